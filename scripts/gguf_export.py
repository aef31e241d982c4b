"""One GGUF file (f16 or q8_0) from a merged llama or qwen2 model, for llama.cpp and Ollama: scripts/merge_adapter.py's
--gguf. Metadata keys and tensor names are llama.cpp's (gguf-py's name map, the keys its convert_hf_to_gguf.py writes);
the tokenizer goes in as llama.cpp's byte-level BPE ("gpt2"): tokens, types, merges, special ids and chat template.
`check_gguf` loads the file back through transformers' GGUF reader and compares logits and token ids.
"""

import json
import math

import gguf
import numpy as np
import torch

from common.errors import ModelError

# transformers model_type -> GGUF general.architecture (llama.cpp's name); anything else is refused before writing
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}
# the relative spacing of the stored values: f16 has 10 mantissa bits; q8_0 stores each block of 32 as int8 steps of
# max|block| / 127, so a value is off by at most half a step
STEP = {"f16": 2.0**-10, "q8_0": 1.0 / 127}
FILE_TYPE = {"f16": 1, "q8_0": 7}  # llama.cpp's LLAMA_FTYPE_MOSTLY_F16 / _Q8_0 (1-D tensors stay f32 in both)
# llama.cpp's token types (llama_token_type): what a token is to its tokenizer
NORMAL = 1
CONTROL = 3
USER_DEFINED = 4
UNUSED = 5


def pre_tokenizer_name(tokenizer) -> str:
    """llama.cpp's tokenizer.ggml.pre for how this byte-level BPE splits text before merging (it picks the regex
    from this name, not from the tokenizer): GPT-2's split, Qwen2's, or SmolLM's (single digits, then GPT-2's)."""
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_SPLIT

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and steps[0].get("pattern", {}).get("Regex") == QWEN2_SPLIT:
        return "qwen2"
    raise ModelError(f"a GGUF export covers GPT-2, SmolLM and Qwen2 byte-level tokenizers; this one splits by {kinds}")


def check_exportable(config) -> str:
    """The GGUF architecture name for this config, or ModelError naming what is not covered."""
    arch = ARCHITECTURES.get(config.model_type)
    if arch is None:
        raise ModelError(
            f"--gguf covers {sorted(ARCHITECTURES)} models; this one is {config.model_type!r} "
            "(use llama.cpp's convert_hf_to_gguf.py on the merged folder)"
        )
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ModelError(f"--gguf: rope scaling {rope.get('rope_type')!r} is not covered")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim * config.num_attention_heads != config.hidden_size:
        raise ModelError("--gguf: head_dim * num_attention_heads != hidden_size is not covered")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise ModelError("--gguf: a llama with attention or MLP biases is not covered")
    if getattr(config, "use_sliding_window", False):
        raise ModelError("--gguf: sliding-window attention is not covered")
    return arch


def rope_theta(config) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def llama_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """HF's q/k rows hold each head's rotary pairs as two halves; llama.cpp's llama kernels want them interleaved
    (the layout of Meta's original checkpoints), so each head's rows go (2, d/2) -> (d/2, 2). transformers' GGUF
    reader undoes exactly this for llama; qwen2 is read as stored."""
    rows = weight.shape[0]
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def encode_tensor(data: np.ndarray, kind: str):
    """(array to write, its GGML type): 1-D tensors (norms, biases) stay f32 as llama.cpp keeps them; 2-D ones
    are f16, or q8_0 where a row splits into whole blocks of 32 (else f16, as llama.cpp's converter falls back)."""
    if data.ndim == 1:
        return data.astype(np.float32), gguf.GGMLQuantizationType.F32
    if kind == "q8_0" and data.shape[-1] % 32 == 0:
        return gguf.quants.quantize(
            data.astype(np.float32), gguf.GGMLQuantizationType.Q8_0
        ), gguf.GGMLQuantizationType.Q8_0
    return data.astype(np.float16), gguf.GGMLQuantizationType.F16


def vocabulary(tokenizer, n_vocab: int) -> tuple[list[str], list[int]]:
    """Tokens by id, as the byte-level vocabulary spells them, and their llama.cpp types; ids past the tokenizer's
    up to the embedding's rows (Qwen pads its matrix) become unused [PAD<id>] tokens, as llama.cpp's converter
    writes them, because llama.cpp requires one token per embedding row."""
    if len(tokenizer) > n_vocab:
        raise ModelError(f"--gguf: the tokenizer has {len(tokenizer)} tokens, the embedding only {n_vocab} rows")
    by_id = {i: token for token, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens = []
    types = []
    for i in range(n_vocab):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif i in added:
            tokens.append(added[i].content)
            types.append(CONTROL if added[i].special else USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(NORMAL)
    return tokens, types


def add_tokenizer(writer, tokenizer, n_vocab: int) -> None:
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    if spec["model"]["type"] != "BPE":
        raise ModelError(f"--gguf covers byte-level BPE tokenizers; this one is {spec['model']['type']}")
    tokens, types = vocabulary(tokenizer, n_vocab)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]  # both tokenizers formats
    writer.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE, whichever model it came with
    writer.add_tokenizer_pre(pre_tokenizer_name(tokenizer))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if tokenizer.bos_token_id is not None:
        writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)  # the trained end of turn: llama.cpp stops generating there
    if tokenizer.pad_token_id is not None:
        writer.add_pad_token_id(tokenizer.pad_token_id)
    if tokenizer.unk_token_id is not None:
        writer.add_unk_token_id(tokenizer.unk_token_id)
    # llama.cpp would otherwise decide for itself whether to put BOS before a prompt; say what this tokenizer does
    adds_bos = tokenizer.bos_token_id is not None and tokenizer("a")["input_ids"][:1] == [tokenizer.bos_token_id]
    writer.add_add_bos_token(adds_bos)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def write_gguf(model, tokenizer, path: str, kind: str, name: str) -> None:
    """Write `model` (a merged, plain transformers llama or qwen2) and its tokenizer to one GGUF file at `path`."""
    config = model.config
    arch = check_exportable(config)
    pre_tokenizer_name(tokenizer)  # refused here, before a byte is written
    names = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), config.num_hidden_layers
    )
    head_dim = config.hidden_size // config.num_attention_heads
    tensors = []
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # llama.cpp reads a missing output.weight as tied to token_embd
        stem, _, suffix = hf_name.rpartition(".")
        gguf_name = names.get_name(stem)
        if gguf_name is None:
            raise ModelError(f"--gguf: no llama.cpp name for tensor {hf_name}")
        data = tensor.detach().to("cpu", torch.float32).numpy()
        if arch == "llama" and stem.endswith("self_attn.q_proj"):
            data = llama_permute(data, config.num_attention_heads)
        if arch == "llama" and stem.endswith("self_attn.k_proj"):
            data = llama_permute(data, config.num_key_value_heads)
        tensors.append((f"{gguf_name}.{suffix}", *encode_tensor(data, kind)))

    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(name)
    writer.add_file_type(FILE_TYPE[kind])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(rope_theta(config))
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config.vocab_size)
    add_tokenizer(writer, tokenizer, config.vocab_size)
    for tensor_name, data, qtype in tensors:
        writer.add_tensor(tensor_name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def rounding_tolerance(logits: torch.Tensor, step: float, layers: int, factor: float = 64) -> float:
    """The |logit| difference that rounding alone stays under: `factor` relative steps of the stored format (eps of
    a dtype, or a quantization step) of the largest |logit|, grown with the square root of the depth as independent
    rounding errors add up layer after layer. docs/usage.md has what merges and exports measured against it."""
    return factor * step * logits.abs().max().item() * math.sqrt(layers)


def check_gguf(folder: str, filename: str, model, tokenizer, ids: torch.Tensor, kind: str, texts: list[str]):
    """Load the GGUF back through transformers (model and tokenizer) and compare with the merged model: (max |logit
    difference| on `ids`, the tolerance for `kind`); ModelError when the tokenizer gives other ids on `texts`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    back_tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    for text in texts:
        want = tokenizer(text, add_special_tokens=False)["input_ids"]
        got = back_tokenizer(text, add_special_tokens=False)["input_ids"]
        if got != want:
            raise ModelError(f"--gguf: the file's tokenizer splits {text[:40]!r} into other ids ({got[:8]}...)")
    back = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32).eval()
    with torch.no_grad():
        want_logits = model(ids.to(model.device)).logits.float().cpu()
        got_logits = back(ids).logits.float()
    diff = (got_logits - want_logits).abs().max().item()
    # Only the weights are rounded here (both sides compute in float32 from the same values, but for the merged
    # model's own dtype), once each, so a smaller factor than a merge's check; a lower --dtype adds its own rounding.
    step = max(STEP[kind], torch.finfo(model.dtype).eps)
    return diff, rounding_tolerance(want_logits, step, model.config.num_hidden_layers, factor=8)

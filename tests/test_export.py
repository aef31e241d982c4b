"""scripts/merge_adapter.py's check (a tolerance that follows the dtype's rounding) and its --gguf export: tiny llama
and qwen2 models built in-process, merged, written as GGUF and read back through transformers' GGUF loader."""

import os

import pytest
import torch
from tokenizers import Regex, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, MistralConfig
from transformers import MistralForCausalLM
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from common.errors import ModelError
from common.model import attach_lora, load_model
from harness.checkpoints import save_weights
from scripts import gguf_export, merge_adapter
from tests.tiny import build_tiny_model, build_tokenizer

CONFIG = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)


def tiny_base(path, arch: str, layers: int = 2, head_scale: float = 1.0) -> str:
    """A random model of `arch` with the ChatML test tokenizer. llama: tied embeddings and 5 embedding rows past
    the tokenizer (the [PAD] tokens llama.cpp needs); qwen2: Qwen2's own pre-tokenizer split. head_scale makes the
    logits as large as a real model's (tens), which is what the merge check's rounding grows with."""
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    if arch == "llama":
        config = LlamaConfig(
            vocab_size=len(tokenizer) + 5, num_hidden_layers=layers, tie_word_embeddings=True, **CONFIG
        )
        model = LlamaForCausalLM(config)
    elif arch == "qwen2":
        model = build_tiny_model(len(tokenizer), layers=layers)
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        model = MistralForCausalLM(MistralConfig(vocab_size=len(tokenizer), num_hidden_layers=layers, **CONFIG))
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    for config in (model.config, model.generation_config):
        config.eos_token_id = tokenizer.eos_token_id
        config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def tiny_adapter(base: str, path, lora_b_std: float = 0.2) -> str:
    """A LoRA on every linear layer with B != 0, saved with the tokenizer as the scripts save final/."""
    torch.manual_seed(0)
    model = attach_lora(load_model(base, "fp32")[0], r=4, alpha=8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, lora_b_std)
    save_weights(model, str(path))
    AutoTokenizer.from_pretrained(base).save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def large_logits(tmp_path_factory):
    """(base, adapter) with logits of a real model's size (max |logit| in the tens) over 4 layers: an fp32 merge of
    this adapter differs from the adapter model by more than the old fixed 1e-4 on x86 (docs/usage.md: figures)."""
    root = tmp_path_factory.mktemp("large_logits")
    base = tiny_base(root / "base", "qwen2", layers=4, head_scale=100.0)
    return base, tiny_adapter(base, root / "final", lora_b_std=0.5)


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_an_ordinary_merge_passes_the_default_check(large_logits, tmp_path, dtype):
    # The default was a fixed 1e-4: an fp32 merge with logits in the tens (SmolLM2 after SFT and DPO) went over it
    # and nothing was written; every bf16 merge failed it. Rounding grows with eps(dtype) and the logits.
    base, adapter = large_logits
    res = merge_adapter.main(
        merge_adapter.Args(adapter=adapter, model=base, out=str(tmp_path / "merged"), dtype=dtype)
    )
    assert os.path.isfile(tmp_path / "merged" / "model.safetensors")
    assert res["max_logit_diff"] <= res["tolerance"] / 4  # the default leaves margin for other kernels
    if dtype == "fp32":  # still far under what a wrong merge moves the logits by (the next test)
        assert res["tolerance"] < 1e-2


@pytest.mark.numerics
def test_a_merge_that_dropped_a_modules_update_is_refused(large_logits, tmp_path, monkeypatch):
    # A merge that is wrong by one module (layer 1's v_proj update left out) must still be refused, in one line
    # that says what to check, and write nothing.
    from peft.tuners.lora import LoraModel

    base, adapter = large_logits
    real_merge = LoraModel.merge_and_unload

    def drop_one_update(self, *args, **kwargs):
        for name, p in self.named_parameters():
            if "layers.1.self_attn.v_proj.lora_B" in name:
                p.data.zero_()
        return real_merge(self, *args, **kwargs)

    monkeypatch.setattr(LoraModel, "merge_and_unload", drop_one_update)
    with pytest.raises(ModelError, match=r"differ .* by .* > --tolerance .*check that --model is the base"):
        merge_adapter.main(merge_adapter.Args(adapter=adapter, model=base, out=str(tmp_path / "merged")))
    assert not (tmp_path / "merged").exists()


def export(tmp_path, arch: str, kind: str) -> tuple[dict, str]:
    base = tiny_base(tmp_path / "base", arch)
    adapter = tiny_adapter(base, tmp_path / "final")
    return merge_adapter.main(merge_adapter.Args(adapter=adapter, model=base, out=str(tmp_path / "merged"), gguf=kind))


@pytest.mark.numerics
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", ["f16", "q8_0"])
def test_gguf_export_loads_back_with_the_merged_models_logits_and_tokens(tmp_path, arch, kind):
    import gguf

    res = export(tmp_path, arch, kind)
    out = res["out"]
    name = f"model-{kind}.gguf"
    assert res["gguf"] == os.path.join(out, name)
    assert not [n for n in os.listdir(out) if n.startswith(".gguf-tmp")]
    reader = gguf.GGUFReader(res["gguf"])
    assert reader.fields["general.architecture"].contents() == arch
    assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert reader.fields["tokenizer.ggml.pre"].contents() == ("gpt-2" if arch == "llama" else "qwen2")
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == kind.upper() and types["blk.0.attn_norm.weight"] == "F32"
    assert ("output.weight" in types) == (arch == "qwen2")  # llama's embeddings are tied: llama.cpp reuses them

    alone = tmp_path / "gguf_alone"  # read beside the merged folder's tokenizer files, those would fill gaps
    alone.mkdir()
    os.link(res["gguf"], alone / name)
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    back = AutoModelForCausalLM.from_pretrained(alone, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    chat = [{"role": "user", "content": merge_adapter.TOKENIZER_TEXTS[1]}, {"role": "assistant", "content": "19"}]
    ids = tokenizer.apply_chat_template(chat, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        want = merged(ids).logits
        got = back(ids).logits
    # Only the weights were rounded, once each, to f16 (eps 2^-10) or q8_0 (steps of max|block|/127); the bound is
    # the one the script checks (8 steps x max|logit| x sqrt(layers)). A missing q/k permutation is off by ~|logit|.
    bound = gguf_export.rounding_tolerance(want, gguf_export.STEP[kind], merged.config.num_hidden_layers, factor=8)
    print(f"{arch} {kind}: max |logit diff| {(got - want).abs().max().item():.3g}, bound {bound:.3g}")
    assert (got - want).abs().max().item() <= bound
    assert bound < 0.2 * want.abs().max().item()

    back_tokenizer = AutoTokenizer.from_pretrained(alone, gguf_file=name)
    for text in merge_adapter.TOKENIZER_TEXTS:
        assert back_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"], text
    assert back_tokenizer.chat_template == tokenizer.chat_template
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert back_tokenizer.eos_token_id == im_end and back.generation_config.eos_token_id == im_end  # stops there


def test_a_gguf_that_does_not_read_back_is_removed_and_the_merged_folder_kept(tmp_path, monkeypatch):
    # llama.cpp's llama wants q/k rows interleaved per head; a file written without that reads back wrong. The
    # check refuses it: no .gguf, no temp folder left, the merged model intact.
    monkeypatch.setattr(gguf_export, "llama_permute", lambda weight, n_head: weight)
    with pytest.raises(ModelError, match=r"model-f16.gguf: its logits .* differ .* not written"):
        export(tmp_path, "llama", "f16")
    out = tmp_path / "merged"
    assert sorted(n for n in os.listdir(out) if "gguf" in n) == []
    AutoModelForCausalLM.from_pretrained(out)


def test_gguf_refuses_another_architecture_by_name_before_writing(tmp_path):
    with pytest.raises(ModelError, match=r"--gguf covers \['llama', 'qwen2'\] models; this one is 'mistral'"):
        export(tmp_path, "mistral", "f16")
    assert not (tmp_path / "merged").exists()

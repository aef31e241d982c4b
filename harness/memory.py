"""Will it fit? A pre-flight estimate of a run's peak memory, by part, from the model's config.json and what the script
declares it runs: its passes over the model (Pass: rows x tokens, with or without grad, how many tokens go through the
output head, a shared prompt's KV cache) and its sampling (Generate), grouped into phases.

Peak = what lives all run (weights, trainable state, an allowance) + the largest phase. Within a phase the passes
run in order: a grad pass keeps its activations until the backward, which starts from the last grad pass (its layer
working set and log-prob buffer come on top of everything held); a no-grad pass needs its working set on top of what
is held when it runs. Per-token activation counts are what autograd saves in transformers' Llama/Qwen2 decoder layer
(checked with saved_tensors_hooks; bench/memory_check.py checks the sums against measured peaks).
"""

import ctypes
import dataclasses
import functools
import json
import math
import os
import sys
import time
import warnings

import torch
from huggingface_hub import try_to_load_from_cache
from transformers import AutoConfig, AutoTokenizer

from common.data import Ids, looks_local, micro_batch, setup_chat_template
from common.completions import TOKENIZE, tokenize_dataset, training_steps
from common.distributed import rank_and_world
from common.errors import ArgsError, ModelError
from common.model import BUCKETS, length_groups, pick_device, resolve_dtype
from harness.cli import flag_name
from harness.hub import check_hub, hub_unreachable
from plugins.embedded import ALIAS_CONFIGS, MARKER, SHIPPED, cache_dir

GiB = 2**30
CHUNK = 1024  # common.model.chunked_logps's default chunk_size (rows of logits per chunk)
CUDA_CONTEXT = GiB // 2  # CUDA context + cuBLAS workspaces, outside torch's allocator (docs/memory.md)
# a CPU process beside its tensors: torch + transformers + peft imported, the tokenizer, Python's objects and the small
# blocks glibc's heap keeps (docs/memory.md: measured at the end of a run, its model freed)
CPU_RUNTIME = int(0.7 * GiB)
ALLOCATOR = 0.10  # caching-allocator fragmentation on top of live tensors (CPU: glibc keeps more, docs/memory.md)
MIN_8BIT = 4096  # bitsandbytes' min_8bit_size: a smaller tensor keeps fp32 moments under --optim adamw_8bit
TOKENIZED_ROWS = 1000  # real lengths: the rows longest in UTF-8 bytes are tokenized, at most this many
DRAWN_ROWS = 20_000  # up to this many rows the plan tokenizes them all and finds the micro-batches the run draws
MMAP_THRESHOLD = 1 << 20  # CPU runs: glibc maps a block from this size that no free heap hole fits (steady_heap)
# a packed CPU rollout: oneDNN and ideep cache a primitive (its JIT kernels) per Linear shape and input row count, each
# up to this many, and this much resident per cached row count of one shape, both caches together (docs/memory.md)
KERNEL_CACHE = 1024
KERNEL_BYTES = int(0.64 * 2**20)
SLOW_STEP_S = 60.0  # a CPU step predicted to take longer than this is named with the settings that take less
RATE_ROWS = 2048  # rows of the matmul that measures this CPU's speed (cpu_matmul_rate)
ROWS_KNOB = "per_device_train_batch_size"  # TRL's rows a micro-batch: the knob whose passes scale with it


@dataclasses.dataclass(frozen=True)
class Pass:
    """One forward over `rows` sequences of `tokens` tokens, and its backward when `grad`. `scored` of the tokens go
    through the output head (chunked log-probs; with `entropy` one more buffer; `vocab=False`: a reward model's
    small head instead, no vocabulary logits). `context`: earlier tokens each row attends to through a KV cache that
    a shared prompt pass filled (grad). `kv_cache`: the pass keeps a KV cache of all its tokens. `padding_mask`:
    sdpa gets a float padding mask (False: right-padded rows, which common.model.sequence_logps runs on the causal
    path without one). `group`: tokens of its largest length group (common.model.sequence_logps runs a padded batch
    group by group, so a layer's backward, and under checkpointing its recomputed activations, hold one group at a
    time); 0: one group of all its tokens. `name` labels a no-grad pass in the plan."""

    rows: int
    tokens: int
    scored: int = 0
    grad: bool = False
    entropy: bool = False
    vocab: bool = True
    context: int = 0
    kv_cache: bool = False
    padding_mask: bool = True
    group: int = 0
    name: str = "no-grad pass"


@dataclasses.dataclass(frozen=True)
class Generate:
    """Sampling `group_size` completions of <= new_tokens tokens for each of `prompts` prompts of <= prompt_tokens:
    a KV cache of every row over all layers, the prompts' prefill working set, and the last position's fp32 logits
    and scores. vllm_share: a vLLM engine that takes this share of the card instead. rollouts: how many the run
    samples (each prefills its prompts at a new row count: rollout_kernels)."""

    prompts: int
    group_size: int
    prompt_tokens: int
    new_tokens: int
    vllm_share: float | None = None
    rollouts: int = 1


@dataclasses.dataclass(frozen=True)
class Trained:
    """What training holds besides activations: LoRA of rank lora_r (None: every weight) with `dropout` active on
    its inputs, `frozen_copies` frozen copies of it (a "ref" slot), on a base of `dtype` ("fp32", "bf16" or "fp16"),
    maybe `quantization`, updated by `optim` ("adamw_torch" or "adamw_8bit")."""

    dtype: str
    quantization: str | None = None
    lora_r: int | None = 16
    dropout: bool = False
    frozen_copies: int = 0
    flash_attention: bool = False
    optim: str = "adamw_torch"
    shards: int = 1  # FSDP2: weights, gradients and AdamW states split over this many ranks


def shipped_only(name: str) -> bool:
    """--model is a hub id whose architecture we ship (SHIPPED) and its config.json can be neither read from the
    cache nor fetched: the plan reads the shipped one."""
    if name not in SHIPPED or os.path.exists(name):
        return False
    return not isinstance(try_to_load_from_cache(name, "config.json"), str) and hub_unreachable() is not None


def model_config(name: str, trust_remote_code: bool = False) -> dict:
    """The architecture fields of --model from its config.json alone (no weights): an embedded alias's are known
    (no cache build), a config.json file is read as it is; a hub id is checked as the model's load checks it
    (offline: the cache, SHIPPED, or one line)."""
    if name in ALIAS_CONFIGS:
        return ALIAS_CONFIGS[name]
    if shipped_only(name):
        return SHIPPED[name]
    if name.endswith(".json") and os.path.isfile(name):
        with open(name) as f:
            config = json.load(f)
        return config.get("text_config") or config  # a multimodal config nests the language model's
    if os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")):
        raise ModelError(f"--model {name}: the folder {name} has no config.json, so it is not a model")
    cached = not os.path.isdir(name) and check_hub(name, "model")  # hub unreachable: read the cached config.json
    config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code, local_files_only=cached)
    return config.get_text_config().to_dict()


def _shape(c: dict):
    """(layers L, hidden H, intermediate F, query width Hq, key/value width K)"""
    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    L, H, F = c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"]
    return L, H, F, c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd


def param_counts(c: dict) -> tuple[int, int]:
    """(parameters inside decoder linear layers, all other parameters): q/k/v/o + gate/up/down per layer, and the
    embedding, the untied head and the RMSNorm weights; Qwen2 has q/k/v biases (attention_bias on Llama)."""
    L, H, F, Hq, K = _shape(c)
    bias = Hq + 2 * K if c.get("attention_bias", c.get("model_type") == "qwen2") else 0
    linear = L * (H * Hq + 2 * H * K + Hq * H + 3 * H * F + bias)
    V = c["vocab_size"]
    return linear, V * H * (1 if c.get("tie_word_embeddings") else 2) + (2 * L + 1) * H


def lora_params(c: dict, r: int) -> int:
    """PEFT all-linear LoRA: r * (in + out) for each of q, k, v, o, gate, up, down (lm_head is never a target)."""
    L, H, F, Hq, K = _shape(c)
    return L * r * ((H + Hq) + 2 * (H + K) + (Hq + H) + 2 * (H + F) + (F + H))


def trained_tensors(c: dict, lora_r: int | None) -> list[tuple[int, int, bool]]:
    """(elements, how many, an nn.Embedding weight) of the tensors the optimizer holds: PEFT's all-linear LoRA A
    (r x in) and B (out x r) of q, k, v, o, gate, up and down in every layer, or every weight of the model."""
    L, H, F, Hq, K = _shape(c)
    if lora_r is not None:
        modules = [(H, Hq), (H, K), (H, K), (Hq, H), (H, F), (H, F), (F, H)]  # (in, out) features
        return [(lora_r * features, L, False) for module in modules for features in module]
    bias = [Hq, K, K] if c.get("attention_bias", c.get("model_type") == "qwen2") else []
    layer = [H * Hq, H * K, H * K, Hq * H, H * F, H * F, F * H, H, H] + bias  # + the two RMSNorm weights
    V = c["vocab_size"]
    head = [] if c.get("tie_word_embeddings") else [(V * H, 1, False)]
    return [(n, L, False) for n in layer] + [(V * H, 1, True), (H, 1, False)] + head  # + the final norm


def adamw_state_bytes(tensors: list[tuple[int, int, bool]], optim: str, b: int) -> int:
    """AdamW's two moments of each trained tensor (trained_tensors). adamw_torch: in the parameter's dtype, `b` bytes
    each (torch.optim.AdamW: zeros_like the parameter). adamw_8bit (plugins.quantization.adamw_8bit): a uint8 code per
    element and an fp32 absmax per 256 elements for each moment; a tensor under MIN_8BIT elements and an nn.Embedding
    weight keep two fp32 moments, whatever the weights' dtype."""
    total = 0
    for n, count, embedding in tensors:
        if optim == "adamw_8bit" and not embedding and n >= MIN_8BIT:
            each = 2 * (n + 4 * -(-n // 256))
        elif optim == "adamw_8bit":
            each = 2 * 4 * n
        else:
            each = 2 * b * n
        total += count * each
    return total


def weight_bytes(c: dict, quantization: str | None, b: int) -> int:
    """bitsandbytes NF4: 4 bits + an 8-bit absmax per 64 weights (+ fp32 per 256 absmax, double quant); int8: 1 byte.
    PEFT's prepare_model_for_kbit_training casts every other (bf16/fp16) parameter to fp32."""
    linear, other = param_counts(c)
    per = {"4bit": 0.5 + 1 / 64 + 4 / (64 * 256), "8bit": 1.0}.get(quantization, b)
    return int(linear * per + other * (4 if quantization else b))


def _layer_act(c: dict, b: int, lora_r: int | None, dropout: bool) -> int:
    """Bytes autograd keeps per token per decoder layer (transformers' Llama/Qwen2 layer, sdpa; checked with
    saved_tensors_hooks): 2 RMSNorm inputs in fp32 (the norm upcasts), 2 normed outputs, q, k, v after RoPE (k, v
    repeated to all heads under a padding mask), the attention output, gate, silu(gate), up and their product.
    LoRA adds lora_B's r-wide input per module, with dropout active also a dropped copy of each module's input and
    its bool mask; full fine-tuning keeps the normalised fp32 rows for the norm weights' gradient instead."""
    L, H, F, Hq, K = _shape(c)
    n = 2 * H * 4 + b * (2 * H + 3 * Hq + Hq + 4 * F)
    if lora_r is None:
        return n + 2 * H * 4
    dropped = (5 * H + Hq + F) * (b + 1) if dropout else 0  # q, k, v, gate, up take H-wide inputs, o Hq, down F
    return n + 7 * lora_r * b + dropped


def _pass_bytes(c: dict, b: int, p: Pass, t: Trained, checkpointing: bool) -> tuple[int, int, int, int]:
    """(kept for backward, one layer's working set, log-prob buffer, the part of that buffer the backward keeps) in
    bytes of one Pass. Under checkpointing the working set holds the recomputed layer too (one length group's: the
    backward recomputes group by group)."""
    L, H, F, Hq, K = _shape(c)
    tokens = p.rows * p.tokens
    group = min(p.group or tokens, tokens)
    mask = 0 if t.flash_attention or not p.padding_mask else p.rows * p.tokens * p.tokens * 4  # sdpa's float mask
    per_token = _layer_act(c, b, t.lora_r, t.dropout)
    kept = 0
    if p.grad:
        # checkpointing keeps each layer's input and recomputes one layer at a time (transformers, per layer)
        kept = L * tokens * H * b if checkpointing else L * (per_token * tokens + mask)
        # attending to a shared prompt: its K and V repeated to all heads, the cache of all layers, the fp32 mask
        n, P, C = p.rows, p.context, p.tokens
        kept += L * n * (P * 2 * Hq * b + (P + C) * 2 * K * b + C * (P + C) * 4) if p.context else 0
    kept += tokens * H * (4 + b) + p.scored * H * b  # final norm in/out + the scored rows gathered for the head
    # a layer's gradients (backward) or its live tensors (no grad), one group at a time; sdpa: the model's own copy of
    # the float mask
    work = group * (2 * H + 3 * F) * b + mask
    if p.grad and checkpointing:
        work += per_token * group + mask
    if p.kv_cache:
        work += L * tokens * 2 * K * b
    if not p.vocab:
        return kept, work, 0, 0
    # chunked_logps: (chunk, V) fp32 logits + softmax (one more with entropy); a bf16 head is cast to fp32 once;
    # with grad, a frozen head's fp32 d logp / d h of the scored rows (kept to backward) and the rows' gradient
    rows = min(CHUNK, p.scored)
    V = c["vocab_size"]
    grad_rows = p.grad * p.scored * H * (4 + b)
    head = (2 + p.entropy) * rows * V * 4 + (b != 4) * V * H * 4 + grad_rows
    return kept, work, head, grad_rows


def _generate_bytes(c: dict, b: int, g: Generate, device_bytes: int, device: str, t: Trained) -> tuple[str, int]:
    """The rollout's memory: the KV cache, the prompts' prefill, the last position's logits and scores; on a CPU in
    fp32 also common.rollout.merged_linears' packed copy of every float32 Linear weight (merged where LoRA): all of
    them, or the head alone when the decoder's linears are quantized (counted on any CPU, although the copy is made
    on x86-64 only: on an ARM CPU the plan is that much too high). A GPU's merged copies: estimate."""
    if g.vllm_share is not None:
        return "vLLM reservation", int(g.vllm_share * device_bytes)
    L, H, F, Hq, K = _shape(c)
    n, G, P, C = g.prompts, g.group_size, g.prompt_tokens, g.new_tokens
    kv = L * n * G * (P + C) * 2 * K * b + n * P * (2 * H + 3 * F) * b
    kv += n * G * c["vocab_size"] * 4 * 2
    quantization = t.quantization
    if device != "cpu" or b != 4:
        return "KV cache", kv
    head = c["vocab_size"] * H * 4
    packed = head if quantization else param_counts(c)[0] * 4 + head
    return "KV cache + packed weights", kv + packed


def rollout_kernels(c: dict, g: Generate, quantization: str | None) -> int:
    """What a CPU float32 rollout on common.rollout.merged_linears leaves cached for the rest of the run: oneDNN's
    and ideep's primitives, one per packed Linear shape (q, k/v, o, gate/up, down, the head; a quantized decoder
    packs the head alone) and input row count, each cache up to KERNEL_CACHE of them. Row counts: the decode's live
    rows (1 .. prompts x group_size, as rows that sampled an EOS leave) and one prefill per rollout."""
    L, H, F, Hq, K = _shape(c)
    bias = bool(c.get("attention_bias", c.get("model_type") == "qwen2"))
    shapes = {(H, c["vocab_size"], False)}
    if not quantization:
        shapes |= {(H, Hq, bias), (H, K, bias), (Hq, H, False), (H, F, False), (F, H, False)}
    row_counts = g.prompts * g.group_size + g.rollouts
    return min(KERNEL_CACHE, len(shapes) * row_counts) * KERNEL_BYTES


def _bucketed(p):
    """A GPU's Pass or Generate: lengths rounded up to common.model.BUCKETS["cuda"], a Pass run as one group."""
    up = lambda n: -(-n // BUCKETS["cuda"]) * BUCKETS["cuda"]  # noqa: E731
    if isinstance(p, Generate):
        return dataclasses.replace(p, prompt_tokens=up(p.prompt_tokens))
    return dataclasses.replace(p, tokens=up(p.tokens), context=up(p.context), group=0)


def estimate(
    c: dict,
    trained: Trained,
    phases: dict[str, list],
    checkpointing: bool = False,
    device: str = "cuda",
    device_bytes: int = 0,
    extra: dict[str, int] | None = None,
) -> dict:
    """Peak memory by part (bytes): the lasting parts (weights, trainable state, `extra` such as a frozen reward
    model, an allowance) and, keyed "<phase>: ...", each phase's; total = lasting + the largest phase + 10 %."""
    b = 4 if trained.dtype == "fp32" else 2  # bf16 / fp16
    linear, other = param_counts(c)
    n = trained.shards
    full_weights = weight_bytes(c, trained.quantization, b)
    parts = {"weights" if n == 1 else f"weights (1/{n} shard)": full_weights // n}
    eight_bit = " 8-bit" if trained.optim == "adamw_8bit" else ""
    states = trained_tensors(c, trained.lora_r)
    if trained.lora_r is not None:  # PEFT keeps adapters in fp32: + an fp32 grad, the optimizer's two moments
        own = lora_params(c, trained.lora_r) * (8 + 4 * trained.frozen_copies)
        parts[f"LoRA + grads + AdamW{eight_bit}"] = own + adamw_state_bytes(states, trained.optim, 4)
    else:  # full fine-tuning: a gradient per weight in the weights' dtype, the optimizer's two moments
        full = (linear + other) * b + adamw_state_bytes(states, trained.optim, b)
        parts[f"grads + AdamW{eight_bit} (full{'' if n == 1 else f', 1/{n} shard'})"] = full // n
    L = _shape(c)[0]
    # FSDP2 gathers a unit's weights while it runs: the root's (embeddings, head, norms) through a pass and two
    # layers at a time (the next one is fetched while one runs); a rollout holds them all (common.distributed.gathered)
    gathered = (other * b + 2 * linear * b // L) if n > 1 else 0
    parts |= {k: v for k, v in (extra or {}).items() if v}
    parts["allowance (runtime)"] = CUDA_CONTEXT if device == "cuda" else CPU_RUNTIME
    if device == "cuda":  # a GPU's passes: lengths rounded up to the bucket, one pass a micro-batch (no groups)
        phases = {phase: [_bucketed(p) for p in passes] for phase, passes in phases.items()}
    peaks = []
    for phase, passes in phases.items():
        held = 0
        peak = 0
        last = None
        for p in passes:
            if isinstance(p, Generate):
                name, size = _generate_bytes(c, b, p, device_bytes, device, trained)
                parts[f"{phase}: {name}"] = size
                merged = 0
                if device == "cuda" and trained.lora_r is not None and not trained.quantization and device_bytes:
                    # merged_linears' copies of the decoder linears, as many as the card has room for beside the rest
                    # (the runtime merges layer by layer while it has room): the total with the 10 % allocator share
                    lasting = sum(v for k, v in parts.items() if ":" not in k)
                    room = (device_bytes + ALLOCATOR * parts["allowance (runtime)"]) / (1 + ALLOCATOR) - lasting
                    merged = int(max(0, min(param_counts(c)[0] * b, room - held - size)))
                    parts[f"{phase}: merged LoRA weights (what fits)"] = merged
                size += merged
                if name.endswith("packed weights"):  # cached after the first rollout: beside every later phase
                    parts["rollout kernels (oneDNN, cached)"] = rollout_kernels(c, p, trained.quantization)
                if n > 1:
                    parts[f"{phase}: gathered weights (FSDP)"] = full_weights - full_weights // n
                    size += full_weights - full_weights // n
                peak = max(peak, held + size)
                continue
            kept, work, head, grad_rows = _pass_bytes(c, b, p, trained, checkpointing)
            if p.grad:
                held += kept
                last = (work, head, grad_rows)
            else:
                parts[f"{phase}: {p.name}"] = work + head
                peak = max(peak, held + work + head)
        if last is not None:  # the backward starts from the last grad pass
            work, head, grad_rows = last
            parts |= {f"{phase}: activations": held, f"{phase}: layer working set": work}
            parts[f"{phase}: log-prob buffer"] = head
            # under checkpointing the head's chunks are freed before the first layer is recomputed, while the rows'
            # d logp / d h (then the gradient that flows down) stays: the larger of the rest counts (measured: the
            # peak of a checkpointed DPO step is its last head forward). Without, both are added: the plan stayed at
            # or above every measured peak so (docs/memory.md)
            top = grad_rows + max(work, head - grad_rows) if checkpointing else work + head
            peak = max(peak, held + top)
        if gathered and any(not isinstance(p, Generate) for p in passes):
            parts[f"{phase}: gathered units (FSDP)"] = gathered
            peak += gathered
        peaks.append(peak)
    lasting = sum(v for k, v in parts.items() if ":" not in k)
    peak = max(peaks, default=0)
    parts = {k: int(v) for k, v in parts.items()}
    parts["allocator (10 %)"] = int(ALLOCATOR * (lasting - parts["allowance (runtime)"] + peak))
    parts["total"] = int(lasting + peak) + parts["allocator (10 %)"]
    return parts


def _size(x) -> int:
    """Tokens of a text (<= its UTF-8 bytes: a byte-level BPE or byte-fallback token covers >= 1) + 16 for the
    chat template; messages: the sum of their contents."""
    if isinstance(x, (str, dict)):
        return len((x if isinstance(x, str) else x.get("content", "")).encode()) + 16
    return sum(map(_size, x)) if isinstance(x, list) else 0


def rows_bytes(rows: list[dict], sample: int = 1000) -> int:
    """Host memory the loaded rows hold: CPython's object sizes, followed through dicts, lists and strings (an object
    shared between rows counted once), over an even sample of `sample` rows scaled to all of them. Python's objects
    cost a multiple of the file's size (per-object headers, a dict per row, every row's "_loc")."""
    if not rows:
        return 0
    picked = rows[:: max(1, len(rows) // sample)]
    return int(_object_bytes(picked, set()) * len(rows) / len(picked)) + sys.getsizeof(rows)


def _object_bytes(objects: list, seen: set) -> int:
    """CPython's sizes of `objects` and of what they hold through dicts, lists and tuples (an array's size includes
    its items), each object once: `seen` holds the ids of those already counted, and gains these."""
    total = 0
    stack = list(objects)
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        total += sys.getsizeof(x)
        if isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return total


def _example(tokenizer, row: dict) -> dict | None:
    """The example common.data.tokenize_dataset builds from a validated row, untruncated (None: a row it drops); with
    no tokenizer, each id array as long as its text's UTF-8 byte bound (_size). A {prompt, completion} row is planned
    as supervised (input_ids + a mask), which holds more than the binary kind's two id arrays."""
    if "chosen" in row:
        kind, fields = "preference", {"prompt_ids": "prompt", "chosen_ids": "chosen", "rejected_ids": "rejected"}
    elif any(k in row for k in ("completion", "messages", "text")):
        kind, fields = "supervised", {"input_ids": ("prompt", "completion", "messages", "text")}
    else:
        kind, fields = "prompt", {"prompt_ids": "prompt"}
    if tokenizer is not None:
        example = TOKENIZE[kind](tokenizer, row, None)
    else:
        sizes = {k: sum(_size(row.get(f)) for f in ([v] if isinstance(v, str) else v)) for k, v in fields.items()}
        example = {k: Ids("i", bytes(4 * n)) for k, n in sizes.items()}
        if kind == "supervised":
            example["completion_mask"] = Ids("b", bytes(sizes["input_ids"]))
    return example and (row if kind == "prompt" else {"_loc": row.get("_loc")}) | example


def examples_bytes(rows: list[dict], tokenizer=None, sample: int = 1000) -> int:
    """Host memory the run's tokenized examples add to the loaded rows (a dict a row, its token ids and masks in C
    arrays; what an example shares with its row, a prompt row's fields, is the rows'): an even sample of `sample`
    rows tokenized as the run does but untruncated (_example), scaled to all of them."""
    if not rows:
        return 0
    picked = rows[:: max(1, len(rows) // sample)]
    seen = set()
    _object_bytes(picked, seen)
    examples = [e for e in (_example(tokenizer, r) for r in picked) if e is not None]
    return int(_object_bytes(examples, seen) * len(rows) / len(picked)) + sys.getsizeof(rows)


def longest_row(rows: list[dict]) -> int:
    """A bound on the longest row in tokens: prompt + the longest of completion / chosen / rejected / messages;
    0 without rows (no bound)."""
    keys = ("completion", "chosen", "rejected", "messages")
    return max((_size(r.get("prompt")) + max(_size(r.get(k)) for k in keys) for r in rows), default=0)


def local_tokenizer(name: str, trust_remote_code: bool = False):
    """--model's tokenizer when it is on this machine (a folder, an embedded alias's built cache, the hub cache), else
    None: a plan never fetches or builds anything for it."""
    folder = name
    if name in ALIAS_CONFIGS:
        folder = str(cache_dir() / "models" / name)
        if not os.path.isfile(os.path.join(folder, MARKER)):  # not converted yet: the run builds it, a plan does not
            return None
    elif not os.path.isdir(name):
        if looks_local(name) or os.path.exists(name):
            return None
        if not isinstance(try_to_load_from_cache(name, "tokenizer_config.json"), str):
            return None
    files = ("tokenizer_config.json", "tokenizer.json")
    if os.path.isdir(folder) and not any(os.path.isfile(os.path.join(folder, f)) for f in files):
        return None
    return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code, local_files_only=True)


def _tokens(tokenizer, row: dict) -> int:
    """A validated row's tokens as the run tokenizes it, untruncated: prompt + the longer of chosen / rejected, prompt
    + completion or the whole chat, or the prompt alone (0: a row the run drops)."""
    if "chosen" in row:
        pair = TOKENIZE["preference"](tokenizer, row, None)
        return len(pair["prompt_ids"]) + max(len(pair["chosen_ids"]), len(pair["rejected_ids"]))
    if any(k in row for k in ("completion", "messages", "text")):
        example = TOKENIZE["supervised"](tokenizer, row, None)
        return len(example["input_ids"]) if example else 0
    return len(TOKENIZE["prompt"](tokenizer, row, None)["prompt_ids"])


def row_tokens(args, rows: list[dict], quiet: bool = False) -> int:
    """Tokens in the longest of `rows` (what a script plans its sequences at, capped by its length limits), printed
    (unless quiet) with how it was found. With --model's tokenizer on this machine (local_tokenizer, --template
    applied): the rows tokenized as the run tokenizes them, the TOKENIZED_ROWS longest in UTF-8 bytes; without it the
    UTF-8 byte bound (longest_row), which on English text is several times the real length. 0 without rows (no
    bound)."""
    if not rows:
        return 0
    tokenizer = local_tokenizer(args.model, args.trust_remote_code)
    if tokenizer is None:
        bound = longest_row(rows)
        if not quiet:
            why = "a bound from UTF-8 bytes (the tokenizer is not on this machine)"
            print(f"row lengths: at most {bound} tokens, {why}")
        return bound
    setup_chat_template(tokenizer, args.template)
    picked = sorted(rows, key=lambda r: longest_row([r]), reverse=True)[:TOKENIZED_ROWS]
    longest = max(_tokens(tokenizer, r) for r in picked)
    which = (
        f"all {len(rows)} rows" if len(picked) == len(rows) else f"the {len(picked)} longest in bytes of {len(rows)}"
    )
    if not quiet:
        print(
            f"row lengths: the longest is {longest} tokens ({which} tokenized with the model's tokenizer)", flush=True
        )
    return longest


def padded_tokens(lengths: list[int], grouped: bool = True) -> tuple[int, int]:
    """(tokens, those of its largest group) a micro-batch of right-padded sequences of `lengths` runs as: in
    common.model.length_groups' groups, each padded to its longest row (`grouped`), or as one batch padded to the
    longest."""
    whole = len(lengths) * max(lengths)
    if not grouped:
        return whole, whole
    mask = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]
    groups = length_groups(mask)
    if groups is None:  # an empty row: the run keeps the one padded batch
        return whole, whole
    sizes = [len(rows) * (end - start) for rows, start, end in groups]
    return sum(sizes), max(sizes)


def batch_tokens(
    args, rows: list[dict], kind: str, sequences, grouped: bool = True, min_rows: int = 1, **kw
) -> tuple[int, int]:
    """The most tokens any micro-batch of this run holds, padded as it runs, and the most of any one length group
    (padded_tokens of the lengths `sequences(example)` lists for its examples), found by tokenizing the rows as the
    run does (tokenize_dataset with --max-length and `kw`: the same rows dropped, the same order) and drawing every
    rank's micro-batches of every step as the run draws them (common.data.micro_batch, `min_rows`). (0, 0) when that
    is not done here: no rows, more than DRAWN_ROWS, or --model's tokenizer not on this machine."""
    if not rows or len(rows) > DRAWN_ROWS:
        return 0, 0
    tokenizer = local_tokenizer(args.model, args.trust_remote_code)
    if tokenizer is None:
        return 0, 0
    setup_chat_template(tokenizer, args.template)
    with warnings.catch_warnings():  # the rows a limit drops: the run says so itself, once
        warnings.simplefilter("ignore")
        examples = tokenize_dataset(tokenizer, rows, kind, args.max_length, **kw)
    if not examples:
        return 0, 0
    bs = args.per_device_train_batch_size
    world = args.plan_world_size or rank_and_world()[1]
    ga = args.gradient_accumulation_steps
    steps, _ = training_steps(len(examples), bs, ga * world, args.max_steps, args.num_train_epochs)
    most = group = 0
    for index in range(steps * ga * world):
        batch = micro_batch(examples, index, bs, args.seed, min_rows=min_rows)
        tokens, largest = padded_tokens([n for e in batch for n in sequences(e)], grouped)
        most, group = max(most, tokens), max(group, largest)
    print(
        f"row lengths: the largest of the run's {steps * ga * world} micro-batches holds {most} tokens, padded as it "
        f"runs (all {len(rows)} rows tokenized with the model's tokenizer)",
        flush=True,
    )
    return most, group


def sequence_tokens(args, rows: list[dict], n: int, kind: str, sequences, **kw) -> tuple[int, int]:
    """(tokens per sequence, tokens of the largest length group) to plan a micro-batch of `n` sequences at: the run's
    largest micro-batch's padded tokens shared out over its n sequences (batch_tokens; activations grow with the
    tokens, not with their split) and its largest group, else the longest row capped by --max-length (row_tokens:
    every sequence as long as the longest) and 0 (Pass.group: one group)."""
    most, group = batch_tokens(args, rows, kind, sequences, **kw)
    if most:
        return -(-most // n), group
    return min(args.max_length, row_tokens(args, rows) or args.max_length), 0


_libc = None  # glibc, once steady_heap has set its heap up (release_heap)


def steady_heap() -> bool:
    """On glibc, serve every block of MMAP_THRESHOLD bytes or more that no free hole of the heap fits with its own
    mmap, given back when freed (one a hole fits goes there: release_heap). glibc's default raises that threshold to
    the largest block freed so far (up to 32 MiB), so a CPU run's activations move into its heap, where freed blocks
    of one step's shapes stay resident beside the next step's: the peak RSS then climbs from step to step past what
    the tensors need (docs/memory.md). False where this is not glibc (another allocator was chosen: it is left
    alone)."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  glibc alone has it
    except (OSError, AttributeError):
        return False
    if os.environ.get("LD_PRELOAD") or os.environ.get("MALLOC_MMAP_THRESHOLD_"):  # the launcher chose: keep it
        return False
    m_mmap_threshold = -3  # malloc.h
    if libc.mallopt(m_mmap_threshold, MMAP_THRESHOLD) != 1:
        raise OSError(f"mallopt(M_MMAP_THRESHOLD, {MMAP_THRESHOLD}) failed")
    global _libc
    _libc = libc  # release_heap trims this heap from now on
    return True


def release_heap() -> bool:
    """Give the pages of glibc's free heap blocks back to the system (malloc_trim), where steady_heap set this
    process's heap up. The heap keeps the holes that freed blocks leave between live ones resident, and blocks of
    MMAP_THRESHOLD or more are placed in those holes before any new mapping: a pass's short-lived blocks wander
    through them, so at the pass's peak RSS holds the whole heap, free holes included (docs/memory.md, the GRPO
    demo). A released page that a later block reuses comes back zeroed on first touch. False where steady_heap did
    not apply (another allocator, a launcher's threshold, a GPU run): nothing is done."""
    if _libc is None:
        return False
    _libc.malloc_trim(0)  # its result only says whether any page went back
    return True


def describe_batch(phases: dict[str, list]) -> str:
    """The shapes a plan assumed, phase by phase: each pass's rows x tokens (and what it is), each rollout's prompts,
    samples and token budgets."""
    said = []
    for phase, passes in phases.items():
        shapes = []
        for p in passes:
            if isinstance(p, Generate):
                budget = f"{p.prompt_tokens} + {p.new_tokens} tokens"
                shapes.append(f"sampling {p.prompts} prompts x {p.group_size}, {budget}")
                continue
            what = "forward + backward" if p.grad else p.name
            after = f" after a {p.context}-token prompt" if p.context else ""
            shapes.append(f"{what} {p.rows} row{'s' * (p.rows != 1)} x {p.tokens} tokens{after}")
        if shapes:
            said.append(f"{phase}: {', then '.join(shapes)}")
    return "; ".join(said)


@functools.cache
def cpu_matmul_rate(hidden: int, intermediate: int, fp32: bool, threads: int) -> float:
    """FLOP/s this CPU gives the model's MLP matmul (RATE_ROWS x hidden @ hidden x intermediate, the run's dtype and
    torch thread count), best of 3 after a warm-up: about 0.1 s. A step's other work (attention's softmax, norms,
    the optimizer, Python) only adds, so a time from it is a floor."""
    dtype = torch.float32 if fp32 else torch.bfloat16
    own = torch.Generator().manual_seed(0)  # not torch's global stream: the run's seeded draws stay as they were
    a = torch.randn(RATE_ROWS, hidden, dtype=dtype, generator=own)
    b = torch.randn(hidden, intermediate, dtype=dtype, generator=own)
    torch.mm(a, b)
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * RATE_ROWS * hidden * intermediate / max(best, 1e-9)


def pass_flops(c: dict, p, full: bool, checkpointing: bool) -> float:
    """Matmul FLOPs of one Pass or Generate: 2 per weight per token through the decoder's linears, causal attention
    (queries x the keys before them, twice: scores and values) and the head for the scored tokens; a backward adds
    the gradient of every input (frozen weights: as much again) and of every weight when all are trained, and
    checkpointing one more forward. A rollout: its prompts' prefill and one token per row per new token."""
    L, H, F, Hq, K = _shape(c)
    linear = param_counts(c)[0]
    V = c["vocab_size"]
    if isinstance(p, Generate):
        rows = p.prompts * p.group_size
        return 2 * linear * p.prompts * p.prompt_tokens + 2 * (linear + V * H) * rows * p.new_tokens
    forward = 2 * linear * p.rows * p.tokens + 2 * L * p.rows * p.tokens * (p.context + p.tokens) * Hq
    forward += 2 * p.scored * (V if p.vocab else 1) * H
    if not p.grad:
        return forward
    return forward * (3 if full else 2) + forward * checkpointing


def si(x: float) -> str:
    """'12.7 T', '49 G', '3 M': three figures at most and a metric prefix, for FLOP counts and rates."""
    for prefix in ("", "k", "M", "G", "T", "P"):
        if abs(x) < 1000 or prefix == "P":
            return f"{x:.3g} {prefix}"
        x /= 1000
    return f"{x:.3g} P"


def step_seconds(c: dict, phases: dict[str, list], full: bool, checkpointing: bool, micro: int, rate: float) -> float:
    """A floor on a CPU step's seconds: the matmul FLOPs of its passes (each micro-batch's, `micro` of them) and its
    rollouts (once) at `rate` FLOP/s."""
    flops = 0.0
    for passes in phases.values():
        for p in passes:
            flops += pass_flops(c, p, full, checkpointing) * (1 if isinstance(p, Generate) else micro)
    return flops / rate


def scaled_phases(phases: dict[str, list], rows: float = 1.0, max_tokens: int = 0, longest: int = 0) -> dict:
    """The passes of a micro-batch with `rows` times the rows, or each sequence cut to max_tokens (--max-length), as
    a bound: fewer rows may pad to a longer row than the run's largest micro-batch did, so their sequences are taken
    as long as `longest` (the longest row, capped by --max-length; 0: unknown, kept as planned), in one length group;
    cut rows are as long as each other, one group too. A plan with the flag draws the micro-batches again."""
    out = {}
    for phase, passes in phases.items():
        out[phase] = []
        for p in passes:
            if isinstance(p, Generate):
                out[phase].append(p)
                continue
            n = max(1, math.ceil(p.rows * rows))
            T = min(p.tokens, max_tokens) if max_tokens else max(p.tokens, 0 if p.context else longest)
            group = p.group if T == p.tokens else 0
            scored = math.ceil(p.scored * n / p.rows * T / p.tokens)
            out[phase].append(dataclasses.replace(p, rows=n, tokens=T, scored=scored, group=min(group, n * T)))
    return out


def cheaper_settings(
    args, knobs, phases, checkpointed, plan, budget: int, checkpointing: bool, slow: bool, longest: int = 0
) -> list[str]:
    """The settings among the script's knobs (`knobs`: (field, least)) that fit the budget, each with its estimated
    plan (`plan(phases, checkpointing, micro-batches a step)` -> (total bytes, a step's seconds or None)): fewer rows
    a micro-batch with as many more accumulated (the same rows a step), shorter sequences (--max-length) and, when
    `slow`, fewer rows a step: each the first halving that fits (when `slow`, that also takes under SLOW_STEP_S, else
    the quickest); then gradient checkpointing (`checkpointed`: its passes) when it is off. longest: the bound
    scaled_phases takes for fewer rows."""
    ga = getattr(args, "gradient_accumulation_steps", None)
    micro = ga or 1
    found = []
    for name, least in knobs:
        value = getattr(args, name, None)
        if not isinstance(value, int) or isinstance(least, str) or value <= least:
            continue
        trials = []  # (kind, flag, passes, micro-batches a step), each kind's halvings in order
        v = value // 2
        while v >= least:
            if name == ROWS_KNOB and ga:
                flag = f"{flag_name(name)} {v} --gradient-accumulation-steps {math.ceil(value * ga / v)}"
                fewer = scaled_phases(phases, v / value, longest=longest)
                trials.append(("the same rows a step", flag, fewer, math.ceil(value * ga / v)))
            if name == ROWS_KNOB and slow:
                fewer = scaled_phases(phases, v / value, longest=longest)
                trials.append(("fewer rows a step", f"{flag_name(name)} {v}", fewer, micro))
            if name == "max_length":
                cut = scaled_phases(phases, max_tokens=v)
                trials.append(("rows past it cut or dropped", f"{flag_name(name)} {v}", cut, micro))
            v //= 2
        picked = {}
        for kind, flag, shrunk, steps in trials:
            total, seconds = plan(shrunk, checkpointing, steps)
            quick = not slow or kind == "the same rows a step" or seconds is None or seconds < SLOW_STEP_S
            if total <= budget and (kind not in picked or not picked[kind][3]):
                picked[kind] = (flag, total, seconds, quick)  # kept once quick; else the next, quicker one
        for kind, (flag, total, seconds, _) in picked.items():
            took = "" if seconds is None else f", {seconds:.0f} s or more a step"
            found.append(f"{flag} ({total / GiB:.1f} GiB{took}; {kind})")
    if not checkpointing:
        total, seconds = plan(checkpointed, True, micro)
        if total <= budget:
            took = "" if seconds is None else f", {seconds:.0f} s or more a step"
            found.append(f"--gradient-checkpointing ({total / GiB:.1f} GiB{took}; one more forward a step)")
    return found


def fit_knob(args, name: str, most: int, plan):
    """args with the micro-batch knob `name` set where it is None: on a GPU (or a plan for a card, --gpu-memory) the
    largest of most, most // 2, ... 1 whose plan(args) fits the card (plan: the script's memory_plan with quiet=True;
    one forward and backward for all of a step's rows when they fit, few large kernels rather than many small ones),
    without gradient checkpointing, or with it where not even 1 fits without (plan_memory then turns it on); 1 on a
    CPU, where smaller passes peak lower and run as fast."""
    if getattr(args, name) is not None:
        return args
    value = 1
    if args.gpu_memory is not None or torch.cuda.is_available():
        for checkpointing in dict.fromkeys([args.gradient_checkpointing, True]):
            trial = dataclasses.replace(args, gradient_checkpointing=checkpointing)
            value = max(most, 1)
            while value > 1 and not plan(dataclasses.replace(trial, **{name: value}))[1]:
                value //= 2
            if plan(dataclasses.replace(trial, **{name: value}))[1]:
                break
    return dataclasses.replace(args, **{name: value})


def suggestion(knobs: list[tuple[str, object, object]], checkpointing: bool) -> str:
    """What to try, in the order the script lists its knobs (name, value, least): an int above `least` is halved;
    a knob left unset (None) whose `least` is a value suggests that value (e.g. quantization 4bit)."""
    tries = [] if checkpointing else ["--gradient-checkpointing"]
    for name, value, least in knobs:
        flag = flag_name(name)
        if value is None and isinstance(least, str):
            tries.append(f"{flag} {least}")
        elif isinstance(value, int) and not isinstance(least, str) and value > least:
            tries.append(f"{flag} {value // 2}")
    return "try " + ", then ".join(tries) if tries else "no knob left: a larger card or a smaller model"


def device_memory(device: str) -> tuple[int, str]:
    """(bytes, description): CUDA: the card's total memory. CPU: physical RAM (MemTotal), the hard ceiling before
    the kernel's OOM killer or swap; MemAvailable would make the same command pass or fail with other processes."""
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return props.total_memory, f"{props.name} total memory"
    with open("/proc/meminfo") as f:
        kib = int(next(line.split()[1] for line in f if line.startswith("MemTotal:")))
    return kib * 1024, "physical RAM (CPU run)"


def format_plan(parts: dict[str, int], budget: int, what: str) -> str:
    """One aligned table in GiB."""
    width = max(map(len, parts)) + 2
    head = (
        "memory plan (peak = the parts without a phase + the largest phase: step, rollout or reference; in a step "
        "the passes run in order and the backward starts from the last; under gradient checkpointing its layer "
        "working set and log-prob buffer are never held at once, so the larger counts):"
    )
    rows = []
    for k, v in parts.items():
        budget_note = f" of {budget / GiB:.1f} GiB {what}" if k == "total" else ""
        rows.append(f"  {k.ljust(width)}{v / GiB:8.2f} GiB{budget_note}")
    return "\n".join([head, *rows])


def plan_memory(
    args,
    phases: dict[str, list],
    *,
    lora: bool = True,
    dropout_off: bool = False,
    frozen_copies: int = 0,
    phases_checkpointed: dict[str, list] | None = None,
    knobs: list[tuple[str, object]] = (),
    extra: dict[str, int] | None = None,
    rows: list[dict] | None = None,
    reference_copy: bool = False,
    quiet: bool = False,
) -> tuple[dict, bool]:
    """Print the plan of what the script declared (`phases`, its training state: LoRA or every weight, dropout off,
    `frozen_copies` of the LoRA such as a "ref" slot, `extra` lasting parts) with the model flags every script has
    (--model, --dtype, --quantization, --lora-r, --lora-dropout, --adapter, --attn-implementation, --optim,
    --gradient-checkpointing, --trust-remote-code); return (parts, gradient checkpointing). A plan over the device's
    memory turns checkpointing on when that makes it fit (TRL's default is on; off is faster where the memory allows
    it; `phases_checkpointed`: the passes under checkpointing, when they differ). A plan that does not fit is refused
    (ArgsError naming the script's `knobs` to try: (flag, least value)) unless --ignore-memory-plan or --plan.
    As the model will load: --dtype auto resolved for this device, and an --adapter's own rank and dropout. The loaded
    `rows`, their tokenized examples (examples_bytes) and a `reference_copy` (a full fine-tune's starting weights kept
    in host memory, common.model.snapshot_ref) are lasting parts on a CPU run (the same RAM); on a GPU they are
    printed as host memory. --gpu-memory N: the plan for a CUDA card of N GiB, on any machine (bf16 under --dtype
    auto, sdpa attention). quiet: nothing printed or refused, checkpointing left as
    given; returns (parts, whether the total fits the device) (fit_knob's question)"""
    card = args.gpu_memory
    if card is not None and not 0 < card <= 2**20:  # 1 PiB: past it int(card * GiB) overflows into Inf
        raise ArgsError(f"--gpu-memory {card}: must be a card's memory in GiB, > 0 and <= {2**20}")
    if card is not None and not args.plan and not torch.cuda.is_available():
        raise ArgsError(f"--gpu-memory {card:g} plans for a CUDA card and this machine has none: add --plan")
    device = "cuda" if card is not None or torch.cuda.is_available() else "cpu"
    budget, what = (int(card * GiB), f"CUDA card (--gpu-memory {card:g})") if card else device_memory(device)
    data = rows_bytes(rows or [])
    tokenizer = local_tokenizer(args.model, args.trust_remote_code) if rows else None
    if tokenizer is not None:
        setup_chat_template(tokenizer, args.template)
    tokens = examples_bytes(rows or [], tokenizer)
    config = model_config(args.model, args.trust_remote_code)
    if shipped_only(args.model) and not quiet:
        print(f"config: {args.model}'s config.json is not here, the hub is out of reach: its shipped architecture")
    on_card = card is not None and not torch.cuda.is_available()  # planned for a card this machine lacks
    dtype = "bf16" if on_card and args.dtype == "auto" else args.dtype
    fp32 = resolve_dtype(dtype, pick_device()) == torch.float32
    world = args.plan_world_size or rank_and_world()[1]  # the plan is one rank's
    copy = weight_bytes(config, None, 4 if fp32 else 2) if reference_copy else 0
    copy //= world if args.fsdp else 1  # FSDP2: each rank keeps its shards of the reference
    if device == "cpu":
        extra = (extra or {}) | {"dataset rows": data, "dataset tokens": tokens, "reference weights (CPU copy)": copy}
    if device == "cpu" and not args.plan and card is None and not quiet:
        steady_heap()  # the plan counts live tensors: RSS follows them only when freed blocks leave it
    lora_r = args.lora_r
    rate = args.lora_dropout
    adapter_config = os.path.join(args.adapter, "adapter_config.json") if args.adapter else None
    if lora and adapter_config and os.path.isfile(adapter_config):
        with open(adapter_config) as f:
            saved = json.load(f)
        lora_r = saved["r"]
        rate = saved.get("lora_dropout", 0.0)
    trained = Trained(
        shards=world if args.fsdp else 1,
        dtype="fp32" if fp32 else "bf16",
        quantization=args.quantization,
        lora_r=lora_r if lora else None,
        dropout=rate > 0 and not dropout_off,
        frozen_copies=frozen_copies,
        flash_attention=args.attn_implementation == "flash_attention_2",
        optim=args.optim,
    )
    checkpointing = args.gradient_checkpointing
    ignore = args.ignore_memory_plan
    declared = phases_checkpointed if checkpointing and phases_checkpointed else phases
    parts = estimate(config, trained, declared, checkpointing, device, budget, extra)
    if quiet:
        return parts, parts["total"] <= budget
    if parts["total"] > budget and not checkpointing and not ignore:
        on = phases_checkpointed or phases
        fits = estimate(config, trained, on, True, device, budget, extra)
        if fits["total"] <= budget:
            print(
                f"gradient checkpointing turned on: without it the plan needs {parts['total'] / GiB:.1f} GiB of the "
                f"{budget / GiB:.1f} GiB {what} (--ignore-memory-plan keeps it off)",
                flush=True,
            )
            parts = fits
            checkpointing = True
    used = phases_checkpointed if checkpointing and phases_checkpointed else phases
    print(f"batch planned: {describe_batch(used)}", flush=True)
    if world > 1:
        sharded = (
            f"weights, gradients and AdamW states 1/{world} each (--fsdp)" if args.fsdp else "a full replica each"
        )
        print(f"memory plan: one of {world} ranks, {sharded}", flush=True)
    print(format_plan(parts, budget, what), flush=True)
    if device != "cpu":
        # the reference is pinned host memory; while it is swapped in, the trained weights wait there too
        host = f"dataset rows {data / GiB:.2f} GiB" + (f" + their tokens {tokens / GiB:.2f} GiB" if tokens else "")
        host += f", reference weights 2 x {copy / GiB:.2f} GiB" if copy else ""
        print(f"  host RAM (not in the total): {host}", flush=True)
    micro = getattr(args, "gradient_accumulation_steps", None) or 1
    rate = None
    if device == "cpu":  # a CPU step's floor from its matmuls at this CPU's measured speed
        L, H, F, Hq, K = _shape(config)
        rate = cpu_matmul_rate(H, F, fp32, torch.get_num_threads())
    full = trained.lora_r is None

    def replan(passes, on: bool, steps: int) -> tuple[int, float | None]:
        total = estimate(config, trained, passes, on, device, budget, extra)["total"]
        return total, None if rate is None else step_seconds(config, passes, full, on, steps, rate)

    seconds = replan(used, checkpointing, micro)[1]
    slow = seconds is not None and seconds > SLOW_STEP_S
    over = parts["total"] > budget and not ignore
    if slow or over:
        checkpointed = phases_checkpointed or phases
        limit = getattr(args, "max_length", 0)  # fewer rows a micro-batch: sequences up to the longest row
        longest = min(limit, row_tokens(args, rows, quiet=True) or limit) if limit else 0
        found = cheaper_settings(args, knobs, used, checkpointed, replan, budget, checkpointing, slow, longest)
        fit = f"settings that fit the {budget / GiB:.1f} GiB, estimated (--plan with one prints its own plan): "
        fit += "; ".join(found) if found else "none among this script's knobs"
    if slow:
        threads = torch.get_num_threads()
        floor = f"{si(seconds * rate)}FLOP of matmuls at {si(rate)}FLOP/s, measured on {threads}"
        print(
            f"slow on this CPU: a step takes {seconds:.0f} s or more ({floor} torch thread(s); {micro} "
            f"micro-batch(es) a step); {fit}",
            flush=True,
        )
    if over and args.plan and not slow:  # (a slow step's line names the same settings)
        print(f"over the {what}: {fit}", flush=True)
    if over and not args.plan:
        if found:
            raise ArgsError(
                f"the memory plan needs {parts['total'] / GiB:.1f} GiB but the {what} is {budget / GiB:.1f} GiB: "
                f"{fit} (or --ignore-memory-plan to start anyway)"
            )
        values = [(name, getattr(args, name), least) for name, least in knobs]
        raise ArgsError(
            f"the memory plan needs {parts['total'] / GiB:.1f} GiB but the {what} is {budget / GiB:.1f} GiB: "
            f"{suggestion(values, checkpointing)} (or --ignore-memory-plan to start anyway)"
        )
    return parts, checkpointing

"""Will it fit? A pre-flight estimate of a run's peak memory, by part, from the model's config.json and the Args.

Peak = what lives all run (weights, trainable state, an allowance) + the largest phase (a training micro-batch, or
a rollout). Per-token activation counts are what autograd saves in transformers' Llama/Qwen2 decoder layer (checked
with saved_tensors_hooks; the bench, bench/memory_check.py, checks the sum against measured peaks).
`python -m common.memory --table --gpu-memory 24 48` prints the capability matrix for Qwen2.5 sizes.
"""

import argparse
import json
import os

GiB = 2**30
SCRIPTS = ("sft", "dpo", "orpo", "kto", "grpo", "raft", "rm")
CHUNK = 1024  # common.logps.chunked_logps's default chunk_size (rows of logits per chunk)
CUDA_CONTEXT = GiB // 2  # CUDA context + cuBLAS workspaces: outside torch's allocator, ~0.3-0.5 GiB on recent cards
CPU_RUNTIME = GiB // 2  # torch + transformers + peft imported: 0.43 GB measured (README, "Where the memory goes")
ALLOCATOR = 0.10  # caching-allocator fragmentation on top of live tensors (CPU: glibc keeps more, see README)

# Qwen2.5 config.json architecture fields (Qwen/Qwen2.5-*B); the 7B and 14B have a 152,064-row untied head.
QWEN25 = {
    "0.5B": dict(num_hidden_layers=24, hidden_size=896, intermediate_size=4864, num_attention_heads=14),
    "1.5B": dict(num_hidden_layers=28, hidden_size=1536, intermediate_size=8960, num_attention_heads=12),
    "3B": dict(num_hidden_layers=36, hidden_size=2048, intermediate_size=11008, num_attention_heads=16),
    "7B": dict(num_hidden_layers=28, hidden_size=3584, intermediate_size=18944, num_attention_heads=28),
    "14B": dict(num_hidden_layers=48, hidden_size=5120, intermediate_size=13824, num_attention_heads=40),
}
for _size, _c in QWEN25.items():  # all: Qwen2 (q/k/v biases); 2 kv heads below 7B; 4 (7B), 8 (14B)
    _c.update(model_type="qwen2", vocab_size=152064 if _size in ("7B", "14B") else 151936)
    _c.update(tie_word_embeddings=_c["vocab_size"] == 151936, num_key_value_heads={"7B": 4, "14B": 8}.get(_size, 2))
# The embedded smollm2-135m (SmolLM2-135M-Instruct's config.json): known here, so --plan never builds its cache.
EMBEDDED = {
    "smollm2-135m": dict(
        model_type="llama", num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
    )
}  # fmt: skip


def model_config(name: str, trust_remote_code: bool = False) -> dict:
    """The architecture fields of --model from its config.json alone (no weights): the embedded alias's are written
    above (no cache build); a hub id is checked as load_model checks it (offline: the cache, or one line)."""
    if name in EMBEDDED:
        return EMBEDDED[name]
    from transformers import AutoConfig

    from common.hub import check_hub
    from common.model import ModelError

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


def weight_bytes(c: dict, quantization: str | None, b: int) -> int:
    """bitsandbytes NF4: 4 bits + an 8-bit absmax per 64 weights (+ fp32 per 256 absmax, double quant); int8: 1 byte.
    PEFT's prepare_model_for_kbit_training casts every other (bf16/fp16) parameter to fp32."""
    linear, other = param_counts(c)
    per = {"4bit": 0.5 + 1 / 64 + 4 / (64 * 256), "8bit": 1.0}.get(quantization, b)
    return int(linear * per + other * (4 if quantization else b))


def reward_model_bytes(c: dict, args, b: int) -> int:
    """A `--rewards model:<dir>` (common.reward_model.load_reward): its LoRA as a frozen fp32 slot on the policy's
    base, or, on another base, that base (dtype auto, quantized as trained) + its LoRA, loaded apart."""
    specs = [s for s in getattr(args, "rewards", None) or [] if s.startswith("model:")]
    if not specs:
        return 0
    from common.model import same_base
    from common.reward_model import read_config
    from common.rewards import split_weight

    path = split_weight(specs[0].removeprefix("model:"))[0].partition("@")[0]  # one reward-model directory per run
    config = read_config(path)
    with open(os.path.join(path, "adapter_config.json")) as f:
        r = json.load(f)["r"]
    if same_base(config["base_model"], args.model):
        return lora_params(c, r) * 4
    other = model_config(config["base_model"])
    return weight_bytes(other, config.get("quantization"), b) + lora_params(other, r) * 4


def _layer_act(c: dict, b: int, lora: bool, dropout: bool, r: int) -> int:
    """Bytes autograd keeps per token per decoder layer (transformers' Llama/Qwen2 layer, sdpa; checked with
    saved_tensors_hooks): 2 RMSNorm inputs in fp32 (the norm upcasts), 2 normed outputs, q, k, v after RoPE (k, v
    repeated to all heads under a padding mask), the attention output, gate, silu(gate), up and their product.
    LoRA adds lora_B's r-wide input per module, with lora_dropout > 0 also a dropped copy of each module's input and
    its bool mask; full fine-tuning keeps the normalised fp32 rows for the norm weights' gradient instead."""
    L, H, F, Hq, K = _shape(c)
    n = 2 * H * 4 + b * (2 * H + 3 * Hq + Hq + 4 * F)
    # dropout copies: q, k, v, gate, up take H-wide inputs, o Hq, down F
    return n + (7 * r * b + (dropout and (5 * H + Hq + F) * (b + 1)) if lora else 2 * H * 4)


def _pass(c: dict, b: int, rows: int, seq: int, scored: int, args, grad: bool, entropy: bool = False):
    """(kept for backward, one layer's working set, log-prob buffer) in bytes for a forward (+ backward if grad) over
    rows x seq tokens, `scored` of them through the chunked head. No grad keeps nothing but the working set."""
    L, H, F, Hq, K = _shape(c)
    lora, tokens = getattr(args, "use_lora", True), rows * seq
    dropout = lora and getattr(args, "lora_dropout", 0) > 0 and not getattr(args, "disable_dropout", False)
    mask = 0 if getattr(args, "attn_implementation", "") == "flash_attention_2" else rows * seq * seq * 4
    layer = _layer_act(c, b, lora, dropout, getattr(args, "lora_r", 16)) * tokens + mask  # sdpa keeps a float mask
    # checkpointing keeps each layer's input and recomputes one layer at a time (transformers, per decoder layer)
    kept = (L * tokens * H * b + layer if getattr(args, "gradient_checkpointing", 0) else L * layer) if grad else 0
    kept += tokens * H * (4 + b) + scored * H * b  # final norm in/out + the scored rows gathered for the head
    # a layer's gradients (backward) or its live tensors (no grad); sdpa: the model's own copy of the float mask
    work = tokens * (2 * H + 3 * F) * b + mask
    # chunked_logps: (chunk, V) fp32 logits + softmax (one more with entropy); a bf16 head is cast to fp32 once;
    # backward allocates the hidden rows' gradient
    n, V = min(CHUNK, scored), c["vocab_size"]
    return kept, work, (2 + entropy) * n * V * 4 + (b != 4) * V * H * 4 + grad * scored * H * b


def estimate(c: dict, args, script: str, device: str = "cuda", device_bytes: int = 0, longest: int = 0) -> dict:
    """Peak memory by part (bytes), keys prefixed by phase: lasting parts, "step:" (one training micro-batch),
    "rollout:" and "reference:" (GRPO's no-grad passes before the update). total = lasting + the largest phase; in
    a step the reference pass (DPO, KTO) and the backward's working set come one after the other.
    longest: a bound on the longest row in tokens (0 = none), which caps max_length and max_prompt_length."""
    if script not in SCRIPTS:
        raise ValueError(f"memory plan: unknown script {script!r}; known: {', '.join(SCRIPTS)}")
    q, (L, H, F, Hq, K), (linear, other) = getattr(args, "quantization", None), _shape(c), param_counts(c)
    b = 4 if args.dtype == "fp32" or (args.dtype == "auto" and device == "cpu") else 2  # auto: bf16 on CUDA only
    ref = {"dpo": getattr(args, "loss_type", "") != "simpo", "kto": True, "grpo": getattr(args, "beta", 0) != 0}
    ref["raft"] = getattr(args, "dpo", False) or getattr(args, "mode", "") == "spin"  # scripts with a "ref" slot
    parts = {"weights": weight_bytes(c, q, b)}
    if getattr(args, "use_lora", True):  # PEFT keeps adapters in fp32: + fp32 grad, AdamW exp_avg and exp_avg_sq
        parts["LoRA + grads + AdamW"] = lora_params(c, args.lora_r) * (16 + 4 * ref.get(script, False))  # + "ref"
    else:  # full fine-tuning: a gradient and two AdamW states per weight, in the weights' dtype (torch.optim.AdamW)
        parts["grads + AdamW (full)"] = (linear + other) * 3 * b
    if reward := reward_model_bytes(c, args, 4 if device == "cpu" else 2):  # load_reward's dtype: auto
        parts["reward model (frozen)"] = reward
    parts["allowance (runtime)"] = CUDA_CONTEXT if device == "cuda" else CPU_RUNTIME
    cap, C = longest or 1 << 40, getattr(args, "max_completion_length", 0)
    P = min(getattr(args, "max_prompt_length", None) or 1 << 40, cap)
    T = min(getattr(args, "max_length", 1024), P + C if script == "raft" else cap)  # raft: prompt + a sample
    pairs = script in ("dpo", "orpo") or getattr(args, "dpo", 0)  # chosen + rejected in one batch
    pairs = pairs or (script == "rm" and getattr(args, "loss_type", "") != "regression")  # regression: rows
    rows, ref_pass, rollout = getattr(args, "per_device_train_batch_size", 1) * (1 + pairs), 0, {}
    kept, work, head = _pass(c, b, rows, T, rows * T, args, True)
    head *= script != "rm"  # a reward model's head is H -> 1: no vocabulary logits
    # DPO's and KTO's reference (and KTO's KL rows): a no-grad pass over the same rows
    if (script in ("dpo", "kto") or getattr(args, "dpo", 0)) and not getattr(args, "precompute_ref_log_probs", 0):
        ref_pass = sum(_pass(c, b, rows, T, rows * T, args, False)[1:]) if ref.get(script) else 0
    if script in ("grpo", "raft") and getattr(args, "engine", "hf") == "vllm":  # vLLM takes this share of the card
        rollout["rollout: vLLM reservation"] = int(args.vllm_gpu_memory_utilization * device_bytes)
    elif script in ("grpo", "raft"):  # HF: a KV cache of every row (prompts x G) x (P + C) positions, all layers,
        # + the prompts' prefill working set and the last position's fp32 logits and scores; raft: a slice of the round
        n = args.prompts_per_step if script == "grpo" else min(args.prompts_per_round, args.generation_batch_size)
        rollout["rollout: KV cache"] = L * n * args.group_size * (P + C) * 2 * K * b + n * P * (2 * H + 3 * F) * b
        rollout["rollout: KV cache"] += n * args.group_size * c["vocab_size"] * 4 * 2
    if script == "grpo":  # a micro-batch: each prompt once + its G completions attending to it (logps.py)
        g, G = args.groups_per_micro_batch, args.group_size
        if args.gradient_checkpointing:  # then grouped_completion_logps scores the concatenated rows instead
            kept, work, head = _pass(c, b, g * G, P + C, g * G * C, args, True, entropy=True)
        else:  # + the repeated prompt K, V (all heads) its attention keeps, the cache of all layers and the mask
            kept, work, head = _pass(c, b, g * G, C, g * G * C, args, True, entropy=True)
            kept += _pass(c, b, g, P, 0, args, True)[0]
            kept += L * g * G * (P * 2 * Hq * b + (P + C) * 2 * K * b + C * (P + C) * 4)
        if args.beta or args.num_iterations > 1:  # reference / old-policy log-probs: no_grad, before the update;
            no_grad = sum(_pass(c, b, g * G, P + C, g * G * C, args, False)[1:])  # + its KV cache
            rollout["reference: no-grad pass"] = no_grad + L * g * G * (P + C) * 2 * K * b
    parts |= {"step: activations": kept, "step: layer working set": work, "step: log-prob buffer": head}
    parts |= ({"step: reference pass": ref_pass} if ref_pass else {}) | rollout
    lasting = sum(v for k, v in parts.items() if ":" not in k)
    step = kept + max(work + head, ref_pass)  # kto.py, raft.py: the reference pass runs while the graph is held
    if script == "dpo":  # dpo.py runs it before the policy's forward, so it never coexists with the graph
        step = max(kept + work + head, ref_pass)
    peak = max([step, *rollout.values()])
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


def longest_row(rows: list[dict]) -> int:
    """A bound on the longest row in tokens: prompt + the longest of completion / chosen / rejected / messages."""
    keys = ("completion", "chosen", "rejected", "messages")
    return max((_size(r.get("prompt")) + max(_size(r.get(k)) for k in keys) for r in rows), default=0)


def suggestion(args, script: str) -> str:
    """Knobs in order of what they cost the run (speed first, then quality of the experiment)."""
    knobs = [] if getattr(args, "gradient_checkpointing", True) else ["--gradient-checkpointing"]
    halve = {"generation_batch_size": 1, "per_device_train_batch_size": 1, "groups_per_micro_batch": 1}
    halve |= {"quantization": 0}
    if getattr(args, "generation_batch_size", 0) >= getattr(args, "prompts_per_round", 0):  # raft: one call already
        halve.pop("generation_batch_size")
    halve |= {"max_completion_length": 64, "max_length": 64, "group_size": 2}  # flag: the least worth halving to
    for name, least in halve.items():
        if name == "quantization" and getattr(args, name, 0) is None:
            knobs.append("--quantization 4bit")
        elif name != "quantization" and getattr(args, name, 0) and getattr(args, name) > least:
            knobs.append(f"--{name.replace('_', '-')} {getattr(args, name) // 2}")
    return "try " + ", then ".join(knobs) if knobs else "no knob left: a larger card or a smaller model"


def device_memory(device: str) -> tuple[int, str]:
    """(bytes, description): CUDA: the card's total memory. CPU: physical RAM (MemTotal), the hard ceiling before
    the kernel's OOM killer or swap; MemAvailable would make the same command pass or fail with other processes."""
    if device == "cuda":
        import torch

        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return props.total_memory, f"{props.name} total memory"
    with open("/proc/meminfo") as f:
        kib = int(next(line.split()[1] for line in f if line.startswith("MemTotal:")))
    return kib * 1024, "physical RAM (CPU run)"


def format_plan(parts: dict[str, int], budget: int, what: str) -> str:
    """One aligned table in GiB."""
    width, head = max(map(len, parts)) + 2, "memory plan (peak = the parts without a phase + the largest phase:"
    rows = [f"  {k.ljust(width)}{v / GiB:8.2f} GiB" + (f" of {budget / GiB:.1f} GiB {what}" if k == "total" else "")
            for k, v in parts.items()]  # fmt: skip
    return "\n".join([head + " step, rollout or reference; in a step the reference pass and the backward's working"
                      " set take turns):", *rows])  # fmt: skip


def check_memory(args, script: str, rows: list[dict] | None = None):
    """Print the plan and return the args the run starts with; on --plan exit 0 (no weights loaded). A plan over the
    device's memory turns gradient checkpointing on when that makes it fit (TRL's default is on; off is faster where
    the memory allows it), else it is refused. rows (the training rows, optional) bound the sequence lengths below
    max_length when they are all shorter."""
    import dataclasses

    import torch

    from common.model import resolve_dtype
    from common.run import ArgsError

    device = "cuda" if torch.cuda.is_available() else "cpu"
    budget, what = device_memory(device)
    cfg = model_config(args.model, getattr(args, "trust_remote_code", False))
    longest = longest_row(rows or [])
    # As load_policy builds it: --dtype auto resolved (fp32 on a CPU or a CUDA card without bf16, e.g. V100, T4), and
    # an --adapter's own rank and dropout (sft.py's r 64 adapter is r 64 in dpo.py, whatever --lora-r says)
    over = {"dtype": "fp32" if resolve_dtype(args.dtype, torch.device(device)) == torch.float32 else "bf16"}
    if (path := getattr(args, "adapter", None)) and os.path.isfile(path := os.path.join(path, "adapter_config.json")):
        with open(path) as f:
            lora = json.load(f)
        over |= {"lora_r": lora["r"], "lora_dropout": lora.get("lora_dropout", 0.0)}
    parts = estimate(cfg, dataclasses.replace(args, **over), script, device, budget, longest)
    ignore = getattr(args, "ignore_memory_plan", False)
    if parts["total"] > budget and not args.gradient_checkpointing and not ignore:
        checkpointed = dataclasses.replace(args, gradient_checkpointing=True)
        fits = estimate(cfg, dataclasses.replace(checkpointed, **over), script, device, budget, longest)
        if fits["total"] <= budget:
            print(f"gradient checkpointing turned on: without it the plan needs {parts['total'] / GiB:.1f} GiB of the "
                  f"{budget / GiB:.1f} GiB {what} (--ignore-memory-plan keeps it off)", flush=True)  # fmt: skip
            args, parts = checkpointed, fits
    print(format_plan(parts, budget, what), flush=True)
    if getattr(args, "plan", False):
        raise SystemExit(0)
    if parts["total"] > budget and not ignore:
        raise ArgsError(
            f"the memory plan needs {parts['total'] / GiB:.1f} GiB but the {what} is {budget / GiB:.1f} GiB: "
            f"{suggestion(args, script)} (or --ignore-memory-plan to start anyway)"
        )
    return args


TABLE_NOTE = (
    " cards it fits, (no) = none. bf16, LoRA r 16 all-linear, gradient checkpointing on, sdpa. SFT: 2 rows x 1,024 "
    "tokens; ORPO/DPO: 2 pairs x 1,024 tokens; GRPO: 8 prompts x G 4, prompts <= 256 and completions <= 512 tokens, "
    "HF rollout, 1 group per micro-batch, beta 0.04. n/a: dpo.py and grpo.py train LoRA only (reference = a slot)."
)


def capability_table(gpu_gib: list[float]) -> str:
    """Qwen2.5 sizes x methods x (bf16 full, bf16 LoRA, 4-bit QLoRA) on a CUDA card, bf16, HF rollouts."""
    from types import SimpleNamespace as NS

    base = dict(dtype="bf16", lora_r=16, lora_dropout=0.05, gradient_checkpointing=True, max_length=1024)
    base |= dict(per_device_train_batch_size=2, disable_dropout=True, precompute_ref_log_probs=False, loss_type="")
    grpo = dict(group_size=4, prompts_per_step=8, groups_per_micro_batch=1, max_prompt_length=256, beta=0.04)
    grpo |= dict(max_completion_length=512, num_iterations=1, disable_dropout=False)
    variants = {"bf16 full": dict(use_lora=False), "bf16 LoRA": {}, "QLoRA 4-bit": dict(quantization="4bit")}
    methods = {"SFT": "sft", "ORPO": "orpo", "DPO": "dpo", "GRPO G=4": "grpo"}
    lines = ["| model | weights, training | " + " | ".join(methods) + " |", "|---|---|" + "---:|" * len(methods)]

    def cell(c: dict, script: str, v: dict) -> str:
        if "use_lora" in v and script in ("dpo", "grpo"):  # their reference is a LoRA slot
            return "n/a"
        gib = estimate(c, NS(**base | (grpo if script == "grpo" else {}) | v), script, "cuda")["total"] / GiB
        return f"{gib:.1f}" + (f" ({min(g for g in gpu_gib if gib <= g):g})" if gib <= max(gpu_gib) else " (no)")

    for size, c in QWEN25.items():
        for name, v in variants.items():
            lines.append(f"| Qwen2.5-{size} | {name} | " + " | ".join(cell(c, s, v) for s in methods.values()) + " |")
    sizes = ", ".join(map("{:g}".format, gpu_gib))
    return "\n".join(lines) + f"\n\nGiB estimated; (N) = the smallest of {sizes} GiB" + TABLE_NOTE


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m common.memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", action="store_true", required=True, help="the Qwen2.5 capability matrix (a run's own"
                    " plan: python sft.py --plan)")  # fmt: skip
    ap.add_argument("--gpu-memory", type=float, nargs="+", default=[24.0, 48.0], help="card sizes in GiB")
    print(capability_table(ap.parse_args().gpu_memory))

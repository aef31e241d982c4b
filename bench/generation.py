"""Generation against its floor: one GRPO rollout's shapes through the HF engine's decode loop (common.rollout.decode:
on a GPU static shapes and the step captured as a CUDA graph, on a CPU rows dropped as they end), transformers'
model.generate (the engine before issue #30), the loop on the model's own forward every step instead of decoder_step
(for the model types that have it), the loop without its merged weights (PEFT's unmerged LoRA; on a CPU each layer's
own forward: MKL's matmuls), on a GPU the loop without the CUDA graph (the same kernels launched from Python) and
with a CPU's shapes, and, where vllm is installed, the vLLM engine; and that rollout's floor on the machine it runs
on. Each row also gives the milliseconds a decode step (the rollout over its longest completion) and, on a GPU, the
host syncs of a rollout (torch.cuda.set_sync_debug_mode).

Floor: each decode step must read every weight it uses once (the parameters' bytes; a tied head counted once) and
the live rows' KV cache, and do 2 FLOPs per weight per live row plus attention's 4 x layers x heads x head_dim x
context; its floor is max(bytes / read bandwidth, FLOPs / matmul throughput), both measured here (best of 5 sums of a
1 GiB tensor; best of 5 square matmuls, 2048 on a CPU, 8192 on a GPU, in the run's dtype). Summed over the steps with
each step's live rows taken from our loop's own completion lengths, plus the prefill (each distinct prompt once:
FLOPs, or one read of the weights, whichever is longer). Times: on a CPU the process's CPU seconds
(time.process_time, steadier than wall time on a shared machine), on CUDA synchronised wall seconds; best of
--repeats for each engine, run alternately; the first rollout of each (capture, kernel selection) is not counted.

    OMP_NUM_THREADS=1 python bench/generation.py     # SmolLM2-135M + LoRA r16, 4 builtin math prompts x G 4, 64 tokens
    python bench/generation.py --qwen-shapes --dtype bf16 --prompts 8 --group-size 4 --tokens 512
"""

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import time
import unittest.mock

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.headline_cpu import host_syncs
from common.data import load_rows, pad_batch, setup_chat_template
from common.completions import tokenize_dataset
from common.model import attach_lora, load_model, unwrap
import common.rollout as rollout
from common.rollout import DECODER_STEP_MODELS, _model_generate, eos_ids, hf_generate
from plugins.builtin_math import builtin_rows


def clock(device):
    """Seconds so far: the process's CPU time on a CPU, wall time after a sync on CUDA."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.process_time()


def best_of(fn, device, n=5) -> float:
    times = []
    for _ in range(n):
        start = clock(device)
        fn()
        times.append(clock(device) - start)
    return min(times)


def machine(device, dtype) -> dict:
    """Measured read bandwidth (bytes/s) and matmul throughput (FLOP/s) of this device, in the run's dtype."""
    big = torch.ones(2**28, dtype=torch.float32, device=device)  # 1 GiB: far beyond any cache
    bandwidth = big.numel() * 4 / best_of(big.sum, device)
    size = 8192 if device.type == "cuda" else 2048
    a = torch.randn(size, size, dtype=dtype, device=device)
    flops = 2 * size**3 / best_of(lambda: a @ a, device)
    return {"bandwidth_gb_s": bandwidth / 1e9, "matmul_gflop_s": flops / 1e9}


def floor_seconds(model, prompts, group_size, lengths, speed) -> float:
    """The rollout's floor (module docstring): per-step max(bytes / bandwidth, FLOPs / throughput), summed."""
    lm = unwrap(model)
    cfg = lm.config
    size = next(model.parameters()).element_size()
    embed = lm.get_input_embeddings().weight
    tied = embed is lm.get_output_embeddings().weight
    params = sum(p.numel() for p in model.parameters() if tied or p is not embed)  # lookups read a few rows only
    matmul_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", heads)
    layers = cfg.num_hidden_layers
    bandwidth = speed["bandwidth_gb_s"] * 1e9
    throughput = speed["matmul_gflop_s"] * 1e9
    prompt = sum(map(len, prompts)) / len(prompts)
    total = max(params * size / bandwidth, 2 * matmul_params * sum(map(len, prompts)) / throughput)
    for k in range(max(lengths)):
        rows = sum(n > k for n in lengths)
        context = prompt + k
        kv_bytes = rows * layers * 2 * kv_heads * head_dim * context * size
        flops = 2 * matmul_params * rows + 4 * rows * layers * heads * head_dim * context
        total += max((params * size + kv_bytes) / bandwidth, flops / throughput)
    return total


def setup(args, device, dtype):
    """(model, tokenizer, prompts): SmolLM2-135M (or Qwen2.5-1.5B's shapes, random) with a LoRA adapter whose B is
    not 0 (a trained adapter's cost), and the first --prompts built-in math prompts."""
    torch.manual_seed(0)  # the LoRA's A init: the same policy in every run
    if args.qwen_shapes:
        from bench.qwen_shapes import QWEN25_15B, TINY, build_random_qwen

        model, tokenizer = build_random_qwen(TINY if args.tiny else QWEN25_15B, dtype=dtype, device=str(device))
    else:
        from harness.hub import locate_model

        model, tokenizer = load_model(args.model, dtype=args.dtype, path=locate_model(args.model))
    setup_chat_template(tokenizer, "auto")
    model = attach_lora(model, r=16, alpha=32, dropout=0.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01, generator=torch.Generator(device=p.device).manual_seed(0))
    rows = load_rows("builtin:math", "train", builtin=builtin_rows)[: args.prompts]
    prompts = [e["prompt_ids"] for e in tokenize_dataset(tokenizer, rows, "prompt", 512)]
    return model, tokenizer, prompts


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--qwen-shapes", action="store_true", help="random Qwen2.5-1.5B shapes (bench/qwen_shapes.py)")
    parser.add_argument("--tiny", action="store_true", help="with --qwen-shapes: the cut-down shapes (dry runs)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--only", nargs="*", default=None, help="these engines (names as in the table) only")
    parser.add_argument("--json", default=None)
    parser.add_argument("--md", default=None, help="also write the table to this Markdown file")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model, tokenizer, prompts = setup(args, device, dtype)
    G = args.group_size
    sampling = dict(temperature=args.temperature, top_p=1.0, top_k=0)
    rows = [p for p in prompts for _ in range(G)]
    pad = tokenizer.pad_token_id
    input_ids = pad_batch(rows, pad, side="left").to(device)
    attention_mask = pad_batch([[1] * len(r) for r in rows], 0, side="left").to(device)
    eos = eos_ids(model, tokenizer)
    model.eval()

    def generate():
        with torch.no_grad():
            return _model_generate(model, tokenizer, input_ids, attention_mask, G, eos, args.tokens, sampling)

    def ours(swapped=(), **kw):  # swapped: (name, stand-in) of common.rollout's functions for this run
        with contextlib.ExitStack() as stack:
            for name, stand_in in swapped:
                stack.enter_context(unittest.mock.patch.object(rollout, name, stand_in))
            return hf_generate(model, tokenizer, prompts, G, **sampling, max_new_tokens=args.tokens, **kw)

    engines = {"model.generate": generate, "decode": ours}
    if device.type == "cuda":  # the same loop's kernels launched from Python every step; a CPU's shapes
        engines["decode, no CUDA graph"] = lambda: ours(cuda_graph=False)
        engines["decode, a CPU's shapes"] = lambda: ours(static=False)
    if unwrap(model).config.model_type in DECODER_STEP_MODELS:  # the same loop on the model's forward every step
        engines["decode, model forward"] = lambda: ours([("decoder_step", rollout._last_logits)])
    # PEFT's LoRA forward (a CPU: MKL's matmuls too)
    engines["decode, unmerged"] = lambda: ours([("merged_linears", lambda *a: contextlib.nullcontext())])
    if args.only:
        engines = {n: fn for n, fn in engines.items() if n in args.only or n in ("decode", "model.generate")}
    results = {}
    failed = {}
    for name, fn in list(engines.items()):  # warm-up (capture, kernel selection), and a failure is a finding
        try:
            torch.manual_seed(0)
            fn()
        except Exception as e:
            failed[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
            del engines[name]
    results |= failed
    if importlib.util.find_spec("vllm") is None:
        results["vllm"] = "not installed"
    else:
        from plugins.vllm_engine import VLLMEngine

        path = args.model if not args.qwen_shapes else None
        if path is None:
            results["vllm"] = "needs a model on disk (not --qwen-shapes)"
        else:
            engine = VLLMEngine(path, model, tokenizer, 0.3, 512 + args.tokens, dtype, None, 0, 0.1)
            engines["vllm"] = lambda: engine.generate(prompts, G, max_new_tokens=args.tokens, **sampling)
    torch.manual_seed(0)
    lengths = [len(c) for c in engines["decode"]()["completion_ids"]]  # the live rows per step
    syncs = {name: host_syncs(fn) for name, fn in engines.items()}  # the same seed's rollout: lengths as timed
    times = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, fn in engines.items():
            torch.manual_seed(0)
            start = clock(device)
            fn()
            times[name].append(clock(device) - start)
    speed = machine(device, dtype)
    floor = floor_seconds(model, prompts, G, lengths, speed)
    unit = "CPU s" if device.type == "cpu" else "s"
    what = "Qwen2.5-1.5B shapes (random)" if args.qwen_shapes else args.model
    threads = torch.get_num_threads()
    lines = [
        f"{what}, {args.dtype}, LoRA r16, {len(prompts)} prompts x G {G}, <= {args.tokens} tokens, T "
        f"{args.temperature:g}, {device.type} ({threads} threads); completions' mean length "
        f"{sum(lengths) / len(lengths):.1f}; bandwidth {speed['bandwidth_gb_s']:.1f} GB/s, matmul "
        f"{speed['matmul_gflop_s']:.0f} GFLOP/s; floor {floor:.2f} {unit}",
        "",
        f"| engine | {unit} per rollout (best of {args.repeats}) | ms a decode step | / floor | / model.generate | "
        "host syncs a rollout |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    base = min(times["model.generate"])
    for name, t in times.items():
        ms = 1000 * min(t) / max(lengths)
        lines.append(
            f"| {name} | {min(t):.2f} | {ms:.1f} | {min(t) / floor:.1f} | {min(t) / base:.2f} | {syncs[name]} |"
        )
    for name, value in results.items():
        shown = f"{value:.1f} {unit}" if isinstance(value, float) else value
        lines.append(f"| {name} | {shown} | | |")
    print("\n".join(lines))
    if args.md:
        with open(args.md, "w") as f:
            f.write("\n".join(lines) + "\n")
    if args.json:
        record = {"args": vars(args), "machine": speed, "floor": floor, "lengths": lengths, "times": times}
        with open(args.json, "w") as f:
            json.dump(record | {"other": results, "table": "\n".join(lines)}, f, indent=1)


if __name__ == "__main__":
    main()

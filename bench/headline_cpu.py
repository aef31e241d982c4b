"""The headline experiment's code path end to end (grpo.py, Qwen2.5-1.5B's shapes, GSM8K train prompts through the
same loading and field mapping as the hub set) on a random-init local model, cut down only through flags. Not CI.
Prints peak memory (RSS on CPU, allocated on CUDA), the time per step and per phase, and tokens/s.

    python bench/headline_cpu.py                    # 2 steps, 1 prompt x G=2, 32-token completions, on the CPU
    python bench/headline_cpu.py --steps 3 --prompts-per-step 8 --group-size 4 --max-completion-length 512  # GPU
    python bench/headline_cpu.py --tiny --steps 2   # cut-down shapes (bench/gpu_check.sh --dry-run)
    python bench/headline_cpu.py --quick --steps 2 --prompts-per-step 8 --group-size 4 --max-completion-length 64
        # bench/gpu_check.sh's first stage: the tiny shapes (2 x G 2 x 32 tokens) for a figure within seconds, then
        # the 1.5B's at 64 tokens; with the milliseconds a decode token and, on CUDA, the host syncs of one rollout
        # and of one training pass of a group (torch.cuda.set_sync_debug_mode)

The model folder (random weights, bf16 on disk, tests/tiny.py's ChatML tokenizer) is written once by
bench/qwen_shapes.py in a child process, so the peak RSS printed here is the training run's own. The data is
../shared/data/gsm8k/{train,test}.jsonl; where that folder is absent (a clone, the GPU machine) GSM8K-layout rows
{question, answer: '... #### N'} from plugins.builtin_math.make_math_problems go through the same mapping instead.
grpo.main gets explicit arguments, the held-out GSM8K test file as --eval-dataset.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
GSM8K = os.path.join(os.path.dirname(ROOT), "shared", "data", "gsm8k")
PHASES = ("time/rollout", "time/reward", "time/reference", "time/train")


def gsm8k_files(out: str) -> tuple[str, str, str]:
    """(train, test, where from): the shared GSM8K files, else procedural rows in GSM8K's layout written to out."""
    if os.path.isfile(os.path.join(GSM8K, "train.jsonl")):
        return os.path.join(GSM8K, "train.jsonl"), os.path.join(GSM8K, "test.jsonl"), "GSM8K (shared/data)"
    from plugins.builtin_math import make_math_problems

    os.makedirs(out, exist_ok=True)
    paths = []
    for split, n, seed in (("train", 512, 0), ("test", 64, 1)):
        paths.append(os.path.join(out, f"{split}.jsonl"))
        with open(paths[-1], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in make_math_problems(n, seed))
    return paths[0], paths[1], "procedural GSM8K-layout rows (no shared/data here)"


def host_syncs(fn) -> int | str:
    """How many times fn() makes the host wait for the GPU (torch.cuda.set_sync_debug_mode: one warning a sync);
    "n/a" on a CPU."""
    import warnings

    import torch

    if not torch.cuda.is_available():
        fn()
        return "n/a"
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def run(shape: str, model_dir: str, steps: int, prompts: int, G: int, tokens: int, out: str, eval_limit: int) -> dict:
    """grpo.main on the random model at model_dir (written first if absent) for `steps` steps of prompts x G
    completions of `tokens` tokens; its figures, and on CUDA the host syncs of one more rollout and one training
    pass of a group (host_syncs)."""
    t0 = time.perf_counter()
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        subprocess.run(
            [sys.executable, os.path.join(ROOT, "bench", "qwen_shapes.py"), model_dir]
            + (["--tiny"] if shape == "tiny" else []),
            check=True,
        )
    write_s = time.perf_counter() - t0
    train, test, source = gsm8k_files(os.path.join(out, "data"))

    import torch
    from transformers import AutoTokenizer

    import grpo

    kw = dict(
        model=model_dir,
        dataset=train,
        output_dir=os.path.join(out, "runs"),
        max_steps=steps,
        prompts_per_step=prompts,
        group_size=G,
        max_completion_length=tokens,
        breaker_action="warn",
    )
    kw |= {"eval_dataset": test, "eval_steps": steps, "eval_limit": eval_limit}  # the held-out GSM8K eval
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    result = grpo.main(grpo.Args(**kw))
    run_s = time.perf_counter() - t0
    history = result["history"]
    measured = history[1:] or history  # step 1 carries one-off costs (allocator, kernel selection)
    figures = {
        "shape": shape,
        "data": source,
        "steps": len(history),
        "prompts_x_G": f"{prompts} x {G}",
        "max_completion_length": tokens,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "model_write_s": round(write_s, 1),
        "run_s": round(run_s, 1),
        "step_s": [round(sum(h[k] for k in PHASES), 2) for h in history],
        **{k.split("/")[1] + "_s": round(statistics.median(h[k] for h in measured), 3) for k in PHASES},
        "tokens_per_s": round(statistics.median(h["perf/tokens_per_s"] for h in measured), 1),
        "completion_mean_length": round(statistics.mean(h["completions/mean_length"] for h in history), 1),
        "peak_gb": round(
            torch.cuda.max_memory_allocated() / 2**30
            if torch.cuda.is_available()
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            2,
        ),
        "peak_kind": "GPU allocated" if torch.cuda.is_available() else "RSS",
        **{k: v for k, v in result.items() if k.startswith("eval/")},
    }
    # ms a decode step: the rollout's time over its longest completion (random weights run every row to the end)
    figures["rollout_ms_per_token"] = round(1000 * figures["rollout_s"] / max(1, tokens), 2)
    model = result["model"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = [tokenizer("What is 12 plus 7? Think step by step.")["input_ids"]] * prompts
    figures["syncs_per_rollout"] = host_syncs(
        lambda: grpo.hf_generate(model, tokenizer, prompt_ids, G, max_new_tokens=tokens)
    )

    def pass_of_a_group():
        completions = [[5] * tokens] * G
        logps, _ = grpo.grouped_completion_logps(model, prompt_ids[:1], completions, G, tokenizer.pad_token_id)
        logps.sum().backward()

    figures["syncs_per_training_pass"] = host_syncs(pass_of_a_group)
    model.zero_grad(set_to_none=True)
    return figures


ROW = (
    "| {shape}, {prompts_x_G} x {max_completion_length} tokens, {steps} steps | {rollout_s:.2f} | "
    "{rollout_ms_per_token:.1f} | {reward_s:.2f} | {reference_s:.2f} | {train_s:.2f} | {total:.2f} | "
    "{tokens_per_s:.0f} | {peak_gb:.2f} | {syncs_per_rollout} / {syncs_per_training_pass} |"
)
HEAD = (
    "| run | rollout s | ms/token | reward s | reference s | train s | step s | tokens/s | peak GB | host syncs: "
    "rollout / training pass |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"
)


def table(figures: list[dict]) -> str:
    """Markdown: each run's medians over its steps after the first."""
    rows = [ROW.format(**f, total=sum(f[k.split("/")[1] + "_s"] for k in PHASES)) for f in figures]
    return "\n".join([HEAD, *rows]) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default=None, help="random model folder; default /tmp/onlyone-random-<shape>")
    parser.add_argument("--tiny", action="store_true", help="cut-down shapes (bench/qwen_shapes.TINY)")
    parser.add_argument(
        "--quick", action="store_true", help="the tiny shapes, 2 x G 2 x 32, then the run's (64 tokens)"
    )
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts-per-step", type=int, default=1)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--max-completion-length", type=int, default=32)
    parser.add_argument("--eval-limit", type=int, default=2, help="held-out prompts in the eval (when grpo has one)")
    parser.add_argument("--out", default="outputs/headline")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    parser.add_argument("--md", default=None, help="also write the table to this Markdown file")
    args = parser.parse_args()
    shape = "tiny" if args.tiny else "qwen2.5-1.5b"
    runs = [(shape, args.model_dir or f"/tmp/onlyone-random-{shape}", args.steps)]
    if args.quick:  # the tiny model first: a figure within seconds, whatever follows
        runs.insert(0, ("tiny", "/tmp/onlyone-random-tiny", 2))
    figures = []
    for i, (name, model_dir, steps) in enumerate(runs):
        tiny_quick = args.quick and i == 0
        prompts, G, tokens = (
            (2, 2, 32) if tiny_quick else (args.prompts_per_step, args.group_size, args.max_completion_length)
        )
        figures.append(run(name, model_dir, steps, prompts, G, tokens, os.path.join(args.out, name), args.eval_limit))
        print("headline figures: " + json.dumps(figures[-1]), flush=True)
        print(table(figures), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures if args.quick else figures[0], f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(table(figures))


if __name__ == "__main__":
    main()

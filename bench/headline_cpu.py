"""The headline experiment's code path end to end (grpo.py, Qwen2.5-1.5B's shapes, GSM8K train prompts through the
same loading and field mapping as the hub set) on a random-init local model, cut down only through flags. Not CI.
Prints peak memory (RSS on CPU, allocated on CUDA), the time per step and per phase, and tokens/s.

    python bench/headline_cpu.py                    # 2 steps, 1 prompt x G=2, 32-token completions, on the CPU
    python bench/headline_cpu.py --steps 3 --prompts-per-step 8 --group-size 4 --max-completion-length 512  # GPU
    python bench/headline_cpu.py --tiny --steps 2   # cut-down shapes (bench/gpu_check.sh --dry-run)

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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default=None, help="random model folder; default /tmp/onlyone-random-<shape>")
    parser.add_argument("--tiny", action="store_true", help="cut-down shapes (bench/qwen_shapes.TINY)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts-per-step", type=int, default=1)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--max-completion-length", type=int, default=32)
    parser.add_argument("--eval-limit", type=int, default=2, help="held-out prompts in the eval (when grpo has one)")
    parser.add_argument("--out", default="outputs/headline")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args()
    shape = "tiny" if args.tiny else "qwen2.5-1.5b"
    model_dir = args.model_dir or f"/tmp/onlyone-random-{shape}"
    t0 = time.perf_counter()
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        subprocess.run(
            [sys.executable, os.path.join(ROOT, "bench", "qwen_shapes.py"), model_dir]
            + (["--tiny"] if args.tiny else []),
            check=True,
        )
    write_s = time.perf_counter() - t0
    train, test, source = gsm8k_files(os.path.join(args.out, "data"))

    import torch

    import grpo

    kw = dict(
        model=model_dir,
        dataset=train,
        output_dir=os.path.join(args.out, "runs"),
        max_steps=args.steps,
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        max_completion_length=args.max_completion_length,
        breaker_action="warn",
    )
    kw |= {"eval_dataset": test, "eval_steps": args.steps, "eval_limit": args.eval_limit}  # the held-out GSM8K eval
    t0 = time.perf_counter()
    result = grpo.main(grpo.Args(**kw))
    run_s = time.perf_counter() - t0
    history = result["history"]
    measured = history[1:] or history  # step 1 carries one-off costs (allocator, kernel selection)
    figures = {
        "shape": shape,
        "data": source,
        "steps": len(history),
        "prompts_x_G": f"{args.prompts_per_step} x {args.group_size}",
        "max_completion_length": args.max_completion_length,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "model_write_s": round(write_s, 1),
        "run_s": round(run_s, 1),
        "step_s": [round(sum(h[k] for k in PHASES), 2) for h in history],
        **{k.split("/")[1] + "_s": round(statistics.median(h[k] for h in measured), 2) for k in PHASES},
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
    print("headline figures: " + json.dumps(figures))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()

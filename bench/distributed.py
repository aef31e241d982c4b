"""Data parallelism on this machine's CPUs: sft and grpo at N = 1 and N = 2 ranks (gloo), the same global batch.

For each script and N, `torchrun --nproc-per-node N <script>.py` (N = 1 with twice the accumulation, or grpo's whole
prompts per step) runs --steps steps on the embedded SmolLM2-135M-Instruct with one torch thread a rank, --repeats
times; the table gives the global tokens per second (the mean of steps 2..end, metrics.jsonl's perf/tokens_per_s,
every rank's tokens), the scaling efficiency tokens/s(N=2) / (2 x tokens/s(N=1)), rank 0's peak RSS
(memory/peak_gb) and the memory plan's total for one rank (`--plan --plan-world-size N`).

    OMP_NUM_THREADS=1 python bench/distributed.py --steps 6 --repeats 2
"""

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
FLAGS = {
    "sft": ["--dataset", "builtin:math_sft", "--per-device-train-batch-size", "4", "--max-length", "256"],
    "grpo": ["--dataset", "builtin:math", "--prompts-per-step", "4", "--group-size", "4"]
    + ["--max-completion-length", "64", "--rewards", "math", "--breaker-action", "warn"],
}


def accumulation(script: str, n: int) -> list[str]:
    """The same global batch at every N: sft accumulates 2 / N micro-batches; grpo splits its prompts."""
    return ["--gradient-accumulation-steps", str(2 // n)] if script == "sft" else []


def run(script: str, n: int, steps: int, out: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", f"{script}.py"]
    cmd += FLAGS[script] + accumulation(script, n)
    cmd += ["--max-steps", str(steps), "--torch-threads", "1", "--report-to", "none", "--output-dir", out]
    cmd += ["--save-steps", "0", "--seed", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{script} N={n} failed: {done.stderr[-2000:]}")
    (run_dir,) = pathlib.Path(out).iterdir()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def plan_total(script: str, n: int) -> float:
    """The memory plan's total (GiB) for one rank of n."""
    cmd = [sys.executable, f"{script}.py", *FLAGS[script], *accumulation(script, n), "--plan"]
    cmd += ["--plan-world-size", str(n)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    found = re.search(r"^\s+total\s+([\d.]+) GiB", done.stdout, re.MULTILINE)
    if not found:
        raise SystemExit(f"no plan total in {script} --plan: {done.stdout[-1000:]} {done.stderr[-1000:]}")
    return float(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scripts", nargs="+", default=["sft", "grpo"], choices=sorted(FLAGS))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print("| script | N | tokens/s (median of runs) | runs | scaling efficiency | peak RSS rank 0 (GB) | plan (GiB) |")
    print("|---|---:|---:|---|---:|---:|---:|")
    for script in args.scripts:
        speed = {}
        for n in (1, 2):
            runs = []
            peaks = []
            for _ in range(args.repeats):
                with tempfile.TemporaryDirectory() as out:
                    history = run(script, n, args.steps, out)
                runs.append(statistics.mean(h["perf/tokens_per_s"] for h in history[1:]))
                peaks.append(max(h["memory/peak_gb"] for h in history))
            speed[n] = statistics.median(runs)
            efficiency = f"{speed[2] / (2 * speed[1]):.2f}" if n == 2 else ""
            shown = ", ".join(f"{r:.0f}" for r in runs)
            row = f"| {script} | {n} | {speed[n]:.0f} | {shown} | {efficiency} | {max(peaks):.2f} |"
            print(f"{row} {plan_total(script, n):.2f} |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

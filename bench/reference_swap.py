"""The reference pass of a full fine-tune, two ways: the starting weights kept in CPU memory and swapped in for the
pass (common.model.snapshot_ref + as_reference: what grpo.py --no-use-lora runs, one backbone on the card) against a
resident copy (a second model object holding the starting weights: what TRL's GRPOTrainer keeps without PEFT).

Each child process builds the model, takes the reference (swap: snapshot_ref; resident: a deepcopy), makes one AdamW
update (the policy then differs from its reference, and AdamW's states are held as in training), then per
repetition resets the peak and times --passes no-grad reference passes (sequence_logps over --rows x --tokens random
tokens) after one warm-up: the median seconds per pass and the peak memory (CPU: peak RSS, VmHWM; CUDA:
torch.cuda.max_memory_allocated, and the host's peak RSS), and the held memory before the passes. Both ways must give
the same reference log-probs bit for bit (checked). Children run with MALLOC_MMAP_THRESHOLD_=65536, so that RSS
follows the live tensors (docs/memory.md, the allocator).

    OMP_NUM_THREADS=1 python bench/reference_swap.py                  # CPU, fp32, SmolLM2-135M, 2 processes a cell
    OMP_NUM_THREADS=1 python bench/reference_swap.py --model tiny     # the tiny test model (seconds)
    python bench/reference_swap.py --gpu --runs 1 --reps 2            # CUDA: random-init Qwen2.5-1.5B in bf16
    python bench/reference_swap.py --gpu --tiny --runs 1 --reps 2     # the same code path on a CPU, cut down
"""

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MODES = ("swap", "resident")


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith(field + ":")))


def build(args):
    """(model on its device, vocabulary size): SmolLM2-135M or the tiny model in fp32 on the CPU, or a random-init
    Qwen2.5-1.5B (bench/qwen_shapes.py) in bf16 on CUDA (--gpu; --tiny: its cut-down shapes, on the CPU)."""
    import torch

    from common.model import load_model
    from plugins.embedded import resolve_model

    if args.gpu:
        from bench.qwen_shapes import QWEN25_15B, TINY, build_random_qwen

        device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        model, _ = build_random_qwen(TINY if args.tiny else QWEN25_15B, dtype, device)
        return model, model.config.vocab_size
    path = args.model
    if args.model == "tiny":
        from tests.tiny import write_tiny

        path = write_tiny(tempfile.mkdtemp(prefix="reference_swap_"))
    model, _ = load_model(path, "fp32", "sdpa", path=resolve_model(path))
    return model, model.config.vocab_size


def child(args) -> None:
    """One mode in this process: --reps repetitions of (reset the peak, warm up, time --passes reference passes)."""
    import torch

    from common.model import as_reference, sequence_logps, snapshot_ref

    torch.manual_seed(0)
    model, vocab = build(args)
    cuda = next(model.parameters()).is_cuda
    device = next(model.parameters()).device
    ids = torch.randint(0, min(vocab, 400), (args.rows, args.tokens), device=device)
    mask = torch.ones_like(ids)
    reference = None
    if args.child == "swap":
        snapshot_ref(model)
    else:  # a second model object holding the starting weights
        reference = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model.train()
    sequence_logps(model, ids, mask, mask).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)  # as in grpo.py's reference pass: no gradient held

    def reference_pass():
        if reference is None:
            with as_reference(model):
                return sequence_logps(model, ids, mask, mask)
        with torch.no_grad():
            return sequence_logps(reference, ids, mask, mask)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    results = []
    for _ in range(args.reps):
        sync()
        held = torch.cuda.memory_allocated() if cuda else rss_kib("VmRSS") * 1024
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM back to the current RSS (Linux >= 4.0)
        logps = reference_pass()  # warm-up: allocator, kernel selection
        times = []
        for _ in range(args.passes):
            sync()
            t0 = time.perf_counter()
            logps = reference_pass()
            sync()
            times.append(time.perf_counter() - t0)
        results.append(
            {
                "s_per_pass": statistics.median(times),
                "held_gb": held / 2**30,
                "peak_gb": (torch.cuda.max_memory_allocated() if cuda else rss_kib("VmHWM") * 1024) / 2**30,
                "host_peak_rss_gb": rss_kib("VmHWM") / 2**20,
                "logps_sum": logps.double().sum().item(),
            }
        )
    print("RESULT " + json.dumps(results), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="CPU: a path, an alias, or tiny")
    parser.add_argument("--gpu", action="store_true", help="random-init Qwen2.5-1.5B in bf16 on CUDA")
    parser.add_argument("--tiny", action="store_true", help="with --gpu: its cut-down shapes (a dry run on a CPU)")
    parser.add_argument("--rows", type=int, default=None, help="rows per pass (CPU: 4; --gpu: 8)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per row (CPU: 128; --gpu: 512)")
    parser.add_argument("--passes", type=int, default=3, help="timed passes per repetition (after one warm-up)")
    parser.add_argument("--runs", type=int, default=2, help="processes per cell")
    parser.add_argument("--reps", type=int, default=1, help="repetitions within a process")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--md", default=None, help="also write the table to this Markdown file")
    parser.add_argument("--child", choices=MODES, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.rows = args.rows or (8 if args.gpu else 4)
    args.tokens = args.tokens or (512 if args.gpu else 128)
    if args.child:
        child(args)
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    flags = [f"--{k}={v}" for k, v in vars(args).items() if k in ("model", "rows", "tokens", "passes", "reps")]
    flags += ["--gpu"] * args.gpu + ["--tiny"] * args.tiny
    out = {}
    for mode in MODES:
        for run in range(args.runs):
            cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, *flags]
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode != 0 or not lines:
                raise SystemExit(f"{mode} run {run + 1} failed: {done.stderr[-2000:]}")
            out.setdefault(mode, []).extend(json.loads(lines[-1][len("RESULT ") :]))
            report(args, out)  # after each process: a run cut short by a time limit keeps what it measured
    sums = {r["logps_sum"] for rows in out.values() for r in rows}
    if len(sums) != 1:
        raise SystemExit(f"the two ways gave different reference log-probs: {sorted(sums)}")
    print(report(args, out))


def report(args, out: dict) -> str:
    """The Markdown table of the results so far, also written to --json with them."""
    sums = sorted({r["logps_sum"] for rows in out.values() for r in rows})
    what = args.model
    if args.gpu:
        what = "random-init Qwen2.5-1.5B" if not args.tiny else "random-init Qwen2.5 cut-down shapes (--tiny)"
    peak = "peak GB (GPU allocated; RSS on a CPU)" if args.gpu else "peak RSS GB"
    lines = [
        f"Reference pass, {what}: {args.rows} rows x {args.tokens} tokens, median of {args.passes} passes; "
        f"reference log-probs summed: {', '.join(f'{x:.6g}' for x in sums)} (one value: the same both ways)",
        "",
        f"| reference | run | s / pass | held before GB | {peak} | host peak RSS GB |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for mode, rows in out.items():
        for i, r in enumerate(rows, 1):
            lines.append(
                f"| {mode} | {i} | {r['s_per_pass']:.3f} | {r['held_gb']:.2f} | {r['peak_gb']:.2f} | "
                f"{r['host_peak_rss_gb']:.2f} |"
            )
    table = "\n".join(lines) + "\n"
    if args.md:
        with open(args.md, "w") as f:
            f.write(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": vars(args), "results": out, "table": table}, f, indent=1)
    return table


if __name__ == "__main__":
    main()

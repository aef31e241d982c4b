"""Peak memory and time of per-token logps, forward + backward: common.model.chunked_logps vs the naive
h @ W^T -> log_softmax -> gather, at Qwen2.5-0.5B's head size (V=151,936, H=896), fp32 on CPU.

Each variant runs in a fresh subprocess; its cost is peak RSS (ru_maxrss) minus the RSS right after the inputs
(hidden, head, labels) exist, so both numbers include the head's own gradient (V x H fp32, 544 MB).

    OMP_NUM_THREADS=1 python bench/logps_memory.py              # N = 8 x 1024 tokens (naive needs ~15 GB)
    OMP_NUM_THREADS=1 python bench/logps_memory.py --n-tokens 4096
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.model import chunked_logps


def naive_logps(hidden, weight, labels):
    """What a trainer writes without chunking: full (N, V) fp32 logits, log_softmax, gather."""
    return torch.log_softmax(hidden @ weight.T, dim=-1).gather(-1, labels[:, None]).squeeze(-1)


def inputs(n, v, h, seed=0):
    torch.manual_seed(seed)
    hidden = torch.randn(n, h, requires_grad=True)
    weight = (torch.randn(v, h) * h**-0.5).requires_grad_()  # trainable head, logits of O(1) scale
    return hidden, weight, torch.randint(0, v, (n,)), torch.randn(n)


def rss_mb():
    """Current resident set size (MB), from /proc/self/statm (pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_variant(variant, n, v, h, chunk_size):
    """Child process: one forward + backward, prints {peak_extra_mb, seconds, cpu_seconds} as JSON."""
    hidden, weight, labels, g = inputs(n, v, h)
    baseline = rss_mb()
    start, cpu_start = time.perf_counter(), time.process_time()
    logps = (
        naive_logps(hidden, weight, labels)
        if variant == "naive"
        else chunked_logps(hidden, weight, labels, chunk_size=chunk_size)
    )
    (logps * g).sum().backward()  # random upstream grad, as a policy-gradient loss would give
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KB
    print(json.dumps(dict(peak_extra_mb=peak - baseline, seconds=seconds, cpu_seconds=cpu_seconds)))


def check_equal(n=300, v=5003, h=64, chunk_size=128):
    """Values and grads (hidden, head) of both variants agree at a small size."""
    hidden, weight, labels, g = inputs(n, v, h)
    ours = chunked_logps(hidden, weight, labels, chunk_size=chunk_size)
    ref = naive_logps(hidden, weight, labels)
    grads = [torch.autograd.grad((x * g).sum(), (hidden, weight)) for x in (ours, ref)]
    errors = [(ours - ref).abs().max().item()] + [(a - b).abs().max().item() for a, b in zip(*grads, strict=True)]
    assert max(errors) < 1e-4, errors
    return errors


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-tokens", type=int, default=8 * 1024)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--variant", choices=["naive", "ours"], help="internal: run one variant and print JSON")
    args = parser.parse_args()
    shape = (args.n_tokens, args.vocab, args.hidden)
    if args.variant:
        return run_variant(args.variant, *shape, args.chunk_size)

    # Refuse rather than OOM a shared machine: naive holds ~3 (N, V) fp32 tensors (logits, log_softmax, its grad).
    logits_mb = args.n_tokens * args.vocab * 4 / 2**20
    with open("/proc/meminfo") as f:
        available_mb = next(int(line.split()[1]) / 1024 for line in f if line.startswith("MemAvailable"))
    if 3 * logits_mb + 4096 > available_mb:
        sys.exit(f"naive needs ~{3 * logits_mb:,.0f} MB, {available_mb:,.0f} MB available: lower --n-tokens")

    errors = check_equal()
    results = {}
    for variant in ("ours", "naive"):
        cmd = [sys.executable, __file__, "--variant", variant, "--n-tokens", str(args.n_tokens)]
        cmd += ["--vocab", str(args.vocab), "--hidden", str(args.hidden), "--chunk-size", str(args.chunk_size)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])

    print(f"N={args.n_tokens} V={args.vocab} H={args.hidden} fp32 CPU, chunk_size={args.chunk_size}, fwd+bwd")
    print(f"one (N, V) fp32 logits tensor = {logits_mb:,.0f} MB; small-size check max |diff| = {max(errors):.1e}\n")
    # cpu seconds (process time, 1 thread) is the compute cost; wall seconds also count waiting on a shared CPU
    print("| variant | peak extra MB | cpu seconds | wall seconds |")
    print("|---|---:|---:|---:|")
    for variant, r in results.items():
        print(f"| {variant} | {r['peak_extra_mb']:,.0f} | {r['cpu_seconds']:.1f} | {r['seconds']:.1f} |")
    ratio = {key: results["ours"][key] / results["naive"][key] for key in ("peak_extra_mb", "cpu_seconds", "seconds")}
    print(f"| ours / naive | {ratio['peak_extra_mb']:.3f} | {ratio['cpu_seconds']:.2f} | {ratio['seconds']:.2f} |")
    print(f"\ncommand: OMP_NUM_THREADS=1 python bench/logps_memory.py --n-tokens {args.n_tokens}")


if __name__ == "__main__":
    main()

"""--optim adamw_torch vs adamw_8bit on sft.py (SmolLM2-135M, fp32 on a CPU), LoRA and full fine-tuning: the
optimizer's state after the run's steps (its moments, measured and as harness.memory plans them, and the rest it
holds), the process's peak RSS (VmHWM, the whole process), the wall time of each step (tokens / tokens per second,
which sft.py logs after the optimizer step) and of optimizer.step() alone (the fastest of 3 on random gradients).
Each case runs in a fresh process, `--repeats` times.

    OMP_NUM_THREADS=1 python bench/optim_memory.py [--steps 3] [--repeats 2] [--batch 4] [--max-length 256]

Prints a markdown table (docs/memory.md shows its output).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MOMENTS = ("exp_avg", "exp_avg_sq", "state1", "state2", "absmax1", "absmax2")


def state_bytes(optimizer) -> tuple[int, int]:
    """(moments: torch's exp_avg and exp_avg_sq, bitsandbytes' state1, state2 and absmax; every other tensor of the
    state, each storage once: step counters, bitsandbytes' shared quantization maps)."""
    moments = 0
    other = {}
    for state in optimizer.state.values():
        for name, value in state.items():
            if not hasattr(value, "untyped_storage"):
                continue
            size = value.numel() * value.element_size()
            if name in MOMENTS:
                moments += size
            else:
                other[value.untyped_storage().data_ptr()] = size
    return moments, sum(other.values())


def child(optim: str, lora: bool, steps: int, batch: int, max_length: int) -> dict:
    """One sft.py run in this process; the optimizer is the one sft.main hands its scheduler."""
    import resource
    from unittest import mock

    import torch

    import sft
    from harness import memory

    built = []
    real = sft.get_scheduler

    def recorded(name, optimizer, *a, **k):
        built.append(optimizer)
        return real(name, optimizer, *a, **k)

    with tempfile.TemporaryDirectory() as out, mock.patch.object(sft, "get_scheduler", recorded):
        args = sft.Args(
            model="smollm2-135m",
            preset="demo",
            output_dir=out,
            max_steps=steps,
            save_steps=0,
            per_device_train_batch_size=batch,
            max_length=max_length,
            use_lora=lora,
            optim=optim,
        )
        result = sft.main(args)
    moments, other = state_bytes(built[0])
    step_seconds = []
    for _ in range(3):  # optimizer.step() alone, on gradients of the trained tensors' shapes, after the run
        for group in built[0].param_groups:
            for p in group["params"]:
                p.grad = torch.randn_like(p) * 1e-3
        start = time.perf_counter()
        built[0].step()
        step_seconds.append(time.perf_counter() - start)
    config = memory.model_config("smollm2-135m")
    planned = memory.adamw_state_bytes(memory.trained_tensors(config, args.lora_r if lora else None), optim, 4)
    seconds = [h["num_tokens"] / h["perf/tokens_per_s"] for h in result["history"]]
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return dict(
        moments=moments,
        other=other,
        planned=planned,
        seconds=seconds,
        peak_mib=peak_kib / 1024,
        optimizer_step=min(step_seconds),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--child", nargs=2, metavar=("OPTIM", "LORA"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        result = child(a.child[0], a.child[1] == "lora", a.steps, a.batch, a.max_length)
        print("RESULT " + json.dumps(result))
        return
    head = "| training | optim | moments measured / planned (MiB) | other state (KiB) | peak RSS (MiB) | s per step |"
    print(head + " optimizer.step() s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for lora in ("lora", "full"):
        for optim in ("adamw_torch", "adamw_8bit"):
            runs = []
            for _ in range(a.repeats):
                cmd = [sys.executable, __file__, "--child", optim, lora, "--steps", str(a.steps)]
                cmd += ["--batch", str(a.batch), "--max-length", str(a.max_length)]
                done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
                line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
                runs.append(json.loads(line[len("RESULT ") :]))
            first = runs[0]
            peaks = " / ".join(f"{r['peak_mib']:,.0f}" for r in runs)
            # the first step pays for the moments' allocation (and bitsandbytes' first call): steps 2+ shown
            later = " / ".join(f"{sum(r['seconds'][1:]) / len(r['seconds'][1:]):.2f}" for r in runs)
            state = f"{first['moments'] / 2**20:.2f} / {first['planned'] / 2**20:.2f}"
            training = "LoRA r 16" if lora == "lora" else "full"
            alone = " / ".join(f"{r['optimizer_step']:.3f}" for r in runs)
            print(f"| {training} | {optim} | {state} | {first['other'] / 1024:.1f} | {peaks} | {later} | {alone} |")
    shape = f"{a.batch} rows x <= {a.max_length} tokens"
    print(f"\nsft.py, SmolLM2-135M fp32, {shape}, {a.steps} steps, {a.repeats} runs each (peak RSS, s per step)")


if __name__ == "__main__":
    main()

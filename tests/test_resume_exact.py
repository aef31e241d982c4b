"""Exact resume and clean stops: a run resumed from step k logs what the uninterrupted run logged after step k (every
metric but wall-clock ones), its count of skipped non-finite updates goes on from the checkpoint, grpo's circuit
breakers keep their baseline and patience across a resume, and every way out of a loop puts the caller's Ctrl-C
handler back."""

import dataclasses
import importlib
import json
import math
import os
import signal

import pytest
import torch

from harness.errors import RunStopped
from harness.checkpoints import marker_sha256
from tests.prefs_helpers import preference_rows, write_jsonl

SCRIPTS = ["sft", "dpo", "orpo", "kto", "rm", "grpo"]
DATA = {  # each script's own kind of rows; preference rows for the rest
    "sft": dict(dataset="builtin:math_sft", per_device_train_batch_size=2),
    "kto": dict(dataset="builtin:math_binary", per_device_train_batch_size=4),
    "grpo": dict(dataset="builtin:math", group_size=2, prompts_per_step=1, max_completion_length=4, beta=0.04),
}
QUIET = dict(  # grpo's breakers off, so that none stops a run these tests do not mean to stop
    breaker_max_kl=math.inf,
    breaker_max_clipped_ratio=2.0,
    breaker_max_length_growth=math.inf,
    breaker_max_frac_zero_std=2.0,
    breaker_max_nonfinite=100,
)
WALL_CLOCK = ("time/", "perf/", "memory/")


@pytest.fixture
def prefs(tmp_path):
    return write_jsonl(tmp_path / "prefs.jsonl", preference_rows(8))


def args_for(script, model_dir, prefs, out, **kw):
    module = importlib.import_module(script)
    kw = dict(model=model_dir, output_dir=str(out), preset="demo", learning_rate=5e-2, seed=3) | kw
    kw |= DATA.get(script, dict(dataset=prefs)) | (QUIET if script == "grpo" else {})
    return module, module.Args(**kw)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_resumed_run_logs_every_metric_as_the_straight_run(script, tiny_model_dir, prefs, tmp_path):
    """The resume tests compared the loss (and the weights): here every logged key of steps 3-4, wall clock aside."""
    module, args = args_for(script, tiny_model_dir, prefs, tmp_path / "a", max_steps=4, save_steps=2)
    straight = module.main(args)
    ckpt = os.path.join(straight["run_dir"], "checkpoints", "step-2")
    resumed = module.main(dataclasses.replace(args, output_dir=str(tmp_path / "b"), resume_from_checkpoint=ckpt))

    def logged(history):
        return [{k: v for k, v in h.items() if not k.startswith(WALL_CLOCK)} for h in history if h["step"] > 2]

    assert [h["step"] for h in logged(resumed["history"])] == [3, 4]
    assert logged(resumed["history"]) == logged(straight["history"])


@pytest.mark.parametrize("script", SCRIPTS)
def test_skipped_updates_count_on_after_a_resume(script, tiny_model_dir, prefs, tmp_path, monkeypatch):
    """nonfinite_updates restarted at 0 after a resume in sft/dpo/orpo/kto/rm: it was not in the checkpoint."""
    real = torch.nn.utils.clip_grad_norm_

    def nan_norm(*a, **k):  # every update's gradient norm is NaN: the loop must skip it and count it
        return real(*a, **k) * math.nan

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", nan_norm)
    module, args = args_for(script, tiny_model_dir, prefs, tmp_path / "a", max_steps=1, save_steps=1)
    args = dataclasses.replace(args, breaker_max_nonfinite=4)  # counting on, not the stop (tests/test_nonfinite.py)
    first = module.main(args)
    ckpt = os.path.join(first["run_dir"], "checkpoints", "step-1")
    again = dataclasses.replace(args, output_dir=str(tmp_path / "b"), max_steps=3, resume_from_checkpoint=ckpt)
    history = module.main(again)["history"]
    assert [(h["step"], h["nonfinite_updates"]) for h in history if h["step"] > 1] == [(2, 2), (3, 3)]


def test_grpo_breakers_keep_their_patience_across_a_resume(tiny_model_dir, tmp_path, capsys):
    """The breakers' history was not in the checkpoint: resumed from step 1, a condition holding on every step (one
    reward for all: no group has a spread) began a new streak and fired at step 3, not at step 2 as straight."""
    module, args = args_for("grpo", tiny_model_dir, None, tmp_path / "a", max_steps=4, save_steps=1)
    args = dataclasses.replace(args, breaker_action="stop", breaker_patience=2, breaker_max_frac_zero_std=1.0)
    args = dataclasses.replace(args, rewards=["tests.test_grpo:constant"])
    with pytest.raises(RunStopped, match=r"stopped at step 2 \(circuit breaker reward_std_zero\)") as straight:
        module.main(args)
    ckpt = os.path.join(straight.value.result["run_dir"], "checkpoints", "step-1")
    again = dataclasses.replace(args, output_dir=str(tmp_path / "b"), resume_from_checkpoint=ckpt)
    with pytest.raises(RunStopped, match=r"stopped at step 2 \(circuit breaker reward_std_zero\)"):
        module.main(again)


def test_grpo_length_baseline_is_the_first_step_of_the_run_not_of_the_resume(tiny_model_dir, tmp_path):
    """length_exploding compares with the run's first step: the baseline goes through the checkpoint's JSON and a
    resumed run keeps it (here a step-1 baseline of 0.25 tokens, which the resumed step 2 is far above)."""
    module, args = args_for("grpo", tiny_model_dir, None, tmp_path / "a", max_steps=1, save_steps=1)
    first = module.main(args)
    ckpt = os.path.join(first["run_dir"], "checkpoints", "step-1")
    marker = os.path.join(ckpt, "checkpoint_complete.json")  # the breakers' state is JSON in the marker
    meta = json.load(open(marker))
    assert meta["trainer_state"]["start_length"] == first["history"][0]["completions/mean_length"]
    meta["trainer_state"]["start_length"] = 0.25
    meta["marker_sha256"] = marker_sha256(meta)  # an edit the marker's own hash would refuse: resealed
    json.dump(meta, open(marker, "w"))
    again = dataclasses.replace(args, output_dir=str(tmp_path / "b"), max_steps=3, resume_from_checkpoint=ckpt)
    again = dataclasses.replace(again, breaker_action="stop", breaker_patience=1, breaker_max_length_growth=2.0)
    with pytest.raises(RunStopped, match=r"stopped at step 2 \(circuit breaker length_exploding\)") as stopped:
        module.main(again)
    assert stopped.value.result["history"][-1]["completions/mean_length"] > 2 * 0.25
    marker = os.path.join(stopped.value.checkpoint, "checkpoint_complete.json")
    assert json.load(open(marker))["trainer_state"]["start_length"] == 0.25  # not step 2's own length


@pytest.mark.parametrize("script", ["sft", "grpo"])
def test_the_callers_ctrl_c_handler_is_back_after_the_loop_raises(
    script, tiny_model_dir, prefs, tmp_path, monkeypatch
):
    """StopOnCtrlC stayed installed when the loop raised: an in-process caller's next Ctrl-C was swallowed as a stop
    request of a run that no longer existed."""
    module = importlib.import_module(script)

    def boom(*a, **k):
        raise ZeroDivisionError("in the loop")

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", boom)  # the loop's clipping, before the optimizer step
    _, args = args_for(script, tiny_model_dir, prefs, tmp_path, max_steps=2, save_steps=0)
    assert_callers_handler_is_back(lambda: module.main(args), ZeroDivisionError)


def test_the_callers_ctrl_c_handler_is_back_after_a_breaker_stop(tiny_model_dir, tmp_path):
    module, args = args_for("grpo", tiny_model_dir, None, tmp_path, max_steps=3, save_steps=0)
    args = dataclasses.replace(args, breaker_action="stop", breaker_patience=1, breaker_max_frac_zero_std=1.0)
    args = dataclasses.replace(args, rewards=["tests.test_grpo:constant"])
    assert_callers_handler_is_back(lambda: module.main(args), RunStopped)


def assert_callers_handler_is_back(run, error) -> None:
    """run() raises `error`; the SIGINT handler the caller had before is the one it has after."""

    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGINT, mine)
    try:
        with pytest.raises(error):
            run()
        assert signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, previous)


# ------------------------------------------------------------------- a resume continues its run dir (issue 41 §6)
def without_wall_clock(log_file) -> list[dict]:
    lines = [json.loads(line) for line in open(log_file)]
    return [{k: v for k, v in h.items() if not k.startswith(WALL_CLOCK)} for h in lines]


def tensorboard_steps(run_dir, tag: str) -> list[int]:
    """The steps TensorBoard shows for `tag` in run_dir: every event file read as TensorBoard reads a run, a
    purge_step dropping what a later file replaces."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir))
    events.Reload()
    return [e.step for e in events.Scalars(tag)]


def ctrl_c_at_step(monkeypatch, at: int) -> None:
    """A Ctrl-C delivered while step `at` is logged: the run stops after that step with a checkpoint."""
    from harness.run import Logger

    real = Logger.log

    def log(self, step, metrics):
        if step == at:
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, step, metrics)

    monkeypatch.setattr(Logger, "log", log)


@pytest.mark.parametrize("script", ["sft", "grpo"])
def test_a_run_stopped_and_resumed_is_one_run_dir_as_a_straight_run(
    script, tiny_model_dir, prefs, tmp_path, monkeypatch, capsys
):
    """A resume started a new run dir: one run's curve in two dirs, two TensorBoard runs, and an end line that
    covered only the resumed steps. Now a Ctrl-C stop at step 2 and its resume leave one run dir whose metrics.jsonl
    is the straight run's (wall clock aside), one TensorBoard stream of steps 1..4, and an end line over all 4."""
    module, args = args_for(script, tiny_model_dir, prefs, tmp_path / "a", max_steps=4, save_steps=0)
    straight = module.main(args)
    straight_line = capsys.readouterr().out.strip().splitlines()[-1]
    stopped_args = dataclasses.replace(args, output_dir=str(tmp_path / "b"))
    with monkeypatch.context() as m:
        ctrl_c_at_step(m, 2)
        with pytest.raises(RunStopped) as stopped:
            module.main(stopped_args)
    run_dir = os.path.dirname(os.path.dirname(stopped.value.checkpoint))
    capsys.readouterr()
    resumed = module.main(dataclasses.replace(stopped_args, resume_from_checkpoint=run_dir))
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert resumed["run_dir"] == run_dir and os.listdir(tmp_path / "b") == [os.path.basename(run_dir)]
    log = os.path.join(run_dir, "metrics.jsonl")
    assert without_wall_clock(log) == without_wall_clock(os.path.join(straight["run_dir"], "metrics.jsonl"))
    assert tensorboard_steps(run_dir, "loss") == [1, 2, 3, 4]
    # the end line: the whole run's trend, as the straight run's, over all 4 steps, with the thread count
    trend = straight_line.split(" s for ")[0].rsplit(", ", 1)[0]
    assert line.startswith(trend) and " s for 4 steps on " in line and f"run dir {run_dir}," in line, line


def test_a_resume_from_an_older_checkpoint_keeps_what_it_replaces(tiny_model_dir, prefs, tmp_path, capsys):
    """Resumed from step-2 of a finished 4-step run: steps 3-4 are trained again in the same run dir. The lines and
    the checkpoint they replace are moved aside (named in one line each), never deleted, never resumed from; the
    log and TensorBoard end as one stream of steps 1..4, equal to the first pass."""
    module, args = args_for("sft", tiny_model_dir, prefs, tmp_path, max_steps=4, save_steps=2)
    first = module.main(args)
    run_dir = first["run_dir"]
    log = os.path.join(run_dir, "metrics.jsonl")
    before = open(log).read()
    capsys.readouterr()
    step2 = os.path.join(run_dir, "checkpoints", "step-2")
    module.main(dataclasses.replace(args, resume_from_checkpoint=step2))
    out = capsys.readouterr().out
    [aside] = [f for f in os.listdir(run_dir) if f.startswith("metrics.replaced-")]
    assert open(os.path.join(run_dir, aside)).read() == "".join(before.splitlines(keepends=True)[2:])
    assert f"resume at step 2: 2 lines of metrics.jsonl after it (steps 3..4) moved to {run_dir}/{aside}" in out
    assert without_wall_clock(log) == [
        {k: v for k, v in json.loads(line).items() if not k.startswith(WALL_CLOCK)} for line in before.splitlines()
    ]
    [replaced] = [p for p in os.listdir(os.path.join(run_dir, "checkpoints")) if p.startswith("replaced-")]
    assert os.listdir(os.path.join(run_dir, "checkpoints", replaced)) == ["step-4"]
    assert "the newer checkpoint step-4 moved to" in out
    assert sorted(n for n in os.listdir(os.path.join(run_dir, "checkpoints")) if n.startswith("step-")) == [
        "step-2",
        "step-4",
    ]
    assert tensorboard_steps(run_dir, "loss") == [1, 2, 3, 4]

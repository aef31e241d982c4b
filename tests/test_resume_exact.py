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

from common.errors import RunStopped
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
    assert [(h["step"], h["nonfinite_updates"]) for h in module.main(again)["history"]] == [(2, 2), (3, 3)]


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

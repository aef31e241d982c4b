"""Bad numbers and bad stops (issue: fault injection): nonsense flags refused before the model loads, --max-steps 0,
NaN/Inf updates skipped, non-finite weights never saved, breaker stops and Ctrl-C exit non-zero with a checkpoint."""

import dataclasses
import importlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from common.errors import ArgsError
from harness.errors import NonFiniteWeightsError, RunStopped
from tests.prefs_helpers import preference_rows, write_jsonl
from tests import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture
def prefs(tmp_path):
    return write_jsonl(tmp_path / "prefs.jsonl", preference_rows(8))


@pytest.fixture
def sft_rows(tmp_path):
    rows = [{"prompt": f"Say {w}", "completion": f"{w} {w}"} for w in ("red", "blue", "green", "yes") * 4]
    return write_jsonl(tmp_path / "sft.jsonl", rows)


# (script, flag, value, what the message says): each crashed deep inside the run, or trained on, before.
NONSENSE = [
    ("sft", "learning_rate", math.inf, "finite number > 0"),
    ("dpo", "learning_rate", -1e-5, "finite number > 0"),
    ("orpo", "max_grad_norm", math.nan, "finite number > 0"),
    ("kto", "gradient_accumulation_steps", 0, "at least 1"),
    ("dpo", "per_device_train_batch_size", 0, "at least 1"),
    ("grpo", "group_size", 1, "at least 2"),
    ("grpo", "prompts_per_step", 0, "at least 1"),
    ("grpo", "temperature", 0.0, "finite number > 0"),
    ("raft", "prompts_per_round", 0, "at least 1"),
    ("sft", "max_steps", -2, ">= 0"),
    ("rm", "per_device_train_batch_size", 0, "at least 1"),
    ("grpo", "epsilon", -0.2, ">= 0"),  # the clip bounds would cross
    ("grpo", "epsilon_high", -0.1, ">= 0"),
    ("grpo", "max_steps", -1, ">= 0"),  # grpo has no epochs to count steps from: -1 trained nothing
    ("rm", "center_rewards_coefficient", -0.01, ">= 0"),  # would reward rewards far from 0
    ("grpo", "top_p", 0.0, "must be in (0, 1]"),  # HF samples greedily at 0, vLLM refuses it
    ("raft", "top_p", 5.0, "must be in (0, 1]"),
    ("sft", "lora_dropout", 1.5, "must be in [0, 1)"),  # PEFT raised only after the model loaded
    ("grpo", "lora_dropout", -0.1, "must be in [0, 1)"),
    ("dpo", "lora_alpha", 0, "must be > 0"),  # scales the adapter by alpha / r = 0: a no-op adapter trained
    ("kto", "lora_r", 0, "at least 1"),
    ("orpo", "breaker_max_nonfinite", 0, "at least 1"),
]


@pytest.mark.parametrize("script, flag, value, message", NONSENSE, ids=[f"{s}-{f}" for s, f, *_ in NONSENSE])
def test_nonsense_flags_are_refused_before_the_model_loads(script, flag, value, message, tmp_path):
    module = importlib.import_module(script)
    args = module.Args(model=str(tmp_path / "no-such-model"), output_dir=str(tmp_path), **{flag: value})
    with pytest.raises(ArgsError, match=rf"^--{flag.replace('_', '-')} {value}: .*{re.escape(message)}"):
        module.main(args)


def test_max_steps_zero_means_zero(tiny_model_dir, sft_rows, tmp_path):
    """It used to train a whole epoch (0 was read as 'derive from the epochs')."""
    import sft

    out = sft.main(sft.Args(model=tiny_model_dir, dataset=sft_rows, output_dir=str(tmp_path), max_steps=0))
    assert out["history"] == [] and os.path.isfile(os.path.join(out["final_dir"], "adapter_model.safetensors"))


def test_nan_loss_skips_every_update_in_dpo(tiny_model_dir, prefs, tmp_path, monkeypatch):
    """dpo.py had no guard: a NaN loss stepped Adam and wrote a NaN model as final/ with exit 0."""
    import dpo

    original = dpo.dpo_loss

    def nan_loss(**kw):
        losses, chosen, rejected = original(**kw)
        return losses * math.nan, chosen, rejected

    monkeypatch.setattr(dpo, "dpo_loss", nan_loss)
    out = dpo.main(
        dpo.Args(
            model=tiny_model_dir,
            dataset=prefs,
            output_dir=str(tmp_path),
            max_steps=3,
            per_device_train_batch_size=4,
            learning_rate=1e-2,
            breaker_max_nonfinite=4,  # one more than the steps: this test is about the skip, not the stop
        )
    )
    assert [h["nonfinite_updates"] for h in out["history"]] == [1, 2, 3]
    default = {n: p for n, p in out["model"].named_parameters() if ".default." in n}
    assert all(torch.isfinite(p).all() for p in default.values())
    assert all(not p.any() for n, p in default.items() if "lora_B" in n), "a NaN step moved the fresh adapter"


def test_non_finite_weights_are_never_saved(tiny_model_dir, sft_rows, tmp_path, monkeypatch):
    """An update that leaves NaN in the weights (as fp16 overflow does) stops the run at the next save."""
    import sft

    step = torch.optim.AdamW.step

    def poisoned_step(self, *a, **kw):
        result = step(self, *a, **kw)
        with torch.no_grad():
            self.param_groups[0]["params"][0].fill_(math.nan)
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", poisoned_step)
    with pytest.raises(NonFiniteWeightsError, match="hold NaN/Inf .* nothing was saved. Last good checkpoint: none"):
        sft.main(sft.Args(model=tiny_model_dir, dataset=sft_rows, output_dir=str(tmp_path), max_steps=2, save_steps=1))
    run_dir = next(p for p in (tmp_path.iterdir()) if p.is_dir())
    assert not (run_dir / "final").exists() and not (run_dir / "checkpoints" / "step-1").exists()


def test_the_finite_check_before_a_save_holds_no_copy_of_a_weight():
    """check_finite runs before every save: torch.isfinite of a whole weight allocated |w| and three bool masks (a 64
    MiB |w| and 48 MiB of masks for this 64 MiB weight: a spike the size of an embedding at the end of a run). A chunk
    at a time no tensor it makes reaches 8 MiB, and it still finds a NaN or an Inf in the last element, or a NaN in a
    bf16 weight."""
    from torch.profiler import ProfilerActivity, profile

    from harness.checkpoints import all_finite, check_finite

    model = torch.nn.Embedding(4096, 4096)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        check_finite(model)
    largest = max(e.cpu_memory_usage for e in prof.events())  # the largest tensor an op made (old: |w|, 64 MiB)
    assert largest < 8 * 2**20, f"the check made a {largest / 2**20:.0f} MiB tensor for a 64 MiB weight"
    for bad in (math.nan, math.inf, -math.inf):
        with torch.no_grad():
            model.weight[-1, -1] = bad
        with pytest.raises(NonFiniteWeightsError, match="1 weight tensors hold NaN/Inf .e.g. weight."):
            check_finite(model)
        model.weight.data[-1, -1] = 0.0
    half = torch.zeros(3 * 2**20 + 7, dtype=torch.bfloat16)
    assert all_finite(half) and all_finite(torch.arange(5)) and all_finite(torch.empty(0))
    half[-1] = math.nan
    assert not all_finite(half)


def test_breaker_stop_exits_non_zero_with_one_line(tiny_model_dir, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"Count to {i}"} for i in range(8)])
    done = cli.run(
        [
            sys.executable,
            "grpo.py",
            "--preset",
            "demo",
            "--model",
            tiny_model_dir,
            "--dataset",
            prompts,
            "--rewards",
            "tests.test_grpo:constant",
            "--max-steps",
            "3",
            "--group-size",
            "2",
            "--max-completion-length",
            "4",
            "--breaker-patience",
            "1",
            "--output-dir",
            str(tmp_path / "runs"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    # the breakers that tripped are listed together (4-token completions may also pin the length breaker)
    assert re.search(r"\(circuit breaker [a-z_, ]*reward_std_zero", last), last
    assert "resume with --resume-from-checkpoint" in last
    assert "Traceback" not in done.stderr
    run_dir = next((tmp_path / "runs").iterdir())
    assert (run_dir / "checkpoints" / "step-1").is_dir() and not (run_dir / "final").exists()


def test_ctrl_c_saves_at_the_step_boundary_and_prints_the_resume_command(tiny_model_dir, sft_rows, tmp_path):
    """It used to die with a KeyboardInterrupt traceback inside Adam, losing up to save_steps steps; then it printed
    `sft.py: error: sft: stopped ...` with status 1, though a stop the user asks for is no error."""
    runs = tmp_path / "runs"
    cmd = [
        sys.executable,
        "sft.py",
        "--model",
        tiny_model_dir,
        "--dataset",
        sft_rows,
        "--max-steps",
        "100000",
        "--per-device-train-batch-size",
        "2",
        "--save-steps",
        "0",
        "--output-dir",
        str(runs),
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # wait until a few steps are logged
        logged = list(runs.glob("*/metrics.jsonl"))
        if logged and len(logged[0].read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]  # an interrupt's status, as a second Ctrl-C's
    last = err.strip().splitlines()[-1]  # a stop the user asked for is no error
    assert last.startswith("sft: stopped at step") and "(Ctrl-C)" in last and "error" not in err, err[-2000:]
    assert "Traceback" not in err
    run_dir = next(runs.iterdir())
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    checkpoint = run_dir / "checkpoints" / f"step-{steps[-1]}"  # the last finished step, nothing lost
    assert checkpoint.is_dir() and f"--resume-from-checkpoint {checkpoint}" in err
    assert not (run_dir / "final").exists()


def test_ctrl_c_on_a_save_step_keeps_the_checkpoint_it_just_wrote(tiny_model_dir, prefs, tmp_path, monkeypatch):
    """The stop saved the step again right after the loop's save of it; a save deletes an existing step-N before
    renaming the new one into place, so with --save-total-limit 1 a kill in between left no checkpoint."""

    import dpo
    from harness.checkpoints import COMPLETE, Checkpoints

    saves = []
    save = Checkpoints.save

    def recorded(self, step, *a, **k):  # the loop's saves and the stop's own
        saves.append(step)
        return save(self, step, *a, **k)

    monkeypatch.setattr(Checkpoints, "save", recorded)
    monkeypatch.setattr(dpo, "StopOnCtrlC", pressed)
    args = dpo.Args(model=tiny_model_dir, dataset=prefs, output_dir=str(tmp_path), max_steps=3, save_steps=1)
    with pytest.raises(RunStopped) as stopped:
        dpo.main(dataclasses.replace(args, save_total_limit=1))
    assert stopped.value.step == 1 and saves == [1]  # the loop's save of step 1, and no second one by the stop
    assert os.path.isfile(os.path.join(stopped.value.checkpoint, COMPLETE))


def pressed():
    """A StopOnCtrlC as after a Ctrl-C (its handler installed as the real one's)."""
    from harness.cli import StopOnCtrlC

    interrupt = StopOnCtrlC()
    interrupt.requested = True
    return interrupt


LAST_STEP = {  # one step on each script's own kind of rows
    "sft": dict(dataset="builtin:math_sft"),
    "kto": dict(dataset="builtin:math_binary", per_device_train_batch_size=4),
    "grpo": dict(dataset="builtin:math", group_size=2, prompts_per_step=1, max_completion_length=4),
}


@pytest.mark.parametrize("script", ["dpo", "orpo", "rm", "sft", "kto", "grpo"])
def test_ctrl_c_during_the_last_step_finishes_the_run(script, tiny_model_dir, prefs, tmp_path, monkeypatch):
    """A Ctrl-C in the last step raised RunStopped with a checkpoint at total_steps, which --resume-from-checkpoint
    refuses (no steps left): the run could neither finish nor resume, and final/ was never written."""

    module = importlib.import_module(script)
    monkeypatch.setattr(module, "StopOnCtrlC", pressed)
    kw = dict(model=tiny_model_dir, output_dir=str(tmp_path), max_steps=1, save_steps=0, preset="demo")
    out = module.main(module.Args(**kw | LAST_STEP.get(script, dict(dataset=prefs))))
    assert os.path.isfile(os.path.join(out["final_dir"], "adapter_model.safetensors"))
    assert [h["step"] for h in out["history"]] == [1]


@pytest.mark.parametrize("script", ["dpo", "orpo", "rm"])
def test_an_eval_split_of_a_single_file_is_refused(script, prefs, tmp_path):
    """load_rows reads a whole file whatever the split, so --eval-split test on prefs.jsonl logged eval/* metrics of
    the training rows themselves as if held out."""
    module = importlib.import_module(script)
    args = module.Args(model=str(tmp_path / "no-such-model"), dataset=prefs, eval_split="test", eval_steps=1)
    with pytest.raises(ArgsError, match=r"^--eval-split test: .*prefs\.jsonl is one file"):
        module.main(args)
    # the training rows themselves, asked for by name, are still an eval set
    with pytest.raises(Exception) as failed:
        module.main(dataclasses.replace(args, eval_split="train"))
    assert not isinstance(failed.value, ArgsError)


@pytest.mark.parametrize("script", ["dpo", "orpo", "rm"])
def test_eval_steps_without_an_eval_split_is_refused(script, prefs, tmp_path):
    """--eval-steps with no --eval-split ran no eval at all, silently (TRL refuses eval_strategy without a dataset)."""
    module = importlib.import_module(script)
    args = module.Args(model=str(tmp_path / "no-such-model"), dataset=prefs, eval_steps=5)
    with pytest.raises(ArgsError, match=r"^--eval-steps 5: .*--eval-split"):
        module.main(args)


@pytest.mark.parametrize("script", ["sft", "orpo", "dpo", "kto", "rm", "grpo", "raft"])
def test_what_full_fine_tuning_cannot_take_is_refused_before_loading(script, tmp_path):
    """sft.py and orpo.py dropped an --adapter given with --no-use-lora without a word (the other scripts refused it);
    every script now refuses it, and a quantized base, in one shared check (harness.cli.check_model_flags)."""
    module = importlib.import_module(script)
    common = dict(model=str(tmp_path / "no-such-model"), output_dir=str(tmp_path), use_lora=False)
    with pytest.raises(ArgsError, match=r"^--adapter some/adapter with --no-use-lora: merge it first"):
        module.main(module.Args(**common, adapter="some/adapter"))
    with pytest.raises(ArgsError, match=r"^--quantization 4bit with --no-use-lora: a quantized base trains only"):
        module.main(module.Args(**common, quantization="4bit"))

"""The two sets of defaults: `python grpo.py` is the CPU demo it always was; the user's own command,
`python grpo.py --model Qwen/Qwen2.5-1.5B --group-size 4`, resolves to the GSM8K experiment. Both resolve before any
weights load, are printed at the start and saved in args.json; the GSM8K path runs end to end on the shared files."""

import dataclasses
import json
import os
import re

import pytest
import torch
import tyro
from tyro._docstrings import get_field_docstring

import dpo
import grpo
import kto
import orpo
import raft
import rm
import sft
from harness.cli import resolve_preset
from harness.held_out import eval_source

# grpo.py's defaults before the presets existed (the demo run in docs/results.md): the demo must resolve to
# exactly these.
DEMO_BEFORE = dict(
    dataset="builtin:math",
    prompts_per_step=2,
    max_completion_length=64,
    temperature=0.7,
    learning_rate=3e-4,
    max_steps=20,
    warmup_steps=0,
    lr_scheduler_type="constant",
    weight_decay=0.0,
    max_grad_norm=1.0,
    eval_steps=0,
    group_size=8,
    beta=0.04,
    loss_type="dapo",
    engine="hf",
)


def resolved(module, argv):
    return resolve_preset(tyro.cli(module.Args, args=argv), module.PRESETS)


def test_no_arguments_is_still_the_cpu_demo():
    args = resolved(grpo, [])
    assert args.preset == "demo" and args.model == "smollm2-135m"
    assert {k: getattr(args, k) for k in DEMO_BEFORE} == DEMO_BEFORE
    assert args.save_steps == 10  # new: a checkpoint every 10 of the 20 steps (issue: no checkpoints by default)


def test_the_headline_command_resolves_to_the_gsm8k_experiment():
    args = resolved(grpo, ["--model", "Qwen/Qwen2.5-1.5B", "--group-size", "4"])
    assert args.preset == "gsm8k" and args.group_size == 4
    expected = dict(
        dataset="openai/gsm8k:main",
        dataset_split="train",
        eval_split="test",
        eval_steps=50,
        eval_limit=250,
        max_completion_length=512,
        prompts_per_step=8,
        max_steps=250,
        temperature=1.0,
        learning_rate=5e-6,
        warmup_steps=25,
        lr_scheduler_type="cosine",
        weight_decay=0.1,
        max_grad_norm=0.1,
        save_steps=50,
        groups_per_micro_batch=None,  # on a GPU the most groups the plan fits; on a CPU 1
        beta=0.04,
        engine="hf",
    )
    assert {k: getattr(args, k) for k in expected} == expected
    assert all(getattr(args, k) is not None for k in grpo.PRESETS["gsm8k"])


def test_explicit_flags_win_over_the_preset_and_the_preset_can_be_forced():
    args = resolved(grpo, ["--model", "Qwen/Qwen2.5-1.5B", "--max-completion-length", "300", "--max-steps", "40"])
    assert (args.max_completion_length, args.max_steps, args.prompts_per_step) == (300, 40, 8)
    assert resolved(grpo, ["--preset", "gsm8k"]).dataset == "openai/gsm8k:main"  # the embedded model, real data
    assert resolved(grpo, ["--model", "some/model", "--preset", "demo"]).max_completion_length == 64


def field_docs(module) -> dict[str, str]:
    """Each Args field's help as tyro shows it under --help (tyro's own reader of the comment on or above it)."""
    return {
        f.name: " ".join(get_field_docstring(module.Args, f.name, ()).split()) for f in dataclasses.fields(module.Args)
    }


SCRIPTS = [grpo, raft, sft, dpo, orpo, kto]


@pytest.mark.parametrize("module", SCRIPTS, ids=[m.__name__ for m in SCRIPTS])
def test_every_preset_field_defaults_to_none_and_its_help_states_both_values(module):
    (other,) = set(module.PRESETS) - {"demo"}
    demo, real = module.PRESETS["demo"], module.PRESETS[other]
    assert demo.keys() == real.keys()
    docs, fields = field_docs(module), module.Args.__dataclass_fields__
    for key in demo:
        assert fields[key].default is None, key
        for name, value in (("demo", demo[key]), (other, real[key])):
            shown = re.search(rf"{name}: ([^;),]+)", docs[key])
            assert shown, (key, name, docs[key])
            text = shown.group(1).strip()
            assert text == str(value) or (isinstance(value, float) and float(text) == value), (key, name, text, value)


def test_raft_presets():
    assert resolved(raft, []).dataset == "builtin:math" and resolved(raft, []).max_completion_length == 128
    real = resolved(raft, ["--model", "Qwen/Qwen2.5-1.5B"])
    assert (real.dataset, real.eval_dataset, real.max_completion_length) == ("openai/gsm8k:main",) * 2 + (512,)


def test_the_gsm8k_path_runs_end_to_end_on_the_shared_files(tiny_model_dir, shared_data, tmp_path, capsys):
    """The real experiment's code path (GSM8K rows, held-out accuracy before, during and after, the summary), cut down
    only through flags; the model is the tiny test model (a real one cannot be downloaded here)."""
    gsm8k = shared_data / "gsm8k"
    out = grpo.main(
        grpo.Args(
            preset="gsm8k",
            model=tiny_model_dir,
            dataset=str(gsm8k / "train.jsonl"),
            eval_dataset=str(gsm8k / "test.jsonl"),
            eval_limit=4,
            eval_steps=1,
            max_steps=2,
            prompts_per_step=2,
            group_size=2,
            max_completion_length=8,
            output_dir=str(tmp_path),
            max_prompt_length=4096,
        )
    )
    printed = capsys.readouterr().out
    assert "grpo: preset gsm8k" in printed and "7473 prompts" in printed and "eval: 4 of" in printed
    logged = [json.loads(line) for line in open(os.path.join(out["run_dir"], "metrics.jsonl"))]
    assert [row["step"] for row in logged if "eval/gsm8k/accuracy" in row] == [0, 1, 2]
    assert "eval/gsm8k/accuracy" in printed.splitlines()[-1]  # the final summary line
    saved = json.load(open(os.path.join(out["run_dir"], "args.json")))
    assert saved["preset"] == "gsm8k" and saved["learning_rate"] == 5e-6 and saved["lr_scheduler_type"] == "cosine"
    assert all(saved[k] is not None for k in grpo.PRESETS["gsm8k"])


def test_a_local_train_file_runs_without_an_eval_set(tmp_path):
    """TRL trains without an eval_dataset: a file (no test split) under the gsm8k preset runs without the eval and
    the start-up block says how to add one; only what is really missing (here the model) stops the run, after the
    rows are read and before anything loads."""
    rows = tmp_path / "train.jsonl"
    rows.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n")
    args = grpo.Args(model=str(tmp_path / "no-model"), dataset=str(rows), output_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"^model '\S+no-model': no such local folder"):
        grpo.main(args)
    args = grpo.resolve_preset(args, grpo.PRESETS)
    assert eval_source(args.dataset, args.eval_dataset) is None and args.eval_steps == 50
    data = grpo.config_lines(args, 1, 0, None)["data"]
    assert data.endswith(
        "1 prompts; no eval (a file has no test split: --eval-dataset FILE scores one every 50 steps)"
    )


@pytest.mark.parametrize(
    ("module", "demo", "real"),
    [
        (sft, "builtin:math_sft", "trl-lib/Capybara"),
        (dpo, "builtin:math_preference", "trl-lib/ultrafeedback_binarized"),
        (orpo, "builtin:math_preference", "trl-lib/ultrafeedback_binarized"),
        (kto, "builtin:math_binary", "trl-lib/kto-mix-14k"),
        (rm, "builtin:math_preference", "trl-lib/ultrafeedback_binarized"),
    ],
    ids=["sft", "dpo", "orpo", "kto", "rm"],
)
def test_other_scripts_train_on_real_data_for_a_real_model(module, demo, real):
    """The built-in math sets are demo-sized: any other --model gets the dataset of TRL's own example for it."""
    assert resolved(module, []).dataset == demo
    assert resolved(module, ["--model", "Qwen/Qwen2.5-1.5B"]).dataset == real
    assert resolved(module, ["--model", "Qwen/Qwen2.5-1.5B", "--dataset", "mine.jsonl"]).dataset == "mine.jsonl"


@pytest.mark.parametrize("module", [sft, dpo, orpo, kto, rm], ids=["sft", "dpo", "orpo", "kto", "rm"])
def test_every_script_prints_its_resolved_config_before_loading(module, tmp_path, capsys):
    """The block comes before the model loads: here the model does not exist, and the block is printed all the same."""
    data = module.PRESETS["demo"]["dataset"]  # a built-in set: the hub is out of reach here
    with pytest.raises(Exception, match="no-model"):
        module.main(module.Args(model=str(tmp_path / "no-model"), dataset=data, output_dir=str(tmp_path), max_steps=3))
    printed = capsys.readouterr().out
    name = module.__name__
    # any other model: the trl preset, with the demo's data given here instead of its own
    assert f"{name}: preset trl (its settings, your dataset), model {tmp_path / 'no-model'}" in printed
    assert "3 steps x " in printed and "a checkpoint every 100 steps" in printed


def test_a_run_on_your_own_data_is_not_labelled_the_demo_and_shows_its_resolved_dtype():
    """The start-up block names the preset a run took its settings from, and says so when --dataset replaced the
    preset's data; the backend line gives the dtype the weights load in (as grpo.py's does), not `auto`."""
    from harness.cli import preset_label, training_lines

    demo = resolve_preset(sft.Args(), sft.PRESETS)
    mine = resolve_preset(sft.Args(dataset="mine.jsonl"), sft.PRESETS)
    assert (demo.preset, mine.preset) == ("demo", "demo")  # args.json keeps a replayable --preset
    assert preset_label(demo, sft.PRESETS) == "demo"
    assert preset_label(mine, sft.PRESETS) == "demo (its settings, your dataset)"
    expected = "torch.bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "torch.float32"
    assert training_lines(demo, 10)["backend"].startswith(f"dtype {expected},")

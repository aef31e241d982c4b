"""--optim adamw_torch | adamw_8bit in every script (transformers' names): the 8-bit optimizer is what transformers'
Trainer builds for adamw_8bit, its moments really are 8-bit, they go through a checkpoint and a resume exactly, the
choice is part of the run's identity, and a missing bitsandbytes is one line before any weights load."""

import dataclasses
import importlib
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import sft
from harness.errors import ResumeError
from plugins.quantization import adamw_8bit
from harness.memory import MIN_8BIT
from tests.conftest import ROOT
from tests.prefs_helpers import preference_rows, write_jsonl
from tests.test_memory import QUICK
from tests.test_resume_exact import WALL_CLOCK, args_for

bnb = pytest.importorskip("bitsandbytes")  # CI installs it (requirements-cpu-extras.txt)

SCRIPTS = ["sft", "dpo", "orpo", "kto", "rm", "grpo", "raft"]
R = 64  # LoRA rank: the tiny model's A and B of q, o, gate, up, down reach bitsandbytes' 4,096-element minimum


def moments(optimizer) -> dict[torch.nn.Parameter, dict]:
    """Each trained tensor's state as its optimizer holds it."""
    return {p: optimizer.state[p] for group in optimizer.param_groups for p in group["params"] if p in optimizer.state}


def test_adamw_8bit_is_what_transformers_builds_for_it(tiny_model_dir):
    """TrainingArguments(optim="adamw_8bit"): bitsandbytes' AdamW, optim_bits 8, not paged, torch's betas and eps,
    and Trainer.create_optimizer's 32-bit override of every nn.Embedding weight."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(
        TrainingArguments(output_dir="unused", optim="adamw_8bit", learning_rate=3e-4)
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = adamw_8bit(model, params, 3e-4, 0.1)
    assert type(optimizer) is cls
    group = optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"]) == (kwargs["lr"], kwargs["betas"], kwargs["eps"])
    assert group["weight_decay"] == 0.1  # Trainer passes it through its parameter groups; ours has one group
    assert (optimizer.args.optim_bits, optimizer.is_paged) == (kwargs["optim_bits"], kwargs["is_paged"]) == (8, False)
    assert optimizer.args.min_8bit_size == MIN_8BIT
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    state = moments(optimizer)
    embedding = model.get_input_embeddings().weight
    assert state[embedding]["state1"].dtype == torch.float32 and embedding.numel() >= MIN_8BIT
    assert state[model.lm_head.weight]["state1"].dtype == torch.uint8  # untied: a Linear, 8-bit as in Trainer


def test_a_second_model_in_the_process_gets_no_stale_override(tiny_model_dir):
    """bitsandbytes keys its per-tensor overrides by id(): a freed model's embedding entry must not make a new
    model's tensor 32-bit (or a stale one 8-bit) when Python reuses the id."""
    from transformers import AutoModelForCausalLM

    first = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    adamw_8bit(first, list(first.parameters()), 1e-3, 0.0)
    manager = bnb.optim.GlobalOptimManager.get_instance()
    assert set(manager.pid2config) == {id(first.get_input_embeddings().weight)}
    second = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    adamw_8bit(second, list(second.parameters()), 1e-3, 0.0)
    assert set(manager.pid2config) == {id(second.get_input_embeddings().weight)}


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_trains_with_8bit_moments(script, tiny_model_dir, tmp_path, monkeypatch):
    """--optim adamw_8bit builds bitsandbytes' optimizer (raft.py: in each phase) and, after its steps, every trained
    tensor of >= 4,096 elements holds uint8 moments with an fp32 absmax per 256 elements; smaller ones fp32."""
    module = importlib.import_module(script)
    built = []

    def recorded(*a, **k):
        built.append(adamw_8bit(*a, **k))
        return built[-1]

    monkeypatch.setattr(module, "adamw_8bit", recorded)
    args = module.Args(model=tiny_model_dir, preset="demo", output_dir=str(tmp_path), **QUICK[script])
    module.main(dataclasses.replace(args, optim="adamw_8bit", lora_r=R, lora_alpha=2 * R))
    assert len(built) == (2 if script == "raft" else 1)  # raft: a fresh optimizer for its SFT and its DPO phase
    for optimizer in built:
        state = moments(optimizer)
        assert state and all(s["step"] >= 1 for s in state.values())
        big = [s for p, s in state.items() if p.numel() >= MIN_8BIT]
        small = [s for p, s in state.items() if p.numel() < MIN_8BIT]
        assert big and small
        for p, s in state.items():
            eight = p.numel() >= MIN_8BIT
            assert s["state1"].dtype == s["state2"].dtype == (torch.uint8 if eight else torch.float32)
            assert s["state1"].shape == p.shape
            if eight:
                assert s["absmax1"].shape == s["absmax2"].shape == (-(-p.numel() // 256),)


@pytest.mark.parametrize("script, kw", [("sft", dict(use_lora=False)), ("dpo", dict(lora_r=R, lora_alpha=2 * R))])
def test_an_8bit_run_resumes_exactly(script, kw, tiny_model_dir, tmp_path):
    """4 steps straight vs 2 + a resume of 2 (sft: full fine-tuning, the embedding's fp32 moments among them; dpo:
    LoRA): the same history after step 2, and at step 4 the same weights and optimizer state, 8-bit codes and absmax
    included, bit for bit (the same code path run twice)."""
    prefs = write_jsonl(tmp_path / "prefs.jsonl", preference_rows(8))
    module, args = args_for(script, tiny_model_dir, prefs, tmp_path / "a", max_steps=4, save_steps=2, **kw)
    args = dataclasses.replace(args, optim="adamw_8bit", learning_rate=1e-3)
    straight = module.main(args)
    ckpt = os.path.join(
        shutil.copytree(straight["run_dir"], tmp_path / "b"), "checkpoints", "step-2"
    )  # resumed in place
    resumed = module.main(dataclasses.replace(args, resume_from_checkpoint=ckpt))

    def logged(history):
        return [{k: v for k, v in h.items() if not k.startswith(WALL_CLOCK)} for h in history if h["step"] > 2]

    assert [h["step"] for h in logged(resumed["history"])] == [3, 4]
    assert logged(resumed["history"]) == logged(straight["history"])
    ends = [os.path.join(run["run_dir"], "checkpoints", "step-4") for run in (straight, resumed)]
    states = [torch.load(os.path.join(end, "state.pt"), weights_only=True)["optimizer"]["state"] for end in ends]
    assert states[0].keys() == states[1].keys()
    eight_bit = 0
    for key, saved in states[0].items():
        quant = saved["__bnb_optimizer_quant_state__"]
        again = states[1][key]["__bnb_optimizer_quant_state__"]
        assert saved["step"] == states[1][key]["step"] == 4
        assert quant.keys() == again.keys()
        assert all(torch.equal(quant[name], again[name]) for name in quant), key
        eight_bit += quant["state1"].dtype == torch.uint8
    assert eight_bit > 0
    for name in sorted(os.listdir(os.path.join(ends[0], "weights"))):
        if name.endswith(".safetensors"):
            first = load_file(os.path.join(ends[0], "weights", name))
            second = load_file(os.path.join(ends[1], "weights", name))
            assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_a_resume_with_another_optimizer_is_refused(tiny_model_dir, tmp_path):
    """The optimizer changes the math (and its state would not load into the other one): part of the identity."""
    base = sft.Args(model=tiny_model_dir, preset="demo", output_dir=str(tmp_path / "a"), max_steps=1, save_steps=1)
    base = dataclasses.replace(base, per_device_train_batch_size=2)
    first = sft.main(base)
    ckpt = os.path.join(first["run_dir"], "checkpoints", "step-1")
    again = dataclasses.replace(base, output_dir=str(tmp_path / "b"), max_steps=2, resume_from_checkpoint=ckpt)
    with pytest.raises(ResumeError, match="args.optim: saved 'adamw_torch', now 'adamw_8bit'"):
        sft.main(dataclasses.replace(again, optim="adamw_8bit"))


def refuse_load(*a, **k):
    raise AssertionError("the model was loaded")


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_missing_bitsandbytes_is_named_before_the_model_loads(script, tiny_model_dir, tmp_path, monkeypatch):
    module = importlib.import_module(script)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # importlib.util.find_spec then finds nothing
    monkeypatch.setattr(module, "load_model", refuse_load)
    args = module.Args(model=tiny_model_dir, preset="demo", output_dir=str(tmp_path), optim="adamw_8bit")
    with pytest.raises(ImportError) as e:
        module.main(args)
    assert str(e.value) == "--optim adamw_8bit needs the optional package 'bitsandbytes': pip install bitsandbytes"
    assert os.listdir(tmp_path) == []  # not even a run directory


def test_a_missing_bitsandbytes_is_one_line_on_the_command_line(tiny_model_dir, tmp_path):
    hide = "import sys, runpy; sys.modules['bitsandbytes'] = None; sys.argv = ['sft.py', *sys.argv[1:]]; "
    run = hide + "runpy.run_path('sft.py', run_name='__main__')"
    cmd = [
        sys.executable,
        "-c",
        run,
        "--model",
        tiny_model_dir,
        "--optim",
        "adamw_8bit",
        "--output-dir",
        str(tmp_path),
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "sft.py: error: --optim adamw_8bit needs the optional package 'bitsandbytes': pip install bitsandbytes"
    ]
    assert os.listdir(tmp_path) == []

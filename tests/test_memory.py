"""The memory planner: each part on a hand-computed config from a script's declared passes (and each script's own
declaration giving the same plan), LoRA counts equal to PEFT's, --plan, the refusal and checkpointing to fit."""

import dataclasses
import importlib
import inspect
import json
import math
import os
import re
import sys

import pytest
import torch

import dpo
import grpo
import rm
import sft
from common.errors import ArgsError, ModelError
from harness import memory
from harness.memory import CPU_RUNTIME, Pass, Trained, adamw_state_bytes, estimate, lora_params, param_counts
from harness.memory import trained_tensors
from tests.conftest import ROOT, python_as_launched
from tests import cli
from tests.prefs_helpers import write_jsonl

# L 2, H 8, intermediate F 16, 2 heads of 4 (Hq 8), 1 kv head (K 4), vocab 32, untied, no attention bias
CFG = dict(model_type="llama", num_hidden_layers=2, hidden_size=8, intermediate_size=16, num_attention_heads=2,
           num_key_value_heads=1, vocab_size=32, tie_word_embeddings=False)  # fmt: skip
LORA = dict(dtype="fp32", lora_r=2, lora_dropout=0.0, gradient_checkpointing=False, attn_implementation="sdpa")
SFT = LORA | dict(per_device_train_batch_size=2, max_length=4)
STEP = {"step": [Pass(2, 4, 8, grad=True)]}  # SFT's micro-batch: 2 rows x 4 tokens, all 8 through the head
RIGHT = {"step": [Pass(2, 4, 8, grad=True, padding_mask=False)]}  # the same, right-padded: sdpa's causal path
GRPO = LORA | dict(group_size=2, prompts_per_step=3, max_prompt_length=5, max_completion_length=6, engine="hf",
                   beta=0.04, num_iterations=1, groups_per_micro_batch=1, vllm_gpu_memory_utilization=0.3)  # fmt: skip


@pytest.fixture
def on_cpu(monkeypatch):
    """Plans as on a CPU with 1 TiB of RAM, whichever machine runs the tests."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(memory, "device_memory", lambda device: (2**40, "test RAM"))


def plan_of(module, monkeypatch, rows=(), **fields) -> dict:
    """The plan a script declares (its memory_plan) for Args(**fields) on the hand-computed CFG; rows are sized by
    their UTF-8 byte bound (no tokenizer is read, whatever is cached on the machine)."""
    monkeypatch.setattr(memory, "model_config", lambda name, trust=False: CFG)
    monkeypatch.setattr(memory, "local_tokenizer", lambda name, trust=False: None)
    return module.memory_plan(module.Args(**fields), list(rows))[0]


def test_param_counts_by_hand_and_on_a_real_model():
    # per layer q 8x8 + k, v 2 x 8x4 + o 8x8 + gate, up, down 3 x 8x16 = 576; embed + head 2 x 32x8; 5 norms of 8
    assert param_counts(CFG) == (2 * 576, 512 + 40)
    from tests.tiny import build_tiny_model

    model = build_tiny_model(400)  # Qwen2: q/k/v biases count as linear parameters
    assert sum(param_counts(model.config.to_dict())) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("r", [2, 16])
def test_lora_count_equals_peft(tiny_model_dir, r):
    """attach_lora (all-linear) on the tiny model: exactly the trainable parameters PEFT creates."""
    from transformers import AutoModelForCausalLM

    from common.model import attach_lora

    model = attach_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), r=r, alpha=2 * r)
    peft_count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_params(model.config.to_dict(), r) == peft_count
    # by hand on CFG, r 2: per layer q (8+8) + k, v 2 x (8+4) + o (8+8) + gate, up 2 x (8+16) + down (16+8) = 128
    assert lora_params(CFG, 2) == 2 * 2 * 128


def test_each_part_of_an_sft_plan_by_hand(monkeypatch, on_cpu):
    p = estimate(CFG, Trained("fp32", None, 2), STEP, device="cpu")
    assert (
        p["weights"] == 1704 * 4 and p["LoRA + grads + AdamW"] == 512 * 16 and p["allowance (runtime)"] == CPU_RUNTIME
    )
    # per token and layer: 2 fp32 norm inputs 2x8x4 + 4 x (2 normed 16 + q, k, v at all heads 24 + attention out 8
    # + 4 x 16) + lora_B inputs 7 x 2 x 4 = 568; 8 tokens + the float mask 2x4x4x4 = 4,672 per layer, x 2 layers,
    # + final norm in/out 8x8x8 + the 8 scored rows 8x8x4
    assert p["step: activations"] == 2 * (568 * 8 + 128) + 512 + 256
    assert p["step: layer working set"] == 8 * (16 + 48) * 4 + 128  # a layer's grads + the model's own mask
    # two (8, 32) fp32 chunks + the rows' fp32 d logp / d h (a frozen head's, kept to backward) + their gradient
    assert p["step: log-prob buffer"] == 2 * 8 * 32 * 4 + 8 * 8 * (4 + 4)
    assert p["allocator (10 %)"] == int(0.1 * (6816 + 8192 + 10112 + 2176 + 2560)) == 2985
    assert p["total"] == 6816 + 8192 + CPU_RUNTIME + 14848 + 2985
    ckpt = estimate(CFG, Trained("fp32", None, 2), STEP, checkpointing=True, device="cpu")
    assert ckpt["step: activations"] == 2 * 8 * 8 * 4 + 512 + 256  # the layers' inputs (+ final norm, scored rows)
    # the backward recomputes one layer at a time: its activations join its gradients' working set
    assert ckpt["step: layer working set"] == p["step: layer working set"] + 568 * 8 + 128
    assert ckpt["step: log-prob buffer"] == p["step: log-prob buffer"]
    # the head's chunks are freed before the first recompute, the rows' d logp / d h (8 x 8 x (4 + 4)) stays: the
    # larger of the working set and the rest of the buffer counts, not their sum
    held = 6816 + 8192 + CPU_RUNTIME + 2 * 8 * 8 * 4 + 512 + 256
    rows = 8 * 8 * (4 + 4)
    top = rows + max(ckpt["step: layer working set"], ckpt["step: log-prob buffer"] - rows)
    assert top == 512 + 6848 < ckpt["step: layer working set"] + ckpt["step: log-prob buffer"]
    assert ckpt["total"] == held + top + int(0.1 * (held - CPU_RUNTIME + top))
    # sequence_logps runs a padded batch group by group: a layer's working set (and its recompute) is one group's
    halves = {"step": [Pass(2, 4, 8, grad=True, group=4)]}
    half = estimate(CFG, Trained("fp32", None, 2), halves, device="cpu")
    assert half["step: activations"] == p["step: activations"]  # every group's activations wait for the backward
    assert half["step: layer working set"] == 4 * (16 + 48) * 4 + 128
    half_ckpt = estimate(CFG, Trained("fp32", None, 2), halves, checkpointing=True, device="cpu")
    assert half_ckpt["step: layer working set"] == 4 * (16 + 48) * 4 + 128 + 568 * 4 + 128
    drop = estimate(CFG, Trained("fp32", None, 2, dropout=True), STEP, device="cpu")
    # + a dropped copy of each LoRA module's input (q, k, v, gate, up: 8; o: 8; down: 16) and its bool mask
    assert drop["step: activations"] - p["step: activations"] == 2 * 8 * (6 * 8 + 16) * 5
    # sft.py declares these passes with right-padded rows (no float mask: common.model.sequence_logps runs them on
    # sdpa's causal path): its own plan of the same run is the hand-computed one less the mask in each layer
    right = estimate(CFG, Trained("fp32", None, 2), RIGHT, device="cpu")
    assert right["step: activations"] == p["step: activations"] - 2 * 128
    assert right["step: layer working set"] == p["step: layer working set"] - 128
    assert plan_of(sft, monkeypatch, **SFT) == right
    ckpt_right = estimate(CFG, Trained("fp32", None, 2), RIGHT, checkpointing=True, device="cpu")
    assert plan_of(sft, monkeypatch, **SFT | dict(gradient_checkpointing=True)) == ckpt_right
    drop_right = estimate(CFG, Trained("fp32", None, 2, dropout=True), RIGHT, device="cpu")
    assert plan_of(sft, monkeypatch, **SFT | dict(lora_dropout=0.1)) == drop_right
    assert drop_right["step: activations"] - right["step: activations"] == 2 * 8 * (6 * 8 + 16) * 5


def test_weights_by_dtype_quantization_and_full_fine_tuning(monkeypatch, on_cpu):
    bf16 = estimate(CFG, Trained("bf16", None, 2), STEP, device="cuda")
    assert bf16["weights"] == 1704 * 2 and bf16["allowance (runtime)"] == memory.CUDA_CONTEXT
    assert bf16["step: log-prob buffer"] == 2 * 8 * 32 * 4 + 32 * 8 * 4 + 8 * 8 * (4 + 2)  # + the head cast to fp32
    q4 = estimate(CFG, Trained("bf16", "4bit", 2), STEP, device="cuda")
    assert q4["weights"] == int(1152 * (0.5 + 1 / 64 + 4 / 16384) + 552 * 4)  # NF4 linears, the rest in fp32
    full = estimate(CFG, Trained("fp32", None, None), RIGHT, device="cpu")
    assert full["grads + AdamW (full)"] == 1704 * 3 * 4 and "LoRA + grads + AdamW" not in full
    assert plan_of(sft, monkeypatch, **SFT | dict(use_lora=False)) == full  # sft.py --no-use-lora


# L 1, H 64, F 128, 4 heads of 16 (Hq 64), 2 kv heads (K 32), vocab 100, untied: tensors on both sides of 4,096
CFG64 = dict(model_type="llama", num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=100, tie_word_embeddings=False)  # fmt: skip


@pytest.mark.parametrize("tied", [False, True])
def test_trained_tensors_are_the_models_tensors(tied, tiny_model_dir):
    """Tensor by tensor (the 4,096-element threshold is per tensor): every weight of the tiny Qwen2 (q/k/v biases, a
    tied or untied head), or the LoRA tensors PEFT creates; the nn.Embedding weight flagged."""
    from common.model import attach_lora, trainable_parameters
    from tests.tiny import build_tiny_model

    def expanded(tensors):
        return sorted((n, embedding) for n, count, embedding in tensors for _ in range(count))

    model = build_tiny_model(400, tie_word_embeddings=tied)
    cfg = model.config.to_dict()
    embedding = model.get_input_embeddings().weight
    assert expanded(trained_tensors(cfg, None)) == sorted((p.numel(), p is embedding) for p in model.parameters())
    lora = trainable_parameters(attach_lora(model, r=8, alpha=16))
    assert expanded(trained_tensors(cfg, 8)) == sorted((p.numel(), False) for p in lora)
    assert sum(n * k for n, k, _ in trained_tensors(CFG, None)) == sum(param_counts(CFG))
    assert sum(n * k for n, k, _ in trained_tensors(CFG, 2)) == lora_params(CFG, 2)


def test_optimizer_state_by_hand(monkeypatch, on_cpu):
    """adamw_torch: two moments in the weights' dtype. adamw_8bit: per moment a uint8 code and an fp32 absmax per 256
    elements in a tensor of >= 4,096 elements, two fp32 moments in a smaller one and in the embedding."""
    # CFG64, every weight: 8-bit q, o 64x64, gate, up, down 64x128 and the head 100x64 (39,168 elements, 153 blocks of
    # 256); fp32 k, v 32x64, 3 norms of 64 and the embedding 100x64 (10,688 elements); 49,856 in all
    assert sum(param_counts(CFG64)) == 49856
    full8 = estimate(CFG64, Trained("fp32", None, None, optim="adamw_8bit"), STEP, device="cpu")
    assert full8["grads + AdamW 8-bit (full)"] == 49856 * 4 + 2 * (39168 + 4 * 153) + 8 * 10688
    bf16 = estimate(CFG64, Trained("bf16", None, None, optim="adamw_8bit"), STEP, device="cuda")
    assert bf16["grads + AdamW 8-bit (full)"] == 49856 * 2 + 2 * (39168 + 4 * 153) + 8 * 10688  # fp32 moments stay
    torch_bf16 = estimate(CFG64, Trained("bf16", None, None), STEP, device="cuda")
    assert torch_bf16["grads + AdamW (full)"] == 49856 * (2 + 2 * 2)  # torch.optim.AdamW: moments in bf16
    assert "grads + AdamW (full)" not in full8 and "grads + AdamW 8-bit (full)" not in torch_bf16
    # LoRA r 32: 8-bit down's A 32x128 and gate's, up's B 128x32 (12,288 elements, 48 blocks); the rest of the 32,768
    # fp32 (A of q, k, v, o, gate, up 32x64, B of q, o, down 64x32, of k, v 32x32)
    assert lora_params(CFG64, 32) == 32768
    lora8 = estimate(CFG64, Trained("fp32", None, 32, optim="adamw_8bit"), STEP, device="cpu")
    assert lora8["LoRA + grads + AdamW 8-bit"] == 32768 * 8 + 2 * (12288 + 4 * 48) + 8 * 20480
    lora = estimate(CFG64, Trained("fp32", None, 32), STEP, device="cpu")
    assert lora["LoRA + grads + AdamW"] == 32768 * 16
    assert {k: v for k, v in lora8.items() if "AdamW" not in k and "total" not in k and "allocator" not in k} == {
        k: v for k, v in lora.items() if "AdamW" not in k and "total" not in k and "allocator" not in k
    }
    # on CFG every tensor is under 4,096 elements: 8-bit AdamW keeps fp32 moments throughout, as many bytes
    assert plan_of(sft, monkeypatch, **SFT | dict(optim="adamw_8bit"))["LoRA + grads + AdamW 8-bit"] == 512 * 16
    full = plan_of(sft, monkeypatch, **SFT | dict(use_lora=False, optim="adamw_8bit"))
    assert full["grads + AdamW 8-bit (full)"] == 1704 * 12


def held_state_bytes(state: dict) -> int:
    """Bytes of an optimizer state_dict's moments (torch: exp_avg, exp_avg_sq; bitsandbytes: state1, state2 and the
    absmax of 8-bit ones), not its step counters nor bitsandbytes' two shared 256-entry maps."""
    total = 0
    for s in state["state"].values():
        held = s.get("__bnb_optimizer_quant_state__", s)
        for name in ("exp_avg", "exp_avg_sq", "state1", "state2", "absmax1", "absmax2"):
            total += held[name].numel() * held[name].element_size() if name in held else 0
    return total


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_8bit"])
@pytest.mark.parametrize("lora", [True, False])
def test_the_planned_optimizer_state_is_what_the_optimizer_holds(optim, lora, tiny_model_dir, tmp_path, on_cpu):
    """One sft.py step on the tiny model (LoRA r 64 or every weight): the optimizer state in its checkpoint, byte for
    byte, is what the plan counts."""
    pytest.importorskip("bitsandbytes")
    args = sft.Args(model=tiny_model_dir, preset="demo", output_dir=str(tmp_path), max_steps=1, save_steps=1,
                    per_device_train_batch_size=2, optim=optim, use_lora=lora, lora_r=64, lora_alpha=128)  # fmt: skip
    run_dir = sft.main(args)["run_dir"]
    saved = torch.load(os.path.join(run_dir, "checkpoints", "step-1", "state.pt"), weights_only=True)["optimizer"]
    cfg = memory.model_config(tiny_model_dir)
    planned = adamw_state_bytes(trained_tensors(cfg, 64 if lora else None), optim, 4)
    assert held_state_bytes(saved) == planned
    plan = sft.memory_plan(args, [])[0]
    eight_bit = " 8-bit" if optim == "adamw_8bit" else ""
    part = f"LoRA + grads + AdamW{eight_bit}" if lora else f"grads + AdamW{eight_bit} (full)"
    # LoRA: the fp32 adapter and its gradient (the base is under weights); every weight: its gradient
    assert plan[part] == (lora_params(cfg, 64) * 8 if lora else sum(param_counts(cfg)) * 4) + planned


def test_dpo_reference_and_grpo_rollout_parts(monkeypatch, on_cpu):
    # 1 pair = 2 rows of 4: the same 8 tokens as the SFT case; dropout off (disable_dropout)
    p = plan_of(dpo, monkeypatch, **SFT | dict(per_device_train_batch_size=1, lora_dropout=0.05, disable_dropout=True))
    assert p["LoRA + grads + AdamW"] == 512 * 20  # + the frozen "ref" copy
    assert p["step: reference pass"] == 8 * (16 + 48) * 4 + 2 * 8 * 32 * 4  # no grad: working set + chunks
    assert p["step: activations"] == estimate(CFG, Trained("fp32", None, 2), RIGHT, device="cpu")["step: activations"]
    g = plan_of(grpo, monkeypatch, **GRPO)
    # 6 rows x 11 positions x 2 layers x k, v of 4 x 4 bytes + prefill 3 x 5 x (16 + 48) x 4 + 6 x 32 x 4 x 2 logits;
    # on a CPU in fp32 also the rollout's packed copy of every Linear weight (common.rollout.merged_linears): the
    # decoder's linears (2 x 576) and the head (vocab 32 x H 8), 4 bytes each
    packed = (2 * 576 + 32 * 8) * 4
    assert g["rollout: KV cache + packed weights"] == 4224 + 3840 + 1536 + packed
    assert "reference: no-grad pass" in g and "reference: no-grad pass" not in plan_of(
        grpo, monkeypatch, **GRPO | dict(beta=0.0)
    )
    # vLLM takes its share of the card instead (a CUDA card of 1,000 bytes here)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(memory, "device_memory", lambda device: (1000, "test card"))
    v = plan_of(grpo, monkeypatch, **GRPO | dict(engine="vllm", ignore_memory_plan=True))
    assert v["rollout: vLLM reservation"] == 300 and not [k for k in v if "KV cache" in k]


def test_grpo_with_checkpointing_asked_for_plans_the_whole_rows_it_runs(monkeypatch, on_cpu):
    """Under gradient checkpointing grpo.py scores whole prompt + completion rows (no shared prompt pass): a plan with
    --gradient-checkpointing given must declare those, as the plan that turns checkpointing on itself does."""
    on = plan_of(grpo, monkeypatch, **GRPO | dict(gradient_checkpointing=True))
    # 1 group of G 2 rows x (P 5 + C 6) tokens, C of each scored, with grad and entropy; checkpointing on
    whole = {"step": [Pass(2, 11, 12, grad=True, entropy=True)]}
    expected = estimate(CFG, Trained("fp32", None, 2, frozen_copies=1), whole, checkpointing=True, device="cpu")
    for key in ("step: activations", "step: layer working set", "step: log-prob buffer"):
        assert on[key] == expected[key], key


def test_rm_regression_batches_rows_not_pairs(monkeypatch, on_cpu):
    """rm.py --loss-type regression puts per_device_train_batch_size rows in a forward (bradley_terry: 2 per pair)."""
    rows2 = plan_of(rm, monkeypatch, **SFT | dict(loss_type="regression"))
    pair1 = plan_of(rm, monkeypatch, **SFT | dict(per_device_train_batch_size=1))
    assert rows2["step: activations"] == pair1["step: activations"] > 0
    assert rows2["step: log-prob buffer"] == 0  # a reward model's head is H -> 1: no vocabulary logits


@pytest.mark.parametrize("bf16", [True, False])
def test_auto_dtype_is_planned_as_load_model_resolves_it(bf16, tiny_model_dir, monkeypatch):
    """--dtype auto on a CUDA card without bf16 (V100, T4) loads fp32 weights: the plan must count 4 bytes each."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    monkeypatch.setattr(memory, "device_memory", lambda device: (2**40, "test card"))
    auto = sft.memory_plan(sft.Args(model=tiny_model_dir, dtype="auto"), [])[0]
    explicit = sft.memory_plan(sft.Args(model=tiny_model_dir, dtype="bf16" if bf16 else "fp32"), [])[0]
    assert auto["weights"] == explicit["weights"] and auto["total"] == explicit["total"]
    assert auto["weights"] == memory.weight_bytes(memory.model_config(tiny_model_dir), None, 2 if bf16 else 4)


def test_an_adapters_own_rank_is_planned(tiny_model_dir, tmp_path, on_cpu):
    """--adapter (sft.py's final/) keeps its own rank and dropout in the run, so the plan counts them, not --lora-r
    and --lora-dropout."""
    from common.model import attach_lora, load_model

    attach_lora(load_model(tiny_model_dir)[0], r=32, alpha=64, dropout=0.1).save_pretrained(str(tmp_path / "sft"))
    args = sft.Args(model=tiny_model_dir, adapter=str(tmp_path / "sft"), lora_r=4, lora_dropout=0.0)
    plan = sft.memory_plan(args, [])[0]
    cfg = memory.model_config(tiny_model_dir)
    assert plan["LoRA + grads + AdamW"] == lora_params(cfg, 32) * 16
    want = sft.memory_plan(dataclasses.replace(args, adapter=None, lora_r=32, lora_dropout=0.1), [])[0]
    assert plan["step: activations"] == want["step: activations"] and plan == want


def test_a_model_reward_is_in_the_plan(tiny_model_dir, tmp_path, on_cpu):
    """--rewards model:<dir>: a frozen fp32 LoRA slot on the policy's base, or its own base + LoRA loaded apart."""
    from tests.prefs_helpers import preference_rows, write_jsonl
    from tests.tiny import write_tiny

    prefs = write_jsonl(tmp_path / "prefs.jsonl", preference_rows(4))
    rm_args = rm.Args(model=tiny_model_dir, dataset=prefs, output_dir=str(tmp_path), max_steps=0, lora_r=4)
    final = rm.main(rm_args)["final_dir"]
    cfg = memory.model_config(tiny_model_dir)

    def plan(model, rewards):
        return grpo.memory_plan(grpo.Args(**GRPO | dict(model=model, rewards=rewards)), [])[0]

    plain = plan(tiny_model_dir, ["math"])
    slot = plan(tiny_model_dir, ["math", f"model:{final}:0.5"])
    assert "reward model (frozen)" not in plain and slot["reward model (frozen)"] == lora_params(cfg, 4) * 4
    other = write_tiny(tmp_path / "other", seed=1)  # another base: the reward model's own is loaded apart
    apart = plan(other, [f"model:{final}@reward"])  # fp32 on a CPU, as load_reward's dtype auto
    assert apart["reward model (frozen)"] == 4 * (sum(param_counts(cfg)) + lora_params(cfg, 4))
    assert apart["total"] > slot["total"] > plain["total"]


def test_longest_row_caps_the_planned_length(monkeypatch, on_cpu):
    rows = [{"prompt": "ab", "completion": "éé"}, {"prompt": [{"role": "user", "content": "abc"}], "chosen": "x"}]
    assert memory.longest_row(rows) == (2 + 16) + (4 + 16)  # UTF-8 bytes + 16 template tokens per text
    assert memory.longest_row([]) == 0  # no rows: no bound
    short = plan_of(sft, monkeypatch, rows, **SFT | dict(max_length=1000))
    assert short == plan_of(sft, monkeypatch, rows, **SFT | dict(max_length=38))  # rows of <= 38 tokens cap it
    assert short["step: activations"] != plan_of(sft, monkeypatch, **SFT | dict(max_length=1000))["step: activations"]


def test_model_config_reads_config_json_only(tiny_model_dir, tmp_path):
    assert memory.model_config(tiny_model_dir)["hidden_size"] == 64
    assert memory.model_config("smollm2-135m")["num_hidden_layers"] == 30  # written in the module: no cache build
    with pytest.raises(ModelError, match="no config.json"):
        memory.model_config(str(tmp_path))


def test_table_states_its_assumptions():
    from bench.capability_table import METHODS, capability_table

    out = capability_table([24, 48])
    assert "Qwen2.5-14B" in out and "2 rows x 1,024 tokens" in out and "gradient checkpointing on" in out
    assert "torch's AdamW unless 8-bit AdamW" in out
    fields = {s: {f.name for f in dataclasses.fields(importlib.import_module(s).Args)} for s in METHODS.values()}
    lora_only = [s for s, names in fields.items() if "use_lora" not in names]
    assert out.count("| n/a") == 5 * 2 * len(lora_only)  # no full fine-tuning: 5 sizes x 2 full rows each
    rows = [line for line in out.splitlines() if line.startswith("| Qwen2.5-")]
    assert len(rows) == 5 * 4  # sizes x (bf16 full, bf16 full with 8-bit AdamW, bf16 LoRA, QLoRA 4-bit)
    cells = [c.strip() for row in rows for c in row.strip("|").split("|")[2:]]
    assert len(cells) == 20 * 4 and all(re.fullmatch(r"n/a|\d+\.\d \((24|48|no)\)", c) for c in cells), cells
    full = [[c.strip() for c in row.strip("|").split("|")[2:]] for row in rows if "| bf16 full" in row]
    for torch_adamw, eight_bit in zip(full[::2], full[1::2]):  # 8-bit moments: each full fine-tuning cell smaller
        for a, b in zip(torch_adamw, eight_bit):
            assert a == b == "n/a" or float(b.split()[0]) < float(a.split()[0]), (a, b)


SCRIPTS = ["sft", "dpo", "orpo", "kto", "grpo", "raft", "rm"]


def refuse_load(*a, **k):
    raise AssertionError("the model was loaded")


@pytest.mark.parametrize("script", SCRIPTS)
def test_plan_returns_before_loading(script, tiny_model_dir, tmp_path, monkeypatch, capsys):
    mod = importlib.import_module(script)
    monkeypatch.setattr(mod, "load_model", refuse_load)
    out = mod.main(mod.Args(model=tiny_model_dir, preset="demo", output_dir=str(tmp_path), plan=True))
    assert list(out) == ["memory_plan"] and out["memory_plan"]["total"] > 0
    assert "memory plan" in capsys.readouterr().out
    assert os.listdir(tmp_path) == []  # not even a run directory


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_sets_torch_threads_before_it_plans(script, tiny_model_dir, tmp_path):
    """--torch-threads was grpo.py's only: every script now sets torch's CPU threads from it first thing."""
    mod = importlib.import_module(script)
    before = torch.get_num_threads()
    args = mod.Args(model=tiny_model_dir, preset="demo", output_dir=str(tmp_path), plan=True, torch_threads=before + 1)
    try:
        mod.main(args)
        assert torch.get_num_threads() == before + 1
    finally:
        torch.set_num_threads(before)


class Loaded(Exception):
    """Raised by the test's load_model: the run got past the plan and the model would load now."""


def stop_at_load(seen: list):
    """A load_model that records the gradient_checkpointing it was asked for, then stops the run."""
    from common.model import load_model

    def load(*a, **k):
        seen.append(inspect.signature(load_model).bind(*a, **k).arguments.get("gradient_checkpointing", False))
        raise Loaded

    return load


def test_over_budget_refuses_unless_ignored(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "device_memory", lambda device: (2**20, "test budget"))
    monkeypatch.setattr(dpo, "load_model", stop_at_load([]))
    args = dpo.Args(model=tiny_model_dir, preset="demo", output_dir=str(tmp_path), per_device_train_batch_size=4)
    with pytest.raises(ArgsError, match="--ignore-memory-plan") as e:
        dpo.main(args)
    assert "--gradient-checkpointing, then --per-device-train-batch-size 2" in str(e.value)
    assert os.listdir(tmp_path) == []  # refused before the run directory
    with pytest.raises(Loaded):  # past the plan, into the model load
        dpo.main(dataclasses.replace(args, ignore_memory_plan=True))


def test_a_plan_over_the_device_turns_checkpointing_on_when_that_alone_fits(tiny_model_dir, tmp_path, monkeypatch):
    args = dpo.Args(model=tiny_model_dir, preset="demo", output_dir=str(tmp_path), per_device_train_batch_size=4)
    monkeypatch.setattr(memory, "device_memory", lambda device: (2**40, "test budget"))
    off = dpo.main(dataclasses.replace(args, plan=True))["memory_plan"]["total"]  # the rows main plans with
    on = dpo.main(dataclasses.replace(args, plan=True, gradient_checkpointing=True))["memory_plan"]["total"]
    assert on < off
    seen = []
    monkeypatch.setattr(dpo, "load_model", stop_at_load(seen))
    monkeypatch.setattr(memory, "device_memory", lambda device: ((on + off) // 2, "test budget"))
    with pytest.raises(Loaded):
        dpo.main(args)
    assert seen[-1] is True  # the model loads with checkpointing on
    with pytest.raises(Loaded):  # --ignore-memory-plan: as asked, checkpointing stays off
        dpo.main(dataclasses.replace(args, ignore_memory_plan=True))
    assert seen[-1] is False
    monkeypatch.setattr(memory, "device_memory", lambda device: (off, "test budget"))  # fits as it is: left off
    with pytest.raises(Loaded):
        dpo.main(args)
    assert seen[-1] is False


QUICK = {  # two steps (raft: one round with an SFT and a DPO phase) on the tiny model, demo data
    "sft": dict(max_steps=2, per_device_train_batch_size=2, learning_rate=1e-3),
    "dpo": dict(max_steps=2, per_device_train_batch_size=2, learning_rate=1e-3),
    "orpo": dict(max_steps=2, per_device_train_batch_size=2, learning_rate=1e-3),
    "kto": dict(max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3),
    "rm": dict(max_steps=2, per_device_train_batch_size=2, learning_rate=1e-3),
    "grpo": dict(max_steps=2, group_size=4, prompts_per_step=2, max_completion_length=8, learning_rate=1e-2,
                 lora_dropout=0.0, rewards=["length"], breaker_action="warn"),
    "raft": dict(num_rounds=1, prompts_per_round=2, group_size=4, max_completion_length=8, eval_limit=0, dpo=True,
                 reward_threshold=None, min_margin=0.0, mask_truncated_completions=False,
                 rewards=["tests.test_raft:frac_low_ids"]),
}  # fmt: skip


@pytest.mark.numerics
@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_trains_the_same_with_checkpointing_on(script, tiny_model_dir, tmp_path, monkeypatch):
    """The plan may turn gradient checkpointing on in any script: the losses must not move (recomputation is the same
    arithmetic; dpo.py and grpo.py then score whole rows instead of sharing each prompt's pass, equal to fp32
    rounding)."""
    from common.model import is_checkpointing, unwrap

    mod = importlib.import_module(script)
    models = []
    load_model = mod.load_model

    def recorded(*a, **k):
        models.append(load_model(*a, **k))
        return models[-1]

    monkeypatch.setattr(mod, "load_model", recorded)
    losses = []
    for on in (False, True):
        # grpo: a reward that differs within a group, so step 1 has real gradients; with all advantages 0 only the KL
        # term's rounding-level gradient (~1e-7, the two paths' gap) is left, Adam's first step turns it into an
        # lr-sized step in its sign, and step 2 would sample from another policy on each path
        quick = QUICK[script] | ({"rewards": ["tests.test_raft:frac_low_ids"]} if script == "grpo" else {})
        args = mod.Args(model=tiny_model_dir, preset="demo", output_dir=str(tmp_path / str(on)), **quick)
        out = mod.main(dataclasses.replace(args, gradient_checkpointing=on))
        assert is_checkpointing(unwrap(models[-1][0])) is on
        keys = ["sft/loss", "dpo/loss"] if script == "raft" else ["loss"]
        losses.append([h[k] for h in out["history"] for k in keys if k in h])
    assert len(losses[0]) == 2 and all(map(math.isfinite, losses[0]))  # raft: its SFT and its DPO phase
    if script in ("dpo", "grpo"):
        # Another path (common.model.shares_prompt_pass: no shared prompt pass under checkpointing), the same sums in
        # another order: step 1 (policy == ref) agrees and step 2 differs by fp32 rounding (2^-24 relative per op,
        # over a forward, a backward and one AdamW step), whose size the CPU's kernels decide. 1e-5 relative is far
        # above that and far below the loss's move in one step, so a completion that lost sight of its prompt fails.
        assert losses[1] == pytest.approx(losses[0], rel=1e-5, abs=1e-7)
        assert any(loss != 0 for loss in losses[0]), losses  # a step with a gradient was compared
    else:
        # The same kernels on the same shapes, only recomputed in the backward: bit for bit on any CPU.
        assert losses[1] == losses[0]


HEADLINE = {"sft": [], "dpo": [], "orpo": [], "kto": [], "rm": [], "grpo": ["--group-size", "4"], "raft": []}


@pytest.mark.parametrize("size, card", [("1.5B", 24), ("3B", 24), ("7B", 48)])
@pytest.mark.parametrize("script", SCRIPTS)
def test_each_scripts_real_preset_starts_on_a_24_or_48_gib_card(script, size, card):
    """`python <script>.py --model Qwen/Qwen2.5-<size>` (the gsm8k / trl preset, no other flag but grpo's headline
    --group-size 4) passes the plan on a CUDA card (raft.py's preset once sampled a whole round at once, and
    sft/dpo/orpo/rm ran 8 x 1,024 tokens without checkpointing: both were refused)."""
    import tyro

    from bench.capability_table import plan_on_card
    from harness.cli import resolve_preset

    mod = importlib.import_module(script)
    args = resolve_preset(tyro.cli(mod.Args, args=["--model", f"Qwen/Qwen2.5-{size}", *HEADLINE[script]]), mod.PRESETS)
    parts, _, printed = plan_on_card(mod, args, size, card)  # as on a bf16 card of `card` GiB: refused if over
    total = float(printed.split("total")[1].split()[0])
    assert total <= card and parts["total"] <= card * memory.GiB


def test_cli_plan_subprocess(tiny_model_dir, tmp_path):
    cmd = [sys.executable, "sft.py", "--plan", "--model", tiny_model_dir, "--preset", "demo"]
    out = cli.run(
        [*cmd, "--output-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "step: activations" in out.stdout and "physical RAM" in out.stdout and os.listdir(tmp_path) == []
    table = cli.run([sys.executable, "bench/capability_table.py", "--gpu-memory", "24"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert table.returncode == 0 and "Qwen2.5-7B" in table.stdout and "(no)" in table.stdout


def test_the_plan_counts_the_loaded_rows_in_ram(tiny_model_dir, tmp_path):
    """The rows of a data file take a multiple of its size in RAM before the model loads; the CPU plan did not count
    them (docs/memory.md has the measurement)."""
    words = "the quick brown fox jumps over the lazy dog and some more words".split()
    rows = [{"prompt": " ".join(words[i % 7 :]), "completion": " ".join(words[: 3 + i % 9])} for i in range(20000)]
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(f'{{"prompt": "{r["prompt"]}", "completion": "{r["completion"]}"}}\n' for r in rows))
    args = sft.Args(model=tiny_model_dir, dataset=str(data), output_dir=str(tmp_path), plan=True)
    plan = sft.main(args)["memory_plan"]
    loaded = sft.load_splits(str(data), "train", None, "supervised", 0, None, None)[0]
    exact = memory.rows_bytes(loaded, sample=len(loaded))  # every row walked
    assert plan["dataset rows"] == pytest.approx(exact, rel=0.05)  # the plan's even sample of 1,000 rows
    assert exact > 2 * data.stat().st_size  # Python's objects cost a multiple of the file
    without = {k: v for k, v in plan.items() if k not in ("total", "allocator (10 %)", "dataset rows")}
    assert plan["total"] >= sum(without.values()) + plan["dataset rows"]


# ------------------------------------------------------------------ planning for a card, real lengths, host RAM
@pytest.fixture
def no_hub(monkeypatch, tmp_path):
    """The hub out of reach (HF_HUB_OFFLINE) and nothing in its caches: a plan may read nothing but local files."""
    import datasets.config
    from huggingface_hub import constants

    import harness.hub

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    harness.hub.hub_unreachable.cache_clear()
    yield
    harness.hub.hub_unreachable.cache_clear()


SCRIPTS = ["sft", "dpo", "orpo", "kto", "rm", "grpo", "raft"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_plan_for_a_stated_card_from_a_config_json_alone(script, no_hub, tmp_path, capsys, monkeypatch):
    """`<script>.py --model <Qwen2.5-1.5B config.json> --plan --gpu-memory 24`, no dataset (each preset's hub set is
    neither cached nor reachable), no GPU: the plan for a 24 GiB CUDA card in bf16, as bench/capability_table.py's
    simulated card plans the same Args (its Qwen2.5-1.5B shapes), at the length limits."""
    from bench.capability_table import plan_on_card
    from plugins.embedded import QWEN25

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (tmp_path / "qwen").mkdir()
    config = tmp_path / "qwen" / "config.json"
    config.write_text(json.dumps(QWEN25["1.5B"]))
    module = importlib.import_module(script)
    extra = {"group_size": 4} if script == "grpo" else {}
    args = module.Args(model=str(config), plan=True, gpu_memory=24, **extra)
    parts = module.main(args)["memory_plan"]
    out = capsys.readouterr().out
    assert "planned at the length limits" in out and "of 24.0 GiB CUDA card (--gpu-memory 24)" in out, out
    assert parts["weights"] == memory.weight_bytes(QWEN25["1.5B"], None, 2)  # bf16, as --dtype auto on a card
    assert parts["allowance (runtime)"] == memory.CUDA_CONTEXT and parts["total"] <= 24 * memory.GiB
    resolved = module.resolve_preset(dataclasses.replace(args, model="Qwen/Qwen2.5-1.5B"), module.PRESETS)
    assert parts == plan_on_card(module, resolved, "1.5B", 24)[0]
    # a folder holding only that config.json plans the same
    assert module.main(dataclasses.replace(args, model=str(tmp_path / "qwen")))["memory_plan"] == parts


def test_plan_of_a_known_hub_id_offline_reads_its_shipped_shapes(no_hub, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = grpo.Args(model="Qwen/Qwen2.5-1.5B", group_size=4, plan=True, gpu_memory=24)
    parts = grpo.main(args)["memory_plan"]
    assert "its shipped architecture" in capsys.readouterr().out
    from bench.capability_table import plan_on_card

    assert parts == plan_on_card(grpo, grpo.resolve_preset(args, grpo.PRESETS), "1.5B", 24)[0]
    with pytest.raises(ArgsError, match="--gpu-memory 24 plans for a CUDA card and this machine has none: add --plan"):
        grpo.main(dataclasses.replace(args, plan=False, dataset="builtin:math", model="smollm2-135m"))


def test_plan_reads_the_rows_real_token_lengths_with_a_local_tokenizer(tiny_model_dir, tmp_path, capsys, on_cpu):
    """With the model's tokenizer on disk the rows are tokenized as the run tokenizes them (the chat template
    included); without it the plan falls back to the UTF-8 byte bound, several times longer on English text."""
    from transformers import AutoTokenizer

    from common.data import setup_chat_template
    from common.completions import tokenize_dataset, validate_rows

    text = "The quick brown fox jumps over the lazy dog. " * 6
    chat = {"prompt": [{"role": "user", "content": text}], "completion": [{"role": "assistant", "content": text[:90]}]}
    rows = validate_rows([dict(chat) for _ in range(3)], "supervised")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    setup_chat_template(tokenizer)
    real = max(len(e["input_ids"]) for e in tokenize_dataset(tokenizer, rows, "supervised", None))
    args = sft.Args(model=tiny_model_dir, max_length=4096)
    assert memory.row_tokens(args, rows) == real < memory.longest_row(rows) // 2
    printed = capsys.readouterr().out
    assert f"the longest is {real} tokens (all 3 rows tokenized with the model's tokenizer)" in printed
    bare = tmp_path / "bare"  # the same model without its tokenizer files
    bare.mkdir()
    (bare / "config.json").write_text(open(os.path.join(tiny_model_dir, "config.json")).read())
    assert memory.row_tokens(dataclasses.replace(args, model=str(bare)), rows) == memory.longest_row(rows)
    assert "a bound from UTF-8 bytes (the tokenizer is not on this machine)" in capsys.readouterr().out
    tokens = sft.memory_plan(args, rows)[0]["step: activations"]
    assert tokens < sft.memory_plan(dataclasses.replace(args, model=str(bare)), rows)[0]["step: activations"]


def test_a_full_fine_tunes_reference_copy_is_planned_in_host_ram(monkeypatch, on_cpu, capsys):
    """grpo.py --no-use-lora with beta != 0 (and dpo/kto scoring the reference every step) keep the starting
    weights in host memory (common.model.snapshot_ref): one more weights-size lasting part on a CPU run; on a card
    the host-RAM line holds it, twice (the trained weights wait there while the reference is swapped in)."""
    copy = "reference weights (CPU copy)"
    full = GRPO | dict(use_lora=False)
    assert plan_of(grpo, monkeypatch, **full)[copy] == memory.weight_bytes(CFG, None, 4)
    assert copy not in plan_of(grpo, monkeypatch, **full | dict(beta=0.0))  # no reference at all
    assert copy not in plan_of(grpo, monkeypatch, **GRPO)  # LoRA: a "ref" slot, counted with the adapter
    pairs = SFT | dict(use_lora=False)
    assert plan_of(dpo, monkeypatch, **pairs | dict(precompute_ref_log_probs=False))[copy] > 0
    assert copy not in plan_of(dpo, monkeypatch, **pairs)  # precomputed (the default): the copy is dropped first
    capsys.readouterr()
    on_card = plan_of(grpo, monkeypatch, **full | dict(plan=True, gpu_memory=24, dtype="bf16"))
    assert copy not in on_card
    half = memory.weight_bytes(CFG, None, 2) / memory.GiB
    assert f"host RAM (not in the total): dataset rows 0.00 GiB, reference weights 2 x {half:.2f} GiB" in (
        capsys.readouterr().out
    )


@pytest.mark.parametrize("script", ["sft", "grpo"])
def test_the_plan_is_one_ranks_and_counts_fsdp_shards(script, tiny_model_dir, tmp_path):
    """--plan --plan-world-size N: one rank's plan. Data parallelism keeps a full replica a rank (grpo samples its
    share of the prompts); --fsdp splits weights, gradients and AdamW states N ways and adds what FSDP2 gathers."""
    mod = importlib.import_module(script)
    base = dict(model=tiny_model_dir, preset="demo", output_dir=str(tmp_path), plan=True, use_lora=False)
    if script == "grpo":
        base["prompts_per_step"] = 8
    alone = mod.main(mod.Args(**base))["memory_plan"]
    replica = mod.main(mod.Args(**base, plan_world_size=4))["memory_plan"]
    sharded = mod.main(mod.Args(**base, plan_world_size=4, fsdp=True))["memory_plan"]
    assert replica["weights"] == alone["weights"]
    assert sharded["weights (1/4 shard)"] == alone["weights"] // 4
    assert sharded["grads + AdamW (full, 1/4 shard)"] == alone["grads + AdamW (full)"] // 4
    assert sharded["step: gathered units (FSDP)"] > 0
    if script == "grpo":  # a quarter of the prompts: a smaller KV cache; the full weights gathered for the rollout
        rollout = next(k for k in alone if k.startswith("rollout: KV cache"))  # (+ packed weights on a CPU)
        assert replica[rollout] < alone[rollout]
        assert sharded["rollout: gathered weights (FSDP)"] == alone["weights"] - alone["weights"] // 4


def test_capability_tables_grpo_cell_stands_beside_the_presets_own_plan():
    """docs/memory.md's capability table said 7.9 GiB for Qwen2.5-1.5B bf16 LoRA GRPO G=4 while the headline
    preset plans 19.5 GiB (issue 41 section 6): the preset's rows stand beside the table's, with what differs."""
    from bench.capability_table import plan_on_card

    text = (ROOT / "docs" / "memory.md").read_text()
    preset = grpo.resolve_preset(grpo.Args(model="Qwen/Qwen2.5-1.5B", group_size=4), grpo.PRESETS)
    table = dataclasses.replace(preset, max_prompt_length=256, gradient_checkpointing=True, groups_per_micro_batch=1)
    assert preset.prompts_per_step == 8 and preset.max_completion_length == 512 and preset.max_prompt_length == 512
    rows = {
        "the table's row | 256 | 512 | on": table,
        "grpo.py's gsm8k preset with `--gradient-checkpointing` | 512 | 512 | on": dataclasses.replace(
            preset, gradient_checkpointing=True
        ),
        "grpo.py's gsm8k preset as it starts (`--group-size 4`) | 512 | 512 | off (it fits)": preset,
    }
    for row, args in rows.items():
        parts, checkpointing, _ = plan_on_card(grpo, args, "1.5B", 24)
        assert checkpointing == args.gradient_checkpointing  # the preset at G 4 fits without: it stays off
        assert f"| {row} | {parts['total'] / memory.GiB:.1f} |" in text, row
    g8 = grpo.resolve_preset(grpo.Args(model="Qwen/Qwen2.5-1.5B"), grpo.PRESETS)
    parts, checkpointing, printed = plan_on_card(grpo, g8, "1.5B", 24)
    needs = re.search(r"without it the plan needs ([\d.]+) GiB", printed).group(1)
    assert (
        checkpointing
        and f"needs {needs} GiB, so it turns checkpointing on and plans {parts['total'] / memory.GiB:.1f}" in text
    )


def test_the_plan_takes_the_micro_batches_the_run_draws_not_every_row_at_the_longest(tiny_model_dir, on_cpu):
    """Issue 40 section 6: sft.py planned every row of a micro-batch at the longest row's length (alpaca_en_demo:
    8 x 750 tokens, 2.9 x the measured peak). The plan now tokenizes the rows as the run does, draws the run's own
    micro-batches and plans the largest at its tokens, padded as length groups pad it."""
    from common.data import micro_batch
    from common.completions import tokenize_dataset, validate_rows

    long_text = "The quick brown fox jumps over the lazy dog. " * 20
    rows = [{"prompt": "Say it.", "completion": long_text}] + [{"prompt": "Say it.", "completion": "ok"}] * 15
    rows = validate_rows([dict(r) for r in rows], "supervised")
    args = sft.Args(model=tiny_model_dir, max_length=4096, per_device_train_batch_size=8, max_steps=1, lora_dropout=0)
    tokenizer = memory.local_tokenizer(tiny_model_dir)
    lengths = [len(e["input_ids"]) for e in tokenize_dataset(tokenizer, rows, "supervised", None)]
    longest, short = lengths[0], lengths[1]
    assert longest > 8 * short

    def activations(T: int, mask: bool = False) -> int:  # of 8 rows of T tokens
        step = {"step": [Pass(8, T, 8 * T, grad=True, padding_mask=mask)]}
        return estimate(memory.model_config(tiny_model_dir), Trained("fp32"), step, device="cpu")["step: activations"]

    # a seed whose first micro-batch leaves the long row out: a run of one step never draws it
    seed = next(s for s in range(100) if rows[0] not in micro_batch(rows, 0, 8, s))
    one = dataclasses.replace(args, seed=seed)
    assert sft.memory_plan(one, rows)[0]["step: activations"] == activations(short)
    # two steps draw it: its micro-batch runs the long row alone in one group, the 7 short rows in another
    both = sft.memory_plan(dataclasses.replace(one, max_steps=2), rows)[0]["step: activations"]
    assert both == activations(-(-(longest + 7 * short) // 8))
    assert activations(longest, mask=True) > 3 * both  # the old plan: every row at the longest row's length


def test_padded_tokens_follow_the_runs_length_groups():
    # (tokens, those of the largest group): the long row alone, the short ones together
    assert memory.padded_tokens([100, 10, 10, 10]) == (130, 100)
    assert memory.padded_tokens([100, 10, 10, 10], grouped=False) == (400, 400)  # one batch padded to its longest
    assert memory.padded_tokens([100, 95, 90]) == (300, 300)  # within 1.125 x their tokens: one group, padded to 100
    assert memory.padded_tokens([40, 40, 40, 10, 10]) == (140, 120)


STEADY = """
import sys, torch
sys.path.insert(0, {root!r})
import sft
from harness import memory
memory.device_memory = lambda device: (2**40, "test RAM")
torch.cuda.is_available = lambda: False
sft.memory_plan(sft.Args(model={model!r}), [])  # a run's plan, on a CPU
def rss():
    with open("/proc/self/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith("VmRSS:"))) * 1024
x = torch.ones(16 << 20, dtype=torch.uint8)  # a freed 16 MiB block: glibc's default raises its mmap threshold to it
del x
blocks = [torch.ones(2 << 20, dtype=torch.uint8) for _ in range(100)]  # 200 MiB in 2 MiB blocks
before = rss()
del blocks[::2]  # every other one freed: holes in the middle of a heap stay resident
print("RELEASED", (before - rss()) >> 20)
"""


def test_a_cpu_runs_plan_keeps_freed_blocks_out_of_its_resident_memory(tiny_model_dir):
    """Issue 40 section 6: dpo.py on dpo_en_demo.json measured 6.47 -> 7.10 -> 8.54 GiB over three steps against a
    4.17 GiB plan, with glibc's default malloc: its mmap threshold climbs to the largest block freed (up to 32 MiB),
    so activations land in the heap and the blocks one step frees stay resident beside the next step's. A CPU run's
    plan sets a fixed threshold (harness.memory.steady_heap): a freed block of 1 MiB or more leaves RSS at once. In a
    fresh process, as a user launches a script (no MALLOC_* variable, no LD_PRELOAD)."""
    text = python_as_launched(STEADY.format(root=str(ROOT), model=str(tiny_model_dir)))
    released = int(re.search(r"RELEASED (-?\d+)", text).group(1))
    assert released >= 90, text  # the 100 MiB freed left RSS


# ---- issue 52: the batch a plan assumed; the settings that fit, or that take less than a slow CPU step
LONG_PAIRS = [  # preference pairs longer than the --max-length the tests plan with, of varied lengths
    {"prompt": f"Question {i}: say yes or no.", "chosen": "yes " * (60 + 20 * i), "rejected": "no " * (40 + 9 * i)}
    for i in range(16)
]


def test_a_plan_without_its_data_says_which_batch_it_planned(tiny_model_dir, tmp_path, capsys, on_cpu):
    """`--plan` without the data planned at the length limits without saying which batch (issue 52): one line gives
    each pass's rows x tokens, here DPO's 2 x 8 pairs at --max-length 1024."""
    args = dpo.Args(model=tiny_model_dir, dataset=str(tmp_path / "absent.jsonl"), plan=True, output_dir=str(tmp_path))
    dpo.main(args)
    out = capsys.readouterr().out
    assert "--plan without its data" in out and "planned at the length limits" in out, out
    line = "batch planned: step: reference pass 16 rows x 1024 tokens, then forward + backward 16 rows x 1024 tokens"
    assert line in out.splitlines(), out


def named_settings(message: str) -> list[tuple[dict, float]]:
    """(the Args fields, the GiB said) of each setting a message names: `--flag N [--flag N]` or a bare flag."""
    found = []
    for flags, gib in re.findall(r"((?:--[a-z-]+(?: \d+)? ?)+) \(([\d.]+) GiB", message):
        fields = {}
        for flag, value in re.findall(r"--([a-z-]+)(?: (\d+))?", flags):
            fields[flag.replace("-", "_")] = int(value) if value else True
        found.append((fields, float(gib)))
    return found


def test_over_budget_names_the_settings_that_fit_and_each_does(tiny_model_dir, tmp_path, monkeypatch):
    """A plan over the machine named knobs to try, halved, none known to fit (issue 52): the refusal names the
    settings that fit (fewer rows a micro-batch with more accumulated, a shorter --max-length), each with its plan,
    and each, planned for real with its flags, fits the same budget."""
    data = write_jsonl(tmp_path / "pairs.jsonl", LONG_PAIRS)
    kw = dict(
        model=tiny_model_dir, dataset=data, output_dir=str(tmp_path), max_length=512, gradient_checkpointing=True
    )
    monkeypatch.setattr(memory, "device_memory", lambda device: (2**40, "test budget"))
    full = dpo.main(dpo.Args(**kw, plan=True))["memory_plan"]
    budget = full["total"] - (full["total"] - full["weights"] - full["allowance (runtime)"]) // 3
    monkeypatch.setattr(memory, "device_memory", lambda device: (budget, "test budget"))
    monkeypatch.setattr(dpo, "load_model", refuse_load)
    with pytest.raises(ArgsError, match="settings that fit") as e:
        dpo.main(dpo.Args(**kw))
    named = named_settings(str(e.value))
    flags = [set(fields) for fields, _ in named]
    assert {"per_device_train_batch_size", "gradient_accumulation_steps"} in flags, named
    for fields, gib in named:
        planned = dpo.main(dpo.Args(**kw | fields, plan=True))["memory_plan"]["total"]
        assert planned <= budget and abs(planned / memory.GiB - gib) < 0.1 + 0.1 * gib, (fields, gib, planned)


def test_a_slow_cpu_step_is_said_with_the_settings_that_take_less(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """DPO on a real preference file took ~100 s a step on a CPU and said nothing (issue 52): a step whose matmuls
    alone, at the CPU's measured speed (made slow here), take over SLOW_STEP_S is said in one line, naming quicker
    settings (fewer rows a step, a shorter --max-length) with their times under it, and the memory ones."""
    data = write_jsonl(tmp_path / "pairs.jsonl", LONG_PAIRS)
    kw = dict(model=tiny_model_dir, dataset=data, output_dir=str(tmp_path), max_length=512, plan=True)
    monkeypatch.setattr(memory, "device_memory", lambda device: (2**40, "test budget"))
    said = {}
    for rate in (1e12, 1e6, None):  # FLOP/s: a fast CPU (nothing said), a slow one, then one 1.2 x SLOW_STEP_S slow
        if rate is None:
            rate = 1e6 * float(re.search(r"takes (\d+) s or more", said[1e6][0]).group(1)) / (1.2 * memory.SLOW_STEP_S)
        monkeypatch.setattr(memory, "cpu_matmul_rate", lambda *a, rate=rate: rate)
        dpo.main(dpo.Args(**kw))
        said[rate] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("slow on this CPU")]
    assert said[1e12] == [] and len(said[1e6]) == 1 and "at 1 MFLOP/s, measured on 1 torch thread" in said[1e6][0]
    [line] = said[rate]
    step = float(re.match(r"slow on this CPU: a step takes (\d+) s or more \(", line).group(1))
    assert memory.SLOW_STEP_S < step < 1.3 * memory.SLOW_STEP_S, line
    quick = re.findall(r"(--[a-z-]+ \d+) \([\d.]+ GiB, (\d+) s or more a step; (fewer rows a step|rows past it)", line)
    assert {q[0].split()[0] for q in quick} == {"--per-device-train-batch-size", "--max-length"}, line
    assert all(int(q[1]) < memory.SLOW_STEP_S for q in quick), line
    assert "--gradient-accumulation-steps" in line and "--gradient-checkpointing" in line, line


def test_the_plan_leaves_torchs_random_stream_as_it_was(tiny_model_dir, on_cpu):
    """Timing this CPU's matmul (cpu_matmul_rate, on a CPU plan) draws its operands from a generator of its own: a run
    seeded before its plan samples after it exactly as it would without it (its LoRA init, a fork's the same)."""
    memory.cpu_matmul_rate.cache_clear()
    torch.manual_seed(0)
    before = torch.get_rng_state()
    dpo.memory_plan(dpo.Args(model=tiny_model_dir), [])
    assert memory.cpu_matmul_rate.cache_info().misses == 1  # the CPU was timed
    assert torch.equal(torch.get_rng_state(), before)

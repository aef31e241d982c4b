"""orpo.py: the stable log-odds and loss against hand-computed values and TRL's code, then end to end."""

import math
import os

import pytest
import torch
from safetensors.torch import load_file
import torch.nn.functional as F

from common.data import micro_batch
from common.completions import concat_pairs
from common.errors import DataError
from orpo import Args, log1mexp, main, orpo_log_odds, orpo_loss
from tests.prefs_helpers import (
    assert_adapters,
    assert_base_untouched,
    assert_logged,
    fake_accelerator,
    hf_chosen_nll,
    make_sft_adapter,
    preference_rows,
    run_cli,
    write_jsonl,
)

KEYS = (
    "loss",
    "nll_loss",
    "log_odds_ratio",
    "log_odds_chosen",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "memory/peak_gb",
    "perf/tokens_per_s",
    "grad_norm",
    "learning_rate",
)
XS = [-1e-9, -1e-7, -1e-4, -0.1, -0.69, -math.log(2), -0.7, -5.0, -30.0, -100.0]


def log_odds_by_hand(lc, lr):
    """float64 math: log(p/(1-p)) of the chosen minus that of the rejected, p = e^l."""
    return (lc - math.log(-math.expm1(lc))) - (lr - math.log(-math.expm1(lr)))


@pytest.mark.numerics
def test_log1mexp_is_accurate_where_the_naive_formula_breaks():
    x = torch.tensor(XS)
    expected = torch.tensor([math.log(-math.expm1(v)) for v in XS], dtype=torch.float64)
    torch.testing.assert_close(log1mexp(x).double(), expected, rtol=1e-5, atol=1e-7)
    assert torch.isinf(torch.log(1 - torch.exp(torch.tensor(-1e-9))))  # the naive formula: log(0) in fp32
    x.requires_grad_(True)
    log1mexp(x).sum().backward()  # both torch.where branches stay finite, so no 0 * inf = NaN in backward
    assert torch.isfinite(x.grad).all()
    # d/dx log(1 - e^x) = -e^x / (1 - e^x) = -1 / expm1(-x)
    torch.testing.assert_close(
        x.grad.double(), torch.tensor([-1 / math.expm1(-v) for v in XS], dtype=torch.float64), rtol=1e-4, atol=1e-6
    )


@pytest.mark.numerics
def test_orpo_loss_by_hand_including_a_near_certain_chosen():
    chosen, rejected = torch.tensor([-0.5, -1e-7, -3.0]), torch.tensor([-1.0, -2.0, -0.2])
    odds = [log_odds_by_hand(c, r) for c, r in zip(chosen.tolist(), rejected.tolist())]
    loss, log_odds = orpo_loss(nll_loss=torch.tensor(1.25), chosen_logps=chosen, rejected_logps=rejected, beta=0.2)
    assert log_odds.tolist() == pytest.approx(odds, rel=1e-5)
    expected = 1.25 - 0.2 * sum(-math.log1p(math.exp(-o)) for o in odds) / 3  # log sigmoid(o) = -log(1 + e^-o)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert orpo_log_odds(chosen[:1], chosen[:1]).item() == 0.0  # equal likelihoods: odds ratio 1


@pytest.mark.numerics
def test_matches_trl_orpo_trainer():
    pytest.importorskip("trl")
    from trl.experimental.orpo import ORPOTrainer
    from trl.experimental.orpo.orpo_trainer import log1mexp as trl_log1mexp

    g = torch.Generator().manual_seed(0)
    chosen, rejected = -3 * torch.rand(8, generator=g), -3 * torch.rand(8, generator=g)
    chosen[0], rejected[1] = -1e-4, -1e-5  # near-certain completions: TRL's expm1 branch
    trainer = object.__new__(ORPOTrainer)  # no __init__: odds_ratio_loss reads beta and accelerator.device only
    trainer.__dict__.update(beta=0.1, accelerator=fake_accelerator())
    losses, trl_chosen, trl_rejected, trl_ratio, trl_log_odds = trainer.odds_ratio_loss(chosen, rejected)
    nll = torch.tensor(2.5)
    loss, log_odds = orpo_loss(nll_loss=nll, chosen_logps=chosen, rejected_logps=rejected, beta=0.1)
    torch.testing.assert_close(loss, nll - losses.mean(), rtol=1e-6, atol=1e-6)  # TRL: policy_nll_loss - losses.mean()
    torch.testing.assert_close(log_odds.mean(), trl_log_odds, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(F.logsigmoid(log_odds).mean(), trl_ratio, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(0.1 * chosen, trl_chosen)
    x = torch.tensor(XS[1:])  # TRL's log1mexp too (its unused branch is -inf at -1e-9, still fine in forward)
    torch.testing.assert_close(log1mexp(x), trl_log1mexp(x), rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------------------------------- end to end
def run(tiny_model_dir, dataset, tmp_path, **kw):
    defaults = dict(
        model=tiny_model_dir,
        dataset=dataset,
        output_dir=str(tmp_path / "runs"),
        max_length=64,
        per_device_train_batch_size=4,
        learning_rate=5e-3,
        max_steps=2,
        seed=1,
    )
    return main(Args(**{**defaults, **kw}))


@pytest.fixture
def prefs(tmp_path):
    # The tiny random model prefers "yes it is good" at the start, so the chosen side is the other one
    return write_jsonl(tmp_path / "prefs.jsonl", preference_rows(16, chosen="no it is bad", rejected="yes it is good"))


def test_from_sft_adapter_end_to_end(tiny_model_dir, prefs, tmp_path):
    start = make_sft_adapter(tiny_model_dir, tmp_path / "sft")
    out = run(tiny_model_dir, prefs, tmp_path, adapter=str(tmp_path / "sft"), eval_split="train", eval_steps=2)
    assert_logged(out, KEYS)
    assert "eval/log_odds_ratio" in out
    assert_adapters(out["model"], start, with_ref=False)  # reference-free: no "ref" slot is ever created
    assert_base_untouched(out["model"], tiny_model_dir)


def test_learns_a_separable_preference_set(tiny_model_dir, prefs, tmp_path):
    out = run(tiny_model_dir, prefs, tmp_path, max_steps=20)
    assert out["history"][0]["rewards/accuracies"] < 0.5
    assert out["rewards/accuracies"] >= 0.9 and out["log_odds_chosen"] > out["history"][0]["log_odds_chosen"]


@pytest.mark.numerics
@pytest.mark.parametrize("completion_only_loss", [True, False])
def test_nll_covers_the_response_or_prompt_plus_response(tiny_model_dir, prefs, tmp_path, completion_only_loss):
    """Step 1's nll_loss is transformers' cross-entropy on the chosen rows, with labels on the response (the paper)
    or on every real token (TRL's ORPOTrainer)."""
    out = run(tiny_model_dir, prefs, tmp_path, max_steps=1, completion_only_loss=completion_only_loss)
    expected = hf_chosen_nll(tiny_model_dir, prefs, 4, 1, concat_pairs, micro_batch, completion_only_loss)
    assert out["history"][0]["nll_loss"] == pytest.approx(expected, rel=1e-5)


def test_full_fine_tuning(tiny_model_dir, prefs, tmp_path):
    out = run(tiny_model_dir, prefs, tmp_path, use_lora=False, learning_rate=1e-3)
    assert math.isfinite(out["loss"])
    start = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    final = load_file(os.path.join(out["final_dir"], "model.safetensors"))  # a full model, no adapter
    assert set(final) <= set(start) and all(torch.isfinite(v).all() for v in final.values())
    moved = [k for k in final if not torch.equal(final[k], start[k])]
    assert len(moved) > len(final) // 2, f"full fine-tuning moved only {moved}"


def test_empty_chosen_fails_before_the_model_loads(tmp_path):
    rows = preference_rows(3)
    rows[0]["chosen"] = [{"role": "assistant", "content": ""}]
    bad = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError, match=r"bad\.jsonl:1: field 'chosen': is empty"):
        main(Args(model=str(tmp_path / "no-such-model"), dataset=bad))


def test_cli_help_and_one_step(tiny_model_dir, prefs, tmp_path):
    help_out = run_cli("orpo.py", "--help")
    assert help_out.returncode == 0 and "--completion-only-loss" in help_out.stdout and "--beta" in help_out.stdout
    done = run_cli(
        "orpo.py",
        "--model",
        tiny_model_dir,
        "--dataset",
        prefs,
        "--max-steps",
        1,
        "--max-length",
        64,
        "--per-device-train-batch-size",
        2,
        "--output-dir",
        tmp_path / "cli",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "orpo: loss" in done.stdout

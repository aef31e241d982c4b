"""dpo.py: each loss type against hand-computed values and TRL's own loss code, then end to end on the tiny model."""

import math
import os
import shutil
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

import dpo
from common.data import load_rows, micro_batch, setup_chat_template
from common.completions import concat_pairs, tokenize_dataset, validate_rows
from common.errors import ArgsError, DataError
from common.model import attach_lora, load_model, snapshot_ref
from common.completions import completion_logps, disable_dropout
from dpo import Args, dpo_loss, evaluate, main, pair_completion_logps, pair_losses, precompute_ref_logps
from tests.prefs_helpers import (
    FakeLM,
    assert_adapters,
    assert_base_untouched,
    assert_logged,
    fake_accelerator,
    hf_chosen_nll,
    make_sft_adapter,
    preference_rows,
    rows_with_lengths,
    run_cli,
    slot_state,
    write_jsonl,
)

KEYS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "memory/peak_gb",
    "perf/tokens_per_s",
    "grad_norm",
    "learning_rate",
)


def pairs(chosen, rejected, ref_chosen, ref_rejected, chosen_lengths, rejected_lengths) -> dict:
    """dpo_loss's tensor keywords, in the order the tests read them."""
    return dict(
        chosen_logps=chosen,
        rejected_logps=rejected,
        ref_chosen_logps=ref_chosen,
        ref_rejected_logps=ref_rejected,
        chosen_lengths=chosen_lengths,
        rejected_lengths=rejected_lengths,
    )


def nls(x):
    """-log sigmoid(x), by hand."""
    return math.log1p(math.exp(-x))


# Two pairs: delta = h_c - h_r = (1 - -1, 0.5 - 0.5) = (2, 0); lengths (5, 2) chosen, (4, 2) rejected.
C, R = torch.tensor([-10.0, -5.0]), torch.tensor([-12.0, -4.0])
REF_C, REF_R = torch.tensor([-11.0, -5.5]), torch.tensor([-11.0, -4.5])
LEN_C, LEN_R = torch.tensor([5, 2]), torch.tensor([4, 2])


@pytest.mark.numerics
def test_sigmoid_at_zero_margin_is_ln2():
    x = torch.tensor([-3.0, -7.5])
    losses, chosen, rejected = dpo_loss(**pairs(x, x - 1, x, x - 1, LEN_C, LEN_R))
    assert losses.tolist() == pytest.approx([math.log(2)] * 2, abs=1e-7)
    assert chosen.tolist() == rejected.tolist() == [0.0, 0.0]


@pytest.mark.parametrize(
    "loss_type, expected",
    [
        ("sigmoid", [nls(0.1 * 2), math.log(2)]),
        ("ipo", [(1 / 5 + 1 / 4 - 5) ** 2, (0.25 - 0.25 - 5) ** 2]),  # 1/(2 beta) = 5
        (
            "robust",
            [(0.9 * nls(0.2) - 0.1 * nls(-0.2)) / 0.8, math.log(2)],
        ),  # e = 0.1: (1-e)/(1-2e) - e/(1-2e) = 1 at 0
        ("simpo", [nls(0.1 * (-2 - -3) - 0.5), nls(0.1 * (-2.5 - -2) - 0.5)]),  # averages (-2, -3) and (-2.5, -2)
    ],
)
@pytest.mark.numerics
def test_loss_types_by_hand(loss_type, expected):
    losses, chosen, rejected = dpo_loss(
        **pairs(C, R, REF_C, REF_R, LEN_C, LEN_R), loss_type=loss_type, beta=0.1, label_smoothing=0.1, simpo_gamma=0.5
    )
    assert losses.tolist() == pytest.approx(expected, rel=1e-6)
    if loss_type == "simpo":  # reference-free rewards: beta * average log-prob
        assert chosen.tolist() == pytest.approx([-0.2, -0.25]) and rejected.tolist() == pytest.approx([-0.3, -0.2])
    else:
        assert chosen.tolist() == pytest.approx([0.1, 0.05]) and rejected.tolist() == pytest.approx([-0.1, 0.05])


def trl_dpo(loss_type, beta, label_smoothing, chosen, rejected, ref_chosen, ref_rejected, len_c, len_r):
    """TRL 1.16 DPOTrainer._compute_loss on these log-probs (precomputed-reference path, FakeLM as the model)."""
    from trl import DPOTrainer

    trainer = object.__new__(DPOTrainer)  # no __init__: only the attributes _compute_loss reads
    b = len(chosen)
    trainer.__dict__.update(
        model=FakeLM(torch.cat([chosen, rejected])),
        accelerator=fake_accelerator(),
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=label_smoothing,
        use_weighting=False,
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
        args=SimpleNamespace(),
    )
    input_ids, attention_mask, completion_mask = rows_with_lengths(range(2 * b), [*len_c, *len_r], 16)
    inputs = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        completion_mask=completion_mask,
        ref_chosen_logps=ref_chosen,
        ref_rejected_logps=ref_rejected,
    )
    loss = trainer._compute_loss(trainer.model, inputs, return_outputs=False)
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


@pytest.mark.numerics
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "robust"])
def test_matches_trl_dpo_trainer(loss_type):
    pytest.importorskip("trl")
    g = torch.Generator().manual_seed(0)
    chosen, rejected, ref_chosen, ref_rejected = (-20 * torch.rand(6, generator=g) for _ in range(4))
    len_c, len_r = torch.randint(1, 12, (6,), generator=g), torch.randint(1, 12, (6,), generator=g)
    trl_loss, trl_metrics = trl_dpo(loss_type, 0.3, 0.2, chosen, rejected, ref_chosen, ref_rejected, len_c, len_r)
    losses, chosen_rewards, rejected_rewards = dpo_loss(
        **pairs(chosen, rejected, ref_chosen, ref_rejected, len_c, len_r),
        loss_type=loss_type,
        beta=0.3,
        label_smoothing=0.2,
    )
    torch.testing.assert_close(losses.mean(), trl_loss, rtol=1e-6, atol=1e-6)
    assert chosen_rewards.mean().item() == pytest.approx(trl_metrics["rewards/chosen"], rel=1e-6)
    assert (chosen_rewards > rejected_rewards).float().mean().item() == trl_metrics["rewards/accuracies"]


@pytest.mark.numerics
def test_simpo_matches_trl_cpo_trainer():
    pytest.importorskip("trl")
    from trl.experimental.cpo import CPOTrainer

    g = torch.Generator().manual_seed(1)
    avg_c, avg_r = -3 * torch.rand(6, generator=g), -3 * torch.rand(6, generator=g)
    len_c, len_r = torch.randint(1, 12, (6,), generator=g), torch.randint(1, 12, (6,), generator=g)
    cpo = object.__new__(CPOTrainer)  # CPO's simpo takes average log-probs; ours takes sums and lengths
    cpo.__dict__.update(
        alpha=0.0, beta=2.0, loss_type="simpo", simpo_gamma=0.7, label_smoothing=0.0, accelerator=fake_accelerator()
    )
    trl_losses, trl_chosen, trl_rejected = cpo.cpo_loss(avg_c, avg_r)
    losses, chosen, rejected = dpo_loss(
        **pairs(avg_c * len_c, avg_r * len_r, None, None, len_c, len_r), loss_type="simpo", beta=2.0, simpo_gamma=0.7
    )
    torch.testing.assert_close(losses, trl_losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chosen, trl_chosen, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rejected, trl_rejected, rtol=1e-5, atol=1e-6)


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
    return write_jsonl(tmp_path / "prefs.jsonl", preference_rows(16))


def test_from_sft_adapter_ref_is_that_adapter(tiny_model_dir, prefs, tmp_path):
    start = make_sft_adapter(tiny_model_dir, tmp_path / "sft")
    out = run(
        tiny_model_dir, prefs, tmp_path, adapter=str(tmp_path / "sft"), max_steps=3, eval_split="train", eval_steps=3
    )
    # Step 1 scores the pairs before any update with policy == ref (a non-zero SFT adapter): delta = 0 exactly
    assert out["history"][0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert_logged(out, KEYS)
    assert "eval/rewards/accuracies" in out and "eval/loss" in out
    assert_adapters(out["model"], start, with_ref=True)
    assert_base_untouched(out["model"], tiny_model_dir)


def test_learns_a_separable_preference_set(tiny_model_dir, prefs, tmp_path):
    out = run(tiny_model_dir, prefs, tmp_path, max_steps=20, rpo_alpha=0.1)
    assert out["history"][0]["rewards/accuracies"] == 0.0  # a tie at step 1 (policy == ref) counts as wrong
    assert out["rewards/accuracies"] >= 0.9 and out["rewards/margins"] > 0
    assert out["loss"] < out["history"][0]["loss"]


@pytest.mark.numerics
def test_rpo_alpha_adds_the_token_mean_nll_of_the_chosen_responses(tiny_model_dir, prefs, tmp_path):
    plain = run(tiny_model_dir, prefs, tmp_path / "plain", max_steps=1)
    rpo = run(tiny_model_dir, prefs, tmp_path / "rpo", max_steps=1, rpo_alpha=0.5)
    nll = hf_chosen_nll(tiny_model_dir, prefs, 4, 1, concat_pairs, micro_batch)  # TRL 0.x RPO / CPO's cross-entropy
    assert rpo["loss"] - plain["loss"] == pytest.approx(0.5 * nll, rel=1e-5)


@pytest.mark.numerics
def test_precomputed_reference_gives_the_same_losses(tiny_model_dir, prefs, tmp_path):
    common = dict(max_steps=3, gradient_accumulation_steps=2, per_device_train_batch_size=3)
    live = run(tiny_model_dir, prefs, tmp_path / "live", **common)
    pre = run(tiny_model_dir, prefs, tmp_path / "pre", precompute_ref_log_probs=True, **common)
    for key in ("loss", "rewards/margins", "rewards/chosen", "logps/rejected"):
        assert [h[key] for h in pre["history"]] == pytest.approx([h[key] for h in live["history"]], rel=1e-5, abs=1e-6)


def test_resume_restores_policy_and_reference(tiny_model_dir, prefs, tmp_path):
    start = make_sft_adapter(tiny_model_dir, tmp_path / "sft")
    common = dict(adapter=str(tmp_path / "sft"), max_steps=4)
    straight = run(tiny_model_dir, prefs, tmp_path / "a", save_steps=2, **common)
    ckpt = os.path.join(
        shutil.copytree(straight["run_dir"], tmp_path / "b"), "checkpoints", "step-2"
    )  # resumed in place
    resumed = run(tiny_model_dir, prefs, tmp_path / "b", resume_from_checkpoint=ckpt, **common)
    assert [h["step"] for h in resumed["history"]] == [1, 2, 3, 4]  # the run dir's steps, then the resumed ones
    assert [h["loss"] for h in resumed["history"][2:]] == [h["loss"] for h in straight["history"][2:]]
    a, b = slot_state(straight["model"], "default"), slot_state(resumed["model"], "default")
    assert all(torch.equal(a[k], b[k]) for k in a), "2 steps + resume + 2 steps differs from 4 straight steps"
    assert_adapters(resumed["model"], start, with_ref=True)


@pytest.mark.parametrize("loss_type", ["ipo", "robust", "simpo"])
def test_other_loss_types_train(tiny_model_dir, prefs, tmp_path, loss_type):
    start = make_sft_adapter(tiny_model_dir, tmp_path / "sft")
    out = run(
        tiny_model_dir,
        prefs,
        tmp_path,
        loss_type=loss_type,
        label_smoothing=0.1 if loss_type == "robust" else 0.0,
        rpo_alpha=0.5,
        adapter=str(tmp_path / "sft"),
    )
    assert all(math.isfinite(h["loss"]) for h in out["history"])
    # "default" moved from the start; SimPO is reference-free (no "ref" slot at all), the others keep it frozen
    assert_adapters(out["model"], start, with_ref=loss_type != "simpo")
    assert_base_untouched(out["model"], tiny_model_dir)


# ------------------------------------------------------------------------------- the two log-prob paths
# dpo.main scores pairs with pair_completion_logps on a CPU (each prompt once) and with completion_logps on CUDA
# (one batched forward); both must give the same losses, metrics, gradients and reference log-probs.
def both_paths_policy(tiny_model_dir, adapter_dir):
    """The DPO policy as dpo.main builds it from an SFT adapter, then "default" moved off "ref" (policy != ref)."""
    model, tokenizer = load_model(tiny_model_dir, "fp32")
    setup_chat_template(tokenizer, "auto")
    model = attach_lora(model, adapter_dir)
    disable_dropout(model)
    snapshot_ref(model)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name and ".default." in name:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model, tokenizer


@pytest.mark.numerics
def test_pair_and_batched_log_prob_paths_give_the_same_losses(tiny_model_dir, prefs, tmp_path, monkeypatch):
    make_sft_adapter(tiny_model_dir, tmp_path / "sft")
    model, tokenizer = both_paths_policy(tiny_model_dir, str(tmp_path / "sft"))
    pad_id = tokenizer.pad_token_id
    examples = tokenize_dataset(tokenizer, validate_rows(load_rows(prefs), "preference"), "preference", 64)
    chunk = examples[:4]
    args = Args(per_device_train_batch_size=3, rpo_alpha=0.5)  # the NLL term reads the per-token log-probs too
    params = [p for p in model.parameters() if p.requires_grad]
    fallbacks = []  # pair_completion_logps must really share the prompt pass here, not fall back to the batch
    monkeypatch.setattr(dpo, "completion_logps", lambda *a: fallbacks.append(1) or completion_logps(*a))
    out = {}
    for name, logps_of in (("pair", pair_completion_logps), ("batched", completion_logps)):
        model.train()
        loss, stats, tokens = pair_losses(model, chunk, args, pad_id, "cpu", logps_of)
        grads = torch.autograd.grad(loss, params)
        rows = [dict(e) for e in examples[:7]]
        precompute_ref_logps(model, rows, 3, pad_id, "cpu", logps_of)
        ref = torch.tensor([[e["ref_chosen_logps"], e["ref_rejected_logps"]] for e in rows])
        metrics = evaluate(model, examples[:7], args, pad_id, "cpu", logps_of)
        out[name] = dict(loss=loss.detach(), stats=stats, tokens=tokens, grads=grads, ref=ref, metrics=metrics)
    assert not fallbacks, "pair_completion_logps fell back to the batched forward: nothing was compared"
    pair, batched = out["pair"], out["batched"]
    assert pair["loss"].item() != pytest.approx(math.log(2), abs=1e-3)  # policy != ref: not the trivial point
    torch.testing.assert_close(pair["loss"], batched["loss"], atol=1e-5, rtol=1e-5)
    assert pair["stats"].keys() == batched["stats"].keys() and pair["tokens"] == batched["tokens"]
    for key in pair["stats"]:
        torch.testing.assert_close(pair["stats"][key], batched["stats"][key], atol=1e-5, rtol=1e-5)
    for a, b in zip(pair["grads"], batched["grads"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(pair["ref"], batched["ref"], atol=1e-5, rtol=1e-5)
    assert pair["metrics"].keys() == batched["metrics"].keys()
    for key, value in pair["metrics"].items():
        assert value == pytest.approx(batched["metrics"][key], rel=1e-5, abs=1e-6), key


@pytest.mark.numerics
def test_a_run_on_the_batched_path_matches_the_pair_path(tiny_model_dir, prefs, tmp_path, monkeypatch):
    """dpo.main as it runs on CUDA (completion_logps as logps_of), here on the CPU: the same per-step history."""
    common = dict(max_steps=3, gradient_accumulation_steps=2, per_device_train_batch_size=3, rpo_alpha=0.5)
    common |= dict(eval_split="train", eval_steps=3)
    pair = run(tiny_model_dir, prefs, tmp_path / "pair", **common)
    monkeypatch.setattr(dpo, "pair_completion_logps", completion_logps)  # what dpo.main picks off the CPU
    batched = run(tiny_model_dir, prefs, tmp_path / "batched", **common)
    for key in ("loss", "rewards/margins", "rewards/chosen", "logps/rejected", "grad_norm", "eval/loss"):
        expected = [h[key] for h in pair["history"] if key in h]
        assert [h[key] for h in batched["history"] if key in h] == pytest.approx(expected, rel=1e-5, abs=1e-6), key


# ------------------------------------------------------------------------------------------------- bad input
def test_bad_rows_fail_before_the_model_loads(tmp_path):
    rows = preference_rows(3)
    rows[1]["rejected"] = [{"role": "assistant", "content": "  "}]
    bad = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError, match=r"bad\.jsonl:2: field 'rejected': is empty"):
        main(Args(model=str(tmp_path / "no-such-model"), dataset=bad))  # DataError, not a model-loading error


def test_chosen_equal_rejected_warns_with_its_line_before_loading(tmp_path):
    rows = preference_rows(3)
    rows[2]["rejected"] = rows[2]["chosen"]
    same = write_jsonl(tmp_path / "same.jsonl", rows)
    with pytest.warns(UserWarning, match=r"1 of 3 preference rows have chosen == rejected \(.*same\.jsonl:3\)"):
        with pytest.raises(Exception) as failed:  # the warning came first; then the missing model fails to load
            main(Args(model=str(tmp_path / "no-such-model"), dataset=same))
    assert not isinstance(failed.value, DataError)


def test_robust_rejects_label_smoothing_of_one_half():
    with pytest.raises(ValueError, match="label_smoothing"):
        main(Args(loss_type="robust", label_smoothing=0.5))


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "simpo"])
def test_label_smoothing_is_refused_where_the_loss_ignores_it(loss_type, prefs, tmp_path):
    """It was accepted and silently unused (TRL's CPOTrainer does smooth its simpo loss with it)."""
    with pytest.raises(ArgsError, match=r"^--label-smoothing 0.1: .*only robust"):
        main(Args(model=str(tmp_path / "no-such-model"), dataset=prefs, loss_type=loss_type, label_smoothing=0.1))


# ------------------------------------------------------------------------------------------------- CLI
def test_cli_help_and_one_step(tiny_model_dir, tmp_path):
    help_out = run_cli("dpo.py", "--help")
    assert help_out.returncode == 0, help_out.stderr[-2000:]
    assert "--loss-type" in help_out.stdout and "--precompute-ref-log-probs" in help_out.stdout
    rows = preference_rows(4)
    rows[3]["rejected"] = rows[3]["chosen"]  # the data warning must reach the user's terminal with file:line
    data = write_jsonl(tmp_path / "cli.jsonl", rows)
    done = run_cli(
        "dpo.py",
        "--model",
        tiny_model_dir,
        "--dataset",
        data,
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
    assert "dpo: loss 0.6931" in done.stdout
    assert "cli.jsonl:4" in done.stderr and "chosen == rejected" in done.stderr

"""Parity with TRL 1.16 (scripts/compare_with_trl.py): each method for 2-3 optimizer steps on the tiny model, from the
same LoRA adapter, on the same rows in the same order, with every hyperparameter mapped. The per-step logged values
must agree to float rounding; where the two differ by design, the test pins the difference instead.

Tolerance: |ours - TRL| <= ATOL + RTOL |TRL| per logged value and step, RTOL = ATOL = 1e-5 (fp32 rounding of
~300-token sums is ~1e-5 relative at worst; measured differences are 1e-8 to 3e-6). Sums of completion log-probs
(logps/*, KTO's kl = a difference of such sums) get ATOL = 1e-4: they are O(300) here, so 1e-4 is ~3e-7 relative.
GRPO on one fixed batch: loss to 1e-6, gradients to 1e-5 relative (measured ~3e-7). The values are the harness's own
(scripts/compare_with_trl.py), whose verdict applies them to every compared key.
"""

import pytest

pytest.importorskip("trl")

from scripts.compare_with_trl import (
    ATOL,
    ATOL_SUMS,
    RTOL,
    SUMS,
    Setup,
    make_rows,
    run_pair,
    tokenization_report,
    tokenize_dataset,
    trl_order,
    trl_trainer,
)

pytestmark = pytest.mark.numerics  # every test here compares our per-step numbers with TRL's


@pytest.fixture(scope="module")
def harness(trl_harness):
    return trl_harness


def run(harness, method, **kw):
    setup = Setup(method=method, model=harness["model"], adapter=harness["adapter"], out=harness["out"], **kw)
    return run_pair(setup, harness["tokenizer"])


def assert_series_match(report):
    for key, series in report["series"].items():
        atol = ATOL_SUMS if key in SUMS or (report["setup"]["method"] == "kto" and key == "kl") else ATOL
        for step, (ours, trl) in enumerate(zip(series["ours"], series["trl"], strict=True), 1):
            if ours != ours and trl != trl:  # NaN on both sides: the key was not logged at this step
                continue
            assert abs(ours - trl) <= atol + RTOL * abs(trl), f"{report['name']} {key} step {step}: {ours} vs {trl}"
    losses = report["series"]["loss"]["ours"]
    assert losses[0] != losses[-1], "the loss never moved: parity over the steps would prove nothing"


@pytest.mark.parametrize(
    "method, kw",
    [
        ("sft", dict(grad_accum=2, steps=2)),  # accumulation: both normalise by the whole step's completion tokens
        ("dpo", dict(loss_type="sigmoid")),
        ("dpo", dict(loss_type="ipo")),
        ("dpo", dict(loss_type="robust", label_smoothing=0.1)),
        ("dpo", dict(use_lora=False, learning_rate=1e-4)),  # every weight, both precompute the reference
        ("simpo", dict(cpo_alpha=0.5)),  # CPOTrainer(loss_type="simpo", cpo_alpha) == dpo.py simpo + rpo_alpha
        ("orpo", dict()),
        ("kto", dict()),
        ("rm", dict()),  # RewardTrainer on a seq-cls model holding the same LoRA and rm.py's seeded head
        ("rm", dict(rm_margin=True, center_rewards_coefficient=0.01)),
    ],
    ids=[
        "sft-ga2",
        "dpo-sigmoid",
        "dpo-ipo",
        "dpo-robust",
        "dpo-full",
        "simpo",
        "orpo",
        "kto",
        "rm",
        "rm-margin-center",
    ],
)
def test_per_step_metrics_match_trl(harness, method, kw):
    report = run(harness, method, **kw)
    assert report["tokenization"]["identical"], report["tokenization"]
    assert_series_match(report)
    assert report["verdict"]["verdict"] == "PASS", report["verdict"]  # the harness's own verdict, same tolerances
    if kw.get("use_lora") is False:  # step 1 scores the untouched policy against its own precomputed log-probs
        for side in ("ours", "trl"):
            first = report["history"][side][0]
            assert first["loss"] == pytest.approx(0.6931471805599453, abs=1e-7) and first["rewards/margins"] == 0
    if method == "simpo":  # pinned metric difference: TRL's CPO logs logps/* length-averaged, ours summed
        beta = report["setup"]["beta"] or 0.1
        for ours, trl in zip(report["history"]["ours"], report["history"]["trl"], strict=True):
            for side in ("chosen", "rejected"):
                assert trl[f"logps/{side}"] == pytest.approx(ours[f"rewards/{side}"] / beta, rel=1e-5)


def test_full_finetune_is_refused_for_another_method_before_anything_is_built(tmp_path):
    from scripts.compare_with_trl import main

    with pytest.raises(SystemExit, match="--no-use-lora: only the dpo and grpo comparisons"):
        main(["--method", "kto", "--no-use-lora", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())


def test_grpo_fixed_rollouts_match_trl_per_step_and_per_loss_type(harness):
    """Same completions fed to both (sampling replaced on both sides); then, on the trained model (so the KL term is
    live), one batch in 2 micro-batches through TRL's _compute_loss and our loss for every loss_type."""
    report = run(harness, "grpo", fixed_rollout=True)
    assert_series_match(report)
    assert report["series"]["kl"]["trl"][-1] > 1e-4  # the policy has left the reference: the KL gradient is tested
    rows = {(r["loss_type"], r["trl"], r["ours"]): r for r in report["loss_parity"]}
    parity = [
        r
        for r in rows.values()  # TRL without the KL bias correction; bnpo with TRL's normaliser
        if r["trl"].endswith("False") and (r["loss_type"] != "bnpo" or "x GA" in r["ours"])
    ]
    assert {r["loss_type"] for r in parity} == {"grpo", "bnpo", "dr_grpo", "dapo"}
    for r in parity + [r for r in rows.values() if r["ours"].endswith("KL x ratio")]:
        assert r["loss_abs_diff"] <= 1e-6 and r["grad_rel_diff"] <= 1e-5, r
    # Pinned: TRL 1.16's default use_bias_correction_kl=True multiplies the KL term by the ratio (the one batch is
    # off-policy: its value and its gradient change; on-policy only the gradient would, by beta * k3)
    assert all(r["off_policy"] for r in rows.values())
    for loss_type in ("grpo", "dr_grpo", "dapo"):
        r = rows[(loss_type, "use_bias_correction_kl=True", "grpo.py")]
        assert r["loss_abs_diff"] > 1e-6 and r["grad_rel_diff"] > 1e-4, r
    assert report["verdict"]["verdict"] == "PASS" and report["verdict"]["one_batch"]["verdict"] == "PASS"
    # Pinned: bnpo under accumulation. grpo.py divides by the whole step's tokens (= dapo); TRL by each micro-batch's
    # own tokens x GA, which differs as soon as the micro-batches hold different numbers of tokens.
    r = rows[("bnpo", "use_bias_correction_kl=False", "grpo.py")]
    assert len(set(r["micro_batch_tokens"])) == 2 and r["grad_rel_diff"] > 1e-2, r
    dapo = rows[("dapo", "use_bias_correction_kl=False", "grpo.py")]
    assert r["ours_loss"] == pytest.approx(dapo["ours_loss"], rel=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_full_fine_tuning_matches_trl_without_peft(harness, beta):
    """grpo.py --no-use-lora against GRPOTrainer without a peft_config, from the same base weights and fixed rollouts
    (TRL's reference: a second model loaded from the base's path; ours: the starting weights swapped in): per step to
    the LoRA parity's tolerances, then one batch's loss and every weight's gradient per loss_type."""
    report = run(harness, "grpo", fixed_rollout=True, use_lora=False, beta=beta)
    assert report["name"] == f"grpo-fixed-full-beta={beta:g}"
    assert_series_match(report)
    kl = report["series"]["kl"]["trl"]
    assert kl[-1] > 1e-4 if beta else all(k != k for k in kl)  # beta 0: no KL logged on either side
    parity = [  # TRL without the KL bias correction; bnpo with TRL's normaliser (as the LoRA test)
        r
        for r in report["loss_parity"]
        if r["trl"].endswith("False") and (r["loss_type"] != "bnpo" or "x GA" in r["ours"])
    ]
    assert {r["loss_type"] for r in parity} == {"grpo", "bnpo", "dr_grpo", "dapo"}
    for r in parity:
        assert r["loss_abs_diff"] <= 1e-6 and r["grad_rel_diff"] <= 1e-5, r


def test_chat_rows_pinned_difference_trl_trains_the_newline_after_end_of_turn(harness):
    """With conversational rows TRL 1.16 keeps the template's '\\n' after <|im_end|> in every completion; ours ends at
    <|im_end|>. Exactly one extra token per completion, nothing else (tokenization only, no training)."""
    tokenizer = harness["tokenizer"]
    setup = Setup(
        method="dpo", model=harness["model"], adapter=harness["adapter"], out=harness["out"], chat=True, steps=1
    )
    rows = make_rows("preference", setup.n_rows, tokenizer, chat=True)
    order = trl_order(setup)
    trainer = trl_trainer(setup, [rows[i] for i in order], tokenizer)
    ours = tokenize_dataset(tokenizer, rows, "preference", setup.max_length, max_prompt_length=None)
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    for j, i in enumerate(order):
        trl = trainer.train_dataset[j]
        assert trl["prompt_ids"] == ours[i]["prompt_ids"]
        for side in ("chosen", "rejected"):
            assert ours[i][f"{side}_ids"][-1] == tokenizer.eos_token_id
            assert trl[f"{side}_ids"] == ours[i][f"{side}_ids"] + newline
    assert not tokenization_report(setup, trainer, ours, order)["identical"]


@pytest.mark.slow
def test_grpo_clip_extremes_over_several_updates_match_trl(harness):
    """num_iterations 2 with a clip that binds in the second update: TRL logs clip_ratio/high_max (low_min) per update
    and the harness averages a rollout's updates; grpo.py's must be the same average (not the max over both)."""
    keys = ("loss", "clip_ratio/high_max", "clip_ratio/low_min", "clip_ratio/region_mean")
    kw = dict(fixed_rollout=True, iterations=2, epsilon=3e-4, epsilon_high=4e-4, beta=0.0, steps=2, keys=keys)
    report = run(harness, "grpo", **kw)
    assert max(report["series"]["clip_ratio/high_max"]["trl"]) > 0, "the clip never bound: nothing tested"
    assert_series_match(report)

"""kto.py: the loss with a known z0 by hand and against TRL's KTOTrainer code, then end to end on the tiny model."""

import math
from collections import defaultdict

import pytest
import torch

from common.errors import ArgsError, DataError
from kto import Args, kto_batches, kto_loss, kto_reference_point, main
from tests.prefs_helpers import (
    FakeLM,
    assert_adapters,
    assert_base_untouched,
    assert_logged,
    binary_rows,
    fake_accelerator,
    make_sft_adapter,
    preference_rows,
    rows_with_lengths,
    run_cli,
    write_jsonl,
)

KEYS = (
    "loss",
    "kl",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "memory/peak_gb",
    "perf/tokens_per_s",
    "grad_norm",
    "learning_rate",
)


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


@pytest.mark.numerics
def test_reference_point_is_a_detached_mean_clamped_at_zero():
    kl_logps = torch.tensor([-1.0, -2.0, -3.0], requires_grad=True)
    z0 = kto_reference_point(kl_logps, torch.tensor([-1.5, -3.5, -5.5]))
    assert z0.item() == pytest.approx(1.5) and not z0.requires_grad  # mean(0.5, 1.5, 2.5)
    assert kto_reference_point(kl_logps, torch.tensor([0.0, 0.0, 0.0])).item() == 0.0  # mean -2 -> clamped


@pytest.mark.numerics
def test_loss_with_a_known_z0_by_hand():
    logps, ref_logps = torch.tensor([-4.0, -6.3, -5.8]), torch.tensor([-5.0, -6.0, -6.0])  # h = (1.0, -0.3, 0.2)
    labels = torch.tensor([True, False, True])
    losses, rewards = kto_loss(
        logps=logps,
        ref_logps=ref_logps,
        labels=labels,
        z0=torch.tensor(0.7),
        beta=0.5,
        desirable_weight=1.5,
        undesirable_weight=0.8,
    )
    expected = [
        1.5 * (1 - sigmoid(0.5 * (1.0 - 0.7))),
        0.8 * (1 - sigmoid(0.5 * (0.7 + 0.3))),
        1.5 * (1 - sigmoid(0.5 * (0.2 - 0.7))),
    ]
    assert losses.tolist() == pytest.approx(expected, rel=1e-6)
    assert losses.mean().item() == pytest.approx(sum(expected) / 3, rel=1e-6)  # weighted class sums / batch size
    assert rewards.tolist() == pytest.approx([0.5, -0.15, 0.1], rel=1e-5)


@pytest.mark.numerics
def test_at_the_start_every_row_costs_one_half():
    x = torch.tensor([-3.0, -9.0])
    losses, _ = kto_loss(logps=x, ref_logps=x, labels=torch.tensor([True, False]), z0=kto_reference_point(x, x))
    assert losses.tolist() == [0.5, 0.5]  # h = 0, z0 = 0: 1 - sigmoid(0)


def test_mismatched_pairs_rotate_completions_by_one_like_trl():
    examples = [{"prompt_ids": [10 + i], "completion_ids": [20 + i] * (i + 1)} for i in range(3)]
    matched, mismatched = kto_batches(examples, 0, 3, "cpu")
    # TRL: KL_completion_ids = [c[-1]] + c[:-1], i.e. (x_i, y_{i-1}); cut to max_length=3 after the prompt
    assert mismatched["input_ids"].tolist() == [[10, 22, 22], [11, 20, 0], [12, 21, 21]]
    assert mismatched["completion_mask"].tolist() == [[0, 1, 1], [0, 1, 0], [0, 1, 1]]
    assert matched["input_ids"][2].tolist() == [12, 22, 22, 22]  # matched rows come tokenized to fit already


@pytest.mark.numerics
def test_matches_trl_kto_trainer():
    pytest.importorskip("trl")
    from trl import KTOTrainer

    g = torch.Generator().manual_seed(0)
    logps, ref_logps, kl_logps = (-20 * torch.rand(6, generator=g) for _ in range(3))
    ref_kl_logps = kl_logps - 2 * torch.rand(6, generator=g)  # KL estimate > 0, so z0 is not clamped
    labels = torch.tensor([True, False, False, True, False, True])
    trainer = object.__new__(KTOTrainer)  # no __init__: only the attributes _compute_loss reads
    trainer.__dict__.update(
        model=FakeLM(torch.cat([logps, kl_logps])),
        accelerator=fake_accelerator(),
        aux_loss_enabled=False,
        calculate_KL=True,
        precompute_ref_logps=True,
        loss_type="kto",
        beta=0.3,
        desirable_weight=1.3,
        undesirable_weight=0.7,
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    ids, attention, completion = rows_with_lengths(range(6), [3] * 6, 8)
    kl_ids, kl_attention, kl_completion = rows_with_lengths(range(6, 12), [3] * 6, 8)
    inputs = dict(
        input_ids=ids,
        attention_mask=attention,
        completion_mask=completion,
        KL_input_ids=kl_ids,
        KL_attention_mask=kl_attention,
        KL_completion_mask=kl_completion,
        label=labels,
        ref_logps=ref_logps,
        ref_KL_logps=ref_kl_logps,
    )
    trl_loss = trainer._compute_loss(trainer.model, inputs, return_outputs=False)
    trl = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    z0 = kto_reference_point(kl_logps, ref_kl_logps)
    losses, rewards = kto_loss(
        logps=logps, ref_logps=ref_logps, labels=labels, z0=z0, beta=0.3, desirable_weight=1.3, undesirable_weight=0.7
    )
    torch.testing.assert_close(losses.mean(), trl_loss, rtol=1e-6, atol=1e-6)
    assert z0.item() == pytest.approx(trl["kl"], rel=1e-6) and z0.item() > 0
    assert rewards[labels].mean().item() == pytest.approx(trl["rewards/chosen"], rel=1e-6)
    assert rewards[~labels].mean().item() == pytest.approx(trl["rewards/rejected"], rel=1e-6)
    assert logps[labels].mean().item() == pytest.approx(trl["logps/chosen"], rel=1e-6)


# ------------------------------------------------------------------------------------------------- end to end
def run(tiny_model_dir, dataset, tmp_path, **kw):
    defaults = dict(
        model=tiny_model_dir,
        dataset=dataset,
        output_dir=str(tmp_path / "runs"),
        max_length=64,
        per_device_train_batch_size=8,
        learning_rate=5e-3,
        max_steps=2,
        seed=1,
    )
    return main(Args(**{**defaults, **kw}))


def test_from_sft_adapter_end_to_end(tiny_model_dir, tmp_path):
    start = make_sft_adapter(tiny_model_dir, tmp_path / "sft")
    data = write_jsonl(tmp_path / "binary.jsonl", binary_rows(16))
    out = run(tiny_model_dir, data, tmp_path, adapter=str(tmp_path / "sft"), max_steps=3)
    assert out["history"][0]["loss"] == pytest.approx(0.5, abs=1e-6)  # policy == ref at step 1: h = 0, z0 = 0
    assert out["history"][0]["kl"] == 0.0
    assert_logged(out, KEYS)
    assert_adapters(out["model"], start, with_ref=True)
    assert_base_untouched(out["model"], tiny_model_dir)


def test_preference_data_is_unpaired_and_learned(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "prefs.jsonl", preference_rows(8))  # 8 pairs -> 16 binary rows
    out = run(tiny_model_dir, data, tmp_path, max_steps=20)
    assert out["epoch"] == pytest.approx(20 * 8 / 16)  # 16 unpaired rows, 2 batches per epoch
    assert out["rewards/margins"] > 0.5 and out["rewards/chosen"] > 0 > out["rewards/rejected"]
    assert out["loss"] < out["history"][0]["loss"]


def test_one_class_batches_warn_and_train_on_the_class_they_have(tiny_model_dir, tmp_path):
    rows = [dict(row, label=i > 0) for i, row in enumerate(binary_rows(8))]  # 1 undesirable, 7 desirable
    data = write_jsonl(tmp_path / "skewed.jsonl", rows)
    with pytest.warns(UserWarning, match=r"micro-batches hold only desirable or only undesirable rows"):
        out = run(tiny_model_dir, data, tmp_path, per_device_train_batch_size=2, max_steps=4)
    for h in out["history"]:
        assert math.isfinite(h["loss"]) and "rewards/chosen" in h
        assert ("rewards/margins" in h) == ("rewards/rejected" in h)  # margins only when both classes are there
    assert {"rewards/margins" in h for h in out["history"]} == {True, False}  # both kinds of step happened


def test_an_epochs_last_row_alone_still_gets_a_mismatched_pair(tiny_model_dir, tmp_path, monkeypatch):
    # 9 rows, batch 8: the epoch's second micro-batch held one row, whose "mismatched" pair (x_1, y_1) was the matched
    # one, so z0 = max(0, h) and the row's loss was a constant 0.5 whenever h > 0: the very case batch size 1 refuses.
    import kto

    seen, build = [], kto.kto_batches
    monkeypatch.setattr(kto, "kto_batches", lambda ex, *a: seen.append(ex) or build(ex, *a))
    run(tiny_model_dir, write_jsonl(tmp_path / "nine.jsonl", binary_rows(9)), tmp_path, max_steps=2)
    assert [len(chunk) for chunk in seen] == [8, 2]
    assert all(len({e["_loc"] for e in chunk}) == len(chunk) for chunk in seen)  # (x_i, y_{i-1}) from another row


def test_non_boolean_label_fails_before_the_model_loads(tmp_path):
    rows = binary_rows(3)
    rows[1]["label"] = "yes"
    bad = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError, match=r"bad\.jsonl:2: field 'label': must be a JSON boolean"):
        main(Args(model=str(tmp_path / "no-such-model"), dataset=bad))


def test_single_class_dataset_warns_before_the_model_loads(tmp_path):
    rows = [dict(r, label=True) for r in binary_rows(3)]
    data = write_jsonl(tmp_path / "all_good.jsonl", rows)
    with pytest.warns(UserWarning, match=r"all 3 binary rows are labelled True"):
        with pytest.raises(Exception) as failed:  # the warning came first; then the missing model fails to load
            main(Args(model=str(tmp_path / "no-such-model"), dataset=data))
    assert not isinstance(failed.value, DataError)


def test_batch_of_one_is_refused():
    with pytest.raises(ArgsError, match="--per-device-train-batch-size 1: KTO needs >= 2 rows"):
        main(Args(per_device_train_batch_size=1))


def test_a_single_row_is_refused_before_the_model_loads(tmp_path):
    """With one row its KL pair is the row itself (z0 = h, a constant loss of 0.5 when h > 0): nothing to learn."""
    one = write_jsonl(tmp_path / "one.jsonl", binary_rows(1))
    with pytest.raises(DataError, match=r"one\.jsonl: one row; KTO needs >= 2"):
        main(Args(model=str(tmp_path / "no-such-model"), dataset=one))


def test_cli_help_and_one_step(tiny_model_dir, tmp_path):
    help_out = run_cli("kto.py", "--help")
    assert help_out.returncode == 0 and "--desirable-weight" in help_out.stdout
    rows = preference_rows(4)
    rows[1]["rejected"] = rows[1]["chosen"]  # the data warning must reach the user's terminal with file:line
    data = write_jsonl(tmp_path / "cli.jsonl", rows)
    done = run_cli(
        "kto.py",
        "--model",
        tiny_model_dir,
        "--dataset",
        data,
        "--max-steps",
        1,
        "--max-length",
        64,
        "--per-device-train-batch-size",
        4,
        "--output-dir",
        tmp_path / "cli",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "kto: loss 0.5000" in done.stdout
    assert "cli.jsonl:2" in done.stderr and "chosen == rejected" in done.stderr

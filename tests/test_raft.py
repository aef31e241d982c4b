"""raft.py: selection and pairing on hand-made scored groups, SPIN pairs, one round end to end on the tiny model
(round files valid for sft.py / dpo.py, metrics, adapters), exact resume at a round boundary, the reference = each
round's starting policy (LoRA and full fine-tuning), CLI."""

import functools
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

import raft
from common.data import load_rows
from common.completions import validate_rows
from harness.errors import CorruptCheckpointError, ResumeError, RunStopped
from harness.checkpoints import write_marker
from safetensors.torch import load_file, save_file
from raft import Args, last_good_round, main, make_pairs, select_best, spin_pairs
from tests import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAN = math.nan


def frac_low_ids(prompts, completions, completion_ids=None, **kw):
    """Rule reward with varied scores on random text: the share of completion tokens whose id is below 200."""
    return [sum(t < 200 for t in ids) / max(len(ids), 1) for ids in completion_ids]


# ---------------------------------------------------------------------------------------------------- selection
def test_select_best_threshold_ties_and_keep_per_prompt():
    scores = [
        [0.2, 0.9, 0.9, 0.5],  # tie for best: sample order decides
        [0.1, 0.3, 0.2, 0.0],  # nothing reaches the threshold
        [1.0, NAN, 0.7, 0.6],
    ]  # NaN = unusable (truncated / empty), never kept
    assert select_best(scores, 0.5, 1) == [(0, 1), (2, 0)]
    assert select_best(scores, 0.5, 2) == [(0, 1), (0, 2), (2, 0), (2, 2)]
    assert select_best(scores, 0.5, 10) == [(0, 1), (0, 2), (0, 3), (2, 0), (2, 2), (2, 3)]
    assert select_best(scores, None, 1) == [(0, 1), (1, 1), (2, 0)]  # best of K, whatever its score
    assert select_best(torch.tensor([[0.0, 1.0, 1.0, 0.0]]), 1.0, 1) == [(0, 1)]  # >=, tensors too
    assert select_best([[NAN, NAN]], None, 1) == []


def test_make_pairs_margin_ties_equal_groups_and_k1():
    scores = [
        [0.0, 1.0, 0.0, 1.0],  # ties at both ends: the first best (1), the last worst (2)
        [0.5, 0.5, 0.5, 0.5],  # all equal: no pair, even with min_margin 0
        [0.2, 0.4, 0.3, 0.25],  # margin 0.2
        [1.0, NAN, NAN, 0.0],  # NaN samples are never paired
        [1.0, NAN, NAN, NAN],
    ]  # one usable sample: no pair
    assert make_pairs(scores, 0.0) == [(0, 1, 2), (2, 1, 0), (3, 0, 3)]
    assert make_pairs(scores, 0.2) == [(0, 1, 2), (2, 1, 0), (3, 0, 3)]  # margin >= min_margin
    assert make_pairs(scores, 0.5) == [(0, 1, 2), (3, 0, 3)]
    assert make_pairs(scores, 1.5) == []
    assert make_pairs([[1.0], [0.0]], 0.0) == []  # K = 1: no pair is possible


def test_spin_pairs():
    chat = [
        {"prompt": [{"role": "user", "content": f"q{i}"}], "completion": [{"role": "assistant", "content": f"a{i}"}]}
        for i in range(4)
    ]
    pairs = spin_pairs(chat, ["wrong", None, " a2 ", ""])  # None: unusable; same as the truth or empty: no pair
    assert pairs == [
        {
            "prompt": chat[0]["prompt"],
            "chosen": chat[0]["completion"],
            "rejected": [{"role": "assistant", "content": "wrong"}],
        }
    ]
    assert spin_pairs([{"prompt": "2+2=", "completion": " 4"}], [" 5"]) == [
        {"prompt": "2+2=", "chosen": " 4", "rejected": " 5"}
    ]  # standard (string) rows stay strings
    validate_rows(pairs, "preference")


# ---------------------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def prompts_jsonl(tmp_path_factory):
    """Conversational rows with both an answer (raft's rewards) and a completion (SPIN's ground truth)."""
    path = tmp_path_factory.mktemp("raft_data") / "rows.jsonl"
    with open(path, "w") as f:
        for i, q in enumerate(["What is 12 plus 7?", "Say hello", "Tom has 3 apples.", "Name a colour"]):
            f.write(
                json.dumps(
                    {
                        "prompt": [{"role": "user", "content": q}],
                        "answer": str(i),
                        "completion": [{"role": "assistant", "content": f"The answer is {i}."}],
                    }
                )
                + "\n"
            )
    return str(path)


def run(model_dir, dataset, out_dir, **kw):
    defaults = dict(
        preset="demo",
        model=model_dir,
        dataset=dataset,
        output_dir=str(out_dir),
        rewards=["tests.test_raft:frac_low_ids"],
        num_rounds=1,
        prompts_per_round=2,
        group_size=4,
        max_completion_length=6,
        reward_threshold=None,
        min_margin=0.0,
        mask_truncated_completions=False,
        learning_rate=1e-2,
        dpo_learning_rate=1e-2,
        per_device_train_batch_size=2,
        num_train_epochs=1.0,
        eval_dataset="builtin:math",
        eval_limit=2,
        seed=1,
    )
    return main(Args(**{**defaults, **kw}))


@pytest.fixture
def spy_model(monkeypatch):
    """The policy main() builds, and a copy of every parameter right after the LoRA is attached."""
    seen = {}

    def attach(*args, **kwargs):
        model = attach_lora(*args, **kwargs)
        seen["model"], seen["before"] = model, {n: p.detach().clone() for n, p in model.named_parameters()}
        return model

    attach_lora = raft.attach_lora  # what raft.main calls, by its name in raft's namespace
    monkeypatch.setattr(raft, "attach_lora", attach)
    return seen


@pytest.fixture
def reference_spy(monkeypatch):
    """Each call of raft.reference_logps: the policy it scored with (what a round writes: the "default" adapter's or
    every weight's tensors, as saved) and the pairs with the log-probs it stored in them."""
    from peft import get_peft_model_state_dict

    from common.model import is_peft

    calls = []
    original = raft.reference_logps

    @functools.wraps(original)  # spy.__wrapped__: raft's own, to score again
    def spy(model, pairs, *args, **kwargs):
        state = get_peft_model_state_dict(model) if is_peft(model) else model.state_dict()
        calls.append({"policy": {k: v.detach().clone() for k, v in state.items()}, "pairs": pairs})
        return original(model, pairs, *args, **kwargs)

    monkeypatch.setattr(raft, "reference_logps", spy)
    return calls


def saved_policy(round_dir: str) -> dict:
    """The policy a round wrote: its adapter's tensors, or the full model's."""
    folder = os.path.join(round_dir, "adapter")
    lora = os.path.exists(os.path.join(folder, "adapter_config.json"))
    return load_file(os.path.join(folder, "adapter_model.safetensors" if lora else "model.safetensors"))


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_one_round_files_adapters_and_exact_resume(tiny_model_dir, prompts_jsonl, tmp_path, spy_model, reference_spy):
    out = run(tiny_model_dir, prompts_jsonl, tmp_path / "a", dpo=True)
    run_dir = out["run_dir"]
    assert sorted(d for d in os.listdir(run_dir) if "round" in d) == ["round-0", "round-1"]  # no temp dir left
    r1 = os.path.join(run_dir, "round-1")
    assert sorted(os.listdir(r1)) == [
        "adapter",
        "eval.jsonl",
        "metrics.json",
        "pairs.jsonl",
        "round_complete.json",
        "samples.jsonl",
        "sft.jsonl",
    ]
    samples = read_jsonl(os.path.join(r1, "samples.jsonl"))
    assert len(samples) == 8 and all(
        {"prompt", "completion", "reward", "truncated", "usable"} <= s.keys() for s in samples
    )
    # The round's data is what sft.py / dpo.py read: same loader, same validation
    sft_rows = validate_rows(load_rows(os.path.join(r1, "sft.jsonl")), "supervised")
    pairs = validate_rows(load_rows(os.path.join(r1, "pairs.jsonl")), "preference")
    assert len(sft_rows) == 2 and 1 <= len(pairs) <= 2  # best of K per prompt; a pair per non-tied group
    for row in sft_rows:  # the kept sample is its group's best
        assert row["reward"] == max(s["reward"] for s in samples if s["prompt"] == row["prompt"])
    assert all(p["score_chosen"] > p["score_rejected"] for p in pairs)

    # Metrics: one step per round (round 0 = the starting policy's eval), also in metrics.json
    logged = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [row["step"] for row in logged] == [0, 1] and "eval/builtin_math/accuracy" in logged[0]
    expected = {
        "reward",
        "reward_std",
        "rewards/frac_low_ids/mean",
        "kept_fraction",
        "num_kept",
        "num_pairs",
        "completions/mean_length",
        "completions/clipped_ratio",
        "sft/loss",
        "sft/grad_norm",
        "dpo/loss",
        "dpo/rewards/accuracies",
        "dpo/rewards/margins",
        "eval/builtin_math/accuracy",
        "time/rollout",
        "time/round",
    }
    assert expected <= logged[1].keys(), expected - logged[1].keys()
    assert all(math.isfinite(logged[1][k]) for k in expected)
    with open(os.path.join(r1, "metrics.json")) as f:
        assert json.load(f)["sft/loss"] == pytest.approx(logged[1]["sft/loss"])
    assert out["kept_fraction"] == 2 / 8 and out["num_pairs"] == len(pairs)

    # The reference = the round-start policy (the fresh adapter), scored once before the SFT phase moved it, with no
    # "ref" slot; base bit-identical, "default" moved
    model, before = spy_model["model"], spy_model["before"]
    assert "ref" not in model.peft_config and len(reference_spy) == 1
    fresh = {k: before[k.replace(".weight", ".default.weight")] for k in reference_spy[0]["policy"]}
    assert same_tensors(reference_spy[0]["policy"], fresh)
    assert all(math.isfinite(e["ref_chosen_logps"] + e["ref_rejected_logps"]) for e in reference_spy[0]["pairs"])
    for name, p in model.named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, before[name]), f"base weight {name} changed"
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if ".default." in n)

    # Resume with 2 rounds: only round-2 is new, and it equals round 2 of an uninterrupted 2-round run
    stamps = {f: os.path.getmtime(os.path.join(r1, f)) for f in os.listdir(r1)}
    resumed = run(tiny_model_dir, prompts_jsonl, tmp_path / "unused", dpo=True, num_rounds=2, resume_from=run_dir)
    assert resumed["run_dir"] == run_dir and not os.path.exists(tmp_path / "unused")
    assert sorted(d for d in os.listdir(run_dir) if "round" in d) == ["round-0", "round-1", "round-2"]
    assert stamps == {f: os.path.getmtime(os.path.join(r1, f)) for f in os.listdir(r1)}
    assert [row["step"] for row in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))] == [0, 1, 2]
    assert [h["step"] for h in resumed["history"]] == [0, 1, 2] and len(resumed["accuracy_by_round"]) == 3
    straight = run(tiny_model_dir, prompts_jsonl, tmp_path / "b", dpo=True, num_rounds=2)
    for name in ("round-1/samples.jsonl", "round-2/samples.jsonl", "round-2/sft.jsonl", "round-2/pairs.jsonl"):
        assert read_jsonl(os.path.join(run_dir, name)) == read_jsonl(os.path.join(straight["run_dir"], name)), name


def test_raft_without_dpo_has_no_reference(tiny_model_dir, prompts_jsonl, tmp_path, spy_model):
    out = run(tiny_model_dir, prompts_jsonl, tmp_path, eval_limit=0, keep_per_prompt=2)
    assert "ref" not in spy_model["model"].peft_config and "dpo/loss" not in out
    assert out["num_kept"] == 4 and out["num_pairs"] >= 1  # pairs are written even when not trained on
    assert "eval/builtin_math/accuracy" not in out


def test_spin_pairs_ground_truth_and_refreshes_the_reference(tiny_model_dir, prompts_jsonl, tmp_path, reference_spy):
    out = run(tiny_model_dir, prompts_jsonl, tmp_path, mode="spin", prompts_per_round=4, num_rounds=2)
    r1 = os.path.join(out["run_dir"], "round-1")
    assert "sft.jsonl" not in os.listdir(r1) and len(read_jsonl(os.path.join(r1, "samples.jsonl"))) == 4  # K = 1
    pairs = validate_rows(load_rows(os.path.join(r1, "pairs.jsonl")), "preference")
    truth = {json.dumps(r["prompt"]): r["completion"] for r in load_rows(prompts_jsonl)}
    assert pairs and all(p["chosen"] == truth[json.dumps(p["prompt"])] != p["rejected"] for p in pairs)
    assert out["history"][1]["dpo/steps"] == math.ceil(len(pairs) / 2) and math.isfinite(out["dpo/loss"])
    # Iteration 2's reference is the policy iteration 1 trained (written to round-1): the next opponent
    assert len(reference_spy) == 2 and same_tensors(reference_spy[1]["policy"], saved_policy(r1))
    assert not same_tensors(reference_spy[0]["policy"], saved_policy(r1))  # iteration 1 moved it


# ---------------------------------------------------------------------------------------------------- full fine-tuning
@pytest.mark.parametrize("mode", ["raft", "spin"])
def test_full_fine_tuning_scores_each_rounds_pairs_with_the_round_start_policy(prompts_jsonl, tmp_path, reference_spy,
                                                                              mode):  # fmt: skip
    """--no-use-lora, 2 rounds with a DPO loss: every weight trains; each round's reference log-probs are those of the
    policy it started from (round 1: the starting weights; round 2: the weights round 1 wrote), scored before any
    update of the round (raft's SFT phase included) and bit for bit what that policy gives; round-N/adapter/ holds the
    full model; final/ is a plain transformers model that stops at the trained end of turn."""
    from common.model import load_model
    from common.completions import disable_dropout
    from tests.test_grpo import base_stopping_at_endoftext, check_full_final

    base, stops = base_stopping_at_endoftext(tmp_path)
    kw = dict(mode="spin", prompts_per_round=4) if mode == "spin" else dict(dpo=True)
    out = run(base, prompts_jsonl, tmp_path / "runs", use_lora=False, num_rounds=2, **kw)
    start = load_model(base)[0].state_dict()
    rounds = [os.path.join(out["run_dir"], f"round-{r}") for r in (1, 2)]
    assert all(sorted(os.listdir(os.path.join(r, "adapter"))) == ["config.json", "generation_config.json",
                                                                   "model.safetensors"] for r in rounds)  # fmt: skip
    written = [saved_policy(r) for r in rounds]
    assert len(reference_spy) == 2
    assert same_tensors(reference_spy[0]["policy"], start) and same_tensors(reference_spy[1]["policy"], written[0])
    assert not same_tensors(start, written[0]) and not same_tensors(written[0], written[1])  # each round trained
    unmoved = [k for k in start if torch.equal(written[1][k], start[k])]
    assert not unmoved, f"weights that did not train: {unmoved}"
    for call in reference_spy:  # the stored log-probs are the round-start policy's, scored again from its weights
        model, tokenizer = load_model(base)
        model.load_state_dict(call["policy"])
        disable_dropout(model)
        again = [{k: v for k, v in e.items() if not k.startswith("ref_")} for e in call["pairs"]]
        raft.reference_logps.__wrapped__(model, again, 2, tokenizer.pad_token_id, model.device)
        assert [(e["ref_chosen_logps"], e["ref_rejected_logps"]) for e in call["pairs"]] == [
            (e["ref_chosen_logps"], e["ref_rejected_logps"]) for e in again
        ]
    losses = [h[k] for h in out["history"][1:] for k in ("sft/loss", "dpo/loss") if k in h]
    assert len(losses) == (2 if mode == "spin" else 4) and all(map(math.isfinite, losses))
    trained = {n: p.detach() for n, p in out["model"].named_parameters()}
    assert same_tensors(trained, written[1])
    check_full_final(out["final_dir"], trained, stops)


def test_a_full_fine_tune_resumes_by_rounds(tiny_model_dir, prompts_jsonl, tmp_path):
    """Round 2 of a run resumed after round 1 (the full model's weights read back from round-1/adapter/) writes the
    same samples, pairs, metrics and weights as round 2 of the straight 2-round run."""
    from tests.test_grpo import without_timing

    first = run(tiny_model_dir, prompts_jsonl, tmp_path / "a", use_lora=False, dpo=True)
    resumed = run(tiny_model_dir, prompts_jsonl, tmp_path / "unused", use_lora=False, dpo=True, num_rounds=2,
                  resume_from=first["run_dir"])  # fmt: skip
    straight = run(tiny_model_dir, prompts_jsonl, tmp_path / "b", use_lora=False, dpo=True, num_rounds=2)
    a, b = resumed["run_dir"], straight["run_dir"]
    for name in ("round-2/samples.jsonl", "round-2/sft.jsonl", "round-2/pairs.jsonl", "round-2/eval.jsonl"):
        assert read_jsonl(os.path.join(a, name)) == read_jsonl(os.path.join(b, name)), name
    assert [h["step"] for h in resumed["history"]] == [0, 1, 2]  # the run dir's rounds, then the resumed one
    assert without_timing(resumed["history"]) == without_timing(straight["history"])
    assert "dpo/loss" in resumed["history"][-1]
    assert same_tensors(saved_policy(os.path.join(a, "round-2")), saved_policy(os.path.join(b, "round-2")))


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(quantization="4bit"), "--quantization 4bit with --no-use-lora: a quantized base trains only through"),
        (dict(adapter="some/adapter"), "--adapter some/adapter with --no-use-lora: merge it first"),
    ],
)
def test_full_fine_tuning_refuses_what_needs_an_adapter_before_loading(tmp_path, monkeypatch, flags, message):
    from common.errors import ArgsError

    monkeypatch.setattr(raft, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(ArgsError, match=message):
        main(Args(preset="demo", output_dir=str(tmp_path), use_lora=False, **flags))
    assert os.listdir(tmp_path) == []


def test_a_round_is_sampled_in_slices_with_each_prompts_samples_together(
    tiny_model_dir, prompts_jsonl, tmp_path, monkeypatch
):
    """--generation-batch-size bounds one generate() call (the KV cache): 4 prompts in slices of 3 and 1, joined in
    order, so each prompt's K samples are still rows i*K .. i*K+K-1 of the round (scored, kept and paired as such)."""
    calls = []

    def spy(model, tokenizer, prompts, *a, **k):
        calls.append(len(prompts))
        return hf_generate(model, tokenizer, prompts, *a, **k)

    hf_generate = raft.hf_generate
    monkeypatch.setattr(raft, "hf_generate", spy)
    out = run(tiny_model_dir, prompts_jsonl, tmp_path, prompts_per_round=4, group_size=2, generation_batch_size=3,
              eval_limit=0)  # fmt: skip
    assert calls == [3, 1]
    samples = read_jsonl(os.path.join(out["run_dir"], "round-1", "samples.jsonl"))
    prompts = [json.dumps(s["prompt"]) for s in samples]
    assert len(samples) == 8 and all(prompts[2 * i] == prompts[2 * i + 1] for i in range(4))
    assert len(set(prompts)) == 4  # every prompt of the round, each once, as one group


def test_a_phase_makes_num_train_epochs_full_passes_over_its_rows():
    """run_phase counted ceil(rows * epochs / batch) steps, fewer than the batches of that many epochs when the last
    batch of an epoch is short: 10 rows in batches of 8 for 2 epochs took 3 steps (8, 2, 8), and 2 rows were seen
    once."""
    seen, model = [], torch.nn.Linear(2, 1)

    def step_loss(chunk):  # (the micro-batch's summed loss, its count, stats)
        if torch.is_grad_enabled():  # an update's rows, not the no-grad check of the policy the phase leaves
            seen.extend(e["i"] for e in chunk)
        return model.weight.sum() * 0.0, len(chunk), {}

    args = Args(per_device_train_batch_size=8, num_train_epochs=2.0)
    out = raft.run_phase(model, [{"i": i} for i in range(10)], args, 1e-3, step_loss, "sft/", seed=0)
    assert sorted(seen) == sorted(list(range(10)) * 2) and out["sft/steps"] == 4


def test_pass_rate_counts_only_usable_samples(tiny_model_dir, prompts_jsonl, tmp_path):
    """pass_rate is the share of samples good enough to keep: a truncated completion (never kept or paired) that
    scores above the threshold used to count as passing."""
    out = run(tiny_model_dir, prompts_jsonl, tmp_path, reward_threshold=0.0, mask_truncated_completions=True,
              eval_limit=0)  # fmt: skip
    samples = read_jsonl(os.path.join(out["run_dir"], "round-1", "samples.jsonl"))
    assert all(s["reward"] >= 0.0 for s in samples) and not all(s["usable"] for s in samples)  # a truncated one
    assert out["pass_rate"] == sum(s["usable"] for s in samples) / len(samples)


def test_spin_needs_completions(tmp_path):
    with pytest.raises(ValueError, match="completion"):
        main(Args(mode="spin", dataset="builtin:math", output_dir=str(tmp_path)))


def test_cli_help_and_one_round(tiny_model_dir, prompts_jsonl, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    help_out = subprocess.run([sys.executable, "raft.py", "--help"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert help_out.returncode == 0 and "--reward-threshold" in help_out.stdout and "--mode" in help_out.stdout
    done = cli.run(
        [
            sys.executable,
            "raft.py",
            "--preset",
            "demo",
            "--model",
            tiny_model_dir,
            "--dataset",
            prompts_jsonl,
            "--rewards",
            "length",
            "--num-rounds",
            "1",
            "--group-size",
            "2",
            "--prompts-per-round",
            "2",
            "--max-completion-length",
            "4",
            "--reward-threshold",
            "None",
            "--no-mask-truncated-completions",
            "--eval-limit",
            "1",
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
    assert "raft (raft): eval/builtin_math/accuracy by round" in done.stdout


@pytest.fixture(scope="module")
def two_rounds(tiny_model_dir, prompts_jsonl, tmp_path_factory):
    """A finished 2-round raft run dir (copy it before damaging it)."""
    return run(tiny_model_dir, prompts_jsonl, tmp_path_factory.mktemp("two"), num_rounds=2)["run_dir"]


def damage(path: str, how: str) -> None:
    if how == "truncated":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        return
    tensors = load_file(path)
    key = next(k for k in tensors if "lora_B" in k)
    if how == "flipped":
        tensors[key].view(torch.int32).view(-1)[0] ^= 1 << 29  # one exponent bit
    else:
        tensors[key].view(-1)[0] = math.nan
    save_file(tensors, path)
    if how == "nan-resealed":  # the marker rewritten to match: the finite check on load still refuses it
        folder = os.path.dirname(os.path.dirname(path))
        meta = json.load(open(os.path.join(folder, "round_complete.json")))
        write_marker(folder, "round_complete.json", {"round": meta["round"]})


@pytest.mark.parametrize("how", ["flipped", "truncated", "nan-resealed"])
def test_a_damaged_newest_round_falls_back_to_the_previous_one(
    tiny_model_dir, prompts_jsonl, two_rounds, tmp_path, how
):
    """Issue 40, section 3: a flipped bit in round-N's weights resumed silently, a NaN crashed the rollout, a
    truncated file gave a raw SafetensorError. Now round-N is checked (its files' sha256, its weights finite) and the
    previous round is resumed from, with one warning."""
    run_dir = shutil.copytree(two_rounds, tmp_path / "copy")
    damage(os.path.join(run_dir, "round-2", "adapter", "adapter_model.safetensors"), how)
    problem = "holds NaN/Inf" if how == "nan-resealed" else "does not match the hashes"
    with pytest.warns(UserWarning, match=f"round-2: .*{problem}.*falling back to the previous round"):
        out = run(tiny_model_dir, prompts_jsonl, tmp_path / "unused", num_rounds=3, resume_from=str(run_dir))
    # the run's whole history: the rounds kept (0, 1), then round 2 again and round 3 (the damaged round's line moved
    # aside with it)
    assert [h["step"] for h in out["history"]] == [0, 1, 2, 3]
    assert sorted(d for d in os.listdir(run_dir) if "round" in d) == ["round-0", "round-1", "round-2", "round-3"]


def test_a_round_marker_with_a_flipped_bit_is_refused(two_rounds, tmp_path):
    run_dir = shutil.copytree(two_rounds, tmp_path / "copy")
    marker = pathlib.Path(run_dir, "round-2", "round_complete.json")
    marker.write_bytes(marker.read_bytes().replace(b'"round": 2', b'"round": 0'))  # one bit
    with pytest.warns(UserWarning, match="round-2: round_complete.json does not match its own hash"):
        assert last_good_round(str(run_dir)) == 1
    for n in (0, 1):
        shutil.rmtree(pathlib.Path(run_dir, f"round-{n}", "adapter"), ignore_errors=True)
        pathlib.Path(run_dir, f"round-{n}", "metrics.json").write_text("{}")
    with pytest.warns(UserWarning), pytest.raises(CorruptCheckpointError, match="no intact round .*round-2.*round-0"):
        last_good_round(str(run_dir))


def test_a_huge_learning_rate_stops_with_the_last_good_round(tiny_model_dir, prompts_jsonl, tmp_path):
    """Issue 40, section 4: --learning-rate 1e30 wrote a round with huge (finite) weights, and the next rollout died
    on a raw 'index ... out of bounds'. The policy an update leaves is scored once: NaN/Inf stops the round unwritten,
    naming the last good round."""
    with pytest.raises(RunStopped, match=r"stopped in round 1 \(.*the updated policy's loss is NaN/Inf\)") as e:
        run(tiny_model_dir, prompts_jsonl, tmp_path, num_rounds=2, learning_rate=1e30)
    assert e.value.checkpoint.endswith("round-0") and "last good: " in str(e.value)
    run_dir = os.path.dirname(e.value.checkpoint)
    assert sorted(d for d in os.listdir(run_dir) if "round" in d) == ["round-0"]


def test_a_round_copied_from_an_earlier_round_or_another_run_is_refused(
    tiny_model_dir, prompts_jsonl, two_rounds, tmp_path
):
    """Issue 51, item 6: round markers held no run identity and the round number was not compared with the folder,
    so a resume continued from a round copied from another run, or from an earlier round, without a word. Each
    marker now holds its round and its run (identity.json: the run's identity and a random run_id), checked on
    resume: a copy is refused in one line naming the folder, before anything loads."""
    run_dir = shutil.copytree(two_rounds, tmp_path / "copy")
    marker = json.load(open(os.path.join(run_dir, "round-2", "round_complete.json")))
    record = json.load(open(os.path.join(run_dir, "identity.json")))
    assert marker["round"] == 2 and marker["run"] == record and record["args.seed"] == 1 and record["run_id"]
    shutil.rmtree(os.path.join(run_dir, "round-2"))
    shutil.copytree(os.path.join(run_dir, "round-1"), os.path.join(run_dir, "round-2"))  # an earlier round
    with pytest.raises(ResumeError, match=r"round-2: its marker is round 1's \(a copy of another round\)$"):
        last_good_round(run_dir)
    # another run of the same command (the same identity: --num-rounds may change): its round-1 in place of ours
    other = run(tiny_model_dir, prompts_jsonl, tmp_path / "other", num_rounds=1)["run_dir"]
    for n in (1, 2):
        shutil.rmtree(os.path.join(run_dir, f"round-{n}"))
    shutil.copytree(os.path.join(other, "round-1"), os.path.join(run_dir, "round-1"))
    with pytest.raises(ResumeError, match=r"round-1: its marker is another run's .*; move it out of .* to resume"):
        last_good_round(run_dir)
    os.remove(os.path.join(run_dir, "identity.json"))
    with pytest.raises(ResumeError, match="no identity.json, so its rounds cannot be checked"):
        last_good_round(run_dir)

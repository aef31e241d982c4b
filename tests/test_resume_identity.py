"""Resume refuses another experiment's checkpoint (script, base model, LoRA config, math args), skips a damaged
newest checkpoint for the previous good one, catches a flipped bit in "default", and refuses a run with no steps
left (issue 18, section 4)."""

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import dpo
import sft
import harness.checkpoints
from common.errors import ArgsError, DataError
from harness.errors import CorruptCheckpointError, ResumeError
from harness.checkpoints import _file_hashes, data_sha256, marker_sha256, rank_view, run_identity
from tests.prefs_helpers import preference_rows, write_jsonl
from tests.conftest import ROOT
from tests.tiny import write_tiny


@pytest.fixture(scope="module")
def memo(tmp_path_factory):
    rows = [
        {
            "prompt": [{"role": "user", "content": f"Say word {i}"}],
            "completion": [{"role": "assistant", "content": f"{w} {w}"}],
        }
        for i, w in enumerate(["red", "blue"] * 4)
    ]
    return write_jsonl(tmp_path_factory.mktemp("memo") / "memo.jsonl", rows)


def sft_run(model_dir, dataset, out, **kw):
    defaults = dict(
        model=model_dir,
        dataset=dataset,
        output_dir=str(out),
        max_length=64,
        learning_rate=1e-2,
        per_device_train_batch_size=4,
        lora_dropout=0.0,
        max_steps=2,
        seed=1,
        save_steps=1,
    )
    return sft.main(sft.Args(**{**defaults, **kw}))


@pytest.fixture(scope="module")
def sft_run_dir(tiny_model_dir, memo, tmp_path_factory):
    """A finished 2-step SFT run with checkpoints step-1 and step-2 (copy it before damaging it)."""
    return sft_run(tiny_model_dir, memo, tmp_path_factory.mktemp("base"))["run_dir"]


@pytest.fixture
def run_copy(sft_run_dir, tmp_path):
    return shutil.copytree(sft_run_dir, tmp_path / "copy")


def ckpt(run_dir, step):
    return os.path.join(run_dir, "checkpoints", f"step-{step}")


def test_a_different_base_model_of_the_same_shape_is_refused(sft_run_dir, memo, tmp_path):
    other = write_tiny(tmp_path / "other", seed=7)  # same config, other weights
    with pytest.raises(ResumeError, match="base.weights_sha256: saved") as e:
        sft_run(other, memo, tmp_path / "runs", max_steps=4, resume_from_checkpoint=ckpt(sft_run_dir, 2))
    assert "\n" not in str(e.value) and "base.config_sha256" not in str(e.value)  # one line, only what differs


def test_a_different_lora_alpha_is_refused_and_the_override_lists_it(tiny_model_dir, run_copy, memo, tmp_path):
    kw = dict(max_steps=3, lora_alpha=64, resume_from_checkpoint=ckpt(run_copy, 2))
    with pytest.raises(ResumeError, match="lora.alpha: saved 32, now 64"):
        sft_run(tiny_model_dir, memo, tmp_path / "a", **kw)
    with pytest.warns(UserWarning, match="--resume-ignore-mismatch: .*lora.alpha: saved 32, now 64"):
        out = sft_run(tiny_model_dir, memo, tmp_path / "b", resume_ignore_mismatch=True, **kw)
    assert [h["step"] for h in out["history"]] == [1, 2, 3]  # the run dir's steps, then the resumed one


def test_a_math_arg_is_refused_but_logging_output_and_length_are_not(tiny_model_dir, run_copy, memo, tmp_path):
    with pytest.raises(ResumeError, match="args.learning_rate: saved 0.01, now 0.02"):
        sft_run(
            tiny_model_dir,
            memo,
            tmp_path / "a",
            max_steps=3,
            learning_rate=2e-2,
            resume_from_checkpoint=ckpt(run_copy, 2),
        )
    out = sft_run(
        tiny_model_dir,
        memo,
        tmp_path / "b",
        max_steps=3,
        logging_steps=2,
        save_steps=0,
        exp_name="x",
        resume_from_checkpoint=ckpt(run_copy, 2),
    )
    assert [h["step"] for h in out["history"]] == [1, 2, 3]


def test_a_resume_may_add_ignore_memory_plan(tiny_model_dir, run_copy, memo, tmp_path):
    """--ignore-memory-plan (what a resume on a busier machine needs) counted as a math arg: the run was refused."""
    kw = dict(max_steps=3, ignore_memory_plan=True, resume_from_checkpoint=ckpt(run_copy, 2))
    assert [h["step"] for h in sft_run(tiny_model_dir, memo, tmp_path, **kw)["history"]] == [1, 2, 3]


def test_another_scripts_checkpoint_is_refused(tiny_model_dir, memo, tmp_path):
    prefs = write_jsonl(tmp_path / "prefs.jsonl", preference_rows(8))
    d = dpo.main(
        dpo.Args(
            model=tiny_model_dir,
            dataset=prefs,
            output_dir=str(tmp_path / "dpo"),
            max_length=64,
            per_device_train_batch_size=4,
            max_steps=1,
            seed=1,
            save_steps=1,
        )
    )
    with pytest.raises(ResumeError, match="script: saved 'dpo', now 'sft'"):
        sft_run(tiny_model_dir, memo, tmp_path / "runs", max_steps=4, resume_from_checkpoint=ckpt(d["run_dir"], 1))
    import grpo

    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "Count to 3", "answer": "3"}] * 2)
    with pytest.raises(ResumeError, match="script: saved 'dpo', now 'grpo'"):
        grpo.main(
            grpo.Args(
                model=tiny_model_dir,
                dataset=prompts,
                output_dir=str(tmp_path / "g"),
                max_steps=4,
                preset="demo",
                resume_from_checkpoint=ckpt(d["run_dir"], 1),
            )
        )


def test_resuming_past_max_steps_names_both_numbers(tiny_model_dir, sft_run_dir, memo, tmp_path):
    with pytest.raises(ResumeError, match="at step 2, past this run's 1 steps: nothing to train"):
        sft_run(tiny_model_dir, memo, tmp_path, max_steps=1, resume_from_checkpoint=sft_run_dir)


def files_of(folder) -> dict:
    root = pathlib.Path(folder)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_final_lost_at_the_end_is_made_by_a_resume(tiny_model_dir, run_copy, memo, tmp_path, capsys):
    """Issue 51, item 1: the last checkpoint is the last step (--save-steps divides --max-steps) and the final write
    died (a kill, OOM, a full disk): the resume said "nothing to train", so final/ could never be made. Now it loads
    that step, trains nothing and writes final/: the one the run wrote, byte for byte."""
    final = pathlib.Path(run_copy, "final")
    whole = files_of(final)
    shutil.rmtree(final)
    out = sft_run(tiny_model_dir, memo, tmp_path, resume_from_checkpoint=str(run_copy))  # --max-steps 2 again
    assert "is this run's last step (2): no step left to train; final/ from it" in capsys.readouterr().out
    assert os.path.samefile(out["final_dir"], final) and files_of(final) == whole
    assert [h["step"] for h in out["history"]] == [1, 2]  # the run's steps, none trained again


def flip_one_value(path):
    tensors = load_file(path)
    key = next(iter(tensors))
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[0] *= -1.0
    save_file(tensors, path)


def test_a_flipped_default_adapter_is_refused(tiny_model_dir, run_copy, memo, tmp_path):
    step2 = ckpt(run_copy, 2)
    flip_one_value(os.path.join(step2, "weights", "adapter_model.safetensors"))
    with pytest.raises(CorruptCheckpointError, match="adapter_model.safetensors .*does not match the hash"):
        sft_run(tiny_model_dir, memo, tmp_path / "a", max_steps=3, resume_from_checkpoint=step2)
    # Even with the file hashes rewritten to match, the tensor hash of "default" recorded at save time catches it.
    marker = os.path.join(step2, "checkpoint_complete.json")
    meta = json.load(open(marker))
    meta["files_sha256"] = _file_hashes(step2)
    meta["marker_sha256"] = marker_sha256(meta)  # and the marker's own hash resealed
    json.dump(meta, open(marker, "w"))
    with pytest.raises(CorruptCheckpointError, match="'default' adapter does not match the hash"):
        sft_run(tiny_model_dir, memo, tmp_path / "b", max_steps=3, resume_from_checkpoint=step2)


@pytest.mark.parametrize("removed", [("files_sha256",), ("adapter_sha256",), ("files_sha256", "adapter_sha256")])
def test_a_marker_that_cannot_be_verified_is_corrupt(tiny_model_dir, run_copy, memo, tmp_path, removed):
    """A marker stripped of its hash keys was trusted: with an exponent bit flipped in the adapter the resume went
    ahead and trained on the damaged weights."""
    step2 = ckpt(run_copy, 2)
    weights = os.path.join(step2, "weights", "adapter_model.safetensors")
    tensors = load_file(weights)
    key = next(k for k in tensors if "lora_B" in k)
    tensors[key].view(torch.int32).view(-1)[0] ^= 1 << 29  # one exponent bit: a value 2**64 times larger or smaller
    save_file(tensors, weights)
    marker = os.path.join(step2, "checkpoint_complete.json")
    meta = json.load(open(marker))
    meta["files_sha256"] = _file_hashes(step2)  # the file check alone would not see the flip now
    for k in removed:
        meta.pop(k)
    meta["marker_sha256"] = marker_sha256(meta)  # resealed: the missing keys alone are refused
    json.dump(meta, open(marker, "w"))
    with pytest.raises(CorruptCheckpointError, match="records no (file|adapter) hashes"):
        sft_run(tiny_model_dir, memo, tmp_path / "a", max_steps=3, resume_from_checkpoint=step2)


def test_a_file_added_to_a_checkpoint_is_refused(tiny_model_dir, run_copy, memo, tmp_path):
    step2 = ckpt(run_copy, 2)
    with open(os.path.join(step2, "weights", "extra.safetensors"), "wb") as f:
        f.write(b"not saved by the run")
    with pytest.raises(CorruptCheckpointError, match="weights/extra.safetensors is not listed in the hashes"):
        sft_run(tiny_model_dir, memo, tmp_path / "a", max_steps=3, resume_from_checkpoint=step2)


def truncate_weights(step_dir) -> None:
    weights = os.path.join(step_dir, "weights", "adapter_model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_one(
    tiny_model_dir, sft_run_dir, run_copy, memo, tmp_path
):
    truncate_weights(ckpt(run_copy, 2))
    with pytest.warns(UserWarning, match="step-2: .*falling back to the previous checkpoint"):
        out = sft_run(tiny_model_dir, memo, tmp_path / "a", max_steps=3, resume_from_checkpoint=str(run_copy))
    assert [h["step"] for h in out["history"]] == [1, 2, 3]  # resumed from step-1, in the run dir
    # the damaged step-2 was moved aside (kept, never resumed from the run dir again); the new step-2 took its place
    assert [p.name for p in (run_copy / "checkpoints").glob("replaced-*/*")] == ["step-2"]
    # With no intact checkpoint left it is an error that lists each one.
    damaged = shutil.copytree(sft_run_dir, tmp_path / "damaged")
    truncate_weights(ckpt(damaged, 2))
    flip_one_value(os.path.join(ckpt(damaged, 1), "weights", "adapter_model.safetensors"))
    no_good = pytest.raises(CorruptCheckpointError, match="no intact checkpoint.*step-2.*step-1")
    with pytest.warns(UserWarning), no_good:
        sft_run(tiny_model_dir, memo, tmp_path / "b", max_steps=3, resume_from_checkpoint=str(damaged))


def test_identity_records_what_the_checkpoint_belongs_to(sft_run_dir):
    meta = json.load(open(os.path.join(ckpt(sft_run_dir, 2), "checkpoint_complete.json")))
    ident = meta["identity"]
    assert ident["script"] == "sft" and ident["dtype"] == "float32" and ident["quantization"] is None
    assert (ident["lora.r"], ident["lora.alpha"], ident["lora.dropout"]) == (16, 32, 0.0)
    assert ident["args.learning_rate"] == 0.01 and ident["args.seed"] == 1
    # Not recorded: where and how often it writes, how far it trains (a resume may change them).
    assert not {"args.output_dir", "args.max_steps", "args.save_steps", "args.logging_steps"} & ident.keys()
    assert set(meta["adapter_sha256"]) == {"default"} and "weights/adapter_model.safetensors" in meta["files_sha256"]


def test_the_base_fingerprint_ignores_the_load_dtype_but_not_the_weights(tiny_model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    fp32 = run_identity(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    bf16 = run_identity(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16))
    other = run_identity(AutoModelForCausalLM.from_pretrained(write_tiny(tmp_path / "o", seed=3)))
    assert fp32["base.weights_sha256"] == bf16["base.weights_sha256"] and fp32["dtype"] != bf16["dtype"]
    assert fp32["base.config_sha256"] == other["base.config_sha256"]
    assert fp32["base.weights_sha256"] != other["base.weights_sha256"]


def test_raft_resume_in_the_same_run_dir_must_be_the_same_experiment(tiny_model_dir, tmp_path):
    import raft

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"Count to {i}"} for i in range(4)])
    kw = dict(
        model=tiny_model_dir,
        dataset=prompts,
        output_dir=str(tmp_path / "runs"),
        eval_limit=0,
        num_rounds=1,
        rewards=["tests.test_raft:frac_low_ids"],
        prompts_per_round=2,
        group_size=2,
        max_completion_length=4,
        reward_threshold=None,
        per_device_train_batch_size=2,
        seed=1,
    )
    run_dir = raft.main(raft.Args(**kw))["run_dir"]
    with pytest.raises(ResumeError, match="args.learning_rate: saved 0.0002, now 0.002"):
        raft.main(raft.Args(**{**kw, "num_rounds": 2, "learning_rate": 2e-3, "resume_from": run_dir}))
    assert sorted(d for d in os.listdir(run_dir) if d.startswith("round-")) == ["round-0", "round-1"]  # nothing ran


def test_raft_resume_at_its_last_round_makes_a_lost_final_and_past_it_is_an_error(tiny_model_dir, tmp_path, capsys):
    """A resume past the run's rounds used to be a silent no-op that rewrote final/: it is an error. At the last
    round (issue 51, item 1: the final write died) it writes final/ from that round, saying so, and runs none."""
    import raft

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"Count to {i}", "answer": str(i)} for i in range(4)])
    kw = dict(
        preset="demo",
        model=tiny_model_dir,
        dataset=prompts,
        output_dir=str(tmp_path / "runs"),
        num_rounds=1,
        prompts_per_round=2,
        group_size=2,
        max_completion_length=4,
        eval_limit=0,
        reward_threshold=None,
    )
    run_dir = raft.main(raft.Args(**{**kw, "num_rounds": 2}))["run_dir"]
    with pytest.raises(ResumeError, match="round 2 is done, past this run's 1 rounds"):
        raft.main(raft.Args(**{**kw, "resume_from": run_dir}))
    final = pathlib.Path(run_dir, "final")
    whole = files_of(final)
    shutil.rmtree(final)
    capsys.readouterr()
    out = raft.main(raft.Args(**{**kw, "num_rounds": 2, "resume_from": run_dir}))
    assert "round 2 is this run's last (2); no round left to run, final/ from it" in capsys.readouterr().out
    assert files_of(final) == whole and [h["step"] for h in out["history"]] == [0, 1, 2]


def test_raft_resume_from_a_dir_without_a_round_is_an_error(tiny_model_dir, tmp_path):
    """--resume-from a dir with no round-N/ (a typo'd path, another script's run dir) started a fresh run inside it."""
    import raft

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"Count to {i}", "answer": str(i)} for i in range(4)])
    elsewhere = tmp_path / "dpo-run"
    elsewhere.mkdir()
    kw = dict(model=tiny_model_dir, dataset=prompts, num_rounds=1, prompts_per_round=2, group_size=2, eval_limit=0)
    with pytest.raises(ResumeError, match=r"--resume-from .*dpo-run: no round-N/$"):
        raft.main(raft.Args(**kw, max_completion_length=4, resume_from=str(elsewhere)))
    assert os.listdir(elsewhere) == []


def flip_marker_bits(marker: str, old: bytes, new: bytes) -> None:
    """One flipped bit in the marker file: the first `old` becomes `new` (which differs from it in one bit)."""
    data = pathlib.Path(marker).read_bytes()
    assert old in data and bin(int.from_bytes(old, "big") ^ int.from_bytes(new, "big")).count("1") == 1
    pathlib.Path(marker).write_bytes(data.replace(old, new, 1))


@pytest.mark.parametrize(
    "old, new",
    [(b'"step": 2', b'"step": 0'), (b'"step"', b'"rtep"'), (b'"identity"', b'"identitx"')],
    ids=["step", "key", "identity-key"],
)
def test_a_flipped_bit_in_the_marker_is_a_corrupt_checkpoint(tiny_model_dir, run_copy, memo, tmp_path, old, new):
    """Issue 40, section 3: a marker's "step": 2 read as 0 resumed at step 1 with step 2's weights, exit 0; a key
    read as "rtep" crashed a run-dir resume with KeyError. The marker's own hash catches both: named, one line; from
    the run dir, the previous checkpoint with one warning."""
    flip_marker_bits(os.path.join(ckpt(run_copy, 2), "checkpoint_complete.json"), old, new)
    with pytest.raises(CorruptCheckpointError, match="checkpoint_complete.json does not match its own hash") as e:
        sft_run(tiny_model_dir, memo, tmp_path / "a", max_steps=3, resume_from_checkpoint=ckpt(run_copy, 2))
    assert "\n" not in str(e.value)
    with pytest.warns(UserWarning, match="step-2: .*own hash.*falling back to the previous checkpoint"):
        out = sft_run(tiny_model_dir, memo, tmp_path / "b", max_steps=3, resume_from_checkpoint=str(run_copy))
    assert [h["step"] for h in out["history"]] == [1, 2, 3]  # resumed from step-1


def test_a_dataset_whose_content_changed_is_refused_on_resume(tiny_model_dir, memo, tmp_path):
    """Issue 51, item 7: the identity held the dataset's path only, so a resume on a file edited since trained on
    other rows without a word. The checkpoint holds the file's sha256: another content under the same name is
    refused in one line naming it."""
    data = str(shutil.copy(memo, tmp_path / "data.jsonl"))
    run_dir = sft_run(tiny_model_dir, data, tmp_path / "runs", max_steps=1)["run_dir"]
    text = pathlib.Path(data).read_text()
    pathlib.Path(data).write_text(text.replace("blue", "teal", 1))  # one word of one row
    with pytest.raises(ResumeError, match=r"data.sha256: saved '[0-9a-f]{64}', now '[0-9a-f]{64}'") as e:
        sft_run(tiny_model_dir, data, tmp_path / "runs", max_steps=2, resume_from_checkpoint=run_dir)
    assert "\n" not in str(e.value) and "args." not in str(e.value)  # the path is the same: only the content
    pathlib.Path(data).write_text(text)  # the content it trained on: resumed
    out = sft_run(tiny_model_dir, data, tmp_path / "runs", max_steps=2, resume_from_checkpoint=run_dir)
    assert [h["step"] for h in out["history"]] == [1, 2]


def test_a_dataset_rewritten_while_it_is_hashed_is_refused(tmp_path, monkeypatch):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a"}\n')
    assert data_sha256(str(data)) == data_sha256(str(shutil.copy(data, tmp_path / "same.jsonl")))  # content, not path
    real = hashlib.file_digest

    def rewritten_meanwhile(f, name):
        digest = real(f, name)
        data.write_text('{"prompt": "b"}\n{"prompt": "c"}\n')
        return digest

    monkeypatch.setattr(hashlib, "file_digest", rewritten_meanwhile)
    with pytest.raises(DataError, match=f"^--dataset {data}: it changed while this run read it"):
        data_sha256(str(data))


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("seed", 2, "--seed: rank 0 1, rank 1 2"),
        ("learning_rate", 0.02, "--learning-rate: rank 0 0.01, rank 1 0.02"),
        ("per_device_train_batch_size", 2, "--per-device-train-batch-size: rank 0 4, rank 1 2"),
        ("max_steps", 3, "--max-steps: rank 0 2, rank 1 3"),
        ("dataset", "copy", "--dataset's content \\(sha256\\): rank 0 '[0-9a-f]{64}', rank 1 '[0-9a-f]{64}'"),
        ("torch_threads", 2, None),  # a machine's own: free
    ],
)
def test_ranks_that_disagree_are_refused_naming_the_field(
    tiny_model_dir, memo, tmp_path, monkeypatch, field, value, named
):
    """Issue 51, item 3: rank 1 started with another --seed, --learning-rate, dataset copy or batch size trained
    silently (its gradients averaged in); with another --max-steps rank 0 wrote final/ and both timed out. Every
    rank's view is gathered at start-up (run_identity); here rank 1's is computed from its own Args and handed to
    rank 0 as torchrun's all_gather would."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    args = sft.Args(
        model=tiny_model_dir, dataset=memo, max_steps=2, seed=1, learning_rate=0.01, per_device_train_batch_size=4
    )
    if field == "dataset":  # rank 1's copy of the data: the same file name on its node, one row changed
        value = str(tmp_path / "node1" / os.path.basename(memo))
        os.makedirs(os.path.dirname(value))
        pathlib.Path(value).write_text(pathlib.Path(memo).read_text().replace("blue", "teal", 1))
    theirs = dataclasses.replace(args, **{field: value})
    view = rank_view(run_identity(model, theirs), theirs)
    monkeypatch.setattr(harness.checkpoints, "rank_and_world", lambda: (0, 2))
    monkeypatch.setattr(harness.checkpoints, "all_gather", lambda items: items + [view])
    if named is None:
        run_identity(model, args)
        return
    with pytest.raises(ArgsError, match=f"^the ranks would train different runs: .*{named}") as e:
        run_identity(model, args)
    assert "\n" not in str(e.value)


def test_ranks_that_would_resume_from_different_checkpoints_are_refused(
    tiny_model_dir, run_copy, memo, tmp_path, monkeypatch
):
    """A rank that reads another copy of the run dir (another node's, older) picks another checkpoint: every rank's
    choice (its marker's hash) is gathered, and a difference is refused naming each rank's checkpoint."""
    monkeypatch.setattr(harness.checkpoints, "all_gather", lambda items: items + [("/node1/step-1", "0" * 64)])
    with pytest.raises(ResumeError, match=r"different checkpoints \(rank 0: .*step-2; rank 1: /node1/step-1\)"):
        sft_run(tiny_model_dir, memo, tmp_path, max_steps=3, resume_from_checkpoint=str(run_copy))


def test_a_dataset_rewritten_while_the_run_reads_it_is_refused(tiny_model_dir, memo, tmp_path, monkeypatch):
    """Issue 51, item 7: a file rewritten while a run read it went unnoticed (the rows read could mix two versions,
    and the checkpoint would record the new one). Its size and time are taken before the rows are read
    (check_inputs) and compared when it is hashed (run_identity): a change in between stops the run before any
    step."""
    data = str(shutil.copy(memo, tmp_path / "data.jsonl"))
    real = sft.load_splits

    def rewritten_while_read(*args, **kwargs):
        rows = real(*args, **kwargs)
        with open(data, "a") as f:  # another process appends a row meanwhile
            f.write(json.dumps({"prompt": "Say late", "completion": "late late"}) + "\n")
        return rows

    monkeypatch.setattr(sft, "load_splits", rewritten_while_read)
    with pytest.raises(DataError, match=f"^--dataset {data}: it changed while this run read it"):
        sft_run(tiny_model_dir, data, tmp_path / "runs")
    assert not list((tmp_path / "runs").glob("*/checkpoints"))


def test_an_adapter_is_saved_as_the_same_bytes_by_every_process(tiny_model_dir, tmp_path):
    """PEFT writes target_modules in a set's order, which follows the process's string hashes (PYTHONHASHSEED): a
    raft run's final/ and the one its resume wrote from the same round differed in adapter_config.json (seeds 23 and
    25 of test_raft_resume_at_its_last_round_makes_a_lost_final_and_past_it_is_an_error). save_weights sorts them."""
    code = (
        "import sys; from common.model import attach_lora, load_model; from harness.checkpoints import save_weights; "
        "save_weights(attach_lora(load_model(sys.argv[1])[0], r=4), sys.argv[2], adapters=['default'])"
    )
    written = set()
    for seed in ("23", "25", "7"):
        command = [sys.executable, "-c", code, tiny_model_dir, str(tmp_path / seed)]
        subprocess.run(command, env={**os.environ, "PYTHONHASHSEED": seed}, cwd=ROOT, check=True)
        written.add((tmp_path / seed / "adapter_config.json").read_bytes())
    assert len(written) == 1

"""Issue 40, sections 3 and 4: what is on disk is verified before it is trusted (raft rounds, final/, a merged
model), and numbers and flags that would crash late, overflow or train nothing are refused in one line naming the
flag or file, before any weights load."""

import errno
import fcntl
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import harness.checkpoints
import kto
import raft
import sft
from common.errors import ArgsError, ModelError, RewardError
from harness.errors import OutputDirError
from common.rewards import compute_rewards
from harness.checkpoints import write_marker
from harness.cli import wandb_credentials
from harness.run import make_run_dir
from scripts import merge_adapter
from tests.prefs_helpers import write_jsonl

SFT_ROWS = [{"prompt": "Say red", "completion": "red"}, {"prompt": "Say blue", "completion": "blue"}]


@pytest.fixture
def no_model_load(monkeypatch):
    """Any load_model call fails the test: the check comes before the weights."""

    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the flag was checked")

    for script in (sft, kto, raft):
        monkeypatch.setattr(script, "load_model", load_model)


# ------------------------------------------------------------------------------------------------ --torch-threads
@pytest.mark.parametrize("threads", [0, -1, 100_000])
@pytest.mark.parametrize("script", [sft, kto, raft])
def test_torch_threads_out_of_range_is_refused_naming_the_flag(script, threads, tmp_path, monkeypatch, no_model_load):
    """100,000 segfaulted trying to start them all, 0 was silently ignored, -1 was refused by torch naming no flag."""

    def set_num_threads(n):
        raise AssertionError(f"torch.set_num_threads({n}) ran before the flag was checked")

    monkeypatch.setattr(torch, "set_num_threads", set_num_threads)
    args = script.Args(model="unused", output_dir=str(tmp_path), torch_threads=threads)
    with pytest.raises(ArgsError, match=rf"^--torch-threads {threads}: must be 1\.\.1024"):
        script.main(args)


# ------------------------------------------------------------------------------------------------ numbers
@pytest.mark.parametrize("flag", ["desirable_weight", "undesirable_weight"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0])
def test_kto_weights_are_refused_before_loading(flag, value, tmp_path, no_model_load):
    with pytest.raises(ArgsError, match=f"^--{flag.replace('_', '-')} {value}: must be a finite number >= 0"):
        kto.main(kto.Args(model="unused", output_dir=str(tmp_path), **{flag: value}))


def test_raft_refuses_a_nan_reward_threshold(tmp_path, no_model_load):
    """NaN >= x is False: no sample was ever kept, nothing trained, exit 0."""
    with pytest.raises(ArgsError, match="^--reward-threshold nan: must be a finite number"):
        raft.main(raft.Args(model="unused", output_dir=str(tmp_path), reward_threshold=math.nan))


def test_a_reward_past_float32_is_refused_naming_the_function():
    """1e39 is finite in float64 and Inf in the float32 rewards train in: raft trained on it and logged Infinity."""
    funcs = [("huge", lambda prompts, completions, **kw: [1.0, 1e39], 1.0)]
    with pytest.raises(RewardError, match=r"reward 'huge' returned 1e\+39 for completion 1: past float32's range"):
        compute_rewards(funcs, ["p", "p"], ["a", "b"], {})
    big = [(n, lambda prompts, completions, **kw: [3e38, 0.0], 1.0) for n in ("a", "b")]  # each fits, the sum not
    with pytest.raises(RewardError, match=r"weighted sum of rewards \['a', 'b'\] overflows float32"):
        compute_rewards(big, ["p", "p"], ["a", "b"], {})


def test_a_huge_gpu_memory_is_refused_naming_the_flag(tiny_model_dir, tmp_path):
    """1e300 GiB overflowed into an OverflowError naming no flag."""
    data = write_jsonl(tmp_path / "d.jsonl", SFT_ROWS)
    args = sft.Args(model=tiny_model_dir, dataset=data, output_dir=str(tmp_path), plan=True, gpu_memory=1e300)
    with pytest.raises(ArgsError, match=r"^--gpu-memory 1e\+300: must be a card's memory in GiB"):
        sft.main(args)


# ------------------------------------------------------------------------------------------------ the run dir
def test_a_file_system_without_locks_is_named_and_leaves_no_run_dir(tmp_path, monkeypatch):
    """NFS without lockd: flock fails with ENOLCK, which was a bare '[Errno 37] No locks available' and an empty run
    dir left behind."""

    def flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", flock)
    with pytest.raises(OutputDirError, match="No locks available: the file system does not support flock") as e:
        make_run_dir("sft", "m", 1, str(tmp_path / "runs"))
    assert "\n" not in str(e.value)
    assert os.listdir(tmp_path / "runs") == []


# ------------------------------------------------------------------------------------------------ --report-to wandb
@pytest.fixture
def no_wandb_credentials(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "wandb-config"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "home").mkdir()
    return tmp_path / "home"


def test_wandb_without_credentials_is_refused_before_loading(no_wandb_credentials, tmp_path, no_model_load):
    data = write_jsonl(tmp_path / "d.jsonl", SFT_ROWS)
    args = sft.Args(model="unused", dataset=data, output_dir=str(tmp_path), report_to="wandb")
    with pytest.raises(ArgsError, match="^--report-to wandb: no W&B credentials"):
        sft.main(args)


def test_wandb_credentials_are_found_where_wandb_reads_them(no_wandb_credentials, monkeypatch):
    assert wandb_credentials() is None
    netrc = no_wandb_credentials / ".netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    netrc.chmod(0o600)
    assert wandb_credentials() == str(netrc)
    netrc.unlink()
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_credentials() == "WANDB_MODE=offline"
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert wandb_credentials() == "WANDB_API_KEY"


# ------------------------------------------------------------------------------------------------ final/, merged
def enospc_after(real, calls: list):
    """`real`, then a full disk (ENOSPC), as a writer that ran out of space half-way."""

    def write(*args, **kwargs):
        real(*args, **kwargs)
        calls.append(args)
        raise OSError(errno.ENOSPC, "No space left on device")

    return write


def test_a_full_disk_while_writing_final_leaves_no_final_dir(tiny_model_dir, tmp_path, monkeypatch):
    """final/ was written in place: a full disk left a final/ with README.md alone (LoRA), or config.json and
    generation_config.json without weights (full), and a raw SafetensorError."""
    calls = []
    monkeypatch.setattr(harness.checkpoints, "save_weights", enospc_after(harness.checkpoints.save_weights, calls))
    data = write_jsonl(tmp_path / "d.jsonl", SFT_ROWS)
    args = sft.Args(model=tiny_model_dir, dataset=data, output_dir=str(tmp_path / "runs"), max_steps=1, save_steps=0)
    with pytest.raises(OutputDirError, match=r"^cannot write .*/final \(no space left on device\); removed") as e:
        sft.main(args)
    assert calls and "\n" not in str(e.value)
    run_dir = next((tmp_path / "runs").iterdir())
    assert not (run_dir / "final").exists() and not [p for p in os.listdir(run_dir) if "tmp" in p]


@pytest.fixture(scope="module")
def base_and_adapter(tmp_path_factory):
    from tests.test_export import tiny_adapter, tiny_base

    root = tmp_path_factory.mktemp("merge")
    base = tiny_base(root / "base", "qwen2")
    return base, tiny_adapter(base, root / "final")


@pytest.fixture
def adapter_copy(base_and_adapter, tmp_path, monkeypatch):
    def load_model(*args, **kwargs):
        raise AssertionError("the base was loaded before the adapter was checked")

    monkeypatch.setattr(merge_adapter, "load_model", load_model)
    return shutil.copytree(base_and_adapter[1], tmp_path / "adapter")


def test_merge_adapter_names_a_nan_adapter_before_loading(adapter_copy, tmp_path):
    """An adapter holding a NaN was blamed on --model / --tolerance after the merge."""
    weights = adapter_copy / "adapter_model.safetensors"
    tensors = load_file(weights)
    key = next(k for k in tensors if "lora_B" in k)
    tensors[key].view(-1)[0] = math.nan
    save_file(tensors, weights)
    named = f"^--adapter {adapter_copy}: tensor {key} in adapter_model.safetensors holds NaN/Inf"
    with pytest.raises(ModelError, match=named):
        merge_adapter.main(merge_adapter.Args(adapter=str(adapter_copy), out=str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()


def test_merge_adapter_names_a_truncated_adapter_or_a_broken_config(adapter_copy, tmp_path):
    weights = adapter_copy / "adapter_model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    with pytest.raises(ModelError, match=f"^--adapter {adapter_copy}: adapter_model.safetensors cannot be read"):
        merge_adapter.main(merge_adapter.Args(adapter=str(adapter_copy), out=str(tmp_path / "out")))
    config = adapter_copy / "adapter_config.json"
    config.write_text(config.read_text()[:40])
    with pytest.raises(ModelError, match=f"^--adapter: {config} cannot be read \\(JSONDecodeError"):
        merge_adapter.main(merge_adapter.Args(adapter=str(adapter_copy), out=str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()


def test_a_full_disk_while_merging_leaves_no_output_dir(base_and_adapter, tmp_path, monkeypatch):
    from transformers import PreTrainedTokenizerBase

    calls = []
    real = PreTrainedTokenizerBase.save_pretrained
    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", enospc_after(real, calls))
    out = tmp_path / "merged" / "run"
    with pytest.raises(OutputDirError, match=f"^cannot write {out} \\(no space left on device\\); removed"):
        merge_adapter.main(merge_adapter.Args(adapter=base_and_adapter[1], out=str(out)))
    assert calls and not out.exists() and os.listdir(tmp_path / "merged") == []


def test_a_resume_in_a_dir_without_locks_is_named_before_loading(tiny_model_dir, tmp_path, monkeypatch, no_model_load):
    """raft.py --resume-from on a file system without locks: one line naming the cause (every rank raises it)."""
    run_dir = tmp_path / "raft-run"
    (run_dir / "round-0").mkdir(parents=True)
    (run_dir / "round-0" / "metrics.json").write_text("{}")
    (run_dir / "identity.json").write_text('{"run_id": "0"}')  # a round marker repeats its run's record
    write_marker(str(run_dir / "round-0"), raft.ROUND_COMPLETE, {"round": 0, "run": {"run_id": "0"}})

    def flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", flock)
    args = raft.Args(
        preset="demo", model=tiny_model_dir, resume_from=str(run_dir), num_rounds=2, eval_dataset="builtin:math"
    )
    with pytest.raises(OutputDirError, match=f"^{run_dir}: cannot lock .*No locks available"):
        raft.main(args)

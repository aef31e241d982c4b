"""Files on disk (issue: reliability round 3): a save that fills the disk says so, names the last good checkpoint and
removes its half-written folder; one process at a time writes a run directory."""

import os
import subprocess
import sys
import uuid

import pytest
import torch

import harness.checkpoints
import raft
import sft
from common.errors import OutputDirError
from harness.checkpoints import _read_verified_meta, write_marker
from tests.prefs_helpers import write_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SFT_ROWS = [{"prompt": f"Say {w}", "completion": f"{w} {w}"} for w in ("red", "blue", "green", "yes") * 2]


@pytest.fixture
def small_disk(tmp_path):
    """A 32 MiB tmpfs (root only: mount(2) needs CAP_SYS_ADMIN), unmounted afterwards."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mount_point)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=True)


def fill(folder) -> None:
    """Write zeros into folder/filler until the file system is full."""
    with open(os.path.join(folder, "filler"), "wb") as f:
        try:
            while True:
                f.write(b"\0" * 2**16)
                f.flush()
        except OSError:
            pass


@pytest.mark.parametrize("writer", ["safetensors", "torch"])
def test_a_full_disk_during_a_save_says_so_and_keeps_the_last_checkpoint(
    writer, tiny_model_dir, small_disk, tmp_path, monkeypatch
):
    """torch's writer said '[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534' and left
    .tmp-step-N behind; safetensors' error named neither the checkpoint nor what to do."""
    saves = []
    real = {"safetensors": harness.checkpoints.save_weights, "torch": torch.save}

    def fill_then(name):
        def write(*args, **kwargs):
            saves.append(name)
            if saves.count(name) == 2:  # the second checkpoint: the disk fills up just before this write
                fill(small_disk)
            return real[name](*args, **kwargs)

        return write

    if writer == "safetensors":
        monkeypatch.setattr(harness.checkpoints, "save_weights", fill_then("safetensors"))
    else:
        monkeypatch.setattr(harness.checkpoints.torch, "save", fill_then("torch"))
    data = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    args = sft.Args(model=tiny_model_dir, dataset=data, output_dir=str(small_disk), max_steps=3, save_steps=1)
    with pytest.raises(OutputDirError) as e:
        sft.main(args)
    run_dir = next(p for p in small_disk.iterdir() if p.is_dir())
    step1 = run_dir / "checkpoints" / "step-1"
    assert str(e.value) == (
        f"cannot write checkpoint step-2 (no space left on device); removed the half-written "
        f"{run_dir / 'checkpoints' / '.tmp-step-2'}. Last good checkpoint: {step1}"
    )
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["step-1"]
    assert _read_verified_meta(str(step1))["step"] == 1  # intact: every file matches its recorded hash


def test_a_failed_write_that_is_not_a_full_disk_is_named_as_it_is(tmp_path):
    tmp = tmp_path / ".tmp-step-3"
    tmp.mkdir()
    with pytest.raises(OutputDirError, match=r"^cannot write x \(PermissionError: denied\); removed the half-written"):
        with harness.checkpoints.writing(str(tmp), "x", "none"):
            raise PermissionError("denied")
    assert not tmp.exists()
    tmp.mkdir()
    with pytest.raises(KeyError), harness.checkpoints.writing(str(tmp), "x", "none"):
        raise KeyError("a bug is not a write failure")  # re-raised as it is, the temp dir still removed
    assert not tmp.exists()


# ------------------------------------------------------------------------------------------------ one writer
HOLD = """
import sys, time
from harness.run import lock_run_dir
lock_run_dir(sys.argv[1])
print("locked", flush=True)
time.sleep(120)
"""


def test_a_second_process_cannot_write_a_run_dir_in_use(tiny_model_dir, tmp_path, monkeypatch):
    """Two `raft.py --resume-from DIR` raced in one run dir: one died with '[Errno 39] Directory not empty' and a
    stale .tmp-round-2 stayed. The second is now refused before its model loads, naming the first one's pid."""
    run_dir = tmp_path / f"raft-{uuid.uuid4().hex[:6]}"
    (run_dir / "round-0").mkdir(parents=True)
    (run_dir / "round-0" / "metrics.json").write_text("{}")
    write_marker(str(run_dir / "round-0"), raft.ROUND_COMPLETE, {"round": 0})  # a round a resume accepts
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        monkeypatch.setattr(raft, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
        args = raft.Args(
            preset="demo", model=tiny_model_dir, resume_from=str(run_dir), num_rounds=2, eval_dataset="builtin:math"
        )
        with pytest.raises(OutputDirError, match=rf"another process \(pid {holder.pid}\) is writing this run"):
            raft.main(args)
    finally:
        holder.kill()
        holder.wait()
    # The kernel drops a dead process's lock (even after SIGKILL): the dir can be taken again.
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from harness.run import lock_run_dir; lock_run_dir(sys.argv[1])",
            str(run_dir),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr

"""Files on disk (issue: reliability round 3): a save that fills the disk says so, names the last good checkpoint and
removes its half-written folder; one process at a time writes a run directory."""

import dataclasses
import importlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import uuid

import pytest
import torch
from safetensors.torch import load_file

import harness.checkpoints
import raft
import sft
from harness.errors import OutputDirError
from harness.checkpoints import _read_verified_meta, write_marker
from harness.cli import one_line_errors
from harness.run import Logger
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
    (run_dir / "identity.json").write_text('{"run_id": "0"}')  # a round a resume accepts: its marker names the run
    write_marker(str(run_dir / "round-0"), raft.ROUND_COMPLETE, {"round": 0, "run": {"run_id": "0"}})
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


def test_a_finished_run_dir_keeps_no_lock_file_and_a_crashed_one_keeps_it_for_its_resume(
    tiny_model_dir, tmp_path, monkeypatch
):
    """A finished run dir kept its .lock (issue 52): a clean end removes it. A run that crashes keeps it (the flock
    goes with the process), and its resume, which takes the lock again, removes it when it ends cleanly."""
    data = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    kw = dict(model=tiny_model_dir, dataset=data, output_dir=str(tmp_path / "runs"), max_steps=2, save_steps=1)
    done = sft.main(sft.Args(**kw))
    assert os.path.isdir(os.path.join(done["run_dir"], "final")) and ".lock" not in os.listdir(done["run_dir"])
    monkeypatch.setattr(sft, "save_final", lambda *a, **k: (_ for _ in ()).throw(OSError("disk gone")))
    with pytest.raises(OSError, match="disk gone"):
        sft.main(sft.Args(**kw))
    crashed = [d for d in (tmp_path / "runs").iterdir() if str(d) != done["run_dir"]]
    assert len(crashed) == 1 and (crashed[0] / ".lock").is_file()
    monkeypatch.undo()
    resumed = sft.main(sft.Args(**kw | dict(max_steps=3, resume_from_checkpoint=str(crashed[0]))))
    assert os.path.realpath(resumed["run_dir"]) == str(crashed[0].resolve())
    assert ".lock" not in os.listdir(crashed[0]) and (crashed[0] / "final").is_dir()


def test_a_resume_says_so_and_names_its_run_dir_as_a_new_run_does(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """A resume never said it was resuming, and named its run dir by its absolute path where a new run names it as
    --output-dir does (issue 52): one line names the checkpoint and its step, and the run dir is the same string."""
    monkeypatch.chdir(tmp_path)
    data = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    kw = dict(model=tiny_model_dir, dataset=data, output_dir="runs", max_steps=2, save_steps=1, report_to="none")
    first = sft.main(sft.Args(**kw))
    assert first["run_dir"].startswith("runs/sft__"), first["run_dir"]
    capsys.readouterr()
    checkpoint = os.path.join(first["run_dir"], "checkpoints", "step-2")
    resumed = sft.main(sft.Args(**kw | dict(max_steps=3, resume_from_checkpoint=checkpoint)))
    out = capsys.readouterr().out
    assert resumed["run_dir"] == first["run_dir"] and f"run dir {first['run_dir']}, saved" in out, out[-2000:]
    said = [line for line in out.splitlines() if line.startswith("resuming")]
    assert said == [f"resuming from {checkpoint} at step 2 of 3 (run dir {first['run_dir']})"], out[-2000:]


# ------------------------------------------------------------------------ Ctrl-C at the end of a run (issue 40 §5)
PREFS = [{"prompt": f"Pick {i}", "chosen": f"yes {i}", "rejected": f"no {i} no"} for i in range(8)]  # dpo's rows
END_RUNS = {  # two steps of each on the tiny model
    "dpo": dict(per_device_train_batch_size=4),
    "grpo": dict(dataset="builtin:math", group_size=2, prompts_per_step=1, max_completion_length=4, preset="demo"),
}


def end_run_args(script, model_dir, tmp_path):
    module = importlib.import_module(script)
    kw = dict(model=model_dir, output_dir=str(tmp_path / "runs"), max_steps=2, save_steps=0)
    if script == "dpo":
        kw["dataset"] = write_jsonl(tmp_path / "prefs.jsonl", PREFS)
    return module, module.Args(**kw | END_RUNS[script])


def ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)  # what a terminal's Ctrl-C delivers, at this exact point


def assert_complete_final(final_dir) -> None:
    """final/ as plain PEFT loads it: the adapter's config and finite weights, and the tokenizer."""
    names = set(os.listdir(final_dir))
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json"} <= names, names
    weights = load_file(os.path.join(final_dir, "adapter_model.safetensors"))
    assert weights and all(bool(t.isfinite().all()) for t in weights.values())
    assert not [n for n in os.listdir(os.path.dirname(final_dir)) if n.startswith(".tmp-")]


@pytest.mark.parametrize("script", ["dpo", "grpo"])
@pytest.mark.parametrize("when", ["save_final", "first_write", "last_step"])
def test_ctrl_c_at_the_end_of_a_run_leaves_a_complete_final_and_exits_130(
    script, when, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """A Ctrl-C just after the last step (as save_final starts, or at final/'s first file write) or during the last
    step: the handler was already gone, so KeyboardInterrupt left no final/ and no checkpoint of the last step. Now
    the write completes, a second Ctrl-C included, and the CLI exits 130 after the run's end line."""
    module, args = end_run_args(script, tiny_model_dir, tmp_path)
    if when == "save_final":
        real_save = module.save_final

        def save_final(*a, **k):
            ctrl_c()
            return real_save(*a, **k)

        monkeypatch.setattr(module, "save_final", save_final)
    elif when == "first_write":
        real_weights = harness.checkpoints.save_weights

        def save_weights(*a, **k):  # final/'s first file: two Ctrl-Cs there, the write still completes
            ctrl_c()
            ctrl_c()
            return real_weights(*a, **k)

        monkeypatch.setattr(harness.checkpoints, "save_weights", save_weights)
    else:
        real_log = Logger.log

        def log(self, step, metrics):
            if step == args.max_steps:
                ctrl_c()
            return real_log(self, step, metrics)

        monkeypatch.setattr(Logger, "log", log)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own: Ctrl-C raises
    try:
        with pytest.raises(SystemExit) as exited, one_line_errors():
            module.main(args)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the caller's handler is back
    finally:
        signal.signal(signal.SIGINT, previous)
    assert exited.value.code == 130
    [run_dir] = (tmp_path / "runs").iterdir()
    assert_complete_final(run_dir / "final")
    out, err = capsys.readouterr()
    assert f"{script}: " in out and "s for 2 steps on " in out  # the run's end line
    assert "writing final/ first" in err and "exit 130" in err.strip().splitlines()[-1]


DRIVER = """
import os, sys, time
import tyro
import sft
from harness.cli import one_line_errors
real = sft.save_final
def save_final(*a, **k):  # the last step is done: hold here until the parent's SIGINT has been sent
    print("LAST STEP DONE", flush=True)
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.02)
    return real(*a, **k)
sft.save_final = save_final
with one_line_errors():
    sft.main(tyro.cli(sft.Args, args=sys.argv[2:]))
"""


def test_sft_cli_ctrl_c_right_after_the_last_step_completes_final(tiny_model_dir, tmp_path):
    """sft.py's window between its last step and final/ (hit by timing from outside): a SIGINT from another process
    landing there. The parent sends it, then lets the run go on; the old code died there with exit 130 and no
    final/."""
    data = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    go = tmp_path / "go"
    cmd = [sys.executable, "-c", DRIVER, str(go), "--model", tiny_model_dir, "--dataset", data]
    cmd += ["--max-steps", "2", "--save-steps", "0", "--output-dir", str(tmp_path / "runs")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in proc.stdout:
            if line.strip() == "LAST STEP DONE":
                break
        proc.send_signal(signal.SIGINT)  # pending in the child before it can see `go`
        go.write_text("")
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-2000:]
    [run_dir] = (tmp_path / "runs").iterdir()
    assert_complete_final(run_dir / "final")
    assert "sft: loss " in out and "Traceback" not in err
    assert err.strip().splitlines()[-1].endswith(": Ctrl-C: the last step and final/ were completed first; exit 130")


class Killed(BaseException):
    """A SIGKILL at that instant: no handler of ours runs (BaseException passes every `except Exception`)."""


def files_of(folder) -> dict:
    root = pathlib.Path(folder)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("exchange", [True, False], ids=["names-exchanged", "renamed-aside"])
def test_a_kill_at_any_instant_of_a_final_write_leaves_the_old_or_the_new_final_whole(
    tiny_model_dir, tmp_path, monkeypatch, exchange
):
    """Issue 51, item 2: final/ was replaced by rmtree then rename, so a kill in between left a final/ with some of
    its files (PEFT cannot load it) beside a complete temp dir, and nothing repaired it. The write is killed before
    each step that renames or deletes, in turn: final/ is then the old one or the new one, file for file (where the
    file system cannot exchange two names, the old one renamed aside is put back by the next write's first act)."""
    from common.model import attach_lora, load_model

    model, tokenizer = load_model(tiny_model_dir, "fp32")
    model = attach_lora(model)
    old_dir = tmp_path / "old"
    harness.checkpoints.save_final(str(old_dir), model, tokenizer)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.fill_(0.5)  # the new final/: other adapter weights
    if not exchange:
        monkeypatch.setattr(harness.checkpoints, "_exchange", lambda a, b: False)
    state = {"armed": False, "kill_at": -1, "steps": 0}

    def killable(fn):
        def step(*args, **kwargs):
            if state["armed"]:
                if state["steps"] == state["kill_at"]:
                    raise Killed
                state["steps"] += 1
            return fn(*args, **kwargs)

        return step

    for name in ("replace", "rename", "unlink", "remove", "rmdir"):
        monkeypatch.setattr(os, name, killable(getattr(os, name)))
    if hasattr(harness.checkpoints, "_exchange"):
        monkeypatch.setattr(harness.checkpoints, "_exchange", killable(harness.checkpoints._exchange))
    out = tmp_path / "run" / "final"

    def write_killed_at(kill_at: int) -> int:
        shutil.rmtree(out.parent, ignore_errors=True)
        shutil.copytree(old_dir, out)  # the run's earlier final/
        state.update(armed=True, kill_at=kill_at, steps=0)
        try:
            harness.checkpoints.save_final(str(out), model, tokenizer)
        except Killed:
            pass
        finally:
            state["armed"] = False
        return state["steps"]

    old = files_of(old_dir)
    total = write_killed_at(-1)  # not killed: the steps of a whole write
    new = files_of(out)
    assert new != old and total >= 2
    seen = []
    for kill_at in range(total):
        write_killed_at(kill_at)
        if not exchange:
            harness.checkpoints.repair_swap(str(out))
        now = files_of(out)
        assert now in (old, new), f"killed before step {kill_at} of {total}: final/ holds {sorted(now)}"
        seen.append("old" if now == old else "new")
    assert "old" in seen and "new" in seen


@pytest.mark.parametrize("script", ["dpo", "grpo"])
def test_a_final_lost_at_the_end_is_made_by_a_resume_in_dpo_and_grpo(script, tiny_model_dir, tmp_path):
    """Issue 51, item 1, for a script with a reference slot (dpo: final/ref/) and for grpo's loop: a checkpoint at
    --max-steps whose final/ was lost resumes into the same final/, byte for byte, training no step."""
    module, args = end_run_args(script, tiny_model_dir, tmp_path)
    args = dataclasses.replace(args, save_steps=2)
    out = module.main(args)
    final = pathlib.Path(out["final_dir"])
    whole = files_of(final)
    shutil.rmtree(final)
    again = module.main(dataclasses.replace(args, resume_from_checkpoint=out["run_dir"]))
    assert os.path.samefile(again["final_dir"], final) and files_of(final) == whole
    assert [json.loads(line)["step"] for line in open(final.parent / "metrics.jsonl")] == [1, 2]

"""The scripts under torchrun (2 CPU processes, gloo), against one process with the same global batch.

Every script: `torchrun --nproc-per-node 2 <script>.py` with accumulation ga logs what one process logs with 2 x ga,
step by step, and ends with the same weights; grpo and raft sample the same completions (their rewards and lengths
are logged per step). FSDP2 (--fsdp, a full fine-tune) against one process too. Tolerance: the two runs add the same
per-row gradients in another order (each rank sums its micro-batches, then the all-reduce adds the two sums), which
is exact arithmetic reordered, so every value agrees to fp32 rounding carried through a few AdamW steps: 1e-5
relative on logged metrics, 1e-4 absolute on weights (updates are lr-sized, lr 1e-2 / 1e-3). Then what is around the
loop: one writer, a resume of a killed run, Ctrl-C, a breaker stop, a NaN stop, a resume with another N, a rank that
dies, and two "nodes" on 127.0.0.1.
"""

import contextlib
import importlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from tests import cli
from tests.conftest import ROOT
from tests.prefs_helpers import binary_rows, preference_rows, write_jsonl

pytestmark = pytest.mark.slow
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
WALL_CLOCK = ("time/", "perf/", "memory/")
OPTIONAL_BOOL = {"precompute_ref_log_probs"}  # True / False / None on the command line
COMMON = dict(seed=1, torch_threads=1, report_to="none", ddp_timeout=120, max_steps=3, learning_rate=1e-2)
GRPO_QUIET = dict(breaker_action="warn")
# Dropout on (dpo, orpo, kto and rm turn it off by default): each micro-batch's masks are keyed to its global index,
# so the ranks draw the masks one process draws
DROPOUT = dict(lora_dropout=0.1)
# Each script's flags: the data it reads and the knobs that keep it small. ga: the per-rank accumulation.
RUNS = {
    "sft": dict(dataset="{sft}", per_device_train_batch_size=2, max_length=64, **DROPOUT),
    "dpo": dict(dataset="{prefs}", per_device_train_batch_size=2, max_length=64, **DROPOUT, disable_dropout=False),
    "orpo": dict(dataset="{prefs}", per_device_train_batch_size=2, max_length=64, **DROPOUT, disable_dropout=False),
    "kto": dict(dataset="{binary}", per_device_train_batch_size=4, max_length=64, **DROPOUT, disable_dropout=False),
    "rm": dict(dataset="{prefs}", per_device_train_batch_size=2, max_length=64, **DROPOUT, disable_dropout=False),
    "grpo": dict(
        dataset="builtin:math",
        rewards=["tests.test_grpo:frac_low_ids"],
        group_size=4,
        prompts_per_step=4,
        max_completion_length=8,
        beta=0.04,
        **DROPOUT,
        **GRPO_QUIET,
    ),
    "raft": dict(
        preset="demo",
        dataset="builtin:math",
        rewards=["tests.test_raft:frac_low_ids"],
        num_rounds=2,
        prompts_per_round=4,
        group_size=4,
        max_completion_length=6,
        reward_threshold=None,
        min_margin=0.0,
        mask_truncated_completions=False,
        dpo=True,
        dpo_learning_rate=1e-2,
        per_device_train_batch_size=2,
        num_train_epochs=1.0,
        eval_dataset="builtin:math",
        eval_limit=3,
        **DROPOUT,
    ),
}


def flags(kw: dict) -> list[str]:
    """tyro's command line for a dict of Args fields."""
    out = []
    for key, value in kw.items():
        name = "--" + key.replace("_", "-")
        if isinstance(value, bool) and key not in OPTIONAL_BOOL:
            out.append(name if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, list):
            out += [name, *map(str, value)]
        else:
            out += [name, str(value)]
    return out


def torchrun(
    script: str, kw: dict, nproc: int = 2, timeout: float = 300, extra: tuple = (), via: str = "torch.distributed.run"
) -> subprocess.Popen:
    """torchrun --standalone (a free port) with the script's flags (via: torchrun's module, or harness.torchrun);
    the caller waits."""
    launcher = [sys.executable, "-m", via, "--standalone", f"--nproc-per-node={nproc}", *extra]
    return subprocess.Popen(
        [*launcher, f"{script}.py", *flags(kw)],
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"torchrun did not end within {timeout} s (a hang): {err[-3000:]}") from None
    return proc.returncode, out, err


def run_dir_of(root) -> str:
    dirs = [os.path.join(root, d) for d in os.listdir(root)]
    assert len(dirs) == 1, dirs  # one writer: one run dir
    return dirs[0]


def metrics_of(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(WALL_CLOCK)} for line in f]


def weights_of(final_dir: str) -> dict:
    """The adapter (or the full model) in final/, and a reward model's head."""
    name = "adapter_model.safetensors" if os.path.exists(os.path.join(final_dir, "adapter_model.safetensors")) else ""
    weights = load_file(os.path.join(final_dir, name or "model.safetensors"))
    head = os.path.join(final_dir, "reward_head.safetensors")
    if os.path.exists(head):
        weights |= {f"head.{k}": v for k, v in load_file(head).items()}
    return weights


def assert_same_run(one: list[dict], two: list[dict], rel=1e-5):
    assert [h["step"] for h in one] == [h["step"] for h in two]
    for a, b in zip(one, two, strict=True):
        assert a.keys() == b.keys(), a.keys() ^ b.keys()
        for key in a:
            both_nan = math.isnan(a[key]) and math.isnan(b[key])
            assert both_nan or a[key] == pytest.approx(b[key], rel=rel, abs=1e-6), (a["step"], key, a[key], b[key])


def assert_same_weights(a: dict, b: dict, atol=1e-4):
    assert a.keys() == b.keys()
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst <= atol, worst


def round_metrics(run_dir: str) -> list[dict]:
    rounds = sorted(d for d in os.listdir(run_dir) if d.startswith("round-"))
    out = []
    for d in rounds:
        with open(os.path.join(run_dir, d, "metrics.json")) as f:
            out.append({"step": int(d[6:]), **{k: v for k, v in json.load(f).items() if not k.startswith(WALL_CLOCK)}})
    return out


@pytest.fixture(scope="module")
def prefs(tmp_path_factory):
    """Preference pairs (dpo) and, beside them, demonstrations of uneven lengths (sft)."""
    folder = tmp_path_factory.mktemp("data")
    words = ["red", "blue", "green", "yes", "no", "good", "bad", "hello", "world", "fox", "dog", "cat"]
    sft = [
        {
            "prompt": [{"role": "user", "content": f"Say word {i}"}],
            "completion": [{"role": "assistant", "content": f"{w} " * (i % 3 + 1)}],
        }
        for i, w in enumerate(words)
    ]
    write_jsonl(folder / "sft.jsonl", sft)
    write_jsonl(folder / "binary.jsonl", binary_rows(16))
    return write_jsonl(folder / "prefs.jsonl", preference_rows(12))


def setup(script, tiny_model_dir, prefs, **kw) -> dict:
    base = {**COMMON, "model": tiny_model_dir, **RUNS[script], **kw}
    if base.get("dataset") == "{prefs}":
        base["dataset"] = prefs
    if base.get("dataset") in ("{sft}", "{binary}"):
        base["dataset"] = os.path.join(os.path.dirname(prefs), base["dataset"][1:-1] + ".jsonl")
    if script == "raft":
        base.pop("max_steps")
    return base


def one_process(script: str, kw: dict, out) -> dict:
    module = importlib.import_module(script)
    return module.main(module.Args(**{**kw, "output_dir": str(out)}))


def logged(script: str, run_dir: str) -> list[dict]:
    return round_metrics(run_dir) if script == "raft" else metrics_of(run_dir)


# The equality runs beyond RUNS: grpo's old-policy pass draws dropout masks too (two updates a rollout); raft's DPO
# loss turns dropout off, so its SFT phase alone is run once more with it on
VARIANTS = {"grpo": dict(num_iterations=2), "raft-sft": dict(dpo=False, num_rounds=1)}


@pytest.mark.parametrize("run", ["sft", "dpo", "orpo", "kto", "rm", "grpo", "raft", "raft-sft"])
def test_two_ranks_equal_one_process_with_twice_the_accumulation(run, tiny_model_dir, prefs, tmp_path):
    """The same global batch: 2 ranks x ga 1 against 1 process x ga 2 (grpo and raft: the same prompts per step,
    split over the ranks). Every logged metric of every step and the final weights agree; one run dir is written.
    Dropout is on: each micro-batch draws its masks from a stream keyed to its index in the global batch."""
    script = run.split("-")[0]
    kw = setup(script, tiny_model_dir, prefs, **VARIANTS.get(run, {}))
    alone = dict(kw)
    if script != "grpo":
        alone["gradient_accumulation_steps"] = 2
    one = one_process(script, alone, tmp_path / "one")
    code, out, err = finish(torchrun(script, {**kw, "output_dir": str(tmp_path / "two")}))
    assert code == 0, err[-3000:]
    two_dir = run_dir_of(tmp_path / "two")
    assert_same_run(logged(script, one["run_dir"]), logged(script, two_dir))
    assert_same_weights(weights_of(one["final_dir"]), weights_of(os.path.join(two_dir, "final")))
    if script == "raft":  # the samples themselves (grpo's rewards per step are among its metrics above)
        for n in range(1, kw["num_rounds"] + 1):
            a = open(os.path.join(one["run_dir"], f"round-{n}", "samples.jsonl")).read()
            assert a == open(os.path.join(two_dir, f"round-{n}", "samples.jsonl")).read()
    ends = [line for line in out.splitlines() if line.startswith(script) and "saved" in line]
    assert len(ends) == 1, out[-2000:]  # rank 0 alone prints the end line (rank 1's stdout is closed)


@pytest.mark.parametrize("script", ["sft", "dpo", "grpo"])
def test_fsdp_full_fine_tune_equals_one_process(script, tiny_model_dir, prefs, tmp_path):
    """--fsdp --no-use-lora on 2 ranks against one process's full fine-tune with the same global batch; final/ is one
    plain transformers folder. sft evaluates mid-run and grpo takes two updates a rollout: both run no-grad passes
    between updates, which must not leave stale gathered weights behind."""
    from transformers import AutoModelForCausalLM

    extra = {"sft": dict(eval_split="train", eval_steps=1), "grpo": dict(num_iterations=2), "dpo": {}}[script]
    kw = setup(script, tiny_model_dir, prefs, use_lora=False, learning_rate=1e-3, **extra)
    if script == "dpo":
        kw["precompute_ref_log_probs"] = False  # the reference's shards swapped in at every step
    alone = dict(kw)
    if script != "grpo":
        alone["gradient_accumulation_steps"] = 2
    one = one_process(script, alone, tmp_path / "one")
    code, _, err = finish(torchrun(script, {**kw, "fsdp": True, "output_dir": str(tmp_path / "two")}))
    assert code == 0, err[-3000:]
    two_dir = run_dir_of(tmp_path / "two")
    assert_same_run(logged(script, one["run_dir"]), logged(script, two_dir))
    assert_same_weights(weights_of(one["final_dir"]), weights_of(os.path.join(two_dir, "final")))
    loaded = AutoModelForCausalLM.from_pretrained(os.path.join(two_dir, "final"))  # plain transformers, no shards
    assert sum(p.numel() for p in loaded.parameters()) > 0
    assert not [f for f in os.listdir(os.path.join(two_dir, "final")) if "shard" in f or f.endswith(".distcp")]


def test_a_killed_rank_ends_the_run_and_its_resume_equals_the_straight_run(tiny_model_dir, prefs, tmp_path):
    """SIGKILL one rank mid-run: the launcher ends the other within a bounded time (no hang); resuming the run dir
    on 2 ranks gives the uninterrupted 2-rank run's final weights bit for bit (every rank's RNG restored)."""
    kw = setup("sft", tiny_model_dir, prefs, max_steps=40, save_steps=1, lora_dropout=0.1, learning_rate=1e-3)
    code, _, err = finish(torchrun("sft", {**kw, "output_dir": str(tmp_path / "straight")}))
    assert code == 0, err[-3000:]
    straight = weights_of(os.path.join(run_dir_of(tmp_path / "straight"), "final"))
    proc = torchrun("sft", {**kw, "output_dir": str(tmp_path / "killed")})
    victim = None
    deadline = time.time() + 120
    while victim is None and time.time() < deadline:  # rank 1, once a checkpoint exists
        ckpts = [r for r in _checkpoints(tmp_path / "killed") if r]
        children = _workers(proc.pid)
        if ckpts and len(children) == 2:
            victim = children[1]
        time.sleep(0.05)
    assert victim is not None, "no checkpoint within 120 s"
    os.kill(victim, signal.SIGKILL)
    t0 = time.time()
    code, _, err = finish(proc, timeout=180)
    assert code != 0 and time.time() - t0 < 120
    run_dir = run_dir_of(tmp_path / "killed")
    assert not os.path.exists(os.path.join(run_dir, "final"))
    code, _, err = finish(torchrun("sft", {**kw, "resume_from_checkpoint": run_dir}))  # continues that run dir
    assert code == 0, err[-3000:]
    resumed = weights_of(os.path.join(run_dir, "final"))
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def _checkpoints(root) -> list[str]:
    if not os.path.isdir(root):
        return []
    found = []
    for d in os.listdir(root):
        ckpt = os.path.join(root, d, "checkpoints")
        if os.path.isdir(ckpt):
            found += [n for n in os.listdir(ckpt) if n.startswith("step-")]
    return found


def _workers(launcher_pid: int) -> list[int]:
    """The launcher's worker processes (its children running python), rank order = pid order."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(launcher_pid)], capture_output=True, text=True).stdout
    return sorted(int(p) for p in out.split())


def test_ctrl_c_stops_every_rank_after_the_same_step_with_one_checkpoint(tiny_model_dir, prefs, tmp_path):
    """SIGINT to the launcher (it forwards the signal to each rank): every rank stops after the same step (the request
    is all-reduced), one checkpoint of that step, and each line once: rank 0's (every rank printed `Ctrl-C: stopping
    after this step`). Through harness.torchrun the launcher exits 130, as one process does, without torchrun's
    traceback (plain torchrun: status 1 and its SignalException's traceback, after the ranks exited 130)."""
    kw = setup("sft", tiny_model_dir, prefs, max_steps=500, save_steps=0)
    proc = torchrun("sft", {**kw, "output_dir": str(tmp_path / "out")}, via="harness.torchrun")
    deadline = time.time() + 120
    while time.time() < deadline:
        runs = os.listdir(tmp_path / "out") if os.path.isdir(tmp_path / "out") else []
        if runs and os.path.exists(os.path.join(tmp_path / "out", runs[0], "metrics.jsonl")):
            if os.path.getsize(os.path.join(tmp_path / "out", runs[0], "metrics.jsonl")) > 0:
                break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)
    code, _, err = finish(proc, timeout=120)
    assert code == 130, err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]
    assert err.count("Ctrl-C: stopping after this step") == 1, err[-3000:]
    lines = [line for line in err.splitlines() if "stopped at step" in line]
    assert len(lines) == 1 and "(Ctrl-C)" in lines[0] and "--resume-from-checkpoint" in lines[0], err[-3000:]
    step = lines[0].split("stopped at step ")[1].split()[0]
    assert _checkpoints(tmp_path / "out") == [f"step-{step}"]


def test_ranks_die_with_their_launcher(tiny_model_dir, prefs, tmp_path):
    """torchrun SIGKILLed (or OOM-killed) mid-run: its ranks ran on unsupervised to the end (63 s later they wrote
    final/), holding their GPUs after the job had "ended". Each rank has a parent-death signal now: both are gone
    within seconds, and no final/ is written."""
    kw = setup("sft", tiny_model_dir, prefs, max_steps=2000, save_steps=0)
    proc = torchrun("sft", {**kw, "output_dir": str(tmp_path / "out")})
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not _checkpoints_or_metrics(tmp_path / "out"):
            time.sleep(0.05)
        ranks = _workers(proc.pid)
        assert len(ranks) == 2, ranks
        os.kill(proc.pid, signal.SIGKILL)  # the launcher alone (its ranks hold its pipes: read them after)
        deadline = time.time() + 30
        while time.time() < deadline and [pid for pid in ranks if _alive(pid)]:
            time.sleep(0.1)
        assert not [pid for pid in ranks if _alive(pid)], "a rank outlived its launcher by 30 s"
        assert not os.path.exists(os.path.join(run_dir_of(tmp_path / "out"), "final"))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # (the ranks share the launcher's process group)
        proc.communicate(timeout=60)


def _alive(pid: int) -> bool:
    """Whether pid is a process that has not exited (a zombie waiting to be reaped has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_world_size_without_torchrun_is_refused_at_once(monkeypatch, capsys):
    """WORLD_SIZE set by hand, with no other rank to join: the join waited --ddp-timeout (1,800 s by default) for a
    peer nothing would start. The CLI refuses it before main() runs, in one line naming WORLD_SIZE."""
    from common.distributed import init_distributed
    from harness.cli import one_line_errors

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with pytest.raises(SystemExit) as stopped, one_line_errors():
        init_distributed(5)  # (what main() would do first: on the old code it waited 5 s for rank 1)
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 1 and len(err) == 1, err
    assert err[0].endswith(": error: WORLD_SIZE=2 is set, but not by torchrun: launch with torchrun, or unset it")


def test_a_breaker_stops_every_rank_at_the_same_step(tiny_model_dir, prefs, tmp_path):
    """grpo with a constant reward: frac_reward_zero_std holds on the all-reduced metrics, so both ranks stop at the
    same step with one checkpoint."""
    kw = setup(
        "grpo",
        tiny_model_dir,
        prefs,
        rewards=["tests.test_grpo:constant"],
        breaker_action="stop",
        breaker_patience=2,
        max_steps=6,
    )
    code, _, err = finish(torchrun("grpo", {**kw, "output_dir": str(tmp_path / "out")}))
    assert code == 1
    lines = [line for line in err.splitlines() if "stopped at step" in line]
    assert len(lines) == 1 and "stopped at step 2 (circuit breaker" in lines[0], err[-3000:]
    assert _checkpoints(tmp_path / "out") == ["step-2"]


def test_a_nan_stop_is_decided_on_all_ranks(tiny_model_dir, prefs, tmp_path):
    """A learning rate that makes the loss non-finite: the skipped-update count comes from the all-reduced loss, so
    both ranks stop at the same step, with one checkpoint and no final/."""
    kw = setup("sft", tiny_model_dir, prefs, learning_rate=1e30, max_steps=10, breaker_max_nonfinite=2)
    code, _, err = finish(torchrun("sft", {**kw, "output_dir": str(tmp_path / "out")}))
    assert code == 1
    lines = [line for line in err.splitlines() if "stopped at step" in line]
    assert len(lines) == 1 and "NaN/Inf" in lines[0], err[-3000:]
    assert len(_checkpoints(tmp_path / "out")) == 1
    assert not os.path.exists(os.path.join(run_dir_of(tmp_path / "out"), "final"))


def test_a_resume_on_another_number_of_ranks_is_refused_in_one_line(tiny_model_dir, prefs, tmp_path):
    kw = setup("sft", tiny_model_dir, prefs, max_steps=2, save_steps=1)
    code, _, err = finish(torchrun("sft", {**kw, "output_dir": str(tmp_path / "two")}))
    assert code == 0, err[-3000:]
    run_dir = run_dir_of(tmp_path / "two")
    alone = cli.run(
        [sys.executable, "sft.py", *flags({**kw, "max_steps": 3, "resume_from_checkpoint": run_dir})],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert alone.returncode == 1
    assert "was written by 2 rank(s), this run has 1" in alone.stderr
    assert len(alone.stderr.strip().splitlines()) == 1 or alone.stderr.strip().splitlines()[-1].startswith("sft.py:")


def two_nodes(kw: dict, out, node1: dict | None = None) -> list[subprocess.Popen]:
    """Two torchrun "nodes" on 127.0.0.1, one process each, meeting at a free port (static rendezvous); node1: flags
    node 1 gets instead (a rank started with another command)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = []
    for node in (0, 1):
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}"]
        launcher += ["--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}"]
        own = (node1 or {}) if node == 1 else {}
        cmd = [*launcher, "sft.py", *flags({**kw, "output_dir": str(out), **own})]
        pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        nodes.append(subprocess.Popen(cmd, cwd=ROOT, env=ENV, **pipes))
    return nodes


def test_a_rank_that_dies_on_another_node_gives_one_clear_line_not_a_hang(tiny_model_dir, prefs, tmp_path):
    """Node 1's worker is SIGKILLed mid-run: node 0's launcher cannot see it, so its rank finds out from the
    collective, and ends with one line naming the cause, well within --ddp-timeout (a closed connection fails at
    once; a silent peer would fail at the timeout)."""
    kw = setup("sft", tiny_model_dir, prefs, max_steps=2000, save_steps=0, ddp_timeout=60)
    nodes = two_nodes(kw, tmp_path / "out")
    deadline = time.time() + 120
    while time.time() < deadline and not _checkpoints_or_metrics(tmp_path / "out"):
        time.sleep(0.05)
    workers = _workers(nodes[1].pid)
    assert len(workers) == 1
    os.kill(workers[0], signal.SIGKILL)
    t0 = time.time()
    code, _, err = finish(nodes[0], timeout=120)
    finish(nodes[1], timeout=60)
    assert code != 0 and time.time() - t0 < 60
    lines = [line for line in err.splitlines() if "lost contact with another rank" in line]
    assert len(lines) == 1 and lines[0].startswith("sft.py [rank 0/2]: error:"), err[-3000:]


def test_ranks_started_with_other_flags_or_data_are_refused_in_one_line(tiny_model_dir, prefs, tmp_path):
    """Issue 51, item 3: a rank with another --seed or dataset copy trained silently, its gradients averaged in; with
    another --max-steps rank 0 wrote final/ and both then timed out. Node 1 here gets all three: both ranks stop
    at start-up, before any step, with one line naming each field, and nothing is written."""
    kw = setup("sft", tiny_model_dir, prefs, max_steps=2, save_steps=1, ddp_timeout=60)
    copy = tmp_path / "node1" / os.path.basename(kw["dataset"])  # node 1's own copy, one row changed
    copy.parent.mkdir()
    copy.write_text(open(kw["dataset"]).read().replace("blue", "teal", 1))
    nodes = two_nodes(kw, tmp_path / "out", node1={"seed": 2, "max_steps": 3, "dataset": str(copy)})
    (code, _, err), (code1, _, err1) = [finish(p, timeout=240) for p in nodes]
    assert code != 0 and code1 != 0, err[-3000:]
    lines = [line for line in err.splitlines() if "the ranks would train different runs" in line]
    assert len(lines) == 1 and lines[0].startswith("sft.py [rank 0/2]: error:"), err[-3000:]
    for named in ("--seed: rank 0 1, rank 1 2", "--max-steps: rank 0 2, rank 1 3", "--dataset's content (sha256)"):
        assert named in lines[0]
    assert any("the ranks would train different runs" in line for line in err1.splitlines())
    run_dir = run_dir_of(tmp_path / "out")
    assert not {"checkpoints", "final", "metrics.jsonl"} & set(os.listdir(run_dir))  # nothing trained, nothing saved


def _checkpoints_or_metrics(root) -> bool:
    runs = os.listdir(root) if os.path.isdir(root) else []
    path = os.path.join(root, runs[0], "metrics.jsonl") if runs else ""
    return bool(path) and os.path.exists(path) and os.path.getsize(path) > 0


def test_two_nodes_on_localhost_equal_one_node(tiny_model_dir, prefs, tmp_path):
    """--nnodes 2 with a rendezvous endpoint, one process a node, both on 127.0.0.1: the run of one node with 2."""
    kw = setup("sft", tiny_model_dir, prefs)
    nodes = two_nodes(kw, tmp_path / "nodes")
    results = [finish(p, timeout=300) for p in nodes]
    assert all(code == 0 for code, _, _ in results), results[0][2][-2000:] + results[1][2][-2000:]
    code, _, err = finish(torchrun("sft", {**kw, "output_dir": str(tmp_path / "one_node")}))
    assert code == 0, err[-3000:]
    a = run_dir_of(tmp_path / "nodes")
    b = run_dir_of(tmp_path / "one_node")
    assert metrics_of(a) == metrics_of(b)
    assert_same_weights(weights_of(os.path.join(a, "final")), weights_of(os.path.join(b, "final")), atol=0.0)


def test_a_fork_runs_under_torchrun_unedited(tiny_model_dir, prefs, tmp_path):
    """docs/forks/rloo.patch applied to a copy of grpo.py under its own name: on 2 ranks it logs what it logs alone
    (its leave-one-out advantages over the global batch, its own KL penalty summed over all ranks' completions)."""
    from tests.test_forks import apply_fork

    fork = apply_fork("rloo", tmp_path)
    module_dir, name = os.path.split(fork)
    kw = setup("grpo", tiny_model_dir, prefs)
    sys.path.insert(0, module_dir)
    try:
        one = one_process(name[:-3], kw, tmp_path / "one")
    finally:
        sys.path.remove(module_dir)
    env = {**ENV, "PYTHONPATH": str(ROOT)}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd = [*launcher, fork, *flags({**kw, "output_dir": str(tmp_path / "two")})]
    proc = subprocess.Popen(cmd, cwd=module_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    code, _, err = finish(proc)
    assert code == 0, err[-3000:]
    two_dir = run_dir_of(tmp_path / "two")
    assert os.path.basename(two_dir).startswith("grpo_rloo__")  # the fork names its own runs
    assert_same_run(metrics_of(one["run_dir"]), metrics_of(two_dir))


def test_an_fsdp_resume_continues_bit_for_bit(tiny_model_dir, prefs, tmp_path):
    """--fsdp checkpoints hold the gathered weights and AdamW states: resumed on 2 ranks from step 2, the run ends
    with the straight run's weights bit for bit."""
    kw = setup("sft", tiny_model_dir, prefs, use_lora=False, learning_rate=1e-3, save_steps=2, fsdp=True)
    code, _, err = finish(torchrun("sft", {**kw, "output_dir": str(tmp_path / "straight")}))
    assert code == 0, err[-3000:]
    straight = run_dir_of(tmp_path / "straight")
    ckpt = os.path.join(straight, "checkpoints", "step-2")
    a = weights_of(os.path.join(straight, "final"))
    code, _, err = finish(torchrun("sft", {**kw, "resume_from_checkpoint": ckpt}))  # steps 3.. again, in place
    assert code == 0, err[-3000:]
    b = weights_of(os.path.join(straight, "final"))
    assert all(torch.equal(a[k], b[k]) for k in a)

"""A run's directory, its metric log (metrics.jsonl, TensorBoard or W&B, and a progress bar, or one plain line a step
off a terminal), the cost of each step (seconds per phase, peak memory, tokens per second), and circuit-breaker
bookkeeping (conditions that must hold for several steps in a row before they fire)."""

import fcntl
import json
import math
import os
import re
import resource
import secrets
import shutil
import sys
import time

import torch
from torch.utils.tensorboard import SummaryWriter
from tqdm.auto import tqdm

from common.distributed import rank_and_world
from harness.errors import OutputDirError
from harness.fast_help import require
from harness.checkpoints import COMPLETE, broadcast


def make_run_dir(exp_name: str, model: str, seed: int, root: str = "runs", resume_path: str | None = None) -> str:
    """runs/<exp_name>__<model>__<seed>__<time>-<6 hex>, CleanRL's run naming (model path reduced to its last part)
    plus a random tag, so two runs started in the same second never share a directory. Scripts call it before the
    model loads: the directory is created and a probe file written and deleted, so an unwritable --output-dir fails
    in a second, not after minutes of loading. resume_path (--resume-from-checkpoint: a run dir, or a checkpoint in
    its checkpoints/) continues that run dir instead, as TRL resumes into its output dir: its lock is taken here,
    and the Logger continues its metrics. A checkpoint that sits in no run dir starts a new one, said in one line.
    Under torchrun rank 0 creates or locks it (the run's one writer) and every rank gets its path, or the same
    one-line error."""
    path = None
    error = None
    if rank_and_world()[0] == 0:
        try:
            path = resumed_run_dir(resume_path) if resume_path else None
            if path is None:
                path = _new_run_dir(exp_name, model, seed, root)
                if resume_path:
                    why = "is in no run dir's checkpoints/: this resume writes a new run dir"
                    print(f"note: {resume_path} {why}, {path}")
        except (OutputDirError, FileNotFoundError) as e:
            error = e
    path, error = broadcast((path, error))
    if error:
        raise error
    return path


def resumed_run_dir(resume_path: str) -> str | None:
    """The run dir a --resume-from-checkpoint continues, locked for this process: the folder itself when it holds
    checkpoints/, or the run dir of a checkpoint in <run dir>/checkpoints/; None for a checkpoint elsewhere (a
    copied step-N/ alone). FileNotFoundError when the path is neither a checkpoint nor a run dir with checkpoints."""
    path = os.path.normpath(resume_path)
    if os.path.isfile(os.path.join(path, COMPLETE)):  # a checkpoint
        parent = os.path.dirname(os.path.abspath(path))
        run_dir = os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else None
        if run_dir and not os.path.isabs(path):  # named as the user named it, as a new run's dir is (runs/...)
            run_dir = os.path.relpath(run_dir)
    elif os.path.isdir(os.path.join(path, "checkpoints")):
        run_dir = path
    else:
        raise FileNotFoundError(f"--resume-from-checkpoint {resume_path}: no complete checkpoint there")
    if run_dir is not None:
        try:
            lock_run_dir(run_dir)
        except OSError as e:  # a run dir this user cannot write: refused before the model loads
            raise OutputDirError(f"--resume-from-checkpoint {resume_path}: cannot write its run dir ({e})") from None
    return run_dir


def _new_run_dir(exp_name: str, model: str, seed: int, root: str) -> str:
    model_tag = re.sub(r"[^A-Za-z0-9._-]+", "-", model.rstrip("/").split("/")[-1])
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
    path = os.path.join(root, f"{exp_name}__{model_tag}__{seed}__{stamp}")
    try:
        os.makedirs(path, exist_ok=False)
        probe = os.path.join(path, ".write-probe")
        with open(probe, "w") as f:
            f.write("probe")
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as e:
        raise OutputDirError(
            f"--output-dir {root}: cannot write a run there ({type(e).__name__}: {e.strerror or e})"
        ) from None
    try:
        lock_run_dir(path)
    except OutputDirError:
        shutil.rmtree(path, ignore_errors=True)  # a run dir that could not be locked is left behind empty
        raise
    return path


def claim_run_dir(run_dir: str) -> None:
    """Every rank calls it: rank 0 takes run_dir's lock (lock_run_dir) and a refusal (another writer, a file system
    without locks) is raised on every rank, so none is left waiting at a collective."""
    error = None
    if rank_and_world()[0] == 0:
        try:
            lock_run_dir(run_dir)
        except OutputDirError as e:
            error = str(e)
    error = broadcast(error)
    if error:
        raise OutputDirError(error)


_LOCKED: dict[str, int] = {}  # run dirs this process writes: real path -> the descriptor holding the lock


def lock_run_dir(run_dir: str) -> None:
    """Make this process the only writer of run_dir until it exits: an exclusive flock on run_dir/.lock, which the
    kernel drops when the process ends, however it ends (a SIGKILL leaves no stale lock). A second process is refused
    with one line naming the holder's pid (a run resumed in place: two resumes of one dir raced and broke it). The
    process holding it may call again (a resumed run in the same interpreter)."""
    path = os.path.realpath(run_dir)
    if path in _LOCKED:
        return
    fd = os.open(os.path.join(path, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        why = f"another process (pid {holder}) is writing this run; one writer per run dir"
        raise OutputDirError(f"{run_dir}: {why}") from None
    except OSError as e:  # ENOLCK: a file system without locks (NFS without lockd)
        os.close(fd)
        why = f"cannot lock {path}/.lock ({e.strerror or e}: the file system does not support flock)"
        raise OutputDirError(f"{run_dir}: {why}; write runs to a local disk (--output-dir)") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    _LOCKED[path] = fd


def release_run_dir(run_dir: str) -> None:
    """A clean end (Logger.close): this process is done writing run_dir, so its .lock goes, removed while still held,
    then the lock is dropped. A run that crashes, is killed or stops early keeps the file, unlocked once the process
    ends (the kernel drops a flock however a process ends): the next resume takes it. Nothing when this process holds
    no lock on run_dir (another rank, a dir it only reads)."""
    path = os.path.realpath(run_dir)
    fd = _LOCKED.pop(path, None)
    if fd is None:
        return
    try:
        os.remove(os.path.join(path, ".lock"))
    except FileNotFoundError:  # removed by hand while the run went on: nothing left to remove
        pass
    os.close(fd)


def peak_memory_gb() -> float:
    """Peak CUDA memory allocated by torch, or on CPU the process's peak resident set size (Linux reports KiB)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class PhaseTimer:
    """Wall seconds per named phase of one step; a phase marked twice adds up. On a GPU the marks are CUDA events in
    the device's queue, read once, in metrics(): a phase is charged the device's time from the previous mark to its
    own, so work a phase launches and the device runs later is not charged to the next phase (where the host would
    first wait for it), and a mark makes the host wait for nothing."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.seconds = {}
        self.events = [(None, self._event())] if torch.cuda.is_initialized() else None

    @staticmethod
    def _event():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self, phase: str) -> None:
        if self.events is not None:
            self.events.append((phase, self._event()))
            return
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.last
        self.last = now

    def metrics(self, tokens: int) -> dict:
        """A step's cost: peak memory so far, tokens per second since the timer started, seconds per phase."""
        if self.events is not None:  # the step's one wait for the device, then the phases from its clock
            self.events[-1][1].synchronize()
            for (_, before), (phase, event) in zip(self.events, self.events[1:]):
                self.seconds[phase] = self.seconds.get(phase, 0.0) + before.elapsed_time(event) / 1000
            self.events = [(None, self._event())]
        return {
            "memory/peak_gb": peak_memory_gb(),
            "perf/tokens_per_s": tokens / (time.perf_counter() - self.start),
            **{f"time/{phase}": seconds for phase, seconds in self.seconds.items()},
        }


WANDB_ID = "wandb-run-id.txt"  # in a run dir: the W&B run its metrics went to, which a resume of it continues


def wandb_run(name: str, config: dict, run_id: str | None = None):
    """A W&B run (wandb imported here: an optional package) in WANDB_PROJECT (default "onlyone") named `name`, with
    `config` as its config; run_id continues that run instead (its name kept). As transformers' WandbCallback does,
    every metric is plotted against "train/global_step", so a resume that logs a step again does not break W&B's
    rule that its own step only grows; WANDB_MODE, WANDB_DIR, WANDB_ENTITY ... are read by wandb itself."""
    wandb = require("wandb", "--report-to wandb")
    run = wandb.init(
        project=os.environ.get("WANDB_PROJECT", "onlyone"),
        name=None if run_id else name,
        id=run_id,
        resume="allow" if run_id else None,
        reinit="finish_previous",  # an earlier run in this process (a stopped one, in a test) is closed, not reused
    )
    run.config.update(config, allow_val_change=True)  # a resume changes --resume-from-checkpoint
    run.define_metric("train/global_step")
    run.define_metric("*", step_metric="train/global_step", step_sync=True)
    return run


def log_scores(report_to: str, name: str, config: dict, scores: dict) -> None:
    """An eval's scores to W&B (--report-to wandb): a run named like its files, with the eval's resolved args as its
    config and the scores logged once (train/global_step 0, so they are also its summary); "none" logs nothing."""
    if report_to != "wandb":
        return
    run = wandb_run(name, config)
    run.log({**scores, "train/global_step": 0})
    run.finish()


def wandb_id_of(run_dir: str, resumed_from: str | None) -> str | None:
    """The W&B run id recorded in run_dir (a run resumed in place) or in the run dir `resumed_from` belongs to (the
    run dir itself or its checkpoints/step-N): the run a resume continues; None when neither holds one."""
    dirs = [run_dir]
    if resumed_from:
        dirs += [resumed_from, os.path.dirname(os.path.dirname(os.path.normpath(resumed_from)))]
    for folder in dirs:
        path = os.path.join(folder, WANDB_ID)
        if os.path.isfile(path):
            with open(path) as f:
                return f.read().strip()
    return None


def continue_metrics(log_file: str, start_step: int) -> list[dict]:
    """A resume in place: log_file keeps its steps up to start_step, which are returned; the lines after it (steps a
    resume from an older checkpoint trains again, or a line cut short by a crash) are moved to
    metrics.replaced-<time>.jsonl beside it, never dropped, with one printed line naming it. The file is replaced
    whole (a temp file renamed into place)."""
    kept = []
    kept_lines = []
    moved = []
    moved_steps = []
    with open(log_file) as f:
        for line in f:
            line = line if line.endswith("\n") else line + "\n"  # a last line cut short by a crash
            try:
                record = json.loads(line)
                step = int(record["step"])
            except (ValueError, TypeError, KeyError):
                moved.append(line)
                continue
            if step <= start_step:
                kept.append(record)
                kept_lines.append(line)
            else:
                moved.append(line)
                moved_steps.append(step)
    if moved:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = os.path.join(os.path.dirname(log_file), f"metrics.replaced-{stamp}.jsonl")
        n = 1
        while os.path.exists(aside):
            n += 1
            aside = os.path.join(os.path.dirname(log_file), f"metrics.replaced-{stamp}-{n}.jsonl")
        with open(aside, "w") as f:
            f.writelines(moved)
        which = f"steps {min(moved_steps)}..{max(moved_steps)}" if moved_steps else "a line cut short"
        lines = f"{len(moved)} line{'s' if len(moved) != 1 else ''}"
        print(f"resume at step {start_step}: {lines} of metrics.jsonl after it ({which}) moved to {aside}")
    tmp = log_file + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept_lines)
    os.replace(tmp, log_file)
    return kept


def duration(seconds: float) -> str:
    """'42 s', '5m03s' or '2h07m': a time a person reads at a glance."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds // 60:.0f}m{seconds % 60:02.0f}s"
    return f"{seconds // 3600:.0f}h{seconds % 3600 // 60:02.0f}m"


class Logger:
    """Every logged step goes to metrics.jsonl (one JSON object per step), to TensorBoard or W&B (report_to; "none":
    metrics.jsonl only) and to a tqdm bar, or off a terminal to one stderr line: step/total, the `show` metrics,
    s/step and ETA (averaged since the Logger started). The first logged step also prints, once and on a terminal
    too, what the run will take at that pace (a slow start -- a CPU, a big model -- is said at once, not found out).
    A run dir that already has a metrics.jsonl is a resume in place: its steps up to start_step are the start of
    .history (so the end line covers the whole run), the steps after it (a resume from an older checkpoint trains
    them again) are moved to metrics.replaced-<time>.jsonl with one line saying so, TensorBoard purges its events
    from start_step + 1 on, and W&B continues the run's own id. Under torchrun only rank 0 writes or prints (the
    metrics a script logs are already reduced over the ranks); every rank keeps the history."""

    def __init__(self, run_dir: str, args, total_steps: int, show: tuple[str, ...] = ("loss",), start_step: int = 0):
        """args: the run's resolved arguments (its Args), written to args.json (and W&B's config), of which it reads
        logging_steps (log each N-th step and the last; absent: every step), report_to (absent: "tensorboard") and
        resume_from_checkpoint (the checkpoint or run dir a resume starts from: its W&B run continues)."""
        config = dict(vars(args))
        report_to = getattr(args, "report_to", "tensorboard")
        self.run_dir = run_dir
        self.show = show
        self.main = rank_and_world()[0] == 0  # the run's one writer
        log_file = os.path.join(run_dir, "metrics.jsonl")
        earlier = None
        if not self.main:
            report_to = "none"
        else:
            earlier = continue_metrics(log_file, start_step) if os.path.exists(log_file) else None
            with open(os.path.join(run_dir, "args.json"), "w") as f:
                json.dump(config, f, indent=2)
        earlier = broadcast(earlier)  # every rank's history starts with the run's earlier steps
        purge = None if earlier is None else start_step + 1  # TensorBoard drops the replaced steps' events
        self.writer = SummaryWriter(run_dir, purge_step=purge) if report_to == "tensorboard" else None
        self.wandb = None
        if report_to == "wandb":
            self.wandb = wandb_run(
                os.path.basename(os.path.normpath(run_dir)),
                config,
                wandb_id_of(run_dir, getattr(args, "resume_from_checkpoint", None)),
            )
            with open(os.path.join(run_dir, WANDB_ID), "w") as f:
                f.write(self.wandb.id)
        self.jsonl = open(log_file, "a") if self.main else None
        on_terminal = self.main and sys.stderr.isatty()
        self.bar = tqdm(total=total_steps, initial=start_step, dynamic_ncols=True, disable=not on_terminal)
        self.total = total_steps
        self.start = start_step
        self.t0 = time.perf_counter()
        self.every = getattr(args, "logging_steps", 1)
        self.history = earlier or []
        self.paced = False  # the first step this process trains says what the run will take

    def log(self, step: int, metrics: dict) -> None:
        """Log at every `every`-th step and the last (TRL's logging_steps cadence); other steps are skipped."""
        if step % self.every and step != self.total:
            return
        metrics = {k: float(v) for k, v in metrics.items()}
        if self.writer is not None:
            for k, v in metrics.items():
                self.writer.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log({**metrics, "train/global_step": step})
        self.history.append({"step": step, **metrics})
        if not self.main:
            return
        self.jsonl.write(json.dumps(self.history[-1]) + "\n")
        self.jsonl.flush()  # a crash loses at most the line being written
        self.bar.set_postfix({k: f"{metrics[k]:.4g}" for k in self.show if k in metrics}, refresh=False)
        self.bar.update(step - self.bar.n)
        per_step = (time.perf_counter() - self.t0) / max(step - self.start, 1)
        if not self.paced and self.start < step < self.total:
            done = step - self.start
            took = (
                f"first step took {per_step:.1f} s" if done == 1 else f"first {done} steps took {per_step:.1f} s each"
            )
            left = self.total - step
            self.paced = True
            self.bar.write(
                f"{took}; about {duration(per_step * left)} for the remaining {left} steps", file=sys.stderr
            )
        if self.bar.disable:
            shown = "  ".join(f"{k} {metrics[k]:.4g}" for k in self.show if k in metrics)
            eta = per_step * (self.total - step)
            print(
                f"step {step}/{self.total}  {shown}  {per_step:.2f} s/step  ETA {eta // 60:.0f}m{eta % 60:02.0f}s",
                file=sys.stderr,
                flush=True,
            )

    def trend(self, *keys: str) -> str:
        """'key first -> last' for each logged key, each side the mean of the first / last k values logged (k a
        quarter of them, 1 to 5: single steps are noisy), for the line a script prints at the end."""
        parts = []
        for key in keys:
            values = [h[key] for h in self.history if key in h]
            k = max(1, min(5, len(values) // 4))
            mean = f" (mean of first/last {k} steps)" if k > 1 else ""
            if values:
                parts.append(f"{key} {sum(values[:k]) / k:.4f} -> {sum(values[-k:]) / k:.4f}{mean}")
        return ", ".join(parts) or "no step logged"

    def took(self, seconds: float, unit: str = "steps") -> str:
        """The end line's cost and place: '<S> s for <N> steps on <T> torch threads; run dir <path>'. seconds: the
        whole run's training time, a resumed run's earlier part included (Checkpoints.elapsed); the thread count,
        because a CPU run's speed depends on it and so can its figures (a reduction summed
        in another order rounds otherwise, and sampling can then take another token)."""
        threads = torch.get_num_threads()
        on = f"{threads} torch thread{'s' if threads != 1 else ''}"
        return f"{seconds:.0f} s for {self.total} {unit} on {on}; run dir {self.run_dir}"

    def close(self) -> None:
        """The run's clean end: the log closed and the run dir's lock released, its .lock file removed."""
        self.bar.close()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.jsonl is not None:
            self.jsonl.close()
        release_run_dir(self.run_dir)


class Breakers:
    """Circuit breakers: named conditions on a step's metrics that fire once each has held on `patience` steps in a
    row (printed once, on the step it starts to hold). `checks` maps a name to (metric key, test(value) -> bool); a
    missing metric counts as NaN. `state` (a dict the checkpoint keeps) holds the last `patience` steps' metrics, so
    a resumed run continues the streak. `at_once` maps names to (metric key, test) that fire on a single step."""

    def __init__(self, checks: dict, patience: int, state: dict, at_once: dict | None = None, prefix: str = ""):
        self.checks = checks
        self.at_once = at_once or {}
        self.patience = patience
        self.state = state
        self.prefix = prefix
        self.active = set()

    def update(self, step: int, metrics: dict) -> set[str]:
        """The breakers holding after this step (its metrics), each printed once when it starts to hold."""
        recent = (self.state.get("recent", []) + [{"step": step, **metrics}])[-self.patience :]
        self.state["recent"] = recent
        fired = {}
        if len(recent) == self.patience:  # a condition must hold on patience steps in a row
            for name, (key, test) in self.checks.items():
                if all(test(h.get(key, math.nan)) for h in recent):
                    fired[name] = key
        for name, (key, test) in self.at_once.items():
            if test(metrics.get(key, math.nan)):
                fired[name] = key
        for name in sorted(fired.keys() - self.active):
            values = [round(h.get(fired[name], math.nan), 4) for h in recent]
            print(f"{self.prefix}circuit breaker '{name}' fired at step {step}: recent {fired[name]} = {values}")
        self.active = set(fired)
        return self.active

"""Run plumbing: seeding, the run directory, metric logging (TensorBoard + JSONL + progress bar), memory, checkpoints.
Off a terminal (a log file, CI) importing this turns the hub / transformers / datasets loading bars off (their
carriage-return frames fill a log) and the Logger prints one plain line per logged step instead of its bar.

Checkpoints are written atomically (a temp dir renamed into place, a marker file last) and read back without
pickle: weights as safetensors, optimizer/scheduler/RNG through torch.load(weights_only=True), the rest as JSON.
"""

import contextlib
import dataclasses
import json
import math
import os
import pathlib
import random
import re
import resource
import shutil
import signal
import sys
import threading
import time

import torch

from common.model import REF, adapter_hash, is_peft, load_weights, save_weights, snapshot_ref, trainable_parameters

if not sys.stderr.isatty():
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # transformers' and huggingface_hub's bars
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # datasets reads it when first imported

COMPLETE = "checkpoint_complete.json"  # written last: a checkpoint without it was cut short and is never used


@contextlib.contextmanager
def one_line_errors():
    """Wraps a CLI's `main(tyro.cli(Args))`: an error ends the process with one line on stderr and exit status 1
    (a second Ctrl-C: 130), not a traceback. Errors on the user's side (bad data or flags, a missing file or package,
    a file system or the hub out of reach, a stopped run) print their message; any other also names its type and that ONLYONE_DEBUG=1
    shows the traceback (the exception is then re-raised as it is)."""
    from common.data import DataError
    from common.hub import HubUnavailable

    spec = getattr(sys.modules["__main__"], "__spec__", None)  # `python -m evals.gsm8k` -> evals.gsm8k
    prog = spec.name if spec else os.path.basename(sys.argv[0])
    users = (DataError, HubUnavailable, ArgsError, RunStopped, NonFiniteWeightsError, OSError, ImportError)
    try:
        yield
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except Exception as e:
        if os.environ.get("ONLYONE_DEBUG"):
            raise
        hint = "" if isinstance(e, users) else f" ({type(e).__name__}; ONLYONE_DEBUG=1 shows the traceback)"
        print(f"{prog}: error: {e}{hint}".replace("\n", " "), file=sys.stderr)
        raise SystemExit(1) from None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    with contextlib.suppress(ImportError):
        import numpy as np

        np.random.seed(seed)


def make_run_dir(exp_name: str, model: str, seed: int, root: str = "runs") -> str:
    """runs/<exp_name>__<model>__<seed>__<time>, CleanRL's run naming (model path reduced to its last part)."""
    model_tag = re.sub(r"[^A-Za-z0-9._-]+", "-", model.rstrip("/").split("/")[-1])
    path = os.path.join(root, f"{exp_name}__{model_tag}__{seed}__{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(path, exist_ok=False)
    return path


def peak_memory_gb() -> float:
    """Peak CUDA memory allocated by torch, or on CPU the process's peak resident set size (Linux reports KiB)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class Logger:
    """Every logged step goes to TensorBoard, to metrics.jsonl (one JSON object per step) and to a tqdm bar, or off a
    terminal to one stderr line: step/total, the `show` metrics, s/step and ETA (averaged since the Logger started)."""

    def __init__(self, run_dir: str, args, total_steps: int, show: tuple[str, ...] = ("loss",), start_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter
        from tqdm.auto import tqdm

        self.run_dir, self.show = run_dir, show
        with open(os.path.join(run_dir, "args.json"), "w") as f:
            json.dump(dataclasses.asdict(args) if dataclasses.is_dataclass(args) else vars(args), f, indent=2)
        self.writer = SummaryWriter(run_dir)
        self.jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        self.bar = tqdm(total=total_steps, initial=start_step, dynamic_ncols=True, disable=not sys.stderr.isatty())
        self.total, self.start, self.t0 = total_steps, start_step, time.perf_counter()
        self.history: list[dict] = []

    def log(self, step: int, metrics: dict) -> None:
        metrics = {k: float(v) for k, v in metrics.items()}
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.history.append({"step": step, **metrics})
        self.jsonl.write(json.dumps(self.history[-1]) + "\n")
        self.jsonl.flush()  # a crash loses at most the line being written
        self.bar.set_postfix({k: f"{metrics[k]:.4g}" for k in self.show if k in metrics}, refresh=False)
        self.bar.update(step - self.bar.n)
        if self.bar.disable:
            per_step = (time.perf_counter() - self.t0) / max(step - self.start, 1)
            shown = "  ".join(f"{k} {metrics[k]:.4g}" for k in self.show if k in metrics)
            eta = per_step * (self.total - step)
            print(f"step {step}/{self.total}  {shown}  {per_step:.2f} s/step  ETA {eta // 60:.0f}m{eta % 60:02.0f}s",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        self.bar.close()
        self.writer.close()
        self.jsonl.close()


class ArgsError(ValueError):
    """A flag whose value cannot work; raised before any weights load."""


# Flags (when a script has them) that must be >= 1, and >= 0; each message names the flag as the CLI spells it.
_AT_LEAST_ONE = ("per_device_train_batch_size", "gradient_accumulation_steps", "prompts_per_step", "group_size",
                 "groups_per_micro_batch", "num_iterations", "max_completion_length", "prompts_per_round", "num_rounds",
                 "keep_per_prompt", "eval_batch_size", "logging_steps", "lora_r", "max_length", "breaker_patience")
_AT_LEAST_ZERO = ("save_steps", "eval_steps", "warmup_steps", "save_total_limit", "eval_limit", "beta", "rpo_alpha",
                  "weight_decay", "num_train_epochs")


def check_args(args, min_group_size: int = 1) -> None:
    """Refuse values that would crash late or train nonsense (a zero batch, a NaN learning rate, GRPO's G = 1 whose
    advantages are all 0): ArgsError naming the flag, before the model loads. max_steps: -1 = from the epochs."""

    def fail(name, problem):
        raise ArgsError(f"--{name.replace('_', '-')} {getattr(args, name)}: {problem}")

    fields = {f.name for f in dataclasses.fields(args)}
    for name in (n for n in ("learning_rate", "dpo_learning_rate", "max_grad_norm", "temperature") if n in fields):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            fail(name, "must be a finite number > 0")
    for name in (n for n in _AT_LEAST_ONE if n in fields and getattr(args, n) is not None):
        if getattr(args, name) < 1:
            fail(name, "must be at least 1")
    for name in (n for n in _AT_LEAST_ZERO if n in fields):
        if not getattr(args, name) >= 0:  # also refuses NaN
            fail(name, "must be >= 0")
    if "group_size" in fields and args.group_size < min_group_size:
        fail("group_size", f"must be at least {min_group_size} (advantages compare samples within a group)")
    if "max_steps" in fields and args.max_steps < -1:
        fail("max_steps", "must be >= 0 (or -1: from --num-train-epochs)")


def resolve_preset(args, presets: dict[str, dict]):
    """Args with every field left at None taken from a preset: args.preset, or for "auto" "demo" when the model is
    an embedded alias (the offline CPU demo, e.g. smollm2-135m) and the script's other preset for any other model."""
    from common.embedded import MODEL_ALIASES

    name = args.preset
    if name == "auto":
        name = "demo" if args.model in MODEL_ALIASES else next(k for k in presets if k != "demo")
    if name not in presets:
        raise ValueError(f"--preset {name}: choose auto or one of {sorted(presets)}")
    values = {k: v for k, v in presets[name].items() if getattr(args, k) is None}
    return dataclasses.replace(args, preset=name, **values)


def print_config(script: str, args, lines: dict[str, str]) -> None:
    """The resolved configuration a run starts with, one aligned line per topic (the full set is in args.json)."""
    width = max(map(len, lines))
    body = "".join(f"\n  {k.ljust(width)}  {v}" for k, v in lines.items())
    print(f"{script}: preset {args.preset}, model {args.model}{body}", flush=True)


# ---------------------------------------------------------------------------------------------------- checkpoints
def guarded_step(model, optimizer, scheduler, loss: float, max_grad_norm: float) -> tuple[float, bool]:
    """Clip the gradients to max_grad_norm, then one optimizer (and scheduler) step, unless the loss or the gradient
    norm is NaN/Inf: then the gradients are dropped and nothing moves (no Adam moment update, no step count, no LR
    step), so one bad batch cannot poison the weights. Returns (grad_norm, stepped)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable_parameters(model), max_grad_norm).item()
    stepped = math.isfinite(loss) and math.isfinite(grad_norm)
    if stepped:
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, stepped


class RunStopped(RuntimeError):
    """A run stopped before its last step (a circuit breaker, a non-finite guard, Ctrl-C): its checkpoint was saved,
    final/ was not written, and the CLI exits non-zero with this one-line message."""

    def __init__(self, message: str, step: int, checkpoint: str | None, result: dict | None = None):
        super().__init__(message)
        self.step, self.checkpoint, self.result = step, checkpoint, result or {}


def stop_run(script: str, reason: str, run_dir: str, step: int, model, optimizer, scheduler, state, keep: int, result):
    """Save a checkpoint at this step and raise RunStopped with the command that resumes from it."""
    path = save_checkpoint(run_dir, step, model, optimizer, scheduler, state, keep_last=keep)
    raise RunStopped(f"{script}: stopped at step {step} ({reason}); final/ not written. Checkpoint {path}; resume "
                     f"with --resume-from-checkpoint {path}", step, path, result)


class StopOnCtrlC:
    """From creation until restore(): Ctrl-C (SIGINT) sets .requested, so the loop stops at the end of its step with
    a checkpoint and the resume command; a second Ctrl-C aborts at once (KeyboardInterrupt). Python only lets the main
    thread install a handler: elsewhere Ctrl-C keeps its default."""

    def __init__(self):
        self.requested, self.previous = False, None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nCtrl-C: stopping after this step with a checkpoint (Ctrl-C again aborts now)", file=sys.stderr)

    def restore(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


class NonFiniteWeightsError(RuntimeError):
    """Raised instead of saving a model with NaN/Inf weights."""


def check_finite(model, run_dir: str) -> None:
    """Refuse to write a model with a NaN/Inf weight: the error names the tensors and the last good checkpoint."""
    bad = [n for n, p in model.named_parameters() if p.is_floating_point() and not torch.isfinite(p).all()]
    if bad:
        last = (list_checkpoints(run_dir) or ["none"])[-1]
        raise NonFiniteWeightsError(f"{len(bad)} weight tensors hold NaN/Inf (e.g. {bad[0]}); nothing was saved. "
                                    f"Last good checkpoint: {last}")


def save_final(run_dir: str, model, tokenizer, adapters: list[str] | None = None) -> str:
    """run_dir/final: the adapters given (None = all: "default" at the top, "ref" in ref/) or the full model, as
    plain PEFT / transformers loads them, plus the tokenizer; refused when a weight is not finite."""
    check_finite(model, run_dir)
    final_dir = os.path.join(run_dir, "final")
    save_weights(model, final_dir, adapters)
    tokenizer.save_pretrained(final_dir)
    return final_dir


def save_checkpoint(run_dir, step, model, optimizer=None, scheduler=None, trainer_state=None, keep_last=2) -> str:
    """Write run_dir/checkpoints/step-N atomically and keep the newest `keep_last` complete ones.
    Order matters: the new checkpoint is complete and renamed into place before any old one is deleted, so a
    crash at any moment leaves at least the last good checkpoint."""
    root = os.path.join(run_dir, "checkpoints")
    check_finite(model, run_dir)
    os.makedirs(root, exist_ok=True)
    final, tmp = os.path.join(root, f"step-{step}"), os.path.join(root, f".tmp-step-{step}")
    shutil.rmtree(tmp, ignore_errors=True)  # a leftover from a crash during an earlier save of this step
    save_weights(model, os.path.join(tmp, "weights"))
    rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save({"optimizer": optimizer.state_dict() if optimizer else None, "rng": rng,
                "scheduler": scheduler.state_dict() if scheduler else None}, os.path.join(tmp, "state.pt"))
    meta = {"step": step, "trainer_state": trainer_state or {}}
    if is_peft(model) and REF in model.peft_config:
        meta["ref_sha256"] = adapter_hash(model, REF)
    with open(os.path.join(tmp, COMPLETE), "w") as f:
        json.dump(meta, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old)
    return final


def list_checkpoints(run_dir: str) -> list[str]:
    """Complete checkpoints, oldest first; temp dirs and ones without the completion marker are skipped."""
    root = os.path.join(run_dir, "checkpoints")
    names = [n for n in (os.listdir(root) if os.path.isdir(root) else []) if re.fullmatch(r"step-\d+", n)]
    done = [n for n in names if os.path.isfile(os.path.join(root, n, COMPLETE))]
    return [os.path.join(root, n) for n in sorted(done, key=lambda n: int(n[5:]))]


def resolve_checkpoint(path: str) -> str:
    """A checkpoint dir itself, or a run dir whose newest complete checkpoint is used."""
    if os.path.isfile(os.path.join(path, COMPLETE)):
        return path
    if not (found := list_checkpoints(path)):
        raise FileNotFoundError(f"--resume-from-checkpoint {path}: no complete checkpoint there")
    return found[-1]


def load_checkpoint(path, model, optimizer=None, scheduler=None) -> dict:
    """Restore weights, optimizer, scheduler and RNG; verify the 'ref' hash; return (step, trainer_state) as a dict."""
    ckpt = resolve_checkpoint(path)
    meta = json.loads(pathlib.Path(ckpt, COMPLETE).read_text())
    if "ref_sha256" in meta and is_peft(model) and REF not in model.peft_config:
        snapshot_ref(model)  # create the slot; its content is overwritten by the saved 'ref' below
    load_weights(model, os.path.join(ckpt, "weights"))
    if "ref_sha256" in meta and adapter_hash(model, REF) != meta["ref_sha256"]:
        raise RuntimeError(f"{ckpt}: the 'ref' adapter does not match the hash recorded at save time")
    state = torch.load(os.path.join(ckpt, "state.pt"), weights_only=True, map_location="cpu")
    if optimizer is not None and state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    version, internal, gauss = state["rng"]["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["rng"]["torch"])
    if "cuda" in state["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    return {"step": meta["step"], "trainer_state": meta["trainer_state"], "path": ckpt}

"""Run plumbing: seeding, the run directory, metric logging (TensorBoard + JSONL + progress bar), memory, checkpoints.
Off a terminal (a log file, CI) importing this turns the hub / transformers / datasets loading bars off (their
carriage-return frames fill a log) and the Logger prints one plain line per logged step instead of its bar.

Checkpoints are written atomically (a temp dir renamed into place, a marker file last) and read back without
pickle: weights as safetensors, optimizer/scheduler/RNG through torch.load(weights_only=True), the rest as JSON.
The marker records each file's sha256, each adapter's tensor hash and what the checkpoint belongs to (run_identity):
a resume refuses another experiment's checkpoint and skips a damaged one for the previous good one.
"""

import contextlib
import dataclasses
import hashlib
import inspect
import json
import math
import os
import pathlib
import random
import re
import resource
import secrets
import shutil
import signal
import sys
import threading
import time
import warnings

import torch

from common.model import DEFAULT, REF, adapter_hash, base_identity, is_peft, load_weights, save_weights, snapshot_ref
from common.model import trainable_parameters

if not sys.stderr.isatty():
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # transformers' and huggingface_hub's bars
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # datasets reads it when first imported

COMPLETE = "checkpoint_complete.json"  # written last: a checkpoint without it was cut short and is never used


JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"  # Debian/Ubuntu's libjemalloc2


def preload_jemalloc(lib: str = JEMALLOC) -> None:
    """On a Linux machine without CUDA, re-runs this process once with LD_PRELOAD=<jemalloc> when the library exists,
    LD_PRELOAD is unset and ONLYONE_MALLOC is not "system" (the opt-out). glibc's heap keeps GBs resident that a
    step's changing activation shapes freed (dpo.py's peak 9.4 -> 5.9 GB with jemalloc, README "Speed and memory
    against TRL"); the allocator changes where tensors live in memory, never their values."""
    env = os.environ
    if not sys.platform.startswith("linux") or env.get("LD_PRELOAD") or env.get("ONLYONE_MALLOC") == "system":
        return
    if not os.path.exists(lib) or torch.cuda.is_available():  # GPU runs: activations live in CUDA's own allocator
        return
    print(f"using jemalloc (LD_PRELOAD={lib}; ONLYONE_MALLOC=system keeps glibc's malloc)", file=sys.stderr)
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**env, "LD_PRELOAD": lib})


@contextlib.contextmanager
def one_line_errors():
    """Wraps a CLI's `main(tyro.cli(Args))`: an error ends the process with one line on stderr and exit status 1
    (a second Ctrl-C: 130), not a traceback. Errors on the user's side (bad data or flags, a missing file or package,
    a file system or the hub out of reach, a stopped run) print their message; any other also names its type and
    that ONLYONE_DEBUG=1 shows the traceback (the exception is then re-raised as it is). First, on CPU-only Linux:
    preload_jemalloc()."""
    preload_jemalloc()
    from common.data import DataError
    from common.hub import HubUnavailable
    from common.model import ModelError

    spec = getattr(sys.modules["__main__"], "__spec__", None)  # `python -m evals.gsm8k` -> evals.gsm8k
    prog = spec.name if spec else os.path.basename(sys.argv[0])
    users = (
        DataError,
        HubUnavailable,
        ModelError,
        ArgsError,
        OutputDirError,
        ResumeError,
        CorruptCheckpointError,
        RunStopped,
        NonFiniteWeightsError,
        OSError,
        ImportError,
    )
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


class OutputDirError(RuntimeError):
    """The output directory cannot take a run (read-only, full, not a directory)."""


def make_run_dir(exp_name: str, model: str, seed: int, root: str = "runs") -> str:
    """runs/<exp_name>__<model>__<seed>__<time>-<6 hex>, CleanRL's run naming (model path reduced to its last part)
    plus a random tag, so two runs started in the same second never share a directory. Scripts call it before the
    model loads: the directory is created and a probe file written and deleted, so an unwritable --output-dir fails
    in a second, not after minutes of loading."""
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
    return path


def peak_memory_gb() -> float:
    """Peak CUDA memory allocated by torch, or on CPU the process's peak resident set size (Linux reports KiB)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class PhaseTimer:
    """Wall seconds per named phase of one step; a phase marked twice adds up."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.seconds = {}

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.last
        self.last = now

    def metrics(self, tokens: int) -> dict:
        """A step's cost: peak memory so far, tokens per second since the timer started, seconds per phase."""
        return {
            "memory/peak_gb": peak_memory_gb(),
            "perf/tokens_per_s": tokens / (time.perf_counter() - self.start),
            **{f"time/{phase}": seconds for phase, seconds in self.seconds.items()},
        }


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
        self.every, self.history = getattr(args, "logging_steps", 1), []

    def log(self, step: int, metrics: dict) -> None:
        """Log at every --logging-steps-th step and the last (TRL's cadence); other steps are skipped."""
        if step % self.every and step != self.total:
            return
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
            parts += [f"{key} {sum(values[:k]) / k:.4f} -> {sum(values[-k:]) / k:.4f}{mean}"] if values else []
        return ", ".join(parts) or "no step logged"

    def close(self) -> None:
        self.bar.close()
        self.writer.close()
        self.jsonl.close()


class ArgsError(ValueError):
    """A flag whose value cannot work; raised before any weights load."""


# Flags (when a script has them) that must be >= 1, and >= 0; each message names the flag as the CLI spells it.
_AT_LEAST_ONE = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "prompts_per_step",
    "group_size",
    "groups_per_micro_batch",
    "num_iterations",
    "max_completion_length",
    "prompts_per_round",
    "num_rounds",
    "keep_per_prompt",
    "eval_batch_size",
    "generation_batch_size",
    "logging_steps",
    "lora_r",
    "max_length",
    "breaker_patience",
)
_AT_LEAST_ZERO = (
    "save_steps",
    "eval_steps",
    "warmup_steps",
    "save_total_limit",
    "eval_limit",
    "beta",
    "rpo_alpha",
    "weight_decay",
    "num_train_epochs",
    "epsilon",
    "epsilon_high",
    "center_rewards_coefficient",
)


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
    for name in (n for n in _AT_LEAST_ZERO if n in fields and getattr(args, n) is not None):
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


def training_config(args, n_rows: int) -> dict[str, str]:
    """print_config's lines for a supervised script (sft, dpo, orpo, kto): data, steps, optimiser, backend, output."""
    steps = f"{args.max_steps} steps" if args.max_steps >= 0 else f"{args.num_train_epochs:g} epochs"
    lora = f"LoRA r {args.lora_r}" if getattr(args, "use_lora", True) else "full fine-tuning"
    return {
        "data": f"{args.dataset} {args.dataset_split}: {n_rows} rows, max length {args.max_length}",
        "steps": f"{steps} x {args.per_device_train_batch_size} rows x {args.gradient_accumulation_steps} accumulated",
        "optimizer": f"lr {args.learning_rate:g} ({args.lr_scheduler_type}, warmup {args.warmup_steps}), {lora}",
        "backend": f"dtype {args.dtype}, quantization {args.quantization}",
        "output": f"{args.output_dir}/, a checkpoint every {args.save_steps} steps (keep {args.save_total_limit})",
    }


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


def stop_run(script: str, reason: str, run_dir: str, step: int, model, optimizer, scheduler, state, args, result):
    """Save a checkpoint at this step (unless the loop's save of this step just wrote it: saving again would delete it
    before renaming the new one into place) and raise RunStopped with the command that resumes from it."""
    path = os.path.join(run_dir, "checkpoints", f"step-{step}")
    if not (args.save_steps and step % args.save_steps == 0 and os.path.isfile(os.path.join(path, COMPLETE))):
        path = save_checkpoint(run_dir, step, model, optimizer, scheduler, state, args.save_total_limit, args)
    raise RunStopped(
        f"{script}: stopped at step {step} ({reason}); final/ not written. Checkpoint {path}; resume "
        f"with --resume-from-checkpoint {path}",
        step,
        path,
        result,
    )


class StopOnCtrlC:
    """While a loop runs over watch(steps): Ctrl-C (SIGINT) sets .requested, so the loop stops at the end of its step
    with a checkpoint and the resume command; a second Ctrl-C aborts at once (KeyboardInterrupt). However the loop
    ends (its last step, an exception, RunStopped) the previous handler is back: the generator's `finally` runs when
    the loop drops it, so an in-process caller's next Ctrl-C is never swallowed as a stop request. Python only lets
    the main thread install a handler: elsewhere Ctrl-C keeps its default."""

    def __init__(self):
        self.requested = False

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nCtrl-C: stopping after this step with a checkpoint (Ctrl-C again aborts now)", file=sys.stderr)

    def watch(self, steps):
        """Yield each of `steps` with this handler installed; restore the previous one on every way out."""
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, self._handle) if main else None
        try:
            yield from steps
        finally:
            if previous is not None:  # None: a handler not set from Python, which cannot be put back
                signal.signal(signal.SIGINT, previous)


class NonFiniteWeightsError(RuntimeError):
    """Raised instead of saving a model with NaN/Inf weights."""


def check_finite(model, run_dir: str) -> None:
    """Refuse to write a model with a NaN/Inf weight: the error names the tensors and the last good checkpoint."""
    bad = [n for n, p in model.named_parameters() if p.is_floating_point() and not torch.isfinite(p).all()]
    if bad:
        last = (list_checkpoints(run_dir) or ["none"])[-1]
        raise NonFiniteWeightsError(
            f"{len(bad)} weight tensors hold NaN/Inf (e.g. {bad[0]}); nothing was saved. Last good checkpoint: {last}"
        )


def stop_at_end_of_turn(model, tokenizer) -> None:
    """generate() stops only at generation_config's eos ids: put the trained end of turn (the tokenizer's eos, e.g.
    ChatML's <|im_end|> on a base model whose eos is <|endoftext|>) first among them, as TRL's SFTTrainer does."""
    stops = model.generation_config.eos_token_id
    stops = [] if stops is None else [stops] if isinstance(stops, int) else list(stops)
    if tokenizer.eos_token_id not in stops:
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, *stops]


def save_final(run_dir: str, model, tokenizer, adapters: list[str] | None = None) -> str:
    """run_dir/final: the adapters given (None = all: "default" at the top, "ref" in ref/) or the full model, as
    plain PEFT / transformers loads them, plus the tokenizer; refused when a weight is not finite. A full model's
    generation config also stops at the trained end of turn."""
    check_finite(model, run_dir)
    if not is_peft(model):
        stop_at_end_of_turn(model, tokenizer)
    final_dir = os.path.join(run_dir, "final")
    save_weights(model, final_dir, adapters)
    tokenizer.save_pretrained(final_dir)
    return final_dir


# ------------------------------------------------------------------------------------------------ run identity
# Args fields that do not change the math of an update, so a resume may change them: where and how often to write,
# log and evaluate, how far to train, when breakers stop, speed/memory knobs with the same result, and the model
# fields, whose effect is recorded from the model itself (base hash, LoRA config, dtype). Every other field counts.
NON_MATH_ARGS = {
    "exp_name",
    "output_dir",
    "torch_threads",
    "debug",
    "logging_steps",
    "save_steps",
    "save_total_limit",
    "resume_from_checkpoint",
    "resume_from",
    "resume_ignore_mismatch",
    "max_steps",
    "num_train_epochs",
    "num_rounds",
    "model",
    "adapter",
    "use_lora",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "dtype",
    "quantization",
    "attn_implementation",
    "gradient_checkpointing",
    "trust_remote_code",
    "engine",
    "groups_per_micro_batch",
    "plan",
    "ignore_memory_plan",
}
NON_MATH_PREFIXES = ("eval_", "breaker_", "vllm_")


class ResumeError(ValueError):
    """A resume that would not continue this run: another experiment's checkpoint, or no steps left."""


class CorruptCheckpointError(RuntimeError):
    """A checkpoint whose files or tensors do not match the hashes recorded when it was written."""


def run_identity(model, args=None) -> dict:
    """What a checkpoint belongs to, flat and JSON-ready: base model (config hash, weight fingerprint, dtype,
    quantization), LoRA config of "default", and with `args` the script (its file's stem) and every Args field
    that changes the math (all but NON_MATH_ARGS / NON_MATH_PREFIXES)."""
    ident = dict(base_identity(model))
    cfg = model.peft_config.get(DEFAULT) if is_peft(model) else None
    targets = cfg and cfg.target_modules
    ident |= {
        "lora.r": cfg and cfg.r,
        "lora.alpha": cfg and cfg.lora_alpha,
        "lora.dropout": cfg and cfg.lora_dropout,
        "lora.target_modules": targets if isinstance(targets, str | None) else sorted(targets),
    }
    ident |= getattr(model, "reward_identity", {})  # a model reward's adapter and head (common.reward_model)
    if args is not None:
        fields = dataclasses.asdict(args) if dataclasses.is_dataclass(args) else vars(args)
        ident["script"] = pathlib.Path(inspect.getfile(type(args))).stem
        ident |= {
            f"args.{k}": v for k, v in fields.items() if k not in NON_MATH_ARGS and not k.startswith(NON_MATH_PREFIXES)
        }
    return json.loads(json.dumps(ident, default=str))  # tuples -> lists, as they come back from the marker file


def _check_identity(ckpt: str, meta: dict, model, args) -> None:
    """Refuse (or, with args.resume_ignore_mismatch, warn about) every field that differs from the checkpoint's."""
    now, saved = run_identity(model, args), meta.get("identity")
    if saved is None:
        diff = ["identity: not recorded (a checkpoint written before identity checks)"]
    else:
        diff = [
            f"{k}: saved {saved.get(k, '<absent>')!r}, now {now.get(k, '<absent>')!r}"
            for k in sorted(saved.keys() | now.keys())
            if saved.get(k, "<absent>") != now.get(k, "<absent>")
        ]
    if diff and not getattr(args, "resume_ignore_mismatch", False):
        raise ResumeError(
            f"{ckpt} belongs to another experiment: {'; '.join(diff)} (--resume-ignore-mismatch resumes anyway)"
        )
    if diff:
        warnings.warn(f"--resume-ignore-mismatch: resuming {ckpt} although {'; '.join(diff)}", stacklevel=2)


def check_run_identity(run_dir: str, model, args) -> None:
    """For runs resumed in place (raft.py's rounds): the first start writes run_dir/identity.json; a later start in
    the same run dir must match it, as a checkpoint must (run dirs from before this file are not checked)."""
    path = pathlib.Path(run_dir, "identity.json")
    if path.exists():
        _check_identity(run_dir, {"identity": json.loads(path.read_text())}, model, args)
    else:
        path.write_text(json.dumps(run_identity(model, args), indent=2))


def _file_hashes(root: str) -> dict[str, str]:
    """sha256 of every file under root but the marker, keyed by relative path."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if name != COMPLETE:
                with open(path, "rb") as f:
                    out[os.path.relpath(path, root)] = hashlib.file_digest(f, "sha256").hexdigest()
    return dict(sorted(out.items()))


def _read_verified_meta(ckpt: str) -> dict:
    """The marker's JSON, after every file it lists was re-hashed (a truncated or flipped file is caught here)."""
    try:
        meta = json.loads(pathlib.Path(ckpt, COMPLETE).read_text())
        found = _file_hashes(ckpt)
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{ckpt}: unreadable ({e})") from None
    for rel, digest in meta.get("files_sha256", {}).items():
        if found.get(rel) != digest:
            raise CorruptCheckpointError(f"{ckpt}: {rel} is missing or does not match the hash recorded at save time")
    return meta


def save_checkpoint(
    run_dir, step, model, optimizer=None, scheduler=None, trainer_state=None, keep_last=2, args=None
) -> str:
    """Write run_dir/checkpoints/step-N atomically and keep the newest `keep_last` complete ones; the marker records
    run_identity(model, args), each file's sha256 and each adapter's tensor hash. Tensors in trainer_state (e.g.
    rm.py's head) go into state.pt, whose sha256 the marker holds; the rest is JSON in the marker.
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
    trainer_state = trainer_state or {}
    tensors = {k: v.detach().cpu() for k, v in trainer_state.items() if torch.is_tensor(v)}
    torch.save(
        {
            "optimizer": optimizer.state_dict() if optimizer else None,
            "rng": rng,
            "scheduler": scheduler.state_dict() if scheduler else None,
            "tensors": tensors,
        },
        os.path.join(tmp, "state.pt"),
    )
    meta = {
        "step": step,
        "trainer_state": {k: v for k, v in trainer_state.items() if k not in tensors},
        "identity": run_identity(model, args),
        "files_sha256": _file_hashes(tmp),
    }
    if is_peft(model):
        meta["adapter_sha256"] = {slot: adapter_hash(model, slot) for slot in model.peft_config}
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


def load_checkpoint(path, model, optimizer=None, scheduler=None, args=None, total_steps=None) -> dict:
    """Restore weights, optimizer, scheduler and RNG; return {step, trainer_state, path}.
    `path` is a checkpoint dir, or a run dir: then its newest checkpoint whose files and adapter tensors match their
    recorded hashes is used (a damaged one is skipped with a warning). With `args`, a checkpoint of another experiment
    (run_identity differs) is refused; with `total_steps`, so is one with no steps left. `path` None (no
    --resume-from-checkpoint): a new run, step 0."""
    if path is None:
        return {"step": 0, "trainer_state": {}, "path": None}
    explicit = os.path.isfile(os.path.join(path, COMPLETE))
    candidates = [path] if explicit else list_checkpoints(path)[::-1]
    if not candidates:
        raise FileNotFoundError(f"--resume-from-checkpoint {path}: no complete checkpoint there")
    failures = []
    for ckpt in candidates:
        try:
            meta = _read_verified_meta(ckpt)
            if args is not None:
                _check_identity(ckpt, meta, model, args)
            if total_steps is not None and meta["step"] >= total_steps:
                raise ResumeError(
                    f"{ckpt} is at step {meta['step']}, at or past this run's {total_steps} steps: "
                    "nothing to train (raise --max-steps to continue)"
                )
            _load_verified_weights(ckpt, meta, model)
        except CorruptCheckpointError as e:
            failures.append(str(e))
            if ckpt != candidates[-1]:
                warnings.warn(f"{e}; falling back to the previous checkpoint", stacklevel=2)
            continue
        break
    else:
        hint = "" if not explicit else " (pass the run dir to fall back to an earlier checkpoint)"
        raise CorruptCheckpointError(f"no intact checkpoint to resume from{hint}: {'; '.join(failures)}")
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
    return {"step": meta["step"], "trainer_state": meta["trainer_state"] | state.get("tensors", {}), "path": ckpt}


def _load_verified_weights(ckpt: str, meta: dict, model) -> None:
    """Both LoRA slots (or the full model) from the checkpoint, then each adapter checked against its saved hash."""
    hashes = meta.get("adapter_sha256") or ({REF: meta["ref_sha256"]} if "ref_sha256" in meta else {})
    if REF in hashes and is_peft(model) and REF not in model.peft_config:
        snapshot_ref(model)  # create the slot; its content is overwritten by the saved 'ref' below
    load_weights(model, os.path.join(ckpt, "weights"))
    for slot, digest in hashes.items():
        if adapter_hash(model, slot) != digest:
            raise CorruptCheckpointError(f"{ckpt}: the '{slot}' adapter does not match the hash recorded at save time")

"""Run plumbing: seeding, the run directory, metric logging (TensorBoard + JSONL + progress bar), memory, checkpoints.

Checkpoints are written atomically (a temp dir renamed into place, a marker file last) and read back without
pickle: weights as safetensors, optimizer/scheduler/RNG through torch.load(weights_only=True), the rest as JSON.
"""

import contextlib
import dataclasses
import json
import os
import pathlib
import random
import re
import resource
import shutil
import sys
import time

import torch

from common.model import adapter_hash, is_peft, load_weights, save_weights, snapshot_ref, REF

COMPLETE = "checkpoint_complete.json"  # written last: a checkpoint without it was cut short and is never used


@contextlib.contextmanager
def one_line_errors():
    """Wraps a script's `main(tyro.cli(Args))`: a problem on the user's side (bad data, a missing file, the hub out of
    reach with nothing cached) ends the run with one line on stderr and exit status 1, not a traceback; any other
    exception keeps its traceback (it is ours to fix)."""
    from common.data import DataError
    from common.hub import HubUnavailable

    try:
        yield
    except (DataError, HubUnavailable, FileNotFoundError) as e:
        print(f"{os.path.basename(sys.argv[0])}: error: {e}", file=sys.stderr)
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
    """Every logged step goes to TensorBoard, to metrics.jsonl (one JSON object per step) and to a tqdm bar."""

    def __init__(self, run_dir: str, args, total_steps: int, show: tuple[str, ...] = ("loss",), start_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter
        from tqdm.auto import tqdm

        self.run_dir, self.show = run_dir, show
        with open(os.path.join(run_dir, "args.json"), "w") as f:
            json.dump(dataclasses.asdict(args) if dataclasses.is_dataclass(args) else vars(args), f, indent=2)
        self.writer = SummaryWriter(run_dir)
        self.jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a")
        self.bar = tqdm(total=total_steps, initial=start_step, dynamic_ncols=True, disable=not sys.stderr.isatty())
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

    def close(self) -> None:
        self.bar.close()
        self.writer.close()
        self.jsonl.close()


# ---------------------------------------------------------------------------------------------------- checkpoints
def save_checkpoint(run_dir, step, model, optimizer=None, scheduler=None, trainer_state=None, keep_last=2) -> str:
    """Write run_dir/checkpoints/step-N atomically and keep the newest `keep_last` complete ones.
    Order matters: the new checkpoint is complete and renamed into place before any old one is deleted, so a
    crash at any moment leaves at least the last good checkpoint."""
    root = os.path.join(run_dir, "checkpoints")
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

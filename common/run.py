"""Run plumbing: seeding, the run directory, metric logging (TensorBoard + JSONL + progress bar), memory, checkpoints.

Checkpoints are written atomically (a temp dir renamed into place, a marker file last) and read back without
pickle: weights as safetensors, optimizer/scheduler/RNG through torch.load(weights_only=True), the rest as JSON.
"""

import dataclasses
import json
import os
import random
import re
import resource
import shutil
import sys
import time

import torch

from common.model import adapter_hash, is_peft, load_weights, save_weights, REF

COMPLETE = "checkpoint_complete.json"  # written last: a checkpoint without it was cut short and is never used


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


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
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()  # a crash loses at most the line being written
        self.history.append({"step": step, **metrics})
        self.bar.set_postfix({k: f"{metrics[k]:.4g}" for k in self.show if k in metrics}, refresh=False)
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        self.bar.close()
        self.writer.close()
        self.jsonl.close()


# ---------------------------------------------------------------------------------------------------- checkpoints
def _rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir, step, model, optimizer=None, scheduler=None, trainer_state=None, keep_last=2) -> str:
    """Write run_dir/checkpoints/step-N atomically and keep the newest `keep_last` complete ones.

    Order matters: the new checkpoint is complete and renamed into place before any old one is deleted, so a
    crash at any moment leaves at least the last good checkpoint.
    """
    root = os.path.join(run_dir, "checkpoints")
    os.makedirs(root, exist_ok=True)
    final, tmp = os.path.join(root, f"step-{step}"), os.path.join(root, f".tmp-step-{step}")
    shutil.rmtree(tmp, ignore_errors=True)  # a leftover from a crash during an earlier save of this step
    save_weights(model, os.path.join(tmp, "weights"))
    torch.save(
        {
            "optimizer": optimizer.state_dict() if optimizer else None,
            "scheduler": scheduler.state_dict() if scheduler else None,
            "rng": _rng_state(),
        },
        os.path.join(tmp, "state.pt"),
    )
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
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = re.fullmatch(r"step-(\d+)", name)
        if m and os.path.isfile(os.path.join(root, name, COMPLETE)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return [path for _, path in sorted(found)]


def resolve_checkpoint(path: str) -> str:
    """A checkpoint dir itself, or a run dir whose newest complete checkpoint is used."""
    if os.path.isfile(os.path.join(path, COMPLETE)):
        return path
    found = list_checkpoints(path)
    if not found:
        raise FileNotFoundError(f"--resume-from-checkpoint {path}: no complete checkpoint there")
    return found[-1]


def load_checkpoint(path, model, optimizer=None, scheduler=None) -> dict:
    """Restore weights, optimizer, scheduler and RNG; verify the 'ref' hash; return (step, trainer_state) as a dict."""
    ckpt = resolve_checkpoint(path)
    with open(os.path.join(ckpt, COMPLETE)) as f:
        meta = json.load(f)
    if "ref_sha256" in meta and is_peft(model) and REF not in model.peft_config:
        from common.model import snapshot_ref

        snapshot_ref(model)  # create the slot; its content is overwritten by the saved 'ref' below
    load_weights(model, os.path.join(ckpt, "weights"))
    if "ref_sha256" in meta and adapter_hash(model, REF) != meta["ref_sha256"]:
        raise RuntimeError(f"{ckpt}: the 'ref' adapter does not match the hash recorded at save time")
    state = torch.load(os.path.join(ckpt, "state.pt"), weights_only=True, map_location="cpu")
    if optimizer is not None and state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"])
    return {"step": meta["step"], "trainer_state": meta["trainer_state"], "path": ckpt}

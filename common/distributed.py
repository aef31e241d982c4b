"""Data parallelism under torchrun, as nanoGPT's train.py does it: a script that finds torchrun's environment joins
the process group and trains its slice of every global batch (TRL's: per-device batch x ranks x accumulation); without
it every function here is the one-process identity (rank 0 of 1). Each rank's loss carries the whole step's
normaliser times N and the gradients are averaged over the ranks (average_gradients, or FSDP2's reduce-scatter): the
one-process gradient up to the sum's rounding. Logged metrics are reduced over the ranks before anything is decided
from them, so every rank takes the same decision at the same step (docs/distributed.md).
"""

import contextlib
import datetime
import hashlib
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

_OURS: list[bool] = []  # [True] while the process group is the one init_distributed set up


def init_distributed(timeout_s: float) -> tuple[int, int]:
    """(rank, world size). Under torchrun: join the process group (NCCL on this node's LOCAL_RANK card, gloo on a CPU),
    every collective bounded by timeout_s (a dead rank makes the others fail, not hang); ranks other than 0 print
    nothing on stdout (rank 0 speaks for the run; errors still reach stderr). Alone: (0, 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or dist.is_initialized():
        return rank_and_world()
    backend = "gloo"
    if torch.cuda.is_available():
        backend = "nccl"
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    _OURS.append(True)
    if dist.get_rank() != 0:
        sys.stdout = open(os.devnull, "w")  # open for the life of the process
    return rank_and_world()


def rank_and_world() -> tuple[int, int]:
    """(this process's rank, the number of ranks): (0, 1) without a process group."""
    if not dist.is_initialized():  # (a group of one: vLLM's in-process engine sets up its own)
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def all_sum(values: list[float]) -> list[float]:
    """Each value summed over the ranks (float64, so token counts and sums of losses add exactly)."""
    if rank_and_world()[1] == 1:
        return list(values)
    nccl = dist.get_backend() == "nccl"  # NCCL reduces on this rank's card only, gloo on the CPU
    t = torch.tensor(values, dtype=torch.float64, device=torch.cuda.current_device() if nccl else "cpu")
    dist.all_reduce(t)
    return t.tolist()


def any_rank(flag: bool) -> bool:
    """True on every rank when it is true on any (a Ctrl-C one rank saw first stops all of them at one step)."""
    return all_sum([float(flag)])[0] > 0


def all_gather(items: list) -> list:
    """Every rank's list, concatenated in rank order: what one process would have held (rewards, eval rows)."""
    if rank_and_world()[1] == 1:
        return list(items)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, items)
    return [item for part in gathered for item in part]


@contextlib.contextmanager
def keyed_stream(*key):
    """For the block, torch's random stream (the CPU's, and this process's card's once CUDA is in use) seeded from the
    key alone; the stream is as it was after. A training pass keyed to (seed, its global micro-batch, ...) draws the
    dropout masks one process draws for those rows, on whichever rank it runs, and leaves the sampling stream alone."""
    seed = int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little")  # not hash(): salted per process
    cuda = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda):  # host-side state only: no device sync
        torch.random.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.manual_seed(seed)
        yield


def average_gradients(params: list[torch.nn.Parameter]) -> None:
    """Average the trainable gradients over the ranks, in one flat all-reduce after the step's backward passes: DDP's
    math, written out because our log-prob path calls the decoder and the head directly and never the wrapped
    module's forward, which DDP needs to see. A no-op alone, and under FSDP2 (it reduce-scatters in backward)."""
    _, world = rank_and_world()
    if world == 1 or any(isinstance(p, DTensor) for p in params):
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat)
    flat /= world
    for p, g, part in zip(params, grads, flat.split([g.numel() for g in grads])):
        p.grad = part.view_as(g).to(g.dtype)


def shard_model(model) -> torch.nn.Module:
    """FSDP2 for a full fine-tune: `fully_shard` on each decoder layer and then on the whole model, so each rank holds
    1/N of the weights, gradients and AdamW states, and a layer's full weights exist only while it runs."""
    for layer in model.get_decoder().layers:
        fully_shard(layer)
    fully_shard(model)
    # FSDP2 makes the unit its first forward enters the root, and a rollout enters the decoder's layers directly:
    # one token through the whole model first
    device = next(model.parameters()).device
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
    reshard(model)
    return model


def is_sharded(model) -> bool:
    """Whether FSDP2 holds this model's weights as shards (DTensors)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def reshard(model) -> None:
    """Every FSDP2 unit of the model back to its shards (the root keeps its gathered weights after a forward until
    its backward, or for good after a no-grad forward)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@contextlib.contextmanager
def gathered(model):
    """For the block (a rollout, which calls the decoder's modules step by step), every FSDP2 unit's full weights on
    every rank, as TRL's generation under FSDP, not resharded after each forward; sharded again after."""
    if not is_sharded(model):
        yield model
        return
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    try:
        for unit in units:
            if unit is not model:  # the root never reshards after its forward
                unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()
        yield model
    finally:
        for unit in units:
            if unit is not model:
                unit.set_reshard_after_forward(True, recurse=False)
        reshard(model)


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (DTensor) parameter, a view of the storage FSDP2 gathers from; a plain tensor
    as it is."""
    return p.to_local() if isinstance(p, DTensor) else p


def close_distributed() -> None:
    """Leave the process group init_distributed joined (torchrun's ranks end together; a later run in the same process
    starts clean); a group someone else set up (vLLM's in-process engine) is theirs to close."""
    if _OURS and dist.is_initialized():
        dist.destroy_process_group()
        _OURS.clear()

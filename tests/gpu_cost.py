"""What a GPU would pay for, counted on a CPU (issue #49's guards): aten ops, the host's reads of values that live on
the device (a sync on CUDA: the host waits for every kernel queued before it), and attention calls with a (shape,
stride, dtype) never seen before in the process (on sm90 cuDNN builds an execution plan on the host for each; other
backends do not, but a shape that recurs is what keeps any per-shape cost paid once).

On a CPU every tensor is on the host, so the device is tracked: a tensor is on it when it came through Tensor.to /
.cuda (the model's weights, a batch moved to the device), or when an op had any input on it (a model's outputs, a
loss, a logged sum). A read is: a value of such a tensor taken on the host (aten._local_scalar_dense: .item(), bool(),
int(), float()); an op on one whose output size depends on its values (nonzero, masked_select, unique, a bool-mask
index, repeat_interleave with a tensor of repeats and no output_size); and Tensor.tolist / .numpy / .cpu of one (they
dispatch no aten op on a CPU tensor). What the host builds from its own data (collated rows, a sampler's permutation)
is not on the device and reading it is free, as on a GPU. Not seen: a copy of a pageable host tensor to the device
with non_blocking=False also waits on CUDA (the code's own copies are non_blocking), and .to("cpu") of a device
tensor; bench/gpu_check.sh counts the real syncs on a card (torch.cuda.set_sync_debug_mode)."""

import contextlib
import weakref

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim"}


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else []
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or [])


class Counts(TorchDispatchMode):
    """ops, syncs (with the op names, `sync_names`), attention calls and the new ones among them, while active."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.syncs = 0
        self.sync_names = []
        self.attention = 0
        self.new_attention = 0
        self.attention_keys = []
        self.device = {}  # id -> weak reference: what lives on the device

    def on_device(self, t) -> bool:
        ref = self.device.get(id(t)) if isinstance(t, torch.Tensor) else None
        return ref is not None and ref() is t

    def move(self, t):
        if isinstance(t, torch.Tensor) and not self.on_device(t):
            key = id(t)

            def forget(ref):
                if self.device.get(key) is ref:
                    del self.device[key]

            self.device[key] = weakref.ref(t, forget)
        return t

    def sync(self, name: str) -> None:
        self.syncs += 1
        self.sync_names.append(name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.ops += 1
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        hot = any(self.on_device(t) for t in inputs)
        if hot and (name in SYNC_OPS or (name == "index" and _bool_index(args))):
            self.sync(name)
        if hot and name == "repeat_interleave" and kwargs.get("output_size") is None:
            if len(args) == 1 or isinstance(args[1], torch.Tensor):
                self.sync(name)
        out = func(*args, **kwargs)
        if hot:
            for t in tree_flatten(out)[0]:
                self.move(t)
                if isinstance(t, torch.Tensor) and t._base is not None:  # written through a view: its base too
                    self.move(t._base)
        return out


def _key(t):
    if not isinstance(t, torch.Tensor):
        return t
    return (tuple(t.shape), tuple(t.stride()), str(t.dtype))


@contextlib.contextmanager
def counting(seen: set | None = None, device=()):
    """Yields a Counts that counts everything run in the block (the attention through F.scaled_dot_product_attention,
    which transformers' sdpa layers and common.rollout.decoder_step call). seen: the attention keys a process has
    met so far (a plan once built is reused for the process's lifetime), updated here; None: a new set. device:
    modules or tensors already on the device (a model loaded before the block)."""
    counts = Counts()
    seen = set() if seen is None else seen
    for thing in device:
        for t in thing.parameters() if isinstance(thing, torch.nn.Module) else [thing]:
            counts.move(t)
    sdpa = F.scaled_dot_product_attention
    patched = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "cpu", "to", "cuda")}

    def attention(*args, **kwargs):
        key = tuple(_key(a) for a in args[:4]) + tuple(sorted((k, _key(v)) for k, v in kwargs.items()))
        counts.attention += 1
        counts.attention_keys.append(key)
        if key not in seen:
            seen.add(key)
            counts.new_attention += 1
        return sdpa(*args, **kwargs)

    def read(name):
        def method(self, *args, **kwargs):
            if counts.on_device(self):
                counts.sync(name)
            return patched[name](self, *args, **kwargs)

        return method

    def moved(name):
        def method(self, *args, **kwargs):
            out = patched[name](self, *args, **kwargs)
            to_device = name == "cuda" or "device" in kwargs
            to_device = to_device or any(isinstance(a, (str, torch.device)) for a in args)
            return counts.move(out) if to_device or counts.on_device(self) else out

        return method

    F.scaled_dot_product_attention = attention
    for name in ("tolist", "numpy", "cpu"):
        setattr(torch.Tensor, name, read(name))
    for name in ("to", "cuda"):
        setattr(torch.Tensor, name, moved(name))
    try:
        with counts:
            yield counts
    finally:
        F.scaled_dot_product_attention = sdpa
        for name, method in patched.items():
            setattr(torch.Tensor, name, method)

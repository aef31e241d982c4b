"""Rollouts: G sampled completions for each prompt from the live policy, with TRL's sampling semantics only.

`hf_generate` (and the vLLM engine, plugins.vllm_engine) take tokenized prompts and return the same dict,
prompt-major (the G completions of prompt i are rows i*G .. i*G+G-1, so each group is contiguous):
  prompt_ids      B*G lists (each prompt repeated G times)
  completion_ids  B*G lists, each ending at (and including) its first EOS; anything sampled after it is dropped
  completions     B*G decoded texts (special tokens skipped)
  truncated       B*G bools: no EOS within max_new_tokens
  logprobs        B*G lists of the sampled tokens' log-probs under the sampling distribution, or None
`hf_generate` samples from the live policy (the adapter is attached: no weight sync; logprobs is None, the trainer
recomputes them). Sampling: temperature (0 = greedy), top_p (1 = off), top_k (0 = off, TRL's default); no repetition
penalty, min_p or any other processor, whatever the model's generation_config.json says.
"""

import torch
from transformers import GenerationConfig

from common.data import pad_batch
from common.errors import ArgsError
from common.model import cache_kwarg, prompt_cache, unwrap


def eos_ids(model, tokenizer) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS plus the model's generation_config EOS ids (as TRL)."""
    ids = getattr(getattr(unwrap(model), "generation_config", None), "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    return list(dict.fromkeys([tokenizer.eos_token_id, *ids]))


def cut_at_eos(ids: list[int], eos: list[int]) -> tuple[list[int], bool]:
    """(ids through the first EOS, truncated=False), or (ids, True) when no EOS was sampled."""
    for i, token in enumerate(ids):
        if token in eos:
            return ids[: i + 1], False
    return ids, True


def check_sampling(top_p: float, top_k: int) -> None:
    """Refuse what the two engines would read differently: top_p = 0 (HF: silently greedy; vLLM: an error), top_k < 0
    (vLLM: -1 = off; HF: an error), NaN; the message names the flag."""
    if not 0 < top_p <= 1:
        raise ArgsError(f"--top-p {top_p}: must be in (0, 1] (1 = off)")
    if not top_k >= 0:
        raise ArgsError(f"--top-k {top_k}: must be >= 0 (0 = off)")


def _result(prompt_ids, completion_ids, eos, tokenizer, logprobs=None) -> dict:
    cut = [cut_at_eos(list(c), eos) for c in completion_ids]
    ids = [c for c, _ in cut]
    return {
        "prompt_ids": [list(p) for p in prompt_ids],
        "completion_ids": ids,
        "completions": tokenizer.batch_decode(ids, skip_special_tokens=True),
        "truncated": [t for _, t in cut],
        "logprobs": None if logprobs is None else [lp[: len(c)] for lp, c in zip(logprobs, ids)],
    }


@torch.no_grad()
def hf_generate(
    model,
    tokenizer,
    prompts: list[list[int]],
    group_size: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_new_tokens: int = 256,
) -> dict:
    """Sample group_size completions per prompt with `model.generate` (left padding, KV cache, eval, no_grad)."""
    check_sampling(top_p, top_k)
    lm = unwrap(model)
    eos = eos_ids(model, tokenizer)
    rows = [p for p in prompts for _ in range(group_size)]  # repeat, not num_return_sequences: greedy allows it too
    device = next(model.parameters()).device
    # Left padding: every row's last prompt token sits in the last column, so new tokens are appended in lockstep;
    # generate derives position_ids from the attention mask, so padded rows see the positions of unpadded ones.
    input_ids = pad_batch(rows, tokenizer.pad_token_id, side="left").to(device)
    attention_mask = pad_batch([[1] * len(r) for r in rows], 0, side="left").to(device)
    # top_k is passed even when 0: an unset field falls back to transformers' global default top_k=50.
    greedy = dict(do_sample=False)
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k) if temperature > 0 else greedy
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        use_cache=True,  # the KV cache, even with gradient checkpointing on
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        return_dict_in_generate=True,
        **sampling,
    )
    # generate() fills every field we leave unset from model.generation_config (a checkpoint's repetition_penalty,
    # min_p, suppress_tokens, ...), so for this call the model's own config is replaced by ours.
    saved = lm.generation_config
    was_training = model.training
    try:
        lm.generation_config = config
        model.eval()  # dropout off while sampling; HF also only checkpoints activations in train mode
        # The G rows of a prompt share it: prefill each distinct prompt once (all but its last token, backbone only:
        # no logits) and repeat that KV cache G times, so prefill costs B prompts, not B*G rows. generate() then runs
        # the last prompt token and the new ones. Same left padding and positions as the unshared rows.
        # (Not for models with recurrent states, whose cache cannot be repeated: prompt_cache gives None.)
        cache = prompt_cache(lm) if group_size > 1 and min(len(p) for p in prompts) > 1 else None
        if cache is not None:
            prefix, prefix_mask = input_ids[::group_size, :-1], attention_mask[::group_size, :-1]
            lm.get_decoder()(
                input_ids=prefix,
                attention_mask=prefix_mask,
                use_cache=True,
                position_ids=(prefix_mask.cumsum(-1) - 1).clamp(min=0),
                **{cache_kwarg(lm): cache},
            )
            cache.batch_repeat_interleave(group_size)
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=config,
            **({cache_kwarg(lm): cache} if cache is not None else {}),
        )
    finally:
        lm.generation_config = saved
        model.train(was_training)
    new = out.sequences[:, input_ids.shape[1] :]  # (B*G, T_new); rows that stopped early are padded
    return _result(rows, new.tolist(), eos, tokenizer)

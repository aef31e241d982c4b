"""Rollouts: G sampled completions for each prompt from the live policy, with TRL's sampling semantics only.

`hf_generate` (and the vLLM engine, plugins.vllm_engine) take tokenized prompts and return the same dict,
prompt-major (the G completions of prompt i are rows i*G .. i*G+G-1, so each group is contiguous):
  prompt_ids      B*G lists (each prompt repeated G times)
  completion_ids  B*G lists, each ending at (and including) its first EOS; anything sampled after it is dropped
  completions     B*G decoded texts (special tokens skipped)
  truncated       B*G bools: no EOS within max_new_tokens
  logprobs        B*G lists of the sampled tokens' log-probs under the sampling distribution, or None
`hf_generate` samples from the live policy (the adapter is attached: no weight sync) with its own decode loop
(`decode`): each distinct prompt prefilled once, a KV cache preallocated at prompt + max_new_tokens and written in
place, finished rows dropped from the batch, each one-token step of a Llama, Mistral, Qwen2 or Qwen3 model through
`decoder_step` (that forward written out over the model's own modules); on a CPU every float32 Linear runs on a
oneDNN-packed copy of its weight with the LoRA update merged in (`packed_linears`), for the rollout only. Sampling:
temperature (0 = greedy), top_p (1 = off), top_k (0 = off, TRL's default), applied as transformers' warpers apply
them; no repetition penalty, min_p or any other processor, whatever the model's generation_config.json says.
logprobs are the sampled tokens' log-probs under the processed distribution (greedy: under the plain policy).

Random stream: when sampling (temperature > 0), decode step k (k = 0 .. the longest completion's length - 1) draws
exactly one `torch.rand(B*G, dtype=float64)` from the device's default generator, for every row whether it has ended
or not, and row r takes the token at which the cumulative probability first exceeds u_r * total (inverse CDF). A
rollout therefore consumes B*G x (longest completion) uniforms, whatever rows were dropped on the way, and resumes
from a checkpoint's RNG state exactly; greedy consumes none. (model.generate draws one torch.multinomial per live step
instead: same distribution, another stream.) Models that `decode` refuses (`decodes_exactly`: a cache holding more
than keys and values, a rotary embedding not in STATIC_ROPE) are sampled by `model.generate`, as before.
"""

import contextlib
import functools
import platform

import torch
import torch.nn.functional as F
from peft.tuners.lora import Linear as LoraLinear
from transformers import GenerationConfig
from transformers.cache_utils import Cache, DynamicLayer, StaticCache

from common.data import pad_batch
from common.distributed import all_max
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


class SlabLayer(DynamicLayer):
    """One layer's KV cache, allocated at its final length on the first write and written in place (no torch.cat per
    token); attention reads the filled part, a view. Rows can be dropped (batch_select_indices)."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states, value_states) -> None:
        batch, heads, _, _ = key_states.shape
        self.slab_keys = key_states.new_zeros(batch, heads, self.capacity, key_states.shape[-1])
        self.slab_values = value_states.new_zeros(batch, heads, self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def _slabs(self, keys, values) -> None:
        self.slab_keys = keys
        self.slab_values = values
        self.keys = keys[:, :, : self.length]
        self.values = values[:, :, : self.length]

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        self.slab_keys[:, :, self.length : end] = key_states
        self.slab_values[:, :, self.length : end] = value_states
        self.length = end
        self._slabs(self.slab_keys, self.slab_values)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._slabs(self.slab_keys.repeat_interleave(repeats, 0), self.slab_values.repeat_interleave(repeats, 0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._slabs(self.slab_keys[indices], self.slab_values[indices])


def warp_scores(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """The float32 scores sampled from, as transformers' warpers build them, in their order and each only when on
    (min_tokens_to_keep 1): logits / T; -inf below the k-th largest; -inf on the least probable tokens whose
    cumulative probability stays <= 1 - top_p (the most probable one always kept)."""
    scores = logits.float()
    if temperature != 1.0:
        scores = scores / temperature
    if top_k:
        kth = torch.topk(scores, min(top_k, scores.shape[-1]))[0][..., -1, None]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        drop = sorted_scores.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
        drop[..., -1:] = False
        scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return scores


def sample_tokens(logits, uniforms, temperature: float, top_p: float, top_k: int):
    """(tokens, logprobs) of one step's (n, V) logits. Greedy (temperature 0): generate's argmax of the float32
    logits, with its log-prob under the policy. Sampling: the first token whose cumulative probability under
    softmax(warp_scores) exceeds u * total, one float64 uniform u in [0, 1) per row (a token of probability 0 is
    never taken), with its log-prob under that processed distribution."""
    if temperature == 0:
        logps = logits.float().log_softmax(dim=-1)
        tokens = logps.argmax(dim=-1)
        return tokens, logps.gather(1, tokens[:, None])[:, 0]
    scores = warp_scores(logits, temperature, top_p, top_k)
    cdf = scores.softmax(dim=-1).double().cumsum(dim=-1)
    total = cdf[:, -1:]
    # u * total may round up to total itself: the largest double below it keeps the search inside the support
    target = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, target, right=True)[:, 0]
    return tokens, scores.log_softmax(dim=-1).gather(1, tokens[:, None])[:, 0]


def _last_logits(lm, cache, input_ids, position_ids, attention_mask):
    """The float32 next-token logits (n, V) of one forward feeding input_ids after what the cache holds."""
    kwargs = {cache_kwarg(lm): cache}
    out = lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=1, **kwargs)
    return out.logits[:, -1].float()


# transformers' model types whose decoder layer is exactly what decoder_step writes out
DECODER_STEP_MODELS = ("llama", "mistral", "qwen2", "qwen3")
# rope types whose frequencies are fixed at init: cos/sin depend on the position alone, not on the calls before
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def decodes_exactly(config) -> bool:
    """decode's rule on the config: every rope_type of its text config's rope_parameters (one, or one per layer
    type; none: no rotary embedding) is in STATIC_ROPE. "dynamic" and "longrope" rescale with the longest position
    of each call, so a prompt prefilled in two calls, or rows leaving the batch, change what the model computes."""
    rope = getattr(config.get_text_config(), "rope_parameters", None) or {}
    ropes = [rope] if "rope_type" in rope else [r for r in rope.values() if isinstance(r, dict)]
    return all(r.get("rope_type", "default") in STATIC_ROPE for r in ropes)


def decoder_step(lm, cache, input_ids, position_ids, attention_mask):
    """_last_logits for one new token per row (input_ids (n, 1)) after a SlabLayer cache, for the model types in
    DECODER_STEP_MODELS with no sliding_window (None: Mistral's forward windows every layer when it is set, whatever
    layer_types says); any other config runs _last_logits, the model's own forward. Their forward written out,
    calling each of their modules (embedding, rotary embedding, norms, projections, MLP, head) as their forward does,
    without what the model's forward adds around a one-token step: the mask built per call, the attention interface's
    keyword plumbing, output objects. The attention is the same grouped-query attention over the filled part of the
    slab: a row's one query per head, the G query heads that share a key/value head taken together as G queries of
    that head (transformers' repeat_kv order), the padded positions masked out."""
    if lm.config.model_type not in DECODER_STEP_MODELS or getattr(lm.config, "sliding_window", None) is not None:
        return _last_logits(lm, cache, input_ids, position_ids, attention_mask)
    backbone = lm.get_decoder()
    n = input_ids.shape[0]
    hidden = backbone.embed_tokens(input_ids)  # (n, 1, H)
    cos, sin = backbone.rotary_emb(hidden, position_ids)  # (n, 1, head_dim) each
    cos = cos[:, None]  # (n, 1, 1, head_dim): broadcast over heads
    sin = sin[:, None]
    keep = attention_mask.bool()[:, None, None, :]  # (n, 1, 1, L): True where a row attends
    for layer, slab in zip(backbone.layers, cache.layers, strict=True):
        attention = layer.self_attn
        x = layer.input_layernorm(hidden)
        query = attention.q_proj(x).view(n, 1, -1, attention.head_dim)  # (n, 1, heads, head_dim)
        key = attention.k_proj(x).view(n, 1, -1, attention.head_dim)
        value = attention.v_proj(x).view(n, 1, -1, attention.head_dim)
        if hasattr(attention, "q_norm"):  # Qwen3: RMSNorm over each head's query and key, before the rotation
            query = attention.q_norm(query)
            key = attention.k_norm(key)
        query = query.transpose(1, 2)  # (n, heads, 1, head_dim)
        key = key.transpose(1, 2)
        query = query * cos + rotate_half(query) * sin
        key = key * cos + rotate_half(key) * sin
        keys, values = slab.update(key, value.transpose(1, 2))  # (n, kv_heads, L, head_dim) each
        grouped = query.reshape(n, keys.shape[1], -1, attention.head_dim)  # (n, kv_heads, G, head_dim)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=keep, scale=attention.scaling)
        hidden = hidden + attention.o_proj(out.reshape(n, 1, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return lm.lm_head(backbone.norm(hidden))[:, -1].float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(-x2, x1) for x = (x1, x2) split at the middle of the last dimension: the rotary embedding's partner."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _packed_forward(weight, bias, x):
    """A Linear's forward on a weight packed for oneDNN (only x: anything else a caller passes is an error, not
    dropped)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _packable(linear) -> bool:
    if type(linear) is not torch.nn.Linear:
        return False
    return linear.weight.device.type == "cpu" and linear.weight.dtype == torch.float32


def _mergeable(lora) -> bool:
    """A PEFT LoRA Linear whose active adapters are plain W + s B A on a float32 nn.Linear: no DoRA or other
    variant, no LoRA bias, not merged already, not disabled, not transposed (GPT-2's Conv1D)."""
    adapters = [a for a in lora.active_adapters if a in lora.lora_A]
    plain = all(a not in lora.lora_variant and lora.lora_B[a].bias is None for a in adapters)
    return plain and not (lora.disable_adapters or lora.merged or lora.fan_in_fan_out) and _packable(lora.base_layer)


@contextlib.contextmanager
def packed_linears(model, rows: int):
    """On an x86-64 CPU with oneDNN: for the rollout, every float32 nn.Linear of the policy runs on a copy of its
    weight reordered for oneDNN (freed on exit), a LoRA Linear's active adapters merged into that copy (W + s B A, what
    PEFT's get_delta_weight adds). The decode step's small-batch matmuls are then oneDNN's rather than MKL's and the
    adapters' A/B products leave the step. Equal in exact arithmetic to PEFT's unmerged forward; the sums run in
    another order, so logits differ at float32 rounding. A LoRA layer that cannot be merged (_mergeable) keeps its
    forward around a packed base; anything else (quantized or non-float32 weights, a GPU, an ARM CPU) is left as it
    is. rows: the batch size oneDNN lays the weights out for."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")  # where it was measured; ARM's oneDNN differs
    if not (x86 and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        yield
        return
    swapped = []
    done = set()
    merged = None  # one buffer every merge is written into: the reorder copies it out (fresh buffers cost page faults)

    def swap(module, weight, bias):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        module.forward = functools.partial(_packed_forward, packed, bias)
        swapped.append(module)

    try:
        with torch.no_grad():
            for module in model.modules():
                if id(module) in done:
                    continue
                if isinstance(module, LoraLinear):
                    done.update(id(m) for m in module.modules())  # its base and A/B: handled here or left alone
                    base = module.base_layer
                    if _mergeable(module):
                        weight = base.weight
                        if merged is None or merged.numel() < weight.numel():
                            merged = weight.new_empty(weight.numel())
                        out = merged[: weight.numel()].view_as(weight)
                        for a in module.active_adapters:
                            if a in module.lora_A:
                                lora_B = module.lora_B[a].weight.to(weight.dtype)
                                lora_A = module.lora_A[a].weight.to(weight.dtype)
                                weight = torch.addmm(weight, lora_B, lora_A, alpha=module.scaling[a], out=out)
                        swap(module, weight, base.bias)
                    elif _packable(base):
                        swap(base, base.weight, base.bias)
                elif _packable(module):
                    swap(module, module.weight, module.bias)
        yield
    finally:
        for module in swapped:
            del module.forward  # the class's forward again


_COMPILED = {}  # one compiled decode step per process: compiling per rollout would cost seconds each time


def compiled_step():
    """_last_logits under torch.compile(mode="reduce-overhead"): on CUDA a static-shape step is captured once as a
    CUDA graph and replayed, instead of launching every layer's kernels from Python."""
    if "step" not in _COMPILED:
        _COMPILED["step"] = torch.compile(_last_logits, mode="reduce-overhead", dynamic=False)
    return _COMPILED["step"]


@torch.no_grad()
def decode(
    lm,
    input_ids,
    attention_mask,
    group_size,
    eos,
    pad_id,
    max_new_tokens,
    sampling,
    static=False,
    step=None,
    stream=None,
):
    """(tokens, logprobs), both (n, max_new_tokens), sampled for left-padded rows (n, P) whose groups of group_size
    are contiguous repeats of a prompt (anything after a row's first EOS is meaningless); None when lm's cache holds
    more than full-attention keys and values or not decodes_exactly(lm.config). sampling: temperature, top_p, top_k.

    Default: each distinct prompt but its last token goes through the backbone once (no logits) into a SlabLayer
    cache of P + max_new_tokens positions, repeated group_size times (when group_size > 1 and every prompt has more
    than one token); each step feeds one token per row at position prompt length + k; a row that sampled an EOS
    leaves the batch. static=True (what a CUDA graph captures): transformers' StaticCache, every row prefilled and
    run every step with the same shapes, the mask (n, P + max_new_tokens) hiding what is not written. step: the
    forward of every one-token step (compiled_step(), _last_logits); by default decoder_step (not static), else
    _last_logits. A whole prompt goes through _last_logits. stream (first, total): these rows are rows first ..
    first + n - 1 of a global batch of `total` (a rank's share under torchrun): each step draws the whole batch's
    uniforms and these rows take theirs, so they sample what one process would."""
    device = input_ids.device
    n, width = input_ids.shape
    plain = prompt_cache(lm)
    refused = plain is None or not plain.layers or any(type(layer) is not DynamicLayer for layer in plain.layers)
    if refused or not decodes_exactly(lm.config):
        return None
    capacity = width + max_new_tokens
    if static:
        cache = StaticCache(config=lm.config, max_cache_len=capacity)
    else:
        cache = Cache(layers=[SlabLayer(capacity) for _ in plain.layers])
    if step is None:
        step = _last_logits if static else decoder_step
    mask = attention_mask.new_zeros(n, capacity)  # one more column set per step, in place
    mask[:, :width] = attention_mask
    next_position = attention_mask.sum(dim=-1, keepdim=True)  # (n, 1): where each row's first new token sits
    feed = input_ids
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    prefilled = False
    if not static and group_size > 1 and int(next_position.min()) > 1:
        prefix_mask = attention_mask[::group_size, :-1]
        lm.get_decoder()(
            input_ids=input_ids[::group_size, :-1],
            attention_mask=prefix_mask,
            position_ids=(prefix_mask.cumsum(-1) - 1).clamp(min=0),
            **{cache_kwarg(lm): cache},
        )
        cache.batch_repeat_interleave(group_size)
        feed = input_ids[:, -1:]
        positions = next_position - 1
        prefilled = True
    tokens = torch.full((n, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(n, max_new_tokens, device=device)
    rows = torch.arange(n, device=device)  # the rows still sampling
    stops = torch.tensor(eos, device=device)
    for k in range(max_new_tokens):
        # the whole batch's uniforms every sampled step, ended rows too: the stream a rollout consumes does not
        # depend on which rows ended when; greedy draws none
        uniforms = None
        if sampling["temperature"] > 0 and stream is None:
            uniforms = torch.rand(n, dtype=torch.float64, device=device)
        elif sampling["temperature"] > 0:
            uniforms = torch.rand(stream[1], dtype=torch.float64, device=device)[stream[0] : stream[0] + n]
        forward = step if prefilled or k > 0 else _last_logits  # a whole prompt: the model's forward
        logits = forward(lm, cache, feed, positions, mask if static else mask[:, : width + k])
        chosen, chosen_logps = sample_tokens(logits, None if uniforms is None else uniforms[rows], **sampling)
        tokens[rows, k] = chosen
        logprobs[rows, k] = chosen_logps
        ended = torch.isin(tokens[:, : k + 1], stops).any(-1)[rows]  # (live rows,)
        if k + 1 == max_new_tokens or bool(ended.all()):
            break
        if not static and bool(ended.any()):
            keep = (~ended).nonzero()[:, 0]
            cache.batch_select_indices(keep)
            rows = rows[keep]
            mask = mask[keep]
            next_position = next_position[keep]
            chosen = chosen[keep]
        feed = chosen[:, None]
        positions = next_position + k
        mask[:, width + k] = 1
    return tokens, logprobs


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
    compile: bool = False,
    pack: bool = True,
    own_step: bool = True,
    stream: tuple[int, int] | None = None,
) -> dict:
    """Sample group_size completions per prompt with `decode` (left padding, eval, no_grad), or with model.generate
    for a model decode refuses (a cache holding more than keys and values, not decodes_exactly). compile: static
    shapes and a CUDA-graph-captured decode step (compiled_step), prompts left-padded to a multiple of 64 so that
    rollouts share one compiled shape. pack: on a CPU, decode on packed_linears (False: each layer's own forward,
    to compare). own_step: decoder_step, on the configs it takes (False: the model's forward every step).
    stream (first, total) under torchrun: these prompts' rows are rows first ... of the global batch's `total`; each
    step draws the whole batch's uniforms (decode), and after the rollout a rank whose rows ended early draws what
    the longest row of any rank drew, so every rank's random stream stays one process's. model.generate's fallback
    (models decode refuses) samples from each rank's own stream instead."""
    check_sampling(top_p, top_k)
    lm = unwrap(model)
    eos = eos_ids(model, tokenizer)
    rows = [p for p in prompts for _ in range(group_size)]  # repeat, not num_return_sequences: greedy allows it too
    device = next(model.parameters()).device
    # Left padding: every row's last prompt token sits in the last column, so new tokens are appended in lockstep;
    # positions come from the attention mask, so padded rows see the positions of unpadded ones.
    width = max(map(len, rows))
    if compile:
        width = -(-width // 64) * 64  # more left padding: masked, so the completions are the same
    pad = tokenizer.pad_token_id
    input_ids = pad_batch([[pad] * (width - len(r)) + r for r in rows], pad).to(device)
    attention_mask = pad_batch([[0] * (width - len(r)) + [1] * len(r) for r in rows], 0).to(device)
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
    was_training = model.training
    try:
        model.eval()  # dropout off while sampling; HF also only checkpoints activations in train mode
        step = None if own_step else _last_logits  # None: decode's default, decoder_step
        if compile:
            step = compiled_step()
        packing = packed_linears(model, len(rows)) if pack and not compile else contextlib.nullcontext()
        with packing:
            decoded = decode(
                lm, input_ids, attention_mask, group_size, eos, pad, max_new_tokens, sampling, compile, step, stream
            )
        if decoded is None:
            new = _model_generate(
                model, tokenizer, input_ids, attention_mask, group_size, eos, max_new_tokens, sampling
            )
            return _result(rows, new.tolist(), eos, tokenizer)
    finally:
        model.train(was_training)
    result = _result(rows, decoded[0].tolist(), eos, tokenizer, decoded[1].tolist())
    if stream is not None and temperature > 0:  # decode drew one batch of uniforms per step of its longest row
        drawn = max(map(len, result["completion_ids"]))
        for _ in range(all_max(drawn) - drawn):
            torch.rand(stream[1], dtype=torch.float64, device=device)
    return result


def _model_generate(model, tokenizer, input_ids, attention_mask, group_size, eos, max_new_tokens, sampling):
    """The new tokens (n, T) of model.generate with exactly our sampling settings, for the models decode refuses.
    (Its random stream is generate's: one torch.multinomial per live step.)"""
    lm = unwrap(model)
    temperature = sampling["temperature"]
    # top_k is passed even when 0: an unset field falls back to transformers' global default top_k=50.
    chosen = dict(do_sample=True, **sampling) if temperature > 0 else dict(do_sample=False)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        use_cache=True,  # the KV cache, even with gradient checkpointing on
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        return_dict_in_generate=True,
        **chosen,
    )
    # generate() fills every field we leave unset from model.generation_config (a checkpoint's repetition_penalty,
    # min_p, suppress_tokens, ...), so for this call the model's own config is replaced by ours.
    saved = lm.generation_config
    try:
        lm.generation_config = config
        # Sliding-window models: each distinct prompt but its last token prefilled once (backbone only) and its cache
        # repeated G times; not models with recurrent states (prompt_cache gives None), whose state cannot be, nor
        # a rope that rescales with each call's longest position (not decodes_exactly): generate sees the whole prompt
        shared = group_size > 1 and int(attention_mask.sum(-1).min()) > 1 and decodes_exactly(lm.config)
        cache = prompt_cache(lm) if shared else None
        if cache is not None:
            prefix, prefix_mask = input_ids[::group_size, :-1], attention_mask[::group_size, :-1]
            position_ids = (prefix_mask.cumsum(-1) - 1).clamp(min=0)
            kwargs = {cache_kwarg(lm): cache}
            lm.get_decoder()(input_ids=prefix, attention_mask=prefix_mask, position_ids=position_ids, **kwargs)
            cache.batch_repeat_interleave(group_size)
        kwargs = {cache_kwarg(lm): cache} if cache is not None else {}
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config, **kwargs)
    finally:
        lm.generation_config = saved
    return out.sequences[:, input_ids.shape[1] :]  # (n, T_new); rows that stopped early are padded

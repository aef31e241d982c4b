"""Rollouts: G sampled completions for each prompt from the live policy, with TRL's sampling semantics only.

`hf_generate` (and the vLLM engine, plugins.vllm_engine) return, prompt-major (the G completions of prompt i are rows
i*G .. i*G+G-1): prompt_ids, completion_ids (each through its first EOS), completions (decoded, special tokens
skipped), truncated (no EOS within max_new_tokens) and logprobs (the sampled tokens' log-probs under the sampling
distribution, or None). `decode` is our decode loop: each distinct prompt prefilled once into a KV cache allocated at
its final length (SlabLayer), one-token steps through `decoder_step`, LoRA merged for the rollout (`merged_linears`),
on a GPU static shapes captured as a CUDA graph. Sampling: temperature (0 = greedy), top_p (1 = off), top_k (0 = off)
as transformers' warpers apply them, nothing else (no repetition penalty or min_p, whatever generation_config says).

Random stream: each sampled step draws one float64 uniform per row, for every row whether it has ended or not, and a
row takes the token at which the cumulative probability first exceeds u * total (inverse CDF): a rollout consumes
B*G x (longest completion) uniforms and resumes from a checkpoint's RNG state exactly; greedy draws none. Models that
`decode` refuses (`decodes_exactly`) are sampled by `model.generate`, from its own stream.
"""

import contextlib
import functools
import platform
import time

import torch
import torch.nn.functional as F
from peft.tuners.lora import Linear as LoraLinear
from transformers import GenerationConfig, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.cache_utils import Cache, DynamicLayer
from transformers.models.llama.modeling_llama import rotate_half

from common.data import pad_batch
from common.distributed import all_gather, rank_and_world
from common.errors import ArgsError
from common.model import BUCKETS, cache_kwarg, prompt_cache, unwrap


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
    token); attention reads the filled part, a view. Rows can be dropped (batch_select_indices). `write`: the static
    shapes' update, at a column a device tensor holds (what a captured CUDA graph replays)."""

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

    def write(self, key_states, value_states, column):
        """One token per row written at slab column `column` ((1,) long, on the device); the whole slabs returned:
        the same shapes every step, the caller's mask hiding the columns not written yet."""
        self.slab_keys.index_copy_(2, column, key_states)
        self.slab_values.index_copy_(2, column, value_states)
        return self.slab_keys, self.slab_values

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._slabs(self.slab_keys.repeat_interleave(repeats, 0), self.slab_values.repeat_interleave(repeats, 0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._slabs(self.slab_keys[indices], self.slab_values[indices])


def warp_scores(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> torch.Tensor:
    """The float32 scores sampled from: transformers' warpers in generate's order, each only when on
    (min_tokens_to_keep 1): logits / T; -inf below the k-th largest; -inf on the least probable tokens whose
    cumulative probability stays <= 1 - top_p (the most probable one always kept)."""
    scores = logits.float()
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(float(temperature))(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
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
SYNC_EVERY = 8  # static shapes: one-token steps between the host's reads of whether every row has ended
CAPTURED = []  # the seconds of this process's first CUDA graph capture, once said (a rollout's time counts each)


def decodes_exactly(config) -> bool:
    """decode's rule on the config: every rope_type of its text config's rope_parameters (one, or one per layer
    type; none: no rotary embedding) is in STATIC_ROPE. "dynamic" and "longrope" rescale with the longest position
    of each call, so a prompt prefilled in two calls, or rows leaving the batch, change what the model computes."""
    rope = getattr(config.get_text_config(), "rope_parameters", None) or {}
    ropes = [rope] if "rope_type" in rope else [r for r in rope.values() if isinstance(r, dict)]
    return all(r.get("rope_type", "default") in STATIC_ROPE for r in ropes)


def takes_decoder_step(config) -> bool:
    """decoder_step's models: a type in DECODER_STEP_MODELS with no sliding_window (None: Mistral's forward windows
    every layer when it is set, whatever layer_types says)."""
    return config.model_type in DECODER_STEP_MODELS and getattr(config, "sliding_window", None) is None


def decoder_step(lm, cache, input_ids, position_ids, attention_mask, column=None):
    """_last_logits for one new token per row (input_ids (n, 1)) after a SlabLayer cache, on takes_decoder_step's
    configs (any other runs _last_logits): their forward written out over the model's own modules (embedding, rotary
    embedding, norms, projections, MLP, head), without what the model's forward adds around a one-token step (the
    mask built per call, the attention interface's plumbing, output objects). Attention is the same grouped-query
    attention over the slab (repeat_kv's order), padded positions masked out. column ((1,) long): static shapes, each
    key and value written at that slab column and the whole slab attended under attention_mask (n, capacity); None:
    appended, the filled part attended."""
    if not takes_decoder_step(lm.config):
        return _last_logits(lm, cache, input_ids, position_ids, attention_mask)
    backbone = lm.get_decoder()
    n = input_ids.shape[0]
    hidden = backbone.embed_tokens(input_ids)  # (n, 1, H)
    cos, sin = backbone.rotary_emb(hidden, position_ids)  # (n, 1, head_dim) each
    cos = cos[:, None]  # (n, 1, 1, head_dim): broadcast over heads
    sin = sin[:, None]
    # (n, 1, 1, L): 0 where a row attends, -inf elsewhere, built once a step (a bool mask is converted in every layer)
    keep = hidden.new_zeros(attention_mask.shape).masked_fill_(attention_mask == 0, float("-inf"))[:, None, None]
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
        query = query * cos + rotate_half(query) * sin  # RoPE as the model's forward applies it (Llama's rotate_half)
        key = key * cos + rotate_half(key) * sin
        if column is None:
            keys, values = slab.update(key, value.transpose(1, 2))  # (n, kv_heads, L, head_dim) each
        else:
            keys, values = slab.write(key, value.transpose(1, 2), column)
        grouped = query.reshape(n, keys.shape[1], -1, attention.head_dim)  # (n, kv_heads, G, head_dim)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=keep, scale=attention.scaling)
        hidden = hidden + attention.o_proj(out.reshape(n, 1, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return lm.lm_head(backbone.norm(hidden))[:, -1].float()


def _packed_forward(weight, bias, x):
    """A Linear's forward on a weight packed for oneDNN (only x: anything else passed is an error, not dropped)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _packable(linear) -> bool:
    """A float32 nn.Linear on a CPU: what oneDNN's packed matmul takes."""
    return _plain(linear) and linear.weight.device.type == "cpu" and linear.weight.dtype == torch.float32


def _plain(linear) -> bool:
    return type(linear) is torch.nn.Linear and linear.weight.is_floating_point()


def _mergeable(lora) -> bool:
    """A PEFT LoRA Linear whose active adapters are plain W + s B A on a floating-point nn.Linear (not quantized): no
    DoRA or other variant, no LoRA bias, not merged already, not disabled, not transposed (GPT-2's Conv1D)."""
    adapters = [a for a in lora.active_adapters if a in lora.lora_A]
    plain = all(a not in lora.lora_variant and lora.lora_B[a].bias is None for a in adapters)
    return plain and not (lora.disable_adapters or lora.merged or lora.fan_in_fan_out) and _plain(lora.base_layer)


@contextlib.contextmanager
def merged_linears(model, rows: int, spare: int = 0):
    """For the rollout, every LoRA Linear of the policy runs on one weight W + s B A (PEFT's get_delta_weight), a copy
    freed on exit: the A/B products leave the decode step (half its kernels); equal to PEFT's forward in exact
    arithmetic (docs/results.md: the rounding gap). On x86-64 with oneDNN every float32 Linear also runs on a copy of
    its weight reordered for oneDNN (rows: the batch it is laid out for). Layers that cannot be merged (_mergeable)
    and quantized weights are left as they are; on CUDA a layer is merged only while `spare` bytes stay free."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")  # where it was measured; ARM's oneDNN differs
    pack = x86 and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    swapped = []
    done = set()
    buffer = None  # packing: one buffer every merge is written into (the reorder copies it out; fresh ones fault)
    room = None  # CUDA: bytes the merged copies may still take
    device = next(model.parameters()).device
    if device.type == "cuda":
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # the allocator's spare
        room = torch.cuda.mem_get_info(device)[0] + unused - spare

    def swap(module, weight, bias):
        if pack and weight.device.type == "cpu" and weight.dtype == torch.float32:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
            module.forward = functools.partial(_packed_forward, packed, bias)
        else:
            module.forward = functools.partial(F.linear, weight=weight, bias=bias)  # x alone (more: an error)
        swapped.append(module)

    try:
        with torch.no_grad():
            for module in model.modules():
                if id(module) in done:
                    continue
                if isinstance(module, LoraLinear):
                    done.update(id(m) for m in module.modules())  # its base and A/B: handled here or left alone
                    base = module.base_layer
                    size = base.weight.numel() * base.weight.element_size()
                    if _mergeable(module) and (room is None or size <= room):
                        room = None if room is None else room - size
                        weight = base.weight.float()  # float32 sums, a bf16 weight rounded once below
                        out = None
                        if pack and _packable(base):
                            if buffer is None or buffer.numel() < weight.numel():
                                buffer = weight.new_empty(weight.numel())
                            out = buffer[: weight.numel()].view_as(weight)
                        for a in module.active_adapters:
                            if a in module.lora_A:
                                lora_B = module.lora_B[a].weight.float()
                                lora_A = module.lora_A[a].weight.float()
                                weight = torch.addmm(weight, lora_B, lora_A, alpha=module.scaling[a], out=out)
                        swap(module, weight.to(base.weight.dtype), base.bias)
                    elif pack and _packable(base):
                        swap(base, base.weight, base.bias)
                elif pack and _packable(module):
                    swap(module, module.weight, module.bias)
        yield
    finally:
        for module in swapped:
            del module.forward  # the class's forward again


def graphed(step, *args):
    """step(*args) captured as a CUDA graph, after one warm-up call on a side stream (torch.cuda.graphs' recipe: lazy
    initialisations happen outside the capture); the warm-up computes what the first replay computes and writes it
    where the replay writes it. Returns (replay, out): replay() runs the captured kernels on what the tensors in args
    hold at that moment, into out."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(*args)
    return graph.replay, out


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
    stream=None,
    cuda_graph=False,
):
    """(tokens, logprobs), both (n, max_new_tokens), for left-padded rows (n, P) whose groups of group_size are
    contiguous repeats of a prompt (anything after a row's first EOS is meaningless); None when lm's cache holds more
    than keys and values or not decodes_exactly(lm.config). sampling: temperature, top_p, top_k.

    Each distinct prompt but its last token is prefilled once into a SlabLayer cache of P + max_new_tokens positions
    and repeated group_size times; each step feeds one token per row through decoder_step. A
    CPU's: a row that sampled an EOS leaves the batch. static (a GPU's, on takes_decoder_step's configs): every row
    runs every step on the whole slab under the mask, keys and values written at a column held on the device, so the
    step can be captured once a rollout (cuda_graph); whether all rows ended is read every SYNC_EVERY tokens. stream
    (first, total): these rows are rows first .. first + n - 1 of a batch of `total` (a rank's share): each step
    draws the whole batch's uniforms and these rows take theirs."""
    device = input_ids.device
    n, width = input_ids.shape
    plain = prompt_cache(lm)
    refused = plain is None or not plain.layers or any(type(layer) is not DynamicLayer for layer in plain.layers)
    if refused or not decodes_exactly(lm.config):
        return None
    static = static and takes_decoder_step(lm.config)
    cache = Cache(layers=[SlabLayer(width + max_new_tokens) for _ in plain.layers])
    mask = attention_mask.new_zeros(n, width + max_new_tokens)  # one more column set per step, in place
    mask[:, :width] = attention_mask
    next_position = attention_mask.sum(dim=-1, keepdim=True)  # (n, 1): where each row's first new token sits
    prefilled = group_size > 1 and int(next_position.min()) > 1
    if prefilled:
        prefix_mask = attention_mask[::group_size, :-1]
        lm.get_decoder()(
            input_ids=input_ids[::group_size, :-1],
            attention_mask=prefix_mask,
            position_ids=(prefix_mask.cumsum(-1) - 1).clamp(min=0),
            **{cache_kwarg(lm): cache},
        )
        cache.batch_repeat_interleave(group_size)
    # the one-token steps' input, position and (static) slab column, advanced in place
    feed = input_ids[:, -1:].clone()
    positions = next_position - 1
    column = torch.full((1,), width - 1, dtype=torch.long, device=device)
    tokens = torch.full((n, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(n, max_new_tokens, device=device)
    rows = torch.arange(n, device=device)  # the rows still sampling (static: every row)
    live = torch.ones(n, dtype=torch.bool, device=device)  # static: no EOS sampled yet
    stops = torch.tensor(eos, device=device)
    replay = None
    for k in range(max_new_tokens):
        # the whole batch's uniforms every sampled step, ended rows too: the stream a rollout consumes does not
        # depend on which rows ended when; greedy draws none
        uniforms = None
        if sampling["temperature"] > 0 and stream is None:
            uniforms = torch.rand(n, dtype=torch.float64, device=device)
        elif sampling["temperature"] > 0:
            uniforms = torch.rand(stream[1], dtype=torch.float64, device=device)[stream[0] : stream[0] + n]
        if k == 0 and not prefilled:  # whole prompts: the model's forward
            logits = _last_logits(lm, cache, input_ids, (attention_mask.cumsum(-1) - 1).clamp(min=0), attention_mask)
        elif not static:
            logits = decoder_step(lm, cache, feed, positions, mask[:, : width + k])
        elif cuda_graph:
            if replay is None:  # once a rollout: one warm-up step and the capture, said the first time
                start = time.perf_counter()
                replay, captured = graphed(decoder_step, lm, cache, feed, positions, mask, column)
                if not CAPTURED and rank_and_world()[0] == 0:
                    CAPTURED.append(time.perf_counter() - start)
                    print(f"decode: the step captured as a CUDA graph in {CAPTURED[0]:.2f} s, once a rollout")
            replay()
            logits = captured
        else:
            logits = decoder_step(lm, cache, feed, positions, mask, column)
        chosen, chosen_logps = sample_tokens(logits, None if uniforms is None else uniforms[rows], **sampling)
        tokens[rows, k] = chosen
        logprobs[rows, k] = chosen_logps
        ended = torch.isin(chosen, stops)  # (live rows,); static: (n,), rows that ended before included
        if k + 1 == max_new_tokens:
            break
        if static:
            live &= ~ended
            if (k + 1) % SYNC_EVERY == 0 and not bool(live.any()):
                break
            feed.copy_(chosen[:, None])
            positions += 1
            column += 1
        else:
            if bool(ended.all()):
                break
            if bool(ended.any()):
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
    static: bool | None = None,
    cuda_graph: bool = True,
    stream: tuple[int, int] | None = None,
) -> dict:
    """Sample group_size completions per prompt with `decode` (left padding, eval mode, no_grad), or model.generate
    for a model decode refuses. static: decode's static shapes (None: on a BUCKETS device), prompts then left-padded
    to a multiple of the bucket so that rollouts share shapes; cuda_graph, stream: decode's. Afterwards the
    device's generator is put back and advanced by one draw per step of the longest row (under torchrun: of any
    rank's), so static shapes' extra draws are taken back and every rank's stream stays one process's
    (model.generate's fallback draws from each rank's own stream)."""
    check_sampling(top_p, top_k)
    lm = unwrap(model)
    eos = eos_ids(model, tokenizer)
    rows = [p for p in prompts for _ in range(group_size)]  # repeat, not num_return_sequences: greedy allows it too
    device = next(model.parameters()).device
    static = device.type in BUCKETS if static is None else static  # a GPU's (common.model.BUCKETS)
    # Left padding: every row's last prompt token sits in the last column, so new tokens are appended in lockstep;
    # positions come from the attention mask, so padded rows see the positions of unpadded ones.
    width = max(map(len, rows))
    if static:  # more left padding, to a width that recurs: masked, so the completions are the same
        multiple = BUCKETS.get(device.type, BUCKETS["cuda"])
        width = -(-width // multiple) * multiple
    pad = tokenizer.pad_token_id
    input_ids = pad_batch([[pad] * (width - len(r)) + r for r in rows], pad).to(device, non_blocking=True)
    attention_mask = pad_batch([[0] * (width - len(r)) + [1] * len(r) for r in rows], 0).to(device, non_blocking=True)
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
    cuda = device.type == "cuda"
    state = torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state()
    text = lm.config.get_text_config()  # what decode allocates after the merge: its KV cache and a step's logits
    kv = text.num_key_value_heads * (getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    cache = len(rows) * (width + max_new_tokens) * text.num_hidden_layers * 2 * kv * lm.dtype.itemsize
    spare = cache + 4 * len(rows) * text.vocab_size * 8 + 2**30  # + fp32 logits, scores, float64 cdf; + 1 GiB
    was_training = model.training
    try:
        model.eval()  # dropout off while sampling; HF also only checkpoints activations in train mode
        with merged_linears(model, len(rows), spare):
            decoded = decode(
                lm,
                input_ids,
                attention_mask,
                group_size,
                eos,
                pad,
                max_new_tokens,
                sampling,
                static,
                stream,
                cuda_graph=cuda_graph and cuda,
            )
        if decoded is None:
            new = _model_generate(
                model, tokenizer, input_ids, attention_mask, group_size, eos, max_new_tokens, sampling
            )
            return _result(rows, new.tolist(), eos, tokenizer)
    finally:
        model.train(was_training)
    result = _result(rows, decoded[0].tolist(), eos, tokenizer, decoded[1].tolist())
    if temperature > 0:  # one draw per step of the longest row, as if decode had stopped there (on every rank)
        drawn = max(map(len, result["completion_ids"]))
        drawn = max(all_gather([drawn])) if stream is not None else drawn
        torch.cuda.set_rng_state(state, device) if cuda else torch.set_rng_state(state)
        for _ in range(drawn):
            torch.rand(len(rows) if stream is None else stream[1], dtype=torch.float64, device=device)
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

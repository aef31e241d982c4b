"""One backbone in memory: the model, its LoRA slots, and the log-probs it gives tokens.

The policy is base + the trainable LoRA adapter "default"; the reference is a frozen copy of the starting adapter in
a second slot "ref", switched in by `as_reference` (a reward model may add a third slot, "reward"). Log-probs come
from the final hidden states through the output head chunk by chunk (`chunked_logps`), so the batch's full fp32
logits never exist. Every formula is stated in its docstring and checked against a naive reference in tests/.
"""

import contextlib
import copy
import importlib.util
import inspect
import json
import os
import warnings

import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from torch.distributed.fsdp import FSDPModule
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from common.distributed import is_sharded, local_tensor, reshard
from common.errors import ModelError

DEFAULT = "default"
REF = "ref"
REWARD = "reward"  # a reward model's LoRA on the policy's backbone (plugins.reward_model), never trained
# Device type -> padded lengths round up to a multiple of this and a padded batch runs as one pass, so that shapes
# recur from step to step (attention plans, kernels and the allocator's blocks reused). A CPU (absent) pays for every
# padded token and plans nothing per shape: exact lengths, length groups. (Tests set "cpu" to count a GPU's shapes.)
BUCKETS = {"cuda": 64}


# ------------------------------------------------------------------------------------------------------ loading
def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cache_kwarg(lm) -> str:
    """The name under which lm's forward (and generate) takes a KV cache: `cache`, or `past_key_values`."""
    return "cache" if "cache" in inspect.signature(lm.forward).parameters else "past_key_values"


def is_checkpointing(lm) -> bool:
    """Activation checkpointing on? is_activation_checkpointing, else the deprecated is_gradient_checkpointing."""
    if hasattr(lm, "is_activation_checkpointing"):
        return bool(lm.is_activation_checkpointing)
    return bool(getattr(lm, "is_gradient_checkpointing", False))


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto' = bf16 on a CUDA card that supports it, else fp32 (CPU bf16 matmuls are slow and lossy)."""
    if dtype == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16 else torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]


def load_model(
    name: str,
    dtype: str = "auto",
    attn_implementation: str = "auto",
    quantization_config=None,
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
    path: str | None = None,
):
    """(model, tokenizer) of a hub id or a local folder, on the GPU when there is one.

    `path`: where to load from when it is not `name` itself (the folder an alias or an offline hub id resolves to,
    see harness.hub.locate_model); the model keeps `name` as its name, which saved adapters record.
    quantization_config: any transformers quantization config (QLoRA's: plugins.quantization.bnb_config): the base is
    quantized on load, frozen and prepared for k-bit training (norms in fp32)."""
    path = path or name
    device = pick_device()
    if attn_implementation == "auto":  # flash_attention_2 when flash-attn is installed and we are on CUDA, else SDPA
        flash = device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None
        attn_implementation = "flash_attention_2" if flash else "sdpa"
    kwargs = dict(dtype=resolve_dtype(dtype, device), attn_implementation=attn_implementation)
    if quantization_config is not None:  # quantized on load, straight onto its device
        kwargs["quantization_config"] = quantization_config
        kwargs["device_map"] = {"": (device.index or 0) if device.type == "cuda" else "cpu"}
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code, **kwargs)
    # An alias (smollm2-135m) stays the model's name: saved adapters record it, not this disk's cache path.
    model.name_or_path = name
    model.config._name_or_path = name
    if tokenizer.pad_token is None:
        # Padding is always masked out, so any id works; EOS is the usual choice (our masks never use pad ids).
        tokenizer.pad_token = tokenizer.eos_token
    if device.type == "cuda":
        # cuDNN's SDPA builds an execution plan on the host for every new (shape, stride) of q/k/v/mask, paid again
        # for each length a pass or a decode step brings (docs/results.md). Flash and memory-efficient attention don't.
        torch.backends.cuda.enable_cudnn_sdp(False)
    if quantization_config is None:
        model.to(device)
    else:
        # Checkpointing is switched on below, as without quantization (PEFT's would use a deprecated alias).
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        # bitsandbytes on an AVX512-BF16 CPU repacks a 4-bit weight in place the first time it runs in eval mode
        # without grad and keeps that layout in training: our reference and rollout passes run in eval mode, so the
        # base would change under the trainer. Keep the layout that trains.
        for module in model.modules():
            if hasattr(module, "support_avx512bf16_for_cpu"):
                module.support_avx512bf16_for_cpu = False
    if gradient_checkpointing:
        # Non-reentrant works with frozen inputs (LoRA): no enable_input_require_grads needed
        checkpoint_kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # the newer name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)
    model.config.use_cache = not gradient_checkpointing
    return model, tokenizer


# ------------------------------------------------------------------------------------------------- LoRA slots
def attach_lora(
    model,
    adapter: str | None = None,
    r: int = 16,
    alpha: int = 32,
    dropout: float = 0.05,
    target_modules: str | list[str] = "all-linear",
):
    """Wrap the model in PEFT with a trainable "default" adapter, loaded from `adapter` (e.g. an SFT run's final/)
    or new (r, alpha, dropout on all linear layers). An adapter of another base with the same shapes loads without a
    word (harness.cli.check_adapter names the two models before the base loads)."""
    with warnings.catch_warnings():
        # PEFT reads transformers' deprecated model.is_gradient_checkpointing on every wrap; nothing we call can
        # avoid it, so only that one warning is hidden, here.
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        if adapter is None:
            config = LoraConfig(
                r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules, task_type="CAUSAL_LM"
            )
            return get_peft_model(model, config)
        with open(os.path.join(adapter, "adapter_config.json")) as f:
            trained_on = json.load(f).get("base_model_name_or_path")
        name = model.config._name_or_path
        try:
            return PeftModel.from_pretrained(model, adapter, adapter_name=DEFAULT, is_trainable=True)
        except RuntimeError as e:  # PEFT lists every mismatched tensor, one line each: name the models instead
            if "size mismatch" not in str(e):
                raise
            first = next(line.strip() for line in str(e).splitlines() if "size mismatch" in line)
            raise ModelError(
                f"--adapter {adapter} was trained on {trained_on!r}, whose shapes differ from the base "
                f"--model {name!r} ({str(e).count('size mismatch')} tensors, e.g. {first[:200]})"
            ) from None


def is_peft(model) -> bool:
    return hasattr(model, "peft_config")


def unwrap(model):
    """The transformers PreTrainedModel inside a PeftModel (LoRA layers live in it in place), else the model."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def slot_params(model, slot: str) -> dict[str, torch.nn.Parameter]:
    """LoRA tensors of one slot keyed by their name with the slot name removed, so two slots line up."""
    tag = f".{slot}."
    return {n.replace(tag, ".#."): p for n, p in model.named_parameters() if tag in n}


def snapshot_ref(model) -> None:
    """The reference policy is the starting policy (e.g. the SFT adapter). LoRA: "default" copied into the frozen
    "ref" slot. Full fine-tuning: every weight copied into CPU memory (pinned when the model is on a GPU), so the
    card holds one backbone; as_reference swaps the copy in. Called again, it overwrites the reference with the
    current policy."""
    if not is_peft(model):
        base = unwrap(model)
        reshard(model)
        params = {n: local_tensor(p) for n, p in model.named_parameters()}  # FSDP2: this rank's shards only
        if getattr(base, "reference_weights", None) is None:
            pin = next(iter(params.values())).is_cuda  # pinned host memory: faster copies to and from the card
            weights = {n: torch.empty_like(p, device="cpu", pin_memory=pin) for n, p in params.items()}
            base.reference_weights = weights  # a plain dict attribute: not in state_dict, never saved with the model
        with torch.no_grad():
            for n, p in params.items():  # tied weights (embeddings = head) appear once
                base.reference_weights[n].copy_(p)
        return
    if REF not in model.peft_config:
        config = copy.deepcopy(model.peft_config[DEFAULT])
        config.inference_mode = True
        with torch.random.fork_rng():  # PEFT draws a random init we overwrite: leave the RNG stream alone
            model.add_adapter(REF, config)  # PEFT keeps "default" active and creates the new slot frozen
    src = slot_params(model, DEFAULT)
    dst = slot_params(model, REF)
    if src.keys() != dst.keys():
        raise RuntimeError("the 'ref' slot does not mirror 'default' (different target modules)")
    with torch.no_grad():
        for key, p in dst.items():
            p.copy_(src[key])
            p.requires_grad_(False)


@contextlib.contextmanager
def swapped_weights(model, weights: dict):
    """Run the block with every parameter's tensor replaced by weights[name] (CPU tensors), one tensor at a time (the
    trained one parked in CPU memory first), so the device never holds two copies of the backbone; on a CPU model the
    parameters point at the reference's tensors and back, bit for bit. Put back on exit, even if the block raises;
    gradients and optimizer states are not touched."""
    parked = {}
    if is_sharded(model):  # FSDP2 gathers from each shard's own storage: the shards are copied in place, and back
        reshard(model)  # first: a gathered root's parameters are other tensors until it is resharded
        params = dict(model.named_parameters())
        try:
            with torch.no_grad():
                for n, p in params.items():
                    parked[n] = local_tensor(p).to("cpu", copy=True)
                    local_tensor(p).copy_(weights[n])
            yield model
        finally:
            reshard(model)  # the block's forwards left the root gathered with the reference's weights: drop them
            with torch.no_grad():
                for n, tensor in parked.items():
                    local_tensor(params[n]).copy_(tensor)
        return
    params = dict(model.named_parameters())
    try:
        for n, p in params.items():
            parked[n] = p.data.to("cpu")
            p.data = weights[n].to(p.device, non_blocking=True)
        yield model
    finally:
        for n, tensor in parked.items():
            params[n].data = tensor.to(params[n].device, non_blocking=True)


@contextlib.contextmanager
def as_reference(model, slot: str = REF):
    """Run the block as the reference policy (or another frozen slot, e.g. REWARD): `slot` active, eval mode,
    no_grad; the active adapter, train mode and every requires_grad flag (PEFT's set_adapter flips them) restored on
    exit, even if the block raises. Full fine-tuning: snapshot_ref's CPU copy of the starting weights swapped in."""
    reference_weights = getattr(unwrap(model), "reference_weights", None)
    if not is_peft(model) and slot == REF and reference_weights is not None:
        was_training = model.training
        try:
            model.eval()  # dropout off: the reference must be deterministic
            with torch.no_grad(), swapped_weights(model, reference_weights):
                yield model
        finally:
            model.train(was_training)
        return
    if not is_peft(model) or slot not in model.peft_config:
        raise RuntimeError(f"no '{slot}' adapter: call snapshot_ref(model) (or load_reward) before using it")
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    was_training = model.training
    active = model.active_adapter
    try:
        model.set_adapter(slot)
        model.eval()  # LoRA dropout off: the reference must be deterministic
        with torch.no_grad():
            yield model
    finally:
        model.set_adapter(active)
        for n, p in model.named_parameters():
            p.requires_grad_(flags[n])
        model.train(was_training)


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    """What the optimizer holds: never a "ref" / "reward" tensor (checked: PEFT's adapter switching flips flags)."""
    if getattr(model, "is_quantized", False) and not is_peft(model):
        # Only LoRA can train on a bitsandbytes base: its int8/NF4 weights take no gradient and no optimizer step.
        raise ValueError("a --quantization base trains only through LoRA: drop --no-use-lora or --quantization")
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    leaked = [n for n, _ in params if f".{REF}." in n or f".{REWARD}." in n]
    if leaked:
        raise RuntimeError(f"frozen ('ref' / 'reward') adapter tensors are trainable: {leaked[:3]}")
    if not params:
        raise RuntimeError("the model has no trainable parameters")
    return [p for _, p in params]


# ---------------------------------------------------------------------------------------------------- log-probs
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
    """log p(y_i | h_i) = z_{i, y_i} - logsumexp_v z_{i, v} with z = (h W^T + b) / T, computed chunk by chunk, so the
    peak is one or two (chunk_size, V) fp32 buffers whatever N is: d logp_i / d z_i = onehot(y_i) - softmax(z_i).
    A frozen head (LoRA's): the forward also computes d logp_i / d h_i = (W_{y_i} - softmax(z_i) W) / T, (N, H), and
    backward only scales it. A trainable head's weight gradient needs the incoming gradient inside the (chunk, V)
    product, so its backward recomputes each chunk's logits. Autocast is off inside: bf16 logits would lose the fp32.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, chunk_size, return_entropy, grad_enabled):
        w = weight.float()  # no-op for fp32; for bf16 one fp32 copy of the head so logits are fp32-accurate
        b = None if bias is None else bias.float()
        need_h, need_w, need_b = ctx.needs_input_grad[:3]  # set from requires_grad even under torch.no_grad()
        frozen = grad_enabled and need_h and not (need_w or need_b)
        logps = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logps) if return_entropy else logps.new_empty(0)
        d_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if frozen else None
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)  # the last chunk may be shorter; slicing clips it
            with torch.autocast(hidden.device.type, enabled=False):
                logits = _chunk_logits(hidden[rows], w, b, temperature)  # (n, V) fp32
                if return_entropy:
                    entropy[rows] = entropy_from_logits(logits)
                # logsumexp in the logits' own buffer (max, exp(z - max), sum): logsumexp() would allocate an (n, V)
                # temporary per chunk, and fresh memory costs page faults
                picked = logits.gather(-1, labels[rows, None]).squeeze(-1)
                top = logits.amax(-1)
                exps = logits.sub_(top[:, None]).exp_()
                total = exps.sum(-1)
                logps[rows] = picked - top - total.log()
                if frozen:  # d logp / d h = (W_y - softmax(z) W) / T
                    d_hidden[rows] = (w[labels[rows]] - exps.div_(total[:, None]) @ w).div_(temperature)
            del logits, exps  # free before the next chunk's matmul, else two chunk buffers overlap
        if frozen:
            ctx.save_for_backward(d_hidden)
        else:
            ctx.save_for_backward(hidden, weight, bias, labels)  # inputs only: logits are recomputed in backward
        ctx.frozen = frozen
        ctx.hidden_dtype = hidden.dtype
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(entropy)  # entropy is a logged metric, never a loss term here
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, _grad_entropy):
        if ctx.frozen:
            (d_hidden,) = ctx.saved_tensors
            grad_hidden = (grad_logps.float()[:, None] * d_hidden).to(ctx.hidden_dtype)
            return grad_hidden, None, None, None, None, None, None, None
        hidden, weight, bias, labels = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        w = weight.float()
        b = None if bias is None else bias.float()
        grad_hidden = torch.empty_like(hidden) if need_h else None
        # fp32 accumulators for a trainable head's weight and bias
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
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def chunked_logps(hidden, weight, labels, temperature=1.0, chunk_size=1024, bias=None, return_entropy=False):
    """Per-row log p(labels_i) under softmax((hidden_i W^T + b) / T), fp32 (N,), never holding (N, V) logits.

    hidden (N, H) any float dtype, weight (V, H) the output head, labels (N,) long; with return_entropy also H_i (N,),
    detached. Gradients flow to hidden, and to weight/bias only when they require grad. Logits are fp32 from bf16
    inputs too: `lm_head(h).float()` would round bf16 logits in [16, 32) by up to 1/16.
    """
    grad = torch.is_grad_enabled()
    logps, entropy = _ChunkedLogps.apply(hidden, weight, bias, labels, temperature, chunk_size, return_entropy, grad)
    return (logps, entropy) if return_entropy else logps


def head_is_plain_linear(lm) -> bool:
    """True when logits == lm_head(decoder(x).last_hidden_state) exactly, so the chunked head is safe: not a PEFT or
    quantized head, no config that rescales or softcaps logits (_LOGIT_TRANSFORM_KEYS; those take model(...).logits).
    """
    config = lm.config.get_text_config()
    # 1.0 multiplies or divides by one (Granite's default logits_scaling), so it leaves the plain head exact
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

    input_ids, attention_mask, logps_mask: (B, T). Returns (B, T) fp32 (and entropy (B, T), detached, when
    return_entropy). Position 0 and the first real token after left padding have no context: always 0. Only the
    hidden states that predict a masked target go through the head. On a CPU padded rows run in groups of similar
    length, each cut to its columns (length_groups); on a GPU (BUCKETS) one pass, T rounded up to the bucket, one host
    read. Padding on the right only (or none) takes SDPA's causal path, no mask.
    """
    multiple = BUCKETS.get(input_ids.device.type, 1)
    width = input_ids.shape[1]
    if width % multiple:
        extra = multiple - width % multiple
        mask = None if attention_mask is None else F.pad(attention_mask, (0, extra))
        positions = None
        if position_ids is not None:  # packed rows: the added columns are one more document, which scores nothing
            positions = torch.cat(
                [position_ids, torch.arange(extra, device=input_ids.device).expand(len(input_ids), -1)], 1
            )
        padded = [F.pad(x, (0, extra)) for x in (input_ids, logps_mask)]
        out = sequence_logps(model, padded[0], mask, padded[1], positions, temperature, chunk_size, return_entropy)
        return tuple(x[:, :width] for x in out) if return_entropy else out[:, :width]
    groups = None
    # FSDP2: every rank must run the same number of forwards (each gathers weights with the others), so no grouping
    if multiple == 1 and attention_mask is not None and position_ids is None and not is_sharded(model):
        groups = length_groups(attention_mask)
    if groups and (len(groups) > 1 or groups[0][1:] != (0, input_ids.shape[1])):
        outs = []
        for rows, a, b in groups:  # each group's (g, b - a) result back in its columns of the (B, T) layout
            idx = torch.tensor(rows, device=input_ids.device)
            cut = [x[idx, a:b] for x in (input_ids, attention_mask, logps_mask)]
            group_out = sequence_logps(model, *cut, None, temperature, chunk_size, return_entropy)
            parts = group_out if return_entropy else (group_out,)
            outs.append([F.pad(x, (a, input_ids.shape[1] - b)) for x in parts])
        order = torch.tensor([r for rows, _, _ in groups for r in rows], device=input_ids.device).argsort()
        merged = [torch.cat(x)[order] for x in zip(*outs)]  # rows back in the caller's order
        return tuple(merged) if return_entropy else merged[0]
    lm = unwrap(model)
    if attention_mask is None and position_ids is None:
        raise ValueError("sequence_logps needs attention_mask, or position_ids for packed rows (attention_mask=None)")
    # Shift: the hidden state at t-1 predicts token t, so targets are input_ids[:, 1:] under logps_mask[:, 1:]. A
    # target whose predecessor is padding has no context (the first real token of a left-padded row): 0, like t=0.
    target_mask = logps_mask[:, 1:].bool()  # (B, T-1)
    if attention_mask is not None:
        target_mask = target_mask & attention_mask[:, :-1].bool()
    reads = [target_mask.sum()]
    if position_ids is None:
        reads.append(_right_padded(attention_mask))
    scored, *right = torch.stack(reads).tolist()  # the pass's one host read
    model_mask = attention_mask
    if right and right[0]:
        # Right padding only: under the causal mask a real token sees real tokens alone (the pads come after it), so
        # the model runs without the padding mask and attention takes its causal path (no (T, T) float mask, KV heads
        # not repeated); positions are transformers' default arange(T), the real tokens' own.
        model_mask = None
    elif position_ids is None:
        # Positions count real tokens only, so a left-padded row is scored as if unpadded. HF's default arange(T)
        # shifts each padded row by its pad count: a no-op for RoPE (relative), wrong for absolute-position models
        # (TRL issue #6800, GPT-2). clamp: the pads before the first token.
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    # Packed rows (attention_mask None, position_ids restarting per document): transformers then builds a
    # block-diagonal causal mask from position_ids, but only without a KV cache, hence use_cache=False below.
    inputs = dict(input_ids=input_ids, attention_mask=model_mask, position_ids=position_ids, use_cache=False)
    if head_is_plain_linear(lm):
        hidden = decoder_hidden(lm, inputs)  # (B, T, H), after the final norm
        head = lm.get_output_embeddings()
        # the scored (b, t) of the (B, T-1) layout in row-major order (a stable sort puts them first, no host read)
        order = (~target_mask).reshape(-1).to(torch.uint8).argsort(stable=True)[:scored]
        T = input_ids.shape[1]
        at = order // (T - 1) * T + order % (T - 1)  # their flat positions in the (B, T) layout
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, at)  # (N, H): only the scored rows
        labels = input_ids.reshape(-1)[at + 1]  # (N,): the next token of each
        head_out = chunked_logps(h, head.weight, labels, temperature, chunk_size, head.bias, return_entropy)
        if is_sharded(lm) and not torch.is_grad_enabled():
            # no backward will reshard the root: its gathered weights would go stale at the next update
            reshard(lm)
        logps, entropy = head_out if return_entropy else (head_out, None)
        # Back into (B, T-1); unscored slots are exact zeros (no logits exist for them).
        zeros = torch.zeros(target_mask.numel(), dtype=torch.float32, device=logps.device)
        logps = zeros.index_copy(0, order, logps).view(target_mask.shape)
        if return_entropy:
            entropy = zeros.index_copy(0, order, entropy).view(target_mask.shape)
    else:
        # Naive path: full (B, T-1, V) fp32 logits; the last position predicts nothing, so it is dropped.
        logits = lm(**inputs).logits[:, :-1].float() / temperature
        logps = logits.log_softmax(-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        logps = torch.where(target_mask, logps, 0.0)  # where, not *: unscored slots are exact zeros
        if return_entropy:
            entropy = torch.where(target_mask, entropy_from_logits(logits.detach()), 0.0)
    # Left-pad one zero column for position 0, which has no preceding token to condition on.
    per_token_logps = F.pad(logps, (1, 0))
    if return_entropy:
        return per_token_logps, F.pad(entropy, (1, 0)).detach()
    return per_token_logps


def decoder_hidden(lm, inputs: dict):
    """The decoder's last hidden state (after its final norm) for `inputs`. Under FSDP2 the model's own forward runs
    instead (keeping no logits), so that FSDP's hooks gather the root's weights; a forward hook catches the output."""
    if not isinstance(lm, FSDPModule):
        return lm.get_decoder()(**inputs).last_hidden_state
    caught = []
    hook = lm.get_decoder().register_forward_hook(lambda module, inputs, out: caught.append(out.last_hidden_state))
    try:
        lm(**inputs, logits_to_keep=torch.zeros(0, dtype=torch.long, device=inputs["input_ids"].device))
    finally:
        hook.remove()
    return caught[0]


def _right_padded(attention_mask) -> torch.Tensor:
    """Every row's tokens start at column 0 and run unbroken (padding, if any, only on the right): a 0-dim long, so
    that the caller reads it with its other values."""
    m = attention_mask.bool()
    return (m[:, 0].all() & (m[:, 1:] <= m[:, :-1]).all()).long()


def length_groups(attention_mask, slack: float = 1.125) -> list[tuple[list[int], int, int]] | None:
    """Rows grouped longest first, a row joining the current group while the group's padded size stays within
    `slack` x its real tokens; each group with the column span [a, b) its rows' tokens occupy (left or right
    padding). None when a row is empty (the caller keeps the one padded batch)."""
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
    """An empty DynamicCache for lm, or None when a layer would hold more than keys and values (the conv and recurrent
    states of Falcon-H1, LFM2, Qwen3-Next...): a repeated or rebuilt cache copies keys and values only."""
    cache = DynamicCache(config=lm.config)
    plain = all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in cache.layers)
    return cache if plain else None


def shares_prompt_pass(lm) -> bool:
    """Whether a prompt's KV cache can feed its completions with the numbers of whole rows: a plain linear head
    (chunked_logps), a cache of keys and values only (prompt_cache), no activation checkpointing in train mode
    (transformers then drops the cache: the completions would silently not see their prompt)."""
    if isinstance(lm, FSDPModule):  # the decoder's own calls would skip FSDP's gathering of the root's weights
        return False
    return head_is_plain_linear(lm) and prompt_cache(lm) is not None and not (lm.training and is_checkpointing(lm))


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
    """sum_i values_i * mask_i / sum_i mask_i, over all elements (dim=None) or along dim. An empty mask raises
    ValueError (dim=None, or empty="raise"); empty="zero" makes an all-zero row exactly 0.0 (TRL's clamp(min=1.0)).
    """
    if empty not in ("raise", "zero"):
        raise ValueError(f"empty must be 'raise' or 'zero', got {empty!r}")
    count = mask.sum() if dim is None else mask.sum(dim)
    if dim is None or empty == "raise":
        message = f"masked_mean over an empty mask (dim={dim}): no element to average; check the mask"
        if count.device.type in BUCKETS:  # a GPU's: checked on the device, the run stops at its next read
            torch._assert_async((count > 0).all(), message)
        elif bool((count == 0).any()):
            raise ValueError(message)
    # clamp: only reachable for empty="zero" rows, whose masked sum is 0, so they come out as exactly 0.0
    return masked_sum(values, mask, dim) / count.clamp(min=1)

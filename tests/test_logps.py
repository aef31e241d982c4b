"""The log-prob math (common/model.py, grpo.py's grouped and dpo.py's paired scoring, grpo.py's advantages and
loss aggregation) against naive references and hand-computed values (CPU, tiny random models, no hub access)."""

import math

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import common.model
import dpo
import grpo
from common.completions import concat_pairs
from common.model import (
    chunked_logps,
    entropy_from_logits,
    head_is_plain_linear,
    length_groups,
    masked_mean,
    masked_sum,
    sequence_logps,
)
from common.completions import completion_logps
from dpo import pair_completion_logps
from grpo import aggregate_loss, group_advantages, grouped_completion_logps, kl_k3

pytestmark = pytest.mark.numerics  # every test here compares log-prob math with a naive reference or TRL

VOCAB = 101
TINY = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    vocab_size=VOCAB,
    pad_token_id=0,
)


def tiny_model(arch="qwen2", seed=0, **overrides):
    torch.manual_seed(seed)
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**TINY, **overrides)).eval()
    if arch == "gpt2":  # learned absolute positions: the model where wrong position_ids change logps
        return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB)).eval()
    return LlamaForCausalLM(LlamaConfig(**TINY)).eval()


def lora_model(arch="qwen2", target_modules="all-linear"):
    model = tiny_model(arch)
    torch.manual_seed(1)
    # init_lora_weights=False: random non-zero B, so the adapter changes the logits and a bug in it would show
    config = LoraConfig(r=4, lora_alpha=8, target_modules=target_modules, init_lora_weights=False)
    return get_peft_model(model, config)


# ---------------------------------------------------------------- chunked_logps vs log_softmax + gather


def naive_logps(hidden, weight, labels, temperature=1.0, bias=None):
    logits = hidden.float() @ weight.float().T + (0 if bias is None else bias.float())
    logits = logits / temperature
    return logits.log_softmax(-1).gather(-1, labels[:, None]).squeeze(-1), entropy_from_logits(logits)


def leaves(n, h, v, dtype, bias, seed=0):
    torch.manual_seed(seed)
    hidden = (torch.randn(n, h) * 2).to(dtype).requires_grad_()
    weight = torch.randn(v, h).to(dtype).requires_grad_()
    b = torch.randn(v).to(dtype).requires_grad_() if bias else None
    return hidden, weight, b, torch.randint(0, v, (n,))


# bf16 inputs: both sides build the same fp32 logits from the same bf16 values, so logps agree to fp32 rounding
# (chunked vs whole matmul); grads are fp32 sums rounded once to bf16, so they may differ by 1 bf16 ulp (< 2^-7
# relative). Measured on this data: bit-identical. (HF's lm_head(h).float() rounds logits to bf16 first instead.)
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-5, rtol=2**-7)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature,chunk_size,bias", [(1.0, 1024, False), (0.7, 7, True), (1.3, 4, False)])
def test_chunked_logps_matches_naive(dtype, temperature, chunk_size, bias):
    hidden, weight, b, labels = leaves(30, 16, 53, dtype, bias)  # N=30: chunk 7 and 4 do not divide it
    logps, entropy = chunked_logps(hidden, weight, labels, temperature, chunk_size, b, return_entropy=True)
    ref, ref_entropy = naive_logps(hidden, weight, labels, temperature, b)
    assert logps.dtype == entropy.dtype == torch.float32 and not entropy.requires_grad
    torch.testing.assert_close(logps, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=1e-5)
    g = torch.randn(30)  # random upstream grad, so every row's scale matters
    params = [hidden, weight] + ([b] if bias else [])
    ours = torch.autograd.grad((logps * g).sum(), params)
    theirs = torch.autograd.grad((ref * g).sum(), params)
    for a, r in zip(ours, theirs, strict=True):
        assert a.dtype == dtype
        torch.testing.assert_close(a, r, **TOL[dtype])


def test_chunked_logps_frozen_head_gets_no_grad():
    hidden, weight, _, labels = leaves(12, 8, 29, torch.float32, False)
    weight.requires_grad_(False)  # frozen base head under LoRA
    logps = chunked_logps(hidden, weight, labels, chunk_size=5)
    logps.sum().backward()
    assert weight.grad is None
    ref_hidden = hidden.detach().clone().requires_grad_()
    naive_logps(ref_hidden, weight, labels)[0].sum().backward()
    torch.testing.assert_close(hidden.grad, ref_hidden.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature,chunk_size,bias", [(1.0, 1024, False), (0.7, 7, True), (1.3, 4, False)])
def test_a_frozen_head_backward_scales_the_forward_gradient_and_recomputes_no_logits(
    dtype, temperature, chunk_size, bias, monkeypatch
):
    """Frozen head (LoRA): the forward computes d logp / d h = (W_y - softmax(z) W) / T; backward only scales it by
    the incoming gradient, with no (chunk, V) logits recomputed. The gradient equals the naive one."""
    hidden, weight, b, labels = leaves(30, 16, 53, dtype, bias)
    weight.requires_grad_(False)
    if bias:
        b.requires_grad_(False)
    calls = []
    chunk_logits = common.model._chunk_logits
    monkeypatch.setattr(common.model, "_chunk_logits", lambda *a: calls.append(1) or chunk_logits(*a))
    logps = chunked_logps(hidden, weight, labels, temperature, chunk_size, b)
    forward_calls = len(calls)
    assert forward_calls == -(-30 // chunk_size)  # one per chunk
    g = torch.randn(30)
    (ours,) = torch.autograd.grad((logps * g).sum(), hidden)
    assert len(calls) == forward_calls  # backward made no logits
    ref = naive_logps(hidden, weight, labels, temperature, b)[0]
    (theirs,) = torch.autograd.grad((ref * g).sum(), hidden)
    assert ours.dtype == dtype
    torch.testing.assert_close(logps, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours, theirs, **TOL[dtype])


def test_chunked_logps_stays_fp32_under_autocast():
    """A bf16 autocast region (as around a training forward) must not turn the head matmuls into bf16."""
    hidden, weight, _, labels = leaves(20, 16, 53, torch.float32, False)
    ref = naive_logps(hidden, weight, labels)[0]
    (ref_grad,) = torch.autograd.grad(ref.sum(), hidden)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logps = chunked_logps(hidden, weight, labels, chunk_size=6)
        (grad,) = torch.autograd.grad(logps.sum(), hidden)
    torch.testing.assert_close(logps, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-5)


def test_chunked_logps_without_entropy_returns_tensor():
    hidden, weight, _, labels = leaves(6, 8, 11, torch.float32, False)
    out = chunked_logps(hidden, weight, labels)
    assert isinstance(out, torch.Tensor) and out.shape == (6,)


def test_entropy_from_logits_hand_values():
    inf = math.inf
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, -inf, 0.0, -inf], [5.0, -inf, -inf, -inf]])
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([math.log(4), math.log(2), 0.0]))


# ---------------------------------------------------------------- sequence_logps vs model(...).logits


def naive_sequence_logps(model, input_ids, attention_mask, logps_mask, temperature=1.0):
    """Reference: full logits from model(...) with correct positions, log_softmax, gather, same target rule."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logits = logits[:, :-1].float() / temperature
    logps = logits.log_softmax(-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    keep = logps_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
    entropy = entropy_from_logits(logits)
    pad = torch.nn.functional.pad
    return pad(torch.where(keep, logps, 0.0), (1, 0)), pad(torch.where(keep, entropy, 0.0), (1, 0)).detach()


LENGTHS = [9, 5, 7]


def batch(lengths, padding_side, prompt_len=2, seed=0):
    """Random rows of the given lengths padded to the max; logps_mask covers the tokens after a 2-token prompt."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]
    T = max(lengths)
    input_ids = torch.zeros(len(rows), T, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    logps_mask = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        s = slice(T - len(row), T) if padding_side == "left" else slice(0, len(row))
        input_ids[i, s], attention_mask[i, s] = row, 1
        logps_mask[i, s.start + prompt_len : s.stop] = 1
    return input_ids, attention_mask, logps_mask, rows


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_decoder_output_is_post_norm_and_feeds_lm_head(arch):
    """transformers 5.24: get_decoder() returns the base model; lm_head(last_hidden_state) == model(...).logits."""
    model = tiny_model(arch)
    input_ids, attention_mask, _, _ = batch(LENGTHS, "right")
    normed = []
    model.model.norm.register_forward_hook(lambda module, args, out: normed.append(out))
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    assert model.get_decoder() is model.model
    torch.testing.assert_close(hidden, normed[0], atol=0, rtol=0)  # last_hidden_state is the final norm's output
    torch.testing.assert_close(model.get_output_embeddings()(hidden), logits, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "gpt2"])
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_sequence_logps_matches_naive(arch, padding_side):
    model = tiny_model(arch)
    input_ids, attention_mask, logps_mask, _ = batch(LENGTHS, padding_side)
    logps, entropy = sequence_logps(model, input_ids, attention_mask, logps_mask, temperature=0.9, return_entropy=True)
    ref, ref_entropy = naive_sequence_logps(model, input_ids, attention_mask, logps_mask, temperature=0.9)
    assert logps.dtype == torch.float32 and logps.shape == input_ids.shape
    torch.testing.assert_close(logps, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=1e-5)
    unscored = ~(logps_mask.bool() & (attention_mask.cumsum(-1) > 1))
    assert (logps[unscored] == 0).all() and (logps[~unscored] < 0).all()  # exact zeros off the mask, incl. t=0


@pytest.mark.parametrize("arch", ["qwen2", "llama", "gpt2"])
def test_left_padded_equals_unpadded_single_sequence(arch):
    """Derived position_ids make left padding invisible. With HF's arange default, RoPE models only see a constant
    shift (a no-op), but GPT-2's absolute positions move: TRL #6800 measured 34 nats on a GPT-2 sequence."""
    model = tiny_model(arch)
    input_ids, attention_mask, _, rows = batch(LENGTHS, "left")
    with torch.no_grad():
        padded = sequence_logps(model, input_ids, attention_mask, attention_mask)
        for i, row in enumerate(rows):
            ones = torch.ones(1, len(row), dtype=torch.long)
            single = sequence_logps(model, row[None], ones, ones)
            torch.testing.assert_close(padded[i, -len(row) :], single[0], atol=1e-5, rtol=1e-5)
        arange = torch.arange(input_ids.shape[1])[None]
        wrong = sequence_logps(model, input_ids, attention_mask, attention_mask, position_ids=arange)
    if arch == "gpt2":
        assert (wrong - padded).abs().max() > 1e-2  # the bug the derivation prevents is real here


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_sequence_logps_runs_padded_rows_in_length_groups(padding_side):
    """Rows of similar length run together, each group cut to its longest row: the decoder never sees the padding
    of a short row in a batch with a long one (here 4 x 30 padded tokens become 2 x 30 + 2 x 5), same numbers."""
    model = tiny_model()
    input_ids, attention_mask, logps_mask, _ = batch([30, 4, 29, 5], padding_side)
    seen = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    with torch.no_grad():
        logps = sequence_logps(model, input_ids, attention_mask, logps_mask)
    hook.remove()
    assert sorted(seen) == [(2, 5), (2, 30)]
    ref, _ = naive_sequence_logps(model, input_ids, attention_mask, logps_mask)
    torch.testing.assert_close(logps, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_right_padded_rows_run_without_the_padding_mask(arch):
    """Right padding only: a real token sees no pad under the causal mask, so the model gets no attention_mask
    (SDPA's causal path) and positions arange(T); left-padded rows keep theirs. Same numbers as the masked forward."""
    model = tiny_model(arch)
    seen = {}
    for side in ("right", "left"):
        input_ids, attention_mask, logps_mask, _ = batch([9, 7, 8], side)  # one group: 3 x 9 <= 1.125 x 24

        def record(module, args, kwargs, side=side):
            seen[side] = kwargs["attention_mask"]

        hook = model.get_decoder().register_forward_pre_hook(record, with_kwargs=True)
        with torch.no_grad():
            logps = sequence_logps(model, input_ids, attention_mask, logps_mask)
        hook.remove()
        ref, _ = naive_sequence_logps(model, input_ids, attention_mask, logps_mask)
        torch.testing.assert_close(logps, ref, atol=1e-5, rtol=1e-5)
    assert seen["right"] is None and torch.equal(seen["left"], batch([9, 7, 8], "left")[1])


def test_length_groups_spans_and_empty_rows():
    mask = torch.tensor([[0] * (9 - n) + [1] * n for n in (7, 1, 8)])  # left-padded rows of 7, 1 and 8 tokens
    assert length_groups(mask) == [([2, 0], 1, 9), ([1], 8, 9)]  # 2 x 8 <= 1.125 x 15; 3 x 8 > 1.125 x 16
    assert length_groups(torch.tensor([[1, 1], [0, 0]])) is None  # an empty row: the one padded batch is kept


def test_sequence_logps_chunk_size_does_not_matter():
    model = tiny_model()
    input_ids, attention_mask, logps_mask, _ = batch(LENGTHS, "right")
    with torch.no_grad():
        small = sequence_logps(model, input_ids, attention_mask, logps_mask, chunk_size=3)
        big = sequence_logps(model, input_ids, attention_mask, logps_mask)
    torch.testing.assert_close(small, big, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("arch,padding_side", [("qwen2", "right"), ("qwen2", "left"), ("llama", "left")])
def test_lora_values_and_grads_match_naive(arch, padding_side):
    model = lora_model(arch)
    input_ids, attention_mask, logps_mask, _ = batch(LENGTHS, padding_side)
    with torch.no_grad(), model.disable_adapter():
        base = sequence_logps(model, input_ids, attention_mask, logps_mask)
    logps = sequence_logps(model, input_ids, attention_mask, logps_mask, chunk_size=3)
    ref, _ = naive_sequence_logps(model, input_ids, attention_mask, logps_mask)
    assert (logps - base).abs().max() > 1e-3  # the adapter matters
    torch.testing.assert_close(logps, ref, atol=1e-5, rtol=1e-5)
    lora = [p for n, p in model.named_parameters() if p.requires_grad]
    assert lora and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    weights = torch.randn(logps.shape, generator=torch.Generator().manual_seed(3))
    ours = torch.autograd.grad((logps * weights).sum(), lora)
    theirs = torch.autograd.grad((ref * weights).sum(), lora)
    for a, r in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-4)


def test_full_finetune_grads_match_naive_with_tied_head():
    """Trainable head tied to the embeddings (Qwen2.5-0.5B ties them): every parameter's grad equals the naive one."""
    model = tiny_model(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    input_ids, attention_mask, logps_mask, _ = batch(LENGTHS, "left")
    logps = sequence_logps(model, input_ids, attention_mask, logps_mask, temperature=0.8, chunk_size=4)
    ref, _ = naive_sequence_logps(model, input_ids, attention_mask, logps_mask, temperature=0.8)
    params = list(model.parameters())
    for a, r in zip(torch.autograd.grad(logps.sum(), params), torch.autograd.grad(ref.sum(), params), strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-4)


def test_fallback_paths_match_naive(monkeypatch):
    """LoRA on lm_head (not a plain nn.Linear) and a softcapping config both take the model(...).logits path."""

    def chunked_must_not_run(*args, **kwargs):
        raise AssertionError("expected the naive model(...).logits path")

    monkeypatch.setattr(common.model, "chunked_logps", chunked_must_not_run)
    model = lora_model(target_modules=["q_proj", "lm_head"])
    input_ids, attention_mask, logps_mask, _ = batch(LENGTHS, "left")
    with torch.no_grad():
        logps = sequence_logps(model, input_ids, attention_mask, logps_mask)
        ref, _ = naive_sequence_logps(model, input_ids, attention_mask, logps_mask)
        torch.testing.assert_close(logps, ref, atol=1e-5, rtol=1e-5)
        plain = tiny_model()
        plain.config.final_logit_softcapping = 30.0  # Qwen2 ignores it, so both paths must still agree
        logps = sequence_logps(plain, input_ids, attention_mask, logps_mask)
        torch.testing.assert_close(logps, naive_sequence_logps(plain, input_ids, attention_mask, logps_mask)[0])


def hybrid_model(arch, lm_head_multiplier=0.25):
    """Tiny models with recurrent layers whose forward rescales what lm_head returns (the config key says so)."""
    from transformers import FalconH1Config, FalconH1ForCausalLM, RecurrentGemmaConfig, RecurrentGemmaForCausalLM

    torch.manual_seed(0)
    if arch == "falcon_h1":  # logits = lm_head(h) * lm_head_multiplier (a mamba/attention hybrid)
        mamba = dict(mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8)
        config = FalconH1Config(**TINY, **mamba, mamba_chunk_size=16, lm_head_multiplier=lm_head_multiplier)
        return FalconH1ForCausalLM(config).eval()
    # logits = tanh(lm_head(h) / cap) * cap
    blocks = dict(block_types=["recurrent", "attention"], lru_width=32)
    config = RecurrentGemmaConfig(**{**TINY, "num_key_value_heads": 1}, **blocks, logits_soft_cap=2.0)
    return RecurrentGemmaForCausalLM(config).eval()


@pytest.mark.parametrize("arch", ["falcon_h1", "recurrent_gemma"])
def test_heads_scaled_in_the_forward_take_the_naive_path(arch):
    """Falcon-H1's lm_head_multiplier and RecurrentGemma's logits_soft_cap act after the head: the chunked head on
    the decoder's states gave other log-probs (0.19 and 0.013 nats off here); they must equal model(...).logits'.
    Inkling's keys (hidden states divided before the head, padded vocab cut after it) pick the same path."""
    model = hybrid_model(arch)
    input_ids, attention_mask, logps_mask, _ = batch(LENGTHS, "right")
    with torch.no_grad():
        logps, entropy = sequence_logps(model, input_ids, attention_mask, logps_mask, return_entropy=True)
        ref, ref_entropy = naive_sequence_logps(model, input_ids, attention_mask, logps_mask)
    torch.testing.assert_close(logps, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=1e-5)
    plain = tiny_model()
    assert head_is_plain_linear(plain)
    for key, value in (("logits_mup_width_multiplier", 24.0), ("unpadded_vocab_size", VOCAB - 5)):
        setattr(plain.config, key, value)
        assert not head_is_plain_linear(plain), key
        delattr(plain.config, key)


def grouped_case(G=3, seed=0):
    """2 prompts (lengths 4 and 7: left padding in the shared pass) x G completions of lengths 1..6."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (4, 7)]
    completions = [torch.randint(1, VOCAB, (1 + (5 * i) % 6,), generator=g).tolist() for i in range(2 * G)]
    return prompts, completions


def unshared_logps(model, prompts, completions, G, temperature, entropy=False):
    """Reference: sequence_logps on each prompt+completion row (prompt repeated), cut to the completion columns."""
    rows = [p for p in prompts for _ in range(G)]
    out = [
        sequence_logps(
            model,
            torch.tensor([p + c]),
            torch.ones(1, len(p) + len(c), dtype=torch.long),
            torch.tensor([[0] * len(p) + [1] * len(c)]),
            temperature=temperature,
            return_entropy=entropy,
        )
        for p, c in zip(rows, completions)
    ]
    out = [o if entropy else (o,) for o in out]
    width = max(map(len, completions))
    pad = torch.nn.functional.pad
    return [
        torch.cat([pad(o[k][:, len(p) :], (0, width - len(c))) for o, p, c in zip(out, rows, completions)])
        for k in range(len(out[0]))
    ]


@pytest.mark.parametrize("arch", ["qwen2", "llama", "gpt2"])
def test_grouped_completion_logps_match_unshared_rows(arch):
    """One prompt pass per group (its KV cache repeated G times) gives each row's own log-probs and entropies."""
    model, G = tiny_model(arch), 3
    prompts, completions = grouped_case(G)
    with torch.no_grad():
        logps, mask, entropy = grouped_completion_logps(
            model, prompts, completions, G, pad_id=0, temperature=0.8, chunk_size=5, return_entropy=True
        )
        ref, ref_entropy = unshared_logps(model, prompts, completions, G, 0.8, entropy=True)
    assert mask.tolist() == [[1] * len(c) + [0] * (6 - len(c)) for c in completions]
    torch.testing.assert_close(logps, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=1e-5)
    assert (logps[mask.bool()] < 0).all() and (logps[~mask.bool()] == 0).all()


@pytest.mark.parametrize("G", [1, 2])
def test_grouped_completion_logps_edge_cases_match_unshared_rows(G):
    """Groups of one, a 1-token prompt beside a long one (5 left-padding columns), 1-token completions, and DPO pairs
    with 1-token prompts and completions: the shared-prompt paths give the unshared rows' log-probs."""
    model, g = tiny_model("gpt2"), torch.Generator().manual_seed(5)  # absolute positions: padding would show
    ids = lambda n: torch.randint(1, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    prompts, completions = [ids(1), ids(6)], [ids(n) for n in (1, 3, 1, 1)[: 2 * G]]
    with torch.no_grad():
        logps, mask, entropy = grouped_completion_logps(model, prompts, completions, G, 0, 0.7, return_entropy=True)
        ref, ref_entropy = unshared_logps(model, prompts, completions, G, 0.7, entropy=True)
        examples = [dict(prompt_ids=p, chosen_ids=ids(1), rejected_ids=ids(n)) for p, n in zip(prompts, (1, 2))]
        batch = concat_pairs(examples, 0, "cpu")
        torch.testing.assert_close(pair_completion_logps(model, batch), completion_logps(model, batch))
    torch.testing.assert_close(logps, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=1e-5)
    assert mask.sum().item() == sum(map(len, completions)) and (logps[mask.bool()] < 0).all()


def test_grouped_completion_logps_lora_grads_match_unshared_rows():
    """The gradient reaches the adapter through the shared prompt pass too (the completions' keys/values of the
    prompt): summed over the group, it equals the gradient of the unshared rows."""
    model, G = lora_model("qwen2"), 2
    prompts, completions = grouped_case(G, seed=1)
    logps, mask = grouped_completion_logps(model, prompts, completions, G, pad_id=0, temperature=0.9)
    ref = unshared_logps(model, prompts, completions, G, 0.9)[0]
    torch.testing.assert_close(logps, ref, atol=1e-5, rtol=1e-5)
    lora = [p for p in model.parameters() if p.requires_grad]
    weights = torch.randn(logps.shape, generator=torch.Generator().manual_seed(3))
    for a, r in zip(
        torch.autograd.grad((logps * weights).sum(), lora),
        torch.autograd.grad((ref * weights).sum(), lora),
        strict=True,
    ):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-4)


def test_grouped_completion_logps_fallbacks_match(monkeypatch):
    """Gradient checkpointing in train mode (transformers then drops the KV cache) and a LoRA'd lm_head both score
    the concatenated rows instead: same numbers, no sharing."""
    model, G = lora_model("qwen2", target_modules=["q_proj", "v_proj", "lm_head"]), 2
    prompts, completions = grouped_case(G, seed=2)
    with torch.no_grad():
        ref = unshared_logps(model, prompts, completions, G, 1.0)[0]
        calls = []
        monkeypatch.setattr(grpo, "sequence_logps", lambda *a, **k: calls.append(1) or sequence_logps(*a, **k))
        logps, _ = grouped_completion_logps(model, prompts, completions, G, pad_id=0)
        assert calls, "a LoRA'd lm_head must take the concatenated-rows path"
        torch.testing.assert_close(logps, ref, atol=1e-5, rtol=1e-5)
        plain = lora_model("qwen2")
        plain.activation_checkpointing_enable()
        plain.train()
        for module in plain.modules():  # dropout is 0 here already; train mode is what switches checkpointing on
            assert not isinstance(module, torch.nn.Dropout) or module.p == 0
        calls.clear()
        logps, _ = grouped_completion_logps(plain, prompts, completions, G, pad_id=0)
        assert calls, "gradient checkpointing in train mode must take the concatenated-rows path"
        plain.eval()
        torch.testing.assert_close(logps, unshared_logps(plain, prompts, completions, G, 1.0)[0], atol=1e-5, rtol=1e-5)


def test_models_with_recurrent_states_do_not_share_a_prompt_pass():
    """Falcon-H1's cache holds conv and SSM states that batch_repeat_interleave and a rebuilt cache do not copy: the
    grouped and pair paths crashed on it (tensor sizes); they now score the concatenated rows (same numbers)."""
    model = hybrid_model("falcon_h1", lm_head_multiplier=1.0)  # a plain head: only the cache keeps it unshared
    assert head_is_plain_linear(model)
    prompts, completions = grouped_case(2)
    examples = [
        dict(prompt_ids=p, chosen_ids=c, rejected_ids=r) for p, c, r in zip(prompts, completions, completions[2:])
    ]
    batch = concat_pairs(examples, 0, "cpu")
    with torch.no_grad():
        logps, _ = grouped_completion_logps(model, prompts, completions, 2, pad_id=0, temperature=0.8)
        torch.testing.assert_close(logps, unshared_logps(model, prompts, completions, 2, 0.8)[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pair_completion_logps(model, batch), completion_logps(model, batch))


@pytest.mark.parametrize("arch", ["qwen2", "llama", "gpt2"])
def test_pair_completion_logps_match_completion_logps(arch):
    """DPO pairs with each prompt run once (its keys/values reused for chosen and rejected): the same per-token
    log-probs, sums and adapter gradients as the concatenated [chosen; rejected] batch."""
    model = lora_model(arch, target_modules=["c_attn", "c_fc"] if arch == "gpt2" else "all-linear")
    g = torch.Generator().manual_seed(4)
    ids = lambda n: torch.randint(1, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    examples = [dict(prompt_ids=ids(p), chosen_ids=ids(c), rejected_ids=ids(r)) for p, c, r in [(5, 3, 7), (2, 6, 1)]]
    batch = concat_pairs(examples, 0, "cpu")
    sums, per_token = pair_completion_logps(model, batch)
    ref_sums, ref_per_token = completion_logps(model, batch)
    torch.testing.assert_close(per_token, ref_per_token, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sums, ref_sums, atol=1e-5, rtol=1e-5)
    scored = batch["completion_mask"].bool()
    assert (per_token[scored] < 0).all() and (per_token[~scored] == 0).all()
    lora = [p for p in model.parameters() if p.requires_grad]
    weights = torch.tensor([0.3, -1.0, 0.7, 2.0])
    for a, r in zip(
        torch.autograd.grad((sums * weights).sum(), lora), torch.autograd.grad((ref_sums * weights).sum(), lora)
    ):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-4)


def test_pair_completion_logps_falls_back_on_an_empty_prompt(monkeypatch):
    model = tiny_model()
    examples = [dict(prompt_ids=[], chosen_ids=[3, 4, 5], rejected_ids=[6, 7])]
    batch = concat_pairs(examples, 0, "cpu")
    calls = []
    monkeypatch.setattr(dpo, "completion_logps", lambda *a: calls.append(1) or completion_logps(*a))
    with torch.no_grad():
        torch.testing.assert_close(pair_completion_logps(model, batch), completion_logps(model, batch))
    assert calls


# ---------------------------------------------------------------- masked reductions


def test_masked_sum_and_mean_hand_values():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, float("nan")]])
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]])
    assert masked_sum(values, mask).item() == 13.0  # the NaN sits under the mask and must not leak
    assert masked_mean(values, mask.bool()).item() == 13.0 / 4
    torch.testing.assert_close(masked_sum(values, mask.float(), dim=1), torch.tensor([4.0, 9.0]))
    torch.testing.assert_close(masked_mean(values, mask, dim=1), torch.tensor([2.0, 4.5]))
    torch.testing.assert_close(masked_mean(values, mask, dim=0), torch.tensor([2.5, 5.0, 3.0]))


def test_masked_mean_empty_mask():
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    with pytest.raises(ValueError, match="empty mask"):
        masked_mean(values, torch.zeros(2, 2))
    row_empty = torch.tensor([[1, 1], [0, 0]])
    with pytest.raises(ValueError, match="empty mask"):
        masked_mean(values, row_empty, dim=1)
    torch.testing.assert_close(masked_mean(values, row_empty, dim=1, empty="zero"), torch.tensor([1.5, 0.0]))


# ---------------------------------------------------------------- KL estimators


def test_kl_k3():
    """k3 >= 0, exactly 0 at equality, a hand value, and an unbiased estimate of KL(p || q) on samples from p."""
    torch.manual_seed(0)
    logps, ref = -torch.rand(1000) * 5, -torch.rand(1000) * 5
    assert (kl_k3(logps, ref) >= 0).all()
    assert (kl_k3(logps, logps) == 0).all()
    # log ratio r = ref - logp = -1: e^-1 + 1 - 1 = 0.3679, in fp32: the sum passes through 1.37, whose ulp is 1.2e-7,
    # and exp is within an ulp or two depending on the CPU's kernel, so the bound is 2.5e-7, not 1e-7
    assert kl_k3(torch.tensor([-1.0]), torch.tensor([-2.0])).item() == pytest.approx(math.exp(-1), abs=2.5e-7)
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.2, 0.6])
    exact = (p * (p / q).log()).sum()  # KL(p || q) = 0.4230
    samples = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    logp, logq = p.log()[samples], q.log()[samples]
    assert abs(kl_k3(logp, logq).mean() - exact) < 0.01


# ---------------------------------------------------------------- GRPO advantages and loss aggregation


def test_group_advantages_hand_values():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv, std = group_advantages(rewards, 4)
    s = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]: sum sq dev = 1, / (4 - 1)
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5]) / (s + 1e-4)
    torch.testing.assert_close(adv, torch.cat([expected, torch.zeros(4)]))
    torch.testing.assert_close(std, torch.tensor([s] * 4 + [0.0] * 4))
    batch_std = rewards.std()  # batch mean 1.25: squared deviations 2 x 0.0625, 2 x 1.5625, 4 x 0.5625; / (8 - 1)
    assert abs(batch_std.item() - math.sqrt(5.5 / 7)) < 1e-6
    adv_batch, _ = group_advantages(rewards, 4, "batch")
    torch.testing.assert_close(adv_batch, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]) / (batch_std + 1e-4))
    adv_none, _ = group_advantages(rewards, 4, "none")
    torch.testing.assert_close(adv_none, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    assert not group_advantages(torch.full((4,), 3.0), 2)[0].isnan().any()


def test_group_advantages_rejects_bad_input():
    with pytest.raises(ValueError, match="group_size >= 2"):
        group_advantages(torch.tensor([1.0, 2.0]), 1)
    with pytest.raises(ValueError):
        group_advantages(torch.tensor([1.0, 2.0, 3.0]), 2)
    with pytest.raises(ValueError):
        group_advantages(torch.tensor([1.0, float("nan")]), 2)


def test_group_advantages_match_trl_formula():
    """Reference: trl/trainer/grpo_trainer.py `_generate_and_score_completions`, sum_then_normalize (TRL 1.16)."""
    nanstd = pytest.importorskip("trl.trainer.utils").nanstd
    torch.manual_seed(0)
    rewards, G = torch.randint(0, 3, (24,)).float(), 4
    mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    group_std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    batch_std = nanstd(rewards).expand_as(rewards)
    for scale, std in [("group", group_std), ("batch", batch_std), ("none", None)]:
        trl_adv = rewards - mean if std is None else (rewards - mean) / (std + 1e-4)
        adv, std_grouped = group_advantages(rewards, G, scale)
        torch.testing.assert_close(adv, trl_adv)
        torch.testing.assert_close(std_grouped, group_std)


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


@pytest.mark.parametrize(
    "loss_type,expected",
    [
        ("grpo", ((1 + 2) / 2 + 4 / 1) / 2),  # 2.75
        ("bnpo", (1 + 2 + 4) / 3),
        ("dr_grpo", (1 + 2 + 4) / (2 * 5)),  # max_completion_length = 5
        ("dapo", (1 + 2 + 4) / 3),
    ],
)
def test_aggregate_loss_hand_values(loss_type, expected):
    assert abs(aggregate_loss(LOSS, MASK, loss_type, max_completion_length=5).item() - expected) < 1e-6


def test_aggregate_loss_edge_cases():
    assert aggregate_loss(LOSS, torch.tensor([[1, 1, 0], [0, 0, 0]]), "grpo").item() == 1.5 / 2  # empty row adds 0
    assert aggregate_loss(LOSS, torch.zeros(2, 3), "dapo").item() == 0.0  # all masked: zero, not NaN
    with pytest.raises(ValueError, match="max_completion_length"):
        aggregate_loss(LOSS, MASK, "dr_grpo")
    with pytest.raises(ValueError):
        aggregate_loss(LOSS, MASK, "sapo")


def trl_compute_loss(per_token_loss, mask, loss_type, max_completion_length, ga, num_items_in_batch, spg=None):
    """trl/trainer/grpo_trainer.py `_compute_loss` aggregation (TRL 1.16, train mode, 1 process), reimplemented.

    ga = current_gradient_accumulation_steps, spg = steps_per_generation (TRL's default: spg = ga)."""
    spg = ga if spg is None else spg
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / ga
    if loss_type == "bnpo":
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0) / ga
    if loss_type == "dr_grpo":
        return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length) / ga
    normalizer = num_items_in_batch.clamp(min=1.0) * ga / spg
    return (per_token_loss * mask).sum() / normalizer


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_aggregate_loss_micro_batches_equal_one_batch(loss_type):
    """Documented caller rule: num_sequences and num_items count the whole optimizer step. Also vs TRL with GA=2."""
    torch.manual_seed(0)
    theta = torch.randn(4, 6, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]])
    per_token_loss = lambda rows: theta[rows].sin() * torch.arange(1.0, 7.0)  # noqa: E731
    step = dict(max_completion_length=6, num_items=mask.sum(), num_sequences=4)
    (full,) = torch.autograd.grad(aggregate_loss(per_token_loss(slice(0, 4)), mask, loss_type, **step), theta)
    micro = sum(aggregate_loss(per_token_loss(r), mask[r], loss_type, **step) for r in (slice(0, 2), slice(2, 4)))
    (split,) = torch.autograd.grad(micro, theta)
    torch.testing.assert_close(split, full)
    # TRL with gradient_accumulation_steps=2; its bnpo is a mean of micro-batch means, reproduced with
    # num_items = micro-batch tokens * GA (see aggregate_loss docstring)
    for r in (slice(0, 2), slice(2, 4)):
        trl = trl_compute_loss(per_token_loss(r), mask[r], loss_type, 6, 2, mask.sum().float())
        ours = dict(step, num_items=mask[r].sum() * 2) if loss_type == "bnpo" else step
        torch.testing.assert_close(aggregate_loss(per_token_loss(r), mask[r], loss_type, **ours), trl)


# ------------------------------------------------------------------------------------ a GPU's shapes (BUCKETS)
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_a_gpus_one_bucketed_pass_scores_what_length_groups_score(padding_side, monkeypatch):
    """On a GPU (common.model.BUCKETS) a padded batch runs as one pass, its width rounded up to the bucket with
    columns that score nothing: the same log-probs, entropies and LoRA gradients as the CPU's length groups."""
    model = lora_model()
    input_ids, attention_mask, logps_mask, _ = batch([30, 4, 29, 5], padding_side)
    out = {}
    for bucket in (1, 16):
        monkeypatch.setitem(common.model.BUCKETS, "cpu", bucket)
        seen = []
        embeddings = model.get_input_embeddings()
        hook = embeddings.register_forward_hook(lambda m, args, o, seen=seen: seen.append(tuple(args[0].shape)))
        logps, entropy = sequence_logps(model, input_ids, attention_mask, logps_mask, return_entropy=True)
        hook.remove()
        lora = [p for p in model.parameters() if p.requires_grad]
        out[bucket] = (seen, logps, entropy, torch.autograd.grad(logps.sum(), lora))
    assert sorted(out[1][0]) == [(2, 5), (2, 30)] and out[16][0] == [(4, 32)]
    assert out[16][1].shape == input_ids.shape
    for cpu, gpu in zip(out[1][1:3] + out[1][3], out[16][1:3] + out[16][3], strict=True):
        torch.testing.assert_close(gpu, cpu, atol=1e-5, rtol=1e-4)


def test_a_gpus_bucketed_packed_rows_score_what_the_unbucketed_ones_score(monkeypatch):
    """Packed rows (position_ids restarting per document, no attention mask) on a GPU: the added columns are one
    more document that scores nothing."""
    model = tiny_model()
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1, VOCAB, (2, 13), generator=g)
    position_ids = torch.tensor([list(range(5)) + list(range(8)), list(range(13))])
    logps_mask = torch.ones_like(input_ids)
    with torch.no_grad():
        plain = sequence_logps(model, input_ids, None, logps_mask, position_ids)
        monkeypatch.setitem(common.model.BUCKETS, "cpu", 16)
        bucketed = sequence_logps(model, input_ids, None, logps_mask, position_ids)
    torch.testing.assert_close(bucketed, plain, atol=1e-5, rtol=1e-5)


def test_a_gpus_bucketed_grouped_pass_scores_what_the_unshared_rows_score(monkeypatch):
    """grpo's grouped pass on a GPU: prompts left-padded and completions right-padded to the bucket, the prompts'
    4D mask, the completion tokens picked by positions the host computed: the unshared rows' numbers, gradients
    included."""
    monkeypatch.setitem(common.model.BUCKETS, "cpu", 8)
    model, G = lora_model("qwen2"), 3
    prompts, completions = grouped_case(G, seed=1)
    logps, mask, entropy = grouped_completion_logps(model, prompts, completions, G, 0, 0.8, return_entropy=True)
    ref, ref_entropy = unshared_logps(model, prompts, completions, G, 0.8, entropy=True)
    assert mask.tolist() == [[1] * len(c) + [0] * (logps.shape[1] - len(c)) for c in completions]
    torch.testing.assert_close(logps, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=1e-5)
    lora = [p for p in model.parameters() if p.requires_grad]
    for a, r in zip(torch.autograd.grad(logps.sum(), lora), torch.autograd.grad(ref.sum(), lora), strict=True):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-4)

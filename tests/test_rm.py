"""rm.py and plugins/reward_model.py: the losses by hand, the head's pooling, end to end on the tiny model (a separable
set learnt, regression MSE falling, the saved format loading with plain PEFT/transformers, resume), the "reward" slot's
guard, and a GRPO run whose model reward rises while "reward", "ref" and the base stay bit-identical."""

import dataclasses
import json
import math
import os
import pathlib
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import grpo
from common.data import setup_chat_template
from common.errors import DataError
from harness.errors import CorruptCheckpointError, ResumeError
from common.model import REWARD, attach_lora, load_model, snapshot_ref, trainable_parameters
from plugins.reward_model import CONFIG_FILE, HEAD_FILE, label_rows, load_reward, model_reward, reward_logits, score
from rm import Args, bradley_terry_loss, main, regression_loss
from tests.prefs_helpers import assert_base_untouched, preference_rows, run_cli, slot_state, write_jsonl
from tests.tiny import write_learnable

LOW = 200  # the learnable model's split of the vocabulary, as tests/test_grpo.py
WORDS = ("red", "blue", "green", "yes", "good", "hello")  # regression rows: both scores follow the last word
QUESTIONS = ["What is 12 plus 7?", "Say hello", "Tom has 3 apples.", "Name a colour", "Count to 3"]


def run(model_dir, dataset, tmp_path, **kw):
    defaults = dict(
        model=model_dir,
        dataset=dataset,
        output_dir=str(tmp_path / "runs"),
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        max_steps=12,
        save_steps=0,
    )
    return main(Args(**{**defaults, **kw}))


def swapped(rows):
    return [r | {"chosen": r["rejected"], "rejected": r["chosen"]} for r in rows]


# ------------------------------------------------------------------------------------------------ losses
@pytest.mark.numerics
def test_bradley_terry_loss_by_hand():
    c, r = torch.tensor([0.0, 2.0]), torch.tensor([0.0, -1.0])
    assert bradley_terry_loss(c, r).item() == pytest.approx((math.log(2) + math.log1p(math.exp(-3))) / 2)
    margin = torch.tensor([1.0, 0.5])  # -log s(0 - 1), -log s(3 - 0.5)
    expected = (math.log1p(math.e) + math.log1p(math.exp(-2.5))) / 2
    assert bradley_terry_loss(c, r, margin).item() == pytest.approx(expected)
    centred = bradley_terry_loss(c, r, None, 0.1).item()  # + 0.1 mean((c + r)^2) = 0.1 * (0 + 1) / 2
    assert centred == pytest.approx(bradley_terry_loss(c, r).item() + 0.05)


@pytest.mark.numerics
def test_regression_loss_is_the_mean_of_per_attribute_mse():
    predictions, targets = torch.tensor([[1.0, 0.0], [3.0, 0.0]]), torch.tensor([[0.0, 0.0], [1.0, 2.0]])
    assert regression_loss(predictions, targets).item() == pytest.approx(((1 + 4) / 2 + (0 + 4) / 2) / 2)


@pytest.mark.numerics
def test_head_reads_the_last_real_token_whatever_the_padding(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    head = torch.nn.Linear(model.config.hidden_size, 2, bias=False)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    with torch.no_grad():
        batched = reward_logits(model, head, ids, mask)
        alone = reward_logits(model, head, ids[1:, :2], mask[1:, :2])
        last = model.model(input_ids=ids[:1]).last_hidden_state[:, -1]  # the final norm's output
        padded_last = model.model(input_ids=ids[1:]).last_hidden_state[:, -1]  # would read the padding
    torch.testing.assert_close(batched[1:], alone)  # the padded row scores as it does alone
    torch.testing.assert_close(batched[:1], head(last))
    assert not torch.allclose(batched[1:], head(padded_last))
    with torch.no_grad():  # left padding: the mask's last 1 is still the last real token (RoPE: relative positions)
        left = reward_logits(model, head, torch.tensor([[0, 0, 9, 10]]), torch.tensor([[0, 0, 1, 1]]))
    torch.testing.assert_close(left, alone)


# -------------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def prefs(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("rm") / "prefs.jsonl", preference_rows(16))


def test_learns_a_separable_preference_set_either_way(tiny_model_dir, prefs, tmp_path):
    """accuracy >= 0.9 on the pairs as given AND with chosen/rejected swapped: learnt, not the head's luck."""
    flipped = write_jsonl(tmp_path / "flipped.jsonl", swapped(preference_rows(16)))
    for data in (prefs, flipped):
        out = run(tiny_model_dir, data, tmp_path, eval_split="train", eval_steps=12)
        history = out["history"]
        assert out["eval/accuracy"] >= 0.9 and out["accuracy"] >= 0.9, history[-1]
        assert history[-1]["loss"] < history[0]["loss"] - 0.2
        assert out["eval/margin"] > 0 and out["rewards/chosen"] > out["rewards/rejected"]
        for key in ("margin", "min_reward", "mean_reward", "max_reward", "grad_norm", "memory/peak_gb"):
            assert math.isfinite(history[-1][key]), key
    assert not hasattr(out["model"].get_base_model(), "score")  # the head has its own file (checked below)
    assert_base_untouched(out["model"], tiny_model_dir)
    final = out["final_dir"]
    assert {"adapter_model.safetensors", "adapter_config.json", HEAD_FILE, CONFIG_FILE} <= set(os.listdir(final))
    with open(os.path.join(final, CONFIG_FILE)) as f:
        config = {"base_model": tiny_model_dir, "loss_type": "bradley_terry", "attributes": ["reward"]}
        assert json.load(f) == config | {"quantization": None, "max_length": 1024}


@pytest.mark.numerics
def test_readme_recipe_scores_as_plugins_reward_model_does(tiny_model_dir, prefs, tmp_path):
    """The README's rm-plain block (AutoModelForCausalLM + PeftModel + the head on the backbone's last real token),
    run as written on a trained model, gives the scores plugins.reward_model.score gives."""
    import pathlib
    import re

    final = run(tiny_model_dir, prefs, tmp_path, max_steps=3)["final_dir"]
    readme = pathlib.Path(__file__).resolve().parents[1].joinpath("README.md").read_text()
    block = readme.split("<!-- rm-plain: tests/test_rm.py runs this block -->")[1].split("```python")[1]
    code = re.sub(r'rm_dir = ".*"', f"rm_dir = {final!r}", block.split("```")[0])
    scope = {}
    exec(code, scope)
    chat = scope["chat"]
    ours = score(load_reward(final), [chat[:1]], [chat[1:]])
    assert list(scope["rewards"]) == ["reward"]
    assert scope["rewards"]["reward"] == pytest.approx(ours[0, 0].item(), abs=1e-5)


@pytest.mark.numerics
def test_slot_scores_equal_rm_pys_own_after_training(tiny_model_dir_pad_eos, tmp_path):
    """pad == eos, LoRA dropout asked for (rm.py turns it off), a chosen cut at max_length: the trained model loaded
    as the "reward" slot of a policy in training scores every pair as rm.py's model did at its end, and the policy
    stays in train mode (PEFT's load_adapter puts the whole model in eval mode)."""
    from transformers import AutoTokenizer

    from common.completions import concat_pairs, tokenize_dataset

    rows = preference_rows(8)
    rows[0]["chosen"] = [{"role": "assistant", "content": "yes it is good " * 30}]
    data = write_jsonl(tmp_path / "long.jsonl", rows)
    out = run(tiny_model_dir_pad_eos, data, tmp_path, max_steps=3, max_length=64, lora_dropout=0.3)
    tokenizer = AutoTokenizer.from_pretrained(out["final_dir"])
    examples = tokenize_dataset(tokenizer, [r | {"_loc": str(i)} for i, r in enumerate(rows)], "preference", 64)
    assert len(examples[0]["prompt_ids"] + examples[0]["chosen_ids"]) == 64  # rm.py trained on the cut row
    batch, trained = concat_pairs(examples, tokenizer.pad_token_id, "cpu"), out["model"].eval()
    with torch.no_grad():
        head = torch.nn.Linear(64, 1, bias=False)
        head.weight.copy_(load_file(os.path.join(out["final_dir"], HEAD_FILE))["weight"])  # what rm.py trained
        own = reward_logits(trained, head, batch["input_ids"], batch["attention_mask"])
    model = policy(tiny_model_dir_pad_eos).train()
    reward = load_reward(out["final_dir"], model)
    assert model.training and reward.config["max_length"] == 64
    prompts, chosen, rejected = ([r[k] for r in rows] for k in ("prompt", "chosen", "rejected"))
    torch.testing.assert_close(score(reward, prompts * 2, chosen + rejected), own, rtol=0, atol=1e-6)


def test_regression_mse_falls_for_every_attribute(tiny_model_dir, tmp_path):
    rows = [
        {
            "prompt": [{"role": "user", "content": f"Question {i}: is {7 * i + 3} good?"}],
            "completion": [{"role": "assistant", "content": "it is " + WORDS[i % 6]}],
            "attributes": {"helpful": float(i % 6 >= 3), "verbose": 0.5 * (i % 3)},
        }
        for i in range(24)
    ]
    data = write_jsonl(tmp_path / "attrs.jsonl", rows)
    kw = dict(loss_type="regression", learning_rate=3e-3, lr_scheduler_type="constant", per_device_train_batch_size=8)
    kw |= dict(max_steps=48, eval_split="train", eval_steps=48)
    out = run(tiny_model_dir, data, tmp_path, **kw)
    first = out["history"][0]
    for name, variance in (("helpful", 0.25), ("verbose", 1 / 6)):  # variance = the best constant's MSE
        assert out[f"eval/mse/{name}"] < min(0.5 * first[f"mse/{name}"], 0.5 * variance), (name, first, out)
    with open(os.path.join(out["final_dir"], CONFIG_FILE)) as f:
        assert json.load(f)["attributes"] == ["helpful", "verbose"]
    reward = load_reward(out["final_dir"])
    scores = score(reward, [rows[1]["prompt"], rows[3]["prompt"]], [rows[1]["completion"], rows[3]["completion"]])
    assert (
        scores.shape == (2, 2) and scores[1, 0] > scores[0, 0] + 0.5
    )  # row 3 ("yes") is helpful, row 1 not  # "yes" rows are the helpful ones
    with pytest.raises(ValueError, match=r"name one attribute of \['helpful', 'verbose'\]"):
        model_reward(f"model:{out['final_dir']}")
    with pytest.raises(ValueError, match="no attribute 'tone'"):
        model_reward(f"model:{out['final_dir']}@tone:0.5")
    name, _, weight = model_reward(f"model:{out['final_dir']}@verbose:-0.5")
    assert (name, weight) == ("model@verbose", -0.5)


def test_resume_restores_adapter_and_head_exactly(tiny_model_dir, prefs, tmp_path):
    straight = run(tiny_model_dir, prefs, tmp_path / "a", max_steps=4, save_steps=2)
    ckpt = os.path.join(
        shutil.copytree(straight["run_dir"], tmp_path / "b"), "checkpoints", "step-2"
    )  # resumed in place
    resumed = run(tiny_model_dir, prefs, tmp_path / "b", max_steps=4, resume_from_checkpoint=ckpt)
    assert [h["step"] for h in resumed["history"]] == [1, 2, 3, 4]
    assert [h["loss"] for h in resumed["history"][2:]] == [h["loss"] for h in straight["history"][2:]]
    a, b = (load_file(os.path.join(o["final_dir"], HEAD_FILE))["weight"] for o in (straight, resumed))
    assert torch.equal(a, b)
    # The head travels in state.pt, whose sha256 the marker records: not as JSON floats outside the hashes
    marker = json.loads(pathlib.Path(ckpt, "checkpoint_complete.json").read_text())
    assert "head" not in marker["trainer_state"] and "state.pt" in marker["files_sha256"]
    state = pathlib.Path(ckpt, "state.pt")
    state.write_bytes(state.read_bytes()[:-64] + bytes(64))  # damage the tail: the head's bytes are in there
    with pytest.raises(CorruptCheckpointError, match="state.pt"):
        run(tiny_model_dir, prefs, tmp_path / "c", max_steps=4, resume_from_checkpoint=ckpt)


def test_bad_rows_fail_before_the_model_loads(tmp_path):
    rows = [{"prompt": "a", "completion": "b", "attributes": {"x": 1}}, {"prompt": "c", "completion": "d"}]
    bad = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError, match=r"bad\.jsonl:2: field 'attributes'"):
        main(Args(model=str(tmp_path / "no-such-model"), dataset=bad, loss_type="regression"))
    pairs = preference_rows(2)
    pairs[0]["margin"] = 1.0
    with pytest.raises(DataError, match=r"margins\.jsonl:2: field 'margin'"):
        main(Args(model=str(tmp_path / "no-such-model"), dataset=write_jsonl(tmp_path / "margins.jsonl", pairs)))


def test_cli_help_and_one_step(tiny_model_dir, prefs, tmp_path):
    help_out = run_cli("rm.py", "--help")
    assert help_out.returncode == 0 and "--center-rewards-coefficient" in help_out.stdout
    done = run_cli("rm.py", "--model", tiny_model_dir, "--dataset", prefs, "--max-steps", 1, "--output-dir", tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "rm: loss" in done.stdout and "accuracy" in done.stdout


# --------------------------------------------------------------------------------------- the "reward" slot
@pytest.fixture(scope="module")
def learnable(tmp_path_factory):
    """tests/tiny.py's learnable model (token v scored by +-(h . u), + for ids < LOW), and a reward model trained
    on it to prefer completions of low-id tokens over high-id ones: a reward GRPO can climb."""
    from transformers import AutoConfig, AutoTokenizer

    root = tmp_path_factory.mktemp("learnable")
    path = write_learnable(root / "model", LOW)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    tokenizer, g = AutoTokenizer.from_pretrained(path), torch.Generator().manual_seed(1)

    def text(lo, hi):
        return tokenizer.decode(torch.randint(lo, hi, (8,), generator=g).tolist())

    rows = [
        {
            "prompt": [{"role": "user", "content": QUESTIONS[i % 5]}],
            "chosen": [{"role": "assistant", "content": text(3, LOW)}],
            "rejected": [{"role": "assistant", "content": text(LOW, vocab)}],
        }
        for i in range(64)
    ]
    out = run(path, write_jsonl(root / "lowhigh.jsonl", rows), root, per_device_train_batch_size=8, max_steps=16)
    prompts = [{"prompt": [{"role": "user", "content": q}], "answer": str(i)} for i, q in enumerate(QUESTIONS)]
    return {"model": path, "rm": out["final_dir"], "prompts": write_jsonl(root / "prompts.jsonl", prompts)}


def policy(model_dir):
    """A policy as the scripts build one: the base, its chat template, a new "default" LoRA (rm.py's defaults) and
    the frozen "ref" copy of it."""
    args = Args(model=model_dir, dtype="fp32", attn_implementation="sdpa")
    model, tokenizer = load_model(args.model, args.dtype, args.attn_implementation)
    setup_chat_template(tokenizer, args.template)
    model = attach_lora(model, args.adapter, args.lora_r, args.lora_alpha, args.lora_dropout)
    snapshot_ref(model)
    return model


def test_reward_slot_guard_restores_adapter_flags_and_mode_even_on_error(learnable, monkeypatch):
    model = policy(learnable["model"])
    reward = load_reward(learnable["rm"], model)
    assert reward.model is model and REWARD in model.peft_config  # one backbone, a third slot
    model.train()
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    assert not any(flags[n] for n in flags if f".{REWARD}." in n or ".ref." in n)

    def unchanged():
        assert model.active_adapter == "default" and model.training
        assert {n: p.requires_grad for n, p in model.named_parameters()} == flags

    prompts, completions = [[{"role": "user", "content": "hi"}]] * 2, ["yes", "no"]
    scores = score(reward, prompts, completions)
    assert scores.shape == (2, 1) and not scores.requires_grad
    unchanged()

    def boom(*a, **k):
        assert model.active_adapter == REWARD and not model.training and not torch.is_grad_enabled()
        raise RuntimeError("boom")

    monkeypatch.setattr("plugins.reward_model.reward_logits", boom)
    with pytest.raises(RuntimeError, match="boom"):
        score(reward, prompts, completions)
    unchanged()
    next(p for n, p in model.named_parameters() if f".{REWARD}." in n).requires_grad_(True)
    with pytest.raises(RuntimeError, match="frozen .* adapter tensors are trainable"):
        trainable_parameters(model)  # the optimizer would never get a "reward" tensor


def test_another_base_is_loaded_apart_with_its_memory_printed(learnable, tiny_model_dir, capsys):
    model = policy(tiny_model_dir)
    reward = load_reward(learnable["rm"], model)
    assert reward.model is not model and REWARD not in model.peft_config
    assert "is not the policy's: loaded apart, " in capsys.readouterr().out
    assert score(reward, ["a"], ["b"]).shape == (1, 1)
    load_reward(learnable["rm"])  # standalone (labelling): nothing to compare with, nothing printed
    assert "loaded apart" not in capsys.readouterr().out


def test_grpo_raises_the_model_reward_and_keeps_reward_ref_and_base_bit_identical(learnable, tmp_path, monkeypatch):
    """Same seeds, lr 1e-3 vs 1e-7: the model reward of the trained run's later steps beats the control's, by far."""
    seen = {}

    def spy(funcs, model):  # grpo.main binds the model rewards right after making "default" and "ref"
        seen["model"], seen["before"] = model, {n: p.detach().clone() for n, p in model.named_parameters()}
        return bind(funcs, model)

    bind = grpo.bind_model_rewards
    monkeypatch.setattr(grpo, "bind_model_rewards", spy)
    runs = {}
    for lr in (1e-3, 1e-7):
        runs[lr] = grpo.main(
            grpo.Args(
                preset="demo",
                model=learnable["model"],
                dataset=learnable["prompts"],
                output_dir=str(tmp_path / "runs"),
                rewards=[f"model:{learnable['rm']}"],
                group_size=8,
                prompts_per_step=2,
                max_completion_length=8,
                groups_per_micro_batch=1,
                learning_rate=lr,
                max_steps=12,
                seed=1,
                lora_dropout=0.0,
                breaker_action="warn",
                save_steps=0,
            )
        )
        if lr == 1e-3:  # the trained run's policy: only "default" moved
            model, before = seen["model"], seen["before"]
            params = dict(model.named_parameters())
            for name, p in params.items():
                if ".ref." in name:
                    assert torch.equal(p, before[name.replace(".ref.", ".default.")]), name
                elif "lora_" not in name:
                    assert torch.equal(p, before[name]), f"base weight {name} changed"
            saved = load_file(os.path.join(learnable["rm"], "adapter_model.safetensors"))
            reward = slot_state(model, REWARD)
            assert reward.keys() == saved.keys() and all(torch.equal(v, saved[k]) for k, v in reward.items())
    later = {lr: sum(h["reward"] for h in out["history"][4:]) / 8 for lr, out in runs.items()}
    assert runs[1e-3]["history"][0]["reward"] == pytest.approx(runs[1e-7]["history"][0]["reward"])
    print(f"mean model reward over steps 5-12: lr 1e-3 {later[1e-3]:.3f}, lr 1e-7 {later[1e-7]:.3f}")
    assert later[1e-3] > later[1e-7] + 0.3, later
    assert "rewards/model/mean" in runs[1e-3]["history"][0]


def grpo_args(learnable, out_dir, **kw) -> grpo.Args:
    defaults = dict(
        preset="demo",
        model=learnable["model"],
        dataset=learnable["prompts"],
        output_dir=str(out_dir),
        rewards=[f"model:{learnable['rm']}"],
        group_size=4,
        prompts_per_step=2,
        max_completion_length=6,
        learning_rate=1e-3,
        max_steps=2,
        seed=1,
        breaker_action="warn",
    )
    return grpo.Args(**{**defaults, **kw})


def test_grpo_checkpoints_hash_the_reward_slot_and_refuse_another_reward_model(learnable, tmp_path):
    rm_dir = shutil.copytree(learnable["rm"], tmp_path / "rm")
    args = grpo_args({**learnable, "rm": str(rm_dir)}, tmp_path / "runs", save_steps=1)
    first = grpo.main(args)
    ckpt = os.path.join(first["run_dir"], "checkpoints", "step-1")
    with open(os.path.join(ckpt, "checkpoint_complete.json")) as f:
        meta = json.load(f)
    assert {"default", "ref", REWARD} == set(meta["adapter_sha256"]) and "reward.head" in meta["identity"]
    resumed = grpo.main(dataclasses.replace(args, resume_from_checkpoint=ckpt))  # the same reward model: resumes
    assert [h["step"] for h in resumed["history"]] == [2]
    head = load_file(rm_dir / HEAD_FILE)
    save_file({"weight": head["weight"] + 0.01}, rm_dir / HEAD_FILE)  # the reward model changed on disk
    with pytest.raises(ResumeError, match="reward.head"):
        grpo.main(dataclasses.replace(args, resume_from_checkpoint=ckpt))


def test_raft_keeps_the_best_samples_by_model_reward(learnable, tmp_path):
    import raft

    out = raft.main(
        raft.Args(
            preset="demo",
            model=learnable["model"],
            dataset=learnable["prompts"],
            output_dir=str(tmp_path),
            rewards=[f"model:{learnable['rm']}"],
            num_rounds=1,
            prompts_per_round=2,
            group_size=4,
            max_completion_length=6,
            reward_threshold=None,
            per_device_train_batch_size=2,
            eval_limit=0,
            seed=1,
        )
    )
    with open(os.path.join(out["run_dir"], "round-1", "samples.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    assert len(samples) == 8 and len({s["reward"] for s in samples}) > 1  # real, varying model scores
    assert os.path.isfile(os.path.join(out["final_dir"], "adapter_model.safetensors"))


# ---------------------------------------------------------------------------------------- SteerLM labelling
def test_label_with_fills_attributes_from_a_regression_model(tiny_model_dir, prefs, tmp_path, monkeypatch):
    import sft

    sft_rows = [
        {"prompt": [{"role": "user", "content": q}], "completion": [{"role": "assistant", "content": w}]}
        for q, w in zip(QUESTIONS, WORDS)
    ]
    attrs = [r | {"attributes": {"helpful": 1.0, "verbose": 0.0}} for r in sft_rows]
    data = write_jsonl(tmp_path / "attrs.jsonl", attrs)
    regression = run(tiny_model_dir, data, tmp_path, loss_type="regression", max_steps=1)["final_dir"]
    labelled, empty = label_rows(regression, sft_rows, [])
    expected = score(load_reward(regression), [r["prompt"] for r in sft_rows], [r["completion"] for r in sft_rows])
    assert empty == [] and [list(r["attributes"]) for r in labelled] == [["helpful", "verbose"]] * len(sft_rows)
    levels = [list(r["attributes"].values()) for r in labelled]  # integer levels, as SteerLM's attribute strings
    assert all(type(v) is int for row in levels for v in row)
    assert torch.tensor(levels, dtype=expected.dtype).equal(expected.round())
    assert label_rows(None, sft_rows) == (sft_rows,)
    with pytest.raises(DataError, match="a bradley_terry model; SteerLM labels need a regression one"):
        label_rows(run(tiny_model_dir, prefs, tmp_path, max_steps=0)["final_dir"], sft_rows)

    seen = []
    monkeypatch.setattr(sft, "label_rows", lambda *a: seen.append(label_rows(*a)) or seen[-1])
    sft.main(
        sft.Args(
            model=tiny_model_dir,
            dataset=write_jsonl(tmp_path / "sft.jsonl", sft_rows),
            label_with=regression,
            max_steps=1,
            output_dir=str(tmp_path / "sft"),
        )
    )
    assert all(set(r["attributes"]) == {"helpful", "verbose"} for r in seen[0][0])  # sft.py trained on these rows

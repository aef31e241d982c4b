"""Numbers that are not finite (issue: reliability round 3): every script stops once skipped NaN/Inf updates reach
--breaker-max-nonfinite, a NaN reward or reward weight is an error naming it, a group of equal float32 rewards has
exactly zero advantages, and an adapter holding a NaN/Inf is refused before the base model loads."""

import importlib
import json
import math
import os
import re

import numpy
import pytest
import torch
from safetensors.torch import load_file, save_file

import grpo
from common.errors import ArgsError, ModelError, RewardError
from harness.errors import RunStopped
from common.model import attach_lora, load_model
from common.rewards import compute_rewards, load_reward_funcs
from plugins.reward_model import model_reward
from tests.prefs_helpers import preference_rows, write_jsonl
from tests.test_raft import run as run_raft

KTO_ROWS = [{"prompt": f"Say {w}", "completion": w, "label": i % 2 == 0} for i, w in enumerate(["red", "blue"] * 4)]
SFT_ROWS = [{"prompt": f"Say {w}", "completion": f"{w} {w}"} for w in ("red", "blue", "green", "yes") * 2]
PROMPTS = [{"prompt": f"What is {i} plus 1?", "answer": str(i + 1)} for i in range(8)]


def data_for(script: str, tmp_path) -> str:
    rows = {"sft": SFT_ROWS, "kto": KTO_ROWS, "grpo": PROMPTS, "raft": PROMPTS}.get(script, preference_rows(8))
    return write_jsonl(tmp_path / f"{script}.jsonl", rows)


@pytest.fixture
def nan_gradients(monkeypatch):
    """Every update's gradient norm is NaN, as after an overflow: each update is skipped, never applied."""

    def nan_norm(params, max_norm, *args, **kwargs):
        return torch.tensor(math.nan)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", nan_norm)


@pytest.mark.parametrize("script", ["sft", "dpo", "orpo", "kto", "rm", "grpo"])
def test_every_script_stops_when_skipped_updates_reach_the_limit(script, tiny_model_dir, tmp_path, nan_gradients):
    """Only grpo.py stopped: dpo.py with --learning-rate 1e30 skipped 5 of 6 updates and exited 0 with final/."""
    module = importlib.import_module(script)
    kw = {"per_device_train_batch_size": 2} if script != "grpo" else {"prompts_per_step": 2, "group_size": 2}
    if script == "grpo":
        kw |= {"max_completion_length": 4, "rewards": ["format"], "eval_steps": 0, "preset": "demo"}
    args = module.Args(
        model=tiny_model_dir,
        dataset=data_for(script, tmp_path),
        output_dir=str(tmp_path / "runs"),
        max_steps=6,
        save_steps=1,
        breaker_max_nonfinite=2,
        **kw,
    )
    with pytest.raises(RunStopped, match=r"stopped at step 2 \(.*2 updates skipped for a NaN/Inf|nonfinite") as stop:
        module.main(args)
    run_dir = os.path.dirname(os.path.dirname(stop.value.checkpoint))
    assert stop.value.step == 2 and os.path.isdir(stop.value.checkpoint)
    assert not os.path.exists(os.path.join(run_dir, "final"))


def test_dpo_with_a_runaway_learning_rate_stops_with_exit_1(tiny_model_dir, tmp_path):
    """The issue's reproduction: --learning-rate 1e30 blows the weights up after one update; the losses that follow
    are NaN. It skipped 5 of 6 updates and wrote final/ with exit status 0."""
    import dpo

    args = dpo.Args(
        model=tiny_model_dir,
        dataset=data_for("dpo", tmp_path),
        output_dir=str(tmp_path / "runs"),
        learning_rate=1e30,
        max_steps=6,
        save_steps=1,
        per_device_train_batch_size=2,
    )
    with pytest.raises(RunStopped, match="3 updates skipped for a NaN/Inf loss or gradient") as stop:
        dpo.main(args)
    assert not os.path.exists(os.path.join(os.path.dirname(os.path.dirname(stop.value.checkpoint)), "final"))


def test_raft_stops_in_the_round_that_skips_too_many_updates(tiny_model_dir, tmp_path, nan_gradients):
    kw = dict(rewards=["format"], num_rounds=2, prompts_per_round=4, group_size=2, breaker_max_nonfinite=1)
    with pytest.raises(RunStopped, match=r"stopped in round 1 \(\d+ updates skipped.*last good: .*round-0") as stop:
        run_raft(tiny_model_dir, data_for("raft", tmp_path), tmp_path / "runs", **kw)
    run_dir = os.path.dirname(stop.value.checkpoint)
    assert not os.path.exists(os.path.join(run_dir, "round-1")) and not os.path.exists(os.path.join(run_dir, "final"))


# ------------------------------------------------------------------------------------------------ rewards
def test_a_nan_reward_weight_is_refused():
    """`--rewards math:nan` parsed NaN as the weight: every reward became NaN, nansum made it 0, nothing trained."""
    with pytest.raises(ArgsError, match=r"^--rewards math:nan: the weight must be a finite number"):
        load_reward_funcs(["math:nan"])
    with pytest.raises(ArgsError, match=r"^--rewards format:inf:"):
        load_reward_funcs(["format:inf"])


def test_grpo_refuses_a_nan_reward_weight_before_loading(tmp_path, monkeypatch):
    monkeypatch.setattr(grpo, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    data = data_for("grpo", tmp_path)
    args = grpo.Args(model="unused", dataset=data, output_dir=str(tmp_path), rewards=["math:nan"], preset="demo")
    with pytest.raises(ArgsError, match="--rewards math:nan"):
        grpo.main(args)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_reward_is_an_error_naming_the_function(bad):
    def flaky(prompts, completions, **kw):
        return [1.0, bad, None]

    funcs = [("flaky", flaky, 1.0)]
    with pytest.raises(RewardError, match=rf"^reward 'flaky' returned {bad} for completion 1 of 3 \('b'\)"):
        compute_rewards(funcs, ["p"] * 3, ["a", "b", "c"], {})
    flaky_ok = [("ok", lambda prompts, completions, **kw: [1.0, None, 0], 1.0)]
    rewards, per_func = compute_rewards(flaky_ok, ["p"] * 3, ["a", "b", "c"], {})
    assert rewards.tolist() == [1.0, 0.0, 0.0] and math.isnan(per_func[1, 0])  # None: left out, as TRL


@pytest.mark.parametrize("bad", ["1.0", b"1", [1.0], 1j, {"score": 1.0}])
def test_a_reward_that_is_no_number_is_an_error_naming_the_function(bad):
    """A string "1.0" (or bytes) was taken as 1.0, since float() parses it; a list or a complex number crashed with a
    bare TypeError naming no function. A reward is a finite real number (int, float, bool, a numpy scalar) or None."""

    def flaky(prompts, completions, **kw):
        return [1.0, bad, None]

    with pytest.raises(RewardError, match=rf"^reward 'flaky' returned {re.escape(repr(bad))} for completion 1 of 3"):
        compute_rewards([("flaky", flaky, 1.0)], ["p"] * 3, ["a", "b", "c"], {})
    numbers = [("numbers", lambda prompts, completions, **kw: [1, True, numpy.float32(0.5)], 1.0)]
    assert compute_rewards(numbers, ["p"] * 3, ["a", "b", "c"], {})[0].tolist() == [1.0, 1.0, 0.5]


def grpo_with_reward_module(tiny_model_dir, tmp_path, monkeypatch, module: str, code: str, rewards: list[str]):
    """A 2-step demo grpo run's Args whose rewards include `module` (written from `code`, importable as module:fn)."""
    (tmp_path / f"{module}.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    return grpo.Args(
        model=tiny_model_dir,
        dataset=data_for("grpo", tmp_path),
        output_dir=str(tmp_path / "runs"),
        rewards=rewards,
        preset="demo",
        eval_steps=0,
        max_steps=2,
        prompts_per_step=2,
        group_size=2,
        max_completion_length=4,
    )


def test_grpo_stops_on_a_nan_reward_from_a_custom_function(tiny_model_dir, tmp_path, monkeypatch):
    code = "def score(prompts, completions, **kw):\n    return [float('nan')] * len(completions)\n"
    args = grpo_with_reward_module(tiny_model_dir, tmp_path, monkeypatch, "nan_reward", code, ["nan_reward:score"])
    with pytest.raises(RewardError, match="^reward 'score' returned nan for completion 0 of 4"):
        grpo.main(args)


@pytest.mark.numerics  # which constant groups round depends on the kernels' reduction order
def test_equal_float32_rewards_have_exactly_zero_advantages():
    """A group of equal float32 rewards could get a std and advantages of rounding size (the mean misses the common
    value), and escaped frac_reward_zero_std and its breaker."""
    equal = torch.tensor([1.2, 1.2, 1.2, 1.2, 0.1, 0.1, 0.1, 0.1, 0.0, 1.0, 0.0, 1.0])
    assert equal.dtype == torch.float32
    for scale in ("group", "batch", "none"):
        advantages, std = grpo.group_advantages(equal, 4, scale)
        assert advantages[:8].tolist() == [0.0] * 8 and std[:8].tolist() == [0.0] * 8
        assert advantages[8:].abs().min() > 0.4
    out = {"completion_ids": [[1]] * 12, "truncated": [False] * 12}
    _, std = grpo.group_advantages(equal, 4)
    metrics = grpo.rollout_metrics(equal, equal[:, None], [("r", None, 1.0)], std, out)
    assert metrics["frac_reward_zero_std"] == pytest.approx(2 / 3)
    # Many constant groups of awkward values: none escapes (the 40 of 90; which ones depends on the sizes and
    # on the CPU's reduction order, so several group sizes).
    for group_size in (3, 4, 5, 8):
        values = torch.linspace(-3.3, 7.7, 90).repeat_interleave(group_size)
        advantages, std = grpo.group_advantages(values, group_size)
        assert not advantages.any() and not std.any(), group_size


# ------------------------------------------------------------------------------------------------ adapters
@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory):
    model, _ = load_model(tiny_model_dir)
    path = tmp_path_factory.mktemp("adapter") / "adapter"
    attach_lora(model, r=8, alpha=16).save_pretrained(str(path))
    return str(path)


def poisoned_copy(adapter_dir, tmp_path) -> tuple[str, str]:
    path = tmp_path / "poisoned"
    path.mkdir()
    for name in os.listdir(adapter_dir):
        (path / name).write_bytes(open(os.path.join(adapter_dir, name), "rb").read())
    tensors = load_file(path / "adapter_model.safetensors")
    key = sorted(tensors)[3]
    tensors[key].view(-1)[5] = math.inf
    save_file(tensors, path / "adapter_model.safetensors")
    return str(path), key


@pytest.mark.parametrize("script", ["sft", "dpo", "orpo", "kto", "rm", "grpo", "raft"])
def test_an_adapter_holding_inf_is_refused_before_the_model_loads(script, adapter_dir, tmp_path, monkeypatch):
    module = importlib.import_module(script)
    monkeypatch.setattr(module, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    path, key = poisoned_copy(adapter_dir, tmp_path)
    args = module.Args(model="unused", output_dir=str(tmp_path / "runs"), adapter=path, lora_r=8, lora_alpha=16)
    with pytest.raises(ModelError, match=rf"^--adapter {path}: tensor {key} in adapter_model.safetensors holds NaN"):
        module.main(args)


def test_an_adapters_own_lora_settings_are_named_when_flags_differ(adapter_dir, tiny_model_dir, capsys):
    """--adapter with another --lora-r trained the adapter's r without a word."""
    import sft

    sft.check_args(sft.Args(model=tiny_model_dir, adapter=adapter_dir, lora_r=32))
    note = f"note: --adapter {adapter_dir} trains with its own r 8, lora_alpha 16, lora_dropout 0.05: "
    assert note + "--lora-r 32, --lora-alpha 32 not applied" in capsys.readouterr().out
    sft.check_args(sft.Args(model=tiny_model_dir, adapter=adapter_dir, lora_r=8, lora_alpha=16))
    assert capsys.readouterr().out == ""


def test_a_reward_model_holding_nan_is_refused_when_named(adapter_dir, tmp_path):
    path, key = poisoned_copy(adapter_dir, tmp_path)
    config = {"base_model": "unused", "attributes": ["reward"]}
    (tmp_path / "poisoned" / "reward_config.json").write_text(json.dumps(config))
    save_file({"weight": torch.zeros(1, 64)}, tmp_path / "poisoned" / "reward_head.safetensors")
    with pytest.raises(ModelError, match=rf"^reward model {path}: tensor {key} .* holds NaN/Inf"):
        model_reward(f"model:{path}")
    with pytest.raises(ArgsError, match=r"--rewards model:.*:nan: the weight must be a finite number"):
        model_reward(f"model:{adapter_dir}:nan")


def test_rewards_whose_group_statistics_overflow_are_refused_naming_the_function(
    tiny_model_dir, tmp_path, monkeypatch
):
    """3e38 and -3e38 fit float32, but their group's std does not: it was Inf and every advantage 0, in silence (a run
    that trained nothing and exited 0). grpo.py refuses it before the advantages, naming the function (every rank's
    rewards: grpo gathers them first, so --scale-rewards batch is covered too)."""
    advantages, std = grpo.group_advantages(torch.tensor([3e38, -3e38]), 2)  # what it gave: no signal, no word
    assert advantages.tolist() == [0.0, 0.0] and std.isinf().all()
    code = "def wide(prompts, completions, **kw):\n    return [3e38 * (-1) ** i for i in range(len(completions))]\n"
    rewards = ["format", "wide_reward:wide"]
    args = grpo_with_reward_module(tiny_model_dir, tmp_path, monkeypatch, "wide_reward", code, rewards)
    with pytest.raises(RewardError, match=r"^reward 'wide': rewards -3e\+38 .. 3e\+38 overflow float32 in a group's"):
        grpo.main(args)


def test_group_statistics_are_checked_as_grpo_computes_them():
    """The weighted sum decides (a function's overflowing rewards scaled down by its weight train as they are); the
    first function whose own rewards overflow is named, else the sum; large rewards whose statistics fit pass."""
    from harness.cli import check_reward_statistics

    funcs = [("a", None, 1.0), ("b", None, 1.0)]
    fine = torch.tensor([1e37, -1e37, 0.0, 5.0])
    check_reward_statistics(fine, torch.stack([fine, fine * 0], 1), funcs, 2)
    check_reward_statistics(fine, torch.stack([fine, fine * 0], 1), funcs, 4)
    each_fits = torch.tensor([[1.5e38, 1.5e38], [-1.5e38, -1.5e38]])  # (B, F): each function's group std fits
    with pytest.raises(RewardError, match=r"^the weighted sum of rewards \['a', 'b'\]: rewards -3e\+38 .. 3e\+38"):
        check_reward_statistics(each_fits.sum(1), each_fits, funcs, 2)
    one_wide = torch.tensor([[1.0, 3e38], [1.0, -3e38]])
    with pytest.raises(RewardError, match=r"^reward 'b': rewards"):
        check_reward_statistics(one_wide.sum(1), one_wide, funcs, 2)
    with pytest.raises(RewardError, match=r"^reward 'a': rewards 3e\+38 .. 3e\+38"):  # the mean's sum
        check_reward_statistics(torch.tensor([3e38, 3e38]), torch.tensor([[3e38], [3e38]]), funcs[:1], 2)


def test_a_reward_past_floats_range_is_refused_naming_the_function():
    """10**400 is a real number (an int), and float() of it raised a bare OverflowError naming no reward."""
    funcs = [("huge_int", lambda prompts, completions, **kw: [1, 10**400], 1.0)]
    huge = r"^reward 'huge_int' returned 1000000000.* for completion 1 of 2 \('b'\): must be a finite number"
    with pytest.raises(RewardError, match=huge):
        compute_rewards(funcs, ["p", "p"], ["a", "b"], {})

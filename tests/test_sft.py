"""sft.py end to end on the tiny model: learning, exact gradient accumulation, exact resume, the CLI."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from torch.optim.optimizer import register_optimizer_step_pre_hook

from common.completions import load_splits
from harness.hub import hub_rows
from sft import Args, main, sft_loss
from tests import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ["red", "blue", "green", "yes", "no", "good", "bad", "hello"]


@pytest.fixture(scope="module")
def learnable_dir(tmp_path_factory):
    """The tiny model with a wider init (0.2, not 0.02): with the default, the frozen random head can only reach
    logits within about +-1, so no LoRA can push the loss far below ln(vocab); 0.2 lets memorisation show."""
    from tests.tiny import write_tiny

    return write_tiny(tmp_path_factory.mktemp("learnable"), initializer_range=0.2)


@pytest.fixture
def memo_jsonl(tmp_path):
    """8 conversational prompt/completion pairs a tiny model can memorise in a few dozen steps."""
    path = tmp_path / "memo.jsonl"
    with open(path, "w") as f:
        for i, w in enumerate(WORDS):
            row = {
                "prompt": [{"role": "user", "content": f"Say word {i}"}],
                "completion": [{"role": "assistant", "content": f"{w} {w} {w}"}],
            }
            f.write(json.dumps(row) + "\n")
    return str(path)


def run(tiny_model_dir, dataset, tmp_path, **kw):
    defaults = dict(
        model=tiny_model_dir,
        dataset=dataset,
        output_dir=str(tmp_path / "runs"),
        max_length=64,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        lora_dropout=0.0,
        max_steps=2,
        seed=1,
    )
    return main(Args(**{**defaults, **kw}))


def adapter(out):
    return load_file(os.path.join(out["final_dir"], "adapter_model.safetensors"))


@pytest.mark.numerics
def test_sft_loss_is_token_mean_over_the_whole_step():
    logps = torch.tensor([[0.0, -1.0, -2.0], [0.0, -3.0, 0.0]])
    assert sft_loss(logps, 3).item() == pytest.approx(2.0)


def test_sft_learns_a_memorisable_set(learnable_dir, memo_jsonl, tmp_path):
    out = run(learnable_dir, memo_jsonl, tmp_path, max_steps=30, logging_steps=1)
    losses = [h["loss"] for h in out["history"]]
    assert all(map(lambda x: x == x and abs(x) < 1e4, losses)), "non-finite loss"
    assert losses[-1] < 0.3 * losses[0], f"loss did not fall clearly: {losses[0]:.3f} -> {losses[-1]:.3f}"
    for key in ("loss", "grad_norm", "learning_rate", "num_tokens", "memory/peak_gb", "perf/tokens_per_s"):
        assert key in out
    with open(os.path.join(out["run_dir"], "metrics.jsonl")) as f:
        assert len(f.readlines()) == 30
    # The final adapter loads with plain PEFT and carries the training.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(learnable_dir), out["final_dir"])
    assert any("lora_B" in n and p.abs().sum() > 0 for n, p in model.named_parameters())


@pytest.mark.numerics
def test_gradient_accumulation_1x4_equals_4x1(tiny_model_dir, memo_jsonl, tmp_path):
    """The step's gradient (what optimizer.step sees) of one batch of 4 equals that of 4 accumulated rows of 1."""
    grads = []  # per optimizer step: every trained tensor's gradient as AdamW receives it (accumulated, clipped)

    def record(optimizer, args, kwargs):
        grads.append([p.grad.clone() for group in optimizer.param_groups for p in group["params"]])

    hook = register_optimizer_step_pre_hook(record)
    try:
        one_big = run(tiny_model_dir, memo_jsonl, tmp_path / "a", per_device_train_batch_size=4, max_steps=1)
        four_small = run(
            tiny_model_dir,
            memo_jsonl,
            tmp_path / "b",
            per_device_train_batch_size=1,
            gradient_accumulation_steps=4,
            max_steps=1,
        )
    finally:
        hook.remove()
    assert four_small["loss"] == pytest.approx(one_big["loss"], rel=1e-5)
    assert len(grads) == 2, "each run takes exactly one optimizer step"
    # The padded batch and the single rows sum the same terms in another order: fp32 rounding, 2^-24 relative per op
    # of each tensor's largest terms, so 1e-5 of a tensor's largest gradient bounds it; a wrong accumulation scale or
    # a dropped row moves the gradients by whole percents. The weights after the step are no test of this: AdamW's
    # first step is lr * g / (|g| + eps), and on an element with |g| near eps that amplifies g's rounding to a
    # visible fraction of lr, by an amount each CPU's kernels decide.
    for big, small in zip(*grads, strict=True):
        torch.testing.assert_close(small, big, rtol=1e-5, atol=1e-5 * big.abs().max().item())
    assert any(g.abs().max() > 0 for g in grads[0]), "no gradient reached the adapter: nothing was compared"


def test_resume_is_exact(tiny_model_dir, memo_jsonl, tmp_path):
    straight = run(tiny_model_dir, memo_jsonl, tmp_path / "a", max_steps=6, save_steps=3, lora_dropout=0.1)
    ckpt = os.path.join(
        shutil.copytree(straight["run_dir"], tmp_path / "b"), "checkpoints", "step-3"
    )  # resumed in place
    assert os.path.isdir(ckpt)
    resumed = run(
        tiny_model_dir, memo_jsonl, tmp_path / "b", max_steps=6, lora_dropout=0.1, resume_from_checkpoint=ckpt
    )
    a, b = adapter(straight), adapter(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a), "3 steps + resume + 3 steps differs from 6 straight steps"
    assert [h["step"] for h in resumed["history"]] == [1, 2, 3, 4, 5, 6]  # the run dir's steps, then the resumed ones


@pytest.mark.numerics
def test_full_finetune_and_packing(tiny_model_dir, memo_jsonl, tmp_path):
    full = run(tiny_model_dir, memo_jsonl, tmp_path / "full", use_lora=False, learning_rate=1e-3)
    assert os.path.exists(os.path.join(full["final_dir"], "model.safetensors"))
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(full["final_dir"])  # loadable by plain transformers
    from common.errors import ArgsError
    from scripts.merge_adapter import merge

    with pytest.raises(ArgsError, match="a full model .* nothing to merge"):  # said as such, not "no adapter_config"
        merge(full["final_dir"])
    # One step over all 8 rows at the starting weights: the packed rows (documents isolated by position_ids) must
    # give the same completion-token loss as the 8 unpacked rows.
    packed = run(tiny_model_dir, memo_jsonl, tmp_path / "packed", packing=True, max_steps=1)
    unpacked = run(tiny_model_dir, memo_jsonl, tmp_path / "unpacked", per_device_train_batch_size=8, max_steps=1)
    assert packed["loss"] == pytest.approx(unpacked["loss"], rel=1e-5)


@pytest.mark.numerics
@pytest.mark.parametrize("layout", ["text", "no_completion_only_loss"])
def test_packed_equals_padded_when_the_first_token_is_in_the_loss(tiny_model_dir, memo_jsonl, tmp_path, layout):
    # {text} rows and --no-completion-only-loss put every token in the loss, but token 0 is no target: counting it in
    # the step's token total (the loss's denominator) made the padded loss smaller than the packed one.
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": f"{w} is a word, {w} {w}."}) + "\n" for w in WORDS))
    kw = dict(completion_only_loss=False) if layout == "no_completion_only_loss" else {}
    dataset = memo_jsonl if kw else str(data)
    packed = run(tiny_model_dir, dataset, tmp_path / "packed", packing=True, max_steps=1, **kw)
    padded = run(tiny_model_dir, dataset, tmp_path / "padded", per_device_train_batch_size=8, max_steps=1, **kw)
    assert packed["loss"] == pytest.approx(padded["loss"], rel=1e-5)


def base_stopping_at_endoftext(tmp_path):
    """A base model whose generation_config stops at <|endoftext|> only (trained with ChatML: end of turn <|im_end|>);
    returns (its dir, [<|im_end|> id, <|endoftext|> id]: the stops a saved model must carry)."""
    from transformers import AutoTokenizer, GenerationConfig

    from tests.tiny import write_tiny

    base = write_tiny(tmp_path / "base")
    tok = AutoTokenizer.from_pretrained(base)
    config = GenerationConfig.from_pretrained(base)
    config.eos_token_id = tok.convert_tokens_to_ids("<|endoftext|>")
    config.save_pretrained(base)
    return base, [tok.convert_tokens_to_ids("<|im_end|>"), config.eos_token_id]


def test_merged_model_stops_at_the_trained_end_of_turn(memo_jsonl, tmp_path):
    # The merged folder must stop generate() at <|im_end|>, or the served model runs on past every answer.
    from transformers import GenerationConfig

    from scripts import merge_adapter

    base, stops = base_stopping_at_endoftext(tmp_path)
    out = run(base, memo_jsonl, tmp_path, max_steps=0)
    merged = merge_adapter.main(merge_adapter.Args(adapter=out["final_dir"], out=str(tmp_path / "merged")))
    assert GenerationConfig.from_pretrained(merged["out"]).eos_token_id == stops


def test_a_full_fine_tune_stops_at_the_trained_end_of_turn(memo_jsonl, tmp_path):
    # Trained without LoRA, final/ is a full model that users load with from_pretrained: it must stop there too.
    from transformers import GenerationConfig

    base, stops = base_stopping_at_endoftext(tmp_path)
    out = run(base, memo_jsonl, tmp_path, use_lora=False, max_steps=0)
    assert GenerationConfig.from_pretrained(out["final_dir"]).eos_token_id == stops


def test_a_merged_checkpoint_ships_the_template_the_run_trained_with(tiny_model_dir, memo_jsonl, tmp_path):
    # checkpoints/step-N/weights holds no tokenizer: the merge took the base's (ChatML here), not the run's --template.
    from transformers import AutoTokenizer

    from common.data import QWEN
    from scripts import merge_adapter

    out = run(tiny_model_dir, memo_jsonl, tmp_path, template="qwen", max_length=256, max_steps=1, save_steps=1)
    weights = os.path.join(out["run_dir"], "checkpoints", "step-1", "weights")
    merged = merge_adapter.main(merge_adapter.Args(adapter=weights, out=str(tmp_path / "merged")))
    assert AutoTokenizer.from_pretrained(merged["out"]).chat_template == QWEN


def test_an_eval_split_of_a_local_file_is_refused_before_the_model_loads(memo_jsonl, tmp_path):
    # A file has one split: --eval-split test loaded the same rows again, and eval/loss was the training loss.
    from common.errors import ArgsError

    with pytest.raises(ArgsError, match=r"--eval-split test: .*memo\.jsonl is one file with no splits.* pass train"):
        main(Args(model=str(tmp_path / "no-such-model"), dataset=memo_jsonl, eval_split="test"))


def test_an_eval_split_of_a_saved_dataset_without_splits_is_refused(memo_jsonl, tmp_path):
    # Dataset.save_to_disk (not a DatasetDict) has no splits: --eval-split test evaluated on the training rows.
    import datasets

    from common.errors import ArgsError

    rows = [json.loads(line) for line in open(memo_jsonl)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict(
        train=datasets.Dataset.from_list(rows[:4]), test=datasets.Dataset.from_list(rows[4:])
    ).save_to_disk(str(tmp_path / "saved_dict"))
    with pytest.raises(ArgsError, match=r"--eval-split test: .*saved is a saved Dataset with no splits"):
        main(Args(model=str(tmp_path / "no-such-model"), dataset=str(tmp_path / "saved"), eval_split="test"))
    splits = load_splits(str(tmp_path / "saved_dict"), "train", "test", "supervised", hub=hub_rows)
    assert [len(r) for r in splits] == [4, 4]  # a DatasetDict's splits are real


def test_cli_help_and_one_step(tiny_model_dir, memo_jsonl, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    help_out = subprocess.run([sys.executable, "sft.py", "--help"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert help_out.returncode == 0 and "--learning-rate" in help_out.stdout and "completion" in help_out.stdout
    done = cli.run(
        [
            sys.executable,
            "sft.py",
            "--model",
            tiny_model_dir,
            "--dataset",
            memo_jsonl,
            "--max-steps",
            "1",
            "--max-length",
            "64",
            "--output-dir",
            str(tmp_path / "cli"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "sft: loss" in done.stdout

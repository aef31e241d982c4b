"""What the eval scripts share: load the model to evaluate (base, base + adapter, or a run's checkpoint), batched
greedy generation (through common.rollout), and writing per-example JSONL plus a summary JSON.

A checkpoint is `runs/<run>/checkpoints/step-N` (its weights/ holds the PEFT adapter, or the full weights after
--no-use-lora), a run's `final/` dir, or a run dir (its final/ if present, else its newest complete checkpoint).
"""

import json
import os
import pathlib
import re
import sys

from tqdm.auto import tqdm

import torch

from common.data import dataset_label
from common.model import attach_lora, load_model, load_weights
from common.rewards import math_reward, score_rollout
from common.rollout import hf_generate
from common.run import ArgsError, resolve_checkpoint
from common.templates import setup_chat_template


def eval_source(dataset: str, eval_dataset: str | None) -> str:
    """--eval-dataset, else --dataset itself when it has splits (a hub or builtin set; a file is the train data)."""
    if eval_dataset or not (os.path.exists(dataset) or dataset.endswith((".json", ".jsonl", ".parquet"))):
        return eval_dataset or dataset
    raise ArgsError(f"--dataset {dataset}: a file has no test split; give --eval-dataset FILE, or --eval-steps 0")


@torch.no_grad()
def reward_eval(generate, examples: list[dict], reward_funcs, max_new_tokens: int, source: str) -> dict:
    """A training run's held-out eval through its own rollout engine (`generate`, HF or vLLM): one greedy completion
    per prompt, its mean reward (the run's reward functions) and length and, for rows with an answer, the share whose
    final number is right (eval/<dataset>/accuracy: GSM8K's test accuracy for openai/gsm8k). A row whose answer has
    no number ("p - q") cannot be judged by math_reward (None): it is left out of the accuracy, not counted wrong, and
    counted in eval/<dataset>/unscored (as evals.gsm8k does)."""
    out = generate([e["prompt_ids"] for e in examples], 1, temperature=0.0, max_new_tokens=max_new_tokens)
    rewards, _ = score_rollout(examples, out, reward_funcs, max_new_tokens)
    lengths = [len(c) for c in out["completion_ids"]]
    metrics = {"eval/reward": rewards.mean().item(), "eval/completions/mean_length": sum(lengths) / len(lengths)}
    if all("answer" in e for e in examples):
        scores = math_reward(None, out["completions"], answer=[e["answer"] for e in examples])
        right = [r for r in scores if r is not None]  # None: an answer without a number, which no completion matches
        if right:
            metrics[f"eval/{dataset_label(source)}/accuracy"] = sum(right) / len(right)
        if len(right) < len(scores):  # only then: a run on numeric answers logs the keys it always did
            metrics[f"eval/{dataset_label(source)}/unscored"] = len(scores) - len(right)
    return metrics


def checkpoint_weights(path: str) -> str:
    """The folder that holds the weights of `path`: a checkpoint's weights/, a run's final/, or `path` itself."""
    if os.path.isdir(os.path.join(path, "weights")):
        return os.path.join(path, "weights")  # runs/<run>/checkpoints/step-N
    if os.path.isdir(os.path.join(path, "final")):
        return os.path.join(path, "final")  # a run dir that finished
    if os.path.isdir(os.path.join(path, "checkpoints")):
        return os.path.join(resolve_checkpoint(path), "weights")  # a run dir cut short: its newest checkpoint
    return path  # final/ itself, or any adapter / weights folder


def load_eval_model(
    model: str,
    adapter: str | None = None,
    checkpoint: str | None = None,
    dtype: str = "auto",
    template: str = "auto",
    attn_implementation: str = "auto",
):
    """(model, tokenizer) in eval mode: `model` plus, optionally, a LoRA adapter or a run's checkpoint on top.

    The tokenizer always comes from `model` (checkpoints do not store one), with the same chat template setup the
    training scripts run, so the prompt tokens match what the policy was trained on."""
    if adapter and checkpoint:
        raise ArgsError("give --adapter or --checkpoint, not both")
    policy, tokenizer = load_model(model, dtype, attn_implementation)
    setup_chat_template(tokenizer, template)
    weights = checkpoint_weights(checkpoint) if checkpoint else adapter
    if weights and os.path.isfile(os.path.join(weights, "adapter_config.json")):
        policy = attach_lora(policy, weights)  # PEFT loads the "default" adapter; a saved "ref" slot is ignored
    elif weights:
        load_weights(policy, weights)  # full fine-tuning: the whole state dict replaces the base weights
    return policy.eval(), tokenizer


def model_label(model: str, adapter: str | None = None, checkpoint: str | None = None) -> str:
    """A short file-safe name for the evaluated policy: 'smollm2-135m', '<run>__step-200', '<run>__final'."""
    path = checkpoint or adapter
    if path:
        parts = [p for p in os.path.normpath(path).split(os.sep) if p not in ("checkpoints", "weights", ".")]
        name = "__".join(parts[-2:])
    else:
        name = model.rstrip("/").split("/")[-1]
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", name)


def dataset_tag(dataset: str) -> str:
    """The name results go by, from the dataset actually used: builtin:math -> builtin-math, openai/gsm8k:main ->
    gsm8k, a file -> its stem, or its folder's name when the stem is only a split (data/gsm8k/test.jsonl -> gsm8k)."""
    if dataset.startswith("builtin:"):
        tag = "builtin-" + dataset.split(":", 1)[1]
    elif pathlib.Path(dataset).suffix in (".json", ".jsonl", ".parquet"):
        path = pathlib.Path(dataset)
        generic = path.stem in ("test", "train", "validation", "valid", "dev", "eval", "data", "input_data")
        tag = path.parent.name if generic and path.parent.name not in ("", ".") else path.stem
    else:
        tag = dataset.split(":")[0].rstrip("/").split("/")[-1]  # hub id[:config]
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", tag)


def generate_completions(
    model,
    tokenizer,
    prompt_ids: list[list[int]],
    batch_size: int = 16,
    max_new_tokens: int = 512,
    temperature: float = 0.0,
    num_samples: int = 1,
) -> list[str]:
    """Completions (decoded, special tokens dropped) for tokenized prompts: greedy at temperature 0, else
    num_samples draws per prompt; prompt i's are at [i * num_samples, (i + 1) * num_samples).

    Each batch (batch_size prompts) is one `common.rollout.hf_generate` call, the engine the RL scripts sample with,
    so the same EOS ids stop a completion and the model's generation_config cannot add sampling or penalties.
    Prompts go longest first: an out-of-memory batch size fails at once, and similar lengths pad little."""
    if num_samples < 1 or (temperature == 0.0 and num_samples != 1):
        raise ValueError(f"num_samples={num_samples} at temperature={temperature}: greedy takes 1, sampling >= 1")
    order = sorted(range(len(prompt_ids)), key=lambda i: -len(prompt_ids[i]))
    texts: list[str] = [""] * (len(prompt_ids) * num_samples)
    starts = range(0, len(order), batch_size)
    for start in tqdm(starts, desc="generate", unit="batch", disable=len(starts) < 2 or not sys.stderr.isatty()):
        idx = order[start : start + batch_size]
        out = hf_generate(
            model,
            tokenizer,
            [prompt_ids[i] for i in idx],
            group_size=num_samples,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
        )
        for j, text in enumerate(out["completions"]):  # hf_generate returns each prompt's group together
            texts[idx[j // num_samples] * num_samples + j % num_samples] = text
    return texts


def write_results(output_dir: str, stem: str, records: list[dict], summary: dict) -> dict:
    """Write <output_dir>/<stem>.jsonl (one record per example) and <stem>.json (the summary); returns both paths."""
    os.makedirs(output_dir, exist_ok=True)
    paths = {"outputs": os.path.join(output_dir, f"{stem}.jsonl"), "summary": os.path.join(output_dir, f"{stem}.json")}
    with open(paths["outputs"], "w") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    with open(paths["summary"], "w") as f:
        json.dump({**summary, "outputs": paths["outputs"]}, f, indent=2)
    return paths

"""The held-out eval of a run that samples (a rollout engine's `generate`): which data it reads, and its greedy
completions' reward, length and final-number accuracy."""

import os
import pathlib

import torch

from common.rewards import math_reward, score_rollout


@torch.no_grad()
def reward_eval(generate, examples: list[dict], reward_funcs, max_new_tokens: int, source: str) -> dict:
    """The held-out eval through the run's own rollout engine (`generate`, HF or vLLM): one greedy completion per
    prompt, its mean reward (the run's reward functions) and length and, for rows with an answer, the share whose
    final number is right (eval/<dataset>/accuracy: GSM8K's test accuracy for openai/gsm8k). A row whose answer has
    no number ("p - q") cannot be judged by math_reward (None): it is left out of the accuracy and counted in
    eval/<dataset>/unscored (as evals.gsm8k does). Under torchrun every rank scores every prompt (greedy: the same
    completions on each)."""
    out = generate([e["prompt_ids"] for e in examples], 1, temperature=0.0, max_new_tokens=max_new_tokens)
    rewards, _ = score_rollout(examples, out, reward_funcs, max_new_tokens)
    lengths = [len(c) for c in out["completion_ids"]]
    metrics = {"eval/reward": rewards.mean().item(), "eval/completions/mean_length": sum(lengths) / len(lengths)}
    if all("answer" in e for e in examples):
        scores = math_reward(None, out["completions"], answer=[e["answer"] for e in examples])
        right = [r for r in scores if r is not None]  # None: an answer without a number, which nothing matches
        if right:
            metrics[f"eval/{dataset_label(source)}/accuracy"] = sum(right) / len(right)
        if len(right) < len(scores):  # only then: a run on numeric answers logs the keys it always did
            metrics[f"eval/{dataset_label(source)}/unscored"] = len(scores) - len(right)
    return metrics


def eval_source(dataset: str, eval_dataset: str | None) -> str | None:
    """--eval-dataset, else --dataset itself when it has splits (a hub or builtin set); None for a file, which is all
    train data: no eval, as TRL trains without an eval_dataset (the start-up block can say how to add one)."""
    if eval_dataset:
        return eval_dataset
    if not (os.path.exists(dataset) or dataset.endswith((".json", ".jsonl", ".parquet"))):
        return dataset
    return None


def dataset_label(spec: str) -> str:
    """A short name for metric keys and files: openai/gsm8k:main -> gsm8k, builtin:math -> builtin_math,
    data/gsm8k/test.jsonl -> gsm8k (a split-named file takes its folder's name), prefs.jsonl -> prefs."""
    if spec.startswith("builtin:"):
        return spec.replace(":", "_")
    path = pathlib.Path(spec.split(":")[0])
    stem = path.stem if path.suffix in (".json", ".jsonl", ".parquet") else path.name
    return path.parent.name if stem in ("train", "test", "validation", "dev") and path.parent.name else stem

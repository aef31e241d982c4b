"""What the eval scripts share (and a training script's held-out GSM8K eval): load the model to evaluate (base,
base + adapter, or a run's checkpoint), batched greedy generation (through common.rollout), math-answer accuracy on
GSM8K-style rows, gathering the rows torchrun's ranks generated for, and writing per-example JSONL plus a summary JSON.

A checkpoint is `runs/<run>/checkpoints/step-N` (its weights/ holds the PEFT adapter, or the full weights after
--no-use-lora), a run's `final/` dir, or a run dir (its final/ if present, else its newest complete checkpoint).
"""

import contextlib
import json
import os
import pathlib
import re
import sys
import threading
import time

from tqdm.auto import tqdm


from common.data import load_rows, setup_chat_template, tokenize_prompt, validate_rows
from common.distributed import all_gather
from common.errors import ArgsError, DataError
from common.model import attach_lora, load_model
from common.rewards import extract_answer, math_reward
from common.rollout import hf_generate
from harness.checkpoints import load_weights, resolve_checkpoint
from harness.hub import check_dataset, hub_rows, locate_model, note_other_base
from plugins.builtin_math import MATH_INSTRUCTION, builtin_rows, question_row
from plugins.steerlm import parse_attributes, steer_prompt


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
    weights = checkpoint_weights(checkpoint) if checkpoint else adapter
    lora = weights and os.path.isfile(os.path.join(weights, "adapter_config.json"))
    if lora:
        note_other_base(weights, model)
    policy, tokenizer = load_model(model, dtype, attn_implementation, path=locate_model(model))
    setup_chat_template(tokenizer, template)
    if lora:
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


HEARTBEAT_S = 30.0  # a line this often while one batch decodes: on a CPU one batch can take minutes


@contextlib.contextmanager
def heartbeat(what: str):
    """While the body runs, a stderr line every HEARTBEAT_S seconds saying `what` and the seconds so far. It comes
    from a thread, so the decoding itself (and what it returns) is exactly what it is without it."""
    stop = threading.Event()
    t0 = time.perf_counter()

    def beat():
        while not stop.wait(HEARTBEAT_S):
            tqdm.write(f"generate: {what}, {time.perf_counter() - t0:.0f} s so far", file=sys.stderr)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def generate_completions(
    model,
    tokenizer,
    prompt_ids: list[list[int]],
    batch_size: int = 16,
    max_new_tokens: int = 512,
    temperature: float = 0.0,
    num_samples: int = 1,
    progress: bool = False,
) -> list[str]:
    """Completions (decoded, special tokens dropped) for tokenized prompts: greedy at temperature 0, else
    num_samples draws per prompt; prompt i's are at [i * num_samples, (i + 1) * num_samples).
    progress (the eval CLIs): a line saying what runs, then a bar per batch in a terminal, or off one (a log file)
    a plain stderr line per batch with the time left, and within a batch a line every HEARTBEAT_S seconds (a batch
    of long greedy decodes on a CPU is minutes of silence otherwise); without it (an eval inside training) only a
    terminal's bar.

    Each batch (batch_size prompts) is one `common.rollout.hf_generate` call, the engine the RL scripts sample with,
    so the same EOS ids stop a completion and the model's generation_config cannot add sampling or penalties.
    Prompts go longest first: an out-of-memory batch size fails at once, and similar lengths pad little."""
    if num_samples < 1 or (temperature == 0.0 and num_samples != 1):
        raise ValueError(f"num_samples={num_samples} at temperature={temperature}: greedy takes 1, sampling >= 1")
    order = sorted(range(len(prompt_ids)), key=lambda i: -len(prompt_ids[i]))
    texts: list[str] = [""] * (len(prompt_ids) * num_samples)
    starts = range(0, len(order), batch_size)
    in_terminal = sys.stderr.isatty()
    if progress:
        size = f"{len(prompt_ids)} prompts x {num_samples}" if num_samples > 1 else f"{len(prompt_ids)} prompts"
        say = f"{size} in {len(starts)} batches of up to {batch_size}, up to {max_new_tokens} new tokens each"
        print(f"generate: {say}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    bar = tqdm(starts, desc="generate", unit="batch", disable=not in_terminal or (len(starts) < 2 and not progress))
    for done, start in enumerate(bar, 1):
        idx = order[start : start + batch_size]
        what = f"batch {done}/{len(starts)} ({len(idx)} prompts) decoding"
        with heartbeat(what) if progress else contextlib.nullcontext():
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
        if progress and not in_terminal:
            elapsed = time.perf_counter() - t0
            left = elapsed / done * (len(starts) - done)
            prompts = f"{start + len(idx)}/{len(order)} prompts"
            print(
                f"generate: batch {done}/{len(starts)} ({prompts}), {elapsed:.0f} s, ~{left:.0f} s left",
                file=sys.stderr,
                flush=True,
            )
    return texts


def gather_rows(mine: list, world: int) -> list:
    """Under torchrun (world ranks, this rank having taken rows[rank::world]): every rank's items back in the original
    row order, on every rank (a collective: every rank must call it). Alone (world 1): `mine`, as it is."""
    if world == 1:
        return list(mine)
    parts = all_gather([mine])  # one list per rank, in rank order
    rows = [None] * sum(len(part) for part in parts)
    for rank, part in enumerate(parts):
        rows[rank::world] = part  # rank r held rows r, r + world, r + 2 world, ...
    return rows


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


def gsm8k_rows(
    dataset: str = "openai/gsm8k:main",
    split: str = "test",
    limit: int | None = None,
    instruction: str = MATH_INSTRUCTION,
    attributes: str | None = None,
    where: str = "system",
) -> list[dict]:
    """Eval rows {question, prompt (chat messages), reference}: GSM8K's {question, answer} through the same mapping as
    training (plugins.builtin_math.question_row: reference = the number after '####'), or prompt-only rows such as
    builtin:math's {prompt, answer}. math_reward extracts the reference with the function it applies to completions.
    attributes ("correct:1,length:0"): SteerLM's attribute string goes into each prompt, in its system message or
    its user turn (`where`, steer_prompt)."""
    # A bad attribute spec fails before any row loads
    label = parse_attributes(attributes, "--attributes") if attributes else None
    check_dataset(dataset)
    rows = load_rows(dataset, split, builtin=builtin_rows, hub=hub_rows)[:limit]  # [:None] keeps all
    rows = [question_row(r, instruction) for r in rows]
    missing = [r.get("_loc", "<row>") for r in rows if r.get("answer") is None]
    if missing:
        raise DataError(f"{missing[0]}: field 'answer' is missing: no reference to score ({len(missing)} rows)")
    out = []
    for row in validate_rows(rows, "prompt"):
        # A plain-string prompt becomes one user turn; builtin:math's question is its user turn, instruction included.
        prompt = row["prompt"] if isinstance(row["prompt"], list) else [{"role": "user", "content": row["prompt"]}]
        question = row.get("question", prompt[-1]["content"])
        prompt = steer_prompt(prompt, label, where) if label else prompt
        out.append({"question": question, "prompt": prompt, "reference": str(row["answer"])})
    return out


def score(completions: list[str], references: list[str]) -> list[dict]:
    """Per completion: the extracted answer and whether math_reward counts it correct (exactly the RL reward);
    correct is None when the reference has no number ("p - q"): nothing can match it, so it is not judged."""
    rewards = math_reward([None] * len(completions), completions, answer=references)
    return [
        {"extracted": extract_answer(c), "correct": None if r is None else r == 1.0}
        for c, r in zip(completions, rewards, strict=True)
    ]


def evaluate_gsm8k(
    model,
    tokenizer,
    rows: list[dict],
    batch_size: int = 16,
    max_new_tokens: int = 512,
    temperature: float = 0.0,
    num_samples: int = 1,
    progress: bool = False,
    rank: int = 0,
    world: int = 1,
) -> dict:
    """Decode every row of gsm8k_rows() (greedy, or num_samples draws at temperature) and score each completion:
    {accuracy (mean over the judged completions), n (judged completions), unscored (completions whose reference has
    no number: left out, as the GRPO held-out eval does), records}. Restores the model's mode.
    Under torchrun (every rank calls it with its rank of world): this rank decodes rows rank, rank + world, ...,
    and every rank scores all rows' completions, gathered back into the row order, and returns the same result."""
    # No max prompt length: a GSM8K question is a few hundred tokens at most, and dropping rows would bias accuracy.
    prompt_ids = [tokenize_prompt(tokenizer, row, None)["prompt_ids"] for row in rows[rank::world]]
    mine = generate_completions(
        model, tokenizer, prompt_ids, batch_size, max_new_tokens, temperature, num_samples, progress
    )
    # Gathered as one group of num_samples completions per row, so a row's samples stay together in the row order
    groups = gather_rows([mine[i : i + num_samples] for i in range(0, len(mine), num_samples)], world)
    completions = [c for group in groups for c in group]
    rows = [row for row in rows for _ in range(num_samples)]  # completions come grouped by prompt
    scored = score(completions, [row["reference"] for row in rows])
    records = [
        {"question": row["question"], "reference": extract_answer(row["reference"]), "completion": c, **s}
        for row, c, s in zip(rows, completions, scored, strict=True)
    ]
    judged = [r["correct"] for r in records if r["correct"] is not None]
    accuracy = sum(judged) / len(judged) if judged else float("nan")  # nan: nothing could be judged
    return {"accuracy": accuracy, "n": len(judged), "unscored": len(records) - len(judged), "records": records}

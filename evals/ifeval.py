"""IFEval: does a greedy response follow verifiable instructions ("no commas", "at least 300 words", "wrap in JSON")?

Zhou et al. 2023, arXiv:2311.07911. The 25 checkers are Google's own code as packaged by `if-verifiable` (pip install
if-verifiable), with google-research's later fix to letter_frequency (below); this file generates, applies them, and
aggregates:
  prompt level      a prompt passes when ALL its instructions pass; instruction level: the mean over all instructions
  strict / loose    the response as is / passes if any of the 8 standard variants passes (first line, last line or
                    both removed, each with and without '*' stripped)
Two checkers need NLTK's punkt_tab data (number_sentences, capital_word_frequency): without it (`python -m
nltk.downloader punkt_tab` installs it) those instructions are NOT EVALUATED: out of both numerator and denominator,
the prompts holding one out of the prompt-level scores, and their counts in the summary. Never counted as passed.
Run: `python -m evals.ifeval --dataset google/IFEval --limit 50` (offline: a local copy of IFEval's input_data.jsonl)
     `torchrun --nproc-per-node 2 -m evals.ifeval ...` (rank r generates prompts r, r + 2, ...; rank 0 writes files)

Differences from lm-eval's ifeval task: chat template on (lm-eval: off unless --apply_chat_template); letter_frequency
counts the character the prompt asks for even when it is no letter, as google-research's current checker does (keys
1122 and 1129 ask for '#' and '!'; lm-eval and if-verifiable count a random letter instead, unseeded in lm-eval);
langdetect is seeded (0) and so is the `random` that fills missing kwargs, so every verdict is the same on every run;
1,024 new tokens (lm-eval: 1,280).
"""

import functools
import importlib.metadata
import random
import re
import time
from dataclasses import asdict, dataclass
from typing import Literal

# -h/--help is answered from Args before the imports below load torch, transformers and peft (seconds of CPU).
from harness.fast_help import help_before_imports

help_before_imports(__name__, __file__, None)

import tyro

from common.data import load_rows, tokenize_prompt
from common.distributed import close_distributed, init_distributed
from common.errors import DataError
from harness.fast_help import require
from harness.checkpoints import broadcast
from harness.cli import one_line_errors
from harness.run import log_scores
from harness.hub import check_dataset, hub_rows
from evals.common_eval import gather_rows, generate_completions, load_eval_model, model_label, write_results

# NLTK data a checker loads at check time. Checked up front per instruction, so "missing" is decided from the
# resource, not inferred from an exception (a LookupError from any other checker is still caught, see below).
NLTK_RESOURCES = {
    "length_constraints:number_sentences": "tokenizers/punkt_tab/english/",  # instructions_util.count_sentences
    "change_case:capital_word_frequency": "tokenizers/punkt_tab/english/",  # nltk.word_tokenize
}
METRICS = ("prompt_level_strict_acc", "inst_level_strict_acc", "prompt_level_loose_acc", "inst_level_loose_acc")


@dataclass
class Args:
    # model
    model: str = "smollm2-135m"  # hub id, local path, or embedded alias; the base under --adapter / --checkpoint
    adapter: str | None = None  # a LoRA adapter dir to evaluate on top of --model
    # a run's checkpoint (runs/<run>/checkpoints/step-N), its final/ dir, or the run dir itself
    checkpoint: str | None = None
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"  # weights dtype; auto = bf16 on CUDA, fp32 on CPU
    # chat template: auto (the tokenizer's own, else chatml), chatml, qwen, llama3; use the one you trained with
    template: str = "auto"
    # data

    # hub id or a .jsonl file of {key, prompt, instruction_id_list, kwargs} (IFEval's input_data.jsonl)
    dataset: str = "google/IFEval"
    split: str = "train"  # split to evaluate (the hub set has only "train"; ignored for files)
    limit: int | None = None  # evaluate only the first N prompts
    # generation
    batch_size: int = 16  # prompts per generate() call
    # response budget; some prompts ask for 300+ words, and a cut-off response fails the end checks
    max_new_tokens: int = 1024
    # output
    output_dir: str = "eval_results"  # where the JSONL and JSON files go
    # name of this policy in file names and reports; default from --checkpoint / --adapter / --model
    label: str | None = None
    # besides the JSON files: none, or W&B (a run named like the files: these args, the scores; pip install wandb)
    report_to: Literal["none", "wandb"] = "none"
    # torchrun

    # under torchrun: seconds a rank waits for the others before the run fails (a rank that died ends it)
    ddp_timeout: int = 1800


@functools.cache
def _checkers():
    """(registry of checker classes by instruction id, the loose-variant function) from if-verifiable."""
    require("if_verifiable", "evals.ifeval (Google's IFEval checkers)")
    import langdetect
    from if_verifiable.common import get_loose_transformations
    from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT

    langdetect.DetectorFactory.seed = 0  # langdetect samples n-grams at random: unseeded, a verdict can flip per run
    return INSTRUCTION_DICT, get_loose_transformations


@functools.cache
def nltk_has(resource: str) -> bool:
    import nltk

    try:
        nltk.data.find(resource)
        return True
    except LookupError:
        return False


def missing_resource(instruction_id: str) -> str | None:
    """The NLTK resource this instruction's checker needs and this machine lacks, else None."""
    resource = NLTK_RESOURCES.get(instruction_id)
    return resource if resource is not None and not nltk_has(resource) else None


def check_instruction(instruction_id: str, kwargs: dict, prompt: str, response: str) -> dict:
    """{strict, loose} booleans for one instruction, or both None plus `not_evaluated` (the reason) when it can't run.

    Mirrors IFEval's evaluation_lib: kwargs with None values dropped (the hub set pads every row with all keys),
    the prompt passed to checkers that take it (repeat_prompt), an empty response fails strict and loose alike."""
    registry, loose_variants = _checkers()
    if instruction_id not in registry:
        raise KeyError(f"unknown IFEval instruction {instruction_id!r}; known: {sorted(registry)}")
    missing = missing_resource(instruction_id)
    if missing:
        return {"strict": None, "loose": None, "not_evaluated": f"NLTK data {missing} not installed"}
    # Upstream fills missing or unusable kwargs from the global `random`, so an unseeded verdict could change from run
    # to run. Seed per instruction, then restore.
    state = random.getstate()
    random.seed(f"{instruction_id}|{prompt}")
    try:
        checker = registry[instruction_id](instruction_id)
        checker.build_description(**{k: v for k, v in (kwargs or {}).items() if v is not None})
        if instruction_id == "keywords:letter_frequency" and len(letter := (kwargs or {}).get("letter") or "") == 1:
            checker._letter = letter.lower()  # the 2024 copy swaps a non-letter ('#', '!') for a random letter
        if "prompt" in (checker.get_instruction_args() or {}):
            checker.build_description(prompt=prompt)
        strict = bool(response.strip() and checker.check_following(response))
        loose = any(v.strip() and checker.check_following(v) for v in loose_variants(response))
    except LookupError as e:  # NLTK data we did not list above: same verdict, never a silent pass or fail
        found = re.search(r"Resource \S+ not found", re.sub(r"\x1b\[[0-9;]*m", "", str(e)))  # drop NLTK's colours
        return {"strict": None, "loose": None, "not_evaluated": f"NLTK data missing: {found[0] if found else repr(e)}"}
    finally:
        random.setstate(state)
    return {"strict": strict, "loose": loose, "not_evaluated": None}


def _mean(xs: list[bool]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")  # nan, not 0: "nothing was scored" is not "all failed"


def aggregate(results: list[list[dict]]) -> dict:
    """IFEval's four accuracies from results[p][i] = check_instruction(...) for instruction i of prompt p.

    Not-evaluated instructions leave both numerator and denominator; a prompt with one leaves the prompt level."""
    done = [r for rs in results for r in rs if r["not_evaluated"] is None]
    whole = [rs for rs in results if all(r["not_evaluated"] is None for r in rs)]
    return {
        "prompt_level_strict_acc": _mean([all(r["strict"] for r in rs) for rs in whole]),
        "inst_level_strict_acc": _mean([r["strict"] for r in done]),
        "prompt_level_loose_acc": _mean([all(r["loose"] for r in rs) for rs in whole]),
        "inst_level_loose_acc": _mean([r["loose"] for r in done]),
        "n_prompts": len(results),
        "n_prompts_evaluated": len(whole),
        "n_instructions": sum(len(rs) for rs in results),
        "n_instructions_evaluated": len(done),
        "n_instructions_not_evaluated": sum(len(rs) for rs in results) - len(done),
    }


def score(rows: list[dict], responses: list[str]) -> tuple[list[dict], dict]:
    """Check every instruction of every row: (per-prompt records, aggregate metrics with a per-instruction table)."""
    records = []
    results = []
    by_id = {}
    for row, response in zip(rows, responses, strict=True):
        rs = [
            check_instruction(i, kw, row["prompt"], response)
            for i, kw in zip(row["instruction_id_list"], row["kwargs"], strict=True)
        ]
        results.append(rs)
        for i, r in zip(row["instruction_id_list"], rs):
            counts = by_id.setdefault(i, {"n": 0, "strict": 0, "loose": 0, "not_evaluated": 0})
            counts["n"] += 1
            counts["strict"] += r["strict"] is True  # None (not evaluated) is not a pass
            counts["loose"] += r["loose"] is True
            counts["not_evaluated"] += r["not_evaluated"] is not None
        records.append(
            {
                "key": row.get("key"),
                "prompt": row["prompt"],
                "response": response,
                "instruction_id_list": row["instruction_id_list"],
                "strict": [r["strict"] for r in rs],
                "loose": [r["loose"] for r in rs],
                "not_evaluated": [r["not_evaluated"] for r in rs],
            }
        )
    metrics = aggregate(results)
    metrics["not_evaluated"] = {i: c["not_evaluated"] for i, c in sorted(by_id.items()) if c["not_evaluated"]}
    metrics["by_instruction"] = dict(sorted(by_id.items()))
    return records, metrics


def check_row(row: dict, registry: dict) -> None:
    """An IFEval row: a prompt, a non-empty instruction_id_list of known ids and one kwargs object per id. Without
    ids a prompt would pass the prompt level with nothing checked."""
    where, ids, kwargs = row.get("_loc", "<row>"), row.get("instruction_id_list"), row.get("kwargs")
    if not isinstance(row.get("prompt"), str):
        raise DataError(
            f"{where}: field 'prompt': must be a string (IFEval rows: key, prompt, instruction_id_list, kwargs)"
        )
    if not isinstance(ids, list) or not ids:
        raise DataError(f"{where}: field 'instruction_id_list': must be a non-empty list of IFEval instruction ids")
    if unknown := [i for i in ids if i not in registry]:
        known = ", ".join(sorted(registry)[:3])
        raise DataError(
            f"{where}: field 'instruction_id_list': unknown IFEval instruction {unknown[0]!r} ({known}, ...)"
        )
    if not isinstance(kwargs, list) or len(kwargs) != len(ids):
        raise DataError(f"{where}: field 'kwargs': must be a list of {len(ids)} objects, one per instruction id")


def main(args: Args) -> dict:
    rank, world = init_distributed(args.ddp_timeout)  # under torchrun: this process's rank of world; alone: 0 of 1
    # ---- 1 data and checkers (first: a missing package, bad path or unknown instruction fails before the model loads)
    registry, _ = _checkers()
    if args.report_to == "wandb":
        require("wandb", "--report-to wandb")
    check_dataset(args.dataset)  # a hub set offline and not cached: one line now
    rows = load_rows(args.dataset, args.split, hub=hub_rows)[: args.limit]
    for row in rows:
        check_row(row, registry)

    # ---- 2 model: base, base + adapter, or a run's checkpoint
    t0 = time.perf_counter()
    model, tokenizer = load_eval_model(args.model, args.adapter, args.checkpoint, args.dtype, args.template)
    load_s = time.perf_counter() - t0

    # ---- 3 generate (each prompt is one user turn) and check
    t0 = time.perf_counter()
    chats = [{"prompt": [{"role": "user", "content": row["prompt"]}]} for row in rows]
    prompt_ids = [tokenize_prompt(tokenizer, chat, None)["prompt_ids"] for chat in chats]
    # Under torchrun this rank generates for prompts rank, rank + world, ...; every rank gets all responses back in
    # order and checks them all (the same verdicts as one process: the checkers are seeded per instruction)
    mine = generate_completions(
        model, tokenizer, prompt_ids[rank::world], args.batch_size, args.max_new_tokens, progress=True
    )
    responses = gather_rows(mine, world)
    records, metrics = score(rows, responses)
    eval_s = time.perf_counter() - t0

    # ---- 4 write per-prompt outputs and the summary
    label = args.label or model_label(args.model, args.adapter, args.checkpoint)
    summary = {
        "task": "ifeval",
        "label": label,
        **metrics,
        "model": args.model,
        "adapter": args.adapter,
        "checkpoint": args.checkpoint,
        "dataset": args.dataset,
        "split": args.split,
        "limit": args.limit,
        "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size,
        "checker": f"if-verifiable {importlib.metadata.version('if-verifiable')}",
        "time_s": round(eval_s, 2),
        "load_s": round(load_s, 2),
        "device": str(next(model.parameters()).device),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    paths = None
    if rank == 0:  # one writer
        paths = write_results(args.output_dir, f"{label}__ifeval", records, summary)
        scores = {f"eval/ifeval/{k}": summary[k] for k in (*METRICS, "n_prompts")}
        log_scores(args.report_to, f"{label}__ifeval", asdict(args), scores)
        n_skipped = summary["n_instructions_not_evaluated"]
        skipped = f"; {n_skipped} instructions not evaluated (NLTK data missing)" if n_skipped else ""
        print(
            "ifeval: "
            + ", ".join(f"{m} {summary[m]:.4f}" for m in METRICS)
            + f" over {summary['n_prompts']} prompts in {eval_s:.1f}s{skipped}; wrote {paths['summary']}"
        )
    summary, paths = broadcast((summary, paths))  # every rank returns rank 0's summary (its times) and paths
    close_distributed()
    return {**summary, **paths, "records": records}


if __name__ == "__main__":
    with one_line_errors():  # bad data, a missing file, the hub out of reach: one line, no traceback
        main(tyro.cli(Args))

"""GSM8K accuracy: greedy (or sampled) chat completions, scored by the same answer extraction as the math reward.

A completion is correct when `common.rewards.math_reward` gives it 1.0: its final answer (GSM8K `#### N`, else the
last \\boxed{}, else "the answer is N", else the last number) equals the reference numerically. Zero-shot; the prompt
is the question plus plugins.builtin_math.MATH_INSTRUCTION (which asks for '#### N'); builtin:math rows keep their own.
Run: `python -m evals.gsm8k --dataset openai/gsm8k:main --limit 100` (offline: a local test.jsonl, or builtin:math)
     `python -m evals.gsm8k --checkpoint runs/grpo__smollm2-135m__42__<time>/checkpoints/step-200`
     `python -m evals.gsm8k --dataset builtin:math --limit 64 --temperature 0.7 --num-samples 4` (mean over samples)
     `torchrun --nproc-per-node 2 -m evals.gsm8k ...` (rank r generates rows r, r + 2, ...; rank 0 writes the files)
Results are named by the dataset used (evals.common_eval.dataset_tag: gsm8k, builtin-math, a file's name): writes
<output-dir>/<label>__<dataset>.jsonl (question, reference, completion, extracted, correct per example) and
<label>__<dataset>.json (task = <dataset>, accuracy, n, model, adapter, checkpoint, limit, time_s, ...).
In a training script: `eval_rows = gsm8k_rows(args.eval_dataset, limit=args.eval_limit)`, then every --eval-steps
`metrics["eval/gsm8k/accuracy"] = evaluate_gsm8k(model, tokenizer, eval_rows, 16, 256)["accuracy"]` (both from
evals.common_eval).

Differences from lm-eval: zero-shot chat prompt with our instruction (lm-eval's `gsm8k` is 5-shot plain text
"Question: ...\nAnswer:", `gsm8k_cot` 8-shot, `gsm8k_cot_zeroshot` 0-shot "Q: ... A: Let's think step by step.", no
chat template unless asked); one lenient extraction, like lm-eval's flexible-extract (the last number counts when no
marked answer is found; its strict-match takes only `#### N` / "The answer is N."), compared as numbers, not strings
("5.00", "$5" and "5" are equal; integers exactly).
"""

import re
import time
from dataclasses import asdict, dataclass

from typing import Literal

# -h/--help is answered from Args before the imports below load torch, transformers and peft (seconds of CPU).
from harness.fast_help import help_before_imports

help_before_imports(__name__, __file__, None)

import torch
import tyro

from common.distributed import close_distributed, init_distributed
from harness.fast_help import require
from common.errors import ArgsError
from evals.common_eval import dataset_tag, evaluate_gsm8k, gsm8k_rows, load_eval_model, model_label, write_results
from harness.checkpoints import broadcast
from harness.cli import one_line_errors
from harness.hub import check_dataset
from harness.run import log_scores
from plugins.builtin_math import MATH_INSTRUCTION
from plugins.steerlm import parse_attributes


SCORES = ("accuracy", "correct", "n", "unscored")  # the summary's entries --report-to wandb logs
# What runs with no download: the built-in math word problems (plugins/builtin_math.py) on the embedded default model
BUILTIN = "--dataset builtin:math (built-in grade-school math word problems, generated here, as the demo trains on)"


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

    # hub id[:config], a .jsonl/.json/.parquet file with {question, answer}, or builtin:math
    dataset: str = "openai/gsm8k:main"
    split: str = "test"  # split to evaluate (hub and builtin sets; ignored for files)
    limit: int | None = None  # evaluate only the first N examples
    # appended to each {question} row on a new line ('' for the bare question); None =
    # plugins.builtin_math.MATH_INSTRUCTION (asks for the final answer as '#### N'); builtin:math rows carry their own
    instruction: str | None = None
    # SteerLM: the attribute levels to ask for, e.g. correct:1,length:0, written into every prompt the way sft.py wrote
    # its rows' `attributes` (plugins.steerlm.steer_prompt); results are named with them
    attributes: str | None = None
    # where the attribute string goes: the system turn or each user turn; use sft.py's --attributes-in
    attributes_in: Literal["system", "user"] = "system"
    # generation
    batch_size: int = 16  # prompts per generate() call
    max_new_tokens: int = 512  # completion budget; a cut-off solution usually has no final answer and scores 0
    temperature: float = 0.0  # 0 = greedy; > 0 samples (what GRPO's reward sees at its training temperature)
    num_samples: int = 1  # samples per question when temperature > 0; accuracy is the mean over all of them (pass@1)
    seed: int = 0  # torch seed for sampling
    # output
    output_dir: str = "eval_results"  # where the JSONL and JSON files go
    # name of this policy in file names and reports; default from --checkpoint / --adapter / --model
    label: str | None = None
    # besides the JSON files: none, or W&B (a run named like the files: these args, the scores; pip install wandb)
    report_to: Literal["none", "wandb"] = "none"
    # torchrun

    # under torchrun: seconds a rank waits for the others before the run fails (a rank that died ends it)
    ddp_timeout: int = 1800


def main(args: Args) -> dict:
    rank, world = init_distributed(args.ddp_timeout)  # under torchrun: this process's rank of world; alone: 0 of 1
    # ---- 1 data (first: a bad path or setting fails before the model loads)
    if args.num_samples < 1 or (args.temperature == 0.0 and args.num_samples != 1):
        raise ArgsError(f"--num-samples {args.num_samples} needs --temperature > 0 (greedy decoding gives 1 sample)")
    if args.report_to == "wandb":
        require("wandb", "--report-to wandb")
    instruction = MATH_INSTRUCTION if args.instruction is None else args.instruction
    check_dataset(args.dataset, offline=BUILTIN)  # the hub set out of reach: one line naming what works offline
    rows = gsm8k_rows(args.dataset, args.split, args.limit, instruction, args.attributes, args.attributes_in)

    # ---- 2 model: base, base + adapter, or a run's checkpoint
    t0 = time.perf_counter()
    model, tokenizer = load_eval_model(args.model, args.adapter, args.checkpoint, args.dtype, args.template)
    load_s = time.perf_counter() - t0

    # ---- 3 generate and score
    t0 = time.perf_counter()
    # Sampling: each rank its own stream (seed + rank), so two ranks never draw the same noise for their rows
    torch.manual_seed(args.seed + rank)
    # Under torchrun this rank decodes rows rank, rank + world, ...; every rank gets all rows back in order and scores
    result = evaluate_gsm8k(
        model,
        tokenizer,
        rows,
        args.batch_size,
        args.max_new_tokens,
        args.temperature,
        args.num_samples,
        progress=True,
        rank=rank,
        world=world,
    )
    eval_s = time.perf_counter() - t0

    # ---- 4 write per-example outputs and the summary
    label, task = args.label or model_label(args.model, args.adapter, args.checkpoint), dataset_tag(args.dataset)
    if args.attributes and not args.label:  # one file per set of asked-for attributes, not one overwriting the other
        label += "__" + re.sub(r"[^A-Za-z0-9._+-]+", "-", parse_attributes(args.attributes, "--attributes"))
    summary = {
        "task": task,
        "label": label,
        "accuracy": result["accuracy"],
        "n": result["n"],
        "correct": sum(r["correct"] is True for r in result["records"]),
        "unscored": result["unscored"],
        "model": args.model,
        "adapter": args.adapter,
        "checkpoint": args.checkpoint,
        "dataset": args.dataset,
        "split": args.split,
        "limit": args.limit,
        "attributes": args.attributes,
        "attributes_in": args.attributes_in,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "num_samples": args.num_samples,
        "seed": args.seed,
        "batch_size": args.batch_size,
        "time_s": round(eval_s, 2),
        "load_s": round(load_s, 2),
        "device": str(next(model.parameters()).device),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    paths = None
    if rank == 0:  # one writer
        paths = write_results(args.output_dir, f"{label}__{task}", result["records"], summary)
        scores = {f"eval/{task}/{k}": summary[k] for k in SCORES}
        log_scores(args.report_to, f"{label}__{task}", asdict(args), scores)
        unscored = f"; {result['unscored']} left out (reference without a number)" if result["unscored"] else ""
        print(
            f"{task}: accuracy {summary['accuracy']:.4f} ({summary['correct']}/{summary['n']}) in {eval_s:.1f}s"
            f"{unscored}; wrote {paths['summary']}"
        )
    summary, paths = broadcast((summary, paths))  # every rank returns rank 0's summary (its times) and paths
    close_distributed()
    return {**summary, **paths, "records": result["records"]}


if __name__ == "__main__":
    with one_line_errors():  # bad data, a missing file, the hub out of reach: one line, no traceback
        main(tyro.cli(Args))

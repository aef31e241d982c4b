"""SteerLM on the embedded model: attribute-conditioned SFT on built-in math rows, then steering by attributes alone.

Training rows are builtin:math_sft's train problems, each written four times with attributes {correct, length}:
correct 1 keeps the worked answer, correct 0 has a slip in the final result (one too many; see `slipped`); length 0
is the bare arithmetic ("5 + 3 = 8" per step), length 1 the worked sentences between an opening and a closing line.
sft.py trains on them (`--attributes-in`, written into the prompt by common.data.steer_rows); then, on held-out
builtin:math test prompts, greedy decoding under each of the four attribute sets (evals.gsm8k's --attributes path)
gives the accuracy and the mean completion length (tokens) for each.
Not CI; prints measured figures and asserts nothing.

    OMP_NUM_THREADS=1 python bench/steerlm_demo.py                  # defaults: 60 steps x 8 rows, 48 test prompts
    python bench/steerlm_demo.py --steps 2 --limit 4 --model <dir>   # the code path on a small model (smoke test)
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.embedded import builtin_rows  # noqa: E402

# Each step of a built-in solution reads "<words><x> <op> <y> = <r> <unit>."
STEP = re.compile(r"(\d+ [-+*/] \d+) = (\d+)")
CONDITIONS = ["correct:1,length:0", "correct:0,length:0", "correct:1,length:1", "correct:0,length:1"]


def slipped(solution: str) -> str:
    """The solution with its final result one too many, in the last step and after ####. One slip, not a random one
    of -2..+2 as builtin:math_preference's: under greedy decoding one wrong value must outweigh the right one, and four
    would share the mass. Neither moved the accuracy in 40-60 steps (README, SteerLM)."""
    right = int(solution.rsplit("#### ", 1)[1])
    wrong = right + 1
    lines = solution.split("\n")
    lines[-2] = re.sub(rf"= {right}\b", f"= {wrong}", lines[-2], count=1)
    return "\n".join(lines[:-1] + [f"#### {wrong}"])


def short(solution: str) -> str:
    """Only the arithmetic of each step, then the answer line: '5 + 3 = 8\\n#### 8'."""
    steps, answer = solution.rsplit("\n#### ", 1)
    return "\n".join(f"{m[1]} = {m[2]}" for m in STEP.finditer(steps)) + f"\n#### {answer}"


def long(solution: str) -> str:
    """The worked sentences between an opening and a closing line."""
    steps, answer = solution.rsplit("\n#### ", 1)
    return f"Let's work through it step by step.\n{steps}\nSo the final answer is {answer}.\n#### {answer}"


def steerlm_rows(problems: int | None = None) -> list[dict]:
    """The first `problems` builtin:math_sft train problems, each under all four {correct, length} attribute sets."""
    rows = []
    for row in builtin_rows("math_sft", "train")[:problems]:
        right = row["completion"][0]["content"]
        wrong = slipped(right)
        for correct, solution in ((1, right), (0, wrong)):
            for length, write in ((0, short), (1, long)):
                completion = [{"role": "assistant", "content": write(solution)}]
                rows.append(
                    {
                        "prompt": row["prompt"],
                        "completion": completion,
                        "attributes": {"correct": correct, "length": length},
                    }
                )
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--problems", type=int, default=300, help="train problems (x4 rows); tokenizing all is slow")
    parser.add_argument("--attributes-in", choices=["system", "user"], default="system")
    parser.add_argument("--limit", type=int, default=48, help="held-out builtin:math test prompts per condition")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--out", default="outputs/steerlm_demo")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    # ---- 1 data: the attribute rows as a JSONL file, read by sft.py like any user's
    data = os.path.join(args.out, "steerlm_math.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in steerlm_rows(args.problems))

    # ---- 2 attribute-conditioned SFT through the CLI (its own process: this one only evaluates)
    t0 = time.perf_counter()
    cmd = [sys.executable, os.path.join(ROOT, "sft.py"), "--model", args.model, "--dataset", data]
    cmd += ["--attributes-in", args.attributes_in, "--max-steps", str(args.steps), "--learning-rate"]
    cmd += [str(args.learning_rate), "--per-device-train-batch-size", str(args.batch_size), "--save-steps", "0"]
    cmd += ["--logging-steps", "10", "--output-dir", os.path.join(args.out, "runs")]
    print("$", " ".join(cmd), flush=True)
    log = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    final_dir = re.findall(r"saved (\S+)", log)[-1]
    print(log.strip().splitlines()[-1], f"({time.perf_counter() - t0:.0f} s)", flush=True)

    # ---- 3 steer: the same held-out prompts under each attribute set, greedy
    from evals.common_eval import load_eval_model
    from evals.gsm8k import evaluate_gsm8k, gsm8k_rows

    model, tokenizer = load_eval_model(args.model, adapter=final_dir)
    results = {}
    for spec in CONDITIONS:
        t0 = time.perf_counter()
        rows = gsm8k_rows("builtin:math", "test", args.limit, attributes=spec, attributes_in=args.attributes_in)
        out = evaluate_gsm8k(model, tokenizer, rows, 16, args.max_new_tokens)
        lengths = [len(tokenizer(r["completion"], add_special_tokens=False)["input_ids"]) for r in out["records"]]
        results[spec] = {"accuracy": out["accuracy"], "n": out["n"], "mean_tokens": sum(lengths) / len(lengths)}
        results[spec]["example"] = out["records"][0]["completion"]
        print(
            f"{spec:20s} accuracy {out['accuracy']:.3f} ({sum(r['correct'] for r in out['records'])}/{out['n']})  "
            f"mean completion {results[spec]['mean_tokens']:.1f} tokens  ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"args": vars(args), "final_dir": final_dir, "results": results}, f, indent=1)
    for spec in CONDITIONS:
        print(f"--- {spec}: {results[spec]['example']!r}")


if __name__ == "__main__":
    main()

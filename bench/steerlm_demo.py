"""SteerLM on the embedded model: attribute-conditioned SFT on built-in math rows, then steering by attributes alone.

Training rows are builtin:math_sft's train problems, each written four times with attributes {correct, length}:
correct 1 keeps the worked answer, correct 0 has one consistent slip (a 0 appended to the final result; `slipped`);
length 0 is the bare arithmetic ("5 + 3 = 8" per step), length 1 the worked sentences between an opening and a closing
line. sft.py trains on them (`--attributes-in`, written into the prompt by plugins.steerlm.steer_rows): by default
every weight (not LoRA), packed in file order so each packed row holds one problem's four variants (the rows differ
only in the attribute string and the answer, so each step sees the contrast), constant lr. Then, on held-out
builtin:math test prompts, greedy decoding under each of the four attribute sets (evals.gsm8k's --attributes path)
gives the accuracy and the mean completion length (tokens) for each. docs/reward-models.md, SteerLM: why these
defaults (the LoRA runs learned the answers' 50/50 mix and not the attributes).
Not CI; prints measured figures and asserts nothing.

    OMP_NUM_THREADS=1 python bench/steerlm_demo.py                  # defaults: 80 steps x 2 packs, 48 test prompts
    python bench/steerlm_demo.py --steps 2 --limit 4 --model <dir>   # the code path on a small model (smoke test)
    python bench/steerlm_demo.py --lora --pack-length 0 --batch-size 8 --learning-rate 1e-3 --attributes-in system
                                                                    # ~ the earlier LoRA runs (then: a +1 slip)
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

from plugins.builtin_math import builtin_rows

# Each step of a built-in solution reads "<words><x> <op> <y> = <r> <unit>."
STEP = re.compile(r"(\d+ [-+*/] \d+) = (\d+)")
CONDITIONS = ["correct:1,length:0", "correct:0,length:0", "correct:1,length:1", "correct:0,length:1"]


def slipped(solution: str) -> str:
    """The solution with a 0 appended to its final result, in the last step and after ####: one consistent slip (a
    wrong result the model can make without knowing the right one's neighbours), not +1 (which needs the carry) nor a
    random one of -2..+2 as builtin:math_preference's, which would share the probability mass under greedy decoding."""
    right = solution.rsplit("#### ", 1)[1]
    lines = solution.split("\n")
    lines[-2] = re.sub(rf"= {right}\b", f"= {right}0", lines[-2], count=1)
    return "\n".join(lines[:-1] + [f"#### {right}0"])


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
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--batch-size", type=int, default=2, help="packed rows per step (~4 documents each)")
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter (default: every weight)")
    parser.add_argument("--pack-length", type=int, default=480, help="sft.py --packing --max-length; 0 = no packing")
    parser.add_argument("--problems", type=int, default=300, help="train problems (x4 rows); tokenizing all is slow")
    parser.add_argument("--attributes-in", choices=["system", "user"], default="user")
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
    cmd += ["--logging-steps", "10", "--output-dir", os.path.join(args.out, "runs"), "--lr-scheduler-type", "constant"]
    cmd += [] if args.lora else ["--no-use-lora"]
    cmd += ["--packing", "--max-length", str(args.pack_length)] if args.pack_length else []
    print("$", " ".join(cmd), flush=True)
    log = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    final_dir = re.findall(r"saved (\S+)", log)[-1]
    print(log.strip().splitlines()[-1], f"({time.perf_counter() - t0:.0f} s)", flush=True)

    # ---- 3 steer: the same held-out prompts under each attribute set, greedy
    from evals.common_eval import evaluate_gsm8k, gsm8k_rows, load_eval_model

    model, tokenizer = load_eval_model(args.model, adapter=final_dir)
    results = {}
    for spec in CONDITIONS:
        t0 = time.perf_counter()
        rows = gsm8k_rows("builtin:math", "test", args.limit, attributes=spec, where=args.attributes_in)
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

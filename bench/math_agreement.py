"""The math checker (common.rewards.math_reward) against Math-Verify on the regression sets of tests/math_cases.py and
tests/math_cases_round5.py, and on real references: every GSM8K test solution scored against itself as a completion,
the same solutions without their `#### N` line (what the last-number fallback reads), and every row of the GSM8K files
(and builtin:math) through the row check grpo.py and raft.py run before the model loads.

Math-Verify is a measurement tool here, not a dependency of the project:

    pip install math-verify
    OMP_NUM_THREADS=1 python bench/math_agreement.py [--data ../shared/data]"""

import argparse
import importlib.metadata
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo, for common/

from common.data import load_rows
from common.completions import validate_rows
from common.rewards import load_reward_funcs, math_reward
from harness.cli import check_reward_fields
from plugins.builtin_math import builtin_rows, question_row
from tests import math_cases_round5
from tests.math_cases import CASES


def math_verify_score(completion: str, reference: str) -> int:
    """Math-Verify's verdict as its README runs it: parse the gold and the prediction, then verify(gold, answer)."""
    from math_verify import parse, verify  # the optional measurement tool

    gold = parse(reference)
    if not gold:
        raise ValueError(f"Math-Verify cannot parse the reference {reference!r}")
    return int(verify(gold, parse(completion)))


def regression_table(cases: list[tuple[str, str, int]], title: str) -> None:
    """Cases, how many each checker scores as expected, how often they agree, and every case where they differ."""
    ours = [int(math_reward(None, [c], answer=[r])[0] == 1.0) for c, r, _ in cases]
    theirs = [math_verify_score(c, r) for c, r, _ in cases]
    print(f"\n{title} (Math-Verify {importlib.metadata.version('math-verify')})\n")
    expected = [e for _, _, e in cases]
    print("| set | cases | ours right | Math-Verify right | both agree |\n|---|---|---|---|---|")
    for name, keep in (("must score 1", 1), ("must score 0", 0), ("all", None)):
        idx = [i for i, e in enumerate(expected) if keep is None or e == keep]
        right_ours = sum(ours[i] == expected[i] for i in idx)
        right_theirs = sum(theirs[i] == expected[i] for i in idx)
        agree = sum(ours[i] == theirs[i] for i in idx)
        print(f"| {name} | {len(idx)} | {right_ours} | {right_theirs} | {agree} |")
    wrong = [sum(got[i] == 1 and expected[i] == 0 for i in range(len(cases))) for got in (ours, theirs)]
    print(f"false positives (scored 1, must score 0): ours {wrong[0]}, Math-Verify {wrong[1]}")
    print("\ndisagreements (expected, ours, Math-Verify):")
    for i, (completion, reference, _) in enumerate(cases):
        if ours[i] != theirs[i]:
            print(f"  {expected[i]} {ours[i]} {theirs[i]}  {completion!r} vs {reference!r}")


def gsm8k_references(data: str) -> None:
    """Each GSM8K test solution as a completion against itself: the checker must read every reference."""
    with open(os.path.join(data, "gsm8k", "test.jsonl")) as f:
        answers = [json.loads(line)["answer"] for line in f]
    scores = math_reward(None, answers, answer=answers)
    print(f"\nGSM8K test references scored 1 against themselves: {scores.count(1.0)}/{len(answers)}")
    bodies = [a.rsplit("####", 1)[0].rstrip() for a in answers]  # the worked steps alone: the fallback reads them
    scores = math_reward(None, bodies, answer=answers)
    print(f"GSM8K test solutions without their '#### N' line scored 1: {scores.count(1.0)}/{len(answers)}")


def row_checks(data: str) -> None:
    """Rows that pass check_reward_fields under --rewards math, as grpo.py loads them (load_rows, validate_rows)."""
    funcs = load_reward_funcs(["math"])
    sources = [(os.path.join(data, "gsm8k", f"{split}.jsonl"), "train") for split in ("train", "test")]
    for source, split in sources + [("builtin:math", "train"), ("builtin:math", "test")]:
        rows = validate_rows(load_rows(source, split, question_row, builtin_rows), "prompt")
        check_reward_fields(rows, funcs)  # raises DataError naming the first row it refuses
        name = f"{source} ({split})" if source.startswith("builtin:") else os.path.relpath(source, data)
        print(f"row check, --rewards math: {name}: {len(rows)}/{len(rows)} rows pass")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_data = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data")
    parser.add_argument("--data", default=default_data, help="the shared data folder (holds gsm8k/)")
    args = parser.parse_args()
    regression_table(CASES, "tests/math_cases.py")
    regression_table(math_cases_round5.CASES, "tests/math_cases_round5.py")
    gsm8k_references(args.data)
    row_checks(args.data)


if __name__ == "__main__":
    main()

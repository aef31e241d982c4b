"""The built-in math data: procedural grade-school word problems in GSM8K's answer format (worked steps, then
"#### N"), so every script has data offline. `builtin_rows(name, split)` serves the `builtin:<name>` dataset specs
(pass it to common.data.load_rows as `builtin=`) from `make_math_problems`, a seeded generator (75% one-step over
one-digit numbers, 25% two-step), split so that no (kind, numbers) combination is in both splits. `question_row`
reads GSM8K's own {question, answer} rows as prompt rows (pass it to load_rows as `convert=`)."""

import random
import re
import zlib
from collections.abc import Callable

from common.completions import need, without

NAMES = {
    "Tom": "he",
    "Mia": "she",
    "Sam": "he",
    "Lily": "she",
    "Ben": "he",
    "Ava": "she",
    "Leo": "he",
    "Zoe": "she",
    "Max": "he",
    "Emma": "she",
    "Omar": "he",
    "Nina": "she",
}
ITEMS = ["apples", "marbles", "stickers", "pencils", "cookies", "books", "cards", "shells", "stamps", "balloons"]
PRICED = ["pen", "notebook", "toy car", "sandwich", "ticket", "comic"]
# The built-in problems take one or two steps, so their prompts ask for a one-line answer: shorter rollouts make each
# RL step cheaper and fewer are cut off (measured against MATH_INSTRUCTION below: docs/results.md).
BUILTIN_INSTRUCTION = "Solve it in one line with the calculation, and end with #### followed by the number."


def _problem(rng: random.Random):
    """One problem: (kind, question, solution steps, answer). Every step ends with its arithmetic 'a op b = c unit.'"""
    N, M = rng.sample(sorted(NAMES), 2)  # two different people; p, P, His refer to N
    p = NAMES[N]
    it = rng.choice(ITEMS)
    P = p.capitalize()
    His = "His" if p == "he" else "Her"
    # 75% one-step (kinds 0-5) over one-digit numbers: a small model gets some of them right, and group-relative RL
    # learns only from groups that hold a right answer (measured rates: docs/results.md).
    kind = rng.randrange(6) if rng.random() < 0.75 else rng.randrange(6, 11)
    a = rng.randint(2, 9)
    b = rng.randint(2, 9)
    c = rng.randint(2, 9)
    if kind == 0:
        q = f"{N} has {a} {it}. {P} buys {b} more. How many {it} does {N} have now?"
        s = [(f"{N} buys {b} more, so {p} has ", a, "+", b, f"{it} now")]
    elif kind == 1:
        q = f"A jar has {a} {it}. {N} puts in {b} more. How many {it} are in the jar now?"
        s = [("The jar has ", a, "+", b, it)]
    elif kind == 2:
        a += b  # keeps the answer positive
        q = f"{N} had {a} {it}. {P} gave {b} of them to {M}. How many {it} does {N} have left?"
        s = [(f"{N} gave away {b}, so {p} has ", a, "-", b, f"{it} left")]
    elif kind == 3:
        a += b
        q = f"A shop had {a} {it}. It sold {b} of them. How many {it} does the shop have left?"
        s = [("The shop has ", a, "-", b, f"{it} left")]
    elif kind == 4:
        q = f"{N} has {a} bags with {b} {it} in each bag. How many {it} does {N} have in total?"
        s = [(f"{a} bags with {b} {it} each make ", a, "*", b, it)]
    elif kind == 5:
        a = c * rng.randint(2, 9)  # divides evenly by construction
        b = c
        q = f"{N} shares {a} {it} equally among {b} friends. How many {it} does each friend get?"
        s = [("Each friend gets ", a, "/", b, it)]
    elif kind == 6:
        c = rng.randint(1, a + b - 1)
        q = f"{N} has {a} {it}. {P} finds {b} more and then loses {c}. How many {it} does {N} have now?"
        s = [(f"After finding {b}, {N} has ", a, "+", b, it), (f"After losing {c}, {p} has ", a + b, "-", c, it)]
    elif kind == 7:
        a = c
        b = rng.randint(2, 9)
        c = rng.randint(2, 9)
        q = f"A box holds {a} {it}. {N} has {b} boxes and {c} loose {it}. How many {it} does {N} have altogether?"
        s = [("The boxes hold ", b, "*", a, it), (f"With the loose ones, {N} has ", a * b, "+", c, it)]
    elif kind == 8:
        a = rng.randint(1, 9)
        b = rng.randint(2, 5)
        thing = rng.choice(PRICED)
        c = rng.choice([x for x in (10, 20, 50, 100) if x >= a * b])
        q = f"A {thing} costs ${a}. {N} buys {b} of them and pays with a ${c} bill. How much change does {N} get?"
        s = [(f"{b} of them cost ", b, "*", a, "dollars"), ("The change is ", c, "-", a * b, "dollars")]
    elif kind == 9:
        a = rng.randint(5, 15)
        q = f"{N} is {a} years old. {His} sister is {b} years older. How old will she be in {c} years?"
        s = [(f"{N}'s sister is ", a, "+", b, "years old"), (f"In {c} years she will be ", a + b, "+", c, "years old")]
    else:
        k = rng.randint(3, 9)
        b = c
        a = k * b
        c = rng.randint(1, k - 1)
        q = f"{N} puts {a} {it} equally into {b} jars. Then {p} takes {c} out of one jar. "
        q += f"How many {it} are left in it?"
        s = [("Each jar gets ", a, "/", b, it), (f"After taking {c} out, that jar has ", k, "-", c, it)]
    results = [{"+": x + y, "-": x - y, "*": x * y, "/": x // y}[op] for _, x, op, y, _ in s]
    steps = [f"{text}{x} {op} {y} = {r} {unit}." for (text, x, op, y, unit), r in zip(s, results)]
    return kind, q, steps, results[-1]


def make_math_problems(n: int, seed: int, keep: Callable[[tuple], bool] | None = None) -> list[dict]:
    """n distinct word problems {"question", "answer"} (answer: worked steps, then "#### N"); same seed, same rows.
    keep(key) -> bool, if given, filters on the problem's key (kind, *numbers), names and items left out."""
    rng = random.Random(seed)
    seen = set()
    rows = []
    for _ in range(200 * n):
        if len(rows) == n:
            break
        kind, question, steps, result = _problem(rng)
        if question not in seen and (keep is None or keep((kind, *map(int, re.findall(r"\d+", question))))):
            seen.add(question)
            rows.append({"question": question, "answer": "\n".join(steps) + f"\n#### {result}"})
    if len(rows) < n:
        raise ValueError(f"only {len(rows)} distinct problems exist in these number ranges, asked for {n}")
    return rows


def _is_test_problem(key: tuple) -> bool:
    """A fixed fifth of the (kind, numbers) combinations is held out: test problems share no arithmetic with train."""
    return zlib.crc32(repr(key).encode()) % 5 == 0


def _wrong(solution: str, rng: random.Random) -> str:
    """Same worked solution with an arithmetic slip in the last step, so only the final answer differs."""
    right = int(solution.rsplit("#### ", 1)[1])
    wrong = rng.choice([x for x in (right - 2, right - 1, right + 1, right + 2) if x >= 0])
    lines = solution.split("\n")
    lines[-2] = re.sub(rf"= {right}\b", f"= {wrong}", lines[-2], count=1)
    return "\n".join(lines[:-1] + [f"#### {wrong}"])


BUILTIN_NAMES = {
    "math": "prompt-only {prompt, answer} for GRPO/RAFT; answer is the final number as a string",
    "math_sft": "{prompt, completion} with the worked solution ending in '#### N'",
    "math_preference": "{prompt, chosen, rejected}: correct solution vs the same one with a slip in the last step",
    "math_binary": "{prompt, completion, label} for KTO: alternately correct (True) and slipped (False)",
}
SPLIT_SIZES = {"train": 2000, "test": 200}


def builtin_rows(name: str, split: str = "train") -> list[dict]:
    """Rows for the dataset spec builtin:<name> (see BUILTIN_NAMES); splits "train" (2,000) and "test" (200)."""
    if name not in BUILTIN_NAMES or split not in SPLIT_SIZES:
        raise ValueError(
            f"unknown builtin:{name} / split {split!r}; names: {list(BUILTIN_NAMES)}, splits: train, test"
        )
    # Train and test come from disjoint (kind, numbers) combinations; names and items vary within each.
    problems = make_math_problems(SPLIT_SIZES[split], 0, keep=lambda key: _is_test_problem(key) == (split == "test"))
    rng = random.Random(f"slips-{split}")
    rows = []
    for i, pb in enumerate(problems):
        prompt = [{"role": "user", "content": f"{pb['question']}\n{BUILTIN_INSTRUCTION}"}]
        right = [{"role": "assistant", "content": pb["answer"]}]
        wrong = [{"role": "assistant", "content": _wrong(pb["answer"], rng)}]  # always drawn: same slips per name
        good = i % 2 == 0  # alternating labels keep math_binary exactly balanced
        rows.append(
            {
                "math": {"prompt": prompt, "answer": pb["answer"].rsplit("#### ", 1)[1]},
                "math_sft": {"prompt": prompt, "completion": right},
                "math_preference": {"prompt": prompt, "chosen": right, "rejected": wrong},
                "math_binary": {"prompt": prompt, "completion": right if good else wrong, "label": good},
            }[name]
        )
    return rows


# ----------------------------------------------------------------------------------------------- GSM8K layout
# Chosen by measurement: the instruction the embedded model most often follows with "#### N" (docs/results.md).
MATH_INSTRUCTION = "Solve it step by step. On the last line, write the final answer as #### followed by the number."


def question_row(row: dict, instruction: str = MATH_INSTRUCTION) -> dict:
    """A {question, answer} math row (GSM8K: hub openai/gsm8k:main and its JSONL files alike) as a prompt-only row:
    prompt = one user turn, the question then `instruction` ('' for the bare question) on a new line; answer = the
    number after the last '####' with thousands commas dropped ('#### 1,080' -> '1080'), the whole worked solution
    kept as `solution`. An answer without '####' (a bare number) stays as given; `question` stays too. A row with a
    prompt, or without a question, is returned as it is (load_rows' convert= for prompt data)."""
    if "prompt" in row or "question" not in row:
        return row
    question = need(row, "question", str)
    content = f"{question}\n{instruction}" if instruction else question
    out = without(row, "answer") | {"prompt": [{"role": "user", "content": content}]}
    answer = row.get("answer")
    if isinstance(answer, str) and "####" in answer:
        return out | {"answer": answer.rsplit("####", 1)[1].strip().replace(",", ""), "solution": answer}
    if answer is None:
        return out
    return out | {"answer": str(answer)}

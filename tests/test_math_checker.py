"""The math checker (common.rewards: extract_answer, exact_number, math_reward) on its regression sets
(tests/math_cases.py, tests/math_cases_round5.py), on the cases issues 28, 40 and 51 reported wrong, on input built to
make regexes backtrack, from threads, and the row check that refuses an `answer` it cannot read exactly
(math_row_problem through harness.cli.check_reward_fields and grpo)."""

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import pytest

import grpo
from common.data import load_rows
from common.completions import validate_rows
from common.errors import DataError
from common.rewards import exact_number, load_reward_funcs, math_reward, reference_number
from harness.cli import check_reward_fields
from plugins.builtin_math import question_row
from tests.math_cases import CASES
from tests import math_cases_round5
from tests.prefs_helpers import write_jsonl


def score(completion, reference) -> float | None:
    return math_reward(None, [completion], answer=[reference])[0]


@pytest.mark.parametrize("completion, reference, expected", CASES)
def test_the_regression_set(completion, reference, expected):
    assert score(completion, reference) == expected


def test_the_regression_set_is_large_and_goes_both_ways():
    assert len(CASES) >= 150
    assert 50 <= sum(expected for _, _, expected in CASES) <= len(CASES) - 50  # enough of each verdict
    assert len({(c, r) for c, r, _ in CASES}) == len(CASES)  # no case twice


# Issue 28, section 4: each of these scored 0 (the value the old checker read is in the comment).
@pytest.mark.parametrize(
    "completion, reference",
    [
        ("The answer is 9 * 2 = 18.", "18"),  # read 9: the phrase took the first operand
        ("The answer is 3 + 4 + 11 = 18", "18"),  # read 3
        ("#### 18 = 9 * 2", "18"),  # read 9: the right side of the last '='
        ("#### 40 minutes = 2/3 hour", "40"),  # read 2/3
        ("So the total is $1{,}080$.", "1080"),  # read 80: '{,}' split the number
        ("So the total is 1\\,080.", "1080"),  # read 80
        ("#### +18", "18"),  # read nothing: no '+' sign
        ("\\boxed{\\textbf{18}}", "18"),  # read nothing
        ("\\boxed{\\dfrac12}", "1/2"),  # read nothing: only \frac{a}{b} with braces
    ],
)
def test_issue_28_cases_score_1(completion, reference):
    assert score(completion, reference) == 1.0


@pytest.mark.parametrize(
    "s, value",
    [
        ("2 1/2", Fraction(5, 2)),  # read 21/2
        ("-2 1/2", Fraction(-5, 2)),
        ("2\\frac{1}{2}", Fraction(5, 2)),
        ("21/2", Fraction(21, 2)),
        ("2 1/2 = 5/2", Fraction(5, 2)),
        ("+18", Fraction(18)),
        ("18 = 9 * 2", Fraction(18)),
        ("9 * 2 = 18", Fraction(18)),
        ("x = 9 * 2 = 18", Fraction(18)),
        ("9 * 2", None),  # a calculation without its result
        ("1{,}080", Fraction(1080)),
        ("\\dfrac12", Fraction(1, 2)),
        ("\\tfrac{1}{2}", Fraction(1, 2)),
        ("\\frac{1}{0}", None),
    ],
)
def test_exact_number_reads_mixed_numbers_signs_and_derivations(s, value):
    assert exact_number(s) == value


# Issue 40, section 2: each of these scored 1, a false positive (what the old checker read is in the comment).
@pytest.mark.parametrize(
    "completion, reference",
    [
        ("The floor is 24 m^2.", "2"),  # read the unit's exponent
        ("\\boxed{2^{10}}", "2"),  # read the base
        ("The answer is 3.2e5.", "3.2"),  # read the mantissa
        ("\\boxed{3\\sqrt{2}}", "3"),  # read the factor before the radical
        ("There are 1 234 567 of them.", "567"),  # read the last group
        ("It takes 7\u20139 days.", "9"),  # read one end of the range
        ("It takes 3\u20134 hours.", "4"),
        ("The answer is 10 to 12.", "10"),
    ],
)
def test_issue_40_false_positives_score_0(completion, reference):
    assert score(completion, reference) == 0.0


# Issue 40: each of these scored 0 or None, though the answer is unambiguous.
@pytest.mark.parametrize(
    "completion, reference",
    [
        ("The answer is 3.2e5.", "320000"),
        ("The answer is 3.2 \\times 10^5.", "320000"),
        ("\\boxed{- 14}", "-14"),
        ("\\boxed{\u2212 14}", "-14"),
        ("#### The answer is 48", "48"),
        ("\\boxed{10^3}", "1000"),
    ],
)
def test_issue_40_unambiguous_answers_score_1(completion, reference):
    assert score(completion, reference) == 1.0


@pytest.mark.parametrize(
    "s, value",
    [
        ("2^{10}", Fraction(1024)),
        ("2**10", Fraction(1024)),
        ("-2^2", Fraction(-4)),  # the sign applies to the power, as in LaTeX
        ("10^{-2}", Fraction(1, 100)),
        ("3.2e5", Fraction(320000)),
        ("3.2E+5", Fraction(320000)),
        ("1.5e-3", Fraction(3, 2000)),
        ("3.2 \\times 10^{5}", Fraction(320000)),
        ("3.2 \\cdot 10^5", Fraction(320000)),
        ("1 234 567", Fraction(1234567)),
        ("1'234'567", Fraction(1234567)),
        ("- 14", Fraction(-14)),
        ("90^\\circ", Fraction(90)),
        ("12\\text{ m}^2", Fraction(12)),
        ("2^{10} = 1024", Fraction(1024)),
        ("3\\sqrt{2} = 4.24", Fraction(424, 100)),  # a radical before '=' is a calculation: its result counts
        ("3\\sqrt{2}", None),
        ("2\\pi", None),
        ("(-2)^2", None),  # a power of a bracket is not read, and not read as -2
        ("3/2^2", None),  # 3/4 or 9/4
        ("2 1/2^2", None),
        ("0^{-1}", None),
        ("10^{100000}", None),  # past the digits it evaluates
        ("2^x", None),
        ("10\u2075", None),  # a superscript exponent is not read
        ("7\u20139", None),
        ("1,23", None),  # not thousands: 1.23 in some locales, 123 in none
        ("1 2345", None),
        ("3:4", None),
        ("3i", None),
    ],
)
def test_exact_number_reads_powers_and_refuses_what_it_cannot_read(s, value):
    assert exact_number(s) == value


@pytest.mark.parametrize("completion, reference, expected", math_cases_round5.CASES)
def test_the_round5_set(completion, reference, expected):
    # The known misses are refused (0), never read as another number: the checker does not know which one is asked.
    known_miss = (completion, reference) in math_cases_round5.KNOWN_MISSES
    assert score(completion, reference) == (0.0 if known_miss else expected)


def test_the_round5_set_goes_both_ways():
    cases = math_cases_round5.CASES
    assert len(cases) >= 100 and len({(c, r) for c, r, _ in cases}) == len(cases)
    assert 40 <= sum(expected for _, _, expected in cases) <= len(cases) - 40
    assert all((c, r, 1) in cases for c, r in math_cases_round5.KNOWN_MISSES)


# Issue 51, section 11: each of these scored 1, a false positive (what the old checker read is in the comment).
@pytest.mark.parametrize(
    "completion, reference",
    [
        ("The answer is \uff0d\uff15.", "5"),  # read 5: the full-width minus was dropped
        ("The answer is \uff15\uff0e\uff15.", "5"),  # read 5: the full-width point ended the number
        ("The answer is \uff11\uff0c\uff12\uff10\uff10.", "1"),  # read 1: the full-width comma ended it
        ("The answer is \u20125.", "5"),  # read 5: the figure dash was dropped
        ("The answer is \ufe635.", "5"),  # read 5: the small hyphen-minus was dropped
        ("The answer is 12\u2153.", "12"),  # read 12: the vulgar fraction was left out
        ("The answer is 5\u066b5.", "5"),  # read 5: the Arabic decimal separator ended the number
        ("The answer is 2\u00bd.", "2"),  # read 2
        ("\\boxed{0.\\overline{3}}", "0"),  # read 0: the overline was left out
        ("x = 42 - y", "42"),  # read 42: the variable was left out
        ("The answer is 2n + 1.", "2"),  # read 2: the rest was a unit
        ("#### 42\nIt should be 43", "42"),  # read 42: the self-correction was not read
        ("\\boxed{42}. The answer is 43.", "42"),  # read 42: a later marked answer was not read
        ("So she has 18 apples left, 2 fewer than Tom.", "2"),  # read 2: the fallback took a number after the answer
        ("So she pays 9 * 2 = $18 for 9 eggs.", "9"),  # read 9
        ("x = 3 or x = 5", "5"),  # read 5: one of two candidates
        ("It takes 5\uff5e7 days.", "7"),  # read 7: the full-width tilde of a range was no operator
    ],
)
def test_issue_51_false_positives_score_0(completion, reference):
    assert score(completion, reference) == 0.0


# Issue 51, section 11: each of these scored 0, though the answer is written whole.
@pytest.mark.parametrize(
    "completion, reference",
    [
        ("The answer is \uff0d\uff15.", "-5"),
        ("The answer is \uff15\uff0e\uff15.", "5.5"),
        ("The answer is \uff11\uff0c\uff12\uff10\uff10.", "1200"),
        ("The answer is \ufe635.", "-5"),
        ("The answer is 12\u2153.", "37/3"),
        ("The answer is 5\u066b5.", "5.5"),
        ("The answer is 2\u00bd.", "5/2"),
        ("\\boxed{0.\\overline{3}}", "1/3"),
        ("The answer is - 3.", "-3"),  # the sign set apart after the phrase: no phrase was found
        ("The answer is \u2212 3.", "-3"),
    ],
)
def test_issue_51_answers_read_whole_score_1(completion, reference):
    assert score(completion, reference) == 1.0


@pytest.mark.parametrize(
    "s, value",
    [
        ("\uff0d\uff15\uff0e\uff15", Fraction(-11, 2)),
        ("\uff11\uff0c\uff12\uff10\uff10", Fraction(1200)),
        ("\u0664\u0662", Fraction(42)),  # Arabic-Indic digits
        ("\u0665\u066b\u0665", Fraction(11, 2)),
        ("12\u2153", Fraction(37, 3)),  # a mixed number, not 121/3 (NFKC writes it '121\u20443')
        ("\u00be", Fraction(3, 4)),
        ("1\u20444", Fraction(1, 4)),  # the fraction slash
        ("0.\\overline{3}", Fraction(1, 3)),
        ("0.1\\overline{6}", Fraction(1, 6)),
        ("1.\\overline{27}", Fraction(14, 11)),
        ("10\u2075", None),  # superscripts are not normalised: NFKC would make 105
        ("0.(3)", None),
        ("0.3\u0305", None),  # a combining overline
        ("0.\\dot{3}", None),
        ("42 - y", None),
        ("2n + 1", None),
        ("3 times 4", None),
        ("2 hours and 30 minutes", None),
        ("105(2/7)", None),  # a product written by juxtaposition
        ("18 dollars", Fraction(18)),
        ("60 km/h", Fraction(60)),
        ("$18 for 3 shirts", Fraction(18)),
        ("18 and I am sure", Fraction(18)),
    ],
)
def test_exact_number_reads_unicode_and_refuses_variables(s, value):
    assert exact_number(s) == value


@pytest.mark.parametrize(
    "answer, value",
    [
        ("\uff11\uff0c\uff12\uff10\uff10", Fraction(1200)),
        ("12\u2153", Fraction(37, 3)),
        ("#### \uff0d7", Fraction(-7)),
    ],
)
def test_a_reference_in_other_unicode_forms_is_read_whole(answer, value):
    assert reference_number(answer) == value
    check_reward_fields([{"prompt": "p", "answer": answer, "_loc": "f.jsonl:1"}], load_reward_funcs(["math"]))


@pytest.mark.parametrize("answer", ["x = 42 - y", "2n + 1", "0.(3)"])
def test_a_reference_with_a_variable_or_an_unread_repeat_is_refused(answer):
    assert reference_number(answer) is None


def test_self_corrections_and_competing_numbers_stay_cheap():
    # Each later self-correction or marked answer is read again (extract_answer on what follows it) and the fallback
    # reads every number of the last sentence: neither may make scoring quadratic or deep on text the policy writes.
    texts = [
        "#### 1\n" + "Wait, 2. " * 200,
        "\\boxed{1} " + "The answer is 2. " * 100,
        "#### 1\n" + "actually " * 200 + "3",
        "x = " + "1, " * 1000 + "2",
        "= 1 so " * 400 + "2",
        "0." + "1" * 3000 + "\\overline{" + "3" * 3000 + "}",
        "\uff11" * 5000,
    ]
    for text in texts:
        start = time.time()
        math_reward(None, [text], answer=["18"])
        exact_number(text)
        assert time.time() - start < 2.0  # hang guard
    assert math_reward(None, texts[:3], answer=["1", "1", "1"]) == [0.0, 0.0, 0.0]  # each takes its answer back


def test_powers_and_long_numbers_stay_cheap():
    # The policy writes the exponent and the digits: neither may make the trainer compute without bound or raise.
    texts = [
        "\\boxed{10^{999999999}}",
        "\\boxed{9^{" + "9" * 1000 + "}}",
        "#### " + "111 " * 600,  # grouped digits join into one number of 1,800 digits
        "1e" * 50_000,
        "2^" * 50_000,
        "1 \\times 10" * 20_000,
        "- " * 100_000,
        "111 " * 50_000,  # past int()'s 4,300 digits when read whole (exact_number reads whole strings)
    ]
    for text in texts:
        start = time.time()
        math_reward(None, [text], answer=["18"])
        exact_number(text)
        reference_number(text)
        assert time.time() - start < 2.0  # hang guard


def test_extraction_stays_linear_on_adversarial_text():
    # Each would take seconds or hang with a backtracking pattern; exact_number is public and reads whole strings.
    texts = [
        "\\frac{" * 50_000,
        "1 " * 100_000 + "/",
        ("1" * 4000 + " ") * 25,  # long whole parts of a mixed number that never comes (short enough for int())
        "answer is 1 * " * 20_000,
        "$" * 200_000,
        "1{,}" * 50_000,
        "\\text{" * 50_000 + "x",
        "= 9 * " * 30_000,
        "answer" + "*" * 100_000,
    ]
    for text in texts:
        start = time.time()
        math_reward(None, [text], answer=["18"])
        exact_number(text)
        assert time.time() - start < 2.0  # hang guard


def test_scoring_from_threads_matches_scoring_in_order():
    # No signal-based timeout: rewards are scored from worker threads (the code reward runs 8 at once).
    completions = [c for c, _, _ in CASES] * 4
    references = [r for _, r, _ in CASES] * 4
    alone = math_reward(None, completions, answer=references)
    with ThreadPoolExecutor(8) as pool:
        threaded = list(pool.map(score, completions, references))
    assert threaded == alone


# ---------------------------------------------------------------------------------------------------- row check
@pytest.mark.parametrize("answer", ["", "   ", "p - q", "seventy-two", "#### "])
def test_an_answer_without_a_number_is_refused(answer):
    rows = [
        {"prompt": "p", "answer": "72", "_loc": "f.jsonl:1"},
        {"prompt": "q", "answer": answer, "_loc": "f.jsonl:2"},
    ]
    expected = rf"^f.jsonl:2: field 'answer': has no number the math reward can read: {re.escape(repr(answer))}$"
    with pytest.raises(DataError, match=expected):
        check_reward_fields(rows, load_reward_funcs(["math"]))
    check_reward_fields(rows[:1], load_reward_funcs(["math"]))  # the good row alone passes
    check_reward_fields(rows[1:], load_reward_funcs(["format"]))  # a reward that does not read `answer`


# Issue 40: each was read as a wrong number (in the comment) and passed the row check, so a completion stating that
# number scored 1.0.
@pytest.mark.parametrize(
    "answer",
    [
        "3\\sqrt{2}",  # read 2
        "\\frac{\\pi}{4}",  # read 4
        "\\boxed{5\\pi}",  # read 5
        "(3, 4)",  # read 4
        "3 or 4",  # read 4
        "7\u20139",  # read 9
        "10 to 12",  # read 12
        "2^x",  # read 2
        "about 40",  # read 40: a reference without a marker is the answer itself
    ],
)
def test_an_answer_the_checker_cannot_read_exactly_is_refused(answer):
    rows = [
        {"prompt": "p", "answer": "72", "_loc": "f.jsonl:1"},
        {"prompt": "q", "answer": answer, "_loc": "f.jsonl:2"},
    ]
    expected = rf"^f.jsonl:2: field 'answer': has no number the math reward can read: {re.escape(repr(answer))}$"
    with pytest.raises(DataError, match=expected):
        check_reward_fields(rows, load_reward_funcs(["math"]))
    assert reference_number(answer) is None
    assert math_reward(None, ["2", "4", "9", "12", "40"], answer=[answer] * 5) == [None] * 5


@pytest.mark.parametrize(
    "answer, value",
    [
        ("1e6", Fraction(10**6)),  # read 6
        ("6.02e23", Fraction(602 * 10**21)),  # read 23
        (1e-07, Fraction(1, 10**7)),  # a float column: str() writes it so; read -7
        ("2.5 \\times 10^3", Fraction(2500)),  # read 3
        ("2^{10}", Fraction(1024)),  # read 2
        ("1 234 567", Fraction(1234567)),  # read 567
        ("- 14", Fraction(-14)),  # read 14
        ("x = 5", Fraction(5)),
        ("12 cm", Fraction(12)),
        ("Janet makes 18 dollars.\n#### 18", Fraction(18)),
    ],
)
def test_a_reference_is_read_exactly_and_passes_the_row_check(answer, value):
    assert reference_number(answer) == value
    check_reward_fields([{"prompt": "p", "answer": answer, "_loc": "f.jsonl:1"}], load_reward_funcs(["math"]))


def test_grpo_refuses_an_empty_answer_before_the_model_loads(tmp_path, monkeypatch):
    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the data was checked")

    monkeypatch.setattr(grpo, "load_model", load_model)
    rows = [{"question": "2 + 2?", "answer": "#### 4"}, {"question": "3 + 3?", "answer": "#### "}]
    data = write_jsonl(tmp_path / "math.jsonl", rows)
    args = grpo.Args(model="unused", dataset=data, output_dir=str(tmp_path / "runs"), rewards=["math"], preset="demo")
    expected = rf"^{re.escape(data)}:2: field 'answer': has no number the math reward can read: ''$"
    with pytest.raises(DataError, match=expected):
        grpo.main(args)


def test_every_gsm8k_row_passes_the_row_check(shared_data):
    funcs = load_reward_funcs(["math"])
    for split, n in (("train", 7473), ("test", 1319)):
        rows = validate_rows(load_rows(str(shared_data / "gsm8k" / f"{split}.jsonl"), convert=question_row), "prompt")
        assert len(rows) == n
        check_reward_fields(rows, funcs)
    with open(shared_data / "gsm8k" / "test.jsonl") as f:
        answers = [json.loads(line)["answer"] for line in f]
    assert math_reward(None, answers, answer=answers) == [1.0] * len(answers)  # each solution reads as its own answer

"""The code reward's boundary against the policy (issue #28, section 1), in both sandboxes (test_rewards.py's
fixtures): expected values are never computed where the solution can touch them, the trainer bounds what it computes
on the solution's values, malformed test cases are refused before the model loads, and the solution cannot forge the
sandbox's warnings. Concurrent samples sharing no process limit is in test_sandbox_bounds.py."""

import os
import subprocess
import sys
import tempfile
import warnings

import pytest

import grpo
from common.errors import DataError
from common.rewards import check_reward_fields, load_reward_funcs
from plugins.code import _relay, code_reward, run_code_tests, run_python
from tests import test_input_edges, test_rewards
from tests.prefs_helpers import ROOT, write_jsonl

kind, no_leftovers = test_rewards.kind, test_rewards.no_leftovers
no_model_load = test_input_edges.no_model_load

# The solution finds the list of queries the bootstrap will evaluate (its caller's globals) and evaluates the last
# one itself: an expected value sent to the sandbox as a query is then its own answer.
READS_THE_QUERIES = (
    "import sys\nframe = sys._getframe()\nwhile frame and 'cfg' not in frame.f_globals:\n    frame = frame.f_back\n"
    "queries = [q[0] if isinstance(q, list) else q for q in frame.f_globals['cfg']['queries']]\n"
    "f = lambda x: eval(queries[-1])"
)


def test_an_expected_value_is_never_the_solutions(no_leftovers):
    """A name, an attribute or a comprehension on the expected side went to the sandbox as a query, evaluated in the
    solution's namespace: shadowing `math`, or evaluating the query it read, passed (1.0)."""
    shadows_math = "import types\nmath = types.SimpleNamespace(pi=7)\nf = lambda x: 7"
    assert run_code_tests(shadows_math, ["assert f(1) == math.pi"]) == 0.0
    assert run_code_tests("f = lambda x: 3.141592653589793", ["assert f(1) == math.pi"]) == 1.0  # math's own pi
    with pytest.raises(ValueError, match=r"^\[0\] '\[i \* i for i in range\(3\)\]' would be evaluated where the"):
        run_code_tests(READS_THE_QUERIES, ["assert f(3) == [i * i for i in range(3)]"])
    # written as a literal, the expected value stays here: the one query is `f(3)`, of no use to the solution
    assert run_code_tests(READS_THE_QUERIES, ["assert f(3) == [0, 1, 4]"]) == 0.0
    assert run_code_tests("f = lambda x: [i * i for i in range(x)]", ["assert f(3) == [0, 1, 4]"]) == 1.0


@pytest.mark.parametrize(
    "test, problem",
    [
        ("assert f(3) == [i * i for i in range(3)]", "would be evaluated where the solution's code can touch it"),
        ("assert f(1) == (lambda: 2)()", "is neither the solution's .* nor evaluated here"),
        ("assert f('a') == collections.Counter('a')", "takes an attribute of the module collections"),
        ("assert len(h(K)) == K", "compares the solution's values only with each other"),
        ("assert math.isclose(f(1), g(1))", "compares the solution's values only with each other"),
        ("assert f(1) == math.factorial(3)", "math.factorial is not evaluated by the trainer"),
        ("assert sum(10, 15) == 6", "holds nothing of the solution's and fails here"),
    ],
)
def test_a_test_the_trainer_cannot_judge_is_refused(test, problem):
    with pytest.raises(ValueError, match=f"^\\[0\\] .*{problem}"):
        run_code_tests("", [test])
    assert code_reward.row_problem({"test_cases": [test]})[1].startswith("[0] ")


def test_the_judged_shapes_are_kept():
    """Shapes MBPP and HumanEval use, judged here on the solution's values (docs/rewards.md has the counts)."""
    for test in [
        "assert set(f((3, 4, 5, 6), (5, 7, 4, 10))) == set((4, 5))",
        "assert math.isclose(f(5), 78.53975, rel_tol=0.001)",
        "assert abs(f(1.33) - 0.33) < 1e-6",
        "assert f([1, 2]) == [1, 2], 'message'",
        "assert not f('dawood')",
        "assert Solution().f(1)[0] == 2",
        "assert f(*[1, 2], **{'k': 3}) in (1, 2)",
        "assert True",
    ]:
        assert code_reward.row_problem({"test_cases": [test]}) is None, test


# Each test would hold if the trainer computed it, on numbers the solution picks: 3 ** f(1) with f(1) = 10 ** 9 took
# minutes of the trainer's CPU (the sandbox's limits do not apply there), `[0] * f(1)` took its memory.
COSTLY = [
    ("def f(x):\n    return 10 ** 9", "assert 3 ** f(1) > 4"),
    ("def f(x):\n    return 10 ** 9", "assert 1 << f(1) > 4"),
    ("def f(x):\n    return 10 ** 9", "assert round(5, -f(1)) == 0"),
    ("def f(x):\n    return 5 * 10 ** 6", "assert len([0] * f(1)) > 4"),
    ("def f(x):\n    return 5 * 10 ** 6", "assert len('%0*d' % (f(1), 1)) > 4"),
    ("def f(x):\n    return [[0]] * 150_000", "assert sum(f(1), []) == [0] * 150_000"),
]


def test_the_trainer_bounds_what_it_computes_on_the_solutions_values():
    """The trainer in a child process under a CPU limit (a hang guard, far above what the new code takes): each test
    is refused (0.0 where computing it gives 1.0), and the same shapes still judge small values."""
    program = (
        "import resource, sys\nresource.setrlimit(resource.RLIMIT_CPU, (60, 60))\n"
        f"sys.path.insert(0, {ROOT!r})\nfrom plugins.code import run_code_tests\n"
        f"print([run_code_tests(code, [test]) for code, test in {COSTLY!r}])\n"
        "print(run_code_tests('def f(x):\\n    return 2', ['assert 3 ** f(1) == 9', 'assert [0] * f(1) == [0, 0]']))"
    )
    env = {**os.environ, "ONLYONE_SANDBOX": "fallback"}  # (either sandbox: this is about the trainer's side)
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[:2] == [str([0.0] * len(COSTLY)), "1.0"]


def test_a_value_past_the_parse_budget_is_not_parsed(no_leftovers):
    """The trainer parses at most _MAX_VALUES characters of the solution's values a run: a test needing more fails."""
    code = "def f(n):\n    return [0] * n"
    assert run_code_tests(code, ["assert len(f(300_000)) == 300_000"]) == 1.0  # about 0.9 MB of "0, "
    assert run_code_tests(code, ["assert len(f(400_000)) == 400_000"]) == 0.0


# ------------------------------------------------------------------------------------------------ malformed rows
MALFORMED = [
    (["assert f(1) =="], r"\[0\] not valid Python \(invalid syntax\): 'assert f\(1\) =='"),
    ([{"input": 1, "output": "1"}], r"\[0\] 'input' is int, not str: 1"),
    (["assert f(1) == 2", {"input": "", "output": ["2"]}], r"\[1\] 'output' is list, not str"),
    (["print(f(1))"], r"\[0\] an assert test is one assert statement"),
    ([7], r"\[0\] a test is an assert string or \{'input': str, 'output': str\}, not int"),
    ([{"input": "1", "expected": "1"}], r"\[0\] a test is an assert string .*, not \['expected', 'input'\]"),
    ({"inputs": ["1"], "outputs": []}, r"1 inputs but 0 outputs"),
    ({"inputs": [[1]], "outputs": [2], "fn_name": "f"}, r"APPS-style tests are stdin/stdout ones"),
    ('[{"input": "1"', r"not valid JSON"),
]


@pytest.mark.parametrize("tests, problem", MALFORMED)
def test_a_malformed_test_case_is_refused_naming_line_field_and_case(tests, problem):
    """They killed a grpo run after the model loaded, with a bare SyntaxError or AttributeError."""
    rows = [{"prompt": "p", "test_cases": ["assert f(1) == 2"], "_loc": "c.jsonl:1"}]
    rows.append({"prompt": "q", "test_cases": tests, "_loc": "c.jsonl:2"})
    with pytest.raises(DataError, match=f"^c.jsonl:2: field 'test_cases': {problem}"):
        check_reward_fields(rows, load_reward_funcs(["code"], grpo.REWARDS))
    with pytest.raises(ValueError, match=problem):
        run_code_tests("def f(x):\n    return 2", tests)


def test_grpo_refuses_a_malformed_test_case_before_the_model_loads(tmp_path, no_model_load):
    rows = [{"prompt": "p", "test_cases": ["assert f(1) == 2"]}, {"prompt": "q", "test_cases": ["assert f(1) =="]}]
    data = write_jsonl(tmp_path / "code.jsonl", rows)
    args = grpo.Args(model="unused", dataset=data, output_dir=str(tmp_path / "runs"), rewards=["code"], preset="demo")
    with pytest.raises(DataError, match=r"code.jsonl:2: field 'test_cases': \[0\] not valid Python"):
        grpo.main(args)


# ------------------------------------------------------------------------------------------------ warnings
def test_the_solution_cannot_forge_the_sandboxs_warnings(no_leftovers):
    """A solution's stderr lines `onlyone-sandbox: ...` (and `bwrap: ...`) became trainer warnings, many a
    call; now only the bootstrap's own descriptor is read, closed before the solution runs."""
    forger = (
        "import os, sys\nframe = sys._getframe()\nwhile frame and 'cfg' not in frame.f_globals:\n"
        "    frame = frame.f_back\nfd = frame.f_globals['cfg'].get('messages', 2)\n"
        "for i in range(2000):\n    sys.stderr.write(f'onlyone-sandbox: forged {i}\\nbwrap: forged {i}\\n')\n"
        "for path in [f'/proc/self/fd/{fd}', f'/proc/1/fd/{fd}', f'/proc/{os.getppid()}/fd/{fd}']:\n"
        "    try:\n        os.write(os.open(path, os.O_WRONLY), b'forged by path\\n')\n    except OSError:\n"
        "        pass\ntry:\n    os.write(fd, b'forged on the descriptor\\n')\nexcept OSError:\n    pass\nprint('ran')"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run_python(forger) == "ran\n"
    assert [str(w.message) for w in caught if "forged" in str(w.message)] == []


def test_the_bootstraps_messages_are_relayed_and_bounded():
    """What the bootstrap reports is warned about (at most 8 lines of 200 characters); bwrap's stderr lines only if the
    bootstrap never started, since after that the stderr is the solution's."""
    with tempfile.TemporaryFile() as messages, tempfile.TemporaryFile() as stderr:
        messages.write(b"mount /proc: Operation not permitted\nstarted\n")
        stderr.write(b"bwrap: forged by the solution\n")
        messages.flush()
        stderr.flush()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _relay("fallback", messages.fileno(), stderr.fileno())
        assert [str(w.message) for w in caught] == [
            "code sandbox (fallback): onlyone-sandbox: mount /proc: Operation not permitted"
        ]
    with tempfile.TemporaryFile() as messages, tempfile.TemporaryFile() as stderr:
        messages.write(b"".join(b"x" * 300 + b"\n" for _ in range(20)))
        stderr.write(b"bwrap: Creating new namespace failed: Operation not permitted\n")
        messages.flush()
        stderr.flush()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _relay("bwrap", messages.fileno(), stderr.fileno())
        assert len(caught) == 8 and all(len(str(w.message)) < 240 for w in caught)
    with tempfile.TemporaryFile() as messages, tempfile.TemporaryFile() as stderr:
        stderr.write(b"bwrap: Creating new namespace failed: Operation not permitted\n")
        stderr.flush()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _relay("bwrap", messages.fileno(), stderr.fileno())
        assert [str(w.message) for w in caught] == [
            "code sandbox (bwrap): bwrap: Creating new namespace failed: Operation not permitted"
        ]


# ------------------------------------------------------------------------------------------------ what stays possible
SECRET = test_rewards.SECRET


def test_forged_records_and_rebound_builtins_report_only_values_the_solution_could_return(no_leftovers):
    """What docs/rewards.md says stays possible: a solution may forge its result records or rebind the builtins the
    bootstrap uses, but what it reports is then a value of its choosing, which it could have returned: it passes
    exactly the tests it knows the expected values of, as hard-coding them does."""
    hard_coded = run_code_tests("def secret(x):\n    return 7919", SECRET)
    forged = "import atexit\natexit.register(print, '\\x1e0 7919\\n\\x1e1 7919')\ndef secret(x):\n    return 0"
    rebound = "import builtins\nbuiltins.eval = lambda *a, **k: 7919\ndef secret(x):\n    return 0"
    assert hard_coded == run_code_tests(forged, SECRET) == run_code_tests(rebound, SECRET) == 0.5

"""The code reward's boundary against the policy (issue #28, section 1), in both sandboxes (test_rewards.py's
fixtures): expected values are never computed where the solution can touch them, the trainer bounds what it computes
on the solution's values, malformed test cases are refused before the model loads, and the solution cannot forge the
sandbox's warnings. Concurrent samples sharing no process limit is in test_sandbox_bounds.py."""

import os
import shutil
import subprocess
import sys
import tempfile
import warnings

import pytest

import grpo
from common.errors import DataError, RewardError
from common.rewards import compute_rewards, load_reward_funcs
from harness.cli import check_reward_fields
from plugins import code
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


# ------------------------------------------------------------------------------------------------ malformed records
# Records a solution prints itself: tags whose payload does not fit them, shapes the bootstrap never writes.
MALFORMED_RECORDS = [
    '{"bytes": 5}',
    '{"bytes": null}',
    '{"complex": "ab"}',
    '{"set": [[1]]}',
    '{"dict": [1]}',
    '{"frozenset": [{"dict": [[1, 2]]}]}',
    '{"tuple": 5, "set": 6}',
    "[" * 100_000,
]


@pytest.mark.parametrize("record", MALFORMED_RECORDS)
def test_a_malformed_record_fails_its_test_and_never_stops_the_run(record, no_leftovers):
    """A record whose tag does not fit its payload (`{"bytes": 5}`) made the trainer's decoder raise AttributeError
    out of run_code_tests, code_reward and compute_rewards: one completion ended the run. Whatever the decoder or the
    evaluator raises, that test fails; the run's other records are still judged."""
    forger = f"import os\nprint('\\n\\x1e0 ' + {record!r} + '\\n\\x1e1 3', flush=True)\nos._exit(0)"
    honest = "def f(x):\n    return 2\n\n\ndef g(x):\n    return 3"
    tests = ["assert f(1) == 2", "assert g(1) == 3"]
    _, per_func = compute_rewards(
        [("code", code_reward, 1.0)], ["p", "p"], [forger, honest], {"test_cases": [tests] * 2}
    )
    assert per_func[:, 0].tolist() == [0.5, 1.0]


# ------------------------------------------------------------------------------------------------ the trainer's CPU
# Ints k * (2**61 - 1) all hash to 0 (CPython hashes ints modulo 2**61 - 1): a set or dict of n of them costs n² to
# build. 41,000 of them fit the 1 MiB parse budget and took 22 s of the trainer's CPU, forged as a record or through
# MBPP's `set(f(x))` shape, unforged.
COLLIDING = "[k * (2**61 - 1) for k in range({n})]"
QUADRATIC = [
    (
        "import json, os\nprint('\\n\\x1e0 ' + json.dumps({'set': "
        + COLLIDING.format(n=41_000)
        + "}), flush=True)\nos._exit(0)",
        "assert len(f(1)) == 41_000",
    ),
    (
        "import json, os\nprint('\\n\\x1e0 ' + json.dumps({'dict': [[k, 0] for k in "
        + COLLIDING.format(n=30_000)
        + "]}), flush=True)\nos._exit(0)",
        "assert len(f(1)) == 30_000",
    ),
    ("def f(x):\n    return " + COLLIDING.format(n=41_000), "assert len(set(f(1))) == 41_000"),
]


def test_the_trainers_work_on_the_solutions_values_has_a_cpu_budget():
    """The trainer in a child process under RLIMIT_CPU (10 s, a hang guard: the judge that computes on the solution's
    values is a process of its own, under its own budget): each sample scores 0, and the same shapes on ints that do
    not collide still score 1."""
    program = (
        "import resource, sys\nresource.setrlimit(resource.RLIMIT_CPU, (10, 10))\n"
        f"sys.path.insert(0, {ROOT!r})\nfrom plugins.code import run_code_tests\n"
        f"print([run_code_tests(code, [test]) for code, test in {QUADRATIC!r}])\n"
        "print(run_code_tests('def f(x):\\n    return list(range(41_000))', ['assert len(set(f(1))) == 41_000']))"
    )
    env = {**os.environ, "ONLYONE_SANDBOX": "fallback"}  # (either sandbox: this is about the trainer's side)
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[:2] == [str([0.0] * len(QUADRATIC)), "1.0"]


# ------------------------------------------------------------------------------------------------ the sandbox's choice
@pytest.fixture
def bwrap_chosen_afresh(monkeypatch):
    """bwrap is chosen, resolved and checked once a process: here afresh (with this test's PATH), and again after."""
    monkeypatch.delenv("ONLYONE_SANDBOX", raising=False)
    if code._kind(False) != "bwrap":
        pytest.skip("bubblewrap is not installed or cannot build its sandbox here (apt-get install bubblewrap)")
    code._kind.cache_clear()
    code._bwrap_program.cache_clear()
    yield
    code._kind.cache_clear()
    code._bwrap_program.cache_clear()


def test_bwrap_outside_the_runs_path_is_the_one_every_run_uses(tmp_path, bwrap_chosen_afresh):
    """bwrap on the trainer's PATH but outside /usr/bin:/bin (a conda env, /usr/local/bin) passed the probe, then
    each run's shell (PATH=/usr/bin:/bin) could not find it: every sample scored 0, correct ones too, in silence.
    Here /usr/bin/bwrap is hidden (a bind mount in a mount namespace of the trainer's own) and a copy of it is first
    on the PATH: the program is resolved once, to an absolute path, which every run uses."""
    if os.geteuid() != 0:
        pytest.skip("hiding /usr/bin/bwrap takes a mount namespace of root's")
    (tmp_path / "bin").mkdir()
    shutil.copy("/usr/bin/bwrap", tmp_path / "bin" / "bwrap")
    program = (
        f"import sys\nsys.path.insert(0, {ROOT!r})\nfrom plugins.code import run_code_tests\n"
        "print(run_code_tests('def f(x):\\n    return x + 1', ['assert f(1) == 2', 'assert f(2) == 3']))"
    )
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    hide = f'mount --bind /dev/null /usr/bin/bwrap && exec {sys.executable} -c "$0"'
    result = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", hide, program],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    if "mount" in result.stderr and result.returncode:
        pytest.skip(f"no mount namespace here: {result.stderr[-300:]}")
    assert result.stdout == "1.0\n", result.stderr[-2000:]
    assert f"code sandbox: bwrap ({tmp_path / 'bin' / 'bwrap'})" in result.stderr


def refusal_with_fake_bwrap(tmp_path, monkeypatch, script: str) -> tuple:
    """(the fake, the RewardError's message) of a code reward scored with `script` as the `bwrap` on PATH."""
    fake = tmp_path / "bin" / "bwrap"
    fake.parent.mkdir()
    fake.write_text(script)
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    with pytest.raises(RewardError) as caught:
        code_reward(None, ["def f(x):\n    return x + 1"], test_cases=[["assert f(1) == 2"]])
    return fake, str(caught.value)


def test_a_sandbox_failing_its_self_check_stops_the_run_in_one_line(tmp_path, monkeypatch, bwrap_chosen_afresh):
    """At first use a known-good and a known-bad solution run through the chosen sandbox: unless they score 1 and 0
    the run stops with one line naming the sandbox and its stderr. Here a `bwrap` that passes the probe (it exits 0)
    and runs nothing."""
    fake, message = refusal_with_fake_bwrap(tmp_path, monkeypatch, "#!/bin/sh\necho 'fake-bwrap: runs nothing' >&2\n")
    assert message.startswith(f"reward 'code': the code sandbox bwrap ({fake}) failed its self-check: "), message
    assert "fake-bwrap: runs nothing" in message and "\n" not in message


def test_a_bwrap_without_namespaces_fails_the_isolation_check(tmp_path, monkeypatch, bwrap_chosen_afresh):
    """A `bwrap` that runs its command without namespaces (it only honours --chdir's effect: it runs in the folder
    holding solution.py) passed the self-check, which tested function: good and bad solutions scored 1 and 0, and a
    solution then read a host file. The self-check runs a known escape now, a world-readable host file and a TCP
    listener of the trainer's: the run stops in one line naming bwrap and what the escape reached."""
    script = (
        f"#!{sys.executable}\nimport os, sys\nargs = sys.argv[1:]\n"
        "os.chdir(os.path.dirname(args[args.index('/tmp/solution.py') - 1]))\n"
        f"start = args.index({code._PYTHON!r})\nos.execv(args[start], args[start:])\n"
    )
    fake, message = refusal_with_fake_bwrap(tmp_path, monkeypatch, script)
    assert message.startswith(f"reward 'code': the code sandbox bwrap ({fake}) failed its isolation check: "), message
    assert "read the host file" in message and "connected to the trainer's listener" in message, message
    assert "\n" not in message


def test_the_real_sandboxes_pass_the_isolation_check(kind, no_leftovers):
    """The escape fails in both sandboxes here: bwrap, and the fallback where the kernel allows its namespaces."""
    from plugins.code import _ESCAPE, _isolation_check

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fallback warns where the escape got through
        _isolation_check(kind, kind)
    assert "socket.create_connection" in _ESCAPE


# ------------------------------------------------------------------------------------------ a judge killed by a signal
def _fake_judge(tmp_path, monkeypatch, body: str) -> None:
    """The judge's process replaced by a script: body, then (if it gets there) the real judge."""
    from plugins import code_judge

    script = tmp_path / "judge.py"
    script.write_text(
        f"import os, signal, sys\n{body}\n"
        f"os.execv(sys.executable, [sys.executable, '-I', '-S', {code_judge._SELF!r}])\n"
    )
    monkeypatch.setattr(code_judge, "_SELF", str(script))


def test_a_judge_killed_by_a_signal_is_an_error_naming_it_never_a_silent_0(tmp_path, monkeypatch):
    """A judge killed by the OOM killer (SIGKILL long before its CPU budget) or a SIGTERM scored a correct solution
    0 in silence. It is judged again (JUDGE_RETRIES times, a warning each), then the run stops in one line naming the
    reward and the signal."""
    run_code_tests("pass", ["assert 1 == 1"])  # the sandbox's first use checks itself: before the patch
    for sig in ("SIGKILL", "SIGTERM"):
        _fake_judge(tmp_path, monkeypatch, f"os.kill(os.getpid(), signal.{sig})")
        with warnings.catch_warnings(record=True) as caught, pytest.raises(RewardError) as error:
            warnings.simplefilter("always")
            run_code_tests("def f(x):\n    return x + 1", ["assert f(1) == 2"])
        message = str(error.value)
        assert message.startswith(f"reward 'code': the code judge was killed by {sig} after "), message
        assert "3 times in a row" in message and "\n" not in message
        assert sum("judging the sample again" in str(w.message) for w in caught) == 2


def test_a_judge_killed_once_is_judged_again(tmp_path, monkeypatch):
    """Killed the first time only: the sample gets its true score, with one warning."""
    run_code_tests("pass", ["assert 1 == 1"])
    marker = tmp_path / "killed-once"
    _fake_judge(
        tmp_path,
        monkeypatch,
        f"if not os.path.exists({str(marker)!r}):\n    open({str(marker)!r}, 'w').close()\n"
        "    os.kill(os.getpid(), signal.SIGKILL)",
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run_code_tests("def f(x):\n    return x + 1", ["assert f(1) == 2", "assert f(2) == 3"]) == 1.0
    assert ["code judge: killed by SIGKILL" in str(w.message) for w in caught] == [True]


def test_a_judge_past_its_cpu_budget_still_scores_0_quietly(tmp_path, monkeypatch):
    """What the budget kills (SIGXCPU at RLIMIT_CPU; the hard limit's SIGKILL once the budget is spent) is the
    solution's output costing too much: 0, no warning, no error."""
    from plugins import code_judge

    run_code_tests("pass", ["assert 1 == 1"])
    monkeypatch.setattr(code_judge, "JUDGE_CPU_S", 1)
    spin = "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (1, 2))\n{ignore}while True:\n    pass"
    for ignore in ("", "signal.signal(signal.SIGXCPU, signal.SIG_IGN)\n"):  # SIGXCPU, then the hard limit's SIGKILL
        _fake_judge(tmp_path, monkeypatch, spin.format(ignore=ignore))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert run_code_tests("def f(x):\n    return x + 1", ["assert f(1) == 2"]) == 0.0


def test_a_judge_killed_during_the_self_check_is_named_not_the_sandbox(tmp_path, monkeypatch, bwrap_chosen_afresh):
    """The self-check's known-good solution judged by a judge that is killed: the run stops naming the judge and its
    signal, not `the code sandbox ... failed its self-check`."""
    _fake_judge(tmp_path, monkeypatch, "os.kill(os.getpid(), signal.SIGKILL)")
    with pytest.raises(RewardError) as caught, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code_reward(None, ["def f(x):\n    return x + 1"], test_cases=[["assert f(1) == 2"]])
    assert str(caught.value).startswith("reward 'code': the code judge was killed by SIGKILL"), caught.value

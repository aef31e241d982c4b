"""common/rewards.py (answer extraction, rule rewards, the registry and the scorer), plugins/code.py (the code reward
and its sandbox's containment) and plugins/judge.py (the API judge).

Elapsed-time bounds below are hang guards for the sandbox's timeouts (generous multiples), not speed measurements.
"""

import http.server
import inspect
import json
import math
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings

import pytest
import torch

from common.rewards import (
    REWARD_FUNCS,
    compute_rewards,
    exact_number,
    extract_answer,
    format_reward,
    gsm8k_format_reward,
    json_reward,
    load_reward_funcs,
    math_reward,
    regex_reward,
    soft_overlong_reward,
    split_weight,
    target_length_reward,
    text_of,
)
from plugins.code import _BOOT, _cgroups, _kind, code_reward, run_code_tests, run_python
from plugins.judge import ApiJudge, _env_judge, api_reward

GSM8K_SOLUTION = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


def my_reward(prompts, completions, **kw):
    """A user reward loaded by load_reward_funcs as tests.test_rewards:my_reward."""
    return [float(len(c)) for c in completions]


# ---------------------------------------------------------------------------------------------------- math
@pytest.mark.parametrize(
    "text, value",
    [
        (GSM8K_SOLUTION, 72.0),
        ("Total: 1000 + 234 = <<1000+234=1234>>1234 dollars.\n#### 1,234", 1234.0),
        ("So the probability is \\boxed{\\frac{1}{2}}.", 0.5),
        ("\\boxed{\\dfrac{3}{4}} and then 5 more words 6", 0.75),  # the box wins over later numbers
        ("Nested: \\boxed{\\frac{\\sqrt{4}}{1}} ... \\boxed{12 \\text{ cm}}", 12.0),  # the last box, units dropped
        ("The answer is $18.00.", 18.0),
        ("The answer is 42. Check: 42 * 2 = 84", 42.0),  # the phrase wins over the last number
        ("Final answer: -7", -7.0),
        ("Final answer: \u22127", -7.0),  # typographic minus
        ("The temperature dropped to -3 degrees", -3.0),  # fallback: the last number
        ("The discount is 25%.", 25.0),
        ("answer: 3/4", 0.75),
        ("\\boxed{x = 5}", 5.0),
        ("\\boxed{\\$1,000}", 1000.0),
        ("I have no idea.", None),
        ("", None),
    ],
)
def test_extract_and_normalize(text, value):
    assert exact_number(extract_answer(text)) == value


@pytest.mark.parametrize(
    "s, value",
    [
        ("1,234", 1234.0),
        ("$18.00.", 18.0),
        ("-0.5", -0.5),
        (".5", 0.5),
        ("3/4", 0.75),
        ("\\frac{-1}{4}", -0.25),
        ("1/0", None),
        ("abc", None),
        (None, None),
    ],
)
def test_exact_number(s, value):
    assert exact_number(s) == value


def test_extract_answer_is_bounded_on_adversarial_text():
    # Inputs that make backtracking regexes explode; the tail cut and linear patterns keep these instant.
    for text in ("answer" + " " * 100_000 + "x", "\\boxed{" * 50_000, "1," * 100_000 + "x", "answer:" * 50_000):
        start = time.time()
        extract_answer(text)
        assert time.time() - start < 2.0  # hang guard


def test_math_reward():
    completions = [
        "48 + 24 = 72, so \\boxed{72}",
        "It is 72.0",
        "The answer is 71.",
        "no number here",
        [{"role": "assistant", "content": "#### 72"}],  # conversational
        "\\boxed{72}",
    ]
    answers = [GSM8K_SOLUTION, "72", "72", "72", "72", None]
    assert math_reward(None, completions, answer=answers) == [1.0, 1.0, 0.0, 0.0, 1.0, None]
    assert math_reward(None, ["0.3333333"], answer=["\\frac{1}{3}"]) == [1.0]  # rel tol 1e-6
    assert math_reward(None, ["0.33"], answer=["1/3"]) == [0.0]
    assert math_reward(None, ["7"]) == [None]  # no answer column


def test_math_reward_compares_exactly_not_to_a_relative_tolerance():
    # A relative tolerance of 1e-6 let an off-by-one pass at GSM8K's largest answers (its test set has 2,880,000), and
    # numbers past float range all became inf, so any two of them were equal.
    completions = ["#### 2,880,001", "9" * 400, "#### 2880000.0", "The answer is 1450000.5"]
    assert math_reward(None, completions, answer=["2880000", "8" * 400, "2,880,000", "1450000"]) == [
        0.0,
        0.0,
        1.0,
        0.0,
    ]
    # A non-integer reference still takes its rounded decimal (what a model writes for 1/3).
    assert math_reward(None, ["0.3333333", "0.333", "-0.25"], answer=["\\frac{1}{3}", "1/3", "\\frac{-1}{4}"]) == [
        1.0,
        0.0,
        1.0,
    ]


@pytest.mark.parametrize(
    "completion, reference, reward",
    [
        ("The answer is .5", "5", 0.0),  # a leading-dot decimal is not the integer after its dot
        ("The answer is .5", "0.5", 1.0),
        ("So it is -.25", "-0.25", 1.0),
        ("#### **18**", "18", 1.0),  # markdown bold on the answer line
        ("#### __18__", "18", 1.0),
        ("**Answer:** 18", "18", 1.0),
        ("The answer is **18**. Check: 18 / 2 = 9", "18", 1.0),  # a bold answer is still the marked one
        ("**Answer:** 18, which is 9 * 2.", "18", 1.0),
    ],
)
def test_math_reward_leading_dot_and_bold_answers(completion, reference, reward):
    assert math_reward(None, [completion], answer=[reference]) == [reward]


# ---------------------------------------------------------------------------------------------------- code sandbox
def _sandbox_leftovers(grace: float = 5.0) -> list[str]:
    """Processes of a sandbox and sandbox cgroups still present, but for those another test process has in flight (a
    parallel worker's sandbox is no leftover of ours; one orphaned to init or a subreaper is, whoever leaked it). A
    cgroup's name holds the pid of the process that made it (plugins/code.py): one made by another live test process
    is that process's (it makes its cgroups just before its sandbox joins them and removes them just after it ends,
    which under load can take seconds); one of ours, or of a process that is gone, is a leftover once its members are
    gone and `grace` seconds have passed."""
    deadline = time.monotonic() + grace
    # A process counts if it is still there, not in flight elsewhere, after the grace: one that ends meanwhile (another
    # worker's sandbox between our listing and our look at its parent) is no leftover.
    suspects = [(pid, cmdline) for pid, cmdline in _sandbox_processes() if not _in_flight_elsewhere(pid)]
    while suspects and time.monotonic() < deadline:
        time.sleep(0.05)
        suspects = [(pid, c) for pid, c in suspects if _cmdline(pid) is not None and not _in_flight_elsewhere(pid)]
    found = [f"pid {pid}: {cmdline[:80]!r}" for pid, cmdline in suspects if _cmdline(pid) is not None]
    for root in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup/memory", "/sys/fs/cgroup"):
        if not os.path.isdir(root):
            continue
        for name in [d for d in os.listdir(root) if d.startswith("onlyone_")]:
            path = os.path.join(root, name)
            if _made_elsewhere(name):
                continue
            members = _cgroup_members(path)
            while members == [] and time.monotonic() < deadline:
                time.sleep(0.05)
                members = _cgroup_members(path)
            if members is not None and not (members and all(_in_flight_elsewhere(pid) for pid in members)):
                found.append(f"cgroup {path} (processes {members})")
    return found


def _made_elsewhere(name: str) -> bool:
    """Whether cgroup `name` (onlyone_<pid>_<hex>) was made by another live process of this interpreter (a pytest-xdist
    worker, a parallel rerun), not by this process nor by one that is gone."""
    creator = name.split("_")[1]
    if not creator.isdigit() or int(creator) == os.getpid():
        return False
    return _this_interpreter(int(creator))


def _this_interpreter(pid: int) -> bool:
    """Whether pid runs this Python. False once it is gone, also in the instant it is a zombie, whose exe link is
    there but cannot be read (realpath then raised FileNotFoundError in a teardown: issue #52)."""
    try:
        return os.path.realpath(f"/proc/{pid}/exe", strict=True) == os.path.realpath(sys.executable)
    except OSError:
        return False


def _sandbox_processes() -> list[tuple[int, bytes]]:
    """(pid, command line) of each process of a sandbox: bwrap's (its argv names the run's onlyone_sandbox_ folder) and
    the bootstrap's, in either sandbox (its argv is _BOOT), with what it forked."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        cmdline = _cmdline(int(pid))
        if cmdline is not None and _is_sandbox(cmdline):
            found.append((int(pid), cmdline))
    return found


def _is_sandbox(cmdline: bytes) -> bool:
    return b"onlyone_sandbox_" in cmdline or b"onlyone-sandbox" in cmdline or _BOOT.encode() in cmdline


def _cmdline(pid: int) -> bytes | None:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # it exited meanwhile
        return None


def _cgroup_members(path: str) -> list[int] | None:
    """The pids in a cgroup, or None once it is gone."""
    try:
        return [int(pid) for pid in pathlib.Path(path, "cgroup.procs").read_text().split()]
    except FileNotFoundError:
        return None


def _in_flight_elsewhere(pid: int) -> bool:
    """Whether pid belongs to a sandbox that another test process (this interpreter, not this process: a pytest-xdist
    worker, a parallel rerun) is running now: its first ancestor outside the sandbox is that process. Orphans, whose
    first such ancestor is init or a subreaper, and this process's own are leftovers."""
    owner = pid
    while owner > 1:
        try:
            stat = pathlib.Path(f"/proc/{owner}/stat").read_text()
        except OSError:  # gone: what is left of its sandbox is no longer running under it
            return False
        owner = int(stat[stat.rindex(")") + 2 :].split()[1])  # the parent (the name in parentheses may hold spaces)
        cmdline = _cmdline(owner)
        if cmdline is not None and not _is_sandbox(cmdline):
            break
    if owner <= 1 or owner == os.getpid():
        return False
    return _this_interpreter(owner)


@pytest.fixture(params=["bwrap", "fallback"])
def kind(request, monkeypatch) -> str:
    """Every sandbox test runs in both sandboxes: bubblewrap, and the fallback forced by ONLYONE_SANDBOX."""
    if request.param == "fallback":
        monkeypatch.setenv("ONLYONE_SANDBOX", "fallback")
    elif _kind(False) != "bwrap":
        pytest.skip("bubblewrap is not installed or cannot build its sandbox here (apt-get install bubblewrap)")
    return request.param


def _leftover_keys(found: list[str]) -> set[str]:
    """'pid N' / 'cgroup PATH' of each line of _sandbox_leftovers (its members and command line may change)."""
    return {line.split(" (")[0].split(": ")[0] for line in found}


def _new_leftovers(before: set[str]) -> list[str]:
    """What _sandbox_leftovers finds now that was not there before the test: what this test left behind. (A leftover
    of an earlier, dead process, e.g. a run killed mid-test, is not this test's doing and would fail every test.)"""
    return [line for line in _sandbox_leftovers() if _leftover_keys([line]) - before]


@pytest.fixture
def no_leftovers(kind):
    """Every sandbox test must leave no process and no cgroup behind."""
    before = _leftover_keys(_sandbox_leftovers(grace=0))
    yield
    assert _new_leftovers(before) == []


@pytest.fixture
def namespaced(kind) -> bool:
    """Whether the sandbox has its own PID namespace (and so its own network namespace): a low pid inside."""
    return int(run_python("import os; print(os.getpid())")) <= 2


def _has_cgroup() -> bool:
    """Whether the sandbox can make a pids cgroup here (as root on cgroup v1, or v2 with the pids controller)."""
    cgroups = _cgroups(4, 1 << 30)
    pids = any(os.path.isfile(os.path.join(c, "pids.max")) for c in cgroups)
    for cgroup in cgroups:
        os.rmdir(cgroup)
    return pids


def _count_capped() -> bool:
    """Whether something caps the sandbox's process count: a pids cgroup, else RLIMIT_NPROC (not binding root)."""
    return _has_cgroup() or os.geteuid() != 0


def test_a_sandbox_left_running_is_a_leftover(kind, monkeypatch):
    """no_leftovers still fails when a run leaves its sandbox behind (here: run_python's clean-up skipped), now that
    it passes over the sandboxes other test processes have in flight."""
    from plugins import code

    run_python("pass")  # a sandbox's first use checks itself: before the patch
    before = _leftover_keys(_sandbox_leftovers(grace=0))
    kill_all = code._kill_all
    left = []
    monkeypatch.setattr(code, "_kill_all", lambda proc, cgroups: left.append((proc, cgroups)))
    try:
        run_python("import time\ntime.sleep(60)", timeout=1)
        [(proc, cgroups)] = left
        found = _sandbox_leftovers(grace=0)
        assert any(line.startswith(f"pid {proc.pid}: ") for line in found), found
        assert all(any(line.startswith(f"cgroup {c} ") for line in found) for c in cgroups), (cgroups, found)
    finally:
        for proc, cgroups in left:
            kill_all(proc, cgroups)
    assert _new_leftovers(before) == []


def test_a_sandbox_process_is_in_flight_elsewhere_only_under_another_live_test_process():
    """Whose a sandbox's process is: its first ancestor outside the sandbox. Another process of this interpreter (a
    pytest-xdist worker, a parallel rerun) has it in flight; this process's own and an orphan's (init's or a
    subreaper's) are leftovers."""
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    ours = subprocess.Popen(sleep)
    # the sleeper's output is not the pipe: the orphan's parent's output ends when the parent exits
    quiet = "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL"
    spawn = f"import subprocess; p = subprocess.Popen({sleep!r}, {quiet}); print(p.pid, flush=True)"
    elsewhere = subprocess.Popen([sys.executable, "-c", spawn + "; p.wait()"], stdout=subprocess.PIPE, text=True)
    orphan = int(subprocess.run([sys.executable, "-c", spawn], capture_output=True, text=True, check=True).stdout)
    grandchild = int(elsewhere.stdout.readline())
    try:
        assert not _in_flight_elsewhere(ours.pid)
        assert _in_flight_elsewhere(grandchild)
        assert not _in_flight_elsewhere(orphan)
    finally:
        for pid in (ours.pid, grandchild, orphan):
            os.kill(pid, signal.SIGKILL)
        ours.wait()
        elsewhere.wait()


ADD_IO = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 7\n", "output": "12"}]


def test_correct_solution_scores_one(no_leftovers):
    assert run_code_tests("a, b = map(int, input().split())\nprint(a + b)", ADD_IO) == 1.0
    assert run_code_tests("def f(x):\n    return x + 1", ["assert f(1) == 2", "assert f(2) == 3"]) == 1.0


def test_partial_and_extra_output_fail(no_leftovers):
    two_lines = [{"input": "", "output": "1\n2\n"}]
    assert run_code_tests("print(1)", two_lines) == 0.0  # a missing line fails (open-r1's zip() passed it)
    assert run_code_tests("print(1); print(2); print(3)", two_lines) == 0.0  # an extra line fails
    assert run_code_tests("print(1)   \nprint(2)\n\n", two_lines) == 1.0  # trailing spaces / blank lines ignored
    assert run_code_tests("a, b = map(int, input().split())\nprint(a + b if a == 1 else 0)", ADD_IO) == 0.5


def test_asserts_count_once_and_early_exit_scores_zero(no_leftovers):
    tests = ["assert f(1) == 2", "assert f(2) == 4", "assert f(3) == 4"]
    assert run_code_tests("def f(x):\n    return x + 1", tests) == pytest.approx(2 / 3)
    assert run_code_tests("import os\ndef f(x):\n    return x + 1\nos._exit(0)", tests) == 0.0
    assert run_code_tests("import sys\ndef f(x):\n    return x + 1\nsys.exit(0)", tests) == 0.0
    assert run_code_tests("raise SystemExit", tests) == 0.0
    # printing lines that look like test results passes nothing (records need the expected values)
    assert run_code_tests("for i in range(3):\n    print(f'ok:{i}')\nimport os\nos._exit(0)", tests) == 0.0


def test_assert_forms_are_judged_on_the_solutions_values(no_leftovers):
    """The parts that need the solution run in the sandbox; ==, <, abs(), sorted(), math.isclose() run here."""
    code = (
        "import collections\ndef f(x):\n    print('debug output is fine')\n    return x / 2\n"
        "def g(s):\n    return collections.Counter(s)\ndef h(n):\n    return list(range(n, 0, -1))\nK = 3"
    )
    tests = [
        "assert f(1) == 0.5",
        "assert abs(f(3) - 1.5) < 1e-9",
        "assert math.isclose(f(1), 0.5)",
        "assert g('aab') == {'a': 2, 'b': 1}",
        "assert sorted(h(3)) == [1, 2, 3]",
        "assert h(2)[0] == 2",
        "assert len(h(K)) == 3",  # K is the solution's, an input here (`== K` would compare it with itself)
        "assert not h(0)",
        "assert f(1) == 0.5, 'message'",
        "assert f(2) is None",
    ]
    assert run_code_tests(code, tests) == pytest.approx(9 / 10)  # f(2) is 1.0
    big = f"assert len(g({list(range(40_000))})) == 40_000"  # a query over argv's limit of 128 KiB per string
    assert run_code_tests(code, [big, "assert max(*h(3)) == 3"]) == 1.0
    with pytest.raises(ValueError, match="one assert statement"):
        run_code_tests(code, ["x = f(1)\nassert x == 0.5"])


def test_a_truth_test_takes_any_value(no_leftovers):
    """`assert f(x)` and `assert not f(x)` ask the sandbox only for the value's truth: MBPP's regex tasks return
    re.Match objects, which are no data to send (they scored 0 when correct)."""
    code = "import re\ndef m(text):\n    return re.search('^a.*b$', text)"
    tests = ["assert m('aab')", "assert not m('ba')", "assert m('ab') and not m('b')", "assert m('ab') == True"]
    assert run_code_tests(code, tests) == 0.75  # the last compares the value itself: a Match is not True


SECRET = ["assert secret(1) == 7919", "assert secret(2) == 104729"]  # values no solution can derive
FIND_IN = r"""
import re
def find(text):
    return {int(a): int(b) for a, b in re.findall(r"secret\((\d+)\) == (\d+)", str(text))}
"""
CHEATS = {
    "rebind exec": "def add(a, b):\n    return 0\nexec = lambda *a, **k: None",
    "rebind builtins": "import builtins\nbuiltins.exec = builtins.eval = lambda *a, **k: True\n"
    "builtins.AssertionError = type('Nothing', (Exception,), {})\ndef add(a, b):\n    return 0",
    "monkeypatch AssertionError": "import builtins\nbuiltins.AssertionError = SystemExit\n"
    "def add(a, b):\n    return 0",
    "sys.modules": "import sys, types\nfake = types.ModuleType('os')\nfake.write = fake._exit = lambda *a: 0\n"
    "sys.modules.update(os=fake, json=fake, ast=fake)\ndef add(a, b):\n    return 0",
    "SystemExit(0) in the test": "def add(a, b):\n    raise SystemExit(0)",
    "os._exit(0) in the test": "import os\ndef add(a, b):\n    os._exit(0)",
    "equal to everything": "class Anything:\n    def __eq__(self, other):\n        return True\n"
    "    __hash__ = object.__hash__\ndef add(a, b):\n    return Anything()",
    "read files and /proc": FIND_IN + "import glob, os\nfound = {}\n"
    "for path in [__file__, *glob.glob('/proc/*/cmdline'), *glob.glob('/proc/*/environ'), *glob.glob('*'),\n"
    "             *glob.glob('/tmp/*'), *glob.glob('/proc/1/cwd/*')]:\n"
    "    try:\n        found |= find(open(path, errors='replace').read(1 << 20) if os.path.isfile(path) else '')\n"
    "    except OSError:\n        pass\ndef secret(x):\n    return found.get(x)",
    "inspect the caller": FIND_IN + "import gc, sys\ndef secret(x):\n    frame, found = sys._getframe(1), {}\n"
    "    while frame:\n        found |= find(list(frame.f_locals.values()) + list(frame.f_globals.values()))\n"
    "        frame = frame.f_back\n    for obj in gc.get_objects():\n        found |= find(obj)\n"
    "    return found.get(x)",
    "signal handler": FIND_IN + "import signal, time\nfound = {}\ndef spy(signum, frame):\n    while frame:\n"
    "        found.update(find(list(frame.f_locals.values()) + list(frame.f_globals.values())))\n"
    "        frame = frame.f_back\nsignal.signal(signal.SIGALRM, spy)\n"
    "signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)\n"
    "def secret(x):\n    deadline = time.time() + 1\n    while x not in found and time.time() < deadline:\n"
    "        pass\n    return found.get(x)",
    "atexit: fake results": FIND_IN + "import atexit, re\ndef fake():\n    text = open(__file__).read()\n"
    "    for nonce in set(re.findall(r'[0-9a-f]{32}', text)):\n        print(f'{nonce}:0\\n{nonce}:1')\n"
    "    for i in range(2):\n        print(f'\\n\\x1e{i} True\\n\\x1e{i} 3\\n\\x1e{i} 7919')\n"
    "atexit.register(fake)\n"
    "def add(a, b):\n    return 0\nsecret = add",
}


@pytest.mark.parametrize("name", list(CHEATS))
def test_cheats_score_zero(name, no_leftovers):
    """The verdict is reached outside the sandbox, from values only: no trick passes a test without its expected
    value (what forging does achieve: test_code_reward_attacks.py's test_forged_records_...)."""
    tests = ["assert add(1, 2) == 3", "assert add(20, 22) == 42"] if "def add" in CHEATS[name] else SECRET
    assert run_code_tests(CHEATS[name], tests) == 0.0


def test_honest_secret_passes(no_leftovers):
    """The control for test_cheats_score_zero: the same tests pass for a solution that knows the values."""
    assert run_code_tests("def secret(x):\n    return {1: 7919, 2: 104729}[x]", SECRET) == 1.0
    assert run_code_tests("def add(a, b):\n    return a + b", ["assert add(1, 2) == 3"]) == 1.0


@pytest.mark.parametrize(
    "program",
    [
        "while True:\n    pass",
        "import time\ntime.sleep(1e9)",
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(1e9)",
    ],
)
def test_hangs_are_cut_at_the_timeout(program, no_leftovers):
    start = time.time()
    assert run_code_tests(program + "\nprint(3)", [{"input": "", "output": "3"}], timeout=1) == 0.0
    assert time.time() - start < 10  # hang guard: 1 s timeout + kill


def test_fork_bomb_is_contained(no_leftovers):
    if not _count_capped():
        pytest.skip("root without a pids cgroup: nothing caps the process count, a fork bomb would hit the machine")
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    start = time.time()
    assert run_python(bomb, timeout=2, max_procs=16) == ""
    assert time.time() - start < 15  # hang guard


def test_detached_grandchild_is_killed(namespaced, no_leftovers):
    if not (namespaced or _has_cgroup()):
        pytest.skip("without a PID namespace or a pids cgroup a process that left the group is not found")
    # setsid + double fork leaves the process group: the PID namespace (or the cgroup) must still catch it
    program = (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(60)\n"
        "    os._exit(0)\nprint('parent done')"
    )
    assert run_python(program) == "parent done\n"


def test_process_count_is_capped(no_leftovers):
    if not _count_capped():
        pytest.skip("root without a pids cgroup: RLIMIT_NPROC does not bind root, nothing caps the count")
    program = (
        "import os, time\nn = 0\nfor _ in range(100):\n    try:\n        pid = os.fork()\n"
        "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(60)\n        os._exit(0)\n"
        "    n += 1\nprint(n)"
    )
    assert int(run_python(program, timeout=5, max_procs=16)) < 16


def test_memory_bomb_fails(no_leftovers):
    out = run_python("x = bytearray(10 * 2**30)\nprint('allocated')", timeout=5, memory_mb=512)
    assert "allocated" not in out


def test_writes_stay_in_the_sandbox(no_leftovers):
    """cwd, HOME, /tmp, /var/tmp, /dev/shm, /run/lock are private and vanish; /root, / and the rest: not writable."""
    name = f"onlyone_escape_{uuid.uuid4().hex}"
    targets = [f"{d}/{name}" for d in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/root", "", os.getcwd())]
    program = (
        f"import os\nfor path in {targets!r} + ['inside.txt', os.path.expanduser('~/home.txt')]:\n"
        f"    try:\n        open(path, 'w').write('x')\n        print('wrote', path)\n"
        f"    except OSError as e:\n"
        f"        print('refused', path, e.strerror)\nprint(os.getcwd())"
    )
    out = run_python(program)
    try:
        assert "wrote inside.txt" in out and out.count("\n") == 10  # it ran, and wrote where it may
        assert [t for t in targets if os.path.exists(t)] == []
    finally:
        for t in targets:
            if os.path.exists(t):
                os.remove(t)


def test_trainer_environment_is_unreadable(monkeypatch, no_leftovers):
    """The judge's key in the trainer's environment: neither inherited nor readable through /proc/*/environ."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-onlyone-test-secret")
    program = (
        "import glob, json, os\nleaks = []\n"
        "for path in glob.glob('/proc/*/environ') + glob.glob('/proc/*/task/*/environ'):\n    try:\n"
        "        leaks += [path] * ('sk-onlyone-test-secret' in open(path, errors='replace').read())\n"
        "    except OSError:\n        pass\nprint(json.dumps([leaks, 'sk-onlyone' in str(os.environ), "
        "len([p for p in os.listdir('/proc') if p.isdigit()])]))"
    )
    leaks, inherited, count = json.loads(run_python(program))
    assert leaks == [] and not inherited
    assert count <= 3, "the sandbox's /proc should show its own few processes, not the trainer's"


def test_setns_into_the_trainers_network_fails(no_leftovers):
    """Root's old escape: join the trainer's network namespace through /proc/<pid>/ns/net and reach loopback."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    program = (
        f"import ctypes, glob, os, socket\nlibc = ctypes.CDLL(None, use_errno=True)\nresults = []\n"
        f"for path in glob.glob('/proc/*/ns/net') + ['/proc/{os.getpid()}/ns/net', '/proc/1/ns/net']:\n"
        f"    try:\n        fd = os.open(path, os.O_RDONLY)\n    except OSError:\n        continue\n"
        f"    if libc.setns(fd, 0x40000000) == 0:\n        results.append('joined')\n"
        f"    try:\n        socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        f"        results.append('connected')\n    except OSError:\n        pass\nprint('ran', results)"
    )
    try:
        out = run_python(program)
        assert out.startswith("ran") and "connected" not in out and "joined" not in out
    finally:
        server.close()


def test_output_files_swapped_for_a_fifo_do_not_hang_us(no_leftovers):
    program = (
        "import os\nfor name in ('out', 'err'):\n    if os.path.exists(name):\n        os.remove(name)\n"
        "    os.mkfifo(name)\nprint('still read')"
    )
    assert run_python(program) == "still read\n"  # read through our descriptors, not by name


def test_file_size_and_output_are_capped(no_leftovers):
    out = run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 4096)", timeout=5, max_output=1 << 16)
    assert len(out) <= 1 << 16


def test_network_is_blocked(namespaced, no_leftovers):
    if not namespaced:
        pytest.skip("unshare is refused here: the sandbox warns and the network stays open")
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    program = (
        f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        f"    print('connected')\nexcept OSError as e:\n    print('blocked', e)"
    )
    try:
        assert run_python(program).startswith("blocked")
    finally:
        server.close()


def test_killing_the_parent_spares_us(namespaced, no_leftovers):
    me = os.getpid()
    run_python("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.killpg(0, signal.SIGKILL)")
    if namespaced:  # outside a PID namespace this pid would be ours: only try it where it cannot be
        run_python(f"import os\nos.kill({me}, 9)")
    assert os.getpid() == me  # still here


def test_env_is_minimal(monkeypatch, no_leftovers):
    monkeypatch.setenv("MY_SECRET_API_KEY", "hunter2")
    env = json.loads(run_python("import json, os\nprint(json.dumps(dict(os.environ)))"))
    assert "MY_SECRET_API_KEY" not in env and set(env) <= {"PATH", "LANG", "HOME", "TMPDIR", "LC_CTYPE", "PWD"}


RERUN = "import os, subprocess, sys\nsubprocess.run([os.path.realpath(sys.executable), '-c', ''], check=True)"


def _nobody_python() -> list[str] | None:
    """A command that runs Python as uid nobody (setpriv or runuser), with an interpreter nobody may run."""
    setpriv = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    for drop in (setpriv, ["runuser", "-u", "nobody", "--"]):
        for python in (sys.executable, "/usr/bin/python3"):
            cmd = [*drop, python, "-I"]
            if (
                shutil.which(drop[0])
                and subprocess.run([*cmd, "-c", RERUN], check=False, capture_output=True).returncode == 0
            ):
                return cmd
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="we already run as non-root: every other sandbox test covers it")
def test_sandbox_works_as_non_root(kind):
    """The trainer as nobody: bwrap and the fallback (user namespace) still run code and hide the environment."""
    cmd = _nobody_python()
    if cmd is None:
        pytest.skip("neither setpriv nor runuser can run a Python interpreter as nobody here")
    home = tempfile.mkdtemp()  # readable by nobody (pytest's tmp_path is root's alone)
    try:
        # plugins/code.py and its judge as they are, common/errors.py, and the one helper of common.rewards they
        # import (text_of, stdlib-only) without the rest: nobody's interpreter may be a system Python without torch.
        os.makedirs(os.path.join(home, "plugins"))
        os.makedirs(os.path.join(home, "common"))
        for name in ("plugins/code.py", "plugins/code_judge.py", "common/errors.py"):
            shutil.copy(pathlib.Path(__file__).parents[1] / name, os.path.join(home, name))
        pathlib.Path(home, "common", "__init__.py").touch()
        pathlib.Path(home, "common", "rewards.py").write_text(inspect.getsource(text_of))
        for folder, _, files in os.walk(home):
            os.chmod(folder, 0o755)
            for name in files:
                os.chmod(os.path.join(folder, name), 0o644)
        driver = (
            f"import sys\nsys.path.insert(0, {home!r})\nfrom plugins import code as sandbox\n"
            f"print(sandbox.run_python("
            f"\"import glob, os\\nprint(os.getuid() != 0, 6 * 7, any('sk-onlyone' in open(p).read() "
            f"for p in glob.glob('/proc/*/environ')))\"), sandbox._kind({kind == 'fallback'}))"
        )
        env = {"PATH": "/usr/bin:/bin", "OPENAI_API_KEY": "sk-onlyone-test-secret"}
        result = subprocess.run(
            [*cmd, "-c", driver], check=False, capture_output=True, text=True, env=env, cwd=home, timeout=60
        )
    finally:
        shutil.rmtree(home)
    if "onlyone-sandbox: unshare" in result.stderr:  # warned at run time too; no isolation is possible then
        pytest.skip("this kernel or container refuses non-root user namespaces (to bwrap and to the fallback)")
    assert result.stdout.split()[:3] == ["True", "42", "False"], result.stderr  # it ran, as non-root, sealed off
    if result.stdout.split()[3] != kind:  # bwrap runs as root here, but may not as nobody (e.g. in Docker)
        pytest.skip(f"bwrap cannot build its sandbox as nobody here; the fallback ran and passed: {result.stderr}")


def test_code_reward(no_leftovers):
    import grpo
    import raft

    completions = [
        "Here you go:\n```python\nprint(sum(map(int, input().split())))\n```\nDone.",
        [{"role": "assistant", "content": "```py\nprint(0)\n```"}],
        "print('no tests for me')",
        "print('nor for me')",
    ]
    tests = [ADD_IO, json.dumps(ADD_IO), None, []]  # a column may hold JSON strings
    assert code_reward(None, completions, test_cases=tests) == [1.0, 0.0, None, None]
    apps = {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}
    assert run_code_tests("print(sum(map(int, input().split())))", apps) == 1.0
    # A plug-in: the scripts register it as "code"; its rows need test_cases (check_reward_fields reads `needs`).
    assert grpo.REWARDS["code"] is raft.REWARDS["code"] is code_reward and "code" not in REWARD_FUNCS
    assert code_reward.needs == ("test_cases",)


# ---------------------------------------------------------------------------------------------------- format
def test_format_reward():
    completions = [
        "<think>\nstep\n</think>\n<answer>42</answer>",
        "  <think>a</think><answer>b</answer>\n",
        "<think>a</think> text <answer>b</answer>",
        "<think>a</think><answer>b</answer> trailing",
        "<think>a</think><think>b</think><answer>c</answer>",
        "<answer>b</answer>",
    ]
    assert format_reward(None, completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_gsm8k_format_reward():
    completions = [
        "3 + 4 = 7 apples.\n#### 7",
        "1000 + 234 = 1,234\n#### 1234  \n",  # thousands commas do not matter
        "It costs 2 * 6.25 = $12.50. #### $12.50",
        "10 - 13 = -3\n#### -3.",  # a closing full stop is still the answer line
        "3 + 4 = 7\n#### 7 apples",  # words after the number
        "3 + 4 = 7\n#### 7\nThe answer is 7.",  # the answer line is not last
        "3 + 4 = 7. The answer is 7.",  # no answer line
        "#### 7",  # no calculation before it: the form alone earns nothing
        "3 + 4 = 8\n#### 7",  # the answer is not the calculation's result
        "2 + 5 = 7, 7 * 2 = 14\n#### 7",  # only the last calculation counts
        "6 + 1 = 70\n#### 7",  # 70 is not 7
        [{"role": "assistant", "content": "5 * 2 = 10\n####10"}],  # conversational; no space needed
    ]
    assert gsm8k_format_reward(None, completions) == [1.0, 1.0, 1.0, 1.0] + [0.0] * 7 + [1.0]
    # The form only: a consistent but wrong calculation still passes (that is the math reward's job).
    assert gsm8k_format_reward(None, ["3 + 4 = 8\n#### 8"], answer=["7"]) == [1.0]
    assert REWARD_FUNCS["gsm8k_format"] is gsm8k_format_reward


def test_json_reward():
    schema = {
        "type": "object",
        "required": ["name", "age"],
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
    }
    completions = [
        '{"name": "a", "age": 3}',
        '```json\n{"name": "a", "age": 3, "tags": ["x"]}\n```',
        '{"name": "a"}',
        '{"name": "a", "age": true}',
        '{"name": "a", "age": 3, "tags": [1]}',
        "{oops",
        "[1, 2]",
    ]
    assert json_reward(None, completions, json_schema=[schema] * 6 + [None]) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert json_reward(None, ['"b"'], json_schema=['{"enum": ["a"]}']) == [0.0]  # schema as a JSON string


def test_json_reward_scores_too_deep_nesting_zero_instead_of_crashing_the_run():
    # json.loads and the schema check recurse: a completion of 100,000 '[' raised RecursionError out of the reward.
    deep = "[" * 400 + "]" * 400
    schema = {"type": "array", "items": {"type": "array"}}
    assert json_reward(None, ["[" * 100_000, deep, "[[]]"], json_schema=[None, schema, schema]) == [0.0, 0.0, 1.0]


def test_regex_reward():
    assert regex_reward(None, [" 12-34 ", "12-345", "x"], pattern=[r"\d+-\d\d", r"\d+-\d\d", None]) == [1.0, 0.0, None]


# ---------------------------------------------------------------------------------------------------- length
def test_soft_overlong_reward():
    ids = [[0] * n for n in (10, 80, 90, 100, 120)]
    assert soft_overlong_reward(None, [""] * 5, max_completion_length=100, completion_ids=ids, overlong_buffer=20) == [
        0.0,
        0.0,
        -0.5,
        -1.0,
        -1.0,
    ]
    assert soft_overlong_reward(None, ["a b c d e"], max_completion_length=5) == [-1.0]  # default buffer 5 // 5 = 1
    assert soft_overlong_reward(None, ["a b c d"], max_completion_length=5) == [0.0]  # words when no ids
    with pytest.raises(ValueError, match="max_completion_length"):
        soft_overlong_reward(None, ["a"])


def test_target_length_reward():
    ids = [[0] * 50, [0] * 150]
    assert target_length_reward(None, ["", ""], completion_ids=ids, target_length=100) == [-0.5, -0.5]
    assert target_length_reward(None, ["a b", "a"], target_length=[2, None]) == [0.0, None]


# ---------------------------------------------------------------------------------------------------- api judge
class _Judge(http.server.BaseHTTPRequestHandler):
    replies: list = []  # (status, content) per request, the last one repeated
    requests: list = []

    def do_POST(self):
        self.requests.append((dict(self.headers), json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
        status, content = self.replies[min(len(self.requests), len(self.replies)) - 1]
        body = json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def judge_server():
    _Judge.replies, _Judge.requests = [(200, "Score: 7/10")], []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", _Judge
    server.shutdown()
    server.server_close()


def test_judge_scores_and_fills_the_template(judge_server):
    url, handler = judge_server
    judge = ApiJudge(url, "judge-model", api_key="sk-test", template="Q={prompt} A={completion} R={answer}")
    prompts = [[{"role": "user", "content": "2+2?"}], "3+3?"]
    assert judge(prompts, ["4", [{"role": "assistant", "content": "6"}]], answer=["4", "6"]) == [0.7, 0.7]
    contents = sorted(body["messages"][0]["content"] for _, body in handler.requests)
    assert contents == ["Q=2+2? A=4 R=4", "Q=3+3? A=6 R=6"]
    assert handler.requests[0][0]["Authorization"] == "Bearer sk-test"
    assert handler.requests[0][1]["model"] == "judge-model"


def test_judge_retries_after_a_500(judge_server):
    url, handler = judge_server
    handler.replies = [(500, "oops"), (200, "9")]
    assert ApiJudge(url, "m", backoff=0.01, max_workers=1)(["p"], ["c"]) == [0.9]
    assert len(handler.requests) == 2
    handler.replies, handler.requests = [(200, "no digits at all")], []
    assert ApiJudge(url, "m")(["p"], ["c"]) == [None]


def test_judge_client_error_is_not_retried(judge_server):
    url, handler = judge_server
    handler.replies = [(401, "bad key")]
    with pytest.raises(RuntimeError, match="HTTP 401"):
        ApiJudge(url, "m", backoff=0.01)(["p"], ["c"])
    assert len(handler.requests) == 1


def test_judge_unreachable_names_the_url():
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    with pytest.raises(RuntimeError, match=f"{url}/chat/completions unreachable after 3 attempts"):
        ApiJudge(url, "m", retries=2, backoff=0.01, timeout=2)(["p"], ["c"])


def test_api_registry_entry_reads_the_environment(monkeypatch, judge_server):
    import grpo
    import raft

    # The judge is a plug-in: the scripts that score rollouts register it as "api", the core registry does not.
    assert grpo.REWARDS["api"] is raft.REWARDS["api"] is api_reward and "api" not in REWARD_FUNCS
    _env_judge.cache_clear()
    monkeypatch.delenv("ONLYONE_JUDGE_URL", raising=False)
    with pytest.raises(RuntimeError, match="ONLYONE_JUDGE_URL"):
        grpo.REWARDS["api"](["p"], ["c"])
    monkeypatch.setenv("ONLYONE_JUDGE_URL", judge_server[0])
    monkeypatch.setenv("ONLYONE_JUDGE_MODEL", "m")
    try:
        assert grpo.REWARDS["api"](["p"], ["c"], completion_ids=[[1]]) == [0.7]
    finally:
        _env_judge.cache_clear()


# ---------------------------------------------------------------------------------------------------- registry
def test_load_reward_funcs(tmp_path, monkeypatch):
    funcs = load_reward_funcs(["math", "format:0.5", "tests.test_rewards:my_reward", "tests.test_rewards:my_reward:2"])
    assert [(n, f, w) for n, f, w in funcs] == [
        ("math", math_reward, 1.0),
        ("format", format_reward, 0.5),
        ("my_reward", my_reward, 1.0),
        ("my_reward", my_reward, 2.0),
    ]
    (tmp_path / "user_rewards_mod.py").write_text("def short(prompts, completions, **kw):\n    return [1.0] * 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ((name, fn, weight),) = load_reward_funcs(["user_rewards_mod:short:-1.5"])
    assert (name, weight, fn(None, ["a", "b"])) == ("short", -1.5, [1.0, 1.0])
    with pytest.raises(ValueError, match="unknown reward 'maths'.*'math'"):
        load_reward_funcs(["maths"])
    with pytest.raises(ModuleNotFoundError):
        load_reward_funcs(["no_such_module_xyz:fn"])


def test_compute_rewards_nan_weights_and_warning():
    def half(prompts, completions, **kw):
        return [1.0, None, 0.5, None]

    def never(prompts, completions, **kw):
        return [None] * len(completions)

    funcs = [("half", half, 2.0), ("mine", my_reward, 0.5), ("never", never, 1.0)]
    with pytest.warns(UserWarning, match="'never' returned None for a whole batch"):
        rewards, per_func = compute_rewards(funcs, ["p"] * 4, ["a", "bb", "", "dddd"], {"answer": [1, 2, 3, 4]})
    assert per_func.shape == (4, 3) and torch.isnan(per_func[:, 2]).all() and math.isnan(per_func[1, 0])
    assert torch.allclose(rewards, torch.tensor([2.5, 1.0, 1.0, 2.0]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once already: silent now
        rewards, _ = compute_rewards([("never", never, 1.0)], ["p"], ["a"], {})
    assert rewards.tolist() == [0.0]  # a row no function applies to sums to 0 (nansum), see the docstring

    def short(prompts, completions, **kw):
        return [1.0]

    with pytest.raises(ValueError, match="'short' returned 1 rewards for 2"):
        compute_rewards([("short", short, 1.0)], ["p", "q"], ["a", "b"], {})


def test_split_weight_takes_only_a_numeric_last_part():
    """One parser for every --rewards spec (load_reward_funcs and model:<dir> rewards)."""
    assert split_weight("format:0.2") == ("format", 0.2)
    assert split_weight("math") == ("math", 1.0)
    assert split_weight("pkg.mod:fn") == ("pkg.mod:fn", 1.0)
    assert split_weight("pkg.mod:fn:-0.5") == ("pkg.mod:fn", -0.5)
    assert split_weight("runs/rm/final@tone:0.5") == ("runs/rm/final@tone", 0.5)


def test_a_process_exiting_under_the_leftover_check_is_not_an_error(monkeypatch):
    """The leftover check reads /proc/<pid>/exe of the processes it finds; one that exits in between (a zombie: its exe
    link is there but cannot be read) made realpath raise FileNotFoundError in a test's teardown (issue #52). It is
    not this interpreter's any more: False, no error."""
    other = os.getppid()
    readlink = os.readlink

    def gone(path, *args, **kwargs):  # every process's exe link, as in the instant each is a zombie
        if str(path).startswith("/proc/") and str(path).endswith("/exe"):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return readlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "readlink", gone)
    assert _made_elsewhere(f"onlyone_{other}_ab12") is False
    assert _in_flight_elsewhere(other) is False

"""The code reward's judge (plugins/code.py's run_code_tests): what a sandbox run printed, judged. A stdin/stdout
test's output lines against the expected ones; an assert test's expected side evaluated on the solution's values,
which come back as records "\x1e<i> <json>" on the run's stdout. All of it is work on what the solution picks, and
bounds on sizes alone do not bound its cost: ints k * (2**61 - 1) all hash to 0, so a set or dict of n of them costs
n^2 to build (22 s of CPU for 41,000 of them, inside the 1 MiB parse budget). So it runs in a short-lived process of
its own (`judge`: this file as `python -I -S plugins/code_judge.py`, standard library only, the request on stdin, the
number of tests passed on stdout) under RLIMIT_CPU of JUDGE_CPU_S seconds: a judge past it is killed and its sample
scores 0. A judge killed by anything else (the OOM killer, a SIGTERM from outside) says nothing about the solution:
it is run again, and past JUDGE_RETRIES the run stops naming the signal (ChildProcessError), never a silent 0. A
record or a test it cannot decode or evaluate fails that test, whatever it raises: the values are the solution's,
and a malformed one scores 0, never stops the run."""

import ast
import builtins
import json
import math
import operator
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
import warnings

# The expected side: literals, operators, comparisons, the builtins in PURE and math's functions in MATH, evaluated by
# _value on the solution's values (`_q<i>`). Every operation on them has its size bounded first (_bounded, _binop,
# _call), and the process its CPU time: the solution picks those values.
PURE = {
    name: getattr(builtins, name)
    for name in "abs all any bool dict float frozenset int len list max min round set sorted str sum tuple".split()
}
MATH = {  # math's own, whatever the solution binds to the name `math`
    name: getattr(math, name)
    for name in "isclose sqrt floor ceil trunc fabs exp log log2 log10 sin cos tan atan atan2 hypot degrees radians "
    "isnan isinf isfinite gcd pi e tau inf nan".split()
}
_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.LShift: operator.lshift,
    ast.RShift: operator.rshift,
    ast.BitOr: operator.or_,
    ast.BitXor: operator.xor,
    ast.BitAnd: operator.and_,
    ast.MatMult: operator.matmul,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg, ast.Not: operator.not_, ast.Invert: operator.invert}
_COMPARE = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}
_DECODE = {  # _BOOT's encode, undone: JSON has no tuples, sets, bytes, complex numbers or non-string keys
    "tuple": tuple,
    "set": set,
    "frozenset": frozenset,
    "dict": dict,
    "bytes": lambda text: text.encode("latin-1"),
    "complex": lambda parts: complex(*parts),
}
_MAX_BITS = 1 << 16  # an int operand or result here (a literal in a test has at most 4,300 digits, ~14,300 bits)
_MAX_DIGITS = 4300  # an int the solution sends, in digits: Python's own default limit for int(str)
_MAX_ITEMS = 1 << 20  # a sequence built here by repetition (`[0] * n`)
_MAX_VALUES = 1 << 20  # characters of the solution's values parsed per run
JUDGE_CPU_S = 2  # seconds of CPU to judge one run: its output's lines, or its records decoded and its asserts
_JUDGE_MEMORY = 1 << 30  # bytes of address space: at most _MAX_VALUES of JSON decoded, _binop bounds what is built
_JUDGE_WALL_S = 60  # a guard only (the budget is CPU time): a judge still running then has a machine too busy
JUDGE_RETRIES = 2  # runs again of a judge killed by a signal not of its budget, before the run stops
_SELF = os.path.abspath(__file__)


def _bounded(*values) -> None:
    """Refuse an int operand too large to compute on here (the solution picks it: `3 ** f(1)`)."""
    for v in values:
        if isinstance(v, int) and v.bit_length() > _MAX_BITS:
            raise ValueError(f"an int of {v.bit_length()} bits is not computed on here")


def _binop(op: ast.operator, a, b):
    """a <op> b, refused where the result would be too large to compute: an int power or shift past _MAX_BITS, a
    sequence repeated past _MAX_ITEMS, printf-style formatting (its width and precision are unbounded)."""
    _bounded(a, b)
    ints = isinstance(a, int) and isinstance(b, int)
    if ints and isinstance(op, ast.Pow) and b > 0 and abs(a) > 1 and a.bit_length() * b > _MAX_BITS:
        raise ValueError(f"{a} ** {b} is not computed here")
    if ints and isinstance(op, ast.LShift) and a and a.bit_length() + b > _MAX_BITS:
        raise ValueError(f"{a} << {b} is not computed here")
    if isinstance(op, ast.Mult) and isinstance(a, int) != isinstance(b, int):
        count = a if isinstance(a, int) else b
        sequence = b if isinstance(a, int) else a
        if hasattr(sequence, "__len__") and len(sequence) * count > _MAX_ITEMS:
            raise ValueError(f"a sequence repeated past {_MAX_ITEMS} items is not built here")
    if isinstance(op, ast.Mod) and isinstance(a, (str, bytes)):
        raise ValueError("printf-style formatting is not evaluated here")
    return _BINOPS[type(op)](a, b)


def _call(fn, args: list, kwargs: dict):
    """A builtin of PURE or a function of MATH on these arguments, refused where its cost has no bound: round()'s
    ndigits (10 ** -ndigits is computed), int() of a long string, sum() of sequences (each addition copies)."""
    _bounded(*args, *kwargs.values())
    if fn is round and len(args) > 1 and isinstance(args[1], int) and abs(args[1]) > _MAX_DIGITS:
        raise ValueError(f"round(x, {args[1]}) is not computed here")
    if fn is int and args and isinstance(args[0], (str, bytes)) and len(args[0]) > _MAX_DIGITS:
        raise ValueError(f"int() of {len(args[0])} characters is not computed here")
    if fn is sum and not isinstance(args[1] if len(args) > 1 else kwargs.get("start", 0), (int, float, complex)):
        raise ValueError("sum() with a start that is not a number is not computed here")
    return fn(*args, **kwargs)


def _items(nodes: list, values: dict) -> list:
    """The values of a display's or a call's elements, `*x` unpacked."""
    items = []
    for node in nodes:
        if isinstance(node, ast.Starred):
            items.extend(_value(node.value, values))
        else:
            items.append(_value(node, values))
    return items


def _value(node: ast.AST, values: dict):
    """A split test's node (plugins.code._Split.test), evaluated on the solution's values (`_q<i>`); a missing value
    raises KeyError. _Split lets no other node types through."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return values[node.id] if node.id.startswith("_q") else PURE[node.id]
    if isinstance(node, ast.Attribute):
        return MATH[node.attr]  # (math.<name>)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {ast.Tuple: tuple, ast.List: list, ast.Set: set}[type(node)](_items(node.elts, values))
    if isinstance(node, ast.Dict):
        result = {}
        for key, item in zip(node.keys, node.values, strict=True):
            if key is None:  # {**x}
                result.update(_value(item, values))
            else:
                result[_value(key, values)] = _value(item, values)
        return result
    if isinstance(node, ast.UnaryOp):
        operand = _value(node.operand, values)
        _bounded(operand)
        return _UNARY[type(node.op)](operand)
    if isinstance(node, ast.BinOp):
        return _binop(node.op, _value(node.left, values), _value(node.right, values))
    if isinstance(node, ast.BoolOp):
        result = None
        for item in node.values:  # short-circuit, as Python does: the value that decided
            result = _value(item, values)
            if bool(result) != isinstance(node.op, ast.And):
                return result
        return result
    if isinstance(node, ast.Compare):
        left = _value(node.left, values)
        for op, right_node in zip(node.ops, node.comparators, strict=True):
            right = _value(right_node, values)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.IfExp):
        return _value(node.body if _value(node.test, values) else node.orelse, values)
    if isinstance(node, ast.Subscript):
        return _value(node.value, values)[_value(node.slice, values)]
    if isinstance(node, ast.Slice):
        return slice(*(None if n is None else _value(n, values) for n in (node.lower, node.upper, node.step)))
    if isinstance(node, ast.Call):
        kwargs = {}
        for k in node.keywords:
            kwargs.update(_value(k.value, values) if k.arg is None else {k.arg: _value(k.value, values)})
        return _call(_value(node.func, values), _items(node.args, values), kwargs)
    raise TypeError(f"{type(node).__name__} is not evaluated here")


def _parse_int(digits: str) -> int:
    """json's int parser with Python's default limit on digits, which the process may have lifted."""
    if len(digits.lstrip("-")) > _MAX_DIGITS:
        raise ValueError(f"an int of {len(digits)} digits")
    return int(digits)


def _decoded(obj: dict):
    """One of _BOOT's tagged values ({"tuple": [...]}, ...) as itself."""
    if len(obj) != 1:
        raise ValueError(f"not a tagged value: {sorted(obj)[:3]}")
    kind = next(iter(obj))
    return _DECODE[kind](obj[kind])


def _values(out: str, count: int) -> dict:
    """The sandbox's values `_q<i>` from its output's records (the last one of each query), at most _MAX_VALUES
    characters parsed: a record that is no value (an exception, a fake, a tag that does not fit its payload) or past
    the budget leaves its value out."""
    records = dict(re.findall(r"^\x1e(\d+) (.*)$", out, re.MULTILINE))
    values = {}
    budget = _MAX_VALUES
    for i in range(count):  # (only these: parsing costs us, not the sandbox)
        record = records.get(str(i), "!")
        budget -= len(record)
        if budget < 0:
            break
        try:
            values[f"_q{i}"] = json.loads(record, object_hook=_decoded, parse_int=_parse_int)
        except Exception:  # deliberate: whatever a malformed record raises (`{"bytes": 5}`), its tests fail
            continue
    return values


def _lines(s: str) -> list[str]:
    """Output lines compared as judges do: trailing spaces and trailing blank lines ignored."""
    return [line.rstrip() for line in s.rstrip().splitlines()]


def holds(test: ast.AST, values: dict) -> bool:
    """A split test on the solution's values: whatever evaluating it raises (a missing value's KeyError, a wrong
    type's TypeError or AttributeError, an operation refused as too costly, MemoryError past the judge's memory), the
    test fails."""
    try:
        return bool(_value(test, values))
    except Exception:  # deliberate: the values are the solution's, and a malformed one scores 0, never stops the run
        return False


def _judge_once(message: bytes) -> tuple[int | None, float, bytes, bytes]:
    """One judge process on the request: (its exit status, negative for a signal, or None when it ran past
    _JUDGE_WALL_S and was killed; the CPU seconds it used; its stdout; its stderr). Reaped with os.wait4 for its CPU
    time, which tells its budget's kill from another."""
    with tempfile.TemporaryFile() as i, tempfile.TemporaryFile() as o, tempfile.TemporaryFile() as e:
        i.write(message)
        i.seek(0)
        proc = subprocess.Popen([sys.executable, "-I", "-S", _SELF], stdin=i, stdout=o, stderr=e)
        deadline = time.monotonic() + _JUDGE_WALL_S
        walled = False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline and not walled:  # (not reaped yet: the pid is still the judge's)
                proc.kill()
                walled = True
            time.sleep(0.002)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
        return (
            None if walled else proc.returncode,
            usage.ru_utime + usage.ru_stime,
            os.pread(o.fileno(), 1 << 20, 0),
            os.pread(e.fileno(), 1 << 12, 0),
        )


def judge(request: dict) -> int | None:
    """How many of a run's tests pass, judged by this file in a child process under JUDGE_CPU_S seconds of CPU (the
    trainer computes nothing on what the solution printed); None if the judge ran past its budget: the sample then
    scores 0. request: the run's stdout as "output", and either "expected" (a stdin/stdout test's expected output)
    or "tests" (split asserts as text: plugins.code._Split.test unparsed) and "count" (the run's number of queries).
    A judge killed by another signal (SIGKILL before its budget was spent: the OOM killer; SIGTERM) is run again
    with a warning, JUDGE_RETRIES times; then ChildProcessError: the sample's score is unknown, not 0."""
    message = json.dumps(request).encode()  # ASCII (json escapes the rest): any locale reads it
    for attempt in range(JUDGE_RETRIES + 1):
        code, cpu, out, err = _judge_once(message)
        if code is None:
            warnings.warn(
                f"code judge: {_JUDGE_WALL_S} s of wall time before {JUDGE_CPU_S} s of CPU: the sample scores 0"
            )
            return None
        # its budget: SIGXCPU at JUDGE_CPU_S s of CPU, or the hard limit's SIGKILL a second later
        if code == -signal.SIGXCPU or (code == -signal.SIGKILL and cpu >= JUDGE_CPU_S):
            return None
        if code >= 0:
            break
        killed = f"{signal.Signals(-code).name} after {cpu:.2f} s of CPU (its budget: {JUDGE_CPU_S} s)"
        if attempt == JUDGE_RETRIES:
            raise ChildProcessError(
                f"the code judge was killed by {killed}, {JUDGE_RETRIES + 1} times in a row: not the solution's doing "
                "(the OOM killer? a kill from outside?), so the sample cannot be scored"
            )
        warnings.warn(f"code judge: killed by {killed}, not by its budget: judging the sample again")
    if code != 0:  # the judge's own failure, not the solution's: never a silent 0
        raise RuntimeError(f"the code judge failed: {err.decode(errors='replace')[-1000:]}")
    return int(out)


def _passed(request: dict) -> int:
    """In the judge's process: how many of the request's tests pass (see judge)."""
    if "expected" in request:
        return int(_lines(request["output"]) == _lines(request["expected"]))
    values = _values(request["output"], request["count"])
    return sum(holds(ast.parse(test, mode="eval").body, values) for test in request["tests"])


def main() -> None:
    """The judge's process: its budget first, then the request on stdin, the number of tests passed on stdout."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU's default action dumps core
    resource.setrlimit(resource.RLIMIT_CPU, (JUDGE_CPU_S, JUDGE_CPU_S + 1))  # SIGXCPU, then SIGKILL a second later
    resource.setrlimit(resource.RLIMIT_AS, (_JUDGE_MEMORY, _JUDGE_MEMORY))
    print(_passed(json.loads(sys.stdin.buffer.read())))


if __name__ == "__main__":
    main()

"""Reward functions, a plain dict registry of them, and the batch scorer that grpo.py calls.

A reward function is `fn(prompts, completions, **row_fields) -> list[float | None]` (TRL's contract; None means
"not applicable to this sample"). row_fields are the dataset's extra columns as lists plus `completion_ids` (token-id
lists) and `max_completion_length` (int); every function takes unknown kwargs. Prompts and completions are strings
or, for conversational data, lists of {role, content} messages (a completion's text is its last assistant message).
REWARD_FUNCS: math, code (sandboxed tests, see run_code_tests), format, gsm8k_format, json, regex, length,
target_length, api.
"""

import ast
import concurrent.futures
import contextlib
import functools
import importlib
import json
import math
import os
import re
import time
import types
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable
from fractions import Fraction

import torch

from common.sandbox import run_python


def _text(x, last_assistant: bool = True) -> str:
    """A string as is; a message list as its last assistant message (or, for prompts, all contents joined)."""
    if isinstance(x, str):
        return x
    msgs = ([m for m in x if m.get("role") == "assistant"][-1:] if last_assistant else []) or x
    parts = [m.get("content") or "" for m in msgs]  # multimodal content is a list of {"type", "text"} parts
    return "\n".join(p if isinstance(p, str) else " ".join(c.get("text", "") for c in p) for p in parts)


# ---------------------------------------------------------------------------------------------------- math
# Never hangs: only the last 2,000 characters are read and every pattern runs in linear time (no nested
# quantifiers). No signal.alarm timeout: alarms are process-wide and not thread safe (the verl bug that silently
# zeroed MATH rewards).
_TAIL = 2000
_NUM = r"-?\$?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:/\d+)?%?"  # '.5' whole: not the 5 after its dot
_FRAC = r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}"
# '*': markdown bold around the phrase or the number ("**Answer:** 18", "the answer is **18**")
_PHRASE = re.compile(r"answer(?:\s+is)?[\s:=*]*(?:\\?\$)?(" + _NUM + ")", re.IGNORECASE)


def _boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces balanced by counting (a regex cannot); None if absent or cut off."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    start, depth = start + len("\\boxed"), 0  # start: the opening brace
    for j in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[start + 1 : j]
    return None


def extract_answer(text) -> str | None:
    """The final answer of a solution: GSM8K `#### 42`, else the last \\boxed{...}, else the last "the answer is 42"
    / "answer: 42", else (fallback) the last number in the text; None when there is none."""
    text = _text(text)[-_TAIL:].replace("\u2212", "-")  # U+2212 is the typographic minus
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().split("\n")[0]
    if (boxed := _boxed(text)) is not None:
        return boxed
    numbers = _PHRASE.findall(text) or [m.group() for m in re.finditer(_FRAC + "|" + _NUM, text)]
    return numbers[-1] if numbers else None


def exact_number(s: str | None) -> Fraction | None:
    """'1,234' '$18.00.' '25%' '-3' '3/4' '\\frac{3}{4}' 'x = 5' '12 \\text{cm}' '**18**' -> its exact value (a
    Fraction: huge integers stay distinct, 1/3 stays 1/3); None without a number. Units-free: whatever follows the
    leading number is dropped (so '12 cm' is 12)."""
    if s is None:
        return None
    s = re.sub(_FRAC, r"\1/\2", s.rsplit("=", 1)[-1])  # \frac{a}{b} -> a/b
    s = re.sub(r"\\text\{[^{}]*\}|\\boxed|\\[,!%$ ]|[${}()\s,%]", "", s)  # units in \text{}, LaTeX spaces, $ , %
    m = re.match(r"(-?\d*\.?\d+)(?:/(-?\d*\.?\d+))?", s.lstrip("*_"))  # markdown bold or italics: '#### **18**'
    if m is None or Fraction(m.group(2) or 1) == 0:  # no number, or x/0
        return None
    return Fraction(m.group(1)) / Fraction(m.group(2) or 1)


def same_number(guess: Fraction | None, truth: Fraction) -> bool:
    """Exactly equal; a non-integer reference (1/3) also takes a decimal within 1e-6 of it relatively (0.3333333).
    No tolerance on integers: a relative one let 2,880,001 pass for GSM8K's 2,880,000 (math-verify rounds to 6
    decimal places, an absolute tolerance)."""
    if guess is None:
        return False
    return guess == truth or (truth.denominator != 1 and abs(guess - truth) <= abs(truth) / 10**6)


def math_reward(prompts, completions, answer=None, **kw) -> list[float | None]:
    """1.0 if the completion's final answer equals the row's `answer` (same_number), else 0.0; None for rows without
    one or whose answer has no number. The reference may be a whole GSM8K solution ending `#### 72`: same
    extraction."""
    rewards = []
    for completion, ref in zip(completions, answer or [None] * len(completions), strict=True):
        truth = None if ref is None else exact_number(extract_answer(str(ref)))
        rewards.append(None if truth is None else float(same_number(exact_number(extract_answer(completion)), truth)))
    return rewards


# ---------------------------------------------------------------------------------------------------- code
# An assert test is judged here, out of the solution's reach: the sandbox evaluates only its parts that need the
# solution (a call of its function, a name it defines: "queries") and returns their values as literals; the rest
# (==, <, abs(), sorted(), math.isclose(), the expected values) is evaluated here on those values.
_PURE = {
    f.__name__: f
    for f in (
        abs,
        all,
        any,
        bool,
        dict,
        float,
        frozenset,
        int,
        len,
        list,
        max,
        min,
        round,
        set,
        sorted,
        str,
        sum,
        tuple,
    )
} | {"math": types.SimpleNamespace(isclose=math.isclose)}
_HERE = (
    ast.Constant,
    ast.Tuple,
    ast.List,
    ast.Set,
    ast.Dict,
    ast.BinOp,
    ast.UnaryOp,
    ast.BoolOp,
    ast.Compare,
    ast.IfExp,
    ast.Subscript,
    ast.Slice,
    ast.Starred,
    ast.keyword,
    ast.operator,
    ast.unaryop,
    ast.boolop,
    ast.cmpop,
    ast.expr_context,
)


def _split_assert(test: str, queries: list[str]):
    """`assert f(1) == 2` -> compiled `_q0 == 2`, "f(1)" appended to queries: every largest part that is neither in
    _HERE nor a call of a _PURE function becomes a query."""
    body = ast.parse(test).body
    if len(body) != 1 or not isinstance(body[0], ast.Assert):
        raise ValueError(f"an assert test is one assert statement, e.g. 'assert f(1) == 2'; got {test!r}")

    class Split(ast.NodeTransformer):
        def visit(self, node):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in {*_PURE, "math.isclose"} - {"math"}:
                node.args, node.keywords = [self.visit(a) for a in node.args], [self.visit(k) for k in node.keywords]
            elif isinstance(node, _HERE):
                self.generic_visit(node)
            else:
                queries.append(ast.unparse(node))
                return ast.Name(f"_q{len(queries) - 1}", ast.Load())
            return node

    return compile(ast.fix_missing_locations(ast.Expression(Split().visit(body[0].test))), "<test>", "eval")


def _holds(test, values: dict) -> bool:
    """A split test on the solution's values; a missing value (NameError) or a wrong one's TypeError etc. fails."""
    try:
        return bool(eval(test, {"__builtins__": {}, **_PURE, **values}))
    except (NameError, TypeError, ValueError, ArithmeticError, LookupError, MemoryError, RecursionError):
        return False


def _lines(s: str) -> list[str]:
    """Output lines compared as judges do: trailing spaces and trailing blank lines ignored."""
    return [line.rstrip() for line in s.rstrip().splitlines()]


def run_code_tests(code: str, tests, timeout: float = 5.0, **sandbox) -> float:
    """Fraction of `tests` that `code` passes, run by run_python (the sandbox kwargs go there). `tests` is a list
    (or its JSON string, or APPS' {"inputs": [...], "outputs": [...]}) of
      {"input": str, "output": str}: one run each; passes if the stdout lines equal ALL expected lines after rstrip
        (extra or missing lines fail: open-r1's zip() let half an answer pass);
      "assert f(1) == 2" strings, one assert each: one run for all; the sandbox evaluates only "f(1)" and returns
        its value as a literal, the comparison runs here (_split_assert).
    Either way the expected values never enter the sandbox and the verdict is reached outside it, so no trick of
    the solution's (rebinding exec or builtins, sys.modules, AssertionError, exiting early, atexit, signals,
    printing fake results, reading its files or /proc, an object equal to everything) can pass a test it fails."""
    if isinstance(tests, str):
        tests = json.loads(tests) if tests.lstrip().startswith(("[", "{")) else [tests]
    if isinstance(tests, dict):
        tests = [{"input": i, "output": o} for i, o in zip(tests["inputs"], tests["outputs"], strict=True)]
    passed = sum(
        _lines(run_python(code, t["input"], timeout, **sandbox)) == _lines(t["output"])
        for t in tests
        if isinstance(t, dict)
    )
    queries = []
    asserts = [_split_assert(t, queries) for t in tests if isinstance(t, str)]
    if asserts:
        out, values = run_python(code, "", timeout, queries=queries, **sandbox), {}
        records = dict(re.findall(r"^\x1e(\d+) (.*)$", out, re.MULTILINE))  # the last one of each query
        for i in range(len(queries)):  # (only these: parsing costs us, not the sandbox)
            with contextlib.suppress(KeyError, ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                values[f"_q{i}"] = ast.literal_eval(records[str(i)])  # none or not a literal: its test fails
        passed += sum(_holds(test, values) for test in asserts)
    return passed / max(len(tests), 1)


def extract_code(text) -> str:
    """The last ```python (or ```py) fenced block of a completion, else its whole text."""
    blocks = re.findall(r"```(?:python3?|py)[ \t]*\n(.*?)```", _text(text), re.DOTALL)
    return blocks[-1] if blocks else _text(text)


def code_reward(prompts, completions, test_cases=None, **kw) -> list[float | None]:
    """Fraction of the row's `test_cases` that the completion's code passes (run_code_tests); None if it has none.
    Samples run on a few threads: each run is a separate process, so the threads only wait."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        jobs = [
            None if not t else pool.submit(run_code_tests, extract_code(c), t)
            for c, t in zip(completions, test_cases or [None] * len(completions), strict=True)
        ]
        return [None if j is None else j.result() for j in jobs]


# ---------------------------------------------------------------------------------------------------- format
def format_reward(prompts, completions, **kw) -> list[float]:
    """1.0 if the completion is `<think>...</think>` then `<answer>...</answer>` and nothing else (whitespace aside),
    each tag exactly once; else 0.0. Counting tags instead of a lazy regex keeps it linear on long completions."""
    tags = ("<think>", "</think>", "<answer>", "</answer>")
    texts = [_text(c).strip() for c in completions]
    return [
        float(
            all(t.count(tag) == 1 for tag in tags)
            and t.startswith(tags[0])
            and t.endswith(tags[3])
            and re.search(r"</think>\s*<answer>", t) is not None
        )
        for t in texts
    ]


_NUMBER = r"\$?(-?[\d,]*\d(?:\.\d+)?)"
_ANSWER_LINE, _RESULT = re.compile(rf"####[ \t]*{_NUMBER}\.?$"), re.compile(rf"=[ \t]*{_NUMBER}")


def gsm8k_format_reward(prompts, completions, **kw) -> list[float]:
    """1.0 if the completion ends with GSM8K's answer line `#### N` and N repeats the result of its last calculation
    (the last `= N` before that line, as GSM8K's `<<48/2=24>>` steps); else 0.0. A shaping reward to pair with
    `math`, and to watch: on SmolLM2-135M (20 grpo.py steps, `--rewards math gsm8k_format:0.5`) held-out greedy
    answers went from 8% to 88% in this form but from 17% to 3% right (a form-only check: 100% form, 2% right)."""
    scores = []
    for text in (_text(c).strip() for c in completions):
        line = _ANSWER_LINE.search(text)
        results = _RESULT.findall(text[: line.start()]) if line else []
        scores.append(float(bool(results) and results[-1].replace(",", "") == line.group(1).replace(",", "")))
    return scores


_JSON_TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "number": (int, float),
    "integer": int,
    "boolean": bool,
    "null": type(None),
}


def _schema_ok(value, schema: dict) -> bool:
    """A JSON Schema subset: type, enum, required, properties, items. Built in (jsonschema is no dependency), so a
    reward never depends on which optional packages are installed."""
    kind = schema.get("type")
    if not isinstance(value, _JSON_TYPES.get(kind, object)) or ("enum" in schema and value not in schema["enum"]):
        return False
    if isinstance(value, bool) and kind in ("number", "integer"):  # JSON true is no number; Python's True is an int
        return False
    if isinstance(value, dict):
        return all(k in value for k in schema.get("required", [])) and all(
            _schema_ok(value[k], s) for k, s in schema.get("properties", {}).items() if k in value
        )
    return not isinstance(value, list) or all(_schema_ok(v, schema.get("items", {})) for v in value)


def json_reward(prompts, completions, json_schema=None, **kw) -> list[float]:
    """1.0 if the completion (a ```json fence allowed) parses as JSON and, when the row has `json_schema` (a dict
    or its JSON string), passes _schema_ok; else 0.0 (also for a document nested too deep to parse or check)."""
    rewards = []
    for completion, schema in zip(completions, json_schema or [None] * len(completions), strict=True):
        schema = json.loads(schema) if isinstance(schema, str) else schema  # a bad schema is the data's error: raise
        try:
            value = json.loads(re.sub(r"^```(?:json)?\s*|\s*```$", "", _text(completion).strip()))
            rewards.append(float(schema is None or _schema_ok(value, schema)))
        except (ValueError, RecursionError):  # the completion's fault (json.loads and _schema_ok recurse): not a crash
            rewards.append(0.0)
    return rewards


def regex_reward(prompts, completions, pattern=None, **kw) -> list[float | None]:
    """1.0 if the stripped completion fullmatches the row's `pattern` (re.DOTALL), else 0.0; None without one.
    Patterns come from your data: one with nested quantifiers can backtrack exponentially."""
    return [
        None if p is None else float(re.fullmatch(p, _text(c).strip(), re.DOTALL) is not None)
        for c, p in zip(completions, pattern or [None] * len(completions), strict=True)
    ]


# ---------------------------------------------------------------------------------------------------- length
def _lengths(completions, completion_ids) -> list[int]:
    """|y|: tokens from completion_ids (grpo.py passes them), else whitespace-separated words."""
    tokens_or_words = completion_ids if completion_ids is not None else [_text(c).split() for c in completions]
    return [len(x) for x in tokens_or_words]


def soft_overlong_reward(
    prompts, completions, max_completion_length=None, completion_ids=None, overlong_buffer=None, **kw
) -> list[float]:
    """DAPO eq. 13 (arXiv:2503.14476; TRL's get_soft_overlong_punishment), L_max = max_completion_length,
    L_cache = overlong_buffer (default L_max // 5: DAPO's 4,096 of 20,480):
    0 if |y| <= L_max - L_cache; (L_max - L_cache - |y|) / L_cache up to L_max; -1 beyond. A completion cut at
    L_max gets -1 from the middle case."""
    if max_completion_length is None:
        raise ValueError("the length reward needs max_completion_length (grpo.py passes it)")
    l_cache = max_completion_length // 5 if overlong_buffer is None else overlong_buffer
    free = max_completion_length - l_cache
    return [
        0.0 if n <= free else (free - n) / l_cache if n <= max_completion_length else -1.0
        for n in _lengths(completions, completion_ids)
    ]


def target_length_reward(prompts, completions, target_length=None, completion_ids=None, **kw) -> list[float | None]:
    """-|len - target| / target, target from the row field (a list) or a kwarg (one int) `target_length`; None
    without one. len counted as in soft_overlong_reward."""
    targets = target_length if isinstance(target_length, list) else [target_length] * len(completions)
    return [
        None if t is None else -abs(n - t) / t
        for n, t in zip(_lengths(completions, completion_ids), targets, strict=True)
    ]


# ---------------------------------------------------------------------------------------------------- api judge
JUDGE_TEMPLATE = (
    "Rate the response to the question from 0 to 10. Reply with 'Score: N'.\n\nQuestion:\n{prompt}\n\n"
    "Reference answer (may be empty):\n{answer}\n\nResponse:\n{completion}"
)


class ApiJudge:
    """An LLM judge behind an OpenAI-compatible /chat/completions endpoint (vLLM, SGLang, OpenAI), stdlib only.

    Each completion goes out as one user message (the template's {prompt} {completion} {answer} filled in); the
    first number of the reply ("Score: 7/10" -> 7) / max_score, clipped to [0, 1], is its reward (None without a
    number). 429, 5xx, timeouts and connection errors are retried with exponential backoff, then a RuntimeError
    names the URL: an unreachable judge stops training rather than silently rewarding 0."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        template: str = JUDGE_TEMPLATE,
        max_score: float = 10.0,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = 1.0,
        max_workers: int = 8,
    ):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.template, self.max_score = model, template, max_score
        self.api_key = os.environ.get("OPENAI_API_KEY") if api_key is None else api_key
        self.timeout, self.retries, self.backoff, self.max_workers = timeout, retries, backoff, max_workers

    def _post(self, content: str) -> str:
        """The reply text of one chat completion, retrying what may pass (429, 5xx, network)."""
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": content}], "temperature": 0})
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        headers = {"Content-Type": "application/json", **auth}
        for attempt in range(self.retries + 1):
            try:
                request = urllib.request.Request(self.url, data=body.encode(), headers=headers)
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return json.loads(response.read())["choices"][0]["message"]["content"]
            except urllib.error.HTTPError as e:  # before URLError, its base class
                if e.code != 429 and e.code < 500:  # a bad request or key will not fix itself
                    raise RuntimeError(f"judge {self.url} answered HTTP {e.code}: {e.read()[:500]!r}") from e
                error = e
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                error = e
            if attempt < self.retries:
                time.sleep(self.backoff * 2**attempt)
        raise RuntimeError(f"judge {self.url} unreachable after {self.retries + 1} attempts: {error}")

    def score(self, prompt, completion, answer=None) -> float | None:
        """One reward in [0, 1], None if the reply has no number."""
        content = self.template.replace("{prompt}", _text(prompt, last_assistant=False))
        content = content.replace("{answer}", "" if answer is None else str(answer))
        reply = self._post(content.replace("{completion}", _text(completion)))  # last: its text is not re-scanned
        m = re.search(r"-?\d+(?:\.\d+)?", reply)
        return None if m is None else min(max(float(m.group()) / self.max_score, 0.0), 1.0)

    def __call__(self, prompts, completions, answer=None, **kw) -> list[float | None]:
        with concurrent.futures.ThreadPoolExecutor(max_workers=self.max_workers) as pool:
            return list(pool.map(self.score, prompts, completions, answer or [None] * len(completions)))


@functools.cache  # built on first use, not at import: the env vars only matter when "api" is asked for
def _env_judge() -> ApiJudge:
    url, model = os.environ.get("ONLYONE_JUDGE_URL"), os.environ.get("ONLYONE_JUDGE_MODEL")
    if not url or not model:
        raise RuntimeError(
            "reward 'api' needs ONLYONE_JUDGE_URL (e.g. http://localhost:8000/v1) and "
            "ONLYONE_JUDGE_MODEL (OPENAI_API_KEY if the endpoint wants one)"
        )
    return ApiJudge(url, model)


def api_reward(prompts, completions, **kw) -> list[float | None]:
    """An ApiJudge with default settings at ONLYONE_JUDGE_URL / ONLYONE_JUDGE_MODEL (key: OPENAI_API_KEY)."""
    return _env_judge()(prompts, completions, **kw)


# ---------------------------------------------------------------------------------------------------- registry
REWARD_FUNCS = {
    "math": math_reward,
    "code": code_reward,
    "format": format_reward,
    "gsm8k_format": gsm8k_format_reward,
    "json": json_reward,
    "regex": regex_reward,
    "length": soft_overlong_reward,
    "target_length": target_length_reward,
    "api": api_reward,
}
# The row fields a reward needs to score a row at all (without them it returns None); a custom module:function reward
# may declare its own `fn.needs = ("field",)`. check_reward_fields refuses data that no chosen reward can score.
math_reward.needs, code_reward.needs, regex_reward.needs = ("answer",), ("test_cases",), ("pattern",)
target_length_reward.needs = ("target_length",)


def split_weight(spec: str) -> tuple[str, float]:
    """`name:weight` -> (name, weight) when the last `:` part parses as a float, else (spec, 1.0)."""
    name, _, last = spec.rpartition(":")
    try:
        return name, float(last)
    except ValueError:  # no weight given: the last part belongs to the name (module:function, model:<dir>)
        return spec, 1.0


def load_reward_funcs(specs: list[str]) -> list[tuple[str, Callable, float]]:
    """`name`, `name:weight`, `pkg.module:fn`, `pkg.module:fn:weight` or `model:<rm dir>[@attribute][:weight]` (a
    reward model, common.reward_model) -> (name, fn, weight). The weight is the last `:` part if it parses as a float
    (default 1.0); a name still holding `:` is imported, else a registry key."""
    funcs = []
    for spec in specs:
        if spec.startswith("model:"):  # a trained reward model (rm.py's final/): common.reward_model
            from common.reward_model import model_reward

            funcs.append(model_reward(spec))
            continue
        name, weight = split_weight(spec)
        if ":" in name:
            module, fn_name = name.split(":", 1)
            funcs.append((fn_name, getattr(importlib.import_module(module), fn_name), weight))
        elif name in REWARD_FUNCS:
            funcs.append((name, REWARD_FUNCS[name], weight))
        else:
            raise ValueError(f"unknown reward {name!r}: use one of {sorted(REWARD_FUNCS)} or module:function")
    return funcs


def check_reward_fields(rows: list[dict], funcs) -> None:
    """Before the model loads: every row must have the fields (not None) of at least one chosen reward, else it would
    train on a constant 0 reward (e.g. SFT or preference rows under `math`, which needs `answer`)."""
    from common.data import MAX_SHOWN, DataError

    needs = [(name, getattr(fn, "needs", ())) for name, fn, _ in funcs]
    if not needs or any(not fields for _, fields in needs):
        return  # no rewards (SPIN), or one that scores any row
    wanted = " or ".join(f"'{name}' needs {', '.join(fields)}" for name, fields in needs)
    bad = [r for r in rows if not any(all(r.get(f) is not None for f in fields) for _, fields in needs)]
    if bad:
        has = [", ".join(k for k, v in r.items() if k != "_loc" and v is not None) for r in bad[:MAX_SHOWN]]
        shown = "\n  ".join(f"{r.get('_loc', '<row>')}: row has {h}" for r, h in zip(bad, has, strict=False))
        raise DataError(
            f"{len(bad)} of {len(rows)} rows cannot be scored by the chosen rewards ({wanted}); "
            f"first {min(len(bad), MAX_SHOWN)}:\n  {shown}"
        )


_warned_all_none: set[str] = set()


def compute_rewards(funcs, prompts, completions, row_fields: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Call every (name, fn, weight) on the batch -> (rewards (B,), rewards_per_func (B, F)).

    None becomes NaN in rewards_per_func, and rewards = nansum_f weight_f * reward_f leaves it out, as TRL does. A
    row that no function applies to gets 0 (nansum; group_advantages needs finite rewards): TRL 1.16 makes it NaN
    and zeroes its advantage, which gives the same loss but keeps it out of its group's mean and std."""
    per_func = torch.zeros(len(completions), len(funcs))
    for i, (name, fn, _) in enumerate(funcs):
        out = fn(prompts=prompts, completions=completions, **row_fields)
        if len(out) != len(completions):
            raise ValueError(f"reward '{name}' returned {len(out)} rewards for {len(completions)} completions")
        if all(r is None for r in out) and name not in _warned_all_none:
            _warned_all_none.add(name)  # once per function: a missing dataset column would repeat it every step
            warnings.warn(f"reward '{name}' returned None for a whole batch: is its dataset column missing?")
        per_func[:, i] = torch.tensor([math.nan if r is None else float(r) for r in out])
    weights = torch.tensor([w for _, _, w in funcs])
    return (per_func * weights).nansum(dim=1), per_func


def score_rollout(rows: list[dict], out: dict, funcs, max_completion_length: int):
    """compute_rewards for N rollout samples (out from common.rollout) and their N dataset rows. Conversational
    prompts get each completion as one assistant message (TRL's convention); every other column reaches the rewards."""
    chat = isinstance(rows[0]["prompt"], list)
    completions = [[{"role": "assistant", "content": c}] if chat else c for c in out["completions"]]
    keys = sorted({k for row in rows for k in row} - {"prompt", "prompt_ids", "_loc"})
    fields = {k: [row.get(k) for row in rows] for k in keys}
    fields |= {"completion_ids": out["completion_ids"], "max_completion_length": max_completion_length}
    return compute_rewards(funcs, [row["prompt"] for row in rows], completions, fields)

"""Rule rewards (REWARD_FUNCS, a plain dict by name) and the batch scorer for rollouts. A reward is TRL's
`fn(prompts, completions, **row_fields) -> list[float | None]` (None: not applicable to this sample); row_fields are
the dataset's extra columns as lists plus `completion_ids` and `max_completion_length`, and every function takes
unknown kwargs. Prompts and completions are strings or lists of {role, content} messages. The code reward, the API
judge and reward models are plug-ins that a script adds to the dict it passes to load_reward_funcs.
"""

import importlib
import json
import math
import numbers
import re
import unicodedata
import warnings
from collections.abc import Callable
from fractions import Fraction

import torch

from common.errors import ArgsError, RewardError


def text_of(x, last_assistant: bool = True) -> str:
    """A string as is; a message list as its last assistant message (or, for prompts, all contents joined)."""
    if isinstance(x, str):
        return x
    msgs = ([m for m in x if m.get("role") == "assistant"][-1:] if last_assistant else []) or x
    return "\n".join(m.get("content") or "" for m in msgs)


# ---------------------------------------------------------------------------------------------------- math
# Never hangs: only the last _TAIL characters are read, every pattern runs in linear time (no nested quantifiers), and
# no signal.alarm (process-wide, not thread safe: verl's bug that silently zeroed MATH rewards). Never guesses: an
# answer it cannot read exactly ('3\sqrt{2}', '7–9', '2^x') scores 0, not the 3, 9 or 2 a policy would learn to collect
_TAIL = 2000
_MAX_DIGITS = 4300  # int() refuses longer digit strings (sys.int_info); a power, whose exponent the policy picks, too
# Digits: thousands grouped by threes ('1,234,567'; _plain turns the other separators into commas), or not grouped
_DIGITS = r"(?:\d{1,3}(?:,\d{3}(?!\d))+|\d+)(?:\.\d+)?|\.\d+"
# A power of the number ('2^{10}', '2**10') or of ten ('3.2e5', '3.2 \times 10^{5}'); `kind` tells which
_EXPONENT = (
    r"(?P<kind>\^|\*\*|[eE]|\s*(?:\\times|\\cdot|[x*\u00d7\u22c5\u00b7])\s*10\s*(?:\^|\*\*))"
    r"(?P<exponent>[-+]?\d+|\{\s*[-+]?\d+\s*\})"
)
# After the sign: a mixed number's whole part ('2 1/2' is 5/2), numerator ('1,080', '.5'), denominator, exponent, %
_UNSIGNED = (
    rf"\$?(?:(?P<whole>\d+) +(?=\d+/\d))?(?P<numerator>{_DIGITS})(?:/(?P<denominator>{_DIGITS}))?"
    rf"(?:{_EXPONENT})?(?P<percent>%?)"
)
# A number that starts a token: not the 2 of 'm^2', 'CO2', 'x_2', '[2]' or '\sqrt{2}' (the argument of a command that
# _plain does not read), nor the 5 of '3.2e5', which the match of its number takes; '__18__' (bold) is 18
_NUMBER_TOKEN = re.compile(r"(?<![A-Za-z0-9.^{\[])(?<![A-Za-z0-9}]_)(?P<sign>[-+]?)" + _UNSIGNED)
# An answer's number, after markup that may open it ('**18**', '$18', '(18)'); its sign may stand apart ('- 14')
_LEADING = re.compile(r"[\s*_${(\[]*(?:(?P<sign>[-+])\s*)?" + _UNSIGNED)
# A sentence ends at a line break, '. ' or '; ' ('18. Check: 18 / 2 = 9' is 18), not ', ' ('9 eggs, 9 * 2 = 18' is 18)
_SENTENCE_END = re.compile(r"\n|[.;](?=\s|$)")
# What after a number makes it part of more: a calculation, range or alternative ('9 * 2', '7–9', '5~7', '10 to 12',
# '3 or 4', '3 \pm 1', '2n + 1', '2 hours and 30', '42 - y'), a power left unread ('2^x', '(-2)^2', '10⁵'), LaTeX
# ('3\sqrt{2}', '2\pi', '0.\dot{3}'), another number ('3 4', '(3, 4)', '1,2', '3:4', '1.2.3', '0.(3)'), '0.3̅', '3i'
_OPERATOR = r"[-+*/\u00d7\u00f7\u22c5\u00b7\u00b1\u2013\u2014~\u301c]|\\times|\\cdot|\\div"
_UNREADABLE_AFTER = re.compile(
    rf"[\s)\]}}]*(?:(?:[A-Za-z]+\b\s*)?(?:{_OPERATOR}|\b(?:x|or|and|plus|minus|times)\b)\s*[-+$(.\d\\{{/\u221a\u03c0]"
    rf"|to\s*[-+$(.\d]|(?:{_OPERATOR})\s*[A-Za-z](?![A-Za-z])|\^|\\[A-Za-z]|[\u221a\u03c0\u221e]|(?:pi|sqrt)\b|,\s*[-+]?\d|\d)"
    r"|[.:'\u2019]\d|\.?\(|\.\\|i\b|[\u00b2\u00b3\u00b9\u2070-\u2079\u0304\u0305]"
)
# What before a number joins it to more (the fallback's last number is then no answer): an operator, range, alternative
# or radical ('9 * 2', '7–9', '10 to 12', '\sqrt 2'), a separator ('1,2', '3:4'), a sign apart ('x = - 14', '- 14')
_JOINED = re.compile(
    rf"(?:[\w)\]}}]\s*(?:{_OPERATOR}|\^|\\pm|\bx)|\d\s*(?:to|or|and|plus|minus|times)|\\sqrt|\u221a|[-+])\s*\Z"
    r"|\d[,:'\u2019]\Z|\bor\s+[A-Za-z]\s*=\s*\Z"
)
# "**Answer:** 18"; a sign may stand apart on the same line ("The answer is - 3."), not a list's "Answer:\n- 3"
_PHRASE = re.compile(r"answer(?:\s+is)?(?:[\s:=*]*\$?(?=[-+]?\.?\d)|[ :=*]*(?=[-+] \.?\d))", re.I)
# After a marked answer, a self-correction ('#### 42\nIt should be 43') or another marked answer takes it back;
# after _EQUALS comes a result ('9 * 2 = 18', '3 and 4, so 7')
_AFTERWORD = re.compile(r"(?i)\b(?:wait|actually|should (?:be|have)|meant|mistake)\b|\\boxed\{|" + _PHRASE.pattern)
_EQUALS = re.compile(r"(?i)=|\\approx|\u2248|\b(?:equals|rounds?(?: up| down)? to|so|therefore|thus|hence)\b")
# Unicode as the ASCII a model means: minus signs ('−' '‒' '﹣'), Arabic separators ('5٫5'), the fraction slash, vulgar
# fractions after a space ('12⅓' is 12 1/3), full-width forms by NFKC ('－５．５'; not all text: '10⁵' is no 105)
_UNICODE = str.maketrans("\u2212\u2012\u2010\u2011\u066b\u066c\u066a\u2044\u3000", "----.,%/ ") | {
    c: " " * (c < 0xFE50) + unicodedata.normalize("NFKC", chr(c)).replace("\u2044", "/")
    for c in [0xBC, 0xBD, 0xBE, *range(0x2150, 0x215F), 0x2189, *range(0xFE50, 0xFE6C), *range(0xFF01, 0xFF5F)]
}
_OTHER_DIGIT = re.compile(r"(?![0-9])\d")
_LATEX = (  # the LaTeX and typography a model writes around numbers, as plain text, in this order
    (re.compile(r"<<[^<>]*>>"), ""),  # GSM8K's calculator annotations: '9 * 2 = $<<9*2=18>>18' is '9 * 2 = $18'
    # a repeating decimal a.b\overline{r} as (abr - ab) / (10^|b| (10^|r| - 1)): '0.1\overline{6}' is 15/90
    (
        re.compile(r"(?<!\d)(\d{0,99})\.(\d{0,99})\\(?:overline|bar)\{(\d{1,99})\}"),
        lambda m: f"{int(m[1] + m[2] + m[3]) - int(m[1] + m[2] or 0)}/{10 ** len(m[2]) * (10 ** len(m[3]) - 1)}",
    ),
    # thousands: '1{,}080', '1\,080', '1 080', "1'080" (before \frac below puts a space before its numerator)
    (re.compile(r"(?<=\d)(?:\{,\}|\\,|\\ |[ '\u00a0\u2009\u202f\u2019])(?=\d{3}(?!\d))"), ","),
    # \frac{1}{2}, \dfrac12, -\tfrac{1}{2}: a/b after a space, so that 2\frac{1}{2} is 2 1/2 (a mixed number), not 21/2
    (re.compile(r"([-+]?)\\[dt]?frac(?:\{([^{}]*)\}|(\d))(?:\{([^{}]*)\}|(\d))"), r" \1\2\3/\4\5"),
    # a label or unit without digits, squared or cubed too: '12\text{ cm}' and '12\text{ m}^2' are 12
    (re.compile(r"\\text(?:normal)?\{[^{}\d]*\}(?:\^\d|\^\{\d\})?"), " "),
    (re.compile(r"\\(?:text|textbf|textrm|mathbf|mathrm|boldsymbol|bm|mbox|underline)\{([^{}]*)\}"), r"\1"),
    (re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\degree"), "\u00b0"),  # a unit, not a power: '90^\circ' is 90
    (re.compile(r"\\left|\\right|\\q?quad(?![A-Za-z])|\\[()\[\]!,;: ]|\\(?=[$%])"), " "),  # spaces; '\$' is '$'
)


def _plain(text: str) -> str:
    text = _OTHER_DIGIT.sub(lambda m: str(unicodedata.decimal(m[0])), text.translate(_UNICODE))
    for pattern, replacement in _LATEX:
        text = pattern.sub(replacement, text)
    return text


def _boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces balanced by counting (a regex cannot); None if absent or cut off."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    start += len("\\boxed")  # start: the opening brace
    depth = 0
    for j in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[start + 1 : j]
    return None


def _boxed_or_phrased(text: str) -> tuple[str, int] | None:
    """(The last \\boxed{...}'s content, else the rest of the line after the last "the answer is", where it starts)."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed, text.rfind("\\boxed{")
    phrases = [m.end() for m in _PHRASE.finditer(text)]
    if not phrases:
        return None
    return text[phrases[-1] :].split("\n", 1)[0], phrases[-1]  # the whole line: "The answer is 9 * 2 = 18." is 18


def _marked_answer(text: str) -> tuple[str, int] | None:
    """The answer a (plain) solution marks, and where it starts: GSM8K's last `####` line, or what a box or phrase
    marks in it ('#### The answer is 48'); else the last \\boxed{...} or "the answer is" in the text; else None."""
    if "####" in text:
        start = text.rfind("####") + len("####")
        line = text[start:].strip().split("\n")[0]
        inner = _boxed_or_phrased(line)
        return (line if inner is None else inner[0]), start
    return _boxed_or_phrased(text)


def _last_number(text: str) -> str | None:
    """The last number and the rest of its line ('24 m^2.'), where nothing competes with it: None where it is joined to
    what precedes it ('9 * 2', '7–9', 'x = 3 or x = 5') or another value stands in its sentence after the last _EQUALS
    ('18 apples left, 2 fewer', '= $18 for 9 eggs', '3, 4 and 5'; a count after 'the' is a given: 'The 3 ate 64')."""
    numbers = list(_NUMBER_TOKEN.finditer(text))
    if not numbers or _JOINED.search(text[max(0, numbers[-1].start() - 24) : numbers[-1].start()]):
        return None
    last = numbers[-1].start()
    start = max([m.end() for m in _SENTENCE_END.finditer(text[:last])], default=0)
    start = max([m.end() for m in _EQUALS.finditer(text, start, last)], default=start)
    given = [m for m in numbers if text[max(0, m.start() - 4) : m.start()].lower() == "the "]
    if len({_value(m) for m in numbers if m.start() >= start and m not in given}) > 1:
        return None
    return text[last:].split("\n", 1)[0]


def extract_answer(text) -> str | None:
    """A solution's final answer: the one it marks (_marked_answer), else its last number (_last_number); None
    without one, or where what follows the marked answer takes it back or competes with it and reads otherwise
    (_AFTERWORD: '#### 42\\nIt should be 43', '\\boxed{42}. The answer is 43.')."""
    text = _plain(text_of(text)[-_TAIL:])
    marked = _marked_answer(text)
    if marked is None:
        return _last_number(text)
    afterwords = list(_AFTERWORD.finditer(text, marked[1] + 1))
    if afterwords and _NUMBER_TOKEN.search(text, afterwords[-1].end()):  # the last word stands: 'Wait, 6 * 7 = 42'
        if exact_number(extract_answer(text[afterwords[-1].start() :])) != exact_number(marked[0]):
            return None
    return marked[0]


def _value(m: re.Match) -> Fraction | None:
    """The exact value of a _NUMBER_TOKEN or _LEADING match; None for x/0, 0^-1, a number or power past _MAX_DIGITS
    digits, or a power of a fraction, mixed number or percentage ('3/2^2' is 3/4 to some readers and 9/4 to others)."""
    if len(m[0]) > _MAX_DIGITS:
        return None
    denominator = m["denominator"]
    divisor = Fraction(denominator.replace(",", "")) if denominator else Fraction(1)
    if divisor == 0:  # x/0
        return None
    value = int(m["whole"] or 0) + Fraction(m["numerator"].replace(",", "")) / divisor
    if m["kind"] is None:
        return -value if m["sign"] == "-" else value
    if m["whole"] or denominator or m["percent"]:
        return None
    exponent = int(m["exponent"].strip("{} "))
    of_the_number = m["kind"] in ("^", "**")  # '2^{10}'; else a power of ten: '3.2e5', '3.2 \times 10^5'
    digits = len(m["numerator"]) if of_the_number else 2
    if abs(exponent) * digits > _MAX_DIGITS:
        return None
    if of_the_number and value == 0 and exponent < 0:  # 0^-1
        return None
    magnitude = value**exponent if of_the_number else value * Fraction(10) ** exponent
    return -magnitude if m["sign"] == "-" else magnitude


def _leading_value(text: str) -> Fraction | None:
    """The value of the number `text` opens with; None without one or when what follows makes it part of more."""
    m = _LEADING.match(text)
    if m is None or _UNREADABLE_AFTER.match(text, m.end()):
        return None
    return _value(m)


def exact_number(s: str | None) -> Fraction | None:
    """An answer's exact value ('1,234' '1 234' '$18.00.' '25%' '+18' '- 14' '3/4' '2 1/2' '\\frac{3}{4}' '**18**'
    '12 cm' '2^{10}' '3.2e5' '3.2 \\times 10^5'), or None where it cannot be read exactly ('3\\sqrt{2}' '7–9' '3, 4').
    In its first sentence a calculation or name before '=' ('9 * 2 = 18', 'x = 5') gives the last '=''s result; a lone
    number before '=' is the answer restated ('18 = 9 * 2', '40 minutes = 2/3 hour'); '9 * 2' alone has no value."""
    sentence = _SENTENCE_END.split(_plain(s or ""), maxsplit=1)[0]  # None: no answer, so no value
    if "=" in sentence:
        left = sentence.split("=", 1)[0]
        restated = len(_NUMBER_TOKEN.findall(left)) == 1 and _leading_value(left) is not None
        sentence = left if restated else sentence.rsplit("=", 1)[1]
    return _leading_value(sentence)


def reference_number(answer) -> Fraction | None:
    """A row's `answer` read exactly, or None (math_row_problem refuses the row): a solution's marked answer
    ('... #### 72', '\\boxed{}') is read as a completion's; a reference that marks none is the answer itself, one
    number and what may follow it ('1e6', '- 3/4', '$18', '12 cm'): '(3, 4)', '3 or 4' and 'about 4' are refused."""
    text = _plain(str(answer)[-_TAIL:])
    marked = _marked_answer(text)
    if marked is not None:
        return exact_number(marked[0])
    if len(_NUMBER_TOKEN.findall(text)) != 1:
        return None
    return exact_number(text)


def same_number(guess: Fraction | None, truth: Fraction) -> bool:
    """Exactly equal; a non-integer reference (1/3) also takes a decimal within 1e-6 of it relatively (0.3333333). No
    tolerance on integers: a relative one let 2,880,001 pass for 2,880,000 (math-verify rounds to 6 decimal places)."""
    if guess is None:
        return False
    return guess == truth or (truth.denominator != 1 and abs(guess - truth) <= abs(truth) / 10**6)


def math_reward(prompts, completions, answer=None, **kw) -> list[float | None]:
    """1.0 if the completion's final answer equals the row's `answer` (same_number), else 0.0; None for rows without
    one or whose answer cannot be read (reference_number). The reference may be a GSM8K solution ending `#### 72`."""
    rewards = []
    for completion, ref in zip(completions, answer or [None] * len(completions), strict=True):
        truth = None if ref is None else reference_number(ref)
        rewards.append(None if truth is None else float(same_number(exact_number(extract_answer(completion)), truth)))
    return rewards


def math_row_problem(row: dict) -> tuple[str, str] | None:
    """An `answer` the math reward cannot read exactly ('', 'p - q', '3\\sqrt{2}', '(3, 4)'): every completion of the
    row would score None, at every step (docs/rewards.md lists what it reads)."""
    problem = f"has no number the math reward can read: {str(row['answer'])[:80]!r}"
    return ("answer", problem) if reference_number(row["answer"]) is None else None


# ---------------------------------------------------------------------------------------------------- format
def format_reward(prompts, completions, **kw) -> list[float]:
    """1.0 if the completion is `<think>...</think>` then `<answer>...</answer>` and nothing else (whitespace aside),
    each tag exactly once; else 0.0. Counting tags instead of a lazy regex keeps it linear on long completions."""
    tags = ("<think>", "</think>", "<answer>", "</answer>")
    scores = []
    for t in (text_of(c).strip() for c in completions):
        once = all(t.count(tag) == 1 for tag in tags)
        ordered = t.startswith(tags[0]) and t.endswith(tags[3]) and re.search(r"</think>\s*<answer>", t) is not None
        scores.append(float(once and ordered))
    return scores


_NUMBER = r"\$?(-?[\d,]*\d(?:\.\d+)?)"
_ANSWER_LINE = re.compile(rf"####[ \t]*{_NUMBER}\.?$")
_RESULT = re.compile(rf"=[ \t]*{_NUMBER}")


def gsm8k_format_reward(prompts, completions, **kw) -> list[float]:
    """1.0 if the completion ends with GSM8K's answer line `#### N` and N repeats the result of its last calculation
    (the last `= N` before that line, as GSM8K's `<<48/2=24>>` steps); else 0.0. A shaping reward to pair with
    `math`, and to watch: a policy can learn the form without the arithmetic (docs/rewards.md has a measured case)."""
    scores = []
    for text in (text_of(c).strip() for c in completions):
        line = _ANSWER_LINE.search(text)
        results = _RESULT.findall(text[: line.start()]) if line else []
        scores.append(float(bool(results) and results[-1].replace(",", "") == line.group(1).replace(",", "")))
    return scores


_JSON_TYPES = dict(
    object=dict, array=list, string=str, number=(int, float), integer=int, boolean=bool, null=type(None)
)


def _schema_ok(value, schema: dict) -> bool:
    """A JSON Schema subset: type, enum, required, properties, items (jsonschema is no dependency of a reward)."""
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
            value = json.loads(re.sub(r"^```(?:json)?\s*|\s*```$", "", text_of(completion).strip()))
            rewards.append(float(schema is None or _schema_ok(value, schema)))
        except (ValueError, RecursionError):  # the completion's fault (json.loads and _schema_ok recurse): not a crash
            rewards.append(0.0)
    return rewards


def regex_reward(prompts, completions, pattern=None, **kw) -> list[float | None]:
    """1.0 if the stripped completion fullmatches the row's `pattern` (re.DOTALL), else 0.0; None without one.
    Patterns come from your data: one with nested quantifiers can backtrack exponentially."""
    return [
        None if p is None else float(re.fullmatch(p, text_of(c).strip(), re.DOTALL) is not None)
        for c, p in zip(completions, pattern or [None] * len(completions), strict=True)
    ]


# ---------------------------------------------------------------------------------------------------- length
def _lengths(completions, completion_ids) -> list[int]:
    """|y|: tokens from completion_ids (score_rollout passes them), else whitespace-separated words."""
    tokens_or_words = completion_ids if completion_ids is not None else [text_of(c).split() for c in completions]
    return [len(x) for x in tokens_or_words]


def soft_overlong_reward(
    prompts, completions, max_completion_length=None, completion_ids=None, overlong_buffer=None, **kw
) -> list[float]:
    """DAPO eq. 13 (arXiv:2503.14476; TRL's get_soft_overlong_punishment), L_max = max_completion_length, L_cache =
    overlong_buffer (default L_max // 5: DAPO's 4,096 of 20,480): 0 if |y| <= L_max - L_cache;
    (L_max - L_cache - |y|) / L_cache up to L_max (so a completion cut at L_max gets -1); -1 beyond."""
    if max_completion_length is None:
        raise ValueError("the length reward needs max_completion_length (score_rollout passes it)")
    l_cache = max_completion_length // 5 if overlong_buffer is None else overlong_buffer
    free = max_completion_length - l_cache
    return [
        0.0 if n <= free else (free - n) / l_cache if n <= max_completion_length else -1.0
        for n in _lengths(completions, completion_ids)
    ]


def target_length_reward(prompts, completions, target_length=None, completion_ids=None, **kw) -> list[float | None]:
    """-|len - target| / target, len as in soft_overlong_reward, target from the row field (a list) or a kwarg (one
    int) `target_length`; None without one."""
    targets = target_length if isinstance(target_length, list) else [target_length] * len(completions)
    return [
        None if t is None else -abs(n - t) / t
        for n, t in zip(_lengths(completions, completion_ids), targets, strict=True)
    ]


# ---------------------------------------------------------------------------------------------------- registry
REWARD_FUNCS = {
    "math": math_reward,
    "format": format_reward,
    "gsm8k_format": gsm8k_format_reward,
    "json": json_reward,
    "regex": regex_reward,
    "length": soft_overlong_reward,
    "target_length": target_length_reward,
}
# The row fields a reward needs to score a row at all, and what makes a row that has them unusable (row_problem(row)
# -> (field, problem) | None); a module:function reward may declare its own. harness.cli.check_reward_fields refuses
# such rows, and data no chosen reward can score, before the model loads.
math_reward.needs = ("answer",)
math_reward.row_problem = math_row_problem
regex_reward.needs = ("pattern",)
target_length_reward.needs = ("target_length",)


def split_weight(spec: str) -> tuple[str, float]:
    """`name:weight` -> (name, weight) when the last `:` part parses as a float, else (spec, 1.0)."""
    name, _, last = spec.rpartition(":")
    try:
        return name, float(last)
    except ValueError:  # no weight given: the last part belongs to the name (module:function, model:<dir>)
        return spec, 1.0


def load_reward_funcs(
    specs: list[str], registry: dict[str, Callable] = REWARD_FUNCS, loaders: dict[str, Callable] | None = None
) -> list[tuple[str, Callable, float]]:
    """`name`, `name:weight`, `pkg.module:fn` or `pkg.module:fn:weight` -> (name, fn, weight) (split_weight); a name
    still holding `:` is imported, else a `registry` key. A spec `<prefix>:...` whose prefix is a key of `loaders` is
    read by loaders[prefix](spec) -> (name, fn, weight) (e.g. {"model": plugins.reward_model.model_reward})."""
    funcs = []
    for spec in specs:
        prefix = spec.partition(":")[0]
        if loaders and prefix in loaders:
            funcs.append(loaders[prefix](spec))
            continue
        name, weight = split_weight(spec)
        if not math.isfinite(weight):  # `math:nan` parses as a weight: every reward would become NaN, then 0
            raise ArgsError(f"--rewards {spec}: the weight must be a finite number, got {weight}")
        if ":" in name:
            module, fn_name = name.split(":", 1)
            funcs.append((fn_name, getattr(importlib.import_module(module), fn_name), weight))
        elif name in registry:
            funcs.append((name, registry[name], weight))
        else:
            raise ValueError(f"unknown reward {name!r}: use one of {sorted(registry)} or module:function")
    return funcs


_warned_all_none: set[str] = set()


def compute_rewards(funcs, prompts, completions, row_fields: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Call every (name, fn, weight) on the batch -> (rewards (B,), rewards_per_func (B, F)). None becomes NaN in
    rewards_per_func, and rewards = nansum_f weight_f * reward_f leaves it out, as TRL does. A row that no function
    applies to gets 0 (nansum; advantages need finite rewards): TRL makes it NaN and zeroes its advantage, which gives
    the same loss but keeps it out of its group's mean and std."""
    per_func = torch.zeros(len(completions), len(funcs))
    for i, (name, fn, _) in enumerate(funcs):
        out = fn(prompts=prompts, completions=completions, **row_fields)
        if len(out) != len(completions):
            raise ValueError(f"reward '{name}' returned {len(out)} rewards for {len(completions)} completions")
        if all(r is None for r in out) and name not in _warned_all_none:
            _warned_all_none.add(name)  # once per function: a missing dataset column would repeat it every step
            warnings.warn(f"reward '{name}' returned None for a whole batch: is its dataset column missing?")
        for j, r in enumerate(out):  # None: "does not apply" (NaN below, left out); NaN/Inf, "1.0": a broken reward
            huge = isinstance(r, int) and abs(r) >= 2**128  # past float32 (float() raises past 1e308: 10**400)
            if r is not None and (huge or not (isinstance(r, numbers.Real) and math.isfinite(r))):  # not "1.0"
                shown = f"completion {j} of {len(out)} ({str(completions[j])[:60]!r})"
                raise RewardError(f"reward '{name}' returned {r!r:.60} for {shown}: must be a finite number or None")
        per_func[:, i] = torch.tensor([math.nan if r is None else float(r) for r in out])
        j = next((j for j, r in enumerate(out) if r is not None and per_func[j, i].isinf()), None)
        if j is not None:  # finite in float64, Inf in the float32 the rewards train in (1e39)
            raise RewardError(f"reward '{name}' returned {out[j]!r} for completion {j}: past float32's range")
    weights = torch.tensor([w for _, _, w in funcs])
    rewards = (per_func * weights).nansum(dim=1)
    if not rewards.isfinite().all():  # the weighted sum can overflow float32 where no single reward does
        raise RewardError(f"the weighted sum of rewards {[n for n, _, _ in funcs]} overflows float32: {rewards}")
    return rewards, per_func


def score_rollout(rows: list[dict], out: dict, funcs, max_completion_length: int):
    """compute_rewards for N rollout samples (out from common.rollout) and their N dataset rows. Conversational
    prompts get each completion as one assistant message (TRL's convention); every other column reaches the rewards."""
    chat = isinstance(rows[0]["prompt"], list)
    completions = [[{"role": "assistant", "content": c}] if chat else c for c in out["completions"]]
    keys = sorted({k for row in rows for k in row} - {"prompt", "prompt_ids", "_loc"})
    fields = {k: [row.get(k) for row in rows] for k in keys}
    fields |= {"completion_ids": out["completion_ids"], "max_completion_length": max_completion_length}
    return compute_rewards(funcs, [row["prompt"] for row in rows], completions, fields)

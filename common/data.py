"""Data for every script: load rows, validate them before any model loads, render chat templates, tokenize prompts,
pad and batch. Rows are TRL's, "standard" (strings) or "conversational" (lists of {role, content}); prompt rows are
{prompt, ...extra fields such as answer}; rows with a completion are common.completions'. Every row carries "_loc"
("f.jsonl:12" = 1-based line, "f.json:[3]" / "org/set:[3]" = index) for error messages. Prompt rows over
max_prompt_length are DROPPED with one warning, not left-truncated (TRL's GRPO does not truncate prompts).
"""

import array
import json
import math
import os
import pathlib
import sys
import time
import warnings

import jinja2
import torch
from torch.nn.utils.rnn import pad_sequence

from common.errors import DataError

MAX_SHOWN = 5  # bad rows listed in one error, and locations listed in one warning


def _first(locs: list) -> str:
    return ", ".join(str(x) for x in locs[:MAX_SHOWN]) + (", ..." if len(locs) > MAX_SHOWN else "")


def bad_field(row: dict, field: str, problem: str):
    raise DataError(f"{row.get('_loc', '<row>')}: field '{field}': {problem}")


def _columns(row: dict) -> str:
    return ", ".join(k for k in row if k != "_loc") or "nothing"


def map_rows(rows: list[dict], fn, what: str) -> list[dict]:
    """fn over every row; all bad rows' DataErrors become one error: a file is fixed in one pass, not one per run."""
    out = []
    errors = []
    for row in rows:
        try:
            out.append(fn(row))
        except DataError as e:
            errors.append(str(e))
    if errors:
        raise DataError(
            f"{len(errors)} bad row(s) for {what} (first {min(len(errors), MAX_SHOWN)}):\n  "
            + "\n  ".join(errors[:MAX_SHOWN])
        )
    return out


# ----------------------------------------------------------------------------------------------------- loading
def _json(text: str, name: str, line: int | None = None):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:  # in a whole .json file the decoder knows the line
        raise DataError(f"{name}:{line or e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None


def _utf8(raw: bytes, name: str, line: int) -> str:
    """raw as text; else one line naming the file, line and column of the first byte that is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line += raw.count(b"\n", 0, e.start)
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise DataError(
            f"{name}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {column}); save the file as UTF-8"
        ) from None


def _row(row: object, loc: str) -> dict:
    if not isinstance(row, dict):
        raise DataError(f"{loc}: expected a JSON object, got {type(row).__name__}: {str(row)[:60]}")
    row["_loc"] = loc
    return row


def _read_file(path: pathlib.Path) -> list[dict]:
    name = str(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # installed with datasets

        return [dict(r, _loc=f"{name}:[{i}]") for i, r in enumerate(pq.read_table(path).to_pylist())]
    if path.suffix not in (".json", ".jsonl"):
        raise DataError(f"{name}: unsupported file type {path.suffix!r}; use .json, .jsonl or .parquet")
    bom = b"\xef\xbb\xbf"  # a UTF-8 byte order mark (Windows editors) is not text
    with open(path, "rb") as f:  # the first non-blank byte: "{" starts JSON Lines, "[" a JSON list
        first = next((line.removeprefix(bom).lstrip()[:1] for line in f if line.removeprefix(bom).strip()), b"")
    if not first:
        raise DataError(f"{name}: the file is empty")
    # `Dataset.to_json` writes JSON Lines even into files named .json: a .json starting with "{" is read as such.
    if path.suffix == ".jsonl" or first == b"{":
        # Line by line, so a large file is never held whole in memory, and split at "\n" only: str.splitlines would
        # also split at U+2028, U+0085 and other characters that JSON allows unescaped inside strings.
        rows = []
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                text = _utf8(raw.removeprefix(bom) if n == 1 else raw, name, n)
                if text.strip():
                    rows.append(_row(_json(text, name, n), f"{name}:{n}"))
    else:
        data = _json(_utf8(path.read_bytes().removeprefix(bom), name, 1), name)
        if not isinstance(data, list):
            raise DataError(f"{name}: expected a JSON list of objects, got a {type(data).__name__}")
        rows = [_row(row, f"{name}:[{i}]") for i, row in enumerate(data)]
    if not rows:
        raise DataError(f"{name}: no rows in the file")
    return rows


def looks_local(spec: str) -> bool:
    """A path, not a hub id ("org/name"): absolute, starting with '.' or '~', or with more than one '/'."""
    return spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or (os.sep != "/" and os.sep in spec)


def load_rows(spec: str, split: str = "train", convert=None, builtin=None, hub=None) -> list[dict]:
    """Rows from a local .json/.jsonl/.parquet file, `builtin:<name>` (from `builtin(name, split)`, e.g.
    plugins.builtin_math.builtin_rows) or a saved HF dataset folder or hub id ("org/name[:config]", from `hub(spec,
    split)`, e.g. harness.hub.hub_rows); `convert(row)` (e.g. sharegpt_row, question_row) rewrites each row."""
    path = pathlib.Path(spec)
    if spec.startswith("builtin:"):
        if builtin is None:
            raise DataError(f"{spec}: no built-in datasets here (load_rows was not given a builtin= source)")
        rows = [dict(r) for r in builtin(spec.removeprefix("builtin:"), split)]
    elif path.is_file():
        rows = _read_file(path)
    elif not path.is_dir() and (path.suffix in (".json", ".jsonl", ".parquet") or looks_local(spec)):
        # a mistyped path must not turn into a hub lookup
        raise DataError(f"{spec}: file not found (no such file or directory)")
    elif hub is None:
        raise DataError(f"{spec}: no hub or saved datasets here (load_rows was not given a hub= source)")
    else:
        rows = hub(spec, split)
    for i, row in enumerate(rows):
        row.setdefault("_loc", f"{spec}:[{i}]")
    if convert is not None:
        rows = map_rows(rows, convert, f"the {convert.__name__} conversion")
    return rows


# -------------------------------------------------------------------------------------------------- validation
def _text_problem(value: object, may_be_empty: bool) -> str | None:
    """What is wrong with a string-or-messages field, or None."""
    if not isinstance(value, (str, list)):
        return f"must be a string or a list of {{role, content}} messages, got {type(value).__name__}"
    if value == []:  # even where an empty string is fine: chat templates refuse to render an empty conversation
        return "is an empty message list"
    for j, m in enumerate(value if isinstance(value, list) else []):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            return f"message {j} must be an object with string 'role' and 'content', got {str(m)[:80]}"
    text = value if isinstance(value, str) else "".join(m["content"] for m in value)
    return None if may_be_empty or text.strip() else "is empty"


def _check_prompt_row(row: dict) -> dict:
    if "prompt" not in row:
        bad_field(row, "prompt", f"missing (row has: {_columns(row)})")
    problem = _text_problem(row["prompt"], False)
    if problem:
        bad_field(row, "prompt", problem)
    return row


# Other toolkits' layouts by their columns (required, optional): rows with exactly these were not converted
KNOWN_LAYOUTS = {
    "alpaca": ({"instruction", "output"}, {"input", "system", "history"}),
    "sharegpt": ({"conversations"}, {"system"}),
}


def validate_rows(rows: list[dict], kind: str = "prompt", convert_flag: str | None = None, check=_check_prompt_row):
    """Check rows of `kind` with `check` (a row -> the row normalised, or DataError) before any model loads: one
    DataError listing the first bad rows, or where the check refuses rows in a known other layout, one line saying
    how to convert them (with the caller's `convert_flag`, "--convert": the option's name, or in the file)."""
    if not rows:
        raise DataError(f"no rows to validate for {kind} data")
    try:
        return map_rows(rows, check, f"{kind} data")
    except DataError:
        columns = rows[0].keys() - {"_loc"}
        layout = next((k for k, (need, may) in KNOWN_LAYOUTS.items() if need <= columns <= need | may), None)
        if layout is None:
            raise
        how = f"pass {convert_flag} {layout}" if convert_flag else "convert the file first (docs/data.md, Conversions)"
        raise DataError(
            f"{rows[0]['_loc']}: the rows are in {layout}'s layout ({', '.join(sorted(columns))}), not TRL's {kind} "
            f"rows: {how}"
        ) from None


# ------------------------------------------------------------------------------------------------- templates
# ChatML (OpenAI / Qwen): <|im_start|>role\ncontent<|im_end|>\n
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen2.5's template without tools: ChatML, plus Qwen's default system prompt when the conversation has none.
QWEN = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}" + CHATML
)

# Llama 3 / 3.1 instruct (without tools); Meta's template trims each message's content, so we do too.
LLAMA3 = (
    "{{ '<|begin_of_text|>' }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

TEMPLATES = {"chatml": CHATML, "qwen": QWEN, "llama3": LLAMA3}
# Every special token a template writes, end-of-turn first: each must be ONE token in the tokenizer's vocab.
SPECIALS = {
    "chatml": ["<|im_end|>", "<|im_start|>"],
    "qwen": ["<|im_end|>", "<|im_start|>"],
    "llama3": ["<|eot_id|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>"],
}


def end_of_turn_token(tokenizer, template_name: str) -> str:
    """The token that closes an assistant turn under `template_name` ("tokenizer" = the tokenizer's own template)."""
    if template_name in SPECIALS:
        return SPECIALS[template_name][0]
    # An unknown template: render one exchange and take the first added (special) token after the assistant's text,
    # e.g. <|im_end|>, <|eot_id|>, <end_of_turn>, <|end|>, </s>.
    probe = "Probe-7c1e"
    try:
        chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": probe}]
        text = tokenizer.apply_chat_template(chat, tokenize=False)
    except jinja2.TemplateError:  # the template refuses the probe (raise_exception, e.g. it demands a system turn)
        return tokenizer.eos_token
    except (TypeError, ValueError, KeyError, AttributeError) as e:  # a broken template: say so now, not mid-run
        raise ValueError(f"the tokenizer's chat template fails to render a user/assistant chat: {e}") from None
    if probe not in text:
        return tokenizer.eos_token
    added = set(tokenizer.added_tokens_decoder)
    for token_id in tokenizer(text.split(probe, 1)[1], add_special_tokens=False)["input_ids"]:
        if token_id in added:
            return tokenizer.convert_ids_to_tokens(token_id)
    # The template closes turns with plain text: eos is the best stop signal we have, but no rendered completion
    # holds it, so nothing in the loss teaches the model to stop (TRL's SFTTrainer warns about the same case).
    warnings.warn(
        "the chat template ends the assistant's turn with plain text, not a special token: completions carry no "
        "stop token, so the model will not learn to stop (generation runs on to the limit). Pick a template that "
        f"ends turns with a special token (e.g. --template chatml) or add {tokenizer.eos_token!r} to the template."
    )
    return tokenizer.eos_token


def setup_chat_template(tokenizer, template: str = "auto") -> str:
    """Install a chat template and make its end-of-turn token the tokenizer's eos, as TRL's clone_chat_template does
    (one id stops generation, closes standard completions and is in every loss mask); returns the template's name.
    "auto" keeps the tokenizer's own ("tokenizer") when it has one, else installs ChatML; a TEMPLATES name overrides
    it. Callers copy `tokenizer.eos_token_id` to the model's generation config."""
    if template == "auto":
        template = "tokenizer" if tokenizer.chat_template else "chatml"
    if template == "tokenizer" and not tokenizer.chat_template:
        raise ValueError(
            "chat_template='tokenizer' but this tokenizer has no chat template; pick one of "
            f"{sorted(TEMPLATES)} (or 'auto')"
        )
    if template not in TEMPLATES and template != "tokenizer":
        raise ValueError(f"unknown chat template {template!r}; use 'auto', 'tokenizer' or one of {sorted(TEMPLATES)}")
    if template in TEMPLATES:
        # A non-special "<|im_end|>" splits into byte pieces, a stop generation never sees; adding the specials would
        # need an embedding resize whose new rows are untrained (silently worse): pick a template the tokenizer speaks.
        missing = [t for t in SPECIALS[template] if len(tokenizer(t, add_special_tokens=False)["input_ids"]) != 1]
        if missing:
            raise ValueError(
                f"chat template {template!r} needs the special tokens {missing}, which this tokenizer "
                "does not have as single tokens. Pick a template whose tokens it has; its added tokens "
                f"are {sorted(tokenizer.added_tokens_encoder)[:20]}."
            )
        tokenizer.chat_template = TEMPLATES[template]
    # The completion's closing token must be the one generation stops on, or the model learns to stop with a token
    # that `generate` ignores (a base Qwen tokenizer's eos is <|endoftext|> while ChatML closes turns with <|im_end|>).
    tokenizer.eos_token = end_of_turn_token(tokenizer, template)
    return template


# ------------------------------------------------------------------------------------------------ tokenization
class Ids(array.array):
    """A tokenized row's ids (typecode "i") or 0/1 mask ("b") as a C array, 4 or 1 bytes a token (a list of Python ints
    costs a pointer and an int object per token). It reads like that list: a slice is an Ids, `+` with a list or an
    Ids gives a list, == compares values with a list, so code written for lists of ids runs unchanged."""

    __hash__ = None  # mutable, like a list

    def __getitem__(self, index):
        item = super().__getitem__(index)
        return Ids(self.typecode, item) if isinstance(index, slice) else item

    def __add__(self, other):
        return self.tolist() + list(other) if isinstance(other, (list, array.array)) else NotImplemented

    def __radd__(self, other):
        return list(other) + self.tolist() if isinstance(other, (list, array.array)) else NotImplemented

    def __eq__(self, other):
        return self.tolist() == list(other) if isinstance(other, (list, array.array)) else NotImplemented

    __ne__ = object.__ne__  # the negation of __eq__ above (array's own != compares no list)

    def __copy__(self, memo=None):  # array's copies are plain arrays; ints need no deep copy
        return Ids(self.typecode, self)

    __deepcopy__ = __copy__


def _chat(tokenizer, messages: list[dict], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _encode_texts(tokenizer, texts: list[tuple[str, bool]]) -> list[list[int]]:
    """The ids of each (text, add special tokens: a rendered chat holds its own, BOS included), one tokenizer call per
    flag on the distinct texts (a fast tokenizer encodes a batch in Rust): the same ids as one call per text."""
    ids = {}
    for special in (False, True):
        distinct = list(dict.fromkeys(text for text, flag in texts if flag is special))
        if distinct:
            encoded = tokenizer(distinct, add_special_tokens=special)["input_ids"]
            ids |= {(text, special): e for text, e in zip(distinct, encoded, strict=True)}
    return [ids[key] for key in texts]


def prompt_texts(tokenizer, row: dict) -> list[tuple[str, bool]]:
    """The prompt's (text, add special tokens): a conversation rendered with the generation prompt."""
    prompt = row["prompt"]
    return [(_chat(tokenizer, prompt, True), False) if isinstance(prompt, list) else (prompt, True)]


def tokenize_prompt(tokenizer, row: dict, max_prompt_length: int | None, ids: list | None = None) -> dict | None:
    """{prompt_ids}; None (drop) when too long. `ids`: the encodings of prompt_texts when the caller has them."""
    ids = _encode_texts(tokenizer, prompt_texts(tokenizer, row)) if ids is None else ids
    too_long = max_prompt_length is not None and len(ids[0]) > max_prompt_length
    return None if too_long else {"prompt_ids": Ids("i", ids[0])}


TOKENIZE_BATCH = 1000  # rows whose texts go to the tokenizer in one call
PROGRESS_EVERY = 10.0  # seconds between progress lines; a set tokenized faster than this prints none


def tokenize_dataset(
    tokenizer, rows: list[dict], kind: str, max_length: int | None, texts=prompt_texts, tokenize=tokenize_prompt, **kw
) -> list[dict]:
    """Tokenize validated rows of `kind` with `texts` and `tokenize` (for "prompt", max_length is the prompt limit),
    dropping those that do not fit with one warning. Examples keep "_loc", prompt rows all their fields (reward input).
    TOKENIZE_BATCH rows' texts go to the tokenizer in one call, with a progress line every PROGRESS_EVERY seconds."""
    examples = []
    dropped = []
    start = time.perf_counter()
    shown = start
    for first in range(0, len(rows), TOKENIZE_BATCH):
        batch = rows[first : first + TOKENIZE_BATCH]
        batch_texts = [texts(tokenizer, row) for row in batch]
        encoded = iter(_encode_texts(tokenizer, [t for row_texts in batch_texts for t in row_texts]))
        for row, row_texts in zip(batch, batch_texts, strict=True):
            ids = [next(encoded) for _ in row_texts]
            example = tokenize(tokenizer, row, max_length, ids=ids, **kw)
            if example is None:
                dropped.append(row.get("_loc"))
            else:
                examples.append((row if kind == "prompt" else {"_loc": row.get("_loc")}) | example)
        now = time.perf_counter()
        if now - shown >= PROGRESS_EVERY:
            shown = now
            done = first + len(batch)
            line = f"tokenizing {kind} rows: {done:,} of {len(rows):,} ({done / (now - start):,.0f} rows/s)"
            print(line, file=sys.stderr, flush=True)
    if shown > start:
        took = time.perf_counter() - start
        print(f"tokenized {len(rows):,} {kind} rows in {took:.0f} s", file=sys.stderr, flush=True)
    if dropped:
        what = "the prompt is too long" if kind == "prompt" else "no completion token would be left"
        warnings.warn(
            f"dropped {len(dropped)} of {len(rows)} {kind} rows because {what} at a limit of {max_length} "
            f"tokens: {_first(dropped)}. Raise the limit to keep them."
        )
    if not examples:
        raise DataError(f"no {kind} rows left after tokenization with a limit of {max_length} tokens")
    return examples


# ---------------------------------------------------------------------------------------------------- batching
def pad_batch(seqs: list[list[int]], pad_value: int, side: str = "right") -> torch.LongTensor:
    """(B, T) with T the longest sequence; padding on the right or the left ("left" for generation)."""
    tensors = [torch.as_tensor(s, dtype=torch.long) for s in seqs]
    return pad_sequence(tensors, batch_first=True, padding_value=pad_value, padding_side=side)


def concat_prompt_completion(
    prompt_ids_list: list[list[int]], completion_ids_list: list[list[int]], pad_id: int, side: str = "right"
) -> dict:
    """Prompt + completion per row, padded: input_ids, attention_mask, completion_mask (1 on completion tokens)."""
    pairs = list(zip(prompt_ids_list, completion_ids_list, strict=True))
    seqs = [list(p) + list(c) for p, c in pairs]
    return {
        "input_ids": pad_batch(seqs, pad_id, side),
        "attention_mask": pad_batch([[1] * len(s) for s in seqs], 0, side),
        "completion_mask": pad_batch([[0] * len(p) + [1] * len(c) for p, c in pairs], 0, side),
    }


def micro_batch(
    examples: list, index: int, batch_size: int, seed: int, drop_last: bool = False, min_rows: int = 1
) -> list:
    """The index-th micro-batch of an endless, epoch-wise reshuffled stream: a pure function of (index, seed), so
    resuming at a step needs no saved iterator, and accumulation 1 x 4 sees the same rows as 4 x 1. drop_last: every
    batch is full (the epoch's remainder is skipped; fewer rows than batch_size repeat rows). min_rows: an epoch's
    last batch shorter than that is topped up with the epoch's first rows (e.g. a loss that pairs rows needs two)."""
    per_epoch = max(1, len(examples) // batch_size) if drop_last else math.ceil(len(examples) / batch_size)
    epoch, pos = divmod(index, per_epoch)
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    if drop_last:
        return [examples[order[(pos * batch_size + i) % len(examples)]] for i in range(batch_size)]
    rows = order[pos * batch_size : (pos + 1) * batch_size]
    return [examples[i] for i in rows + order[: max(min_rows - len(rows), 0)]]

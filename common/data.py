"""Data for every script: load rows, convert common layouts, validate before any model loads, tokenize with loss
masks, pad and pack. Row formats are TRL's, "standard" (strings) or "conversational" (lists of {role, content}):
  sft {prompt, completion} | {messages} | {text};  prompt {prompt, ...extra fields such as answer}
  prompt rows may also be {question, answer} (GSM8K's layout, hub openai/gsm8k:main or its JSONL files alike):
    validate_rows turns them into {prompt, answer: the number after '####', solution} (question_row)
  preference {prompt, chosen, rejected}; with no prompt, chosen and rejected's shared start becomes it (as TRL)
  sft and preference rows in ShareGPT's layout ({conversations: [{from, value}]}) go through _sharegpt unasked
  binary {prompt, completion, label: bool}; validate_rows also splits {messages, label} (LLaMA-Factory's and many hub
    KTO sets' layout): the last, assistant, message becomes the completion
Every row carries "_loc" ("f.jsonl:12" = 1-based line, "f.json:[3]" / "org/set:[3]" = index) for error messages.
Truncation: sft keeps the start (TRL's "keep_start"). preference/binary keep the END of the prompt (max_prompt_length,
TRL < 1.0's "keep_end"), then cut completions from the right to fit max_length (max_prompt_length=None: TRL 1.16's
DPO/KTO default). A row whose completion would be cut away is dropped, never trained as a silent zero loss. Prompt-only
rows over max_prompt_length are DROPPED, not left-truncated: that would cut the question and the chat header, and
rewards would score answers to a question the model never saw (TRL 1.16's GRPO does not truncate prompts; older TRL
cut them from the left). Drops get one warning: count + first locations."""

import json
import math
import os
import pathlib
import warnings

import torch

MAX_SHOWN = 5  # bad rows listed in one error, and locations listed in one warning


class DataError(ValueError):
    """A problem in the user's data; the message names the file and line (or index) of each bad row."""


def _first(locs: list) -> str:
    return ", ".join(str(x) for x in locs[:MAX_SHOWN]) + (", ..." if len(locs) > MAX_SHOWN else "")


def _bad(row: dict, field: str, problem: str):
    raise DataError(f"{row.get('_loc', '<row>')}: field '{field}': {problem}")


def _columns(row: dict) -> str:
    return ", ".join(k for k in row if k != "_loc") or "nothing"


def _map_rows(rows: list[dict], fn, what: str) -> list[dict]:
    """fn over every row; all bad rows' DataErrors become one error: a file is fixed in one pass, not one per run."""
    out, errors = [], []
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
        with open(path, "rb") as f:
            rows = [
                _row(_json(text, name, n), f"{name}:{n}")
                for n, raw in enumerate(f, 1)
                if (text := _utf8(raw.removeprefix(bom) if n == 1 else raw, name, n)).strip()
            ]
    else:
        if not isinstance(data := _json(_utf8(path.read_bytes().removeprefix(bom), name, 1), name), list):
            raise DataError(f"{name}: expected a JSON list of objects, got a {type(data).__name__}")
        rows = [_row(row, f"{name}:[{i}]") for i, row in enumerate(data)]
    if not rows:
        raise DataError(f"{name}: no rows in the file")
    return rows


def looks_local(spec: str) -> bool:
    """A path, not a hub id ("org/name"): absolute, starting with '.' or '~', or with more than one '/'."""
    return spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or (os.sep != "/" and os.sep in spec)


def _load_saved_dataset(path: pathlib.Path, split: str) -> list[dict]:
    """A folder written by Dataset(Dict).save_to_disk; any other folder is refused (datasets would train on whatever
    files it finds inside, e.g. a run dir's metrics.jsonl)."""
    if not any((path / f).is_file() for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
        shown = ", ".join(sorted(os.listdir(path))[:5]) or "nothing"
        raise DataError(
            f"{path}: a directory, not a saved HF dataset (save_to_disk's dataset_info.json/state.json "
            f"or dataset_dict.json missing; it holds: {shown}); pass a .json/.jsonl/.parquet file"
        )
    import datasets

    data = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise DataError(f"{path}: no split {split!r} in the saved dataset (it has: {', '.join(data)})")
        data = data[split]
    return [dict(r, _loc=f"{path}:[{i}]") for i, r in enumerate(data.to_list())]


def load_rows(
    spec: str, split: str = "train", convert: str | None = None, field_map: dict[str, str] | None = None
) -> list[dict]:
    """Rows from a local .json/.jsonl/.parquet file, `builtin:<name>`, or a hub id ("org/name" or "org/name:config").
    `field_map` renames columns first ({"question": "prompt"}); then `convert` (a CONVERTERS key) rewrites each row."""
    path = pathlib.Path(spec)
    if spec.startswith("builtin:"):
        from common.embedded import builtin_rows

        rows = [dict(r) for r in builtin_rows(spec.removeprefix("builtin:"), split)]
    elif path.is_file():
        rows = _read_file(path)
    elif path.is_dir():
        rows = _load_saved_dataset(path, split)
    elif path.suffix in (".json", ".jsonl", ".parquet") or looks_local(spec):
        # a mistyped path must not turn into a hub lookup
        raise DataError(f"{spec}: file not found (no such file or directory)")
    else:
        import datasets

        from common.hub import check_hub

        name, _, config = spec.partition(":")  # hub sets with several configs, e.g. "openai/gsm8k:main"
        check_hub(name, "dataset")  # not cached and the hub unreachable: one line now, not a traceback after retries
        rows = datasets.load_dataset(name, config or None, split=split).to_list()
    for i, row in enumerate(rows):
        row.setdefault("_loc", f"{spec}:[{i}]")
    if field_map and rows:
        if missing := [k for k in field_map if k not in rows[0]]:
            raise DataError(f"{rows[0]['_loc']}: field_map names {missing}, not among the columns {_columns(rows[0])}")
        rows = [{field_map.get(k, k): v for k, v in row.items()} for row in rows]
    if convert is not None:
        if convert not in CONVERTERS:
            raise DataError(f"unknown convert={convert!r}; choose from {sorted(CONVERTERS)}")
        rows = _map_rows(rows, CONVERTERS[convert], f"convert={convert!r}")
    return rows


def load_splits(args, kind: str) -> tuple[list[dict], list[dict]]:
    """(--dataset-split rows, --eval-split rows or []) of --dataset, validated as `kind`. A local file has no splits
    or a saved Dataset (load_rows reads all of it whatever the split): its --eval-split may only be --dataset-split.
    --eval-steps needs an --eval-split (TRL refuses eval_strategy="steps" without an eval_dataset)."""
    from common.run import ArgsError

    if args.eval_steps and args.eval_split is None:
        raise ArgsError(f"--eval-steps {args.eval_steps}: there is nothing to evaluate without --eval-split")
    path = pathlib.Path(args.dataset)
    # A saved Dataset (not a DatasetDict) has no splits either: load_rows returns all of it for any split name.
    one = "one file" if path.is_file() else "a saved Dataset" if path.is_dir() else None
    if args.eval_split not in (None, args.dataset_split) and one and not (path / "dataset_dict.json").is_file():
        raise ArgsError(
            f"--eval-split {args.eval_split}: {args.dataset} is {one} with no splits (all of it is the training "
            f"data); leave --eval-split unset, or pass {args.dataset_split} to evaluate on the training rows"
        )
    convert = getattr(args, "convert", None)  # sft.py's --convert alpaca / sharegpt
    rows, eval_rows = (
        load_rows(args.dataset, s, convert=convert) if s else [] for s in (args.dataset_split, args.eval_split)
    )
    return validate_rows(rows, kind), validate_rows(eval_rows, kind) if args.eval_split else []


# -------------------------------------------------------------------------------------------------- converters
def _need(row: dict, field: str, kind: type) -> object:
    if not isinstance(row.get(field), kind):
        _bad(
            row,
            field,
            f"must be a {kind.__name__}, got {type(row[field]).__name__}"
            if field in row
            else f"missing (row has: {_columns(row)})",
        )
    return row[field]


def _rest(row: dict, *drop: str) -> dict:
    return {k: v for k, v in row.items() if k not in drop}  # extra columns (ids, answers, ...) pass through


def _alpaca_history(row: dict) -> list[dict]:
    """LLaMA-Factory's alpaca `history` ([[instruction, response], ...], earlier rounds) as user/assistant turns."""
    rounds = row.get("history") or []
    if not (isinstance(rounds, list) and all(isinstance(r, list) and len(r) == 2 for r in rounds)):
        _bad(row, "history", f"must be a list of [instruction, response] pairs, got {str(rounds)[:80]}")
    return [{"role": role, "content": text} for r in rounds for role, text in zip(("user", "assistant"), r)]


def _alpaca(row: dict) -> dict:
    """{instruction, input, output[, system][, history]} -> conversational {prompt: [system?, the history's turns,
    user], completion: [assistant]}."""
    user, output = _need(row, "instruction", str), _need(row, "output", str)
    if row.get("input"):
        user += "\n\n" + _need(row, "input", str)  # Alpaca's layout: the instruction, a blank line, then the input
    system = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    return _rest(row, "instruction", "input", "output", "system", "history") | {
        "prompt": system + _alpaca_history(row) + [{"role": "user", "content": user}],
        "completion": [{"role": "assistant", "content": output}],
    }


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def _sharegpt_message(row: dict, field: str, turn: object) -> dict:
    if not isinstance(turn, dict) or turn.get("from") not in SHAREGPT_ROLES or not isinstance(turn.get("value"), str):
        _bad(row, field, f"expected {{from: one of {sorted(SHAREGPT_ROLES)}, value: str}}, got {str(turn)[:80]}")
    return {"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]}


def _sharegpt(row: dict) -> dict:
    """{conversations: [{from, value}]} -> {messages}; with chosen/rejected {from, value} turns it is a preference row
    whose prompt is the conversation. A `system` column becomes a leading system message (LLaMA-Factory's layout)."""
    messages = [_sharegpt_message(row, "conversations", t) for t in _need(row, "conversations", list)]
    messages = ([{"role": "system", "content": row["system"]}] if row.get("system") else []) + messages
    if "chosen" not in row and "rejected" not in row:
        return _rest(row, "conversations", "system") | {"messages": messages}
    pair = {k: [_sharegpt_message(row, k, row.get(k))] for k in ("chosen", "rejected")}
    return _rest(row, "conversations", "system") | {"prompt": messages} | pair


CONVERTERS = {"alpaca": _alpaca, "sharegpt": _sharegpt}


# ----------------------------------------------------------------------------------------------- GSM8K layout
def question_row(row: dict, instruction: str | None = None) -> dict:
    """A {question, answer} math row (GSM8K: hub openai/gsm8k:main and its JSONL files alike) as a prompt-only row:
    prompt = one user turn, the question then `instruction` (default: common.embedded.MATH_INSTRUCTION, which asks
    for '#### N'; '' for the bare question) on a new line; answer = the number after the last '####' with thousands
    commas dropped ('#### 1,080' -> '1080'), the whole worked solution kept as `solution`. An answer without '####'
    (a bare number) stays as given; `question` stays too (eval records show it)."""
    if instruction is None:
        from common.embedded import MATH_INSTRUCTION

        instruction = MATH_INSTRUCTION
    question = _need(row, "question", str)
    out = _rest(row, "answer") | {
        "prompt": [{"role": "user", "content": f"{question}\n{instruction}" if instruction else question}]
    }
    if isinstance(answer := row.get("answer"), str) and "####" in answer:
        return out | {"answer": answer.rsplit("####", 1)[1].strip().replace(",", ""), "solution": answer}
    return out | ({"answer": str(answer)} if answer is not None else {})


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


def _extract_prompt(chosen, rejected):
    """TRL's implicit prompt: the longest shared start (messages, or characters) of chosen and rejected."""
    n = _common_prefix(chosen, rejected)
    if isinstance(chosen, str) and n > 0 and chosen[n - 1] == " ":
        n -= 1  # as TRL: the space before the answers stays with the answers
    return chosen[:n], chosen[n:], rejected[n:]


def _check_row(row: dict, kind: str) -> dict:
    # Normalise first: ShareGPT rows (LLaMA-Factory's layout; dpo/orpo/rm have no --convert), implicit-prompt
    # preference rows and {messages, label} binary rows into TRL's form.
    if kind in ("sft", "preference") and "conversations" in row and not {"prompt", "messages", "text"} & row.keys():
        row = _sharegpt(row)
    if (
        kind == "preference"
        and "prompt" not in row
        and isinstance(row.get("chosen"), (str, list))
        and type(row.get("rejected")) is type(row["chosen"])
    ):
        row = row | dict(zip(("prompt", "chosen", "rejected"), _extract_prompt(row["chosen"], row["rejected"])))
        if not (row["chosen"] and row["rejected"]):  # one answer is the other's start: all of it went to the prompt
            side, other = ("chosen", "rejected") if not row["chosen"] else ("rejected", "chosen")
            how = f"equals '{other}'" if row[side] == row[other] else f"is the start of '{other}'"
            why = "so no prompt can be split off their shared start: add a 'prompt' field"
            _bad(row, side, f"{how} and the row has no 'prompt', {why}")
    if kind == "binary" and "messages" in row and "prompt" not in row and "completion" not in row:
        msgs = row["messages"]
        if not (
            isinstance(msgs, list) and msgs and isinstance(msgs[-1], dict) and msgs[-1].get("role") == "assistant"
        ):
            _bad(row, "messages", "the last message must be an assistant turn (it becomes the completion)")
        row = _rest(row, "messages") | {"prompt": msgs[:-1], "completion": msgs[-1:]}
    if kind == "prompt" and "prompt" not in row and "question" in row:
        row = question_row(row)
    # (field, may be empty); an SFT row uses whichever of its three layouts it has
    fields = {
        "preference": [("prompt", True), ("chosen", False), ("rejected", False)],
        "binary": [("prompt", True), ("completion", False)],
        "prompt": [("prompt", False)],
        "sft": [("messages", False)]
        if "messages" in row
        else [("text", False)]
        if "text" in row
        else [("prompt", True), ("completion", False)],
    }[kind]
    for field, may_be_empty in fields:
        if field not in row:
            hint = "; sft rows need {prompt, completion}, {messages} or {text}" if kind == "sft" else ""
            _bad(row, field, f"missing{hint} (row has: {_columns(row)})")
        # {messages} is a chat, {text} plain text (TRL's language modelling rows): only prompt/completion may be either
        if (only := {"messages": list, "text": str}.get(field)) and not isinstance(row[field], only):
            what = "a list of {role, content} messages" if only is list else "a string"
            _bad(row, field, f"must be {what}, got {type(row[field]).__name__}")
        if problem := _text_problem(row[field], may_be_empty):
            _bad(row, field, problem)
        first = row[fields[0][0]]
        if isinstance(row[field], list) != isinstance(first, list):  # apply_chat_template or plain text, not both
            _bad(
                row,
                field,
                f"is a {type(row[field]).__name__} but '{fields[0][0]}' is a {type(first).__name__}: "
                "use strings for all fields or message lists for all",
            )
    if fields[0][0] == "messages":
        if not any(m["role"] == "assistant" and m["content"].strip() for m in row["messages"]):
            _bad(row, "messages", "has no assistant turn with content, so there is nothing to learn")
        if row["messages"][0]["role"] == "assistant":
            _bad(row, "messages", "starts with an assistant turn, which answers nothing (add the user turn before it)")
    if kind == "binary" and type(row.get("label")) is not bool:  # 1, "true", None are not labels: say so, no guessing
        _bad(
            row,
            "label",
            f"must be a JSON boolean (true/false), got {type(row['label']).__name__} {row['label']!r}"
            if "label" in row
            else "missing",
        )
    return row


def validate_rows(rows: list[dict], kind: str) -> list[dict]:
    """Check rows of kind "sft" | "preference" | "binary" | "prompt" before any model loads; returns them normalised
    (implicit prompts extracted, {messages, label} split, {question, answer} prompt rows through question_row).
    Raises one DataError listing the first bad rows."""
    if kind not in ("sft", "preference", "binary", "prompt"):
        raise ValueError(f"unknown data kind {kind!r}")
    if not rows:
        raise DataError(f"no rows to validate for {kind} data")
    rows = _map_rows(rows, lambda row: _check_row(row, kind), f"{kind} data")
    if kind == "preference" and (same := [r.get("_loc") for r in rows if r["chosen"] == r["rejected"]]):
        warnings.warn(
            f"{len(same)} of {len(rows)} preference rows have chosen == rejected ({_first(same)}). They are "
            "kept, but their pairwise loss term is constant (ln 2 for sigmoid DPO) with zero gradient, so "
            "they only dilute each batch: remove them unless that is intended."
        )
    if kind == "binary" and len(labels := {r["label"] for r in rows}) == 1:
        side = "desirable" if (label := labels.pop()) else "undesirable"
        warnings.warn(
            f"all {len(rows)} binary rows are labelled {label}: KTO needs desirable (true) and undesirable "
            f"(false) examples. Training still runs, but only the {side} half of the loss has signal."
        )
    return rows


# ----------------------------------------------------------------------------------------------------- SteerLM
def attribute_label(attributes: object, where: str) -> str:
    """SteerLM's attribute string: integer levels as `name:value` joined by commas, no spaces (NeMo-Aligner's
    examples/nlp/data/steerlm/attribute_annotate.py writes e.g. "quality:4,toxicity:0,humor:0,creativity:0" from a
    fixed name list); here names are sorted, so rows and --attributes agree whatever order they list them in."""
    if not isinstance(attributes, dict) or not attributes:
        raise DataError(f"{where}: field 'attributes': must be a non-empty {{name: level}} object: {attributes!r:.60}")
    for name, value in attributes.items():
        if not name or set(name) & set(",: \t\n"):  # the separators would make the string ambiguous
            raise DataError(f"{where}: field 'attributes': name {name!r} is empty or holds ',', ':' or a space")
        if isinstance(value, bool) or not isinstance(value, int | float) or not float(value).is_integer():
            # SteerLM conditions on integer levels (0-4 in NeMo-Aligner, rounded from the attribute model's scores)
            raise DataError(f"{where}: field 'attributes.{name}': must be an integer level, got {value!r}")
    return ",".join(f"{k}:{int(attributes[k])}" for k in sorted(attributes))


def parse_attributes(spec: str) -> str:
    """--attributes "correct:1,length:0" -> the attribute string training wrote for the same values."""
    pairs = [p.partition(":") for p in spec.split(",")]
    if bad := [n + s + v for n, s, v in pairs if not s or not v.strip().lstrip("-").isdigit()]:
        raise DataError(f"--attributes {spec!r}: {bad[0]!r} is not name:integer (e.g. correct:1,length:0)")
    if len(attributes := {n.strip(): int(v) for n, _, v in pairs}) < len(pairs):
        raise DataError(f"--attributes {spec!r}: a name is given twice")
    return attribute_label(attributes, "--attributes")


def steer_prompt(prompt: str | list[dict], label: str, attributes_in: str) -> str | list[dict]:
    """The prompt with SteerLM's attribute string written in. NeMo-Aligner puts it in a label slot of its own template
    (<extra_id_2>) between the assistant header and the reply; chat templates have no such slot, so it goes into
    "system" (default: its own line at the end of the system turn, which is added if absent; the user's words stay
    as they are) or "user" (its own last line of every user turn, closest to the reply like SteerLM's). A plain-text
    prompt gets it as its first ("system") or last ("user") line."""
    if isinstance(prompt, str):
        return f"{label}\n{prompt}" if attributes_in == "system" else f"{prompt}\n{label}"
    if attributes_in == "user":
        return [m | {"content": f"{m['content']}\n{label}"} if m["role"] == "user" else m for m in prompt]
    if prompt and prompt[0]["role"] == "system":
        return [prompt[0] | {"content": f"{prompt[0]['content']}\n{label}"}] + prompt[1:]
    return [{"role": "system", "content": label}] + prompt


def steer_rows(rows: list[dict], attributes_in: str = "system") -> list[dict]:
    """SteerLM's attribute-conditioned SFT rows: each validated sft row's `attributes` ({name: integer level}) is
    written into its prompt (steer_prompt) and dropped. Rows without attributes come back untouched (the same list);
    once one row has them every row needs the same names."""
    first = next((r for r in rows if r.get("attributes") is not None), None)
    if first is None:
        return rows
    names = sorted(first["attributes"]) if isinstance(first["attributes"], dict) else []

    def steer(row: dict) -> dict:
        if row.get("attributes") is None:
            _bad(row, "attributes", f"missing, but {first.get('_loc')} has them: every row needs the same names")
        label = attribute_label(row["attributes"], row.get("_loc", "<row>"))
        if sorted(row["attributes"]) != names:
            _bad(row, "attributes", f"names {sorted(row['attributes'])} differ from {names} in {first.get('_loc')}")
        if (field := "messages" if "messages" in row else "text" if "text" in row else "prompt") == "text":
            _bad(row, "attributes", "a {text} row has no prompt to write them into")
        return _rest(row, "attributes") | {field: steer_prompt(row[field], label, attributes_in)}

    return _map_rows(rows, steer, "attributes")


# ------------------------------------------------------------------------------------------------ tokenization
def _chat(tokenizer, messages: list[dict], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _ids(tokenizer, text: str, special: bool = False) -> list[int]:
    # A rendered chat already holds its special tokens (BOS included); plain text gets the tokenizer's own (BOS).
    return tokenizer(text, add_special_tokens=special)["input_ids"]


def _common_prefix(a: list | str, b: list | str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _through_last(ids: list[int], token_id: int) -> list[int]:
    # Up to and including the last end-of-turn token: what a template writes after it (ChatML's "\n") is dropped, as
    # generation stops at the end-of-turn, so trained completions end there too.
    return ids[: max((i + 1 for i, t in enumerate(ids) if t == token_id), default=len(ids))]


def _check_prefix(prefix: str, text: str, loc: str):
    if not text.startswith(prefix):
        raise DataError(
            f"{loc}: the chat template renders this chat's start differently when more turns follow (no "
            "prefix property, e.g. it rewrites earlier turns), so the assistant tokens can't be found. Use "
            "a built-in template (--template chatml) or one that renders each turn the same way."
        )


def _encode(tokenizer, prompt, completion, loc: str) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids); the completion ends with its end-of-turn (conversational) or EOS (standard)."""
    eos = tokenizer.eos_token_id
    if isinstance(prompt, list):
        prompt_text, text = _chat(tokenizer, prompt, True), _chat(tokenizer, prompt + completion)
        _check_prefix(prompt_text, text, loc)
        prompt_ids, full = _ids(tokenizer, prompt_text), _ids(tokenizer, text)
    else:
        # TRL appends the eos string to standard completions; we append its id (one token even if eos isn't special).
        prompt_ids, full = _ids(tokenizer, prompt, special=True), _ids(tokenizer, prompt + completion, special=True)
        full = full if full[-1:] == [eos] else full + [eos]
    # As TRL: the completion starts where the prompt's tokens and prompt+completion's first differ; that is right
    # after the prompt unless BPE merged tokens across the boundary (standard rows, e.g. "The sky is" + " blue").
    n = _common_prefix(prompt_ids, full)
    return prompt_ids[:n], _through_last(full[n:], eos)


def _fit(prompt_ids: list[int], completions: list[list[int]], max_length: int | None, max_prompt_length: int | None):
    """Keep the prompt's end (max_prompt_length), then cut completions from the right so each pair fits max_length;
    None when a completion would be left empty."""
    if max_prompt_length is not None and len(prompt_ids) > max_prompt_length:
        prompt_ids = prompt_ids[len(prompt_ids) - max_prompt_length :]
    if max_length is not None:
        completions = [c[: max(max_length - len(prompt_ids), 0)] for c in completions]
    return (prompt_ids, completions) if all(completions) else None


def _messages_ids(tokenizer, messages: list[dict], loc: str) -> tuple[list[int], list[int]]:
    """The chat's ids and a mask on each assistant turn's content + end-of-turn token. A turn is located by rendering
    the chat before it (with the generation prompt) and through it; both must be prefixes of the whole render."""
    text = _chat(tokenizer, messages)
    ids = _ids(tokenizer, text)
    mask = [0] * len(ids)
    for i in (i for i, m in enumerate(messages) if m["role"] == "assistant"):
        before, through = _chat(tokenizer, messages[:i], True), _chat(tokenizer, messages[: i + 1])
        _check_prefix(before, text, loc)
        _check_prefix(through, text, loc)
        # Token positions via common prefixes, which stay right if BPE merges across a turn boundary.
        start = _common_prefix(_ids(tokenizer, before), ids)
        turn = _through_last(ids[start : _common_prefix(_ids(tokenizer, through), ids)], tokenizer.eos_token_id)
        mask[start : start + len(turn)] = [1] * len(turn)
    return ids, mask


def tokenize_sft(tokenizer, row: dict, max_length: int | None, completion_only_loss: bool = True) -> dict | None:
    """{input_ids, completion_mask}: the mask is on the completion (prompt/completion rows) or on every assistant turn
    (messages rows), end-of-turn/EOS token included; all ones for {text} rows or completion_only_loss=False; never
    on token 0, which no token predicts.
    Right-truncated to max_length; None when no completion token survives (the caller drops the row)."""
    eos = tokenizer.eos_token_id
    if "messages" in row:
        input_ids, mask = _messages_ids(tokenizer, row["messages"], row.get("_loc", "<row>"))
    elif "text" in row:  # plain language modelling: every token, closed by EOS as TRL does
        input_ids = _ids(tokenizer, row["text"], special=True)
        input_ids = input_ids if input_ids[-1:] == [eos] else input_ids + [eos]
        mask = [1] * len(input_ids)
    else:
        prompt_ids, completion_ids = _encode(tokenizer, row["prompt"], row["completion"], row.get("_loc", "<row>"))
        input_ids, mask = prompt_ids + completion_ids, [0] * len(prompt_ids) + [1] * len(completion_ids)
    input_ids, mask = input_ids[:max_length], mask[:max_length]  # [:None] keeps everything
    if not any(mask[1:]):
        return None  # the completion was cut away: this row would add a silent zero to the loss
    # Token 0 has no context, so it is never a target (the shift drops it): out of the mask, or the step's token count
    # (the loss's denominator) would count it, once per row padded but not packed (transformers counts labels[1:]).
    mask = mask if completion_only_loss else [1] * len(input_ids)
    return {"input_ids": input_ids, "completion_mask": [0] + mask[1:]}


def tokenize_preference(
    tokenizer, row: dict, max_length: int | None, max_prompt_length: int | None = None
) -> dict | None:
    """{prompt_ids, chosen_ids, rejected_ids}; completions end with the end-of-turn/EOS token. Truncation: _fit."""
    prompt_ids, chosen = _encode(tokenizer, row["prompt"], row["chosen"], row.get("_loc", "<row>"))
    other_ids, rejected = _encode(tokenizer, row["prompt"], row["rejected"], row.get("_loc", "<row>"))
    # The two prompts differ only if BPE merged differently into each answer: share the common part, as TRL does.
    n = _common_prefix(prompt_ids, other_ids)
    fitted = _fit(prompt_ids[:n], [prompt_ids[n:] + chosen, other_ids[n:] + rejected], max_length, max_prompt_length)
    return fitted and {"prompt_ids": fitted[0], "chosen_ids": fitted[1][0], "rejected_ids": fitted[1][1]}


def tokenize_binary(tokenizer, row: dict, max_length: int | None, max_prompt_length: int | None = None) -> dict | None:
    """{prompt_ids, completion_ids, label}; truncated like tokenize_preference."""
    prompt_ids, completion_ids = _encode(tokenizer, row["prompt"], row["completion"], row.get("_loc", "<row>"))
    fitted = _fit(prompt_ids, [completion_ids], max_length, max_prompt_length)
    return fitted and {"prompt_ids": fitted[0], "completion_ids": fitted[1][0], "label": row["label"]}


def tokenize_prompt(tokenizer, row: dict, max_prompt_length: int | None) -> dict | None:
    """{prompt_ids}, conversational prompts rendered with the generation prompt; None (drop) when too long."""
    prompt = row["prompt"]
    ids = (
        _ids(tokenizer, _chat(tokenizer, prompt, True)) if isinstance(prompt, list) else _ids(tokenizer, prompt, True)
    )
    return None if max_prompt_length is not None and len(ids) > max_prompt_length else {"prompt_ids": ids}


TOKENIZE = dict(sft=tokenize_sft, preference=tokenize_preference, binary=tokenize_binary, prompt=tokenize_prompt)


def tokenize_dataset(tokenizer, rows: list[dict], kind: str, max_length: int | None, **kw) -> list[dict]:
    """Tokenize validated rows with TOKENIZE[kind] (for "prompt", max_length is the prompt limit), dropping those that
    do not fit with one warning. Examples keep "_loc"; prompt-only ones keep all their fields (reward inputs)."""
    examples, dropped = [], []
    for row in rows:
        if (example := TOKENIZE[kind](tokenizer, row, max_length, **kw)) is None:
            dropped.append(row.get("_loc"))
        else:
            examples.append((row if kind == "prompt" else {"_loc": row.get("_loc")}) | example)
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
    if side not in ("right", "left"):
        raise ValueError(f"side must be 'right' or 'left', got {side!r}")
    width = max((len(s) for s in seqs), default=0)
    out = torch.full((len(seqs), width), pad_value, dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            out[i, slice(0, len(s)) if side == "right" else slice(width - len(s), width)] = torch.as_tensor(s)
    return out


def collate_sft(examples: list[dict], pad_id: int) -> dict:
    """Right-padded input_ids, attention_mask, completion_mask (B, T); masks come from lengths, never from pad ids
    (with pad == eos, a pad-derived mask would drop the EOS the model must learn to emit)."""
    ids = [e["input_ids"] for e in examples]
    return {
        "input_ids": pad_batch(ids, pad_id),
        "attention_mask": pad_batch([[1] * len(x) for x in ids], 0),
        "completion_mask": pad_batch([e["completion_mask"] for e in examples], 0),
    }


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


# ----------------------------------------------------------------------------------------------------- packing
def concat_pairs(examples: list[dict], pad_id: int, device) -> dict:
    """[chosen rows; rejected rows] (2B, T), right-padded: one forward scores both halves (TRL's concatenated
    batch)."""
    prompts = [e["prompt_ids"] for e in examples]
    completions = [e["chosen_ids"] for e in examples] + [e["rejected_ids"] for e in examples]
    return {k: v.to(device) for k, v in concat_prompt_completion(prompts + prompts, completions, pad_id).items()}


def pack_examples(examples: list[dict], max_length: int) -> list[dict]:
    """Greedily concatenate tokenized SFT examples, in order, into rows of at most max_length tokens, with
    position_ids restarting at 0 for each document (which is what keeps documents from attending to each other)."""
    packs: list[dict] = []
    for ex in examples:
        n = len(ex["input_ids"])
        if n > max_length:
            raise ValueError(f"{ex.get('_loc')}: {n} tokens > max_length={max_length}; tokenize with the same limit")
        if not packs or len(packs[-1]["input_ids"]) + n > max_length:
            packs.append({"input_ids": [], "completion_mask": [], "position_ids": [], "_loc": []})
        packs[-1]["input_ids"] += ex["input_ids"]
        # A document's first token is never a label unpacked (the shift drops it); packed, it would be "predicted"
        # from the previous document's last token, so it leaves the loss (tokenize_sft already leaves it out).
        packs[-1]["completion_mask"] += [0] + ex["completion_mask"][1:]
        packs[-1]["position_ids"] += list(range(n))
        packs[-1]["_loc"].append(ex.get("_loc"))
    return packs


def collate_packed(examples: list[dict], pad_id: int = 0, one_row: bool = False) -> dict:
    """input_ids, position_ids, completion_mask (B, T) for packed rows, and deliberately NO attention_mask (pad_id is
    cosmetic: padding is its own loss-masked block).
    transformers 5.24 (masking_utils.find_packed_sequence_indices) turns restarting position_ids into a block-diagonal
    causal mask for sdpa/eager, but only when attention_mask is None AND there is no KV cache: call
    `model(input_ids=..., position_ids=..., use_cache=False)`; with the config default use_cache=True the model builds
    a cache and the documents silently attend to each other. Flash-attention reads the same position_ids as varlen
    boundaries, but only at batch size 1: pass one_row=True there (the batch's documents end to end in one row).
    sdpa/eager keep one_row=False, whose mask costs B*T^2 instead of (B*T)^2."""
    if one_row:
        examples = [{k: sum((e[k] for e in examples), []) for k in ("input_ids", "position_ids", "completion_mask")}]
    width = max(len(e["input_ids"]) for e in examples)
    # Padding positions restart at 0 too, so the padding is one more (loss-masked) document, never part of a real one.
    positions = [e["position_ids"] + list(range(width - len(e["position_ids"]))) for e in examples]
    return {
        "input_ids": pad_batch([e["input_ids"] for e in examples], pad_id),
        "position_ids": pad_batch(positions, 0),
        "completion_mask": pad_batch([e["completion_mask"] for e in examples], 0),
    }


def dataset_label(spec: str) -> str:
    """A short name for metric keys and files: openai/gsm8k:main -> gsm8k, builtin:math -> builtin_math,
    data/gsm8k/test.jsonl -> gsm8k (a split-named file takes its folder's name), prefs.jsonl -> prefs."""
    if spec.startswith("builtin:"):
        return spec.replace(":", "_")
    path = pathlib.Path(spec.split(":")[0])
    stem = path.stem if path.suffix in (".json", ".jsonl", ".parquet") else path.name
    return path.parent.name if stem in ("train", "test", "validation", "dev") and path.parent.name else stem


def micro_batch(
    examples: list, index: int, batch_size: int, seed: int, drop_last: bool = False, min_rows: int = 1
) -> list:
    """The index-th micro-batch of an endless, epoch-wise reshuffled stream: a pure function of (index, seed), so
    resuming at a step needs no saved iterator, and accumulation 1 x 4 sees the same rows as 4 x 1. drop_last: every
    batch is full (the epoch's remainder is skipped; fewer rows than batch_size repeat rows). min_rows: an epoch's
    last batch shorter than that is topped up with the epoch's first rows (KTO's mismatched pairs need two)."""
    per_epoch = max(1, len(examples) // batch_size) if drop_last else math.ceil(len(examples) / batch_size)
    epoch, pos = divmod(index, per_epoch)
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    if drop_last:
        return [examples[order[(pos * batch_size + i) % len(examples)]] for i in range(batch_size)]
    rows = order[pos * batch_size : (pos + 1) * batch_size]
    return [examples[i] for i in rows + order[: max(min_rows - len(rows), 0)]]


def training_steps(n_examples: int, args) -> tuple[int, int]:
    """(total optimizer steps, micro-batches per epoch): --max-steps if >= 0, else --num-train-epochs over the data
    with per_device_train_batch_size x gradient_accumulation_steps rows per step (the last batch may be short)."""
    per_epoch = math.ceil(n_examples / args.per_device_train_batch_size)
    if args.max_steps >= 0:
        return args.max_steps, per_epoch
    return math.ceil(per_epoch * args.num_train_epochs / args.gradient_accumulation_steps), per_epoch

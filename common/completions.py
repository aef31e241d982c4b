"""Rows with a completion to learn from, for the scripts that train on them: supervised {prompt, completion} |
{messages} | {text}; preference {prompt, chosen, rejected} (no prompt: chosen and rejected's shared start becomes it,
as TRL); binary {prompt, completion, label: bool} ({messages, label} split: the last, assistant, message becomes the
completion); ShareGPT's layout ({conversations: [{from, value}]}) through sharegpt_row. Validation, tokenization
with loss masks, batching, and the sequence log-probs of the preference losses. Truncation: supervised rows keep the
start (TRL's "keep_start"); preference/binary keep the END of the prompt (max_prompt_length, TRL's former "keep_end"),
then cut completions from the right to fit max_length. A row whose completion would be cut away is dropped, never
trained as a silent zero loss.
"""

import functools
import math
import pathlib
import warnings

import torch

from common import data
from common.data import Ids, _chat, _columns, _encode_texts, _first, _text_problem, bad_field, load_rows
from common.data import concat_prompt_completion, pad_batch
from common.distributed import rank_and_world
from common.errors import ArgsError, DataError
from common.model import masked_sum, sequence_logps


def load_splits(
    dataset: str,
    dataset_split: str,
    eval_split: str | None,
    kind: str,
    eval_steps: int = 0,
    convert=None,
    builtin=None,
    convert_flag: str | None = None,
    hub=None,
) -> tuple[list[dict], list[dict]]:
    """(dataset_split rows, eval_split rows or []) of `dataset`, validated as `kind`. A local file or a saved
    Dataset has no splits (load_rows reads all of it whatever the split): its eval_split may only be dataset_split.
    eval_steps > 0 needs an eval_split (TRL refuses eval_strategy="steps" without an eval_dataset).
    `convert_flag`: the caller's option that converts a known layout on load (validate_rows names it)."""
    if eval_steps and eval_split is None:
        raise ArgsError(f"--eval-steps {eval_steps}: there is nothing to evaluate without --eval-split")
    path = pathlib.Path(dataset)
    one = "one file" if path.is_file() else "a saved Dataset" if path.is_dir() else None
    has_splits = (path / "dataset_dict.json").is_file()
    if eval_split not in (None, dataset_split) and one and not has_splits:
        raise ArgsError(
            f"--eval-split {eval_split}: {dataset} is {one} with no splits (all of it is the training "
            f"data); leave --eval-split unset, or pass {dataset_split} to evaluate on the training rows"
        )
    rows = validate_rows(load_rows(dataset, dataset_split, convert, builtin, hub), kind, convert_flag)
    if eval_split is None:
        return rows, []
    return rows, validate_rows(load_rows(dataset, eval_split, convert, builtin, hub), kind, convert_flag)


def need(row: dict, field: str, kind: type) -> object:
    """row[field] when it is a `kind`; else a DataError naming the row and field."""
    if not isinstance(row.get(field), kind):
        bad_field(
            row,
            field,
            f"must be a {kind.__name__}, got {type(row[field]).__name__}"
            if field in row
            else f"missing (row has: {_columns(row)})",
        )
    return row[field]


def without(row: dict, *drop: str) -> dict:
    return {k: v for k, v in row.items() if k not in drop}  # extra columns (ids, answers, ...) pass through


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def _sharegpt_message(row: dict, field: str, turn: object) -> dict:
    if not isinstance(turn, dict) or turn.get("from") not in SHAREGPT_ROLES or not isinstance(turn.get("value"), str):
        bad_field(row, field, f"expected {{from: one of {sorted(SHAREGPT_ROLES)}, value: str}}, got {str(turn)[:80]}")
    return {"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]}


def sharegpt_row(row: dict) -> dict:
    """{conversations: [{from, value}]} -> {messages}; with chosen/rejected {from, value} turns it is a preference row
    whose prompt is the conversation. A `system` column becomes a leading system message (LLaMA-Factory's layout)."""
    messages = [_sharegpt_message(row, "conversations", t) for t in need(row, "conversations", list)]
    messages = ([{"role": "system", "content": row["system"]}] if row.get("system") else []) + messages
    if "chosen" not in row and "rejected" not in row:
        return without(row, "conversations", "system") | {"messages": messages}
    pair = {k: [_sharegpt_message(row, k, row.get(k))] for k in ("chosen", "rejected")}
    return without(row, "conversations", "system") | {"prompt": messages} | pair


def _extract_prompt(chosen, rejected):
    """TRL's implicit prompt: the longest shared start (messages, or characters) of chosen and rejected."""
    n = _common_prefix(chosen, rejected)
    if isinstance(chosen, str) and n > 0 and chosen[n - 1] == " ":
        n -= 1  # as TRL: the space before the answers stays with the answers
    return chosen[:n], chosen[n:], rejected[n:]


def _check_row(row: dict, kind: str) -> dict:
    # Normalise first: ShareGPT rows (LLaMA-Factory's layout, read without any --convert), implicit-prompt
    # preference rows and {messages, label} binary rows into TRL's form.
    if (
        kind in ("supervised", "preference")
        and "conversations" in row
        and not {"prompt", "messages", "text"} & row.keys()
    ):
        row = sharegpt_row(row)
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
            bad_field(row, side, f"{how} and the row has no 'prompt', {why}")
    if kind == "binary" and "messages" in row and "prompt" not in row and "completion" not in row:
        msgs = row["messages"]
        if not (
            isinstance(msgs, list) and msgs and isinstance(msgs[-1], dict) and msgs[-1].get("role") == "assistant"
        ):
            bad_field(row, "messages", "the last message must be an assistant turn (it becomes the completion)")
        row = without(row, "messages") | {"prompt": msgs[:-1], "completion": msgs[-1:]}
    # (field, may be empty); an SFT row uses whichever of its three layouts it has
    fields = {
        "preference": [("prompt", True), ("chosen", False), ("rejected", False)],
        "binary": [("prompt", True), ("completion", False)],
        "prompt": [("prompt", False)],
        "supervised": [("messages", False)]
        if "messages" in row
        else [("text", False)]
        if "text" in row
        else [("prompt", True), ("completion", False)],
    }[kind]
    for field, may_be_empty in fields:
        if field not in row:
            hint = "; supervised rows need {prompt, completion}, {messages} or {text}" if kind == "supervised" else ""
            bad_field(row, field, f"missing{hint} (row has: {_columns(row)})")
        # {messages} is a chat, {text} plain text (TRL's language modelling rows): only prompt/completion may be either
        only = {"messages": list, "text": str}.get(field)
        if only and not isinstance(row[field], only):
            what = "a list of {role, content} messages" if only is list else "a string"
            bad_field(row, field, f"must be {what}, got {type(row[field]).__name__}")
        problem = _text_problem(row[field], may_be_empty)
        if problem:
            bad_field(row, field, problem)
        first = row[fields[0][0]]
        if isinstance(row[field], list) != isinstance(first, list):  # apply_chat_template or plain text, not both
            bad_field(
                row,
                field,
                f"is a {type(row[field]).__name__} but '{fields[0][0]}' is a {type(first).__name__}: "
                "use strings for all fields or message lists for all",
            )
    if fields[0][0] == "messages":
        if not any(m["role"] == "assistant" and m["content"].strip() for m in row["messages"]):
            bad_field(row, "messages", "has no assistant turn with content, so there is nothing to learn")
        if row["messages"][0]["role"] == "assistant":
            bad_field(
                row, "messages", "starts with an assistant turn, which answers nothing (add the user turn before it)"
            )
    if kind == "binary" and type(row.get("label")) is not bool:  # 1, "true", None are not labels: say so, no guessing
        bad_field(
            row,
            "label",
            f"must be a JSON boolean (true/false), got {type(row['label']).__name__} {row['label']!r}"
            if "label" in row
            else "missing",
        )
    return row


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


def _pair_texts(tokenizer, prompt, completion, loc: str) -> list[tuple[str, bool]]:
    """The prompt's text and prompt + completion's, as _split reads their ids."""
    if isinstance(prompt, list):
        prompt_text, text = _chat(tokenizer, prompt, True), _chat(tokenizer, prompt + completion)
        _check_prefix(prompt_text, text, loc)
        return [(prompt_text, False), (text, False)]
    return [(prompt, True), (prompt + completion, True)]


def _split(tokenizer, prompt_ids: list[int], full: list[int], standard: bool) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) from the ids of _pair_texts; the completion ends with its end-of-turn
    (conversational) or EOS (standard)."""
    eos = tokenizer.eos_token_id
    # TRL appends the eos string to standard completions; we append its id (one token even if eos isn't special).
    if standard:
        full = full if full[-1:] == [eos] else full + [eos]
    # As TRL: the completion starts where the prompt's tokens and prompt+completion's first differ; that is right
    # after the prompt unless BPE merged tokens across the boundary (standard rows, e.g. "The sky is" + " blue").
    n = _common_prefix(prompt_ids, full)
    return prompt_ids[:n], _through_last(full[n:], eos)


def _messages_texts(tokenizer, messages: list[dict], loc: str) -> list[tuple[str, bool]]:
    """The whole chat, then for each assistant turn the chat before it (with the generation prompt) and through it;
    both must be prefixes of the whole render."""
    text = _chat(tokenizer, messages)
    texts = [(text, False)]
    for i in (i for i, m in enumerate(messages) if m["role"] == "assistant"):
        before, through = _chat(tokenizer, messages[:i], True), _chat(tokenizer, messages[: i + 1])
        _check_prefix(before, text, loc)
        _check_prefix(through, text, loc)
        texts += [(before, False), (through, False)]
    return texts


def _messages_mask(tokenizer, ids: list[list[int]]) -> list[int]:
    """A mask on each assistant turn's content + end-of-turn token, from the ids of _messages_texts: token positions
    via common prefixes, which stay right if BPE merges across a turn boundary."""
    full = ids[0]
    mask = [0] * len(full)
    for before, through in zip(ids[1::2], ids[2::2], strict=True):
        start = _common_prefix(before, full)
        turn = _through_last(full[start : _common_prefix(through, full)], tokenizer.eos_token_id)
        mask[start : start + len(turn)] = [1] * len(turn)
    return mask


def _texts(tokenizer, row: dict, kind: str) -> list[tuple[str, bool]]:
    """Every (text, add special tokens) that tokenizing a validated row of `kind` encodes, chat templates rendered
    (and their prefix property checked, naming the row): what TOKENIZE[kind] reads back as `ids`."""
    loc = row.get("_loc", "<row>")
    prompt = row.get("prompt")
    if kind == "prompt":
        return [(_chat(tokenizer, prompt, True), False) if isinstance(prompt, list) else (prompt, True)]
    if kind == "preference":
        chosen = _pair_texts(tokenizer, prompt, row["chosen"], loc)
        return chosen + _pair_texts(tokenizer, prompt, row["rejected"], loc)
    if kind == "supervised" and "messages" in row:
        return _messages_texts(tokenizer, row["messages"], loc)
    if kind == "supervised" and "text" in row:
        return [(row["text"], True)]
    return _pair_texts(tokenizer, prompt, row["completion"], loc)


def _fit(prompt_ids: list[int], completions: list[list[int]], max_length: int | None, max_prompt_length: int | None):
    """Keep the prompt's end (max_prompt_length), then cut completions from the right so each pair fits max_length;
    None when a completion would be left empty."""
    if max_prompt_length is not None and len(prompt_ids) > max_prompt_length:
        prompt_ids = prompt_ids[len(prompt_ids) - max_prompt_length :]
    if max_length is not None:
        completions = [c[: max(max_length - len(prompt_ids), 0)] for c in completions]
    return (prompt_ids, completions) if all(completions) else None


def tokenize_sft(
    tokenizer, row: dict, max_length: int | None, completion_only_loss: bool = True, ids: list | None = None
) -> dict | None:
    """{input_ids, completion_mask}: the mask is on the completion (prompt/completion rows) or on every assistant turn
    (messages rows), end-of-turn/EOS token included; all ones for {text} rows or completion_only_loss=False; never
    on token 0, which no token predicts.
    Right-truncated to max_length; None when no completion token survives (the caller drops the row).
    `ids`: the encodings of _texts(tokenizer, row, "supervised") when the caller encoded them (tokenize_dataset)."""
    eos = tokenizer.eos_token_id
    ids = _encode_texts(tokenizer, _texts(tokenizer, row, "supervised")) if ids is None else ids
    if "messages" in row:
        input_ids, mask = ids[0], _messages_mask(tokenizer, ids)
    elif "text" in row:  # plain language modelling: every token, closed by EOS as TRL does
        input_ids = ids[0] if ids[0][-1:] == [eos] else ids[0] + [eos]
        mask = [1] * len(input_ids)
    else:
        prompt_ids, completion_ids = _split(tokenizer, ids[0], ids[1], not isinstance(row["prompt"], list))
        input_ids, mask = prompt_ids + completion_ids, [0] * len(prompt_ids) + [1] * len(completion_ids)
    input_ids, mask = input_ids[:max_length], mask[:max_length]  # [:None] keeps everything
    if not any(mask[1:]):
        return None  # the completion was cut away: this row would add a silent zero to the loss
    # Token 0 has no context, so it is never a target (the shift drops it): out of the mask, or the step's token count
    # (the loss's denominator) would count it, once per row padded but not packed (transformers counts labels[1:]).
    mask = mask if completion_only_loss else [1] * len(input_ids)
    return {"input_ids": Ids("i", input_ids), "completion_mask": Ids("b", [0] + mask[1:])}


def tokenize_preference(
    tokenizer, row: dict, max_length: int | None, max_prompt_length: int | None = None, ids: list | None = None
) -> dict | None:
    """{prompt_ids, chosen_ids, rejected_ids}; completions end with the end-of-turn/EOS token. Truncation: _fit.
    `ids`: as tokenize_sft's."""
    ids = _encode_texts(tokenizer, _texts(tokenizer, row, "preference")) if ids is None else ids
    standard = not isinstance(row["prompt"], list)
    prompt_ids, chosen = _split(tokenizer, ids[0], ids[1], standard)
    other_ids, rejected = _split(tokenizer, ids[2], ids[3], standard)
    # The two prompts differ only if BPE merged differently into each answer: share the common part, as TRL does.
    n = _common_prefix(prompt_ids, other_ids)
    fitted = _fit(prompt_ids[:n], [prompt_ids[n:] + chosen, other_ids[n:] + rejected], max_length, max_prompt_length)
    return fitted and {
        "prompt_ids": Ids("i", fitted[0]),
        "chosen_ids": Ids("i", fitted[1][0]),
        "rejected_ids": Ids("i", fitted[1][1]),
    }


def tokenize_binary(
    tokenizer, row: dict, max_length: int | None, max_prompt_length: int | None = None, ids: list | None = None
) -> dict | None:
    """{prompt_ids, completion_ids, label}; truncated like tokenize_preference. `ids`: as tokenize_sft's."""
    ids = _encode_texts(tokenizer, _texts(tokenizer, row, "binary")) if ids is None else ids
    prompt_ids, completion_ids = _split(tokenizer, ids[0], ids[1], not isinstance(row["prompt"], list))
    fitted = _fit(prompt_ids, [completion_ids], max_length, max_prompt_length)
    return fitted and {
        "prompt_ids": Ids("i", fitted[0]),
        "completion_ids": Ids("i", fitted[1][0]),
        "label": row["label"],
    }


def collate_sft(examples: list[dict], pad_id: int) -> dict:
    """Right-padded input_ids, attention_mask, completion_mask (B, T); masks come from lengths, never from pad ids
    (with pad == eos, a pad-derived mask would drop the EOS the model must learn to emit)."""
    ids = [e["input_ids"] for e in examples]
    return {
        "input_ids": pad_batch(ids, pad_id),
        "attention_mask": pad_batch([[1] * len(x) for x in ids], 0),
        "completion_mask": pad_batch([e["completion_mask"] for e in examples], 0),
    }


def concat_pairs(examples: list[dict], pad_id: int, device) -> dict:
    """[chosen rows; rejected rows] (2B, T), right-padded: one forward scores both halves (TRL's concatenated
    batch)."""
    prompts = [e["prompt_ids"] for e in examples]
    completions = [e["chosen_ids"] for e in examples] + [e["rejected_ids"] for e in examples]
    batch = concat_prompt_completion(prompts + prompts, completions, pad_id)
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}  # built here: copied without a wait


def training_steps(
    n_examples: int, batch_size: int, gradient_accumulation_steps: int, max_steps: int, num_train_epochs: float
) -> tuple[int, int]:
    """(total optimizer steps, micro-batches per epoch): max_steps if >= 0, else num_train_epochs over the data with
    batch_size x gradient_accumulation_steps rows per step (an epoch's last batch may be short)."""
    per_epoch = math.ceil(n_examples / batch_size)
    if max_steps >= 0:
        return max_steps, per_epoch
    return math.ceil(per_epoch * num_train_epochs / gradient_accumulation_steps), per_epoch


def rank_micro_batches(step: int, gradient_accumulation_steps: int) -> list[int]:
    """The global micro-batch indices this rank computes at `step`: one process with accumulation ga x N would
    take step * ga * N ... (step + 1) * ga * N - 1; rank r takes every N-th of them, starting at r."""
    rank, world = rank_and_world()
    first = step * gradient_accumulation_steps * world
    return [first + i * world + rank for i in range(gradient_accumulation_steps)]


def completion_logps(model, batch: dict):
    """Summed completion log-probs per row (B,) and the per-token ones (B, T), 0 off the completion: the sequence
    score of the preference losses (TRL's concatenated_forward) from a concat_prompt_completion batch."""
    per_token_logps = sequence_logps(model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
    return masked_sum(per_token_logps, batch["completion_mask"], dim=1), per_token_logps


def disable_dropout(model) -> None:
    """p = 0 on every nn.Dropout, a loaded adapter's LoRA dropout included (TRL's disable_dropout=True), and on the
    float rates modules pass to functional dropout (Llama/Qwen2's attention_dropout from config.json, which no
    nn.Dropout holds): otherwise the policy (train mode) and the reference (eval mode) differ at step 0."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):  # e.g. attention_dropout, dropout, dropout_p, attn_drop
            if isinstance(value, float) and ("dropout" in name or name.endswith("_drop")):
                setattr(module, name, 0.0)


def validate_rows(rows: list[dict], kind: str, convert_flag: str | None = None) -> list[dict]:
    """common.data.validate_rows for "supervised" | "preference" | "binary" | "prompt" rows, plus a warning for
    preference rows with chosen == rejected and for binary rows of one label."""
    if kind not in ("supervised", "preference", "binary", "prompt"):
        raise ValueError(f"unknown data kind {kind!r}")
    rows = data.validate_rows(rows, kind, convert_flag, functools.partial(_check_row, kind=kind))
    same = [r.get("_loc") for r in rows if kind == "preference" and r["chosen"] == r["rejected"]]
    if same:
        warnings.warn(
            f"{len(same)} of {len(rows)} preference rows have chosen == rejected ({_first(same)}). They are "
            "kept, but their pairwise loss term is constant (ln 2 for sigmoid DPO) with zero gradient, so "
            "they only dilute each batch: remove them unless that is intended."
        )
    labels = {r["label"] for r in rows} if kind == "binary" else set()
    if len(labels) == 1:
        label = labels.pop()
        side = "desirable" if label else "undesirable"
        warnings.warn(
            f"all {len(rows)} binary rows are labelled {label}: KTO needs desirable (true) and undesirable "
            f"(false) examples. Training still runs, but only the {side} half of the loss has signal."
        )
    return rows


TOKENIZE = dict(
    supervised=tokenize_sft, preference=tokenize_preference, binary=tokenize_binary, prompt=data.tokenize_prompt
)


def tokenize_dataset(tokenizer, rows: list[dict], kind: str, max_length: int | None, **kw) -> list[dict]:
    """common.data.tokenize_dataset with TOKENIZE[kind] and its texts."""
    texts = functools.partial(_texts, kind=kind)
    return data.tokenize_dataset(tokenizer, rows, kind, max_length, texts, TOKENIZE[kind], **kw)

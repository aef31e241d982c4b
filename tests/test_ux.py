"""What a user watching, exporting and sharing a run sees: log-file output, merged exports, shareable adapters."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_log_file_run_prints_one_line_per_step_and_no_loading_bars(tiny_model_dir, tmp_path):
    """stderr to a file (not a terminal): one plain line per logged step, no carriage-return bar frames, and no
    transformers FutureWarning from PEFT wrapping the model (gradient checkpointing on, the path that used to warn)."""
    log = tmp_path / "run.log"
    with open(log, "w") as err:
        done = subprocess.run(
            [sys.executable, "sft.py", "--model", tiny_model_dir, "--dataset", "builtin:math_sft", "--max-steps", "2",
             "--max-length", "256", "--gradient-checkpointing", "--output-dir", str(tmp_path / "runs")],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"},
            timeout=300)
    text = log.read_text()
    assert done.returncode == 0, text[-2000:]
    steps = re.findall(r"^step (\d+)/2  loss [-\d.e+]+  learning_rate [-\d.e+]+  [\d.]+ s/step  ETA \d+m\d\ds$",
                       text, re.MULTILINE)
    assert steps == ["1", "2"], text[-2000:]
    assert "\r" not in text, text[:2000]
    assert "is_gradient_checkpointing" not in text and "FutureWarning" not in text, text[-2000:]


# ---- evals: results named by the dataset used, one-line errors, report plots
def test_dataset_tag_names_the_dataset_used():
    from evals.common_eval import dataset_tag

    assert dataset_tag("builtin:math") == "builtin-math"
    assert dataset_tag("openai/gsm8k:main") == "gsm8k" and dataset_tag("google/IFEval") == "IFEval"
    assert dataset_tag("../shared/data/gsm8k/test.jsonl") == "gsm8k"  # a split-named file: its folder
    assert dataset_tag("my data/hard_math.jsonl") == "hard_math" and dataset_tag("test.jsonl") == "test"


def test_gsm8k_eval_on_builtin_math_is_not_labelled_gsm8k(tiny_model_dir, tmp_path, capsys):
    import evals.gsm8k as gsm8k

    out = gsm8k.main(gsm8k.Args(model=tiny_model_dir, dataset="builtin:math", limit=2, max_new_tokens=3,
                                output_dir=str(tmp_path), label="tiny"))
    assert out["task"] == "builtin-math" and sorted(os.listdir(tmp_path)) == ["tiny__builtin-math.json",
                                                                               "tiny__builtin-math.jsonl"]
    printed = capsys.readouterr().out
    assert printed.startswith("builtin-math: accuracy") and "gsm8k" not in printed.replace(str(tmp_path), "")


EVAL_CLIS = {
    "evals.report": ["--runs", "no_such_run", "--evals", "no_such.json"],
    "evals.gsm8k": ["--dataset", "no_such.jsonl"],
    "evals.ifeval": ["--dataset", "no_such.jsonl"],
}


def test_eval_entry_points_give_one_line_errors_for_missing_inputs(tmp_path):
    for module, argv in EVAL_CLIS.items():
        done = subprocess.run([sys.executable, "-m", module, *argv], cwd=tmp_path, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}, timeout=300, check=False)
        lines = [line for line in done.stderr.splitlines() if not line.startswith("Failed to load CPU gemm_4bit")]
        assert done.returncode == 1 and len(lines) == 1, (module, done.stderr[-2000:])
        assert lines[0].startswith(f"{module}: error: ") and "no_such" in lines[0], lines
    assert "no_such_run/metrics.jsonl, no_such.json" in lines[0] or module != "evals.report"


def _history(n, start, noise, seed):
    import random

    rng = random.Random(seed)
    return [{"step": s, "loss": start / s + rng.uniform(-noise, noise), "reward": s / n + rng.uniform(-0.3, 0.3)}
            for s in range(1, n + 1)]


def test_report_plots_one_panel_per_run_kind_with_ema_and_integer_steps(tmp_path):
    from evals.report import Args, curve_figure, ema, main

    assert ema([1.0, 1.0, 1.0], 0.6) == pytest.approx([1.0, 1.0, 1.0])  # debiased: a constant stays constant
    assert ema([0.0, 1.0], 0.5) == pytest.approx([0.0, 0.5 / 0.75])  # (0.5*0 + 0.5*1) / (1 - 0.25)
    histories = {"sft__m__1__a": _history(8, 2.0, 0.05, 0), "dpo__m__1__a": _history(8, 0.7, 0.02, 1),
                 "grpo__m__1__a": _history(20, 0.1, 0.05, 2), "grpo__m__2__b": _history(20, 0.1, 0.05, 3)}
    fig = curve_figure(histories, "loss", 0.6)
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == ["sft: loss", "dpo: loss", "grpo: loss"]  # no shared loss axis
    assert [len(ax.lines) for ax in panels] == [2, 2, 4]  # raw + EMA per run
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

"""What a user watching, exporting and sharing a run sees: log-file output, merged exports, shareable adapters."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_log_file_run_prints_one_line_per_step_and_no_loading_bars(tiny_model_dir, tmp_path):
    """stderr to a file (not a terminal): one plain line per logged step, no carriage-return bar frames, and no
    transformers FutureWarning from PEFT wrapping the model (gradient checkpointing on, the path that used to warn)."""
    log = tmp_path / "run.log"
    with open(log, "w") as err:
        done = subprocess.run(
            [sys.executable, "sft.py", "--model", tiny_model_dir, "--dataset", "builtin:math_sft", "--max-steps", "2",
             "--max-length", "256", "--gradient-checkpointing", "--output-dir", str(tmp_path / "runs")],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
            timeout=300)
    text = log.read_text()
    assert done.returncode == 0, text[-2000:]
    steps = re.findall(r"^step (\d+)/2  loss [-\d.e+]+  learning_rate [-\d.e+]+  [\d.]+ s/step  ETA \d+m\d\ds$",
                       text, re.M)
    assert steps == ["1", "2"], text[-2000:]
    assert "\r" not in text, text[:2000]
    assert "is_gradient_checkpointing" not in text and "FutureWarning" not in text, text[-2000:]

"""common/hub.py and one_line_errors: offline users get one line in seconds, not the hub client's retries and a
traceback. The hub is made unreachable the same way everywhere (CI is online): HF_ENDPOINT points at a closed local
port and HF_HOME at an empty folder, so nothing is cached."""

import os
import shutil
import subprocess
import sys
import time

import pytest

import common.hub
from common.hub import HubUnavailable, check_hub
from tests.conftest import ROOT


def offline_env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_DATASETS_CACHE")}
    return {**env, "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": "http://127.0.0.1:9", "OMP_NUM_THREADS": "1"}


def run_grpo(tmp_path, *argv) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    cmd = [
        sys.executable,
        "grpo.py",
        "--preset",
        "demo",
        "--max-steps",
        "1",
        "--output-dir",
        str(tmp_path / "runs"),
        *argv,
    ]
    res = subprocess.run(cmd, cwd=ROOT, env=offline_env(tmp_path), capture_output=True, text=True, timeout=300)
    return res, time.perf_counter() - start


@pytest.mark.parametrize(
    ("argv", "named", "hint"),
    [
        (["--model", "onlyone-test/no-model"], "model 'onlyone-test/no-model'", "--model /path/to/folder"),
        (["--dataset", "onlyone-test/no-set:main"], "dataset 'onlyone-test/no-set'", "--dataset file.jsonl"),
    ],
)
def test_uncached_hub_model_or_dataset_offline_is_one_line_in_seconds(tmp_path, tiny_model_dir, argv, named, hint):
    argv = ["--model", tiny_model_dir, *argv] if argv[0] == "--dataset" else argv  # the dataset fails first
    res, elapsed = run_grpo(tmp_path, *argv)
    # Our one line is the last; lines before it may come from installed packages' import-time warnings.
    ours = [line for line in res.stderr.splitlines() if line.startswith("grpo.py: error:")]
    assert res.returncode == 1 and ours == res.stderr.strip().splitlines()[-1:], res.stderr[-2000:]
    assert ours[0].startswith("grpo.py: error: cannot fetch " + named), ours
    assert "http://127.0.0.1:9" in ours[0] and hint in ours[0] and "Traceback" not in res.stderr
    # The hub client alone retries for 35-55 s before failing; this is the probe's 3 s at most plus startup.
    assert elapsed < 30, f"took {elapsed:.0f} s"


def test_cached_model_loads_offline_without_retries(tmp_path, tiny_model_dir):
    """A model in the hub cache loads with the hub unreachable, from the cache alone (no 'Retrying' HEAD requests)."""
    repo = tmp_path / "hf" / "hub" / "models--onlyone-test--tiny"
    shutil.copytree(tiny_model_dir, repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    code = "from common.model import load_model; m, t = load_model('onlyone-test/tiny'); print(type(m).__name__)"
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=offline_env(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0 and res.stdout.strip() == "Qwen2ForCausalLM", res.stderr[-2000:]
    assert "Retrying" not in res.stderr and "127.0.0.1" not in res.stderr, res.stderr[-2000:]


def test_offline_mode_and_paths(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    common.hub.hub_unreachable.cache_clear()
    try:
        with pytest.raises(HubUnavailable, match=r"model 'org/x': it is not in the local cache and HF_HUB_OFFLINE"):
            check_hub("org/x", "model")
        (tmp_path / "models--org--x" / "snapshots" / "abc").mkdir(parents=True)
        (tmp_path / "models--org--x" / "snapshots" / "abc" / "config.json").write_text("{}")
        (tmp_path / "models--org--x" / "refs").mkdir()
        (tmp_path / "models--org--x" / "refs" / "main").write_text("abc")
        assert check_hub("org/x", "model") is True  # cached: load it with local_files_only
    finally:
        common.hub.hub_unreachable.cache_clear()
    for path in ("./my-model", "/data/models/qwen", "runs/x/final"):  # not there: never looked up on the hub
        with pytest.raises(FileNotFoundError, match="no such local"):
            check_hub(path, "model")

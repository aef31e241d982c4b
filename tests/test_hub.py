"""harness/hub.py and one_line_errors: offline users get one line in seconds, not the hub client's retries and a
traceback. The hub is made unreachable the same way everywhere (CI is online): HF_ENDPOINT points at a closed local
port and HF_HOME at an empty folder, so nothing is cached."""

import os
import shutil
import socket
import subprocess
import sys
import threading

import pytest

import harness.hub
from harness.errors import HubUnavailable
from harness.hub import check_hub, locate_model
from tests.conftest import ROOT


def offline_env(tmp_path, endpoint: str = "http://127.0.0.1:9") -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_DATASETS_CACHE")}
    return {**env, "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": endpoint, "OMP_NUM_THREADS": "1"}


@pytest.fixture
def dead_hub():
    """A local endpoint that accepts each connection and closes it unanswered, counting them: (url, count())."""
    server = socket.create_server(("127.0.0.1", 0))
    count = [0]

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # the server socket was closed: the test is over
                return
            count[0] += 1
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}", lambda: count[0]
    server.close()


def run_grpo(tmp_path, *argv, endpoint: str) -> subprocess.CompletedProcess:
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
    return subprocess.run(
        cmd, cwd=ROOT, env=offline_env(tmp_path, endpoint), capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    ("argv", "named", "hint"),
    [
        (["--model", "onlyone-test/no-model"], "model 'onlyone-test/no-model'", "--model /path/to/folder"),
        (
            ["--dataset", "onlyone-test/no-set:main"],
            "--dataset onlyone-test/no-set:main: not in",
            "--dataset file.jsonl",
        ),
    ],
)
def test_uncached_hub_model_or_dataset_offline_is_one_line_without_retries(tmp_path, tiny_model_dir, argv, named, hint,
                                                                           dead_hub):  # fmt: skip
    url, connections = dead_hub
    argv = ["--model", tiny_model_dir, *argv] if argv[0] == "--dataset" else argv  # the dataset fails first
    res = run_grpo(tmp_path, *argv, endpoint=url)
    # Our one line is the last; lines before it may come from installed packages' import-time warnings.
    ours = [line for line in res.stderr.splitlines() if line.startswith("grpo.py: error:")]
    assert res.returncode == 1 and ours == res.stderr.strip().splitlines()[-1:], res.stderr[-2000:]
    # a missing dataset names every missing input at once; a model alone is found by the plan, after the rows
    first = "cannot fetch " if named.startswith("model") else "1 input(s) missing"
    assert ours[0].startswith("grpo.py: error: " + first) and named in ours[0], ours
    assert url in ours[0] and hint in ours[0] and "Traceback" not in res.stderr
    # One connection: the probe's single HEAD. The hub client alone retries (35-55 s with no DNS) before it fails.
    assert connections() == 1, connections()


def test_the_headline_command_offline_names_every_missing_input_at_once(tmp_path):
    """`HF_HUB_OFFLINE=1 python grpo.py --model Qwen/Qwen2.5-1.5B --group-size 4` with nothing cached: the model, the
    preset's dataset and its eval set, each with its flag, in one line, before any model or data loads."""
    env = offline_env(tmp_path) | {"HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "grpo.py", "--model", "Qwen/Qwen2.5-1.5B", "--group-size", "4"]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 1 and last.startswith("grpo.py: error: 3 input(s) missing (HF_HUB_OFFLINE is set)"), last
    for missing in ("--model Qwen/Qwen2.5-1.5B", "--dataset openai/gsm8k:main", "--eval-dataset openai/gsm8k:main"):
        assert f"{missing}: not in the local cache" in last, last
    assert "Traceback" not in res.stderr


def test_the_gsm8k_eval_offline_names_the_built_in_set_that_works_without_the_hub(tmp_path):
    """`python -m evals.gsm8k --limit 8` with the hub out of reach suggested only `--dataset file.jsonl` (issue 52):
    its one line also names `--dataset builtin:math`, the set that runs offline on the embedded model."""
    env = offline_env(tmp_path) | {"HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "evals.gsm8k", "--limit", "8", "--output-dir", str(tmp_path / "out")]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 1 and last.startswith("evals.gsm8k: error: cannot fetch dataset 'openai/gsm8k'"), last
    assert "--dataset file.jsonl" in last and "--dataset builtin:math" in last and "Traceback" not in res.stderr


def test_cached_model_loads_offline_without_retries(tmp_path, tiny_model_dir):
    """A model in the hub cache loads with the hub unreachable, from the cache alone (no 'Retrying' HEAD requests):
    locate_model gives its cached folder and load_model loads from there."""
    repo = tmp_path / "hf" / "hub" / "models--onlyone-test--tiny"
    shutil.copytree(tiny_model_dir, repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    code = (
        "from common.model import load_model; from harness.hub import locate_model; name = 'onlyone-test/tiny'; "
        "m, t = load_model(name, path=locate_model(name)); print(type(m).__name__, m.name_or_path)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=offline_env(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0 and res.stdout.strip() == "Qwen2ForCausalLM onlyone-test/tiny", res.stderr[-2000:]
    assert "Retrying" not in res.stderr and "127.0.0.1" not in res.stderr, res.stderr[-2000:]


def test_offline_mode_and_paths(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    harness.hub.hub_unreachable.cache_clear()
    try:
        with pytest.raises(HubUnavailable, match=r"model 'org/x': it is not in the local cache and HF_HUB_OFFLINE"):
            check_hub("org/x", "model")
        with pytest.raises(HubUnavailable, match=r"model 'org/x': it is not in the local cache"):
            locate_model("org/x")
        (tmp_path / "models--org--x" / "snapshots" / "abc").mkdir(parents=True)
        (tmp_path / "models--org--x" / "snapshots" / "abc" / "config.json").write_text("{}")
        (tmp_path / "models--org--x" / "refs").mkdir()
        (tmp_path / "models--org--x" / "refs" / "main").write_text("abc")
        assert check_hub("org/x", "model") is True  # cached: load it with local_files_only
        assert locate_model("org/x") == str(tmp_path / "models--org--x" / "snapshots" / "abc")  # no request made
    finally:
        harness.hub.hub_unreachable.cache_clear()
    for path in ("./my-model", "/data/models/qwen", "runs/x/final"):  # not there: never looked up on the hub
        with pytest.raises(FileNotFoundError, match="no such local"):
            check_hub(path, "model")

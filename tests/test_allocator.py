"""common.run.preload_jemalloc: a CPU-only Linux CLI re-runs itself once under jemalloc, unless told not to."""

import os
import subprocess
import sys

import pytest

import common.run
from common.run import JEMALLOC, preload_jemalloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def execs(monkeypatch, tmp_path):
    """Records os.execve instead of replacing the test process; a fake library file; no CUDA; a clean env."""
    calls = []
    monkeypatch.setattr(common.run.os, "execve", lambda *a: calls.append(a))
    monkeypatch.setattr(common.run.torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("ONLYONE_MALLOC", raising=False)
    lib = tmp_path / "libjemalloc.so.2"
    lib.write_bytes(b"")
    return calls, str(lib)


def test_reexecs_with_the_library_preloaded(execs, capsys):
    calls, lib = execs
    preload_jemalloc(lib)
    assert len(calls) == 1
    exe, argv, env = calls[0]
    assert exe == sys.executable and argv == [sys.executable, *sys.orig_argv[1:]]
    assert env["LD_PRELOAD"] == lib
    assert "using jemalloc" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["missing library", "opt-out", "already preloaded", "cuda"])
def test_leaves_the_process_alone(execs, monkeypatch, case):
    calls, lib = execs
    if case == "missing library":
        lib += ".absent"
    elif case == "opt-out":
        monkeypatch.setenv("ONLYONE_MALLOC", "system")
    elif case == "already preloaded":
        monkeypatch.setenv("LD_PRELOAD", "/some/other/lib.so")
    else:
        monkeypatch.setattr(common.run.torch.cuda, "is_available", lambda: True)
    preload_jemalloc(lib)
    assert calls == []


@pytest.mark.skipif(not os.path.exists(JEMALLOC) or not sys.platform.startswith("linux"), reason="no libjemalloc2")
@pytest.mark.parametrize("opt_out", [False, True])
def test_a_cli_runs_under_jemalloc_once(opt_out):
    """A real process: one_line_errors (every script's __main__) maps jemalloc in, and runs the body only once."""
    maps = "print('jemalloc' in open('/proc/self/maps').read())"
    code = f"from common.run import one_line_errors\nwith one_line_errors():\n    {maps}"
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "ONLYONE_MALLOC")}
    env |= {"ONLYONE_MALLOC": "system"} if opt_out else {}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(not opt_out)]
    assert ("using jemalloc" in out.stderr) is not opt_out

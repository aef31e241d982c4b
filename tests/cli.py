"""`run(cmd, ...)`: subprocess.run(cmd, capture_output=True, text=True, ...) for `python <script>.py ...` and
`python -m <module> ...`, run in a child forked from a process that has already imported torch, transformers, peft
and tyro (each fresh interpreter spends seconds of CPU on those imports; the suite runs dozens of these commands).

The child is what the command would be: the script runs as __main__ (runpy) with its argv, working directory,
environment and sys.path[0] (the script's folder, or the working directory for -m), its stdout and stderr captured,
its exit code Python's own (SystemExit, 1 after a traceback). None of this project's modules is imported before the
fork, so each is imported fresh under the command's environment. A command whose environment differs from the
forking process's in anything a library may read at import (HF_HUB_OFFLINE, HF_HOME, ...) runs as a real subprocess
instead, as does any other command; tests of what a fresh interpreter imports, of signals or of memory run real
subprocesses themselves."""

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

# Read by our own code or at run time only, never at a library's import: a command may differ from the server in these.
RUN_TIME_KEYS = ("PYTEST_CURRENT_TEST", "PYTHONPATH", "COLUMNS", "TOKENIZERS_PARALLELISM")
RUN_TIME_PREFIXES = ("ONLYONE_", "PYTEST_XDIST_")

SERVER = r"""
import atexit, json, os, runpy, sys, threading, traceback
requests, replies = os.fdopen(os.dup(0), "r"), os.fdopen(os.dup(1), "w")
ours = {p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 0)
os.dup2(null, 1)  # the protocol has its own descriptors; nothing else may write into it
os.close(null)
import torch, transformers, transformers.modeling_utils, transformers.trainer_utils, peft, tyro, safetensors.torch
replies.write("ready\n")
replies.flush()
for line in requests:
    req = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        requests.close()
        replies.close()
        os.setpgid(0, 0)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        out = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        err = os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [p for p in sys.path if p not in ours]  # this server's own PYTHONPATH, if it had one
        args = req["args"]
        if args[0] == "-m":
            sys.path[0:1] = [os.getcwd(), *extra]
            sys.argv = [args[1], *args[2:]]
            run = lambda: runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.path[0:1] = [os.path.dirname(os.path.abspath(args[0])), *extra]
            sys.argv = list(args)
            run = lambda: runpy.run_path(args[0], run_name="__main__")
        code = 0
        try:
            run()
        except SystemExit as stop:
            code = stop.code
        except BaseException:
            traceback.print_exc()
            code = 1
        # Python's own exit, less tearing down the imported libraries' modules one by one (seconds, and nothing of
        # the command's): its atexit functions, its non-daemon threads waited for, the streams flushed.
        threading._shutdown()
        atexit._run_exitfuncs()
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)
    replies.write(f"{pid}\n")
    replies.flush()
    status = os.waitpid(pid, 0)[1]
    replies.write(f"{os.waitstatus_to_exitcode(status)}\n")
    replies.flush()
"""

_server: dict = {}


def _start(env: dict) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    atexit.register(proc.kill)
    proc.pending = b""  # what has been read of its replies and not yet used
    if _reply(proc, None) != "ready":
        raise RuntimeError(f"tests/cli.py: the forking server did not start (exit {proc.wait()})")
    return proc


def _reply(server: subprocess.Popen, deadline: float | None) -> str | None:
    """The server's next reply line, or None at the deadline (read from the descriptor itself, so that select sees
    every byte not yet used)."""
    while b"\n" not in server.pending:
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not select.select([server.stdout], [], [], wait)[0]:
            return None
        chunk = os.read(server.stdout.fileno(), 4096)
        if not chunk:
            raise RuntimeError(f"tests/cli.py: the forking server ended (exit {server.wait()})")
        server.pending += chunk
    line, server.pending = server.pending.split(b"\n", 1)
    return line.decode()


def forkable(cmd: list, env: dict) -> bool:
    """A `python <file>.py ...` or `python -m <module> ...` command whose environment a forked child can take."""
    if len(cmd) < 2 or cmd[0] != sys.executable or cmd[1].startswith("-") and cmd[1] != "-m":
        return False
    if cmd[1] != "-m" and not str(cmd[1]).endswith(".py"):
        return False
    base = _base_env()
    differ = {k for k in base.keys() | env.keys() if base.get(k) != env.get(k)}
    return all(k in RUN_TIME_KEYS or k.startswith(RUN_TIME_PREFIXES) for k in differ)


def _base_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def run(
    cmd: list, *, cwd=None, env: dict | None = None, timeout: float | None = None, check=False, **kw
) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=check), forked
    when it can be (the module's docstring); after a timeout the command and what it started are killed and
    subprocess.TimeoutExpired raised, as subprocess.run does."""
    if kw != {"capture_output": True, "text": True}:
        raise ValueError(f"tests/cli.py runs a command as subprocess.run(capture_output=True, text=True), not {kw}")
    done = _run([str(c) for c in cmd], cwd, env, timeout)
    if check:
        done.check_returncode()
    return done


def _run(cmd: list, cwd, env: dict | None, timeout: float | None) -> subprocess.CompletedProcess:
    env = dict(os.environ if env is None else env)
    if not forkable(cmd, env):
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    server = _server.get("proc")
    if server is None or server.poll() is not None:
        server = _server["proc"] = _start(_base_env())
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        request = dict(args=cmd[1:], cwd=os.path.abspath(cwd or os.getcwd()), env=env, stdout=out, stderr=err)
        server.stdin.write((json.dumps(request) + "\n").encode())
        server.stdin.flush()
        pid = int(_reply(server, None))
        code = _reply(server, None if timeout is None else time.monotonic() + timeout)
        timed_out = code is None
        if timed_out:
            try:
                os.killpg(pid, signal.SIGKILL)  # the command and anything it started, as a timeout leaves nothing
            except ProcessLookupError:
                pass  # it ended at the deadline: its exit code is the next reply all the same
            code = _reply(server, None)
        with open(out) as f:  # universal newlines, as subprocess.run's text mode
            stdout = f.read()
        with open(err) as f:
            stderr = f.read()
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(cmd, int(code), stdout, stderr)

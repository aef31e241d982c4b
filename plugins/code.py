"""The code reward: a completion's code run against its row's tests in a sandbox (`code_reward`, registered by the
scripts under the name `code`), and the sandbox itself (`run_python`): untrusted Python in, its stdout out, judged
by plugins/code_judge.py in a process of its own under a CPU budget. The sandbox is chosen once, checked at first use
(a known-good and a known-bad solution must score 1 and 0) and printed once:
- bubblewrap (`apt-get install bubblewrap`) where it works: --unshare-all (no network; own PIDs, /proc, IPC, UTS),
  --die-with-parent --new-session --clearenv --cap-drop ALL, uid nobody in a user namespace (root's outside, if
  root: hence) a read-only root with only /usr and Python's prefix, a private 64 MiB tmpfs as /tmp, cwd and HOME,
  a read-only /dev with a 64 MiB /dev/shm;
- else (or if ONLYONE_SANDBOX=fallback) _BOOT's: new mount, PID, network, IPC, UTS (+ user, if not root)
  namespaces, a fresh /proc, private tmpfs /tmp /var/tmp /dev/shm /run/lock, every other top directory but the
  system's programs and libraries (/usr, /lib...) and Python's hidden, a uid of its own (if root: _UIDS), no
  capabilities, an empty bounding set, no_new_privs; what the kernel refuses is warned about.
Both: `python -I -S` (stdlib only), env PATH LANG HOME TMPDIR only, rlimits, pids and memory cgroups as root
(RLIMIT_NPROC does not bind root, RLIMIT_AS binds each process alone), a wall-clock timeout, then SIGKILL to all
it started."""

import ast
import concurrent.futures
import contextlib
import functools
import json
import math
import os
import pathlib
import re
import resource
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings

from common.errors import RewardError
from common.rewards import text_of
from plugins.code_judge import MATH, PURE, holds, judge

# In the sandbox, before the solution: the fallback's isolation, rlimits, the solution as __main__, then its
# `queries` (run_code_tests), each value written as a line "\x1e<i> <json>" (encode: builtin types, tagged where
# JSON has none). Our own messages go to cfg["messages"], a descriptor closed before the solution runs: it cannot
# forge them.
_BOOT = r"""
import ctypes
import json
import os
import resource
import runpy
import signal
import sys

cfg = json.load(open("cfg.json"))
libc = ctypes.CDLL(None, use_errno=True)
src = open("solution.py").read()
messages = cfg["messages"]


def check(failed, what):  # True if the step worked; a refused one is reported to run_python
    if failed:
        os.write(messages, f"{what}: {os.strerror(ctypes.get_errno())}\n".encode())
    return not failed


if cfg["fallback"]:
    uid = os.getuid()
    gid = os.getgid()
    # mount, PID, network, IPC, UTS (+ user, to mount, if not root) namespaces
    in_namespaces = check(libc.unshare(0x6C020000 | (0x10000000 if uid else 0)), "unshare")
    if in_namespaces and uid:  # keep our uid in the new user namespace
        for name, text in (("uid_map", f"{uid} {uid} 1"), ("setgroups", "deny"), ("gid_map", f"{gid} {gid} 1")):
            open(f"/proc/self/{name}", "w").write(text)
    pid = os.fork()
    if pid:  # we wait; the child is PID 1: when it dies the kernel kills all it left
        os.close(messages)  # else the solution could reach it through our /proc/<pid>/fd (where no PID namespace)
        signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, 9))  # our timeout: kill PID 1, reap it here
        os._exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) & 255)
    libc.prctl(1, 9)  # PR_SET_PDEATHSIG SIGKILL: if the waiter is killed, so is PID 1
    # private: our own mounts (MS_REC | MS_PRIVATE), and every world-writable directory under a fresh tmpfs
    private = in_namespaces and check(libc.mount(b"none", b"/", None, 0x44000, None), "private mounts")
    if private and libc.mount(b"proc", b"/proc", b"proc", 14, None):  # nosuid nodev noexec; else hide the host's
        check(libc.mount(b"tmpfs", b"/proc", b"tmpfs", 1, b"size=4k"), "mount /proc")
    if private:
        for d in (b"/tmp", b"/var/tmp", b"/dev/shm", b"/run/lock"):  # nosuid nodev
            if private and os.path.isdir(d):
                private = check(libc.mount(b"t", d, b"tmpfs", 6, b"size=64m,mode=1777"), "tmp")
    if private:  # into the private /tmp, which hides the host's
        os.chdir("/tmp")
        open("solution.py", "w").write(src)
        # Python's files, read-only, where nobody can read them and where hiding the host's files below leaves them
        # (nobody may not reach /root; a venv in a home)
        os.mkdir(".python")
        py = sys.base_prefix.encode()
        if check(libc.mount(py, b".python", None, 0x5000, None) or libc.mount(0, b".python", 0, 0x1021, 0), "bind"):
            packages = [m.__path__ for m in sys.modules.values() if type(vars(m).get("__path__")) is list]
            for paths in [sys.path] + packages:
                paths[:] = [p.replace(sys.base_prefix, "/tmp/.python", 1) for p in paths]  # import from there
        keep = {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "proc", "dev", "tmp"}
        keep.add(sys.path[-1].split("/")[1])  # Python's top directory stays, where it runs from
        # The host's files (/etc, /root, /home, the data) go under an empty tmpfs: ro nosuid nodev noexec
        for d in sorted(set(os.listdir("/")) - keep):
            path = f"/{d}".encode()
            if os.path.isdir(path) and not os.path.islink(path):
                check(libc.mount(b"none", path, b"tmpfs", 15, b"size=4k,mode=555"), f"hide /{d}")
    for cap in range(64):
        libc.prctl(24, cap)  # PR_CAPBSET_DROP: no capability can come back
    if uid == 0:  # to this run's own uid (RLIMIT_NPROC counts per uid); leaving uid 0 clears the capabilities
        os.chown(".", cfg["uid"], cfg["uid"])
        os.setgroups([])
        os.setresgid(cfg["uid"], cfg["uid"], cfg["uid"])
        os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
        if not os.access(sys.path[-1], os.X_OK):  # (without namespaces, Python's files stay where they are)
            os.write(messages, b"other users may not read Python's files: every import fails\n")
    check(libc.capset((ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()), "capset")  # none left
    check(libc.prctl(38, 1, 0, 0, 0), "no_new_privs")
    os.environ.update(HOME=os.getcwd(), TMPDIR=os.getcwd(), PWD=os.getcwd())
for res, soft, hard in cfg["limits"]:
    resource.setrlimit(res, (soft, hard))
write = os.write  # taken before the solution runs: it may replace os.write
truth = bool
BUILTIN = (bool, int, float, complex, str, bytes, list, tuple, set, frozenset, dict)


def encode(v):  # subclasses (defaultdict, namedtuple, IntEnum) as their builtin base, as an assert compares them
    t = next((t for t in BUILTIN if isinstance(v, t)), None)
    if v is None:
        return None
    if t is None:
        raise TypeError(f"{type(v).__name__} is not a value the trainer compares")
    if t in (bool, int, float, str):
        return t(v)
    if t is list:
        return [encode(x) for x in v]
    if t is dict:
        return {"dict": [[encode(k), encode(x)] for k, x in v.items()]}
    if t is bytes:
        return {"bytes": bytes(v).decode("latin-1")}
    if t is complex:
        return {"complex": [v.real, v.imag]}
    return {t.__name__: [encode(x) for x in v]}


os.write(messages, b"started\n")
os.close(messages)
sys.argv = ["solution.py"]
solution_globals = runpy.run_path("solution.py", run_name="__main__")
for i, (query, wants_truth) in enumerate(cfg["queries"]):
    try:
        value = eval(query, solution_globals)
        record = json.dumps(truth(value) if wants_truth else encode(value))
    except BaseException as e:  # SystemExit too: this query fails, the next ones still run
        record = f"!{type(e).__name__}"
    write(1, f"\n\x1e{i} {record}\n".encode(errors="replace"))
"""

_PYTHON = os.path.realpath(sys.executable)  # a venv's link would point outside the sandbox
_KIND_LOCK = threading.Lock()  # code_reward's threads ask at once: probe, check and print once
# As root the fallback runs each solution as a uid of its own: RLIMIT_NPROC counts every process of a uid, so runs that
# shared one (nobody) shared one limit, and one run's children made a concurrent run's fork fail. A block of uids that
# no account or container mapping should use; other processes draw from it too, at random.
_UIDS = range(0x7F000000, 0x7F010000)
_UIDS_TAKEN: set[int] = set()
_UIDS_LOCK = threading.Lock()
_MAX_WARNINGS = 8  # lines relayed from one run (each cut to 200 characters)


@functools.cache
def _bwrap_program() -> str | None:
    """bwrap's absolute path on the trainer's PATH, resolved once for the probe and every run: a run's own PATH is
    /usr/bin:/bin, where bwrap from a conda env or /usr/local/bin is not (every sample then scored 0, in silence)."""
    found = shutil.which("bwrap")
    return os.path.abspath(found) if found else None


def _bwrap(tmp: str) -> list[str]:
    """bwrap's argv up to the command: /usr and Python's prefix read-only, solution.py read-only in a private tmp."""
    argv = [
        _bwrap_program(),
        "--unshare-all",
        "--unshare-user",
        "--uid",
        "65534",
        "--gid",
        "65534",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        "--cap-drop",
        "ALL",
        "--ro-bind",
        "/usr",
        "/usr",
    ]
    for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", sys.base_prefix):  # merged-/usr symlinks or directories
        argv += ["--symlink", os.readlink(d), d] if os.path.islink(d) else ["--ro-bind", d, d] * os.path.isdir(d)
    return argv + [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(64 << 20),
        "--tmpfs",
        "/dev/shm",
        "--size",
        str(64 << 20),
        "--tmpfs",
        "/tmp",
        "--ro-bind",
        f"{tmp}/solution.py",
        "/tmp/solution.py",
        "--ro-bind",
        f"{tmp}/cfg.json",
        "/tmp/cfg.json",
        "--remount-ro",
        "/",
        "--remount-ro",  # bwrap's /dev is a tmpfs of half the RAM, else writable: GBs no rlimit counts
        "/dev",
        "--chdir",
        "/tmp",
        "--setenv",
        "PATH",
        "/usr/bin:/bin",
        "--setenv",
        "HOME",
        "/tmp",
        "--setenv",
        "TMPDIR",
        "/tmp",
    ]


@functools.cache
def _kind(forced: bool) -> str:
    """'bwrap' if installed and it can build its sandbox here (some containers forbid it), else 'fallback'; the one
    chosen passes _self_check before it is printed and used."""
    with tempfile.TemporaryDirectory() as tmp:
        pathlib.Path(tmp, "solution.py").touch()
        pathlib.Path(tmp, "cfg.json").touch()
        bwrap = (
            not forced
            and _bwrap_program() is not None
            and subprocess.run(
                [*_bwrap(tmp), _PYTHON, "-I", "-S", "solution.py"], check=False, capture_output=True
            ).returncode
            == 0
        )
    kind = "bwrap" if bwrap else "fallback"
    name = f"bwrap ({_bwrap_program()})" if bwrap else "fallback (bubblewrap is stronger)"
    _self_check(kind, name)
    print(f"code sandbox: {name}", file=sys.stderr, flush=True)
    return kind


# The self-check at first use: a known-good and a known-bad solution, each through a stdin/stdout run and an assert
# run of the chosen sandbox, judged as every sample is. A sandbox that runs nothing (a program its runs cannot find,
# namespaces refused after the probe) would otherwise score every sample 0, correct ones too, and say nothing. Then a
# known escape, which proves isolation rather than function: a `bwrap` that runs its command without namespaces (a
# shim, a stub) passed the first part, and its solutions read the host's files.
_CHECK_TESTS = [{"input": "2\n", "output": "3\n"}, "assert f(1) == 2"]
_GOOD = "import sys\n\n\ndef f(x):\n    return x + 1\n\n\nprint(f(int(sys.stdin.read() or 0)))"
_BAD = _GOOD.replace("x + 1", "x - 1")
_ESCAPE = """import socket
leaks = []
try:
    if open({path!r}).read() == {secret!r}:
        leaks.append("read the host file {path}")
except OSError:
    pass
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2).close()
    leaks.append("connected to the trainer's listener on 127.0.0.1:{port}")
except OSError:
    pass
print("; ".join(leaks) or "isolated")
"""


def _self_check(kind: str, name: str) -> None:
    """Raise RewardError, one line naming the sandbox and its stderr, unless _GOOD scores 1 and _BAD 0 in it; then
    _isolation_check."""
    try:
        scores = [run_code_tests(source, _CHECK_TESTS, kind=kind) for source in (_GOOD, _BAD)]
    except OSError as e:  # its program cannot start (gone, not executable): that is what it says
        raise RewardError(f"reward 'code': the code sandbox {name} cannot start: {e}") from None
    if scores == [1.0, 0.0]:
        _isolation_check(kind, name)
        return
    stderr = _run(kind, _GOOD, "2\n", timeout=5.0, memory_mb=1024, max_procs=32, max_output=1 << 22, queries=())[1]
    raise RewardError(
        f"reward 'code': the code sandbox {name} failed its self-check: a known-good solution scored {scores[0]} and "
        f"a known-bad one {scores[1]}, not 1.0 and 0.0; its stderr: {' | '.join(stderr.splitlines()[-5:]) or '(none)'}"
    )


def _isolation_check(kind: str, name: str) -> None:
    """A known escape must fail in the sandbox: reading a host file any user may read (a random secret in a new
    world-readable folder of the trainer's temp dir) and connecting to a TCP listener of the trainer's on 127.0.0.1.
    bwrap promises both (its own mount and network namespaces): one that lets either through is no sandbox, and the
    run stops naming it (RewardError). The fallback's namespaces may be refused by the kernel, which each run warns
    about (docs/rewards.md): there the escape is warned about once, naming what it reached."""
    secret = secrets.token_hex(16)
    listener = socket.create_server(("127.0.0.1", 0))
    with tempfile.TemporaryDirectory(prefix="onlyone_isolation_") as host, listener as ear:
        os.chmod(host, 0o755)  # readable by any uid: only the sandbox's own file system can hide it
        path = os.path.join(host, "secret")
        pathlib.Path(path).write_text(secret)
        os.chmod(path, 0o644)
        escape = _ESCAPE.format(path=path, secret=secret, port=ear.getsockname()[1])
        out = _run(kind, escape, "", timeout=5.0, memory_mb=1024, max_procs=32, max_output=1 << 12, queries=())[0]
    if out == "isolated\n":
        return
    reached = out.strip().replace("\n", " ") or "(it printed nothing)"
    if kind == "fallback":
        warnings.warn(f"code sandbox {name}: not isolated here: a known escape {reached}")
        return
    raise RewardError(
        f"reward 'code': the code sandbox {name} failed its isolation check: a known escape {reached}; it "
        "runs solutions without namespaces (a shim or stub named bwrap?): install bubblewrap, or set "
        "ONLYONE_SANDBOX=fallback"
    )


def _cgroups(max_procs: int, memory: int) -> list[str]:
    """New cgroups that cap all the sandbox's processes together: at most max_procs of them (RLIMIT_NPROC does not
    bind root) and `memory` bytes (RLIMIT_AS binds each process alone; tmpfs pages count here too). cgroup v1's pids
    and memory hierarchies, else one v2 group; none where we may not make them (not root)."""
    v1 = [_cgroup("/sys/fs/cgroup/pids", {"pids.max": max_procs})]
    v1 += [_cgroup("/sys/fs/cgroup/memory", {"memory.limit_in_bytes": memory})]
    if any(v1):
        return [c for c in v1 if c]
    v2 = _cgroup("/sys/fs/cgroup", {"pids.max": max_procs, "memory.max": memory})
    v2 = v2 or _cgroup("/sys/fs/cgroup", {"pids.max": max_procs})  # the memory controller may not be delegated
    return [v2] if v2 else []


def _cgroup(root: str, limits: dict[str, int]) -> str | None:
    """A new cgroup under root with these limits, or None (no such hierarchy or controller here, or not root)."""
    # the creating process's pid in the name: whose sandbox an empty group belongs to stays known (tests tell another
    # test process's sandbox, in flight, from a leftover)
    path = os.path.join(root, f"onlyone_{os.getpid()}_{uuid.uuid4().hex[:12]}")
    try:
        os.mkdir(path)
        if not os.path.isfile(os.path.join(path, "cgroup.procs")):  # a plain directory (a tmpfs), not a cgroup
            raise OSError
        for name, value in limits.items():
            pathlib.Path(path, name).write_text(str(value))  # fails where the controller is missing
        return path
    except OSError:
        with contextlib.suppress(OSError):
            os.rmdir(path)
    return None


def _kill_all(proc: subprocess.Popen, cgroups: list[str]) -> None:
    """SIGTERM the sandbox (the fallback's waiter kills PID 1; bwrap dies, --die-with-parent takes its PID 1, and
    with PID 1 the kernel kills its namespace), SIGKILL its process group and cgroup members until both are gone."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.send_signal(signal.SIGTERM)  # (nothing once it has exited)
        proc.wait(1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for _ in range(200):  # a killed process exists until reaped (by its parent, else by init, which may be slow)
        for pid in [p for c in cgroups for p in pathlib.Path(c, "cgroup.procs").read_text().split()]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        try:
            os.killpg(proc.pid, 0)  # raises once every member of the group has been reaped
        except ProcessLookupError:
            with contextlib.suppress(OSError):  # rmdir fails (EBUSY) until the cgroup's last member is reaped too
                while cgroups:
                    os.rmdir(cgroups[-1])
                    cgroups.pop()
                return
        time.sleep(0.05)
    warnings.warn(f"sandbox process group {proc.pid} or cgroups {cgroups} not empty 10 s after SIGKILL")


@contextlib.contextmanager
def _own_uid():
    """A uid of _UIDS that no other run of this process holds, for as long as the block runs."""
    with _UIDS_LOCK:
        uid = _UIDS[secrets.randbelow(len(_UIDS))]
        while uid in _UIDS_TAKEN:
            uid = _UIDS[secrets.randbelow(len(_UIDS))]
        _UIDS_TAKEN.add(uid)
    try:
        yield uid
    finally:
        with _UIDS_LOCK:
            _UIDS_TAKEN.discard(uid)


def _relay(kind: str, messages: int, stderr: int) -> None:
    """Warn of the isolation steps the kernel refused: the bootstrap's messages (its own descriptor, closed before the
    solution runs), and bwrap's lines on stderr only if the bootstrap never started (else they are the solution's)."""
    lines = os.pread(messages, 1 << 12, 0).decode(errors="replace").splitlines()
    warned = [f"onlyone-sandbox: {line}" for line in lines if line != "started"]
    if "started" not in lines:
        stderr_lines = os.pread(stderr, 1 << 12, 0).decode(errors="replace").splitlines()
        warned += [line for line in stderr_lines if line.startswith("bwrap: ")]
    for line in warned[:_MAX_WARNINGS]:
        warnings.warn(f"code sandbox ({kind}): {line[:200]}")


def run_python(
    source: str,
    stdin: str = "",
    timeout: float = 5.0,
    memory_mb: int = 1024,
    max_procs: int = 32,
    max_output: int = 1 << 22,
    queries: tuple | list = (),
    kind: str | None = None,
) -> str:
    """Run `source` with `stdin` in the sandbox; return its stdout (the first max_output bytes), to which each of
    `queries` ([expression, truth]), evaluated in the solution's globals after it ran, adds a line "\\x1e<i> <json>"
    (its value, or bool(value) if truth, encoded by _BOOT's encode; "!<exception name>" if it raised).
    rlimits: CPU timeout + 1 s, AS memory_mb, FSIZE max_output (stdout and stderr are files: this caps them),
    NOFILE 64, NPROC max_procs; as root, cgroups cap all its processes together at max_procs and memory_mb.
    stdin, stdout and stderr are unnamed files. kind: "bwrap" or "fallback"; None: the one chosen (and checked) at
    first use."""
    if kind is None:
        with _KIND_LOCK:
            kind = _kind(os.environ.get("ONLYONE_SANDBOX") == "fallback")
    return _run(kind, source, stdin, timeout, memory_mb, max_procs, max_output, queries)[0]


def _run(
    kind: str, source: str, stdin: str, timeout: float, memory_mb: int, max_procs: int, max_output: int, queries
) -> tuple[str, str]:
    """run_python in the sandbox `kind`: (stdout, the first 4 KiB of stderr)."""
    cpu = math.ceil(timeout)
    mem = memory_mb << 20
    limits = [
        (resource.RLIMIT_CPU, cpu, cpu + 1),
        (resource.RLIMIT_AS, mem, mem),
        (resource.RLIMIT_NOFILE, 64, 64),
        (resource.RLIMIT_FSIZE, max_output, max_output),
        (resource.RLIMIT_NPROC, max_procs, max_procs),
    ]
    with (
        tempfile.TemporaryDirectory(prefix="onlyone_sandbox_", ignore_cleanup_errors=True) as tmp,
        tempfile.TemporaryFile() as i,
        tempfile.TemporaryFile() as o,
        tempfile.TemporaryFile() as e,
        tempfile.TemporaryFile() as m,
        _own_uid() as uid,
    ):
        pathlib.Path(tmp, "solution.py").write_text(source, encoding="utf-8")
        cfg = {"fallback": kind == "fallback", "limits": limits, "queries": list(queries), "uid": uid}
        cfg["messages"] = m.fileno()  # the same number in the sandbox (pass_fds)
        pathlib.Path(tmp, "cfg.json").write_text(json.dumps(cfg))  # (not argv: its strings are limited)
        i.write(stdin.encode())
        i.seek(0)
        cgroups = _cgroups(max_procs, mem)
        cmd = (_bwrap(tmp) if kind == "bwrap" else []) + [_PYTHON, "-I", "-S", "-c", _BOOT]
        if cgroups:  # the shell joins the cgroups, then becomes the sandbox: all it starts is counted
            join = "".join(f"echo $$ > {c}/cgroup.procs && " for c in cgroups)  # our own paths: no quoting needed
            cmd = ["/bin/sh", "-c", join + 'exec "$@"', "sh", *cmd]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": tmp, "TMPDIR": tmp}
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                cmd, cwd=tmp, env=env, stdin=i, stdout=o, stderr=e, pass_fds=(m.fileno(),), start_new_session=True
            )
        except OSError:
            for cgroup in cgroups:  # else nothing removes them
                os.rmdir(cgroup)
            raise
        try:
            while proc.poll() is None and time.monotonic() < start + timeout:  # (Popen.wait's polling is coarser)
                time.sleep(0.005)
        finally:  # also after a clean exit: the solution's children may still run
            _kill_all(proc, cgroups)
        _relay(kind, m.fileno(), e.fileno())
        stdout = os.pread(o.fileno(), max_output, 0).decode("utf-8", errors="replace")
        return stdout, os.pread(e.fileno(), 1 << 12, 0).decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------------- code
# An assert test is judged out of the solution's reach. The sandbox evaluates only the parts that are the solution's:
# calls of its functions (with their arguments, its inputs) and its names, the "queries"; their values come back as
# data. Everything else is the expected side, evaluated on those values by plugins/code_judge.py in a process of its
# own under a CPU budget: literals, operators, comparisons, the builtins in PURE and math's functions in MATH. The
# solution can read its queries (they are code it runs), so a query never holds an expected value, and a test whose
# parts fit neither side is refused (_Split): a comprehension or lambda would run where the solution can touch it.
_HERE = (ast.Constant, ast.Tuple, ast.List, ast.Set, ast.Dict, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare)
_HERE += (ast.IfExp, ast.Subscript, ast.Slice, ast.Starred)


class _Split:
    """One assert's test, split: `test` for the judge to evaluate, with the names `_q<i>` for what the sandbox
    evaluates, `queries[i]` ([expression, truth]; truth: only its truth matters, `assert f(1)`, `not f(1)`)."""

    def __init__(self, test: str, queries: list):
        try:
            body = ast.parse(test).body
        except SyntaxError as e:
            raise ValueError(f"not valid Python ({e.msg}): {test!r}") from None
        if len(body) != 1 or not isinstance(body[0], ast.Assert):
            raise ValueError(f"an assert test is one assert statement, e.g. 'assert f(1) == 2'; got {test!r}")
        self.queries = queries
        first = len(queries)
        self.test = self.split(body[0].test, truth=True)
        if len(queries) == first and not holds(self.test, {}):  # (`assert True` passes anyway)
            raise ValueError(
                f"'{ast.unparse(body[0].test)}' holds nothing of the solution's and fails here, where "
                f"{', '.join(PURE)} are Python's own"
            )

    def split(self, node: ast.AST, truth: bool = False) -> ast.AST:
        """node, with each of its largest parts that are the solution's replaced by a name `_q<i>`."""
        if isinstance(node, ast.Call) and _here_function(node.func):
            text = ast.unparse(node)
            node.args = [self.split(a) for a in node.args]
            for k in node.keywords:
                k.value = self.split(k.value)
            if isinstance(node.func, ast.Attribute) and node.func.attr == "isclose":
                self.expected_side(text, node.args[:2])
            return node
        if isinstance(node, ast.Name) and node.id in PURE or _is_math(node):
            return node  # a builtin as a value (key=len), math.pi
        if isinstance(node, (ast.Call, ast.Name, ast.Attribute)):
            self.queries.append([_query(node), truth])
            return ast.Name(f"_q{len(self.queries) - 1}", ast.Load())
        if not isinstance(node, _HERE):
            raise ValueError(
                f"'{ast.unparse(node)}' would be evaluated where the solution's code can touch it: an expected value "
                f"is made of literals, operators, builtins such as sorted() and math's functions (docs/rewards.md)"
            )
        text = ast.unparse(node) if isinstance(node, ast.Compare) else ""
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            node.operand = self.split(node.operand, truth=True)
        elif isinstance(node, ast.BoolOp):
            node.values = [self.split(v, truth) for v in node.values]
        elif isinstance(node, ast.IfExp):
            node.test = self.split(node.test, truth=True)
            node.body = self.split(node.body, truth)
            node.orelse = self.split(node.orelse, truth)
        else:
            for field, value in ast.iter_fields(node):
                if isinstance(value, ast.expr):
                    setattr(node, field, self.split(value))
                elif isinstance(value, list):  # (a Compare's ops, a Dict's None keys for ** are no expressions)
                    setattr(node, field, [self.split(v) if isinstance(v, ast.expr) else v for v in value])
        if isinstance(node, ast.Compare):
            self.expected_side(text, [node.left, *node.comparators])
        return node

    def expected_side(self, text: str, operands: list) -> None:
        """A comparison needs an operand free of the solution's values (the expected one), else it passes for any
        solution whose values agree with each other: `len(h(K)) == K`, `f(x) == collections.Counter(...)`."""
        names = [{n.id for n in ast.walk(o) if isinstance(n, ast.Name) and n.id.startswith("_q")} for o in operands]
        if all(names):
            raise ValueError(f"'{text}' compares the solution's values only with each other: no side is expected")


def _is_math(node: ast.AST) -> bool:
    """`math.<name>` of MATH: math's own function or constant, evaluated here (the solution may rebind `math`)."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "math":
        if node.attr not in MATH:
            raise ValueError(f"math.{node.attr} is not evaluated by the trainer; it takes math.<{', '.join(MATH)}>")
        return True
    return False


def _here_function(func: ast.AST) -> bool:
    """A builtin of PURE or a function of MATH, called here."""
    return isinstance(func, ast.Name) and func.id in PURE or _is_math(func)


def _query(node: ast.AST) -> str:
    """The solution's part: a name it defines, or a chain of calls, attributes and subscripts starting at one; a
    standard module's attribute is refused, as an expected value the solution could rebind."""
    chain = [node]
    while isinstance(chain[-1], (ast.Call, ast.Attribute, ast.Subscript)):
        chain.append(chain[-1].func if isinstance(chain[-1], ast.Call) else chain[-1].value)
    root = chain[-1]
    text = ast.unparse(node)
    if not isinstance(root, ast.Name) or root.id in PURE or root.id == "math":
        raise ValueError(f"'{text}' is neither the solution's (a call of its functions, its names) nor evaluated here")
    if root.id in sys.stdlib_module_names and len(chain) > 1 and isinstance(chain[-2], ast.Attribute):
        raise ValueError(
            f"'{text}' takes an attribute of the module {root.id}, which the solution's code could rebind: an "
            f"expected value is written as a literal"
        )
    return text


def _cases(tests, queries: list) -> list:
    """`tests` (see run_code_tests) as a list of {"input": str, "output": str} dicts and _Splits (their queries
    appended to `queries`); raises ValueError naming the first case that is neither: "[i] <problem>"."""
    if isinstance(tests, str) and tests.lstrip().startswith(("[", "{")):
        try:
            tests = json.loads(tests)
        except ValueError as e:
            raise ValueError(f"not valid JSON ({e})") from None
    elif isinstance(tests, str):
        tests = [tests]
    if isinstance(tests, dict):  # APPS
        inputs = tests.get("inputs")
        outputs = tests.get("outputs")
        if "fn_name" in tests or not isinstance(inputs, list) or not isinstance(outputs, list):
            raise ValueError("APPS-style tests are stdin/stdout ones: {'inputs': [str, ...], 'outputs': [str, ...]}")
        if len(inputs) != len(outputs):
            raise ValueError(f"{len(inputs)} inputs but {len(outputs)} outputs")
        tests = [{"input": i, "output": o} for i, o in zip(inputs, outputs, strict=True)]
    if not isinstance(tests, (list, tuple)):
        raise ValueError(f"a list of tests, not {type(tests).__name__}")
    cases = []
    for i, test in enumerate(tests):
        try:
            cases.append(_case(test, queries))
        except ValueError as e:
            raise ValueError(f"[{i}] {e}") from None
    return cases


def _case(test, queries: list):
    """One test: an assert string as a _Split, or a stdin/stdout dict as it is."""
    if isinstance(test, str):
        return _Split(test, queries)
    if not isinstance(test, dict) or set(test) != {"input", "output"}:
        shape = sorted(test) if isinstance(test, dict) else type(test).__name__
        raise ValueError(f"a test is an assert string or {{'input': str, 'output': str}}, not {shape}")
    for field in ("input", "output"):
        if not isinstance(test[field], str):
            raise ValueError(f"'{field}' is {type(test[field]).__name__}, not str: {test[field]!r:.60}")
    return test


def run_code_tests(code: str, tests, timeout: float = 5.0, **sandbox) -> float:
    """Fraction of `tests` that `code` passes, run by run_python (the sandbox kwargs go there). `tests` is a list
    (or its JSON string, or APPS' {"inputs": [...], "outputs": [...]}) of
      {"input": str, "output": str}: one run each; passes if the stdout lines equal ALL expected lines after rstrip
        (extra or missing lines fail: open-r1's zip() let half an answer pass);
      "assert f(1) == 2" strings, one assert each: one run for all; the sandbox evaluates only the solution's parts
        ("f(1)") and returns their values as data, the rest is evaluated on them (_Split, code_judge's _value).
    Either way the expected values never enter the sandbox and the verdict is reached outside it: what the solution
    controls is its own values, as a correct solution does. Each run's output is judged by code_judge.judge, in a
    process of its own under a CPU budget: a run past it scores the sample 0. A test that cannot be judged so raises
    ValueError (code_reward.row_problem refuses its row before the model loads)."""
    queries = []
    cases = _cases(tests, queries)
    judged = []
    for case in cases:
        if isinstance(case, dict):
            output = run_python(code, case["input"], timeout, **sandbox)
            judged.append(_judged({"output": output, "expected": case["output"]}))
    asserts = [ast.unparse(case.test) for case in cases if isinstance(case, _Split)]
    if asserts:
        output = run_python(code, "", timeout, queries=queries, **sandbox)
        judged.append(_judged({"output": output, "tests": asserts, "count": len(queries)}))
    if None in judged:  # a judge ran past its CPU budget on what this solution printed: the sample scores 0
        return 0.0
    return sum(judged) / max(len(cases), 1)


def _judged(request: dict) -> int | None:
    """code_judge.judge, its ChildProcessError (a judge killed by a signal not of its budget, each time it was run) a
    RewardError naming the reward: the run stops in one line rather than score a sample it could not judge."""
    try:
        return judge(request)
    except ChildProcessError as e:
        raise RewardError(f"reward 'code': {e}") from None


def _row_problem(row: dict) -> tuple[str, str] | None:
    """code_reward.row_problem: the first test case of the row that run_code_tests would refuse."""
    try:
        _cases(row["test_cases"], [])
    except ValueError as e:
        return ("test_cases", str(e))
    return None


def extract_code(text) -> str:
    """The last ```python (or ```py) fenced block of a completion, else its whole text."""
    blocks = re.findall(r"```(?:python3?|py)[ \t]*\n(.*?)```", text_of(text), re.DOTALL)
    return blocks[-1] if blocks else text_of(text)


def code_reward(prompts, completions, test_cases=None, **kw) -> list[float | None]:
    """Fraction of the row's `test_cases` that the completion's code passes (run_code_tests); None if it has none.
    Samples run on a few threads: each run is a separate process, so the threads only wait."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        jobs = [
            None if not t else pool.submit(run_code_tests, extract_code(c), t)
            for c, t in zip(completions, test_cases or [None] * len(completions), strict=True)
        ]
        return [None if j is None else j.result() for j in jobs]


code_reward.needs = ("test_cases",)
code_reward.row_problem = _row_problem

"""The code reward: a completion's code run against its row's tests in a sandbox (`code_reward`, registered by the
scripts under the name `code`), and the sandbox itself (`run_python`): untrusted Python in, its stdout out.
The sandbox is chosen once and printed once:
- bubblewrap (`apt-get install bubblewrap`) where it works: --unshare-all (no network; own PIDs, /proc, IPC, UTS),
  --die-with-parent --new-session --clearenv --cap-drop ALL, uid nobody in a user namespace (root's outside, if
  root: hence) a read-only root with only /usr and Python's prefix, a private 64 MiB tmpfs as /tmp, cwd and HOME,
  a read-only /dev with a 64 MiB /dev/shm;
- else (or if ONLYONE_SANDBOX=fallback) _BOOT's: new mount, PID, network, IPC, UTS (+ user, if not root)
  namespaces, a fresh /proc, private tmpfs /tmp /var/tmp /dev/shm /run/lock, every other top directory but the
  system's programs and libraries (/usr, /lib...) and Python's hidden, uid nobody (if root), no capabilities, an
  empty bounding set, no_new_privs; what the kernel refuses is warned about.
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
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
import uuid
import warnings

from common.rewards import text_of

# In the sandbox, before the solution: the fallback's isolation, rlimits, the solution as __main__, then its
# `queries` (run_code_tests), each value written as a line "\x1e<i> <repr>" in builtin types.
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


def check(failed, what):  # True if the step worked; a refused one goes to stderr, where run_python finds it
    if failed:
        os.write(2, f"onlyone-sandbox: {what}: {os.strerror(ctypes.get_errno())}\n".encode())
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
    if uid == 0:  # to nobody; leaving uid 0 clears the capabilities
        os.chown(".", 65534, 65534)
        os.setgroups([])
        os.setresgid(65534, 65534, 65534)
        os.setresuid(65534, 65534, 65534)
        if not os.access(sys.path[-1], os.X_OK):  # (without namespaces, Python's files stay where they are)
            os.write(2, b"onlyone-sandbox: nobody may not read Python's files: every import fails\n")
    check(libc.capset((ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()), "capset")  # none left
    check(libc.prctl(38, 1, 0, 0, 0), "no_new_privs")
    os.environ.update(HOME=os.getcwd(), TMPDIR=os.getcwd(), PWD=os.getcwd())
for res, soft, hard in cfg["limits"]:
    resource.setrlimit(res, (soft, hard))
write = os.write  # taken before the solution runs: it may replace os.write
BUILTIN = (bool, int, float, complex, str, bytes, list, tuple, set, frozenset, dict)


def plain(v):  # subclasses (defaultdict, namedtuple, IntEnum) as their builtin base, as an assert compares them
    t = next((t for t in BUILTIN if isinstance(v, t)), None)
    if t is None:
        return v
    if t is dict:
        return {plain(k): plain(x) for k, x in v.items()}
    if t in (list, tuple, set, frozenset):
        return t(map(plain, v))
    return t(v)


sys.argv = ["solution.py"]
solution_globals = runpy.run_path("solution.py", run_name="__main__")
for i, query in enumerate(cfg["queries"]):
    try:
        value = repr(plain(eval(query, solution_globals)))
    except BaseException as e:  # SystemExit too: this query fails, the next ones still run
        value = f"!{type(e).__name__}"
    write(1, f"\n\x1e{i} {value}\n".encode(errors="replace"))
"""

_PYTHON = os.path.realpath(sys.executable)  # a venv's link would point outside the sandbox
_KIND_LOCK = threading.Lock()  # code_reward's threads ask at once: probe and print once


def _bwrap(tmp: str) -> list[str]:
    """bwrap's argv up to the command: /usr and Python's prefix read-only, solution.py read-only in a private tmp."""
    argv = [
        "bwrap",
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
    """'bwrap' if installed and it can build its sandbox here (some containers forbid it), else 'fallback'."""
    with tempfile.TemporaryDirectory() as tmp:
        pathlib.Path(tmp, "solution.py").touch()
        pathlib.Path(tmp, "cfg.json").touch()
        bwrap = (
            not forced
            and shutil.which("bwrap")
            and subprocess.run(
                [*_bwrap(tmp), _PYTHON, "-I", "-S", "solution.py"], check=False, capture_output=True
            ).returncode
            == 0
        )
    print("code sandbox: " + ("bwrap" if bwrap else "fallback (bubblewrap is stronger)"), file=sys.stderr, flush=True)
    return "bwrap" if bwrap else "fallback"


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
    path = os.path.join(root, f"onlyone_{uuid.uuid4().hex[:12]}")
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


def run_python(
    source: str,
    stdin: str = "",
    timeout: float = 5.0,
    memory_mb: int = 1024,
    max_procs: int = 32,
    max_output: int = 1 << 22,
    queries: tuple | list = (),
) -> str:
    """Run `source` with `stdin` in the sandbox; return its stdout (the first max_output bytes), to which each of
    `queries`, evaluated in the solution's globals after it ran, adds a line "\\x1e<i> <repr>".
    rlimits: CPU timeout + 1 s, AS memory_mb, FSIZE max_output (stdout and stderr are files: this caps them),
    NOFILE 64, NPROC max_procs; as root, cgroups cap all its processes together at max_procs and memory_mb.
    stdin, stdout and stderr are unnamed files."""
    with _KIND_LOCK:
        kind = _kind(os.environ.get("ONLYONE_SANDBOX") == "fallback")
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
    ):
        pathlib.Path(tmp, "solution.py").write_text(source, encoding="utf-8")
        cfg = {"fallback": kind == "fallback", "limits": limits, "queries": list(queries)}  # (argv is limited)
        pathlib.Path(tmp, "cfg.json").write_text(json.dumps(cfg))
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
            proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdin=i, stdout=o, stderr=e, start_new_session=True)
        except OSError:
            for cgroup in cgroups:  # else nothing removes them
                os.rmdir(cgroup)
            raise
        try:
            while proc.poll() is None and time.monotonic() < start + timeout:  # (Popen.wait's polling is coarser)
                time.sleep(0.005)
        finally:  # also after a clean exit: the solution's children may still run
            _kill_all(proc, cgroups)
        for line in os.pread(e.fileno(), 1 << 16, 0).decode(errors="replace").splitlines():
            if line.startswith(("onlyone-sandbox: ", "bwrap: ")):  # an isolation step the kernel refused
                warnings.warn(f"code sandbox ({kind}): {line}")
        return os.pread(o.fileno(), max_output, 0).decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------------- code
# An assert test is judged here, out of the solution's reach: the sandbox evaluates only its parts that need the
# solution (a call of its function, a name it defines: "queries") and returns their values as literals; the rest
# (==, <, abs(), sorted(), math.isclose(), the expected values) is evaluated here on those values.
_PURE = {
    f.__name__: f
    for f in (
        abs,
        all,
        any,
        bool,
        dict,
        float,
        frozenset,
        int,
        len,
        list,
        max,
        min,
        round,
        set,
        sorted,
        str,
        sum,
        tuple,
    )
} | {"math": types.SimpleNamespace(isclose=math.isclose)}
_HERE = (
    ast.Constant,
    ast.Tuple,
    ast.List,
    ast.Set,
    ast.Dict,
    ast.BinOp,
    ast.UnaryOp,
    ast.BoolOp,
    ast.Compare,
    ast.IfExp,
    ast.Subscript,
    ast.Slice,
    ast.Starred,
    ast.keyword,
    ast.operator,
    ast.unaryop,
    ast.boolop,
    ast.cmpop,
    ast.expr_context,
)


def _split_assert(test: str, queries: list[str]):
    """`assert f(1) == 2` -> compiled `_q0 == 2`, "f(1)" appended to queries: every largest part that is neither in
    _HERE nor a call of a _PURE function becomes a query."""
    body = ast.parse(test).body
    if len(body) != 1 or not isinstance(body[0], ast.Assert):
        raise ValueError(f"an assert test is one assert statement, e.g. 'assert f(1) == 2'; got {test!r}")

    class Split(ast.NodeTransformer):
        def visit(self, node):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in {*_PURE, "math.isclose"} - {"math"}:
                node.args, node.keywords = [self.visit(a) for a in node.args], [self.visit(k) for k in node.keywords]
            elif isinstance(node, _HERE):
                self.generic_visit(node)
            else:
                queries.append(ast.unparse(node))
                return ast.Name(f"_q{len(queries) - 1}", ast.Load())
            return node

    return compile(ast.fix_missing_locations(ast.Expression(Split().visit(body[0].test))), "<test>", "eval")


def _holds(test, values: dict) -> bool:
    """A split test on the solution's values; a missing value (NameError) or a wrong one's TypeError etc. fails."""
    try:
        return bool(eval(test, {"__builtins__": {}, **_PURE, **values}))
    except (NameError, TypeError, ValueError, ArithmeticError, LookupError, MemoryError, RecursionError):
        return False


def _lines(s: str) -> list[str]:
    """Output lines compared as judges do: trailing spaces and trailing blank lines ignored."""
    return [line.rstrip() for line in s.rstrip().splitlines()]


def run_code_tests(code: str, tests, timeout: float = 5.0, **sandbox) -> float:
    """Fraction of `tests` that `code` passes, run by run_python (the sandbox kwargs go there). `tests` is a list
    (or its JSON string, or APPS' {"inputs": [...], "outputs": [...]}) of
      {"input": str, "output": str}: one run each; passes if the stdout lines equal ALL expected lines after rstrip
        (extra or missing lines fail: open-r1's zip() let half an answer pass);
      "assert f(1) == 2" strings, one assert each: one run for all; the sandbox evaluates only "f(1)" and returns
        its value as a literal, the comparison runs here (_split_assert).
    Either way the expected values never enter the sandbox and the verdict is reached outside it, so no trick of
    the solution's (rebinding exec or builtins, sys.modules, AssertionError, exiting early, atexit, signals,
    printing fake results, reading its files or /proc, an object equal to everything) can pass a test it fails."""
    if isinstance(tests, str):
        tests = json.loads(tests) if tests.lstrip().startswith(("[", "{")) else [tests]
    if isinstance(tests, dict):
        tests = [{"input": i, "output": o} for i, o in zip(tests["inputs"], tests["outputs"], strict=True)]
    passed = sum(
        _lines(run_python(code, t["input"], timeout, **sandbox)) == _lines(t["output"])
        for t in tests
        if isinstance(t, dict)
    )
    queries = []
    asserts = [_split_assert(t, queries) for t in tests if isinstance(t, str)]
    if asserts:
        out = run_python(code, "", timeout, queries=queries, **sandbox)
        values = {}
        records = dict(re.findall(r"^\x1e(\d+) (.*)$", out, re.MULTILINE))  # the last one of each query
        for i in range(len(queries)):  # (only these: parsing costs us, not the sandbox)
            with contextlib.suppress(KeyError, ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                values[f"_q{i}"] = ast.literal_eval(records[str(i)])  # none or not a literal: its test fails
        passed += sum(_holds(test, values) for test in asserts)
    return passed / max(len(tests), 1)


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

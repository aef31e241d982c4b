"""The code sandbox's bounds on what a solution may take from the machine, in both sandboxes (the fixtures of
tests/test_rewards.py): RAM-backed writable mounts are small, memory is capped for all its processes together, the
host's files are out of sight, and concurrent samples share no process limit."""

import concurrent.futures
import json
import os
import pathlib

import pytest

from plugins.code import run_code_tests, run_python
from tests import test_rewards

# test_rewards.py's fixtures: each test runs in both sandboxes and must leave no process or cgroup behind
kind, namespaced, no_leftovers = test_rewards.kind, test_rewards.namespaced, test_rewards.no_leftovers


def test_writable_mounts_are_small(no_leftovers):
    """bwrap's /dev (and /dev/shm in it) was a tmpfs of half the RAM, writable by the sandbox: a solution could park
    GBs of the shared machine's memory there, which no rlimit counts."""
    program = (
        "import json, os\nwritten = {}\nfor d in ('/dev/shm', '/dev', '/tmp', os.getcwd()):\n    n = 0\n"
        "    try:\n        for n in range(1, 101):\n            with open(f'{d}/fill{n}', 'wb') as f:\n"
        "                f.write(bytes(1 << 20))\n    except OSError:\n        n -= 1\n    written[d] = n\n"
        "print(json.dumps(written))"
    )
    written = json.loads(run_python(program, timeout=10))
    assert all(mib < 65 for mib in written.values()), written  # MiB each, of 100 tried


def _memory_cgroup_possible() -> bool:
    """Root, with the cgroup v1 memory hierarchy or v2's memory controller available to a new group."""
    v2 = pathlib.Path("/sys/fs/cgroup/cgroup.subtree_control")
    return os.geteuid() == 0 and (
        os.access("/sys/fs/cgroup/memory/cgroup.procs", os.W_OK) or (v2.exists() and "memory" in v2.read_text())
    )


def test_memory_is_capped_for_all_processes_together(no_leftovers):
    """RLIMIT_AS binds each process alone: max_procs children of memory_mb each took max_procs times the limit."""
    if not _memory_cgroup_possible():
        pytest.skip("no memory cgroup can be made here (not root, or no memory controller): the cap is per process")
    program = (
        "import os, time\nfor _ in range(6):\n    if os.fork() == 0:\n        x = b'x' * (150 << 20)\n"
        "        time.sleep(1.5)\n        os.write(1, b'held\\n')\n        os._exit(0)\n"
        "for _ in range(6):\n    os.wait()\nprint('done')"
    )
    out = run_python(program, timeout=8, memory_mb=256, max_procs=16)
    assert out.count("held") <= 1, out  # 6 x 150 MiB held at once under a 256 MiB cap: at most one survives


def test_the_hosts_files_are_out_of_sight(namespaced, no_leftovers):
    """The fallback hid only the world-writable directories: as nobody it read /etc, the repo and the training data
    (a code solution could look its expected output up there)."""
    if not namespaced:
        pytest.skip("unshare is refused here: the sandbox warns and the host's files stay visible")
    repo = pathlib.Path(__file__).resolve().parents[1]
    paths = ["/etc/passwd", str(repo / "README.md"), str(repo / "tests"), "/sys/fs/cgroup", "/var/log"]
    program = (
        f"import os\nfor p in {paths!r}:\n    try:\n"
        f"        if os.listdir(p) if os.path.isdir(p) else open(p).read(1):\n            print('read', p)\n"
        f"    except OSError:\n        pass\nprint('ran')"
    )
    assert run_python(program) == "ran\n"


def test_concurrent_samples_share_no_process_limit(no_leftovers):
    """The fallback ran every sample as root's nobody, and RLIMIT_NPROC counts all of a uid's processes: one sample's
    30 sleeping children made a concurrent correct sample's single fork fail (0.0). Each run has its own uid now."""
    hog = (
        "import os, time\nfor _ in range(30):\n    if os.fork() == 0:\n        time.sleep(8)\n        os._exit(0)\n"
        "time.sleep(8)"
    )
    # forks once, after the hog's children are up (it starts at the same time; 30 forks take far less than 2 s)
    forks_once = (
        "import os, time\ntime.sleep(2)\ndef f(x):\n    pid = os.fork()\n    if pid == 0:\n        os._exit(0)\n"
        "    os.waitpid(pid, 0)\n    return x + 1"
    )
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        hogging = pool.submit(run_python, hog, timeout=10)
        correct = pool.submit(run_code_tests, forks_once, ["assert f(1) == 2"], timeout=10)
        assert correct.result() == 1.0
        assert hogging.result() == ""

"""Shared fixtures: a tiny random Qwen2 model + ChatML tokenizer on disk, loaded by path (no hub access)."""

import os
import pathlib
import subprocess
import sys

import peft  # noqa: F401  (first: a script the tests import then leaves bitsandbytes as it is, see below)
import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # scripts (sft.py, dpo.py, ...) and common/ import from the repo root
NO_SHARED_DATA = "shared data folder"  # the start of the skip reason the shared_data fixture gives

# One thread: on a 2-vCPU machine torch is far faster and steadier for tiny models (tests only, not a user default).
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# PEFT is imported above, before any test imports a script: a script's import_peft_quietly (harness.fast_help) then
# hides nothing in the test processes, where test_quantization loads bitsandbytes in-process; the hiding is tested in
# fresh processes (tests/test_model.py).

from scripts.run_tests import SHARED_DATA  # one definition: the test command names it when it is absent
from tests.tiny import write_tiny


def python_as_launched(code: str) -> str:
    """Run `python -c code` in a fresh process with malloc as a user's launch leaves it (no MALLOC_* variable, no
    LD_PRELOAD), one torch thread; returns its stdout and stderr together."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    return out.stdout + out.stderr


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """Tiny Qwen2 (hidden 64, 2 layers) + byte-level BPE ChatML tokenizer, eos=<|im_end|>, pad=<|endoftext|>."""
    return write_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_model_dir_pad_eos(tmp_path_factory) -> str:
    """Same, but pad == eos (the case where a naive mask drops the completion's EOS from the loss)."""
    return write_tiny(tmp_path_factory.mktemp("tiny_pad_eos"), pad_is_eos=True)


@pytest.fixture(scope="session")
def shared_data() -> pathlib.Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{NO_SHARED_DATA} {SHARED_DATA} not present (a fresh user clone); these tests need it")
    return SHARED_DATA


def pytest_configure(config):
    # .ci/run reruns the numerics tests under other CPU kernels through ATEN_CPU_CAPABILITY; torch ignores a value it
    # was not built with (a warning only), and that rerun would then repeat the native kernels and prove nothing.
    asked = os.environ.get("ATEN_CPU_CAPABILITY")
    running = torch.backends.cpu.get_cpu_capability()
    if asked and asked.upper() != running:
        raise pytest.UsageError(f"ATEN_CPU_CAPABILITY={asked} asked for, but torch runs its {running} CPU kernels")


def pytest_terminal_summary(terminalreporter):
    """One line at the end when tests skipped for want of the shared data folder: how many, what they cover, what the
    folder is (a user's clone has none, and a bare count of skips does not say why)."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if NO_SHARED_DATA in str(r.longrepr)]
    if not skipped:
        return
    files = sorted({r.nodeid.split("::")[0].removeprefix("tests/") for r in skipped})
    terminalreporter.write_line(
        f"{len(skipped)} test(s) skipped because {SHARED_DATA} is absent ({', '.join(files)}): they run the data "
        "loaders, converters, math checker and evals on real files (GSM8K train/test, IFEval's prompts, "
        "LLaMA-Factory's Alpaca, ShareGPT and KTO demos). That folder is the project's shared test data, kept beside "
        "the checkout and not shipped with a clone (its files: gsm8k/{train,test}.jsonl from openai/gsm8k, "
        "ifeval/input_data.jsonl from google/IFEval, llamafactory-demo/ from LLaMA-Factory's data/; "
        "ONLYONE_SHARED_DATA names another folder); the rest of the suite covers the same code on built-in rows."
    )


@pytest.hookimpl(tryfirst=True)  # under pytest-xdist, before its worker hook reads the groups
def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items[:] = in_groups(items)


def in_groups(items: list) -> list:
    """The items, each marked with its xdist group, longest groups first (scripts/run_tests.py runs the suite with
    --dist loadgroup --no-loadscope-reorder: a group is one worker's, whole, in this order). A file is a group: its
    module fixtures are built once and its tests run in their order in one process (some compare two runs exactly).
    Every file that launches torchrun is in one group, first: two ranks a launch, so two launches at once would ask
    for twice the cores; it is the longest group, so it goes while the other workers take the rest."""
    sources = {}
    for item in items:
        if item.path not in sources:
            sources[item.path] = item.path.read_text(encoding="utf-8")
    torchrun = {path for path, text in sources.items() if "torch.distributed.run" in text}
    group = {item: "torchrun" if item.path in torchrun else item.nodeid.split("::")[0] for item in items}
    slow = {name: 0 for name in group.values()}  # the `slow` tests a group holds: the longest go first
    for item in items:
        slow[group[item]] += item.get_closest_marker("slow") is not None
        item.add_marker(pytest.mark.xdist_group(group[item]))
    return sorted(items, key=lambda item: (group[item] != "torchrun", -slow[group[item]]))


@pytest.fixture(scope="session")
def trl_harness(tiny_model_dir, tmp_path_factory):
    """scripts/compare_with_trl.py's inputs: the tiny model, the LoRA adapter both sides start from, the tokenizer."""
    pytest.importorskip("trl")
    from scripts.compare_with_trl import load_tokenizer, make_start_adapter

    out = tmp_path_factory.mktemp("parity")
    adapter = make_start_adapter(tiny_model_dir, str(out / "start_adapter"))
    return dict(model=tiny_model_dir, adapter=adapter, out=str(out), tokenizer=load_tokenizer(tiny_model_dir))

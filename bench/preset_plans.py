"""Does each script's real preset start on a 24 / 48 GiB card? `python bench/preset_plans.py`

`python <script>.py --model Qwen/Qwen2.5-<size>` (grpo.py: the headline's --group-size 4) resolved to its preset and
passed through `common.memory.check_memory` as on a CUDA card of the given size (Qwen2.5 configs from
common/memory.py, no download, no GPU): the plan without gradient checkpointing -> the plan the run starts with,
`*` where the plan turned checkpointing on. tests/test_memory.py asserts that every cell fits its card.
"""

import contextlib
import importlib
import io
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import tyro

from common import memory
from common.run import resolve_preset

SCRIPTS = ("sft", "dpo", "orpo", "kto", "rm", "grpo", "raft")
EXTRA = {"grpo": ["--group-size", "4"]}


def main() -> None:
    mods = {s: importlib.import_module(s) for s in SCRIPTS}
    torch.cuda.is_available = lambda: True  # after the imports: bitsandbytes reads CUDA when it is imported
    torch.cuda.is_bf16_supported = lambda *a, **k: True  # --dtype auto is then planned as bf16, as on these cards
    print("| model, card | " + " | ".join(SCRIPTS) + " |\n|---|" + "---:|" * len(SCRIPTS))
    for size, card in (("1.5B", 24), ("3B", 24), ("7B", 48)):
        memory.device_memory = lambda device, card=card: (card * memory.GiB, f"{card} GiB card")
        memory.model_config = lambda name, trust=False, size=size: memory.QWEN25[size]
        cells = []
        for name, mod in mods.items():
            argv = ["--model", f"Qwen/Qwen2.5-{size}", *EXTRA.get(name, [])]
            args = resolve_preset(tyro.cli(mod.Args, args=argv), mod.PRESETS)
            off = memory.estimate(memory.QWEN25[size], args, name, "cuda")["total"] / memory.GiB
            with contextlib.redirect_stdout(io.StringIO()) as out:
                started = memory.check_memory(args, name)
            total = float(out.getvalue().split("total")[1].split()[0])
            cells.append(f"{off:.1f} -> {total:.1f}*" if started.gradient_checkpointing else f"{total:.1f}")
        print(f"| Qwen2.5-{size}, {card} GiB | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

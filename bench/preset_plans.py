"""Does each script's real preset start on a 24 / 48 GiB card? `python bench/preset_plans.py`

`python <script>.py --model Qwen/Qwen2.5-<size>` (grpo.py: the headline's --group-size 4) resolved to its preset and
planned by the script's own memory_plan as on a CUDA card of the given size (bench/capability_table.plan_on_card:
Qwen2.5 configs from bench/capability_table.py, no download, no GPU): the plan without gradient checkpointing -> the
plan the run starts with, `*` where the run starts with checkpointing on. A cell over its card (the run would be
refused) ends in "over". tests/test_memory.py asserts that every cell fits its card.
"""

import importlib
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tyro

from bench.capability_table import plan_on_card
from harness.cli import resolve_preset
from harness.memory import GiB

SCRIPTS = ("sft", "dpo", "orpo", "kto", "rm", "grpo", "raft")
EXTRA = {"grpo": ["--group-size", "4"]}
CARDS = (("1.5B", 24), ("3B", 24), ("7B", 48))
# what harness.memory.plan_memory prints when it turns gradient checkpointing on to fit
WITHOUT = re.compile(r"without it the plan needs ([\d.]+) GiB")


def cell(module, script: str, size: str, card: int) -> str:
    """'plan without checkpointing -> plan the run starts with*' (or the one plan when checkpointing stays off)."""
    # --plan: the planner reports a plan over the card instead of refusing it, so every cell prints
    argv = ["--model", f"Qwen/Qwen2.5-{size}", "--plan", *EXTRA.get(script, [])]
    args = resolve_preset(tyro.cli(module.Args, args=argv), module.PRESETS)
    parts, checkpointing, text = plan_on_card(module, args, size, card)
    total = parts["total"] / GiB
    over = " over" if parts["total"] > card * GiB else ""
    if not checkpointing:
        return f"{total:.1f}{over}"
    turned_on = WITHOUT.search(text)  # None: the preset asked for checkpointing itself
    off = float(turned_on.group(1)) if turned_on else total
    return f"{off:.1f} -> {total:.1f}*{over}"


def main() -> None:
    modules = {script: importlib.import_module(script) for script in SCRIPTS}
    print("| model, card | " + " | ".join(SCRIPTS) + " |\n|---|" + "---:|" * len(SCRIPTS))
    for size, card in CARDS:
        cells = [cell(module, script, size, card) for script, module in modules.items()]
        print(f"| Qwen2.5-{size}, {card} GiB | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

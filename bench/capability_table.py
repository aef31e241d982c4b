"""The capability matrix: Qwen2.5 sizes x methods x (bf16 full with torch's or 8-bit AdamW, bf16 LoRA, 4-bit QLoRA),
each cell the memory plan of the script's own declaration (its memory_plan) as on a CUDA card: no download, no GPU.
`python bench/capability_table.py --gpu-memory 24 48` (docs/memory.md shows its output).
`plan_on_card(module, args, size, card)` is the same planning step for any script and Args (bench/preset_plans.py and
tests/test_memory.py use it)."""

import argparse
import contextlib
import dataclasses
import importlib
import io
import os
import sys
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from harness import memory
from harness.cli import resolve_preset
from plugins.embedded import QWEN25  # Qwen2.5 sizes' config.json architecture fields

METHODS = {"SFT": "sft", "ORPO": "orpo", "DPO": "dpo", "GRPO G=4": "grpo"}
VARIANTS = {
    "bf16 full": dict(use_lora=False),
    "bf16 full, 8-bit AdamW": dict(use_lora=False, optim="adamw_8bit"),
    "bf16 LoRA": {},
    "QLoRA 4-bit": dict(quantization="4bit"),
}
# The table's configuration: bf16, LoRA r 16, checkpointing on, 2 rows (pairs) x 1,024 tokens; GRPO 8 prompts x G 4
COMMON = dict(dtype="bf16", lora_r=16, gradient_checkpointing=True, attn_implementation="sdpa", plan=True)
PER_SCRIPT = {
    "sft": dict(per_device_train_batch_size=2, max_length=1024),
    "orpo": dict(per_device_train_batch_size=2, max_length=1024),
    "dpo": dict(per_device_train_batch_size=2, max_length=1024),
    "grpo": dict(
        group_size=4, prompts_per_step=8, groups_per_micro_batch=1, max_prompt_length=256, max_completion_length=512
    ),
}
NOTE = (
    " cards it fits, (no) = none. bf16, LoRA r 16 all-linear, gradient checkpointing on, sdpa, torch's AdamW unless "
    "8-bit AdamW (bitsandbytes; the embedding's moments fp32). SFT: 2 rows x 1,024 "
    "tokens; ORPO/DPO: 2 pairs x 1,024 tokens; GRPO: 8 prompts x G 4, prompts <= 256 and completions <= 512 tokens, "
    "HF rollout, 1 group per micro-batch, beta 0.04. Full fine-tuning keeps no second copy on the card: DPO "
    "precomputes its reference log-probs, GRPO swaps the starting weights in from host RAM for the reference pass."
)


def plan_on_card(module, args, size: str, card_gib: float) -> tuple[dict, bool, str]:
    """(plan parts, checkpointing, printed text) of module.memory_plan(args, []) as on a `card_gib` CUDA card with
    bf16, the model's config being Qwen2.5-`size`'s."""
    card = (int(card_gib * memory.GiB), f"{card_gib:g} GiB card")
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.cuda, "is_available", lambda: True))
        stack.enter_context(mock.patch.object(torch.cuda, "is_bf16_supported", lambda *a, **k: True))
        stack.enter_context(mock.patch.object(memory, "device_memory", lambda device: card))
        stack.enter_context(mock.patch.object(memory, "model_config", lambda name, trust=False: QWEN25[size]))
        out = stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
        parts, checkpointing = module.memory_plan(args, [])
    return parts, checkpointing, out.getvalue()


def capability_table(gpu_gib: list[float]) -> str:
    """The markdown table: GiB planned per cell, with the smallest card of gpu_gib it fits."""
    header = "| model | weights, training | " + " | ".join(METHODS) + " |"
    lines = [header, "|---|---|" + "---:|" * len(METHODS)]
    modules = {script: importlib.import_module(script) for script in METHODS.values()}
    for size in QWEN25:
        for name, variant in VARIANTS.items():
            cells = []
            for script, module in modules.items():
                fields = {f.name for f in dataclasses.fields(module.Args)}
                if not variant.keys() <= fields:  # no --no-use-lora: the reference is a LoRA slot
                    cells.append("n/a")
                    continue
                args = module.Args(model=f"Qwen/Qwen2.5-{size}", **COMMON, **PER_SCRIPT[script], **variant)
                args = resolve_preset(args, module.PRESETS)  # the real-model preset fills what is left unset
                # each card planned in turn, smallest first: a GPU rollout merges as many LoRA layers as the card
                # has room for, so a plan's total depends on the card (harness.memory.estimate)
                for card in sorted(gpu_gib):
                    gib = plan_on_card(module, args, size, card)[0]["total"] / memory.GiB
                    if gib <= card:
                        cells.append(f"{gib:.1f} ({card:g})")
                        break
                else:
                    cells.append(f"{gib:.1f} (no)")
            lines.append(f"| Qwen2.5-{size} | {name} | " + " | ".join(cells) + " |")
    sizes = ", ".join(map("{:g}".format, gpu_gib))
    return "\n".join(lines) + f"\n\nGiB planned; (N) = the smallest of {sizes} GiB" + NOTE


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu-memory", type=float, nargs="+", default=[24.0, 48.0], help="card sizes in GiB")
    print(capability_table(ap.parse_args().gpu_memory))

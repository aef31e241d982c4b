"""A reward model's "reward" slot on a 4-bit (NF4, bitsandbytes) policy base vs on the unquantized one, CPU: the
same rm.py final/ scores --pairs held-out preference pairs (chosen and rejected) through load_reward(dir, policy)
on a fp32 policy, on a 4-bit policy, and on the fp32 policy carrying the 4-bit layers' dequantized weights. Prints
4-bit vs dequantized (the slot's own error: expect 0) and 4-bit vs fp32 (NF4's rounding as the reward sees it).

    python rm.py --max-steps 8 --per-device-train-batch-size 4 --learning-rate 5e-4 --output-dir runs/rm
    OMP_NUM_THREADS=1 python bench/reward_4bit.py runs/rm/<run>/final"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo, for common/

import grpo
from common.data import load_rows, setup_chat_template
from common.completions import validate_rows
from common.model import attach_lora, load_model
from harness.hub import hub_rows, locate_model
from plugins.builtin_math import builtin_rows
from plugins.quantization import bnb_config
from plugins.reward_model import load_reward, read_config, score


def grpo_policy(model: str, quantization: str | None):
    """The fp32 policy as grpo.py builds it from its Args' defaults (base, chat template, new "default" LoRA)."""
    args = grpo.Args(model=model, dtype="fp32", quantization=quantization)
    policy, tokenizer = load_model(
        args.model,
        args.dtype,
        args.attn_implementation,
        bnb_config(args.quantization, args.dtype),
        args.gradient_checkpointing,
        args.trust_remote_code,
        path=locate_model(args.model),
    )
    setup_chat_template(tokenizer, args.template)
    return attach_lora(policy, args.adapter, args.lora_r, args.lora_alpha, args.lora_dropout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rm_dir", help="rm.py's final/ (its base_model is the policy's)")
    parser.add_argument("--dataset", default="builtin:math_preference")
    parser.add_argument("--split", default="test")
    parser.add_argument("--pairs", type=int, default=48)
    args = parser.parse_args()
    import bitsandbytes as bnb

    rows = load_rows(args.dataset, args.split, builtin=builtin_rows, hub=hub_rows)
    rows = validate_rows(rows, "preference")[: args.pairs]
    prompts, n = [r["prompt"] for r in rows] * 2, len(rows)
    completions = [r["chosen"] for r in rows] + [r["rejected"] for r in rows]
    model, t0 = read_config(args.rm_dir)["base_model"], time.perf_counter()
    policies = {q: grpo_policy(model, q) for q in (None, "4bit")}
    rewards = {q: load_reward(args.rm_dir, m) for q, m in policies.items()}
    scores = {q: score(r, prompts, completions)[:, 0] for q, r in rewards.items()}
    layers = dict(policies["4bit"].named_modules())
    with torch.no_grad():  # the fp32 policy with the NF4 weights, dequantized: the same numbers in fp32 layers
        for name, module in policies[None].named_modules():
            if isinstance(getattr(layers.get(name), "base_layer", None), bnb.nn.Linear4bit):
                w = layers[name].base_layer.weight
                module.base_layer.weight.copy_(bnb.functional.dequantize_4bit(w.data, w.quant_state))
    dequantized = score(rewards[None], prompts, completions)[:, 0]
    q4, fp32 = scores["4bit"], scores[None]
    diff, pairs = q4 - fp32, torch.combinations(torch.arange(2 * n))
    same = (torch.sign(q4[pairs[:, 0]] - q4[pairs[:, 1]]) == torch.sign(fp32[pairs[:, 0]] - fp32[pairs[:, 1]])).float()
    print(f"{args.rm_dir}: {n} pairs of {args.dataset}:{args.split}, {time.perf_counter() - t0:.0f} s")
    print(f"4-bit vs dequantized: max |diff| {(q4 - dequantized).abs().max():.2e}")
    print(f"4-bit vs fp32: max |diff| {diff.abs().max():.4f}, mean |diff| {diff.abs().mean():.4f}, mean diff ", end="")
    print(f"{diff.mean():+.4f} (std {diff.std():.4f}); fp32 scores' std {fp32.std():.4f}; correlation ", end="")
    correlation = torch.corrcoef(torch.stack([q4, fp32]))[0, 1]
    print(f"{correlation:.4f}; pairs of completions in the same order {same.mean():.3f}")
    for q, s in (("fp32", fp32), ("4-bit", q4)):
        margins = s[:n] - s[n:]
        print(f"{q}: accuracy {(margins > 0).float().mean():.3f}, mean margin {margins.mean():+.4f}")


if __name__ == "__main__":
    main()

"""The matmul work of the sft-4x512 preset's steps on both sides of bench/vs_trl.py, counted, not timed.

Per optimizer step, the multiply-adds of the decoder's linear layers and of the output head, forward and backward
(LoRA: the frozen base weights get only the input gradient, so each weight costs 2 FLOPs per token forward and 2
backward). LoRA's own A/B products and attention's score products are left out (a few percent here).
- TRL 1.16: every row right-padded to the step's longest; on a CPU every position, prompt and padding too, goes
  through the head (forward and input gradient).
- Ours (sft.py): the rows in length groups, each cut to its longest row (common.model.length_groups); the head
  sees only the completion tokens, twice (the logits, then d logp / d h in the same forward; common.model).
The rows are the preset's, tokenized by sft.py's own code and taken in the order both sides train on them.

    OMP_NUM_THREADS=1 python bench/sft_flops.py
"""

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="as vs_trl.py --steps (step 1 is warm-up, not counted)")
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    from bench.vs_trl import PRESETS, preset_rows
    from common.data import micro_batch, setup_chat_template
    from common.completions import tokenize_dataset
    from common.model import length_groups
    from harness.hub import locate_model
    from harness.memory import model_config, param_counts

    path = locate_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    setup_chat_template(tokenizer, "auto")
    _, over, _ = PRESETS["sft-4x512"]
    batch, max_length = over["batch_size"], over["max_length"]
    rows = preset_rows("sft-4x512", batch * args.steps, tokenizer, target_length=max_length)
    examples = tokenize_dataset(tokenizer, rows, "supervised", max_length)
    config = model_config(args.model)
    decoder = param_counts(config)[0]  # the decoder's linear layers (and their few bias elements)
    head = config["vocab_size"] * config["hidden_size"]
    print(f"decoder linears {decoder / 1e6:.1f}M weights, head {head / 1e6:.1f}M; GFLOP per optimizer step")
    print("| step | row tokens | completion tokens | ours: tokens / GFLOP | TRL: tokens / GFLOP | ours/TRL |")
    print("|---|---|---|---:|---:|---:|")
    ratios = []
    counted = {"ours": [], "trl": []}  # steps 2..N, as vs_trl.py's medians
    for step in range(args.steps):
        chunk = micro_batch(examples, step, batch, seed=0)  # sft.py's order (the bench's seed 0)
        lengths = [len(e["input_ids"]) for e in chunk]
        completions = [sum(e["completion_mask"]) for e in chunk]
        width = max(lengths)
        mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
        ours_tokens = sum(len(g) * (b - a) for g, a, b in length_groups(mask))
        trl_tokens = len(chunk) * width
        ours = 4 * decoder * ours_tokens + 4 * head * sum(completions)
        trl = 4 * decoder * trl_tokens + 4 * head * trl_tokens
        if step > 0:
            ratios.append(ours / trl)
            counted["ours"].append(ours)
            counted["trl"].append(trl)
        print(
            f"| {step + 1} | {lengths} | {completions} | {ours_tokens} / {ours / 1e9:.0f} | "
            f"{trl_tokens} / {trl / 1e9:.0f} | {ours / trl:.2f} |"
        )
    mine, theirs = counted["ours"], counted["trl"]
    print(
        f"steps 2-{args.steps}, ours/TRL: {sum(mine) / sum(theirs):.2f} of the FLOPs in all; median step over median "
        f"step (what vs_trl.py divides) {statistics.median(mine) / statistics.median(theirs):.2f}; median of the "
        f"steps' ratios {statistics.median(ratios):.2f}"
    )


if __name__ == "__main__":
    main()

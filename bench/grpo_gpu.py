"""GPU variant of bench/vs_trl.py for GRPO: grpo.py against TRL 1.16's GRPOTrainer on a random-init Qwen2.5-1.5B
(architecture from its config, built on the device: no download), G = 8 completions of one 256-token prompt per step,
1,024 new tokens each (a random model never samples EOS, so every completion is full length), LoRA r=16 all-linear,
bf16, sdpa attention, beta 0.04 (a reference pass on both), no gradient checkpointing.

Each side runs in a fresh subprocess; reported per side: seconds per phase (rollout, reward + reference,
train = forward/backward/optimizer) as the median over the measured steps (step 1 is warm-up: CUDA init, kernel
selection), seconds per step, tokens per second and peak GPU memory (torch.cuda.max_memory_allocated / reserved).
Sized for under 5 minutes in all on one H100/H200 (3 steps per side; generation dominates, ~25-35 s per rollout).

    python bench/grpo_gpu.py                    # both sides, Markdown table to stdout and --out/results_gpu.md
    python bench/grpo_gpu.py --side ours        # one side only
    python bench/grpo_gpu.py --dry-run          # a tiny config, runs on CPU: checks the code path, times nothing real

Phases. Ours: grpo.py's own time/rollout, time/reward + time/reference, time/train metrics (each phase ends in a host
sync: .tolist() after generate, .item() after backward). TRL: the trainer's _generate (rollout) and
_generate_and_score_completions (rollout + rewards + reference log-probs) are timed with torch.cuda.synchronize() on
both ends; train = the optimizer step's wall time minus _generate_and_score_completions.
"""

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.qwen_shapes import QWEN25_15B, TINY


def build(args):
    """(model on the device in bf16 (fp32 on CPU), tokenizer, rows of one prompt_len-token prompt each)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.tiny import build_tokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer = build_tokenizer()  # ChatML byte-level BPE; its 400 ids fit any vocab
    config = Qwen2Config(
        **(TINY if args.dry_run else QWEN25_15B),
        attn_implementation="sdpa",
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    with device:  # initialise directly on the device: no 6 GB host copy
        model = Qwen2ForCausalLM(config).to(dtype)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.config.use_cache = True
    rows = []
    for i in range(
        args.steps * args.prompts_per_step
    ):  # grow each prompt's text until the chat renders prompt_len ids
        text = f"Prompt {i}: " + " ".join(f"item{j} costs {j % 7 + 1} dollars" for j in range(args.prompt_len))
        lo, hi = 1, len(text)  # binary search on the characters kept (the token count grows with them)
        while lo < hi:
            mid = (lo + hi) // 2
            if prompt_len(tokenizer, text[:mid]) < args.prompt_len:
                lo = mid + 1
            else:
                hi = mid
        rows.append({"prompt": [{"role": "user", "content": text[:lo]}]})
    return model, tokenizer, rows


def prompt_len(tokenizer, content: str) -> int:
    return len(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    )


def reward(prompts, completions, completion_ids=None, **kw):
    """Cheap and the same on both sides: share of even token ids (a random model has variance on it)."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak():
    import torch

    if not torch.cuda.is_available():
        import resource

        return {"peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    return {
        "peak_allocated_gb": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gb": torch.cuda.max_memory_reserved() / 2**30,
    }


def run_ours(args, out):
    import grpo

    model, tokenizer, rows = build(args)
    # the model built on the device above, no disk round trip: grpo.main calls the load_model bound in its module
    grpo.load_model = lambda *a, **k: (model, tokenizer)
    model.config.save_pretrained(os.path.join(out, "random-qwen2.5-1.5b"))  # config.json alone: for the memory plan
    data = os.path.join(out, "prompts.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    result = grpo.main(
        grpo.Args(
            model=os.path.join(out, "random-qwen2.5-1.5b"),
            dataset=data,
            output_dir=os.path.join(out, "runs"),
            seed=0,
            rewards=["bench.grpo_gpu:reward"],
            group_size=args.group_size,
            prompts_per_step=args.prompts_per_step,
            groups_per_micro_batch=args.prompts_per_step,
            max_prompt_length=args.prompt_len + 8,
            preset="demo",
            max_completion_length=args.completion_len,
            max_steps=args.steps,
            beta=0.04,
            loss_type="dapo",
            learning_rate=1e-5,
            lora_dropout=0.0,
            breaker_action="warn",
            temperature=1.0,
        )
    )
    steps = []
    for h in result["history"]:
        total = sum(h[k] for k in ("time/rollout", "time/reward", "time/reference", "time/train"))
        steps.append(
            {
                "rollout": h["time/rollout"],
                "reward+reference": h["time/reward"] + h["time/reference"],
                "train": h["time/train"],
                "step": total,
                "tokens": h["perf/tokens_per_s"] * total,
                "completion_len": h["completions/mean_length"],
            }
        )
    return steps


def run_trl(args, out):
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model, tokenizer, rows = build(args)
    n = args.group_size * args.prompts_per_step  # TRL's per_device_train_batch_size counts completions
    # transformers 5.24 renamed TrainingArguments.gradient_checkpointing to activation_checkpointing (5.17: old name)
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    config = GRPOConfig(
        output_dir=os.path.join(out, "trl"),
        per_device_train_batch_size=n,
        gradient_accumulation_steps=1,
        num_generations=args.group_size,
        max_completion_length=args.completion_len,
        max_steps=args.steps,
        beta=0.04,
        loss_type="dapo",
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        temperature=1.0,
        top_k=0,
        bf16=torch.cuda.is_available(),
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        shuffle_dataset=False,
        seed=0,
        disable_dropout=True,
        use_bias_correction_kl=False,
        dataloader_pin_memory=False,
        **{checkpointing: False},
    )
    peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    phases = {"_generate": [], "_generate_and_score_completions": []}
    for name in phases:  # time the bound methods on this instance, synchronised
        method = getattr(trainer, name)

        def timed(*a, _method=method, _name=name, **k):
            sync()
            t0 = time.perf_counter()
            result = _method(*a, **k)
            sync()
            phases[_name].append(time.perf_counter() - t0)
            return result

        setattr(trainer, name, timed)
    stamps = []

    class Stamp(TrainerCallback):
        def on_step_begin(self, *_, **__):
            sync()
            stamps.append(time.perf_counter())

        def on_step_end(self, *_, **__):
            sync()
            stamps[-1] = time.perf_counter() - stamps[-1]

    trainer.add_callback(Stamp())
    trainer.train()
    history = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    cumulative = [h["num_tokens"] for h in history]
    tokens = [b - a for a, b in zip([0.0] + cumulative, cumulative)]
    return [
        {
            "rollout": g,
            "reward+reference": s - g,
            "train": step - s,
            "step": step,
            "tokens": tok,
            "completion_len": h["completions/mean_length"],
        }
        for g, s, step, tok, h in zip(
            phases["_generate"], phases["_generate_and_score_completions"], stamps, tokens, history
        )
    ]


def child(args):
    import torch

    out = os.path.join(args.out, args.side)
    os.makedirs(out, exist_ok=True)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    steps = run_ours(args, out) if args.side == "ours" else run_trl(args, out)
    print(json.dumps({"side": args.side, "steps": steps, **peak()}))


def summary(run: dict) -> dict:
    measured = run["steps"][1:] or run["steps"]  # step 1 is warm-up (CUDA context, allocator, kernel selection)
    med = {k: statistics.median(s[k] for s in measured) for k in ("rollout", "reward+reference", "train", "step")}
    med["tokens_per_s"] = sum(s["tokens"] for s in measured) / sum(s["step"] for s in measured)
    med["completion_len"] = statistics.mean(s["completion_len"] for s in measured)
    return med | {k: v for k, v in run.items() if k.startswith("peak")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", choices=["ours", "trl", "both"], default="both")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--completion-len", type=int, default=1024)
    parser.add_argument("--dry-run", action="store_true", help="tiny model, 16+16 tokens: exercises the code on CPU")
    parser.add_argument("--out", default="outputs/bench_grpo_gpu")
    parser.add_argument("--md", default=None, help="also write the table to this Markdown file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dry_run:
        args.prompt_len, args.completion_len = min(args.prompt_len, 32), min(args.completion_len, 16)
    if args.child:
        return child(args)
    results = {}
    for side in ("ours", "trl") if args.side == "both" else (args.side,):
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            "--side",
            side,
            "--steps",
            str(args.steps),
            "--group-size",
            str(args.group_size),
            "--prompts-per-step",
            str(args.prompts_per_step),
            "--prompt-len",
            str(args.prompt_len),
            "--completion-len",
            str(args.completion_len),
            "--out",
            args.out,
        ]
        cmd += ["--dry-run"] if args.dry_run else []
        t0 = time.perf_counter()
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false"},
        )
        if proc.returncode != 0:
            print(f"{side} failed:\n{proc.stderr[-4000:]}", flush=True)
            continue  # the other side's figures still come back
        results[side] = summary(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"{side}: {results[side]} ({time.perf_counter() - t0:.0f} s with start-up)", flush=True)
    md = markdown(results, args)
    os.makedirs(args.out, exist_ok=True)
    for path in (os.path.join(args.out, "results_gpu.md"), args.md):
        if path:
            with open(path, "w") as f:
                f.write(md)
    with open(os.path.join(args.out, "results_gpu.json"), "w") as f:  # for bench/gpu_check.sh's table
        json.dump(results, f, indent=1)
    print(md)
    if len(results) < (2 if args.side == "both" else 1):
        sys.exit(1)


def markdown(results: dict, args) -> str:
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (dry run)"
    mem = "peak_allocated_gb" if torch.cuda.is_available() else "peak_rss_gb"
    model = "tiny dry-run model" if args.dry_run else "random Qwen2.5-1.5B"
    lines = [
        f"`python bench/grpo_gpu.py {' '.join(sys.argv[1:])}` ({time.strftime('%Y-%m-%d')}, {device}; {model}, "
        f"G={args.group_size} x {args.prompts_per_step} prompt(s), prompt {args.prompt_len} / completion "
        f"{args.completion_len} tokens, LoRA r=16, bf16 on CUDA, beta 0.04)",
        "",
        "| side | rollout s | reward+reference s | train s | step s | tokens/s | completion len | peak GB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for side, r in results.items():
        cells = [f"{r[k]:.2f}" for k in ("rollout", "reward+reference", "train", "step")]
        cells += [f"{r['tokens_per_s']:.0f}", f"{r['completion_len']:.0f}", f"{r.get(mem, float('nan')):.2f}"]
        lines.append(f"| {side} | " + " | ".join(cells) + " |")
    if len(results) == 2:
        o, t = results["ours"], results["trl"]
        ratio = {k: o[k] / max(t[k], 1e-9) for k in ("rollout", "reward+reference", "train", "step", mem)}
        lines.append(
            f"| ours / TRL | {ratio['rollout']:.2f} | {ratio['reward+reference']:.2f} | {ratio['train']:.2f} "
            f"| **{ratio['step']:.2f}** | | | **{ratio[mem]:.2f}** |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

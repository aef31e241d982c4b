"""Speed and memory of our scripts against TRL 1.16's trainers, side by side on the same config, one torch thread.

Both sides run the parity harness's setup (scripts/compare_with_trl.py): same model, starting LoRA adapter, rows, row
order and mapped hyperparameters, fp32, no gradient checkpointing. TRL keeps its default fused AdamW (the harness
pins adamw_torch for bit-level parity; here TRL gets its fastest default). Every measured run is a fresh subprocess
(so peak RSS is that run's), and the runs alternate ours, TRL, ours, TRL, ... so drift on a shared CPU hits both.

Reported per side: median seconds per optimizer step (step 1 is warm-up and never counted), tokens per second (non-pad
tokens of the training forward, prompt + completion, summed over the measured steps / their time) and peak RSS
(ru_maxrss of the run, imports and model included), and the ratio ours / TRL. Also the median CPU seconds per step
(time.process_time of the one-thread process): on a shared machine wall time includes waiting for a core, CPU time
does not, so when the load average exceeds the cores the CPU ratio is the steadier of the two.

    OMP_NUM_THREADS=1 python bench/vs_trl.py                       # sft, dpo, grpo on the ~26M bench model
    OMP_NUM_THREADS=1 python bench/vs_trl.py --method grpo --model smollm2-135m
    OMP_NUM_THREADS=1 python bench/vs_trl.py --method dpo --repeats 3 --steps 8

Read the CPU ratios with TRL 1.16's CPU path in mind: its fused LM head compacts to the scored positions only where
Triton runs (CUDA), so on CPU it pushes every position (prompt and padding too) through the head, through torch
fallbacks of its Triton tiles, and also computes entropy / top-1 / mean-logit statistics. Ours scores only the
completion tokens on every device. SFT and DPO ratios here therefore overstate what a GPU would show.

The bench model: Qwen2 architecture from a config (hidden 384, 6 layers, 4 heads / 2 KV heads, MLP 1536, vocab
16,384, untied head: 25.9M parameters) with a byte-level BPE tokenizer trained here on the built-in math text (its ids
all fit in the vocab). Random weights: GRPO completions run to max_completion_length (no EOS), so every step has the
same length. Results go to --out/results.md (Markdown, with the command and date) and results.json.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# method -> (Setup overrides, measured steps incl. warm-up); sized for a few minutes per method on a shared 2-core CPU
CONFIGS = {
    "sft": dict(batch_size=8, learning_rate=2e-5),
    "dpo": dict(batch_size=4, learning_rate=5e-6),  # 4 pairs = 8 sequences per step
    "grpo": dict(prompts_per_step=2, group_size=8, max_completion_length=32, learning_rate=1e-4),  # 16 completions
}


def write_bench_model(out: str, vocab_size: int = 16384, hidden: int = 384, layers: int = 6) -> str:
    """~26M-parameter Qwen2 + a BPE tokenizer trained on the built-in math rows (ChatML template, eos <|im_end|>)."""
    path = os.path.join(out, f"bench_model_h{hidden}_l{layers}_v{vocab_size}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from common.embedded import make_math_problems
    from tests.tiny import CHATML_TEMPLATE, CORPUS, SPECIAL, build_tiny_model

    text = [f"{p['question']}\n{p['answer']}" for p in make_math_problems(2200, seed=0)] + CORPUS
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        text,
        trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML_TEMPLATE
    )
    model = build_tiny_model(
        vocab_size, hidden=hidden, layers=layers, intermediate_size=4 * hidden, max_position_embeddings=2048
    )
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id, cfg.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    tokenizer.save_pretrained(path)
    model.save_pretrained(path)
    return path


def setup_for(args, model: str, adapter: str, method: str):
    from scripts.compare_with_trl import Setup

    return Setup(
        method=method,
        model=model,
        adapter=adapter,
        out=os.path.join(args.out, "runs"),
        steps=args.steps,
        seed=0,
        **CONFIGS[method],
    )


def measure(args) -> dict:
    """Child process: one run of one side; returns per-step seconds and tokens for steps 2..N, and peak RSS."""
    import torch

    torch.set_num_threads(1)
    import datasets

    from scripts.compare_with_trl import (
        KIND,
        load_tokenizer,
        make_rows,
        quiet,
        run_ours,
        trl_history,
        trl_order,
        trl_trainer,
        write_jsonl,
    )

    datasets.disable_progress_bars()
    s = setup_for(args, args.model_path, args.adapter, args.method)
    os.makedirs(s.out, exist_ok=True)
    tokenizer = load_tokenizer(s.model)
    rows = make_rows(KIND[s.method], s.n_rows, tokenizer, target_length=s.max_completion_length // 2)
    stamps = []
    if args.child == "ours":
        import common.run

        log = common.run.Logger.log

        def timed_log(self, step, metrics):  # called once per step, right after it: consecutive stamps = step time
            stamps.append((time.perf_counter(), time.process_time()))
            return log(self, step, metrics)

        common.run.Logger.log = timed_log
        data = write_jsonl(os.path.join(s.out, f"data_{s.method}.jsonl"), rows)
        history = run_ours(s, data)
        if s.method == "grpo":  # attention-mask tokens of the step = tokens_per_s x the step's phases
            tokens = [
                h["perf/tokens_per_s"]
                * sum(h[k] for k in ("time/rollout", "time/reward", "time/reference", "time/train"))
                for h in history
            ]
        else:
            tokens = [h["num_tokens"] for h in history]
    else:
        from transformers import TrainerCallback

        class Stamp(TrainerCallback):
            def on_step_end(self, *_, **__):
                stamps.append((time.perf_counter(), time.process_time()))

        trainer = quiet(trl_trainer(s, [rows[i] for i in trl_order(s)], tokenizer, optim="adamw_torch_fused"))
        trainer.add_callback(Stamp())
        trainer.train()
        cumulative = [h["num_tokens"] for h in trl_history(trainer)]
        tokens = [b - a for a, b in zip([0.0] + cumulative, cumulative)]
    seconds = [b[0] - a[0] for a, b in zip(stamps, stamps[1:])]
    cpu_seconds = [b[1] - a[1] for a, b in zip(stamps, stamps[1:])]
    return {
        "side": args.child,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "tokens": tokens[1:],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def run_child(args, side: str, method: str, model: str, adapter: str) -> dict:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        side,
        "--method",
        method,
        "--model-path",
        model,
        "--adapter",
        adapter,
        "--steps",
        str(args.steps),
        "--out",
        args.out,
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TRL_EXPERIMENTAL_SILENCE": "1",
    }
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{side} {method} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarise(runs: list[dict]) -> dict:
    seconds = [x for r in runs for x in r["seconds"]]
    cpu = [x for r in runs for x in r["cpu_seconds"]]
    tokens = sum(sum(r["tokens"]) for r in runs)
    return {
        "s_per_step": statistics.median(seconds),
        "cpu_s_per_step": statistics.median(cpu),
        "tokens_per_s": tokens / sum(seconds),
        "tokens_per_cpu_s": tokens / sum(cpu),
        "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in runs),
        "steps_measured": len(seconds),
        "s_per_step_all": seconds,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", choices=[*CONFIGS, "all"], default="all")
    parser.add_argument("--model", default="bench", help="'bench' (the ~26M model built here) or a path / alias")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (the first is warm-up)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per side, alternating")
    parser.add_argument("--out", default="outputs/bench_vs_trl")
    parser.add_argument("--child", choices=["ours", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--adapter", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    from common.embedded import resolve_model
    from scripts.compare_with_trl import make_start_adapter

    os.makedirs(args.out, exist_ok=True)
    model = write_bench_model(args.out) if args.model == "bench" else resolve_model(args.model)
    adapter = make_start_adapter(model, os.path.join(args.out, f"adapter_{os.path.basename(model)}"))
    results = []
    for method in CONFIGS if args.method == "all" else (args.method,):
        runs = {"ours": [], "trl": []}
        for _ in range(args.repeats):
            for side in ("ours", "trl"):
                runs[side].append(run_child(args, side, method, model, adapter))
                print(
                    f"{method} {side}: s/step {[round(x, 3) for x in runs[side][-1]['seconds']]}, CPU s/step "
                    f"{[round(x, 3) for x in runs[side][-1]['cpu_seconds']]}, peak RSS "
                    f"{runs[side][-1]['peak_rss_mb']:.0f} MB",
                    flush=True,
                )
        ours, trl = summarise(runs["ours"]), summarise(runs["trl"])
        results.append(
            {
                "method": method,
                "model": os.path.basename(model.rstrip("/")),
                "config": CONFIGS[method],
                "ours": ours,
                "trl": trl,
            }
        )
    command = "OMP_NUM_THREADS=1 python bench/vs_trl.py " + " ".join(sys.argv[1:])
    md = markdown(results, command)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(md)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"command": command, "date": time.strftime("%Y-%m-%d %H:%M"), "results": results}, f, indent=1)
    print(md)


def markdown(results: list[dict], command: str) -> str:
    import torch
    import trl

    lines = [
        f"`{command}` ({time.strftime('%Y-%m-%d')}; torch {torch.__version__}, TRL {trl.__version__}, 1 thread, "
        f"{os.cpu_count()} vCPU shared)",
        "",
        "| method | model | config | ours s/step | TRL s/step | time ours/TRL | CPU s/step ours / TRL | CPU "
        "ours/TRL | ours tok/s | TRL tok/s | ours peak RSS (MB) | TRL peak RSS (MB) | RSS ours/TRL |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        o, t = r["ours"], r["trl"]
        cfg = ", ".join(f"{k}={v}" for k, v in r["config"].items() if k != "learning_rate")
        cells = [
            r["method"],
            r["model"],
            cfg,
            f"{o['s_per_step']:.3f}",
            f"{t['s_per_step']:.3f}",
            f"**{o['s_per_step'] / t['s_per_step']:.2f}**",
            f"{o['cpu_s_per_step']:.3f} / {t['cpu_s_per_step']:.3f}",
            f"**{o['cpu_s_per_step'] / t['cpu_s_per_step']:.2f}**",
            f"{o['tokens_per_s']:.0f}",
            f"{t['tokens_per_s']:.0f}",
            f"{o['peak_rss_mb']:.0f}",
            f"{t['peak_rss_mb']:.0f}",
            f"**{o['peak_rss_mb'] / t['peak_rss_mb']:.2f}**",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

"""The memory planner (each script's memory_plan over harness/memory.py) against measured peaks, CPU fp32: sft / dpo /
grpo on three models at two batch sizes each, every case in a fresh process.

Measured = peak RSS (VmHWM) minus the RSS after every import and before the model loads (the peak is reset there
through /proc/self/clear_refs). Estimated = the planner's parts that exist on a CPU: weights, LoRA + AdamW, the step's
activations, log-prob buffer and reference pass, the rollout's KV cache (not the runtime allowance nor the 10 %
allocator margin), from the script's own memory_plan(args, rows) with the rows the run plans with, against an
unbounded budget (the bench's plan is never refused nor switched to checkpointing). Every sequence reaches ~94-100 %
of max_length (near_full_rows; GRPO: random models never emit EOS, SmolLM2 is asked for long stories), so the
planner's worst case is the case that runs. Children run with MALLOC_MMAP_THRESHOLD_=65536: large blocks go straight
back to the OS when freed, so RSS follows the live tensors (glibc's default keeps freed blocks: docs/memory.md).

    OMP_NUM_THREADS=1 python bench/memory_check.py [--only sft-tiny-32] [--checkpointing] [--full]

--full trains every weight (--no-use-lora) in the sft and dpo cases (named <case>-full; DPO's reference is then
precomputed before the first update, its default): a gradient and two AdamW states per weight instead of the LoRA's.

`--demo-files DIR` runs each script on every LLaMA-Factory demo file it accepts (DIR holds alpaca_en_demo.json,
dpo_en_demo.json, kto_en_demo.json) as a user launches it: its CLI with defaults and the embedded SmolLM2-135M, a
few steps (--steps), without and with --gradient-checkpointing, each a fresh process under the environment this bench
was started with minus any MALLOC_* variable and LD_PRELOAD (glibc's malloc, as a user has it). Planned = the plan's
total as the run prints it; measured = the child's peak RSS (ru_maxrss: imports, weights, the final save included).
Exits 1 when a ratio planned / measured is below 1.0 or above 1.3.

On a CUDA machine, `--gpu` runs sft / dpo / grpo on a random-init Qwen2.5-1.5B (bench/qwen_shapes.py) in bf16 and
compares torch.cuda.max_memory_allocated with the planner's tensors (without the CUDA context and the allocator
margin, which max_memory_allocated does not see); `--gpu --tiny` runs the same cut down on a CPU (a dry run).
"""

import argparse
import atexit
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
WORDS = "the quick brown fox jumps over a lazy dog while Tom counts apples and Mia writes blue stickers".split()
KIND = {"sft": "supervised", "dpo": "preference", "grpo": "prompt"}  # each script's data kind (validate_rows)
SMALL_152K = dict(vocab_size=151936, hidden=256, layers=4, intermediate_size=640)  # Qwen2.5's vocabulary, tiny body
# (script, model) -> (two batch sizes, sequence length): sized so that the larger case stays under ~4 GB
CASES = {
    ("sft", "tiny"): ((32, 64), 512),
    ("dpo", "tiny"): ((16, 32), 512),
    ("grpo", "tiny"): ((4, 8), 256),
    ("sft", "v152k"): ((4, 8), 512),
    ("dpo", "v152k"): ((2, 4), 512),
    ("grpo", "v152k"): ((1, 2), 256),
    ("sft", "smollm2"): ((2, 4), 256),
    ("dpo", "smollm2"): ((1, 2), 256),
    ("grpo", "smollm2"): ((1, 2), 64),
}


def text(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(n_words))


def write_data(folder: str) -> dict[str, str]:
    """JSONL rows: 3 of 4 completions far longer than any max_length here (cut to it), every 4th short (the child
    lengthens it to ~94 % of max_length: near_full_rows); DPO: chosen long, rejected likewise; GRPO prompts of 8-10
    words (left padding)."""
    long = [text(900 if i % 4 else 30, i) for i in range(64)]
    rows = {
        "sft": [{"prompt": "Write: " + text(4, i), "completion": long[i]} for i in range(64)],
        "dpo": [{"prompt": "Say: " + text(4, i), "chosen": text(900, i), "rejected": text(30, i)} for i in range(64)],
        "grpo": [{"prompt": "Write a very long story about " + text(8 + i % 3, i), "answer": "1"} for i in range(64)],
    }
    paths = {}
    for kind, rs in rows.items():
        paths[kind] = os.path.join(folder, f"{kind}.jsonl")
        with open(paths[kind], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rs)
    return paths


def write_v152k(out_dir: str) -> str:
    """tests/tiny.py's tokenizer (400 ids, all below 151,936) + a random Qwen2 with a 151,936-row vocabulary."""
    from tests.tiny import build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_tiny_model(**SMALL_152K)
    model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = model.generation_config.pad_token_id = tokenizer.pad_token_id
    tokenizer.save_pretrained(out_dir)
    model.save_pretrained(out_dir)
    return out_dir


def case_args(script: str, model: str, batch: int, seq: int, data: str, out: str) -> dict:
    common = dict(model=model, dataset=data, output_dir=out, max_steps=2, save_steps=0, logging_steps=1)
    if script == "sft":
        return common | dict(per_device_train_batch_size=batch, max_length=seq)
    if script == "dpo":
        return common | dict(per_device_train_batch_size=batch, max_length=seq, max_prompt_length=32)
    return common | dict(
        prompts_per_step=batch,
        groups_per_micro_batch=batch,
        group_size=4,
        max_completion_length=seq,
        eval_steps=0,
        temperature=1.0,
        learning_rate=1e-5,
        torch_threads=1,
    )


# (script, demo file, extra flags): every pairing the scripts accept (sft reads kto_en_demo's messages; kto unpairs
# dpo_en_demo's preference rows)
DEMO_CASES = [
    ("sft", "alpaca_en_demo.json", ["--convert", "alpaca"]),
    ("sft", "kto_en_demo.json", []),
    ("dpo", "dpo_en_demo.json", []),
    ("orpo", "dpo_en_demo.json", []),
    ("rm", "dpo_en_demo.json", []),
    ("kto", "dpo_en_demo.json", []),
    ("kto", "kto_en_demo.json", []),
]
LOW, HIGH = 1.0, 1.3  # planned / measured must lie within


def demo_case(script: str, path: str, flags: list[str], steps: int, checkpointing: bool, out: str) -> dict:
    """One user's run in a fresh process: the plan's total (GiB) it printed, whether checkpointing ran (asked or
    turned on by the plan), its peak RSS (GiB, ru_maxrss) and the largest memory/peak_gb it logged."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    cmd = [sys.executable, f"{script}.py", "--dataset", path, *flags, "--max-steps", str(steps)]
    cmd += ["--save-steps", "0", "--report-to", "none", "--output-dir", out]
    cmd += ["--gradient-checkpointing"] if checkpointing else []
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    text = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} exited {proc.returncode}:\n{text[-3000:]}")
    planned = float(re.findall(r"^  total +([\d.]+) GiB", text, re.M)[-1])
    logged = []
    for root, _, files in os.walk(out):
        if "metrics.jsonl" in files:
            with open(os.path.join(root, "metrics.jsonl")) as f:
                logged += [json.loads(line).get("memory/peak_gb", 0) for line in f if line.strip()]
    shutil.rmtree(out, ignore_errors=True)
    return dict(
        planned=planned,
        measured=usage.ru_maxrss / 2**20,  # KiB
        logged=max(logged, default=0.0),
        checkpointing=checkpointing or "gradient checkpointing turned on" in text,
        seconds=time.perf_counter() - t0,
    )


def demo_files(folder: str, steps: int, only: list[str] | None, md: str | None) -> None:
    """The table of planned vs measured peaks over DEMO_CASES, without and with --gradient-checkpointing."""
    with open("/proc/loadavg") as f:
        print(f"load average at the start: {f.read().split()[:3]}", flush=True)
    head = "| script | file | checkpointing | planned (GiB) | measured peak RSS (GiB) | planned / measured |"
    rows = [head, "|---|---|---|---:|---:|---:|"]
    bad = []
    for script, name, flags in DEMO_CASES:
        for asked in (False, True):
            case = f"{script}-{name.split('_')[0]}" + ("-ckpt" if asked else "")
            if only and case not in only:
                continue
            out = tempfile.mkdtemp(prefix="memdemo-")
            r = demo_case(script, os.path.join(folder, name), flags, steps, asked, out)
            ratio = r["planned"] / r["measured"]
            how = "asked" if asked else ("on (by the plan)" if r["checkpointing"] else "off")
            rows.append(f"| {script} | {name} | {how} | {r['planned']:.2f} | {r['measured']:.2f} | {ratio:.2f} |")
            print(rows[-1], f"({case}: {r['seconds']:.0f} s, memory/peak_gb logged {r['logged']:.2f})", flush=True)
            if not LOW <= ratio <= HIGH:
                bad.append(f"{case} {ratio:.2f}")
    with open("/proc/loadavg") as f:
        print(f"load average at the end: {f.read().split()[:3]}")
    table = "\n".join(rows) + "\n"
    print("\n" + table)
    if md:
        with open(md, "w") as f:
            f.write(table)
    if bad:
        sys.exit(f"planned / measured outside [{LOW}, {HIGH}]: {', '.join(bad)}")


GPU_CASES = {"sft": (4, 1024), "dpo": (2, 1024), "grpo": (4, 512)}  # random weights: completions run full length
# the dry run's: dpo at 4 pairs so that its scored tokens (short rejected rows) still fill a 1,024-row logits chunk
GPU_TINY = {"sft": (1, 256), "dpo": (4, 256), "grpo": (1, 128)}


def near_full_rows(args, script: str, folder: str) -> str:
    """The case's rows rewritten so that every batch is the planner's worst case under length grouping
    (common.model.length_groups): each short completion (every 4th SFT row, every DPO rejected) is cut to the words
    that make its row ~94 % of max_length in this model's tokens, so a batch is one group, padded (sdpa keeps a mask
    and all-head k, v) and ~max_length long; rows far shorter would run as a group of their own and take less."""
    from transformers import AutoTokenizer

    from common.data import setup_chat_template
    from common.completions import tokenize_dataset, validate_rows
    from harness.hub import locate_model

    tokenizer = AutoTokenizer.from_pretrained(locate_model(args.model))
    setup_chat_template(tokenizer, args.template)
    kind, key = ("supervised", "completion") if script == "sft" else ("preference", "rejected")
    target = int(0.94 * args.max_length)

    def size(row: dict) -> int:
        kw = {"max_prompt_length": args.max_prompt_length} if script == "dpo" else {}
        e = tokenize_dataset(tokenizer, validate_rows([row], kind), kind, None, **kw)[0]
        return len(e["input_ids"]) if script == "sft" else len(e["prompt_ids"]) + len(e["rejected_ids"])

    rows = load_rows_plain(args.dataset)
    for i, row in enumerate(rows):
        if script == "sft" and i % 4:
            continue  # a long row: cut to max_length by the script
        words, lo, hi = text(900, i).split(), 1, 900  # the most words whose row stays within the target
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if size(row | {key: " ".join(words[:mid])}) <= target else (lo, mid - 1)
        row[key] = " ".join(words[:lo])
    path = os.path.join(folder, f"{script}-near-full-{os.getpid()}.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def load_rows_plain(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith(field + ":")))


def child(spec: dict) -> None:
    """Run one case in this process: baseline after imports, peak over the run, and the planner's estimate."""
    import importlib

    import peft  # noqa: F401  everything the run imports later, so the baseline holds it
    import torch.utils.tensorboard
    import transformers  # noqa: F401

    from common.data import load_rows, setup_chat_template
    from common.completions import tokenize_dataset, validate_rows
    from harness import memory
    from harness.hub import hub_rows
    from plugins.builtin_math import question_row
    from harness.cli import resolve_preset
    from harness.hub import locate_model

    mod = importlib.import_module(spec["script"])
    args = mod.Args(**spec["args"])
    if spec["script"] == "grpo":  # the prompt limit = the longest templated prompt, so the planner's P is what runs
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(locate_model(args.model))
        setup_chat_template(tokenizer, args.template)
        prompts = validate_rows(load_rows(args.dataset, "train", question_row, hub=hub_rows), "prompt")
        examples = tokenize_dataset(tokenizer, prompts, "prompt", None)
        args.max_prompt_length = max(len(e["prompt_ids"]) for e in examples)
    if spec["script"] in ("sft", "dpo"):
        args.dataset = near_full_rows(args, spec["script"], os.path.dirname(args.dataset))
    resolved = resolve_preset(args, mod.PRESETS) if hasattr(mod, "PRESETS") else args
    # the rows the script plans with (they bound the sequence lengths below max_length when all are shorter)
    convert = question_row if KIND[spec["script"]] == "prompt" else None  # GSM8K's layout: prompt rows
    rows = load_rows(resolved.dataset, resolved.dataset_split, convert, hub=hub_rows)
    rows = validate_rows(rows, KIND[spec["script"]])
    import torch

    cuda = torch.cuda.is_available()
    # The script's own plan, against a budget it always fits: never refused, never switched to checkpointing here
    unbounded = mock.patch.object(memory, "device_memory", lambda device: (2**60, "unbounded budget (bench)"))
    with unbounded, contextlib.redirect_stdout(io.StringIO()):
        parts, _ = mod.memory_plan(resolved, rows)
    off_cpu = ("allowance (runtime)", "allocator (10 %)")  # the CUDA-or-runtime allowance and the margin
    cpu_parts = {k: v for k, v in parts.items() if k not in ("total", *off_cpu)}
    est = parts["total"] - sum(parts[k] for k in off_cpu)
    baseline = torch.cuda.memory_allocated() if cuda else rss_kib("VmRSS") * 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
    t0 = time.perf_counter()
    result = mod.main(args)
    measured = (torch.cuda.max_memory_allocated() if cuda else rss_kib("VmHWM") * 1024) - baseline
    lengths = [h.get("completions/mean_length") for h in result.get("history", [])]
    print(
        "RESULT "
        + json.dumps(
            dict(
                estimate=est, measured=measured, parts=cpu_parts, seconds=time.perf_counter() - t0, mean_length=lengths
            )
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="case names to run (e.g. dpo-smollm2-2)")
    ap.add_argument("--gpu", action="store_true", help="random Qwen2.5-1.5B in bf16 on CUDA (see above)")
    ap.add_argument("--tiny", action="store_true", help="with --gpu: cut-down shapes on a CPU (dry run)")
    ap.add_argument("--qwen-dir", help="with --gpu: the random model bench/qwen_shapes.py wrote there (else written)")
    ap.add_argument("--checkpointing", action="store_true", help="every case with --gradient-checkpointing")
    ap.add_argument("--full", action="store_true", help="sft and dpo cases with --no-use-lora (grpo's are skipped)")
    ap.add_argument("--md", help="also write the table to this file")
    ap.add_argument("--demo-files", metavar="DIR", help="each script on LLaMA-Factory's demo files in DIR (see above)")
    ap.add_argument("--steps", type=int, default=2, help="with --demo-files: optimizer steps per run")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    cli = ap.parse_args()
    if cli.child:
        return child(json.loads(cli.child))
    if cli.demo_files:
        return demo_files(cli.demo_files, cli.steps, cli.only, cli.md)
    from tests.tiny import write_tiny

    tmp = tempfile.mkdtemp(prefix="memcheck-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)  # the models written here take up to ~3 GB (--gpu)
    data = write_data(tmp)
    cases = CASES
    if cli.gpu:  # one batch size per script: the 1.5B's cases take a minute each
        from bench.qwen_shapes import QWEN25_15B, TINY, write_random_qwen

        name = "qwen-tiny-shapes" if cli.tiny else "qwen2.5-1.5b-random"
        shapes = TINY if cli.tiny else QWEN25_15B
        paths = {name: cli.qwen_dir or write_random_qwen(os.path.join(tmp, name), shapes)}
        cases = {(s, name): ((b,), n) for s, (b, n) in (GPU_TINY if cli.tiny else GPU_CASES).items()}
    else:
        paths = {"tiny": write_tiny(os.path.join(tmp, "tiny")), "smollm2": "smollm2-135m"}
        paths["v152k"] = write_v152k(os.path.join(tmp, "v152k"))
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536", TOKENIZERS_PARALLELISM="false")
    rows, worst = [], 0.0
    for (script, model), (batches, seq) in cases.items():
        for batch in batches:
            name = f"{script}-{model}-{batch}" + ("-full" if cli.full else "")
            if (cli.only and name not in cli.only) or (cli.full and script == "grpo"):
                continue
            spec_args = case_args(script, paths[model], batch, seq, data[script], tmp)
            spec_args |= dict(gradient_checkpointing=cli.checkpointing) | (dict(use_lora=False) if cli.full else {})
            spec = dict(script=script, args=spec_args)
            proc = subprocess.run(
                [sys.executable, __file__, "--child", json.dumps(spec)],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
            )
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
            r = json.loads(line[len("RESULT ") :])
            err = r["estimate"] / r["measured"] - 1
            worst = max(worst, abs(err))
            shape = f"{batch} x {seq}" if script != "grpo" else f"{batch} x G 4 x {seq}"
            trained = " full" if cli.full else ""
            rows.append(
                f"| {script}{trained} | {model} | {shape} | {r['estimate'] / 2**20:,.0f} | "
                f"{r['measured'] / 2**20:,.0f} | {err:+.1%} |"
            )
            print(
                rows[-1],
                f"({r['seconds']:.0f} s; parts MiB: "
                + ", ".join(f"{k} {v / 2**20:.0f}" for k, v in r["parts"].items())
                + (f"; completions' mean length per step {r['mean_length']}" if script == "grpo" else "")
                + ")",
                flush=True,
            )
    head = (
        "| script | model | batch x length | estimate (MiB) | measured (MiB) | error |\n|---|---|---|---:|---:|---:|"
    )
    table = "\n".join([head, *rows, "", f"worst relative error: {worst:.1%}"]) + "\n"
    print("\n" + table)
    if cli.md:
        with open(cli.md, "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()

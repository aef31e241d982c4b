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

    OMP_NUM_THREADS=1 python bench/vs_trl.py --cpu 1                # issue #19's three presets on SmolLM2-135M
    OMP_NUM_THREADS=1 python bench/vs_trl.py --preset sft-8 dpo-4 grpo-2x8   # the first bench's, on the ~26M model
    OMP_NUM_THREADS=1 python bench/vs_trl.py --preset dpo-4x512 --repeats 3 --steps 5
    OMP_NUM_THREADS=1 python bench/vs_trl.py --preset dpo-full-4 dpo-full-live-4 --steps 3  # full FT

Presets (PRESETS below): grpo-4x4 = 4 built-in math prompts (asking for "#### N") x G 4, <= 64 new tokens, T 1.0,
beta 0.04, loss grpo; dpo-4x512 = 4 pairs of single-turn dpo_en_demo rows, max_length 512, sigmoid; sft-4x512 = 4
alpaca_en_demo rows, max_length 512, completion-only loss (both from ../shared/data/llamafactory-demo, truncated
from the right on both sides); dpo-full-4 / dpo-full-live-4 = 4 built-in math pairs with every weight trained, the
reference precomputed on both sides / scored every step (docs/memory.md). Each side's phases come back too: ours
from the scripts' time/* metrics, TRL's from TRLPhases (wrappers around its model's forward, accelerator.backward
and GRPO's generation). With --cpu every
measured process is pinned to that core (taskset), and the 1-minute load average is recorded before and after each.
Allocators: --ours-malloc / --trl-malloc preload jemalloc or tcmalloc (LD_PRELOAD, MALLOCS below) into that side's
processes, or nothing (system: glibc); --allocator puts both sides under the same one. The scripts never choose an
allocator themselves (their launcher does: `LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 python dpo.py`),
so this bench sets LD_PRELOAD for each side's processes, and each child reports the allocator it actually runs
under (a preload the loader could not apply stops the bench). Defaults: ours jemalloc when installed (ours as
launched with jemalloc, docs/results.md's tables), TRL system, as `trl` runs out of the box.

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
import importlib
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DATA = os.path.join(os.path.dirname(ROOT), "shared", "data", "llamafactory-demo")  # ../shared/data (read-only)

# preset -> (method, Setup overrides, rows). Rows: "builtin" = the harness's built-in math rows (GRPO: prompts that ask
# for "#### N"); (file, converter) = rows of a LLaMA-Factory demo file (DPO: single-turn conversations only), in file
# order. The first three are issue #19's configurations; the rest are the first bench's own (smaller) ones.
PRESETS = {
    "grpo-4x4": (
        "grpo",
        dict(prompts_per_step=4, group_size=4, max_completion_length=64, loss_type="grpo"),
        "builtin",
    ),
    "dpo-4x512": ("dpo", dict(batch_size=4, max_length=512, learning_rate=5e-6), ("dpo_en_demo.json", "sharegpt")),
    "sft-4x512": ("sft", dict(batch_size=4, max_length=512, learning_rate=2e-5), ("alpaca_en_demo.json", "alpaca")),
    "sft-8": ("sft", dict(batch_size=8, learning_rate=2e-5), "builtin"),
    "dpo-4": ("dpo", dict(batch_size=4, learning_rate=5e-6), "builtin"),  # 4 pairs = 8 sequences per step
    "grpo-2x8": ("grpo", dict(prompts_per_step=2, group_size=8, max_completion_length=32), "builtin"),
    # full fine-tuning (issue #27): the reference precomputed on both sides (ours' default with --no-use-lora; TRL:
    # precompute_ref_log_probs=True, no peft_config), or scored every step (ours: the starting weights' CPU copy
    # swapped in; TRL's default: a second model)
    "dpo-full-4": ("dpo", dict(batch_size=4, learning_rate=1e-6, use_lora=False), "builtin"),
    "dpo-full-live-4": (
        "dpo",
        dict(batch_size=4, learning_rate=1e-6, use_lora=False, precompute_ref=False),
        "builtin",
    ),
}
for _method, _over, _ in PRESETS.values():  # GRPO: the harness's 1e-3 is for its tiny model
    _over.setdefault("learning_rate", 1e-4)
ISSUE_PRESETS = ("grpo-4x4", "dpo-4x512", "sft-4x512")
FULL_PRESETS = ("dpo-full-4", "dpo-full-live-4")  # issue #27's memory comparison, on SmolLM2-135M too
# --ours-malloc / --trl-malloc / --allocator: the child's LD_PRELOAD (system = glibc's malloc, nothing preloaded)
MALLOCS = {
    "system": None,
    "jemalloc": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",  # Debian/Ubuntu's libjemalloc2
    "tcmalloc": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",  # libtcmalloc-minimal4
}


def preset_rows(preset: str, n: int, tokenizer, target_length: int) -> list[dict]:
    """The first n rows of the preset's data, rendered to standard strings as the harness's make_rows does (prompt
    through the chat template's generation prompt, completions = the assistant text), the same on both sides."""
    from common.data import load_rows
    from scripts.compare_with_trl import KIND, make_rows

    method, _, source = PRESETS[preset]
    if source == "builtin":
        return make_rows(KIND[method], n, tokenizer, target_length=target_length)
    name, convert = source
    raw = load_rows(os.path.join(DATA, name), convert=importlib.import_module("sft").CONVERTERS[convert])
    if method == "dpo":  # single-turn: one user message as the prompt
        raw = [r for r in raw if len(r["prompt"]) == 1]
    if len(raw) < n:
        raise ValueError(f"{name}: {len(raw)} usable rows, {n} needed (fewer --steps)")

    def render(prompt):
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)

    keys = ("chosen", "rejected") if method == "dpo" else ("completion",)
    return [{"prompt": render(r["prompt"])} | {k: r[k][0]["content"] for k in keys} for r in raw[:n]]


def write_bench_model(out: str, vocab_size: int = 16384, hidden: int = 384, layers: int = 6) -> str:
    """~26M-parameter Qwen2 + a BPE tokenizer trained on the built-in math rows (ChatML template, eos <|im_end|>)."""
    path = os.path.join(out, f"bench_model_h{hidden}_l{layers}_v{vocab_size}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from plugins.builtin_math import make_math_problems
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


def setup_for(args, model: str, adapter: str):
    from scripts.compare_with_trl import Setup

    method, over, _ = PRESETS[args.preset]
    return Setup(
        method=method,
        model=model,
        adapter=adapter,
        out=os.path.join(args.out, "runs"),
        steps=args.steps,
        seed=0,
        **over,
    )


class TRLPhases:
    """Seconds per phase of TRL's steps, from wrappers around what its trainer calls (no change to its math):
    generation = GRPOTrainer._generate_single_turn; reference = forwards of the trained model under no_grad outside
    generation (TRL runs the "ref" adapter under torch.no_grad); forward = forwards with grad; backward =
    accelerator.backward; other = the rest of the step (optimizer, clipping, data, logging)."""

    def __init__(self, trainer):
        self.seconds, self.steps, self.in_generation, self.t_forward = {}, [], False, None
        model = trainer.model
        model.register_forward_pre_hook(self._pre)
        model.register_forward_hook(self._post)
        backward = trainer.accelerator.backward
        trainer.accelerator.backward = lambda *a, **k: self._timed("backward", backward, *a, **k)
        if hasattr(trainer, "_generate_single_turn"):
            generate = trainer._generate_single_turn

            def timed_generate(*a, **k):
                self.in_generation = True
                try:
                    return self._timed("generation", generate, *a, **k)
                finally:
                    self.in_generation = False

            trainer._generate_single_turn = timed_generate

    def _timed(self, phase, fn, *a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            self.add(phase, time.perf_counter() - t)

    def add(self, phase, seconds):
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def _pre(self, *_):
        self.t_forward = time.perf_counter()

    def _post(self, *_):
        if not self.in_generation:
            self.add("forward" if torch_grad_enabled() else "reference", time.perf_counter() - self.t_forward)

    def end_step(self, step_seconds: float | None):
        if step_seconds is not None:  # the step's remainder: optimizer, clipping, data, logging
            self.steps.append(self.seconds | {"other": step_seconds - sum(self.seconds.values())})
        self.seconds = {}


def torch_grad_enabled() -> bool:
    import torch

    return torch.is_grad_enabled()


def measure(args) -> dict:
    """Child process: one run of one side; returns per-step seconds, phases and tokens for steps 2..N, peak RSS."""
    import torch

    torch.set_num_threads(1)
    import datasets

    from scripts.compare_with_trl import load_tokenizer, quiet, run_ours, trl_history, trl_order, trl_trainer
    from scripts.compare_with_trl import write_jsonl

    datasets.disable_progress_bars()
    s = setup_for(args, args.model_path, args.adapter)
    os.makedirs(s.out, exist_ok=True)
    tokenizer = load_tokenizer(s.model)
    rows = preset_rows(args.preset, s.n_rows, tokenizer, target_length=s.max_completion_length // 2)
    stamps, phases = [], []
    if args.child == "ours":
        from harness.run import Logger  # the class every script imports: its log() is patched for all of them

        log = Logger.log

        def timed_log(self, step, metrics):  # called once per step, right after it: consecutive stamps = step time
            stamps.append((time.perf_counter(), time.process_time()))
            return log(self, step, metrics)

        Logger.log = timed_log
        data = write_jsonl(os.path.join(s.out, f"data_{args.preset}.jsonl"), rows)
        history = run_ours(s, data)
        phases = [{k[len("time/") :]: v for k, v in h.items() if k.startswith("time/")} for h in history]
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

        trainer = quiet(trl_trainer(s, [rows[i] for i in trl_order(s)], tokenizer, optim="adamw_torch_fused"))
        timer = TRLPhases(trainer)

        class Stamp(TrainerCallback):
            def on_step_end(self, *_, **__):
                stamps.append((time.perf_counter(), time.process_time()))
                timer.end_step(stamps[-1][0] - stamps[-2][0] if len(stamps) > 1 else None)

        trainer.add_callback(Stamp())
        trainer.train()
        phases = [{}] + timer.steps  # step 1 (warm-up) has no start stamp
        cumulative = [h["num_tokens"] for h in trl_history(trainer)]
        tokens = [b - a for a, b in zip([0.0] + cumulative, cumulative)]
    seconds = [b[0] - a[0] for a, b in zip(stamps, stamps[1:])]
    cpu_seconds = [b[1] - a[1] for a, b in zip(stamps, stamps[1:])]
    return {
        "side": args.child,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "phases": phases[1:],
        "tokens": tokens[1:],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "malloc": mapped_malloc(),
    }


def mapped_malloc() -> str:
    """The MALLOCS name of the allocator mapped into this process (system: none of the preloadable ones)."""
    with open("/proc/self/maps") as f:
        maps = f.read()
    return next((name for name, lib in MALLOCS.items() if lib and os.path.basename(lib) in maps), "system")


def run_child(args, side: str, preset: str, model: str, adapter: str) -> dict:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        side,
        "--preset",
        preset,
        "--model-path",
        model,
        "--adapter",
        adapter,
        "--steps",
        str(args.steps),
        "--out",
        args.out,
    ]
    if args.cpu is not None:  # pin the measured process to one core (the same one for both sides)
        cmd = ["taskset", "-c", str(args.cpu), *cmd]
    lib = MALLOCS[getattr(args, f"{side}_malloc")]
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"} | ({"LD_PRELOAD": lib} if lib else {})
    env = {
        **env,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TRL_EXPERIMENTAL_SILENCE": "1",
    }
    load = os.getloadavg()[0]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{side} {preset} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if result["malloc"] != getattr(args, f"{side}_malloc"):  # the table would name an allocator that did not run
        asked = getattr(args, f"{side}_malloc")
        raise RuntimeError(f"{side} {preset}: asked for {asked}, ran under {result['malloc']}:\n{proc.stderr[-2000:]}")
    return result | {"load": [load, os.getloadavg()[0]]}


def summarise(runs: list[dict]) -> dict:
    seconds = [x for r in runs for x in r["seconds"]]
    cpu = [x for r in runs for x in r["cpu_seconds"]]
    tokens = sum(sum(r["tokens"]) for r in runs)
    steps = [p for r in runs for p in r["phases"]]
    names = sorted({k for p in steps for k in p})
    return {
        "s_per_step": statistics.median(seconds),
        "cpu_s_per_step": statistics.median(cpu),
        "tokens_per_s": tokens / sum(seconds),
        "tokens_per_cpu_s": tokens / sum(cpu),
        "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in runs),
        "steps_measured": len(seconds),
        "s_per_step_all": seconds,
        "phases": {k: statistics.median(p.get(k, 0.0) for p in steps) for k in names},
        "load": [x for r in runs for x in r["load"]],
    }


# (name, ours' phase, TRL's phase): the GRPO rollout against TRL's generation, per repeat
PHASE_RATIOS = [("generation", "rollout", "generation")]


def paired_ratios(ours: list[dict], trl: list[dict]) -> dict[str, list[float]]:
    """Ratio ours / TRL of each repeat's pair of runs (run i of each side, run one after the other), per measure:
    wall and CPU s/step (each run's median over its measured steps), peak RSS, and the GRPO generation phase. The
    spread of these ratios is what a reader can expect to see on a re-run; one pooled median hides it."""
    out = {"time": [], "cpu": [], "rss": []}
    for o, t in zip(ours, trl):
        out["time"].append(statistics.median(o["seconds"]) / statistics.median(t["seconds"]))
        out["cpu"].append(statistics.median(o["cpu_seconds"]) / statistics.median(t["cpu_seconds"]))
        out["rss"].append(o["peak_rss_mb"] / t["peak_rss_mb"])
        for name, ours_phase, trl_phase in PHASE_RATIOS:
            a = [p[ours_phase] for p in o["phases"] if ours_phase in p]
            b = [p[trl_phase] for p in t["phases"] if trl_phase in p]
            if a and b:
                out.setdefault(name, []).append(statistics.median(a) / statistics.median(b))
    return out


def spread(ratios: list[float]) -> str:
    """'median (min-max)' of a list of ratios, two places: the figure to quote with its range."""
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", nargs="+", default=list(ISSUE_PRESETS), help=f"any of {', '.join(PRESETS)}")
    parser.add_argument(
        "--model",
        default=None,
        help="'bench' (the ~26M model built here) or a path / alias; "
        f"default: smollm2-135m for {', '.join(ISSUE_PRESETS + FULL_PRESETS)}, bench for the others",
    )
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run (the first is warm-up)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs per side, alternating (a ratio is quoted as the median and range"
        " of the repeats' ratios: at least 3)",
    )
    parser.add_argument("--cpu", type=int, default=None, help="pin each measured run to this core (taskset -c)")
    parser.add_argument("--out", default="outputs/bench_vs_trl")
    default = "jemalloc" if os.path.exists(MALLOCS["jemalloc"]) else "system"
    parser.add_argument(
        "--ours-malloc",
        choices=list(MALLOCS),
        default=None,
        help=f"our side's allocator (LD_PRELOAD); default jemalloc when installed, else system (here: {default}): "
        "ours as launched with LD_PRELOAD=<jemalloc>, the scripts never pick one themselves",
    )
    parser.add_argument(
        "--trl-malloc", choices=list(MALLOCS), default=None, help="TRL's side's allocator; default system"
    )
    parser.add_argument(
        "--allocator", choices=list(MALLOCS), default=None, help="both sides' allocator (instead of the two above)"
    )
    parser.add_argument("--child", choices=["ours", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--adapter", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.allocator is not None:
        if args.ours_malloc is not None or args.trl_malloc is not None:
            parser.error("--allocator sets both sides: leave out --ours-malloc / --trl-malloc")
        args.ours_malloc = args.trl_malloc = args.allocator
    args.ours_malloc = args.ours_malloc or default
    args.trl_malloc = args.trl_malloc or "system"
    if args.child:
        args.preset = args.preset[0]
        print(json.dumps(measure(args)))
        return
    if args.repeats < 3:
        parser.error(f"--repeats {args.repeats}: at least 3 (each ratio is the median and range of the repeats')")
    unknown = [p for p in args.preset if p not in PRESETS]
    if unknown:
        parser.error(f"--preset: unknown {unknown}; choose from {', '.join(PRESETS)}")
    for side in ("ours", "trl"):
        lib = MALLOCS[getattr(args, f"{side}_malloc")]
        if lib and not os.path.exists(lib):
            flag = "--allocator" if args.allocator else f"--{side}-malloc"
            parser.error(f"{flag}: {lib} not found (apt-get install libjemalloc2 / libtcmalloc-minimal4)")
    from harness.hub import locate_model
    from scripts.compare_with_trl import make_start_adapter

    os.makedirs(args.out, exist_ok=True)
    results = []
    for preset in args.preset:
        name = args.model or ("smollm2-135m" if preset in ISSUE_PRESETS + FULL_PRESETS else "bench")
        model = write_bench_model(args.out) if name == "bench" else locate_model(name)  # alias: its folder
        adapter = make_start_adapter(model, os.path.join(args.out, f"adapter_{os.path.basename(model)}"))
        runs = {"ours": [], "trl": []}
        for _ in range(args.repeats):
            for side in ("ours", "trl"):
                run = run_child(args, side, preset, model, adapter)
                runs[side].append(run)
                print(
                    f"{preset} {side}: s/step {[round(x, 3) for x in run['seconds']]}, CPU s/step "
                    f"{[round(x, 3) for x in run['cpu_seconds']]}, peak RSS {run['peak_rss_mb']:.0f} MB, "
                    f"load {run['load'][0]:.1f}->{run['load'][1]:.1f}",
                    flush=True,
                )
        method, over, _ = PRESETS[preset]
        row = {"preset": preset, "method": method, "model": os.path.basename(model.rstrip("/")), "config": over}
        row["malloc"] = {"ours": args.ours_malloc, "trl": args.trl_malloc}
        row["ratios"] = paired_ratios(runs["ours"], runs["trl"])
        results.append(row | {"ours": summarise(runs["ours"]), "trl": summarise(runs["trl"])})
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
        f"`{command}` ({time.strftime('%Y-%m-%d %H:%M')}; torch {torch.__version__}, TRL {trl.__version__}, 1 thread, "
        f"{os.cpu_count()} vCPU shared; malloc ours / TRL: {results[0]['malloc']['ours']} / "
        f"{results[0]['malloc']['trl']})",
        "",
        "| preset | model | config | ours s/step | TRL s/step | time ours/TRL | CPU s/step ours / TRL | CPU "
        "ours/TRL | peak RSS ours / TRL (MB) | RSS ours/TRL | load (1-min, min-max) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        o, t = r["ours"], r["trl"]
        cfg = ", ".join(f"{k}={v}" for k, v in r["config"].items() if k != "learning_rate")
        load = o["load"] + t["load"]
        cells = [
            r["preset"],
            r["model"],
            cfg,
            f"{o['s_per_step']:.2f}",
            f"{t['s_per_step']:.2f}",
            f"**{o['s_per_step'] / t['s_per_step']:.2f}**",
            f"{o['cpu_s_per_step']:.2f} / {t['cpu_s_per_step']:.2f}",
            f"**{o['cpu_s_per_step'] / t['cpu_s_per_step']:.2f}**",
            f"{o['peak_rss_mb']:,.0f} / {t['peak_rss_mb']:,.0f}",
            f"**{o['peak_rss_mb'] / t['peak_rss_mb']:.2f}**",
            f"{min(load):.1f}-{max(load):.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Ratios ours / TRL per repeat (run i of each side), as median (min-max) over the repeats:",
        "",
        "| preset | repeats | CPU s/step | wall s/step | peak RSS | generation | load (1-min, min-max) |",
        "|---|---:|---|---|---|---|---|",
    ]
    for r in results:
        q = r["ratios"]
        load = r["ours"]["load"] + r["trl"]["load"]
        cells = [r["preset"], str(len(q["cpu"])), f"**{spread(q['cpu'])}**", spread(q["time"]), spread(q["rss"])]
        cells += [spread(q["generation"]) if "generation" in q else "", f"{min(load):.1f}-{max(load):.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Phases, median s/step (ours: the script's time/* metrics; TRL: TRLPhases' wrappers):", ""]
    for r in results:
        for side in ("ours", "trl"):
            ph = ", ".join(f"{k} {v:.2f}" for k, v in r[side]["phases"].items())
            lines.append(f"- {r['preset']} {side}: {ph or 'none logged'}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# One prepared check for the GPU machine this project may be lent: Python 3.12, torch 2.11 (CUDA 13), transformers
# 5.17, peft, accelerate, tensorboard, tqdm; no tyro, trl, bitsandbytes, flash-attn, vllm, and no network. In at most
# 9.5 minutes it
#   1. installs the wheels in bench/wheels/ (git-ignored): tyro and its dependencies, pytest, and trl with what trl
#      imports and the image lacks (datasets, pyarrow, pandas, ...); the only ones that are not pure Python are
#      pyarrow, pandas and xxhash (cp312 manylinux),
#   2. runs `pytest -m gpu`,
#   3. runs the headline command's code path (bench/headline_cpu.py: grpo.py on GSM8K-layout prompts) on a
#      random-init model with Qwen2.5-1.5B's exact shapes (bench/qwen_shapes.py) for 3 steps at full completion
#      length (random weights never emit EOS, so every completion is full length),
#   4. runs bench/grpo_gpu.py (ours against TRL 1.16's GRPOTrainer, 512-token completions to fit the budget),
#   5. runs bench/memory_check.py --gpu: each script's memory plan (its memory_plan over harness/memory.py) against
#      torch.cuda.max_memory_allocated for sft / dpo / grpo on a random-init Qwen2.5-1.5B in bf16,
#   6. runs bench/reference_swap.py --gpu: a full fine-tune's reference pass (8 x 512 tokens, Qwen2.5-1.5B shapes,
#      bf16) with the starting weights swapped in from pinned host memory (grpo.py --no-use-lora) against a resident
#      second copy on the card (TRL without PEFT): seconds per pass and peak GPU memory, two repetitions each
#   7. writes one Markdown table to $OUT/gpu_check.md (s/step per phase, tokens/s, peak GPU memory, TRL ratio) and
#      the planner's and the reference pass's tables after it.
#
# Here, with PyPI (fills bench/wheels/, ~55 MiB):   bash bench/gpu_check.sh --download
# which runs, for each of $PACKAGES below:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d bench/wheels PACKAGE
# On the GPU machine:                               OUT=/some/dir bash bench/gpu_check.sh
# On a CPU, cut down (tiny shapes, 2 steps, 16 tokens; installs nothing):   bash bench/gpu_check.sh --dry-run
#
# The generation stage alone, one call of at most 8 minutes (issue #30; it needs no wheels):
#   OUT=/some/dir bash bench/gpu_check.sh --generation          (CPU, tiny shapes: --generation-dry-run)
# bench/generation.py on the headline path's shapes (Qwen2.5-1.5B, bf16, LoRA r16, 8 prompts x G 4, 512 tokens):
# model.generate, our decode loop, the loop on the model's forward every step, the loop with --compile (its first
# call, compile + capture, on its own line), vLLM where installed, each against the rollout's floor on the card;
# table in $OUT/generation.md.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-run}
OUT=${OUT:-outputs/gpu_check}
WHEELS=bench/wheels
# Pinned to the set checked on torch 2.11 + transformers 5.17 (a CPU venv). pyarrow 21 (TRL 1.16's floor) is 12 MB
# smaller than 26 and keeps the folder under 60 MiB; datasets 5.2 declares pyarrow>=24 but runs TRL's GRPO with 21
# (the --dry-run TRL side passed so), hence the --no-deps install.
PACKAGES="tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1
pygments==2.21.0 trl==1.16.0 datasets==5.2.0 pyarrow==21.0.0 pandas==3.1.1 python-dateutil==4.0.0 tzdata==2026.6
dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0"

if [ "$MODE" = "--download" ]; then
    mkdir -p "$WHEELS"
    for p in $PACKAGES; do
        python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --abi cp312 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any \
            -d "$WHEELS" "$p" || exit 1
    done
    du -sh "$WHEELS"
    exit 0
fi
if [ "$MODE" = "--generation" ] || [ "$MODE" = "--generation-dry-run" ]; then
    OUT=${OUT:-outputs/gpu_check}
    mkdir -p "$OUT"
    SHAPES=(--tokens 512 --prompts 8 --group-size 4 --repeats 2)
    [ "$MODE" = "--generation-dry-run" ] && SHAPES=(--tiny --tokens 16 --prompts 2 --group-size 2 --repeats 1)
    timeout 480 python bench/generation.py --qwen-shapes --dtype bf16 --compile "${SHAPES[@]}" \
        --json "$OUT/generation.json" > "$OUT/generation.log" 2>&1
    echo "generation: exit $? (log $OUT/generation.log)"
    python -c "import json, sys; print(json.load(open(sys.argv[1]))['table'])" "$OUT/generation.json" \
        | tee "$OUT/generation.md"
    exit 0
fi
if [ "$MODE" != "run" ] && [ "$MODE" != "--dry-run" ]; then
    echo "usage: bash bench/gpu_check.sh [--download | --dry-run | --generation | --generation-dry-run]" >&2
    exit 2
fi
mkdir -p "$OUT"
DRY=0; [ "$MODE" = "--dry-run" ] && DRY=1
export TOKENIZERS_PARALLELISM=false TRL_EXPERIMENTAL_SILENCE=1
start=$(date +%s)

# ---- 1 wheels (the GPU machine has no network: --no-index; --no-deps: exactly these files, see PACKAGES above)
if [ "$DRY" = 1 ]; then
    echo "dry run: not installing; bench/wheels/ holds $(ls "$WHEELS"/*.whl 2>/dev/null | wc -l) wheels," \
         "$(du -sh "$WHEELS" 2>/dev/null | cut -f1)"
else
    python -m pip install --quiet --no-index --no-deps "$WHEELS"/*.whl || { echo "wheel install failed" >&2; exit 1; }
fi
python -c "import tyro, trl, datasets, pytest" || { echo "tyro/trl/datasets/pytest not importable" >&2; exit 1; }

# ---- 2 pytest -m gpu; 3 the headline path; 4 ours vs TRL; 5 the memory planner; 6 the full fine-tune's reference
# pass. Each stage has its own limit (sum <= 9.5 min on the GPU).
if [ "$DRY" = 1 ]; then
    T_TEST=300 T_HEAD=600 T_TRL=900 T_MEM=600 T_REF=600
    MEMORY=(--gpu --tiny)
    REFERENCE=(--gpu --tiny --runs 1 --reps 2 --rows 2 --tokens 32)
    HEADLINE=(--tiny --steps 2 --prompts-per-step 1 --group-size 2 --max-completion-length 16)
    VS_TRL=(--dry-run --steps 2)
else
    T_TEST=90 T_HEAD=150 T_TRL=170 T_MEM=100 T_REF=60
    MEMORY=(--gpu)
    REFERENCE=(--gpu --runs 1 --reps 2 --passes 2)
    HEADLINE=(--steps 3 --prompts-per-step 8 --group-size 4 --max-completion-length 512)
    VS_TRL=(--completion-len 512)
fi
timeout "$T_TEST" python -m pytest -m gpu -q -p no:cacheprovider > "$OUT/pytest_gpu.log" 2>&1
echo "pytest -m gpu: exit $?, $(tail -n 1 "$OUT/pytest_gpu.log")" | tee "$OUT/pytest_gpu.txt"
timeout "$T_HEAD" python bench/headline_cpu.py "${HEADLINE[@]}" --out "$OUT/headline" --json "$OUT/headline.json" \
    > "$OUT/headline.log" 2>&1
echo "headline: exit $? (log $OUT/headline.log)"
timeout "$T_TRL" python bench/grpo_gpu.py "${VS_TRL[@]}" --out "$OUT/grpo_gpu" > "$OUT/grpo_gpu.log" 2>&1
echo "grpo_gpu: exit $? (log $OUT/grpo_gpu.log)"
timeout "$T_MEM" python bench/memory_check.py "${MEMORY[@]}" --md "$OUT/memory_check.md" > "$OUT/memory_check.log" 2>&1
echo "memory_check: exit $? (log $OUT/memory_check.log)"
timeout "$T_REF" python bench/reference_swap.py "${REFERENCE[@]}" --json "$OUT/reference_swap.json" \
    > "$OUT/reference_swap.log" 2>&1
echo "reference_swap: exit $? (log $OUT/reference_swap.log)"

# ---- 7 one table from what the stages left (a stage that failed or ran out of time shows as such)
python - "$OUT" "$(( $(date +%s) - start ))" "$MODE" <<'EOF'
import json, os, sys
out, seconds, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def load(path):
    return json.load(open(path)) if os.path.isfile(path) else None
head, vs = load(f"{out}/headline.json"), load(f"{out}/grpo_gpu/results_gpu.json")
import torch
device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (dry run)"
lines = [f"bench/gpu_check.sh {mode} on {device}, {seconds} s in all; "
         + open(f"{out}/pytest_gpu.txt").read().strip(), "",
         "| run | rollout s | reward+ref s | train s | s/step | tokens/s | peak GB (GPU allocated; RSS on CPU) "
         "| s/step vs TRL |",
         "|---|---|---|---|---|---|---|---|"]
if head:
    phases = [head["rollout_s"], head["reward_s"] + head["reference_s"], head["train_s"]]
    lines.append(f"| headline path: {head['shape']}, {head['data']}, {head['prompts_x_G']} x "
                 f"{head['max_completion_length']} tokens | " + " | ".join(f"{x:.2f}" for x in phases)
                 + f" | {sum(phases):.2f} | {head['tokens_per_s']:.0f} | {head['peak_gb']:.2f} | |")
else:
    lines.append("| headline path | failed or timed out: see headline.log | | | | | | |")
mem = "peak_allocated_gb" if torch.cuda.is_available() else "peak_rss_gb"
for side in ("ours", "trl"):
    r = (vs or {}).get(side)
    if r is None:
        lines.append(f"| grpo_gpu.py {side} | failed or timed out: see grpo_gpu.log | | | | | | |")
        continue
    ratio = f"**{r['step'] / vs['trl']['step']:.2f}**" if side == "ours" and "trl" in vs else ""
    lines.append(f"| grpo_gpu.py {side}: 1 x 8 x {r['completion_len']:.0f} tokens | {r['rollout']:.2f} | "
                 f"{r['reward+reference']:.2f} | {r['train']:.2f} | {r['step']:.2f} | {r['tokens_per_s']:.0f} | "
                 f"{r.get(mem, float('nan')):.2f} | {ratio} |")
mem_md = f"{out}/memory_check.md"
lines += ["", "Memory planner (bench/memory_check.py " + ("--gpu" if torch.cuda.is_available() else "--gpu --tiny, CPU RSS")
          + "): estimated tensors vs measured peak", ""]
lines.append(open(mem_md).read().strip() if os.path.isfile(mem_md) else "failed or timed out: see memory_check.log")
ref = load(f"{out}/reference_swap.json")
lines += ["", "Full fine-tune's reference pass (bench/reference_swap.py): swapped in from host memory vs resident", ""]
lines.append(ref["table"].strip() if ref else "failed or timed out: see reference_swap.log")
table = "\n".join(lines) + "\n"
open(f"{out}/gpu_check.md", "w").write(table)
print(table)
EOF

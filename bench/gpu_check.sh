#!/usr/bin/env bash
# The prepared check for a lent GPU machine (Python 3.12, torch 2.11 + CUDA 13, transformers 5.17, peft, accelerate,
# pytest; no tyro, trl, datasets, bitsandbytes, flash-attn, vllm; no network). One device call of at most 8 minutes
# always returns figures: the stages run in order, each under its own limit and all under one deadline (DEADLINE
# seconds from the start; a stage that would start with under 20 s left is skipped), and each appends its table to
# $OUT/gpu_check.md as it ends (a stage that fails or runs out of time says so there, and the next one runs).
#   0. setup: the wheels in bench/wheels/ (git-ignored: tyro and what TRL needs that the image lacks, --no-index
#      --no-deps), and a random-init model with Qwen2.5-1.5B's exact shapes written once in bf16
#      (bench/qwen_shapes.py; stages 1, 2 and 5 load it, 3 and 4 build it on the card)
#   1. quick: bench/headline_cpu.py --quick: the tiny model (2 x G 2 x 32 tokens, a figure within seconds), then the
#      1.5B at 8 x G 4 x 64 tokens, 2 steps: seconds per phase, milliseconds a decode token, and the host syncs of a
#      rollout and of a training pass (torch.cuda.set_sync_debug_mode)
#   2. headline: the headline command's shape, 8 x G 4 x 512 tokens, 3 steps (bench/headline_cpu.py)
#   3. trl: ours against TRL 1.16's GRPOTrainer (use_vllm=False) at the same shape, each side a fresh process
#      (bench/grpo_gpu.py; 160-token prompts, GSM8K's length with the chat template)
#   4. generation: one rollout of that shape through our decode loop (static shapes, the step captured as a CUDA
#      graph), the loop without the graph, and model.generate, against the card's floor (bench/generation.py)
#   5. memory: each script's memory plan against torch.cuda.max_memory_allocated for sft, dpo and grpo
#      (bench/memory_check.py --gpu)
#   6. reference: a full fine-tune's reference pass with the starting weights swapped in from pinned host memory
#      against a resident second copy on the card (bench/reference_swap.py --gpu: seconds a pass, peak memory)
# Files under $OUT (the device tool returns 8): gpu_check.md, setup.log, quick.log, headline.log, trl.log,
# generation.log, memory.log, reference.log.
#
# Here, with PyPI (fills bench/wheels/, ~55 MiB):   bash bench/gpu_check.sh --download
# On the GPU machine:                               OUT=/some/dir bash bench/gpu_check.sh
# On a CPU, every stage cut down (tiny shapes, a few tokens; installs nothing): bash bench/gpu_check.sh --dry-run
# (tests/test_gpu_cost.py runs the dry run).
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-run}
OUT=${OUT:-outputs/gpu_check}
WHEELS=bench/wheels
# Pinned to the set checked on torch 2.11 + transformers 5.17 (a CPU venv). pyarrow 21 (TRL 1.16's floor) is 12 MB
# smaller than 26 and keeps the folder under 60 MiB; datasets 5.2 declares pyarrow>=24 but runs TRL's GRPO with 21
# (the --dry-run TRL side passed so), hence the --no-deps install.
PACKAGES="tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 trl==1.16.0 datasets==5.2.0 pyarrow==21.0.0
pandas==3.1.1 python-dateutil==4.0.0 tzdata==2026.6 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0"

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
if [ "$MODE" != "run" ] && [ "$MODE" != "--dry-run" ]; then
    echo "usage: bash bench/gpu_check.sh [--download | --dry-run]" >&2
    exit 2
fi
mkdir -p "$OUT"
export TOKENIZERS_PARALLELISM=false TRL_EXPERIMENTAL_SILENCE=1 PYTHONUNBUFFERED=1
START=$(date +%s)
DEADLINE=${DEADLINE:-470}  # seconds: the device tool's 8-minute call, less the time to send $OUT back
MODEL=/tmp/onlyone-random-qwen2.5-1.5b
if [ "$MODE" = "--dry-run" ]; then
    MODEL=/tmp/onlyone-random-tiny
    QUICK=(--tiny --quick --steps 2 --prompts-per-step 2 --group-size 2 --max-completion-length 16)
    HEADLINE=(--tiny --steps 2 --prompts-per-step 2 --group-size 2 --max-completion-length 24)
    VS_TRL=(--dry-run --steps 2 --prompts-per-step 2 --group-size 2)
    GENERATION=(--tiny --tokens 16 --prompts 2 --group-size 2 --repeats 1)
    MEMORY=(--gpu --tiny)
    REFERENCE=(--gpu --tiny --runs 1 --reps 1 --passes 1 --rows 2 --tokens 32)
    LIMITS=(quick=300 headline=300 trl=400 generation=300 memory=400 reference=300)
else
    QUICK=(--quick --steps 2 --prompts-per-step 8 --group-size 4 --max-completion-length 64)
    HEADLINE=(--steps 3 --prompts-per-step 8 --group-size 4 --max-completion-length 512)
    VS_TRL=(--steps 3 --prompts-per-step 8 --group-size 4 --prompt-len 160 --completion-len 512)
    GENERATION=(--dtype bf16 --tokens 512 --prompts 8 --group-size 4 --repeats 1 --only "decode, no CUDA graph")
    MEMORY=(--gpu)
    REFERENCE=(--gpu --runs 1 --reps 2 --passes 2)
    LIMITS=(quick=75 headline=100 trl=150 generation=80 memory=90 reference=60)
fi
limit_of() { for kv in "${LIMITS[@]}"; do [ "${kv%%=*}" = "$1" ] && echo "${kv#*=}"; done; }
SUMMARY="$OUT/gpu_check.md"
DEVICE=$(python -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU (dry run)')")
VERSIONS=$(python -c "import torch, transformers, peft; print(f'torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}')")
echo "# bench/gpu_check.sh $MODE: $DEVICE, $VERSIONS, $(date -u +%Y-%m-%d)" > "$SUMMARY"

# ---- 0 setup (wheels and the random model); every stage below checks its own imports
{
    if [ "$MODE" = "--dry-run" ]; then
        echo "dry run: not installing; bench/wheels/ holds $(ls "$WHEELS"/*.whl 2>/dev/null | wc -l) wheels"
    else
        python -m pip install --quiet --no-index --no-deps "$WHEELS"/*.whl || echo "wheel install failed"
    fi
    python -c "import tyro, trl, datasets" || echo "tyro/trl/datasets not importable: stages 1, 2 and 3 will fail"
    if [ ! -f "$MODEL/config.json" ]; then
        python bench/qwen_shapes.py "$MODEL" $([ "$MODE" = "--dry-run" ] && echo --tiny)
    fi
} > "$OUT/setup.log" 2>&1
echo "setup: $(( $(date +%s) - START )) s (log setup.log)" | tee -a "$SUMMARY"

# stage NAME COMMAND...: runs COMMAND under min(its limit, what the deadline leaves), its output in NAME.log; then
# appends the table it wrote to NAME.md (or why there is none) to the summary
stage() {
    local name=$1
    shift
    local left=$(( DEADLINE - ($(date +%s) - START) ))
    local limit
    limit=$(limit_of "$name")
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 20 ]; then
        printf '\n## %s\nskipped: %s s left of the %s s deadline\n' "$name" "$left" "$DEADLINE" >> "$SUMMARY"
        return
    fi
    local t0
    t0=$(date +%s)
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    local took=$(( $(date +%s) - t0 ))
    {
        printf '\n## %s: exit %s after %s s (limit %s s); `%s`\n\n' "$name" "$rc" "$took" "$limit" "$*"
        if [ -f "$OUT/$name.md" ]; then cat "$OUT/$name.md"; rm -f "$OUT/$name.md"; else tail -n 5 "$OUT/$name.log"; fi
    } >> "$SUMMARY"
    echo "$name: exit $rc after $took s"
}

stage quick python bench/headline_cpu.py "${QUICK[@]}" --model-dir "$MODEL" --out /tmp/gpu_check/quick \
    --md "$OUT/quick.md"
stage headline python bench/headline_cpu.py "${HEADLINE[@]}" --model-dir "$MODEL" --out /tmp/gpu_check/headline \
    --md "$OUT/headline.md"
stage trl python bench/grpo_gpu.py "${VS_TRL[@]}" --out /tmp/gpu_check/trl --md "$OUT/trl.md"
stage generation python bench/generation.py --qwen-shapes "${GENERATION[@]}" --md "$OUT/generation.md"
stage memory python bench/memory_check.py "${MEMORY[@]}" --qwen-dir "$MODEL" --md "$OUT/memory.md"
stage reference python bench/reference_swap.py "${REFERENCE[@]}" --md "$OUT/reference.md"
echo "total: $(( $(date +%s) - START )) s" | tee -a "$SUMMARY"
cat "$SUMMARY"

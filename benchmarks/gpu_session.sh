#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md in one go, on a machine with one NVIDIA GPU, within a time
# budget (BUDGET_S, default 540 s): each stage is cut short at the budget rather than overrun it.
#
#   1. each GPU machine type's XLA flags (core/generations.py) parse in this jaxlib;
#   2. the smoke model's train step (benchmarks/gpu_step.py --recipe smoke);
#   3. OLMo 3 7B's train step at sequence 8192, per-device batch 1 (all 32 layers, or fewer until one fits);
#   4. the same at OLMo-core's published context, 4096 x 2 sequences (the same tokens a step);
#   5. `olmo-ctl smoke --backend local --device gpu-1`: the trainer itself on the GPU (train, forced
#      stop, resume, bit-exact against its twin, events).
#
# Every stage's output lands in OUT_DIR (default ./gpu-figures): gpu.txt, flags.jsonl, smoke.jsonl,
# 7b-8192.jsonl, 7b-4096.jsonl, trainer-smoke.txt. Exit 0 when stages 1-3 ran, else 1.
#
#   bash benchmarks/gpu_session.sh [OUT_DIR]        # PYTHON=python3 by default, run from the repo root
set -u
out=${1:-gpu-figures}
mkdir -p "$out"
py=${PYTHON:-python3}
budget=${BUDGET_S:-540}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# A 7B's fp32 state and gradients (~110 GiB) need more than JAX's default 75% of an H200's memory.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.97}

left() { echo $((budget - SECONDS - 5)); }
stage() { # stage SECONDS FILE CMD...: run CMD with at most SECONDS (or what is left), output to FILE too
    local limit=$1 file=$2
    shift 2
    local l
    l=$(left)
    ((l < limit)) && limit=$l
    if ((limit < 20)); then
        echo "skipped (budget spent): $*" | tee "$out/$file"
        return 1
    fi
    echo "== $* (at most ${limit}s)"
    timeout "$limit" "$@" 2>&1 | tee "$out/$file"
    return "${PIPESTATUS[0]}"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
    $py -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
} 2>&1 | tee "$out/gpu.txt"

ok=0
stage 90 flags.jsonl $py benchmarks/gpu_step.py --check-flags || ok=1
stage 150 smoke.jsonl $py benchmarks/gpu_step.py --recipe smoke --steps 20 || ok=1
stage 300 7b-8192.jsonl $py benchmarks/gpu_step.py --steps 5 || ok=1
layers=$(grep "^{" "$out/7b-8192.jsonl" | tail -n 1 | $py -c "import json,sys; print(json.load(sys.stdin).get('n_layers') or 32)" 2>/dev/null || echo 32)
stage 200 7b-4096.jsonl $py benchmarks/gpu_step.py --steps 5 --seq 4096 --batch 2 --layers "$layers"
# The trainer's processes share the GPU one after another: no preallocation of 97% each.
XLA_PYTHON_CLIENT_PREALLOCATE=false stage 240 trainer-smoke.txt \
    $py -c "from olmo_ctl.cli import entry; entry()" smoke --backend local --device gpu-1
echo "== done in ${SECONDS}s; figures in $out"
exit $ok

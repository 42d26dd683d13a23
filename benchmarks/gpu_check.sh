#!/usr/bin/env bash
# The prepared run for a lent GPU machine (the `device` tool), about 10 minutes in all:
# the GPU-marked kernel tests, benchmarks/attention.py for both model shapes, and a short
# launch sweep of decode. Each step has its own time limit, so a slow one still leaves the
# others' results. Output goes to the terminal and to $OUT (or the directory given).
#
#     bash benchmarks/gpu_check.sh [OUTDIR]
set -u
out=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
step() {  # step NAME SECONDS COMMAND...
    local name=$1 seconds=$2
    shift 2
    echo "== $name: $*"
    timeout "$seconds" "$@" 2>&1 | tee "$out/$name.txt"
    echo "== $name: exit ${PIPESTATUS[0]}"
}
step device 30 python -c "import jax; print(jax.__version__, jax.devices())"
step tests 180 python -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_pallas_attention.py tests/test_pallas_write_kv.py tests/test_backends.py
for model in llama3_8b smollm2; do
    step "attention_$model" 90 python benchmarks/attention.py --model "$model" \
        --backends reference,pallas_gpu
done
for model in llama3_8b smollm2; do
    step "sweep_$model" 150 python benchmarks/attention_sweep.py --model "$model" \
        --workloads decode --top 6
done

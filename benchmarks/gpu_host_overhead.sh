#!/usr/bin/env bash
# Issue 20's GPU check, the prepared run for a lent GPU machine (the `device` tool, about 7
# minutes): host_overhead.py on SmolLM2 and on a Llama-3-8B-shaped model, both with random
# bfloat16 weights made on the device (host_overhead.random_model), at 1 and 64 rows, async
# scheduling off and on; then at 64 rows with sampled requests and with penalties (a full
# sampler plan, whose sampler holds no conditional on a GPU either: its device idle should
# be the greedy run's); last, sampler.py: what each sampler plan costs the GPU alone. The
# machine has JAX but none of this repo's packages that JAX does not bring and no network,
# so first, here (ignored by git, carried by the call):
#
#     echo /.devcarry/ >> .git/info/exclude
#     pip download 'llguidance==1.9.1' --no-deps -d .devcarry/wheels   # abi3: any CPython 3
#     mkdir -p .devcarry/cache/ksana-jax/SmolLM2-135M-Instruct
#     cp -r ~/.cache/ksana-jax/bench-tiny-llama .devcarry/cache/ksana-jax/   # the tokenizer
#     cp ~/.cache/ksana-jax/SmolLM2-135M-Instruct/*.json .devcarry/cache/ksana-jax/SmolLM2-135M-Instruct/
#
# (run benchmarks/host_overhead.py --models tiny once here to write both), then
# run(command="bash benchmarks/gpu_host_overhead.sh", carry=[".devcarry"]).
set -u
out=${OUT:-/tmp/gpu_host_overhead}
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-index .devcarry/wheels/*.whl 2>&1 | tail -2
export XDG_CACHE_HOME=$PWD/.devcarry/cache PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import jax; print(jax.__version__, jax.devices())"
cd benchmarks
for model in smollm2 llama3_8b; do
    echo "== $model"
    timeout 300 python3 host_overhead.py --models "$model" --random-weights --rows 1 64 \
        --max-model-len 1024 --no-vllm --repeat 2 --tokens 64 2>&1 | grep -v "warm-up" |
        tee "$out/$model.txt"
done
for sampling in sampled penalties; do
    for model in smollm2 llama3_8b; do
        echo "== $model, $sampling"
        timeout 200 python3 host_overhead.py --models "$model" --random-weights --rows 64 \
            --max-model-len 1024 --no-vllm --repeat 2 --tokens 64 --sampling "$sampling" 2>&1 |
            grep -v "warm-up" | tee "$out/$model-$sampling.txt"
    done
done
echo "== sampler"
timeout 120 python3 sampler.py --rows 1 64 256 --repeats 5 2>&1 | tee "$out/sampler.txt"

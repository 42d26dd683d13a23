"""Where a CPU decode step's time goes: SmolLM2-135M bfloat16 (weights int8 or int4 with
--quantization) at batch 1 under
jax.profiler, each XLA:CPU thunk of the step's executable put in a category (layer
products, LM head, attention, norms, ...), averaged over the decode steps. With the cpu
backend and a float KV, "attention" is one call a layer that also does rotary and the KV
write (ragged_paged_attention_cpu.attend_layer).

    python benchmarks/cpu_step_profile.py [--tokens 64] [--trace-dir DIR] [--quantization int4]

Each thunk event names its program and run (a decode step runs the forward, then the
sampler); the table sums their durations per step (busy) and the gaps inside each run, and
prints apart the device's idle time before each step's forward (the host's dispatch, a
wake-up) and before its other programs. On a shared machine, read shares, not ms.

Last, the host's side of a step's launch: the CPU time the engine's thread spends in the
jitted forward call itself (JAX's C++ dispatch: a pytree flatten, a signature and a PjRt
buffer hold per array argument), beside the number of arrays the call takes. On 2 cores it
is not free even with async scheduling: it takes the core the kernels' second thread would
have (2026-12-03: 1.7 ms a step for bfloat16's 272 parameter arrays, 3.2 ms for int4's 694).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import jax
from host_overhead import demo_checkpoint, engine_options, random_prompts

import ksana_jax
from ksana_jax import LLM, SamplingParams

# Thunk name (without its numeric suffix) -> category, as XLA:CPU names SmolLM2's fusions.
CATEGORIES = {
    "wrapped_reduce-window": "rms norm",
    "add_rsqrt_fusion": "rms norm",
    "bitcast_multiply_fusion": "rms norm",
    "wrapped_multiply": "rms norm",
    "slice_concatenate_fusion": "rope",
    "multiply_add_fusion": "rope",
    "multiply_cosine_fusion": "rope",
    "multiply_sine_fusion": "rope",
    "convert_bitcast_fusion": "kv write / page prep",
    "clamp_convert_fusion": "kv write / page prep",
    "pad_bitcast_fusion": "kv write / page prep",
    "bitcast_pad_fusion": "kv write / page prep",
    "wrapped_scatter": "kv write / page prep",
    "multiply_multiply_fusion": "silu * up",
    "wrapped_add": "residual add",
    "dynamic-slice_add_fusion": "residual add",
}


# A dense layer's custom calls, all named `ffi_call`: its q/k/v product, attention (the cpu
# backend's one call for rotary, the KV write and attention; with a quantized KV, XLA's
# rotary, quantize and scatter come before it), then its o, gate/up and down products.
PRODUCTS_BETWEEN_ATTENTIONS = 4  # o, gate/up, down, the next layer's q/k/v


def category(name: str, previous_category: str, products: int, lm_head: str) -> str:
    """A forward thunk's category, from its name, the category of the thunk before it and
    the product calls since the last attention call (`products`; the first layer's q/k/v
    product counts as the fourth, as if an attention had run before the first layer)."""
    base = re.sub(r"[.\d]+$", "", name)
    if name == lm_head:
        return "LM head product"
    if base == "ffi_call":
        return "attention" if products == PRODUCTS_BETWEEN_ATTENTIONS else "layer products"
    if base == "bitcast_multiply_fusion" and previous_category == "layer products":
        return "silu * up"  # after gate/up; before the LM head it is the final norm's
    return CATEGORIES.get(base, f"other ({base})")


def thunk_events(trace_dir: Path) -> list[dict]:
    path = next(trace_dir.glob("**/*.trace.json.gz"))
    with gzip.open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    skip = ("$", "end:", "ThunkExecutor", "Threadpool")
    return sorted(
        (
            e
            for e in events
            if e.get("ph") == "X" and not e["name"].startswith(skip) and "Execute" not in e["name"]
        ),
        key=lambda e: e["ts"],
    )


def table(events: list[dict]) -> None:
    """Each thunk belongs to one run of one program (its `hlo_module` and `run_id`): a decode
    step is a run of the forward, then one of the sampler (the first pair is the prefill's)."""
    runs = collections.defaultdict(list)
    for e in events:
        args = e.get("args", {})
        if "hlo_module" in args:
            runs[args["hlo_module"], args["run_id"]].append(e)
    programs = collections.defaultdict(list)  # module -> its runs' thunks, in time order
    for (module, _), thunks in runs.items():
        programs[module].append(sorted(thunks, key=lambda e: e["ts"]))
    for module_runs in programs.values():
        module_runs.sort(key=lambda thunks: thunks[0]["ts"])
    forward = next(m for m in programs if "forward" in m)
    steps = programs[forward][1:]
    n = len(steps)
    # The LM head is the longest ffi call that runs once a step.
    calls = collections.Counter(e["name"] for run in steps for e in run)
    durations = collections.Counter()
    for run in steps:
        for e in run:
            if e["name"].startswith("ffi_call") and calls[e["name"]] == n:
                durations[e["name"]] += e["dur"]
    lm_head = durations.most_common(1)[0][0]
    busy, count = collections.Counter(), collections.Counter()
    inside_gaps = 0.0
    first_step = steps[0][0]["ts"]
    for module, module_runs in programs.items():
        for run in module_runs:
            if run[0]["ts"] < first_step:
                continue  # the prefill's
            previous_category, products = "", PRODUCTS_BETWEEN_ATTENTIONS - 1
            for i, e in enumerate(run):
                if module == forward:
                    name = category(e["name"], previous_category, products, lm_head)
                    if name == "attention":
                        products = 0
                    elif name == "layer products":
                        products += 1
                elif "sample" in module:
                    name = "sampler"
                else:
                    name = f"other program ({module})"
                busy[name] += e["dur"]
                count[name] += 1
                previous_category = name
                if i:
                    inside_gaps += max(0.0, e["ts"] - run[i - 1]["ts"] - run[i - 1]["dur"])
    # Idle: from the end of the programs run before one to its first thunk (before a step's
    # forward: the host's dispatch and the wake-up; before its sampler: a wake-up).
    ordered = sorted(
        (r for module_runs in programs.values() for r in module_runs if r[0]["ts"] >= first_step),
        key=lambda r: r[0]["ts"],
    )
    idle = collections.Counter()
    done = steps[0][-1]["ts"] + steps[0][-1]["dur"]
    for run in ordered[1:]:
        idle["forward" if run in steps else "other"] += max(0.0, run[0]["ts"] - done)
        done = max(done, max(e["ts"] + e["dur"] for e in run))
    total = sum(busy.values())
    print(
        f"{n} decode steps: thunks {total / n / 1e3:.2f} ms a step busy, "
        f"{inside_gaps / n / 1e3:.2f} ms of gaps between them inside each program run; "
        f"idle {idle['forward'] / (n - 1) / 1e3:.2f} ms before each forward (dispatch, "
        f"wake-up), {idle['other'] / (n - 1) / 1e3:.2f} ms before the step's other programs"
    )
    print(f"| {'category':30s} | ms/step | thunks/step | share |")
    for name, us in busy.most_common():
        print(
            f"| {name:30s} | {us / n / 1e3:7.3f} | {count[name] / n:11.1f} "
            f"| {100 * us / total:4.1f}% |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--trace-dir", type=Path, default=None)
    parser.add_argument("--quantization", choices=["int8", "int4"], default=None)
    args = parser.parse_args()
    model = ksana_jax.load(demo_checkpoint(), dtype="bfloat16")
    llm = LLM(model, quantization=args.quantization, **engine_options(1, 1024, None))
    prompts = random_prompts(1, model.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    trace_dir = args.trace_dir or Path(tempfile.mkdtemp(prefix="ksana-step-profile-"))
    with jax.profiler.trace(str(trace_dir)):
        llm.generate(prompts, params, use_tqdm=False)
    table(thunk_events(trace_dir))
    dispatch_cost(llm, prompts, params)


def dispatch_cost(llm: LLM, prompts, params: SamplingParams) -> None:
    """Prints the median wall and calling-thread CPU time of the step's forward jit call
    over one generate's steps, and the number of arrays it takes."""
    runner = llm.engine.runner
    call = runner.forward_step
    wall, cpu = [], []

    def timed(*args, **kwargs):
        start, start_cpu = time.perf_counter(), time.thread_time()
        out = call(*args, **kwargs)
        wall.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - start_cpu)
        return out

    runner.forward_step = timed
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner.forward_step = call
    arrays = len(jax.tree.leaves(runner.model.params))
    print(
        f"the forward jit call: {statistics.median(wall) * 1e3:.2f} ms wall, "
        f"{statistics.median(cpu) * 1e3:.2f} ms of the engine thread's CPU a step (median of "
        f"{len(wall)}); {arrays} parameter arrays"
    )


if __name__ == "__main__":
    main()

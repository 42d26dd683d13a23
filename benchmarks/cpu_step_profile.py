"""Where a CPU decode step's time goes: SmolLM2-135M bfloat16 (weights int8 or int4 with
--quantization) at batch 1 under
jax.profiler, each XLA:CPU thunk of the step's executable put in a category (layer
products, LM head, attention, norms, rope, KV write, ...), averaged over the decode steps.

    python benchmarks/cpu_step_profile.py [--tokens 64] [--trace-dir DIR] [--quantization int4]

The trace's thunk events run on XLA's executing thread; the table sums their durations per
step (busy) and the gaps between them inside the step. What lies between two steps (the
host's work and its wake-up) is printed apart. On a shared machine, read shares, not ms.

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
import itertools
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
    "convert_bitcast_fusion": "kv write / page prep",
    "clamp_convert_fusion": "kv write / page prep",
    "pad_bitcast_fusion": "kv write / page prep",
    "bitcast_pad_fusion": "kv write / page prep",
    "wrapped_scatter": "kv write / page prep",
    "multiply_multiply_fusion": "silu * up",
    "wrapped_add": "residual add",
    "dynamic-slice_add_fusion": "residual add",
}


def category(name: str, previous: str, lm_head: str) -> str:
    base = re.sub(r"[.\d]+$", "", name)
    if name == lm_head:
        return "LM head product"
    if base == "ffi_call":  # the attention call follows the KV write's scatter
        return "attention" if previous.startswith("wrapped_scatter") else "layer products"
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
    # The LM head is the longest ffi call that runs once a step.
    calls = collections.Counter(e["name"] for e in events if e["name"].startswith("ffi_call"))
    steps = max(calls.values())
    durations = collections.Counter()
    for e in events:
        if calls.get(e["name"], 0) >= steps - 1:
            durations[e["name"]] += e["dur"]
    lm_head = durations.most_common(1)[0][0]
    heads = [e for e in events if e["name"] == lm_head]
    busy, count = collections.Counter(), collections.Counter()
    inside_gaps = between = 0.0
    for a, b in itertools.pairwise(heads):
        thunks = [
            e for e in events if a["ts"] + a["dur"] <= e["ts"] <= b["ts"] and e["tid"] == b["tid"]
        ]
        # The widest gap separates step a's sampler from step b's first thunk.
        cut = max(
            range(1, len(thunks)),
            key=lambda i: thunks[i]["ts"] - thunks[i - 1]["ts"] - thunks[i - 1]["dur"],
        )
        between += thunks[cut]["ts"] - thunks[cut - 1]["ts"] - thunks[cut - 1]["dur"]
        for e in thunks[:cut]:
            busy["sampler (after the LM head)"] += e["dur"]
            count["sampler (after the LM head)"] += 1
        previous = ""
        for i, e in enumerate(thunks[cut:], cut):
            name = category(e["name"], previous, lm_head)
            busy[name] += e["dur"]
            count[name] += 1
            previous = e["name"]
            if i > cut:
                inside_gaps += max(0.0, e["ts"] - thunks[i - 1]["ts"] - thunks[i - 1]["dur"])
    n = len(heads) - 1
    total = sum(busy.values())
    print(
        f"{n} decode steps: thunks {total / n / 1e3:.2f} ms a step busy, "
        f"{inside_gaps / n / 1e3:.2f} ms of gaps between them, "
        f"{between / n / 1e3:.2f} ms between steps (host, wake-up)"
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

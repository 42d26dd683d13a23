"""Attention backends on realistic shapes: time per call and achieved bytes/s.

For each backend (reference = the jnp oracle through XLA; cpu, the C++ kernel, and xla on CPU;
pallas_tpu; pallas_gpu) and each
workload (long-context decode, a prefill chunk, a mixed batch) it times one attention call
over one layer and divides the bytes attention must read -- every real row's cached K and
V, plus q, the new K/V and the output -- by the median time, and prints the fraction of
the device's measured copy bandwidth that is. The target on GPU/TPU for long-context
decode is >= 70% of it and >= 1.0x the reference.

`window_decode` is decode over a 32k context with a 4096-token sliding window (Mistral,
Gemma 2/3 local layers): each backend runs it with the window and without, and prints the
bytes attention must read each way -- with the window only the last 4095 cached positions
of a row -- with both times. The kernels skip the pages before the window, so their time
should fall about as the bytes do; the reference gathers the whole context either way.

On CPU the Pallas kernels run in interpret mode: their times say nothing about kernel
speed (the interpreter is a slow emulation) and are printed only to show they run.

    python benchmarks/attention.py [--model smollm2|llama3_8b] [--dtype bfloat16]
        [--backends reference,pallas_gpu] [--workloads decode,prefill,mixed,window_decode]
        [--repeats 10]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from ksana_jax import pallas_kernels
from ksana_jax.kv_cache import float_kv
from ksana_jax.pallas_kernels.attention_spec import AttentionSpec

MODELS = {"smollm2": (9, 3, 64), "llama3_8b": (32, 8, 128)}  # query heads, KV heads, head dim
PAGE_SIZE = 16

# (cached tokens, new tokens) per row, for accelerators and (smaller) for CPU.
WORKLOADS = {
    "decode": {"device": [(4095, 1)] * 32, "cpu": [(511, 1)] * 4},
    "prefill": {"device": [(1024, 1024)], "cpu": [(64, 64)]},
    "long_decode": {"device": [(16383, 1)] * 8, "cpu": [(1023, 1)] * 2},
    "mixed": {
        "device": [(2047, 1)] * 24 + [(512, 512)],
        "cpu": [(255, 1)] * 4 + [(32, 28)],
    },
    "window_decode": {"device": [(32767, 1)] * 8, "cpu": [(32767, 1)] * 4},
}
WINDOWS = {"window_decode": 4096}  # workload -> sliding window (run with it and without)


def build_batch(rows, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    """Attention arguments for `rows` [(cached, new)] with shuffled pages, one layer."""
    rng = np.random.default_rng(seed)
    pages_per_row = [-(-(c + n) // PAGE_SIZE) for c, n in rows]
    max_pages = max(pages_per_row)
    num_pages = 1 + sum(pages_per_row)
    page_ids = iter(rng.permutation(np.arange(1, num_pages)))
    page_table = np.zeros((len(rows), max_pages), np.int32)
    for s, count in enumerate(pages_per_row):
        page_table[s, :count] = [next(page_ids) for _ in range(count)]
    num_tokens = sum(n for _, n in rows)
    query_starts = np.concatenate([[0], np.cumsum([n for _, n in rows])]).astype(np.int32)
    key = jax.random.key(seed)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    return (
        jax.random.normal(k1, (num_tokens, num_heads, head_dim), jnp.float32),
        jax.random.normal(k2, (num_tokens, num_kv_heads, head_dim), dtype),
        jax.random.normal(k3, (num_tokens, num_kv_heads, head_dim), dtype),
        float_kv(
            jax.random.normal(k4, (1, 2, num_kv_heads, num_pages, PAGE_SIZE, head_dim), dtype)
        ),
        jnp.int32(0),
        jnp.asarray(page_table),
        jnp.asarray([c + n for c, n in rows], jnp.int32),
        jnp.asarray(query_starts),
    )


def bytes_read(rows, num_heads, num_kv_heads, head_dim, dtype, window=None) -> int:
    """What attention must move: cached K and V of real rows (with a sliding window, only
    the W - 1 positions before a row's first new token), q, new K/V, the output."""
    itemsize = jnp.dtype(dtype).itemsize
    num_cached = sum(c if window is None else min(c, window - 1) for c, _ in rows)
    num_tokens = sum(n for _, n in rows)
    cached = 2 * num_cached * num_kv_heads * head_dim * itemsize
    new = 2 * num_tokens * num_kv_heads * head_dim * itemsize
    q_and_out = 2 * num_tokens * num_heads * head_dim * 4
    return cached + new + q_and_out


def median_seconds(fn, repeats: int, calls: int = 1) -> float:
    """Median seconds per call of `fn`, each sample `calls` back-to-back calls (on an
    accelerator a single call can be shorter than its dispatch)."""
    jax.block_until_ready(fn())  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready([fn() for _ in range(calls)])
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def copy_bandwidth(repeats: int, calls: int) -> float:
    """Device memory bandwidth in bytes/s from a large copy (read + write)."""
    x = jnp.ones((1024 * 1024 * 1024 // 4,), jnp.float32)  # 1 GiB, far past any cache
    copy = jax.jit(lambda a: a + 1.0)
    return 2 * x.nbytes / median_seconds(lambda: copy(x), repeats, calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama3_8b")
    # float16: the KV dtype the engine picks on CPU for bfloat16 models (kv_cache.py).
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--backends", default="reference,cpu,xla,pallas_tpu,pallas_gpu")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    platform = jax.default_backend()
    on_cpu = platform == "cpu"
    size = "cpu" if on_cpu else "device"
    num_heads, num_kv_heads, head_dim = MODELS[args.model]
    dtype = jnp.dtype(args.dtype)
    print(
        f"platform {platform} ({jax.devices()[0].device_kind}), model {args.model} "
        f"({num_heads}/{num_kv_heads} heads x {head_dim}), KV {dtype.name}, page {PAGE_SIZE}"
    )
    calls = 1 if on_cpu else 20
    peak = copy_bandwidth(args.repeats, calls)
    print(f"measured copy bandwidth: {peak / 1e9:.1f} GB/s")
    if on_cpu:
        print("CPU: Pallas kernels run in interpret mode -- their times are NOT kernel speed")

    for workload in args.workloads.split(","):
        rows = WORKLOADS[workload][size]
        batch = build_batch(rows, num_heads, num_kv_heads, head_dim, dtype)
        moved = bytes_read(rows, num_heads, num_kv_heads, head_dim, dtype)
        print(
            f"\n{workload}: {len(rows)} rows, {sum(n for _, n in rows)} new tokens, "
            f"{sum(c for c, _ in rows)} cached; attention must read {moved / 1e6:.1f} MB"
        )
        window = WINDOWS.get(workload)
        if window is not None:
            windowed = bytes_read(rows, num_heads, num_kv_heads, head_dim, dtype, window)
            print(
                f"  with a {window}-token sliding window it must read {windowed / 1e6:.1f} MB "
                f"({moved / windowed:.1f}x fewer bytes); each backend: window, then none"
            )
        reference_s = None
        for backend in args.backends.split(","):
            interpret = on_cpu and pallas_kernels.get_backend(backend).interpret_on_cpu
            if backend == "pallas_tpu" and platform not in ("tpu", "cpu"):
                continue
            if backend == "pallas_gpu" and platform not in ("gpu", "cpu"):
                continue
            if backend == "cpu" and not on_cpu:  # an XLA:CPU custom call
                continue
            with warnings.catch_warnings():  # the interpret-mode warning: said above
                warnings.simplefilter("ignore", UserWarning)
                attention = pallas_kernels.get_attention(backend, interpret=interpret)
            # Jitted as the model step does (the reference is a plain function).
            attention = jax.jit(attention, static_argnames="spec")
            if window is not None:
                spec = AttentionSpec(head_dim**-0.5, sliding_window=window)
                call = functools.partial(attention, *batch, spec=spec)
                window_s = median_seconds(call, args.repeats, calls)
                line = f"  {backend:11s} {window_s * 1e3:9.3f} ms  window {window}: "
                line += f"{windowed / window_s / 1e9:8.2f} GB/s of the {windowed / 1e6:.1f} MB"
                print(line + ("  (interpret mode: not a speed)" if interpret else ""))
            call = functools.partial(attention, *batch, spec=AttentionSpec(head_dim**-0.5))
            seconds = median_seconds(call, args.repeats, calls)
            reference_s = seconds if backend == "reference" else reference_s
            line = f"  {backend:11s} {seconds * 1e3:9.3f} ms  {moved / seconds / 1e9:8.2f} GB/s"
            line += f"  {moved / seconds / peak:6.1%} of copy bandwidth"
            if reference_s and backend != "reference":
                line += f"  {reference_s / seconds:5.2f}x reference"
            if window is not None:
                line += f"  no window: {seconds / window_s:5.2f}x the windowed time"
            if interpret:
                line += "  (interpret mode: not a speed)"
            print(line)


if __name__ == "__main__":
    main()

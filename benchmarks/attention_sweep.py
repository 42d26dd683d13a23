"""Tuning sweep of the Pallas GPU attention kernel: time and error of each launch config.

For each workload of benchmarks/attention.py it runs `paged_attention_gpu` over a grid of
num_kv_splits x block_k x (num_warps, num_stages), checks each output against the jitted
reference (max abs diff), and prints time, achieved bytes/s and the fraction of measured
copy bandwidth, fastest first, with the kernel's defaults marked. Needs a GPU.

    python benchmarks/attention_sweep.py [--model llama3_8b] [--workloads decode,long_decode]
"""

from __future__ import annotations

import argparse
import functools
import itertools

import jax
import jax.numpy as jnp
from attention import MODELS, WORKLOADS, build_batch, bytes_read, copy_bandwidth, median_seconds

from ksana_jax.pallas_kernels import paged_attention_gpu, paged_attention_gpu_launches, reference
from ksana_jax.pallas_kernels.attention_spec import AttentionSpec

SPLITS = (None, 1, 4, 16)  # None: the kernel's default (paged_attention_gpu_launches.plan_launches)
BLOCK_K = (None, 32, 128)
LAUNCH = ((None, None), (4, 2), (4, 3), (8, 2), (8, 3))  # (num_warps, num_stages)
DEFAULT = (None, None, None, None)  # splits, block_k, warps, stages
CONFIGS = [(s, k, w, st) for s, k, (w, st) in itertools.product(SPLITS, BLOCK_K, LAUNCH)]


def describe_defaults(batch) -> str:
    """What the kernel picks for this batch when the caller names nothing: the tuning of
    each launch it plans (the short rows' first when there are two)."""
    q, kv, page_table = batch[0], batch[3], batch[5]
    plan = paged_attention_gpu_launches.plan_launches(
        q.shape, kv.pages.shape, kv.pages.dtype, page_table.shape
    )
    described = []
    for launch in plan:
        tuning = ", ".join(f"{name} {value}" for name, value in launch.tuning._asdict().items())
        lo, hi = launch.new_tokens
        rows = f"rows of up to {hi} new tokens: " if lo < 0 else f"rows of over {lo}: "
        described.append(tuning if len(plan) == 1 else rows + tuning)
    return "; ".join(described)


def sweep(batch, expected, configs, *, repeats: int, calls: int, interpret: bool = False):
    """[(seconds, splits, block_k, warps, stages, max abs error)] fastest first; a config
    Triton cannot compile is printed and left out."""
    sm_scale = batch[0].shape[-1] ** -0.5
    results = []
    for splits, block_k, warps, stages in configs:
        call = functools.partial(
            paged_attention_gpu.ragged_paged_attention,
            *batch,
            spec=AttentionSpec(sm_scale),
            block_k=block_k,
            num_kv_splits=splits,
            num_warps=warps,
            num_stages=stages,
            interpret=interpret,
        )
        try:
            err = float(jnp.max(jnp.abs(call() - expected)))
            seconds = median_seconds(call, repeats, calls)
        except Exception as e:  # a config Triton cannot compile: say so, go on
            print(f"  splits={splits} block_k={block_k} warps={warps} stages={stages}: {e!r:.120}")
            continue
        results.append((seconds, splits, block_k, warps, stages, err))
    return sorted(results, key=lambda r: r[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama3_8b")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--workloads", default="decode,long_decode")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    if jax.default_backend() != "gpu":
        raise SystemExit(f"needs a GPU, running on {jax.default_backend()}")

    num_heads, num_kv_heads, head_dim = MODELS[args.model]
    dtype = jnp.dtype(args.dtype)
    calls = 20
    peak = copy_bandwidth(args.repeats, calls)
    print(f"{args.model} ({num_heads}/{num_kv_heads} x {head_dim}), KV {dtype.name}")
    print(f"measured copy bandwidth: {peak / 1e9:.1f} GB/s")
    oracle = jax.jit(reference.ragged_paged_attention, static_argnames="spec")
    for workload in args.workloads.split(","):
        rows = WORKLOADS[workload]["device"]
        batch = build_batch(rows, num_heads, num_kv_heads, head_dim, dtype)
        moved = bytes_read(rows, num_heads, num_kv_heads, head_dim, dtype)
        reference_call = functools.partial(oracle, *batch, spec=AttentionSpec(head_dim**-0.5))
        expected = reference_call()
        ref_s = median_seconds(reference_call, 5, calls)
        print(
            f"\n{workload}: {len(rows)} rows, {moved / 1e6:.1f} MB; reference "
            f"{ref_s * 1e3:.3f} ms; defaults: {describe_defaults(batch)}"
        )
        results = sweep(batch, expected, CONFIGS, repeats=args.repeats, calls=calls)
        for seconds, splits, block_k, warps, stages, err in results[: args.top]:
            mark = " <- default" if (splits, block_k, warps, stages) == DEFAULT else ""
            print(
                f"  splits={splits!s:4s} block_k={block_k!s:4s} warps={warps!s:4s} "
                f"stages={stages!s:4s} {seconds * 1e3:7.3f} ms {moved / seconds / 1e9:8.1f} GB/s "
                f"{moved / seconds / peak:6.1%} {ref_s / seconds:5.2f}x ref  err {err:.1e}{mark}"
            )
        defaults = [r for r in results if r[1:5] == DEFAULT]
        if defaults and defaults[0] not in results[: args.top]:
            seconds = defaults[0][0]
            print(
                f"  default: {seconds * 1e3:.3f} ms {moved / seconds / peak:.1%} "
                f"{ref_s / seconds:.2f}x ref"
            )


if __name__ == "__main__":
    main()

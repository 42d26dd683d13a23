"""The CPU linear kernel (pallas_kernels/linear_cpu.cc) against XLA's dot, by weight dtype,
shape [O, I] and rows R: microseconds a product, weight bytes streamed per second, the
share of the all-core read bandwidth measured in the same run, and XLA's time over the
kernel's (the jnp product `models.layers.linear` used before: dequantize, then dot).

Each timed call runs a chain of products over distinct weight copies (>= 96 MB in all, more
than the L3), each product's input depending on the previous output, as a model's layers
do; the best of several calls is reported (the machine is shared and loaded: a median
measures the neighbours). Read ratios, not absolute numbers, and repeat.

    python benchmarks/linear_cpu.py [--dtypes bfloat16,int8,int4,float32] [--rows 1,2,4,8,16]
        [--shapes 576x576,1536x576,576x1536,4608x576,49152x576,smollm2] [--repeats 7]

`smollm2` is one decode step's products in sequence (121 weights: per layer the fused q/k/v,
o, the fused gate/up and down; the LM head last).

    python benchmarks/linear_cpu.py --layers [--dtypes bfloat16,int8,int4] [--repeats 7]

times one SmolLM2 decode step's layers (1 row) as the model runs them around the kernel's
calls (norms, residual adds, the activation as XLA ops) with the calls' threading threshold
PARALLEL_BYTES at its default, 1 MiB and 0 (always the pool), and "no-act": gate + up in
place of silu(gate) * up (what a kernel writing the gated activation itself could save, at
most), and "xla-ops": the norms and residual adds as XLA ops around the calls (the model's
layers before 2026-12-05; "model" has them inside the calls, layers.linear's norm= and
residual=); the variants run interleaved, each one's best counts.

2026-12-04 (a 2-core Zen 3, XLA:CPU's default concurrent schedule): the norms and residual
adds inside the calls (~14 XLA thunks a layer down to ~5) were no faster there (bfloat16
12.2 against 12.5 ms a step, int4 6.45 against 6.42) nor in the engine's tokens/s. 2026-12-05
(a 2-core Zen 4 with AVX-512, the one-thread schedule of cpu_schedule.py): int4 "model" 3.78
ms against "xla-ops" 3.99 (best of 40), and the engine's SmolLM2 int4 batch-1 median 205-220
-> 224-236 tok/s in three alternating rounds, so the model now takes them into the calls.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from ksana_jax import quant
from ksana_jax.models.layers import rms_norm
from ksana_jax.pallas_kernels import linear_cpu


def all_core_read_bandwidth(threads: int = 0) -> float:
    """Bytes/s of large sequential reads by one thread per core at once (numpy sums of
    512 MiB each, which release the GIL): the decode floor's bandwidth."""
    threads = threads or os.cpu_count() or 1
    arrays = [np.ones(1 << 27, np.float32) for _ in range(threads)]
    best = 0.0
    for _ in range(5):
        workers = [threading.Thread(target=a.sum) for a in arrays]
        start = time.perf_counter()
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        best = max(best, sum(a.nbytes for a in arrays) / (time.perf_counter() - start))
    return best


def make_weight(rng: np.random.Generator, dtype: str, out: int, inp: int):
    """A random weight; int8 / int4 ones multiply in bfloat16, as a bfloat16 model's do."""
    if dtype == "int8":
        values = rng.integers(-127, 128, (out, inp), dtype=np.int8)
        scales = jnp.asarray(rng.random((out, 1), np.float32))
        return quant.Int8Matrix(jnp.asarray(values), scales, "bfloat16")
    if dtype == "int4":
        packed = rng.integers(0, 256, (out, inp // 2), dtype=np.uint8)
        scales = jnp.asarray(rng.random((out, inp // 32)), jnp.float16)
        return quant.Int4Matrix(jnp.asarray(packed), scales, -scales, "bfloat16")
    return jnp.asarray(rng.standard_normal((out, inp), np.float32), dtype)


def xla_linear(x, w):
    """The jnp product layers.linear ran before the kernel (with its one-row padding)."""
    rows = x.shape[0]
    if quant.is_quantized(w):
        w = quant.dequantize(quant.after(w, x))
    if rows == 1 and w.dtype != jnp.float32:
        x = jnp.pad(x, ((0, 1), (0, 0)))
    contract = (((1,), (1,)), ((), ()))
    y = jax.lax.dot_general(x.astype(w.dtype), w, contract, preferred_element_type=jnp.float32)
    return y[:rows]


def chain(product):
    @jax.jit
    def run(x, weights):
        total = jnp.zeros((), jnp.float32)
        for w in weights:
            inp = w.shape[1]  # x's columns, repeated to w's input dim
            xi = jnp.tile(x, (1, -(-inp // x.shape[1])))[:, :inp]
            y = product(xi, w)[: x.shape[0]]  # drops xla_linear's padding row
            total = total + y[0, 0]
            x = x + total * 0.0  # the next product waits for this one
        return total

    return run


# SmolLM2-135M's products in one decode step: 30 layers of the fused q/k/v, o, the fused
# gate/up and down (models/fusion.py), then the tied LM head.
SMOLLM2_LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # wqkv, wo, w_gate_up, w_down
SMOLLM2_STEP = SMOLLM2_LAYER * 30 + [(49152, 576)]


def step_table(rng, dtype: str, rows_list, repeats: int, bandwidth: float) -> None:
    """One decode step's products (SmolLM2) in sequence: kernel vs XLA, ms and GB/s."""
    weights = tuple(make_weight(rng, dtype, o, i) for o, i in SMOLLM2_STEP)
    nbytes = sum(quant.nbytes(w) for w in weights)
    kernel, xla = chain(linear_cpu.linear), chain(xla_linear)
    for rows in rows_list:
        x = jnp.asarray(rng.standard_normal((rows, 576)), jnp.float32)
        t_kernel = time_chain(kernel, x, weights, repeats) * len(weights)
        t_xla = time_chain(xla, x, weights, repeats) * len(weights)
        print(
            f"{dtype:>8} {'smollm2':>11} {rows:>3} {t_kernel * 1e6:>10.0f} "
            f"{nbytes / t_kernel / 1e9:>6.1f} {100 * nbytes / t_kernel / bandwidth:>4.0f}% "
            f"{t_xla * 1e6:>9.0f} {t_xla / t_kernel:>10.2f}",
            flush=True,
        )


def decode_products(activation: bool = True, linear=linear_cpu.linear, fused: bool = True):
    """One decode step's layers as the model runs them: the input norm and q/k/v, o and the
    residual add, the MLP norm and gate/up, the activation, down and the residual add; then
    the LM head; the products by `linear` (the kernel's), the norms and residual adds in its
    calls (`fused`, as models/llama.py runs them) or as XLA ops around them. Without
    `activation` down takes gate + up (one elementwise op fewer: the most a kernel writing
    silu(gate) * up itself could save)."""

    def product(x, w, norm=None, residual=None):
        if fused:
            return linear(x, w, None if norm is None else (norm, 1e-5, 0.0), residual)
        y = linear(x if norm is None else rms_norm(x, norm, 1e-5), w)
        return y if residual is None else residual + y

    @jax.jit
    def run(x, layers, head):
        d = x.shape[1]
        for attn_norm, wqkv, wo, mlp_norm, w_gate_up, w_down in layers:
            qkv = product(x, wqkv, norm=attn_norm)
            x = product(qkv[:, :d] + qkv[:, -d:], wo, residual=x)  # attention's stand-in
            gate_up = product(x, w_gate_up, norm=mlp_norm)
            gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
            x = product(jax.nn.silu(gate) * up if activation else gate + up, w_down, residual=x)
        return linear(x, head)

    return run


def decode_layers(rng, dtype: str, shapes, count: int) -> tuple:
    """`count` layers of `decode_products`: norms and weights of shapes (wqkv, wo, w_gate_up,
    w_down)."""
    d = shapes[1][0]
    return tuple(
        (
            jnp.asarray(1 + rng.standard_normal(d) / 10, jnp.float32),
            make_weight(rng, dtype, *shapes[0]),
            make_weight(rng, dtype, *shapes[1]),
            jnp.asarray(1 + rng.standard_normal(d) / 10, jnp.float32),
            make_weight(rng, dtype, *shapes[2]),
            make_weight(rng, dtype, *shapes[3]),
        )
        for _ in range(count)
    )


def layers_table(rng, dtypes, repeats: int, bandwidth: float) -> None:
    """A decode step's layers by threading threshold (1 row)."""
    default = linear_cpu.PARALLEL_BYTES
    thresholds = {f"{default >> 10}KiB": default, "1MiB": 1 << 20, "0": 0}
    print(f"{'dtype':>8} {'variant':>8} {'parallel':>9} {'step us':>9} {'GB/s':>6} {'% bw':>5}")
    for dtype in dtypes:
        layers = decode_layers(rng, dtype, SMOLLM2_LAYER, 30)
        head = make_weight(rng, dtype, *SMOLLM2_STEP[-1])
        nbytes = sum(quant.nbytes(w) for w in jax.tree.leaves(layers, is_leaf=quant.is_quantized))
        nbytes += quant.nbytes(head)
        x = jnp.asarray(rng.standard_normal((1, 576)), jnp.float32)
        variants = {}
        for name, threshold in thresholds.items():
            linear_cpu.PARALLEL_BYTES = threshold  # read at trace time
            fn = decode_products()
            jax.block_until_ready(fn(x, layers, head))
            variants[("model", name)] = fn
        linear_cpu.PARALLEL_BYTES = default
        variants[("no-act", f"{default >> 10}KiB")] = decode_products(activation=False)
        variants[("xla-ops", f"{default >> 10}KiB")] = decode_products(fused=False)
        best = dict.fromkeys(variants, float("inf"))
        for _ in range(repeats):  # interleaved: a busy spell hits every variant
            for key, fn in variants.items():
                start = time.perf_counter()
                jax.block_until_ready(fn(x, layers, head))
                best[key] = min(best[key], time.perf_counter() - start)
        for (variant, name), t in best.items():
            print(
                f"{dtype:>8} {variant:>8} {name:>9} {t * 1e6:>9.0f} {nbytes / t / 1e9:>6.1f} "
                f"{100 * nbytes / t / bandwidth:>4.0f}%",
                flush=True,
            )


def time_chain(fn, x, weights, repeats: int) -> float:
    jax.block_until_ready(fn(x, weights))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(x, weights))
        times.append(time.perf_counter() - start)
    return min(times) / len(weights)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="bfloat16,int8,int4,float32")
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--shapes", default="576x576,1536x576,576x1536,4608x576,49152x576,smollm2")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--layers", action="store_true", help="the decode-layers table only")
    args = p.parse_args()
    if not linear_cpu.available():
        raise SystemExit("the cpu linear kernel does not build here (no C++ compiler?)")
    bandwidth = all_core_read_bandwidth()
    print(f"all-core read bandwidth: {bandwidth / 1e9:.1f} GB/s ({os.cpu_count()} threads)")
    if args.layers:
        dtypes = args.dtypes.replace(",float32", "").split(",")
        layers_table(np.random.default_rng(0), dtypes, args.repeats, bandwidth)
        return
    print(
        f"{'dtype':>8} {'O x I':>11} {'R':>3} {'kernel us':>10} {'GB/s':>6} {'% bw':>5} "
        f"{'xla us':>9} {'xla/kernel':>10}"
    )
    rng = np.random.default_rng(0)
    kernel, xla = chain(linear_cpu.linear), chain(xla_linear)
    for dtype in args.dtypes.split(","):
        for shape in args.shapes.split(","):
            if shape == "smollm2":
                step_table(rng, dtype, map(int, args.rows.split(",")), args.repeats, bandwidth)
                continue
            out, inp = map(int, shape.split("x"))
            w = make_weight(rng, dtype, out, inp)
            nbytes = quant.nbytes(w)
            copies = int(np.clip(np.ceil(96e6 / nbytes), 2, 64))
            weights = tuple(make_weight(rng, dtype, out, inp) for _ in range(copies))
            for rows in map(int, args.rows.split(",")):
                x = jnp.asarray(rng.standard_normal((rows, inp)), jnp.float32)
                t_kernel = time_chain(kernel, x, weights, args.repeats)
                t_xla = time_chain(xla, x, weights, args.repeats)
                rate = nbytes / t_kernel
                print(
                    f"{dtype:>8} {shape:>11} {rows:>3} {t_kernel * 1e6:>10.1f} "
                    f"{rate / 1e9:>6.1f} {100 * rate / bandwidth:>4.0f}% "
                    f"{t_xla * 1e6:>9.1f} {t_xla / t_kernel:>10.2f}",
                    flush=True,
                )
            del weights


if __name__ == "__main__":
    main()

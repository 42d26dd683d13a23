"""Weight-only int8 / int4 products on CPU: qwix (Google's JAX quantization library) against
ksana-jax's own formats and C++ kernel, at decode's 1 row, on SmolLM2's largest matrix shapes.

The question it answers: why quant.py and pallas_kernels/linear_cpu.py rather than qwix
(or AQT, which qwix succeeds). For each shape it prints the microseconds of one jitted
product (best of 5 x 200 calls) and the bytes the weight occupies:

- XLA's bfloat16 dot (the unquantized baseline);
- qwix: `qwix.quantize` (int8 per output channel; int4 per output channel and groups of 32
  along the input dim, min-max with zero points: GGUF Q4_1's shape) and `qwix.dot_general`;
- ksana-jax: `quant.quantize` and `models.layers.linear` (the kernel, packed bytes).

qwix is not a dependency: `pip install qwix==0.1.8` beside ksana-jax to run it (it pulls
flax; it changes none of ksana-jax's pinned packages).

    python benchmarks/quant_libraries.py
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from ksana_jax import quant
from ksana_jax.models import layers

SHAPES = [(4608, 576), (1536, 576), (576, 1536)]
_DOT = (((1,), (1,)), ((), ()))


def best_us(f, *args, calls: int = 200) -> float:
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            out = f(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls * 1e6)
    return min(times)


def nbytes(tree) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))


def main() -> None:
    try:
        import qwix
    except ImportError:
        print("qwix is not installed: pip install qwix==0.1.8")
        return
    rng = np.random.default_rng(0)
    bf16_dot = jax.jit(
        lambda x, w: jax.lax.dot_general(
            x.astype(w.dtype), w, _DOT, preferred_element_type=jnp.float32
        )
    )
    qwix_dot = jax.jit(
        lambda x, w: qwix.dot_general(
            x.astype(jnp.bfloat16), w, _DOT, preferred_element_type=jnp.float32
        )
    )
    ours_dot = jax.jit(layers.linear)
    print(
        f"{'shape':>12} {'format':>6} {'bf16 us':>8} {'qwix us':>8} {'ours us':>8} "
        f"{'bf16 MB':>8} {'qwix MB':>8} {'ours MB':>8}"
    )
    for out_dim, in_dim in SHAPES:
        w32 = rng.standard_normal((out_dim, in_dim)).astype(np.float32) * 0.05
        w = jnp.asarray(w32).astype(jnp.bfloat16)
        x = jnp.asarray(rng.standard_normal((1, in_dim)).astype(np.float32))
        base = best_us(bf16_dot, x, w)
        for fmt in ("int8", "int4"):
            if fmt == "int8":
                theirs = qwix.quantize(w, jnp.int8, channelwise_axes=(0,))
            else:
                theirs = qwix.quantize(
                    w,
                    jnp.int4,
                    channelwise_axes=(0,),
                    tiled_axes={1: 32},
                    calibration_method="minmax",
                )
            ours = jax.tree.map(jnp.asarray, quant.quantize(w32, fmt, "bfloat16"))
            print(
                f"{f'{out_dim}x{in_dim}':>12} {fmt:>6} {base:8.1f} "
                f"{best_us(qwix_dot, x, theirs):8.1f} {best_us(ours_dot, x, ours):8.1f} "
                f"{w.nbytes / 1e6:8.2f} {nbytes(theirs) / 1e6:8.2f} {nbytes(ours) / 1e6:8.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()

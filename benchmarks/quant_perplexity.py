"""Perplexity and parameter bytes of SmolLM2-135M-Instruct with quantized weights.

Text: Python's own `pydoc_data.topics` (no download), the first `--tokens` tokens, scored in
independent windows of `--window` tokens (each window's first token is context only).
Models, all from the bundled GGUF (Q4_1 linear layers, Q8_0 embedding):

    float32     the GGUF dequantized to float32 (the reference)
    int8        that model quantized at load time, int8 per output channel
    int4        that model quantized at load time, int4 asymmetric groups of 32
    gguf-int4   the GGUF read with quantization="int4": its blocks kept as they are
    bf16 rows   the same in bfloat16 (what serving on CPU uses by default)
    KV rows     the first float model with its KV cache in each of `--kv-cache-dtypes`
                (int8 / fp8: quantized per token and KV head, kv_cache.py); "KV B/token"
                is the cache's bytes per token at that dtype (scales included)

    python benchmarks/quant_perplexity.py [--tokens 4096] [--window 1024]
    python benchmarks/quant_perplexity.py --no-weights --dtypes float32  # KV rows only
    python benchmarks/quant_perplexity.py --through-kernel --dtypes bfloat16

A window's products have hundreds of rows, so on CPU they run through XLA's dot, not the C++
kernel decode's few rows take (linear_cpu.MAX_ROWS), which multiplies int8 and int4 weights
by integer dots with x rounded to 8-bit integers per 32 columns: `--through-kernel` lifts
the row limits of the bfloat16 and quantized formats, so every such product of every window
goes through the kernel and the table shows what decode's rounding of x costs (a bfloat16
product: the kernel's integer dots serve bfloat16 models; float32 stays on XLA's dot).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

import numpy as np


def text_tokens(tokenizer, num_tokens: int) -> list[int]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return tokenizer.encode(text)[:num_tokens]


def perplexity(model, tokens: list[int], window: int) -> float:
    nll, count = 0.0, 0
    for start in range(0, len(tokens) - 1, window):
        chunk = tokens[start : start + window]
        if len(chunk) < 2:
            break
        logits = model.logits(chunk).astype(np.float64)
        logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        picked = logits[np.arange(len(chunk) - 1), chunk[1:]]
        nll += float((logz[:-1] - picked).sum())
        count += len(chunk) - 1
    return math.exp(nll / count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--kv-cache-dtypes", default="int8,fp8")
    parser.add_argument("--no-weights", action="store_true", help="skip quantized weights")
    parser.add_argument(
        "--through-kernel",
        action="store_true",
        help="every bfloat16 / int8 / int4 product through the CPU kernel (decode's path)",
    )
    args = parser.parse_args()
    if args.through_kernel:
        from ksana_jax.pallas_kernels import linear_cpu

        if not linear_cpu.available():
            raise SystemExit("--through-kernel: the CPU kernel does not build on this machine")
        for name in linear_cpu.MAX_ROWS:  # read at trace time
            if name != "float32":
                linear_cpu.MAX_ROWS[name] = 1 << 20

    import ksana_jax
    from ksana_jax import quant
    from ksana_jax.demo import demo_gguf_path
    from ksana_jax.kv_cache import KVCacheSpec

    gguf = demo_gguf_path()
    rows = []
    base = None
    for dtype in args.dtypes.split(","):
        variants = {dtype: dict()}
        if not args.no_weights:
            variants |= {
                f"int8 ({dtype})": dict(quantization="int8"),
                f"int4 ({dtype})": dict(quantization="int4"),
            }
        for name, kw in variants.items():
            model = ksana_jax.load(gguf, dtype=dtype)
            if kw:  # quantized from the float model (load_time), not from the GGUF's blocks
                model = model.with_quantization(kw["quantization"])
            rows.append((name, model))
        if not args.no_weights:
            rows.append(
                (f"gguf-int4 ({dtype})", ksana_jax.load(gguf, dtype=dtype, quantization="int4"))
            )
    float_model = rows[0][1]
    for kv_dtype in filter(None, args.kv_cache_dtypes.split(",")):
        model = dataclasses.replace(float_model, kv_cache_dtype=kv_dtype)
        rows.append((f"{rows[0][0]}, KV {kv_dtype}", model))
    tokens = text_tokens(rows[0][1].tokenizer, args.tokens)
    path = "the CPU kernel (MAX_ROWS lifted)" if args.through_kernel else "the default paths"
    print(f"{len(tokens)} tokens of pydoc_data.topics, windows of {args.window}, by {path}")
    print(
        f"{'model':<22} {'perplexity':>10} {'x ' + rows[0][0]:>10} {'param MB':>9} "
        f"{'KV B/token':>10} {'s':>6}"
    )
    for name, model in rows:
        start = time.perf_counter()
        ppl = perplexity(model, tokens, args.window)
        base = base or ppl
        mb = quant.nbytes(model.params) / 1e6
        took = time.perf_counter() - start
        kv = KVCacheSpec.for_model(model.config, 2, 16, model.kv_dtype).bytes_per_page // 16
        print(f"{name:<22} {ppl:>10.3f} {ppl / base:>10.4f} {mb:>9.1f} {kv:>10} {took:>6.1f}")


if __name__ == "__main__":
    main()

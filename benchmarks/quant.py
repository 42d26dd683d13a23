"""Decode speed with quantized weights: SmolLM2 in bfloat16, int8 and int4 at batch 1 and 16,
against the floor weight_bytes / read bandwidth and llama.cpp's Q4_1.

Each weight format is the bundled demo checkpoint loaded in bfloat16 and quantized at load
time (`ksana_jax.load(..., quantization=...)`; the products run in bfloat16). For each row
count, `rows` requests of a 16-token random prompt each decode `--tokens` tokens (EOS
ignored, all submitted at once) through the engine (host work included), after a warm-up of
the same shape; "tok/s" counts the tokens after the first over the time they took (a run of
the first token only is subtracted: the prefill). The engine has exactly one decode shape
per row count (token_buckets (rows, 16 x rows), so batch 1 runs a 1-row step, not the
default engine's smallest 16-token bucket) and one context bucket of 256 tokens. The
formats run interleaved `--repeat` times and each one's best runs count (the machine is
shared: one busy spell should not decide a ratio).
"step ms" is the jitted step alone at 1 row, steps dispatched back to back (throughput.py's
`decode_step_seconds`, pipelined) at the timed runs' mean context: a step's time with its
dispatch hidden behind the step before, the most the engine could reach with no other host
work between its steps; tok/s below 1000 / step ms is the engine's own host work
(scheduling, inputs, fetching and detokenizing) that the overlap does not hide.

The floor is the params' bytes (every matrix is read once a step; the tied LM head is the
embedding table) over the all-core read bandwidth measured in this run (linear_cpu.py's
`all_core_read_bandwidth`). "kernel" says whether `layers.linear` takes the C++ CPU kernel
(pallas_kernels/linear_cpu.py) for the model's matrices at that row count: its MAX_ROWS per
format decide, at trace time. llama.cpp's Q4_1 figure is FACTS.md's (llama-cpp-python built
without AMX on this machine), not measured in this run.

    python benchmarks/quant.py [--rows 1 16] [--formats bfloat16,int8,int4] [--tokens 64]
        [--repeat 2]
"""

from __future__ import annotations

import argparse
import time

import jax
from host_overhead import random_prompts
from linear_cpu import all_core_read_bandwidth
from throughput import decode_step_seconds

import ksana_jax
from ksana_jax import LLM, SamplingParams, quant
from ksana_jax.demo import demo_checkpoint
from ksana_jax.models import registry
from ksana_jax.pallas_kernels import linear_cpu

MAX_MODEL_LEN = 256  # > 16 prompt + 64 output tokens: one context bucket
PAGE_SIZE = 16
PROMPT_TOKENS = 16  # host_overhead.random_prompts'
# FACTS.md: llama.cpp (llama-cpp-python 0.3.36, built without AMX) on SmolLM2's Q4_1 GGUF,
# 2 threads on this machine: tok/s by batch.
LLAMA_CPP_Q4_1 = {1: "69-86", 8: "135", 32: "154"}


def load(path, fmt: str):
    quantization = None if fmt == "bfloat16" else fmt
    return ksana_jax.load(path, dtype="bfloat16", quantization=quantization)


def takes_kernel(model, rows: int) -> bool:
    """Whether every matrix of one layer, and the LM head, goes through the C++ kernel at
    `rows` rows (linear_cpu.takes, the dispatch `layers.linear` makes at trace time)."""
    layer = registry.layer_params(model.params)[0]
    matrices = [w for w in jax.tree.leaves(layer, is_leaf=quant.is_quantized) if len(w.shape) == 2]
    matrices.append(model.params.get("lm_head", model.params["embed"]))
    return all(
        linear_cpu.takes(jax.ShapeDtypeStruct((rows, w.shape[1]), "float32"), w) for w in matrices
    )


def engine_options(rows: int, max_model_len: int) -> dict:
    """Exactly one decode shape (`rows` tokens; 1 at batch 1, which the default engine's
    smallest 16-token bucket is not) and one prefill shape (every row's prompt at once)."""
    prefill = rows * PROMPT_TOKENS
    return dict(
        max_model_len=max_model_len,
        page_size=PAGE_SIZE,
        max_num_seqs=rows,
        max_num_batched_tokens=prefill,
        token_buckets=tuple(sorted({rows, prefill})),
        seq_buckets=(rows,),
        context_buckets=(max_model_len,),
        num_pages=(rows + 1) * (max_model_len // PAGE_SIZE) + 1,
        enable_prefix_caching=False,
    )


def build(model, rows: int, max_model_len: int) -> LLM:
    llm = LLM(model, **engine_options(rows, max_model_len))
    prompts = random_prompts(rows, model.config.vocab_size)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    return llm


def generate_seconds(llm: LLM, rows: int, tokens: int) -> float:
    """Seconds to generate `tokens` a row for `rows` requests submitted at once."""
    prompts = random_prompts(rows, llm.engine.model.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
    return seconds


def measure(
    path,
    formats,
    rows_list,
    tokens: int,
    repeat: int,
    max_model_len=MAX_MODEL_LEN,
    step_repeats=100,
) -> list[dict]:
    """One result per (format, rows) of the checkpoint at `path`: best tok/s over `repeat`
    interleaved runs, the params' bytes, whether the kernel runs, and (at 1 row) the best
    jitted step time."""
    results = []
    for rows in rows_list:
        engines = {}
        for fmt in formats:
            model = load(path, fmt)
            engines[fmt] = build(model, rows, max_model_len)
            results.append(
                dict(
                    format=fmt,
                    rows=rows,
                    weight_bytes=quant.nbytes(model.params),
                    kernel=takes_kernel(model, rows),
                    tok_s=0.0,
                    full_s=float("inf"),  # best run of `tokens` a row
                    first_s=float("inf"),  # best run of the first token only (the prefill)
                    step_s=float("inf"),
                )
            )
        mine = results[-len(formats) :]
        for _ in range(repeat):
            for row in mine:
                llm = engines[row["format"]]
                row["full_s"] = min(row["full_s"], generate_seconds(llm, rows, tokens))
                row["first_s"] = min(row["first_s"], generate_seconds(llm, rows, 1))
                # The tokens after the first over the time they took.
                row["tok_s"] = rows * (tokens - 1) / (row["full_s"] - row["first_s"])
                if rows == 1:
                    middle = PROMPT_TOKENS + tokens // 2  # the timed runs' mean context
                    step_s = decode_step_seconds(llm, step_repeats, True, middle)
                    row["step_s"] = min(row["step_s"], step_s)
            for row in mine:
                print_row(row, float("nan"), flush=True)  # progress; the table comes last
        del engines
    return results


def print_header() -> None:
    print(
        f"{'weights':<10}{'rows':>5}{'kernel':>8}{'MB':>7}{'tok/s':>9}{'floor tok/s':>13}"
        f"{'floor/ours':>11}{'step ms':>9}{'floor ms':>10}{'llama.cpp Q4_1':>16}"
    )


def print_row(r: dict, bandwidth: float, flush: bool = False) -> None:
    floor_s = r["weight_bytes"] / bandwidth  # one step's weight reads
    floor_tok_s = r["rows"] / floor_s
    step = f"{r['step_s'] * 1e3:.1f}" if r["step_s"] != float("inf") else "-"
    print(
        f"{r['format']:<10}{r['rows']:>5}{'yes' if r['kernel'] else 'no':>8}"
        f"{r['weight_bytes'] / 1e6:>7.0f}{r['tok_s']:>9.1f}{floor_tok_s:>13.1f}"
        f"{floor_tok_s / r['tok_s']:>11.2f}{step:>9}{floor_s * 1e3:>10.1f}"
        f"{LLAMA_CPP_Q4_1.get(r['rows'], '-'):>16}",
        flush=flush,
    )


def report(results: list[dict], bandwidth: float, tokens: int) -> None:
    print(
        f"\nSmolLM2-135M, {tokens} output tokens a request, 16-token prompts, max_model_len "
        f"{MAX_MODEL_LEN}; all-core read bandwidth {bandwidth / 1e9:.1f} GB/s (best of before "
        "and after)"
    )
    print_header()
    for r in results:
        print_row(r, bandwidth)
    by = {(r["format"], r["rows"]): r for r in results}
    print("\nratios (tok/s)")
    for rows in sorted({r["rows"] for r in results}):
        base = by.get(("bfloat16", rows))
        for fmt in ("int8", "int4"):
            if base and (fmt, rows) in by:
                ratio = by[fmt, rows]["tok_s"] / base["tok_s"]
                print(f"batch {rows}: {fmt} / bfloat16 {ratio:.2f}x")
    if ("int4", 1) in by:
        r = by["int4", 1]
        floor_s = r["weight_bytes"] / bandwidth
        print(f"batch 1: int4 tok/s is {1 / floor_s / r['tok_s']:.2f}x below its floor", end="")
        if r["step_s"] != float("inf"):
            print(f" (its steps back to back: {r['step_s'] / floor_s:.2f}x)", end="")
        print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 16])
    parser.add_argument("--formats", default="bfloat16,int8,int4")
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--repeat", type=int, default=2, help="interleaved runs; best counts")
    args = parser.parse_args()

    formats = args.formats.split(",")
    print_header()  # rows as they are measured (floor unknown yet), then the table
    bandwidth = all_core_read_bandwidth()
    results = measure(demo_checkpoint(), formats, args.rows, args.tokens, args.repeat)
    # The best of two measurements, one before and one after (the machine is shared).
    report(results, max(bandwidth, all_core_read_bandwidth()), args.tokens)


if __name__ == "__main__":
    main()

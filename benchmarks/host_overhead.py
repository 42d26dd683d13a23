"""Host overhead per decode step: decode throughput where the device step is nearly free.

On a tiny random Llama (2 layers, hidden 128, SmolLM2's vocabulary and tokenizer) a decode
step costs the device almost nothing, so the host's work per step decides the speed; SmolLM2
(bfloat16, or `--dtype float32`) shows the same with a real model. For each model,
max_model_len, row count and async scheduling off/on: `rows` requests of a short random prompt
each decode `--tokens` tokens (EOS ignored), all submitted at once, after a warm-up run of the
same shape (max_model_len is capped at the model's context: SmolLM2 has 8192). The timed run
is repeated (`--repeat`, 3), every (max_model_len, mode) of a row count taking turns, and
each one's fastest run counts: on a shared machine one slow run says more about the machine
than about the engine; `spread` (slowest / fastest tok/s) shows how much the runs differed.
Prints output tokens per second, wall ms per engine step, and -- when the engine has a step
timer -- host ms per step, device ms per step and the fraction of time the device sat idle
between steps (see ksana_jax/step_metrics.py). Runs against older engines too (no async
option, no timer: those columns say n/a).

    python benchmarks/host_overhead.py [--models tiny smollm2 llama3_8b] [--rows 1 64 256]
        [--max-model-len 1024 32768] [--tokens 64] [--repeat 3] [--dtype bfloat16]
        [--random-weights] [--sampling greedy|sampled|penalties]

`--sampling` is what every request asks (vLLM's requests too), and so which sampler the
steps run (sampling.SamplerPlan): greedy (the argmax alone), sampled (temperature and top-p:
filters and noise) or penalties (greedy with presence and frequency penalties: a full plan).

"llama3_8b" (for a GPU machine: 16 GB of weights) and, with `--random-weights`, "smollm2"
have random bfloat16 weights made on the device (`random_model`): no checkpoint is read.

In the same run, vLLM's CPU build decodes the same requests on the same checkpoints (rows
"vllm"; its own venv, made on first use: see vllm_peer.py; `--no-vllm` leaves it out; its
fastest of `--repeat` timed passes too), and the ratios compare ksana-jax's faster mode with
it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import vllm_peer

import ksana_jax
from ksana_jax import LLM, SamplingParams
from ksana_jax.config import EngineConfig
from ksana_jax.demo import cache_dir, demo_checkpoint

PAGE_SIZE = 16
PROMPT_TOKENS = 16
SAMPLING = {  # --sampling: SamplingParams fields of every request (vLLM's names)
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=0.8, top_p=0.95),
    "penalties": dict(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5),
}


def tiny_checkpoint() -> Path:
    """A random 2-layer, hidden-128 Llama with SmolLM2's tokenizer (written once)."""
    out = cache_dir() / "bench-tiny-llama"
    if (out / "config.json").exists():
        return out
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(staging)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_checkpoint() / name, staging / name)
    staging.rename(out)
    return out


def engine_options(
    rows: int, max_model_len: int, asynchronous: bool | None, tokens: int = 1024
) -> dict:
    """One compiled decode shape and one prefill shape, the size of the rows' prompts (at
    most 1,024 tokens a step: more is chunked), so a few rows' prefill is not padded to a
    1,024-token step vLLM would not run; pages for the rows' prompts and `tokens` outputs,
    and at least one max_model_len sequence (the engine's own check)."""
    per_request = -(-(PROMPT_TOKENS + tokens) // PAGE_SIZE)
    prefill = min(rows * PROMPT_TOKENS, max(rows, 1024))
    options = dict(
        max_model_len=max_model_len,
        page_size=PAGE_SIZE,
        max_num_seqs=rows,
        max_num_batched_tokens=prefill,
        token_buckets=tuple(sorted({rows, prefill})),
        seq_buckets=(rows,),
        num_pages=max(rows * per_request, max_model_len // PAGE_SIZE) + 2,
        enable_prefix_caching=False,
    )
    if asynchronous is not None:
        options["async_scheduling"] = asynchronous
    return options


def random_model(name: str) -> ksana_jax.Model:
    """A model of `name`'s shape with random bfloat16 weights made on the device, for a
    machine that has no checkpoint of it (decode speed does not depend on the weights'
    values): "smollm2" is the demo's config, "llama3_8b" aot_engine_step.MODEL_SHAPES' with
    SmolLM2's vocabulary (49,152, not 128,256: its tokenizer, the tiny checkpoint's, stands
    in, so the LM head is 0.4 GB, not 1.05). The tokenizer is the tiny checkpoint's."""
    from aot_engine_step import MODEL_SHAPES

    from ksana_jax.checkpoint import read_tokenizer
    from ksana_jax.models import registry
    from ksana_jax.sharding import make_plan

    tokenizer_dir = tiny_checkpoint()
    if name == "smollm2":  # the converted demo's config (its folder alone, without params, will do)
        config = cache_dir() / "SmolLM2-135M-Instruct" / "config.json"
        config = config if config.exists() else demo_checkpoint() / "config.json"
        hf = json.loads(config.read_text())
    else:
        hf = dict(MODEL_SHAPES[name], vocab_size=49152, bos_token_id=1, eos_token_id=2)
    config = registry.config_from_hf(dict(hf, dtype="bfloat16", torch_dtype="bfloat16"))
    key = jax.random.key(0)
    flat = {}
    for i, (param, shape) in enumerate(registry.param_shapes(config).items()):
        noise = jax.random.normal(jax.random.fold_in(key, i), shape, jnp.bfloat16)
        flat[param] = 1 + noise / 10 if param.endswith("norm") else noise / 50
    plan = make_plan(config, 1)
    params = plan.shard_params(registry.params_from_flat(flat, config))
    return ksana_jax.Model(config, params, read_tokenizer(tokenizer_dir), {}, plan)


def random_prompts(rows: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(100, vocab, PROMPT_TOKENS)] for _ in range(rows)]


def measure(
    model,
    rows: int,
    max_model_lens: list[int],
    tokens: int,
    modes: list[bool | None],
    repeat: int = 1,
    sampling: dict | None = None,
) -> dict[tuple[int, bool | None], dict]:
    """Each (max_model_len, mode) on its own engine, warmed up, then the timed run `repeat`
    times, all of them taking turns (reversed every other round, so none always runs first):
    on a shared machine whose speed drifts, configurations measured one after the other
    differ by the drift as much as by themselves (README). Each one's fastest run, with
    `spread` = slowest / fastest tok/s. `sampling`: SamplingParams fields (default greedy)."""
    prompts = random_prompts(rows, model.config.vocab_size)
    sampling = sampling or SAMPLING["greedy"]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, **sampling)
    configs = [(max_model_len, mode) for max_model_len in max_model_lens for mode in modes]
    llms = {}
    for max_model_len, mode in configs:
        options = engine_options(rows, max_model_len, mode, tokens)
        llms[max_model_len, mode] = llm = LLM(model, **options)
        llm.generate(prompts, SamplingParams(max_tokens=4, **sampling), use_tqdm=False)
    runs: dict[tuple[int, bool | None], list[dict]] = {config: [] for config in configs}
    for round_ in range(repeat):
        for config in configs if round_ % 2 == 0 else configs[::-1]:
            runs[config].append(_timed(llms[config], prompts, params, rows, tokens))
    best = {}
    for config, rows_ in runs.items():
        best[config] = max(rows_, key=lambda row: row["tok_s"])
        best[config]["spread"] = min(r["tok_s"] for r in rows_) / best[config]["tok_s"]
    return best


def _timed(llm, prompts, params, rows: int, tokens: int) -> dict:
    """One timed generate: tok/s, wall ms per step and (with a step timer) host and device
    ms per step and the device's idle fraction."""
    engine = llm.engine
    steps_before = engine.stats.steps
    timer = getattr(engine, "timer", None)
    if timer is not None:
        engine.timer = type(timer)()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
    steps = engine.stats.steps - steps_before
    row = dict(tok_s=rows * tokens / seconds, wall_ms=seconds / steps * 1e3)
    if timer is not None:
        t = engine.timer
        row |= dict(host_ms=t.host_ms.mean, device_ms=t.device_ms.mean, idle=t.idle_fraction)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["tiny", "smollm2"])
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 64, 256])
    parser.add_argument("--max-model-len", type=int, nargs="*", default=[1024, 32768])
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument(
        "--repeat", type=int, default=3, help="timed runs per mode, taking turns: the best counts"
    )
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM-CPU out")
    parser.add_argument(
        "--dtype", default="bfloat16", help="SmolLM2's dtype (the tiny model runs in float32)"
    )
    parser.add_argument(
        "--random-weights",
        action="store_true",
        help="SmolLM2 with random bfloat16 weights made on the device (`random_model`)",
    )
    parser.add_argument(
        "--sampling",
        choices=sorted(SAMPLING),
        default="greedy",
        help="what every request asks: the argmax, temperature and top-p, or penalties",
    )
    args = parser.parse_args()
    sampling = SAMPLING[args.sampling]

    has_async = "async_scheduling" in {f.name for f in dataclasses.fields(EngineConfig)}
    modes = [False, True] if has_async else [None]
    results = []
    for name in args.models:
        if name == "llama3_8b" or (name == "smollm2" and args.random_weights):
            path, dtype, model = None, "bfloat16", random_model(name)
        else:
            path = tiny_checkpoint() if name == "tiny" else demo_checkpoint()
            dtype = "float32" if name == "tiny" else args.dtype
            model = ksana_jax.load(path, dtype=dtype)
        context = model.config.max_position_embeddings
        max_model_lens = sorted({min(n, context) for n in args.max_model_len})
        for rows in args.rows:
            best = measure(model, rows, max_model_lens, args.tokens, modes, args.repeat, sampling)
            for (max_model_len, mode), row in best.items():
                results.append((name, max_model_len, rows, mode, row))
                print_row(*results[-1], flush=True)
            if args.no_vllm or path is None:  # vLLM loads checkpoints only
                continue
            prompts = random_prompts(rows, model.config.vocab_size)
            for max_model_len in max_model_lens:
                peer = vllm_peer.run(
                    path if name == "tiny" else vllm_peer.smollm2_hf_dir(),
                    prompts,
                    args.tokens,
                    dtype=dtype,
                    max_model_len=max_model_len,
                    max_num_seqs=rows,
                    repeat=args.repeat,
                    sampling=sampling,
                )
                if peer is not None:
                    row = dict(tok_s=peer["tok_s"], wall_ms=peer["seconds"] / args.tokens * 1e3)
                    results.append((name, max_model_len, rows, "vllm", row))
                    print_row(*results[-1], flush=True)
    results.sort(key=lambda r: (r[0], r[1], r[2]))  # by model, max_model_len, rows
    print(
        f"\n{args.tokens} output tokens per request, {PROMPT_TOKENS}-token prompts, "
        f"sampling {args.sampling} {sampling}"
    )
    print_header()
    for result in results:
        print_row(*result)
    print_ratios(results)


def print_header() -> None:
    print(
        f"{'model':<8}{'max_len':>8}{'rows':>6}{'async':>7}{'tok/s':>10}{'spread':>8}"
        f"{'wall ms':>9}{'host ms':>9}{'dev ms':>9}{'idle':>7}"
    )


def print_row(name, max_model_len, rows, mode, row, flush=False) -> None:
    def cell(key, fmt):
        return format(row[key], fmt) if key in row else "n/a"

    mode = {None: "n/a", False: "off", True: "on", "vllm": "vllm"}[mode]
    print(
        f"{name:<8}{max_model_len:>8}{rows:>6}{mode:>7}{row['tok_s']:>10.0f}"
        f"{cell('spread', '.2f'):>8}{row['wall_ms']:>9.2f}{cell('host_ms', '.2f'):>9}"
        f"{cell('device_ms', '.2f'):>9}{cell('idle', '.0%'):>7}",
        flush=flush,
    )


def print_ratios(results) -> None:
    """async on / off, max_model_len largest / smallest, and ksana-jax / vLLM-CPU."""
    by_key = {(n, m, r, a): row["tok_s"] for n, m, r, a, row in results}
    lens = sorted({m for _, m, _, _, _ in results})
    print("\nratios (throughput)")
    for n, m, r, a in by_key:
        if a == "vllm":
            ours = max(
                v
                for (n2, m2, r2, a2), v in by_key.items()
                if (n2, m2, r2) == (n, m, r) and a2 != "vllm"
            )
            print(
                f"{n} max_len {m} rows {r}: ksana-jax (faster mode) / vLLM-CPU "
                f"{ours / by_key[n, m, r, a]:.2f}x"
            )
            continue
        if a is True and (n, m, r, False) in by_key:
            ratio = by_key[n, m, r, a] / by_key[n, m, r, False]
            print(f"{n} max_len {m} rows {r}: async on/off {ratio:.2f}x")
        if m == lens[-1] and len(lens) > 1 and (n, lens[0], r, a) in by_key:
            ratio = by_key[n, m, r, a] / by_key[n, lens[0], r, a]
            print(f"{n} rows {r} async {a}: max_len {m}/{lens[0]} {ratio:.2f}x")


if __name__ == "__main__":
    main()

"""Sharded runs for tests/test_sharding.py, in a process of its own: it needs several CPU
devices (XLA_FLAGS=--xla_force_host_platform_device_count=N, set before JAX starts) or
several processes, while the rest of the suite runs on one device.

    python tests/sharding_worker.py SCENARIO CHECKPOINT_DIR [CHECKPOINT_DIR ...]
        [--devices N] [--coordinator HOST:PORT --num-processes N --process-id I]

Prints one JSON object on its last line of stdout (process 0 only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's ksana_jax

PROMPTS = [[5, 9, 17, 33, 2 + i] * (1 + i) for i in range(4)]
ENGINE = dict(
    max_model_len=128,
    page_size=8,  # the Pallas TPU kernel wants multiples of 8 (float32 KV)
    max_num_seqs=4,
    max_num_batched_tokens=32,
    token_buckets=(8, 32),
    seq_buckets=(4,),
    context_buckets=(32, 128),
    num_pages=64,
)
# Greedy comparisons pad every step to one shape: one compile per engine.
ONE_SHAPE = ENGINE | {"token_buckets": (32,), "context_buckets": (128,)}
GREEDY_TOKENS = 10


def param_bytes(params) -> dict:
    """Total parameter bytes, each device's bytes, and the largest device's fraction."""
    import jax

    from ksana_jax.sharding import bytes_per_device

    per_device = sorted(bytes_per_device(params).values())
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    return {"total": total, "per_device": per_device, "max_fraction": per_device[-1] / total}


def shardings_match_plan(model) -> bool:
    """Every parameter sits in exactly the sharding its logical axes give."""
    import jax

    wanted = model.plan.param_shardings(model.params)
    return all(
        a.sharding.is_equivalent_to(w, a.ndim)
        for a, w in zip(jax.tree.leaves(model.params), jax.tree.leaves(wanted), strict=True)
    )


def greedy_engine(model, tp: int, backend: str = "reference", prompts=PROMPTS, **kw) -> list:
    from ksana_jax import LLM, SamplingParams

    llm = LLM(
        model, warm_up=False, tensor_parallel_size=tp, attention_backend=backend, **ONE_SHAPE | kw
    )
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def scenario_tiny(paths: list[str]) -> dict:
    """Per tiny checkpoint: tp 1/2/4 restored into shards; logits, engine greedy tokens,
    Pallas backends (interpret mode) under the mesh."""
    import numpy as np

    import ksana_jax

    results = {}
    for path in paths:
        runs, reference_logits = {}, None
        for tp in (1, 2, 4):
            model = ksana_jax.load(path, tensor_parallel_size=tp)
            logits = model.logits(PROMPTS[3])
            if reference_logits is None:
                reference_logits = logits
            runs[tp] = {
                "plan": model.plan.describe(),
                "shardings_match_plan": shardings_match_plan(model),
                "bytes": param_bytes(model.params),
                "logits_max_diff": float(np.abs(logits - reference_logits).max()),
                "tokens": greedy_engine(model, tp),
            }
            runs[tp]["logits_max_abs"] = float(np.abs(reference_logits).max())
            if tp == 4:  # interpret mode compiles slowly: the largest mesh only
                for backend in ("pallas_tpu", "pallas_gpu"):
                    runs[tp][backend] = greedy_engine(model, tp, backend, PROMPTS[:2])
        results[path] = runs
    return results


def scenario_families(paths: list[str]) -> dict:
    """Per checkpoint of another family (sliding windows, q/k norms, Gemma's extra norms):
    tp 1 and 2 restored into shards; logits and engine greedy tokens (reference backend)."""
    import numpy as np

    import ksana_jax

    results = {}
    for path in paths:
        runs = {}
        for tp in (1, 2):
            model = ksana_jax.load(path, tensor_parallel_size=tp)
            runs[tp] = {
                "plan": model.plan.describe(),
                "shardings_match_plan": shardings_match_plan(model),
                "logits": model.logits(PROMPTS[3]),
                "tokens": greedy_engine(model, tp),
            }
        want = runs[1].pop("logits")
        got = runs[2].pop("logits")
        runs[2]["logits_max_diff"] = float(np.abs(got - want).max())
        runs[2]["logits_max_abs"] = float(np.abs(want).max())
        results[path] = runs
    return results


def scenario_moe(paths: list[str]) -> dict:
    """An MoE checkpoint at tp 1, 2 and 4, each with and without expert parallelism, restored
    into shards: logits, engine greedy tokens, and each device's bytes of the expert weights
    and of all parameters."""
    import jax
    import numpy as np

    import ksana_jax
    from ksana_jax.sharding import bytes_per_device

    runs, want = {}, None
    for tp, ep in ((1, False), (2, False), (2, True), (4, False), (4, True)):
        model = ksana_jax.load(paths[0], tensor_parallel_size=tp, enable_expert_parallel=ep)
        logits = model.logits(PROMPTS[3])
        want = logits if want is None else want
        experts = [
            {k: v for k, v in layer.items() if k.endswith("_exps")}
            for layer in model.params["layers"]
        ]
        expert_total = sum(leaf.nbytes for leaf in jax.tree.leaves(experts))
        runs[f"{tp}{'-ep' if ep else ''}"] = {
            "plan": model.plan.describe(),
            "shardings_match_plan": shardings_match_plan(model),
            "expert_bytes_total": expert_total,
            "expert_bytes_per_device": sorted(bytes_per_device(experts).values()),
            "bytes": param_bytes(model.params),
            "logits_max_diff": float(np.abs(logits - want).max()),
            "logits_max_abs": float(np.abs(want).max()),
            "tokens": greedy_engine(model, tp, enable_expert_parallel=ep),
        }
    return runs


def scenario_recompile(paths: list[str]) -> dict:
    """tp=4: warm-up compiles every bucket, then the workload of test_engine.py's
    test_no_compilation_after_warm_up (workloads.py: sampling variants, n=2, stops,
    priorities, aborts, prefix-cache hits, preemption) compiles nothing."""
    from workloads import record_compilations, run_varied_workload

    import ksana_jax
    from ksana_jax import LLM
    from ksana_jax.sampling import scored_sizes
    from ksana_jax.step_programs import compile_count

    compiles = record_compilations()
    model = ksana_jax.load(paths[0], tensor_parallel_size=4)
    llm = LLM(
        model,
        tensor_parallel_size=4,
        max_model_len=256,
        page_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        context_buckets=(64, 256),
        num_pages=70,
    )
    warm = compile_count()
    compiles.clear()
    engine = llm.engine
    run_varied_workload(engine, vocab=160)
    runner = engine.runner
    return {
        "buckets": len(llm.engine.runner.bucket_shapes()),
        "scored_sizes": len(scored_sizes(runner.config.max_num_scored_tokens)),
        "warm": warm,
        "after": compile_count(),
        "compiles_after_warm_up": len(compiles),
        "preemptions": engine.stats.preemptions,
        "kv_spec": str(runner.kv.pages.sharding.spec),
        "kv_matches_plan": runner.kv.pages.sharding
        == runner.plan.kv_sharding(runner.kv.pages.shape),
    }


def scenario_donation(paths: list[str]) -> dict:
    """tp=4: the compiled step aliases the donated KV shard and holds no second copy."""
    import numpy as np

    import ksana_jax
    from ksana_jax.kv_cache import KVCacheSpec, allocate_kv
    from ksana_jax.step import logits_step
    from ksana_jax.step_inputs import SequenceChunk, build_step_inputs

    model = ksana_jax.load(paths[0], tensor_parallel_size=4)
    plan = model.plan
    spec = KVCacheSpec.for_model(model.config, 4096, 16, "float32")
    kv = allocate_kv(spec, plan.kv_sharding(spec.shape))
    inputs = build_step_inputs([SequenceChunk(PROMPTS[2], 0, range(1, 3))], 16, 32, 4, 8)
    inputs, idx = plan.put_replicated((inputs, np.zeros(4, np.int32)))
    shard_bytes = kv.pages.addressable_shards[0].data.nbytes
    with plan.activate():
        compiled = logits_step.lower(model.params, model.config, kv, inputs, idx).compile()
        stats = compiled.memory_analysis()
        _, new_kv = compiled(model.params, kv, inputs, idx)
    return {
        "kv_bytes": spec.nbytes,
        "kv_shard_bytes": shard_bytes,
        "alias": stats.alias_size_in_bytes,
        "temp": stats.temp_size_in_bytes,
        "extra_output": stats.output_size_in_bytes - stats.alias_size_in_bytes,
        "donated": kv.pages.is_deleted(),
        "same_sharding": new_kv.pages.sharding == kv.pages.sharding,
    }


def scenario_smollm2(paths: list[str]) -> dict:
    """SmolLM2 at tp 1/2/4, restored into shards: bytes per device, greedy tokens, logits."""
    import numpy as np

    import ksana_jax

    prompts = ["The capital of France is", "def fibonacci(n):"]
    runs, reference_logits = {}, None
    for tp in (1, 2, 4):
        model = ksana_jax.load(paths[0], tensor_parallel_size=tp)
        ids = [model.tokenizer.encode(p) for p in prompts]
        logits = model.logits(ids[0])
        if reference_logits is None:
            reference_logits = logits
        tokens = [ksana_jax.generate(model, p, max_tokens=12, stop_token_ids=[]) for p in ids]
        runs[tp] = {
            "plan": model.plan.describe(),
            "shardings_match_plan": shardings_match_plan(model),
            "bytes": param_bytes(model.params),
            "logits_max_diff": float(np.abs(logits - reference_logits).max()),
            "logits_max_abs": float(np.abs(reference_logits).max()),
            "tokens": tokens,
        }
    return runs


def scenario_bench(paths: list[str]) -> dict:
    """Not a test: per-device parameter bytes and engine decode step times at tp 1/2/4
    (CPU devices share the same cores, so this shows overheads, not speed-ups)."""
    import ksana_jax
    from ksana_jax import LLM, SamplingParams

    out = {}
    for tp in (1, 2, 4):
        model = ksana_jax.load(paths[0], tensor_parallel_size=tp)
        llm = LLM(
            model,
            warm_up=False,
            tensor_parallel_size=tp,
            **(ENGINE | {"max_num_seqs": 8, "seq_buckets": (8,), "token_buckets": (8, 32)}),
        )
        times = {}
        for batch in (1, 8):
            engine = llm.engine
            for i in range(batch):
                prompt = model.tokenizer.encode(f"Story number {i}: once upon a time")
                engine.add_request(f"b{batch}-{i}", prompt, SamplingParams(max_tokens=24))
            steps = []
            while engine.has_unfinished_requests():
                start = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - start)
            decode = sorted(steps[3:])  # after prefill and the first compiles
            times[f"decode_step_ms_batch{batch}"] = round(1000 * decode[len(decode) // 2], 2)
        out[tp] = {"plan": model.plan.describe(), "bytes": param_bytes(model.params)} | times
    return out


def scenario_multihost(paths: list[str]) -> dict | None:
    """One of several processes: tp over all devices, process 0 generates, others follow."""
    import jax

    import ksana_jax
    from ksana_jax import LLM, SamplingParams

    model = ksana_jax.load(paths[0], tensor_parallel_size=jax.device_count())
    llm = LLM(model, tensor_parallel_size=jax.device_count(), **ONE_SHAPE)
    if jax.process_index() != 0:
        return {"followed_steps": llm.follow()}
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    # A prompt of 11 pages, twice: the second run's prefix-cache hit gains 10 pages, more
    # than a step's page writes carry (4 rows + 32 / 8), so they go before its step.
    long = (PROMPTS[3] * 5)[:88]
    repeated = [llm.generate([long], params, use_tqdm=False)[0] for _ in range(2)]
    llm.close()
    return {
        "repeated": [o.outputs[0].token_ids for o in repeated],
        "cached_tokens": repeated[1].num_cached_tokens,
        "processes": jax.process_count(),
        "devices": jax.device_count(),
        "local_devices": jax.local_device_count(),
        "plan": model.plan.describe(),
        "tokens": [o.outputs[0].token_ids for o in outs],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario")
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--coordinator", default=None)
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    warnings.simplefilter("ignore")  # Pallas interpret-mode warnings
    import jax

    if args.coordinator:
        from ksana_jax import multihost

        multihost.initialize(args.coordinator, args.num_processes, args.process_id)
    else:  # as conftest.py does: reruns skip compiling identical steps
        cache = Path.home() / ".cache" / "ksana-jax" / "jax"
        jax.config.update(
            "jax_compilation_cache_dir", os.environ.get("KSANA_TEST_JAX_CACHE", str(cache))
        )
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    if jax.device_count() < 4:
        sys.exit(f"needs 4 devices, found {jax.devices()}")
    result = globals()[f"scenario_{args.scenario}"](args.paths)
    if jax.process_index() == 0:
        print(json.dumps(result))


if __name__ == "__main__":
    main()

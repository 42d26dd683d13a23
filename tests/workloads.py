"""The varied engine workload of the zero-recompile tests: tests/test_engine.py on one
device, and tests/sharding_worker.py under tensor parallelism."""

from __future__ import annotations

import jax
import numpy as np

from ksana_jax import SamplingParams

VARIANTS = [
    SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=2),
    SamplingParams(
        temperature=0.8, top_k=5, seed=1, max_tokens=9, logprobs=3, logit_bias={5: -100}
    ),
    SamplingParams(
        temperature=1.0,
        top_p=0.5,
        min_p=0.1,
        max_tokens=7,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        logprobs=0,
    ),
    SamplingParams(n=2, temperature=0.7, max_tokens=6, stop=["w1"], min_tokens=2),
]


def run_varied_workload(engine, vocab: int, seed: int = 0) -> None:
    """24 requests of 1-119 random tokens below `vocab`, every third one opening with part of
    a shared 64-token prefix (prefix-cache hits), over VARIANTS (greedy with prompt logprobs;
    top-k with logprobs and logit_bias; top-p and min-p with penalties; n=2 with a stop
    string and min_tokens) at priorities
    0-2; after every fifth one a step and the abort of an earlier one; then steps until
    every request is done."""
    rng = np.random.default_rng(seed)
    shared = [int(t) for t in rng.integers(3, vocab, 64)]
    for i in range(24):
        prompt = [int(t) for t in rng.integers(3, vocab, int(rng.integers(1, 120)))]
        if i % 3 == 1:
            prompt = shared[: int(rng.integers(1, 65))] + prompt[:40]
        engine.add_request(f"r{i}", prompt, VARIANTS[i % len(VARIANTS)], priority=i % 3)
        if i % 5 == 4:
            engine.step()
            engine.abort_request(f"r{i - 2}")
    while engine.has_unfinished_requests():
        engine.step()


def record_compilations() -> list[str]:
    """A list that from now on gets one entry per XLA backend compilation (jax.monitoring)."""
    compiles: list[str] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: (
            compiles.append(event)
            if event == "/jax/core/compile/backend_compile_duration"
            else None
        )
    )
    return compiles

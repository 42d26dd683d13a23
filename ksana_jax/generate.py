"""Single-request generation over the paged KV: chunked prefill, then one token per step.

This is the thin path behind `ksana-jax generate` and `Model` checks: one sequence, pages
1..P of a private KV array, prefill in fixed-size chunks (one compiled shape) and decode
steps of one token (another). The engine's scheduler replaces this loop for serving.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ksana_jax.kv_cache import KVCacheSpec, allocate_kv
from ksana_jax.model import Model, bucket
from ksana_jax.sharding import fetch
from ksana_jax.step import logits_step
from ksana_jax.step_inputs import SequenceChunk, build_step_inputs


def _sample(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    if temperature == 0.0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    return int(rng.choice(len(probs), p=probs / probs.sum()))


def generate(
    model: Model,
    prompt_ids: Sequence[int],
    max_tokens: int = 32,
    temperature: float = 0.0,
    seed: int = 0,
    stop_token_ids: Sequence[int] | None = None,
    page_size: int = 16,
    chunk_size: int = 64,
) -> list[int]:
    """Generates up to `max_tokens` after `prompt_ids` (greedy at temperature 0).

    Stops after emitting a stop token (default: the model's EOS ids), which is included.
    """
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if chunk_size % page_size:
        raise ValueError(f"chunk_size ({chunk_size}) must be a multiple of page_size ({page_size})")
    stops = set(model.eos_token_ids if stop_token_ids is None else stop_token_ids)
    total = len(prompt_ids) + max_tokens
    if total > model.config.max_position_embeddings:
        raise ValueError(
            f"prompt ({len(prompt_ids)}) + max_tokens ({max_tokens}) exceeds the "
            f"model's context of {model.config.max_position_embeddings}"
        )
    pages_per_seq = bucket(-(-total // page_size), 1)
    page_ids = range(1, pages_per_seq + 1)
    spec = KVCacheSpec.for_model(model.config, pages_per_seq + 1, page_size, model.kv_dtype)
    kv = allocate_kv(spec, model.plan.kv_sharding(spec.shape))
    rng = np.random.default_rng(seed)

    def run(tokens: Sequence[int], start: int, num_tokens: int):
        nonlocal kv
        inputs = build_step_inputs(
            [SequenceChunk(tokens, start, page_ids)], page_size, num_tokens, 1, pages_per_seq
        )
        last = np.array([len(tokens) - 1], np.int32)
        inputs, last = model.plan.put_replicated((inputs, last))
        with model.plan.activate():
            logits, kv = logits_step(model.params, model.config, kv, inputs, last)
        return fetch(logits)[0]

    for start in range(0, len(prompt_ids), chunk_size):
        logits = run(prompt_ids[start : start + chunk_size], start, chunk_size)
    output: list[int] = []
    while True:
        token = _sample(logits, temperature, rng)
        output.append(token)
        if token in stops or len(output) == max_tokens:
            return output
        logits = run([token], len(prompt_ids) + len(output) - 1, 1)

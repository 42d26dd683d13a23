"""A draft model for speculative decoding: loading it, and its greedy proposals on the device.

The draft (`speculative_config={"model": PATH, ...}`, the target's vocabulary) has its own
params and its own KV array with the target's shape in pages: the scheduler's page
bookkeeping is shared, a request's page ids index both arrays, so prefix caching, preemption
and freeing need nothing of their own. Inside the target's jitted step (step_programs._forward):

1. `propose`: a row the scheduler runs with k proposals arrives as its last token followed
   by k slots marked spec_decode.DRAFTED. k single-token draft decode steps (a fori_loop
   over all S rows, rows with fewer drafts masked onto the sink page) feed the last token,
   then each proposal, and write the draft's greedy choice into the next slot. They run
   only in a step where some row drafts (RowInputs.drafts, static: the host knows it, so
   the step holds no conditional, nor a loop: the k steps are unrolled), and write the
   draft's K/V only at positions the scheduler gave pages for (the chunk's).
2. The target verifies the filled chunk as it verifies n-gram proposals.
3. `catch_up`: the draft runs over the whole step's tokens (prefill chunks, decode rows,
   each verified chunk) on its own KV, so every token the target computes the draft
   computes too; rejected positions are overwritten later, like the target's.

Greedy proposals are one-hot, so the exact verification (accept iff the target's seeded
draw equals the proposal) stays rejection sampling for sampled rows (spec_decode.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ksana_jax.config import EngineConfig
from ksana_jax.kv_cache import SINK_PAGE, KVCache
from ksana_jax.model import Model, load
from ksana_jax.models import registry
from ksana_jax.step_inputs import StepInputs


def load_draft(path: str, target: Model, config: EngineConfig) -> Model:
    """The draft model at `path`, placed as `config` places the target; one that does not
    load, or has a vocabulary other than the target's, is a ValueError naming
    speculative_config.model."""
    try:
        draft = load(
            path,
            dtype=config.dtype,
            tensor_parallel_size=config.tensor_parallel_size,
            enable_expert_parallel=config.enable_expert_parallel,
        )
    except (OSError, ValueError) as e:
        raise ValueError(f"speculative_config.model: cannot load {path!r}: {e}") from e
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft {path!r} has a vocabulary of "
            f"{draft.config.vocab_size} tokens, the target {target.config.vocab_size}; a draft "
            "must share the target's tokenizer"
        )
    return draft


def propose(
    params: registry.Params,
    cfg,
    kv: KVCache,
    inputs: StepInputs,
    rows,
    num_speculative: int,
    backend: str,
) -> tuple[StepInputs, KVCache]:
    """`inputs` with each row's drafted slots filled by the draft's greedy proposals (the
    slots after its last known token; RowInputs.sample_has_draft marks them), and the
    draft's KV with the fed tokens written."""
    num_tokens, num_seqs = inputs.token_ids.shape[0], inputs.seq_lens.shape[0]
    num_drafts = jnp.zeros(num_seqs + 1, jnp.int32).at[rows.sample_rows].add(rows.sample_has_draft)
    firsts = jnp.where(rows.sample_offsets == 0, rows.sample_rows, num_seqs)
    base = jnp.zeros(num_seqs + 1, jnp.int32).at[firsts].set(rows.sample_token_slots)
    num_drafts, base = num_drafts[:num_seqs], base[:num_seqs]  # per row: drafts, last known
    sink_slot = SINK_PAGE * kv.pages.shape[-2]

    def decode(j, carry):
        token_ids, token, kv = carry
        active = j < num_drafts
        slot = jnp.minimum(base + j, num_tokens - 1)
        position = jnp.where(active, inputs.positions[slot], 0)
        step = StepInputs(
            token_ids=token,
            positions=position,
            slot_ids=jnp.where(active, inputs.slot_ids[slot], sink_slot),
            page_table=inputs.page_table,
            page_rows=inputs.page_rows,
            seq_lens=position + 1,
            query_starts=jnp.arange(num_seqs + 1, dtype=jnp.int32),
        )
        hidden, kv = registry.forward(params, cfg, kv, step, backend)
        token = jnp.argmax(registry.logits(params, cfg, hidden), axis=-1).astype(jnp.int32)
        token_ids = token_ids.at[jnp.where(active, base + j + 1, num_tokens)].set(
            token, mode="drop"
        )
        return token_ids, token, kv

    carry = (inputs.token_ids, inputs.token_ids[base], kv)
    token_ids, _, kv = jax.lax.fori_loop(0, num_speculative, decode, carry, unroll=True)
    return dataclasses.replace(inputs, token_ids=token_ids), kv


def catch_up(params: registry.Params, cfg, kv: KVCache, inputs: StepInputs, backend: str):
    """The draft's KV with the step's tokens written (the target's step inputs)."""
    return registry.forward(params, cfg, kv, inputs, backend)[1]

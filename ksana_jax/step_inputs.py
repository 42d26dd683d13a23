"""The typed pytree sent to the device each step, and its host-side builder.

A step is a ragged batch: the new tokens of every scheduled sequence flattened into T token
slots (a prefill chunk and single decode tokens side by side), padded to a token bucket, plus
S per-sequence rows (padded to a request bucket). Sequence s owns token slots
`query_starts[s]:query_starts[s + 1]`; its context after the step is `seq_lens[s]` tokens,
the last of which are its new ones. Padding tokens sit after `query_starts[S]`, write their
K/V into the sink page and are ignored; padding rows have no tokens and `seq_lens == 0`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import numpy as np

from ksana_jax.kv_cache import SINK_PAGE


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "token_ids",
        "positions",
        "slot_ids",
        "page_table",
        "seq_lens",
        "query_starts",
        "page_rows",
    ],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class StepInputs:
    token_ids: jax.Array  # i32[T]     new tokens, padded with 0
    positions: jax.Array  # i32[T]     position of each token in its sequence (padding: 0)
    slot_ids: jax.Array  # i32[T]     page * page_size + offset its K/V goes to (padding: sink)
    page_table: jax.Array  # i32[S, P]  first P pages of each sequence, covering at least its
    #                                  cached tokens (padding: sink). The engine's host inputs
    #                                  leave it None: its step reads the device's (batch.py).
    seq_lens: jax.Array  # i32[S]     cached + new tokens after this step (padding rows: 0)
    query_starts: jax.Array  # i32[S+1]   offsets of each row's new tokens in token_ids
    # i32[S]: sequence s's pages are row page_rows[s] of page_table, then [R, P] (the
    # persistent batch's, read in place by a backend that `reads_page_rows`); None: row s
    page_rows: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class SequenceChunk:
    """One sequence's part of a step: `token_ids` are new, written from `start_pos` on."""

    token_ids: Sequence[int]
    start_pos: int
    page_ids: Sequence[int]


def build_step_inputs(
    chunks: Sequence[SequenceChunk],
    page_size: int,
    num_tokens: int,
    num_seqs: int,
    pages_per_seq: int,
) -> StepInputs:
    """Flattens `chunks` into a StepInputs of bucket shape (T, S, P) as numpy arrays."""
    total = sum(len(c.token_ids) for c in chunks)
    if total > num_tokens or len(chunks) > num_seqs:
        raise ValueError(
            f"{total} tokens in {len(chunks)} sequences do not fit the bucket "
            f"(T={num_tokens}, S={num_seqs})"
        )
    token_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slot_ids = np.full(num_tokens, SINK_PAGE * page_size, np.int32)
    page_table = np.full((num_seqs, pages_per_seq), SINK_PAGE, np.int32)
    seq_lens = np.zeros(num_seqs, np.int32)
    query_starts = np.full(num_seqs + 1, total, np.int32)
    offset = 0
    for s, chunk in enumerate(chunks):
        n = len(chunk.token_ids)
        end_pos = chunk.start_pos + n
        if -(-end_pos // page_size) > len(chunk.page_ids):
            raise ValueError(
                f"sequence {s} needs {-(-end_pos // page_size)} pages for {end_pos} tokens, "
                f"has {len(chunk.page_ids)}"
            )
        # The page table only has to cover cached tokens: new ones are written via slot_ids
        # and attended to directly (see pallas_kernels/reference.py).
        if -(-chunk.start_pos // page_size) > pages_per_seq:
            raise ValueError(
                f"sequence {s} has {chunk.start_pos} cached tokens, more than the bucket's "
                f"{pages_per_seq} pages of {page_size} hold"
            )
        pos = np.arange(chunk.start_pos, end_pos, dtype=np.int32)
        pages = np.asarray(chunk.page_ids, np.int32)
        token_ids[offset : offset + n] = chunk.token_ids
        positions[offset : offset + n] = pos
        slot_ids[offset : offset + n] = pages[pos // page_size] * page_size + pos % page_size
        table = pages[:pages_per_seq]
        page_table[s, : len(table)] = table
        seq_lens[s] = end_pos
        query_starts[s] = offset
        offset += n
    return StepInputs(token_ids, positions, slot_ids, page_table, seq_lens, query_starts)

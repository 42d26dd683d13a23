"""A double-buffered DMA loop for Pallas TPU kernels: items of a range of rows (a row's
page blocks, say) computed one after another, the next item's async copies started into the
other buffer slot before the current item's are waited on, across row boundaries too, so
copies overlap compute. The attention kernel's two phases (cached pages, new tokens) run
on it."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


def cdiv(a, b: int):
    """ceil(a / b) for a >= 0 (lax.div truncates; `//` lowers through sign, which needs a
    TPU generation at lowering time)."""
    return lax.div(a + (b - 1), b)


def when(pred, fn) -> None:
    """pl.when(pred)(fn), where a predicate of Python True runs fn unconditionally."""
    if pred is True:
        fn()
    else:
        pl.when(pred)(fn)


def double_buffered_rows_loop(first_row, last_row, num_items, copies, compute):
    """Runs compute(row, item, slot) for every row in [first_row, last_row] and item in
    [0, num_items(row)), copying the next item's data (into the other slot) while the current
    one is computed. `copies(row, item, slot)` lists (async copy, predicate) pairs; a copy is
    started and waited on under the same predicate. num_items(row) must be >= 1."""

    def start(row, item, slot):
        for copy, pred in copies(row, item, slot):
            when(pred, copy.start)

    def wait(row, item, slot):
        for copy, pred in copies(row, item, slot):
            when(pred, copy.wait)

    @pl.when(first_row <= last_row)
    def _():
        start(first_row, 0, 0)

    def body(carry):
        row, item, slot = carry
        last_item = item + 1 >= num_items(row)
        next_row = jnp.where(last_item, row + 1, row)
        next_item = jnp.where(last_item, 0, item + 1)

        @pl.when(next_row <= last_row)
        def _():
            start(next_row, next_item, 1 - slot)

        wait(row, item, slot)
        compute(row, item, slot)
        return next_row, next_item, 1 - slot

    lax.while_loop(lambda c: c[0] <= last_row, body, (first_row, jnp.int32(0), jnp.int32(0)))

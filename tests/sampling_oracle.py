"""Shared by the sampler tests (test_sampling*.py): their per-row inputs (`make_inputs`,
`Rows`), the sampler call under the host's plan (`run`), and numpy oracles written from the
intended (vLLM / HF) semantics.

Oracle conventions (float64 numpy, never the code under test):
- penalties: repetition on every prompt + output token (logit / r if > 0 else logit * r), then
  frequency and presence on output tokens only.
- filters, in HF's warper order: temperature, top-k, top-p (on the distribution renormalized
  over the top-k survivors, as both HF and vLLM do), min-p (relative to the max probability,
  which no earlier filter removes, so its place in the order does not matter).
- ties: a filter keeps every token whose value equals the boundary token's value (top-k's k-th
  largest, top-p's last needed token, min-p's max), so the kept set never depends on token ids.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from typing import NamedTuple
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from ksana_jax.sampling import (
    PenaltyCounts,
    SamplerPlan,
    SamplingInputs,
    apply_penalties,
    count_tokens,
    plan_for,
    sample,
)

V = 16  # vocabulary of every sampler call here
M = 12  # history length of every call (one compiled shape per batch size)
N_LOGPROBS = 4

sample_jit = jax.jit(functools.partial(sample, max_logprobs=N_LOGPROBS), static_argnames="plan")
# The same sampler traced as on a GPU: a full plan does the work if_needed would skip.
sample_gpu_jit = jax.jit(functools.partial(sample, max_logprobs=N_LOGPROBS), static_argnames="plan")
penalties_jit = jax.jit(apply_penalties)

DEFAULTS = dict(
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    repetition_penalty=1.0,
    presence_penalty=0.0,
    frequency_penalty=0.0,
    seeds=0,
    num_generated=0,
    num_prompt_tokens=0,
    num_logprobs=N_LOGPROBS,
)
DTYPES = dict(
    temperature=np.float32,
    top_k=np.int32,
    top_p=np.float32,
    min_p=np.float32,
    repetition_penalty=np.float32,
    presence_penalty=np.float32,
    frequency_penalty=np.float32,
    seeds=np.uint32,
    num_generated=np.int32,
    num_prompt_tokens=np.int32,
    num_logprobs=np.int32,
)


class Rows(NamedTuple):
    """A sampler call's per-row inputs: SamplingInputs and the rows' PenaltyCounts (row i at
    slot i)."""

    s: SamplingInputs
    counts: PenaltyCounts

    def replace(self, **fields) -> Rows:
        return self._replace(s=dataclasses.replace(self.s, **fields))

    def __getattr__(self, name):
        return getattr(self.s, name)


def counts_from_history(history, num_prompt, vocab=V) -> PenaltyCounts:
    """The engine's penalty counts for rows of history (prompt then output, -1 padded), built
    as the runner builds them: one count_tokens call over every known token."""
    num_seqs = history.shape[0]
    slots = np.repeat(np.arange(num_seqs), M)
    is_output = (np.arange(M)[None, :] >= np.asarray(num_prompt)[:, None]).reshape(-1)
    return count_tokens(
        PenaltyCounts.zeros(num_seqs, vocab),
        jnp.asarray(slots, jnp.int32),
        jnp.asarray(history.reshape(-1)),
        jnp.asarray(is_output),
        jnp.asarray(np.arange(num_seqs), jnp.int32),
    )


def make_inputs(num_seqs: int, history=None, suppressed=None, vocab=V, bias=None, **fields) -> Rows:
    """Rows with per-row fields (scalars broadcast); history -1 padded to M; bias: per row a
    {token id: bias} dict (logit_bias)."""
    arrays = {}
    for name, default in DEFAULTS.items():
        value = np.asarray(fields.pop(name, default))
        if name == "seeds":
            value = value.astype(np.uint64).astype(np.uint32)
        arrays[name] = jnp.asarray(np.broadcast_to(value.astype(DTYPES[name]), (num_seqs,)))
    assert not fields, fields
    if history is None:
        history = np.full((num_seqs, M), -1)
    history = np.asarray(history, np.int32)
    assert history.shape == (num_seqs, M)
    suppressed = np.full((num_seqs, 4), -1, np.int32) if suppressed is None else suppressed
    bias_ids = np.full((num_seqs, 4), -1, np.int32)
    bias_values = np.zeros((num_seqs, 4), np.float32)
    for row, entries in enumerate(bias or ()):
        bias_ids[row, : len(entries)] = list(entries)
        bias_values[row, : len(entries)] = list(entries.values())
    s = SamplingInputs(
        suppressed_ids=jnp.asarray(suppressed, jnp.int32),
        slots=jnp.arange(num_seqs, dtype=jnp.int32),
        bias_ids=jnp.asarray(bias_ids),
        bias_values=jnp.asarray(bias_values),
        token_bitmask=jnp.full((num_seqs, -(-vocab // 32)), -1, jnp.int32),
        **arrays,
    )
    return Rows(s, counts_from_history(history, arrays["num_prompt_tokens"], vocab))


def _renumber(rows: Rows) -> Rows:
    return rows.replace(slots=jnp.arange(rows.s.slots.shape[0], dtype=jnp.int32))


def take_rows(rows: Rows, index) -> Rows:
    return _renumber(jax.tree.map(lambda x: x[np.asarray(index)], rows))


def run(logits, rows: Rows):
    """The sampler under the plan the runner picks for `rows`; it must sample (and, with
    logprobs, report) what the plan that serves any rows (FULL) does, and a full plan what the
    plan a GPU picks does traced as on a GPU (no conditional: the skipped work done)."""
    logits = jnp.asarray(logits, jnp.float32)
    masked = bool(np.any(np.asarray(rows.s.token_bitmask) != -1))
    plan = plan_for(rows.s, masked)
    out = jax.tree.map(np.asarray, sample_jit(logits, rows.s, rows.counts, plan=plan))
    wants_logprobs = bool(np.any(np.asarray(rows.s.num_logprobs) >= 0))
    if plan is not SamplerPlan.FULL:
        full = sample_jit(logits, rows.s, rows.counts, plan=SamplerPlan.FULL)
        _assert_same(out, full, plan.logprobs)
    if plan.full:  # as a GPU would: its own plan (FULL_GREEDY for greedy rows), no conditional
        with mock.patch.object(jax, "default_backend", lambda: "gpu"):
            gpu_plan = plan_for(rows.s, masked)
            gpu = sample_gpu_jit(logits, rows.s, rows.counts, plan=gpu_plan)
        _assert_same(out, gpu, wants_logprobs)
    return out


def _assert_same(out, other, logprobs: bool) -> None:
    other = jax.tree.map(np.asarray, other)
    np.testing.assert_array_equal(out.token_ids, other.token_ids)
    if logprobs:
        np.testing.assert_array_equal(out.top_ids, other.top_ids)
        np.testing.assert_allclose(out.logprobs, other.logprobs, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(out.top_logprobs, other.top_logprobs, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- numpy oracles


def np_log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def np_softmax(x):
    return np.exp(np_log_softmax(x))


def np_penalties(logits, history, num_prompt, rep, pres, freq):
    out = np.array(logits, np.float64)
    for i in range(out.shape[0]):
        tokens = [int(t) for t in history[i] if t >= 0]
        outputs = [int(t) for j, t in enumerate(history[i]) if t >= 0 and j >= num_prompt[i]]
        for t in set(tokens):
            out[i, t] = out[i, t] / rep[i] if out[i, t] > 0 else out[i, t] * rep[i]
        for t, count in Counter(outputs).items():
            out[i, t] -= freq[i] * count + pres[i]
    return out


def np_allowed(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """(allowed mask, near_boundary) for one row; near_boundary flags float-ambiguous inputs."""
    z = np.asarray(logits, np.float64) / temperature
    keep = np.ones(z.shape, bool)
    near = False
    if top_k > 0:
        kth = np.sort(z)[::-1][min(top_k, z.size) - 1]
        gap = np.abs(z - kth)
        near |= bool(np.any((gap > 0) & (gap < 1e-4)))
        keep &= z >= kth
    if top_p < 1.0:
        zk = np.where(keep, z, -np.inf)
        p = np_softmax(zk)
        values = np.unique(zk[keep])[::-1]  # distinct kept values, descending
        group_mass = np.cumsum([p[zk == v].sum() for v in values])
        near |= bool(np.any(np.abs(group_mass - top_p) < 1e-4))
        last = int(np.argmax(group_mass >= top_p))  # first group where the mass reaches top_p
        keep &= zk >= values[last]
    if min_p > 0.0:
        p = np_softmax(z)
        ratio = p / p.max()
        near |= bool(np.any((ratio < 1) & (np.abs(ratio - min_p) < 1e-4)))
        keep &= ratio >= min_p
    return keep, near


def np_probs(logits, temperature, **filters):
    keep, near = np_allowed(logits, temperature, **filters)
    assert not near, "test input too close to a filter boundary"
    z = np.where(keep, np.asarray(logits, np.float64) / temperature, -np.inf)
    return np_softmax(z)


def random_histories(rng, num_seqs, token_range=V):
    history = np.full((num_seqs, M), -1, np.int32)
    num_prompt = np.zeros(num_seqs, np.int32)
    for i in range(num_seqs):
        n_prompt = int(rng.integers(0, M + 1))
        n_out = int(rng.integers(0, M - n_prompt + 1))
        hi = int(rng.integers(2, token_range + 1))  # small ranges force repeated tokens
        history[i, : n_prompt + n_out] = rng.integers(0, hi, n_prompt + n_out)
        num_prompt[i] = n_prompt
    return history, num_prompt

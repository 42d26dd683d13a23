"""The runner's jitted programs: the device side of an engine step (runner.py is the host
side), against the persistent batch's device state (`BatchState`: each slot's last sampled
token, penalty counts and page table).

    forward_step      the model; the sampled positions' logits and the scored positions'
                      hidden states stay on the device; a step whose rows sample greedily
                      with nothing else to do, its tokens too (no sample_step follows)
                                                                          (KV donated)
    sample_step       tokens, logprobs, proposals, under a static sampling.SamplerPlan
                                                                          (BatchState donated)
    score_step        prompt logprobs at a static scored size (only steps that score)
    write_pages_step  page-table writes that do not fit in a step         (BatchState donated)
    engine_step       forward, sample and score composed at their most, for the AOT tools

The forward and the samplers branch on no device data where they run on a GPU: XLA:GPU runs
a conditional it keeps by copying its predicate to the host, so dispatching a program that
holds one would wait for the work queued before it (a full sampler plan skips work with
`sampling.if_needed`, a conditional only on CPU and TPU). `cfg` and the pack layout are static;
the KV array is donated, so XLA writes the new K/V in place and the compiled step holds no
second KV-sized buffer. (`step.logits_step` is the forward without sampling that
`Model.logits` and single-request `generate` use.)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental.layout import Format, Layout

from ksana_jax import draft, pallas_kernels
from ksana_jax.batch import PackLayout, PageWrites, RowInputs, unpack
from ksana_jax.config import ModelConfig
from ksana_jax.kv_cache import SINK_PAGE, KVCache, kv_shardings
from ksana_jax.models import registry
from ksana_jax.sampling import (
    PenaltyCounts,
    SampledTokens,
    SamplerPlan,
    SamplingInputs,
    ScoredLogprobs,
    count_tokens,
    if_needed,
    penalties_active,
    sample,
    score_prompt,
)
from ksana_jax.step_inputs import StepInputs


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["last_token", "counts", "page_table"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class BatchState:
    """The persistent batch's device side, one row per slot (R = max_num_seqs + 1: the last
    is the padding sink)."""

    last_token: jax.Array  # i32[R]  each slot's last sampled token
    counts: PenaltyCounts  # [R, V]  each slot's tokens so far, for penalties
    page_table: jax.Array  # i32[R, max_pages_per_seq]  each slot's pages (batch.PageWrites)

    @classmethod
    def zeros(cls, num_slots: int, vocab: int, max_pages: int) -> BatchState:
        return cls(
            jnp.zeros(num_slots, jnp.int32),
            PenaltyCounts.zeros(num_slots, vocab),
            jnp.full((num_slots, max_pages), SINK_PAGE, jnp.int32),
        )


def _on_used_positions(rows: RowInputs, fn, *operands):
    """fn(size, *operands) over the first `size` = RowInputs.sampled_positions of the W
    sampled positions (static: the host knows how many are in use), padded back to W."""
    width, size = rows.sample_token_slots.shape[0], rows.sampled_positions
    out = fn(size, *operands)
    return jax.tree.map(lambda a: jnp.pad(a, [(0, width - size)] + [(0, 0)] * (a.ndim - 1)), out)


def _with_last_tokens(
    last_token: jax.Array, token_ids: jax.Array, next_tokens: jax.Array, rows: RowInputs, slots
) -> jax.Array:
    """BatchState.last_token once the step sampled `token_ids` i32[W] at its positions: each
    row's slot (`slots` i32[W], SamplingInputs.slots) takes the token of the position that
    is the row's last after verification -- the first whose draft the target rejected, or
    the last (spec_decode.py). Exactly one position of each row writes its slot."""
    num_seqs = rows.reset_slots.shape[0]
    match = rows.sample_has_draft & (token_ids == next_tokens)
    never = jnp.iinfo(jnp.int32).max
    first_miss = jnp.full(num_seqs + 1, never, jnp.int32)
    first_miss = first_miss.at[rows.sample_rows].min(jnp.where(match, never, rows.sample_offsets))
    is_last = rows.sample_offsets == first_miss[rows.sample_rows]
    return last_token.at[jnp.where(is_last, slots, last_token.size)].set(token_ids, mode="drop")


def _next_tokens(inputs: StepInputs, rows: RowInputs) -> jax.Array:
    """i32[W]: the token after each sampled position (its proposal where it has one)."""
    num_tokens = inputs.token_ids.shape[0]
    return inputs.token_ids[jnp.minimum(rows.sample_token_slots + 1, num_tokens - 1)]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "logits",
        "next_tokens",
        "token_ids",
        "scored_hidden",
        "scored_targets",
        "buffers",
        "proposals",
        "greedy_tokens",
    ],
    meta_fields=["layout"],
)
@dataclasses.dataclass(frozen=True)
class Forwarded:
    """What the forward program leaves on the device for the sampling and scoring programs."""

    # f32[W, V]  each sampled position's logits (past those in use: 0); undefined where
    # RowInputs.samples_greedily and the LM head's call took the argmax (on the CPU kernel)
    logits: jax.Array
    next_tokens: jax.Array  # i32[W]  the token after each sampled position (its proposal)
    token_ids: jax.Array  # i32[T]  the tokens the step fed (placeholders filled)
    scored_hidden: jax.Array  # f32[Q, D]  the final hidden states RowInputs scores
    scored_targets: jax.Array  # i32[Q]  the prompt token each one predicts (padding: -1)
    buffers: tuple[jax.Array, jax.Array]  # the step's packed inputs, for the sampler's rows
    proposals: jax.Array  # i32[W]  each sampled position's proposal (-1: none)
    greedy_tokens: jax.Array  # i32[W]  the step's tokens where RowInputs.samples_greedily
    layout: PackLayout  # static: how to unpack them


def _forward(
    params: registry.Params,
    cfg: ModelConfig,
    kv: KVCache,
    state: BatchState,
    buffers: tuple[jax.Array, jax.Array],
    layout: PackLayout,
    max_logprobs: int,
    backend: str = "reference",
    draft_params: registry.Params | None = None,
    draft_kv: KVCache | None = None,
    draft_cfg: ModelConfig | None = None,
    num_speculative: int = 0,
) -> tuple[Forwarded, KVCache, BatchState, KVCache | None]:
    """The step's first program: unpacks its inputs (StepInputs without the page table,
    SamplingInputs without the token bitmask, RowInputs; see batch.pack), writes the pages
    its rows gained into the device's page table and reads their first P pages from it,
    feeds placeholders their slot's last sampled token, runs the model, projects the
    sampled positions' logits and gathers the hidden states of the prompt positions
    RowInputs scores. It loops on nothing and branches only where that costs no sync (see
    sampling.py: a GPU would wait for the work queued before it): what varies from step to
    step on the host's knowledge is static in RowInputs. Where RowInputs.samples_greedily,
    it samples the step too (the argmax of each row: SamplerPlan.GREEDY; on the CPU kernel,
    in the LM head's own call: registry.logits_or_argmax) and advances the slots' last
    tokens, so the next step's forward follows this one directly: on XLA:CPU a second
    program cost a batch-1 step 0.2-0.3 ms (runner.py; `_greedy_step`). With a draft model
    (draft.py) the draft first fills the drafted slots (in a step where some row drafts),
    then computes the step's tokens on its own KV."""
    inputs, sampling, rows = unpack(buffers, layout)[:3]
    page_table = rows.page_writes.apply(state.page_table)
    fed = state.last_token.at[rows.last_token_slots].get(mode="fill", fill_value=-1)
    if pallas_kernels.get_backend(backend).reads_page_rows:  # the table read in place
        tables = dict(page_table=page_table[:, : rows.context_pages], page_rows=rows.row_slots)
    else:
        tables = dict(page_table=page_table[rows.row_slots, : rows.context_pages])
    inputs = dataclasses.replace(
        inputs, token_ids=jnp.where(fed >= 0, fed, inputs.token_ids), **tables
    )
    if draft_cfg is not None:
        if rows.drafts:
            inputs, draft_kv = draft.propose(
                draft_params, draft_cfg, draft_kv, inputs, rows, num_speculative, backend
            )
        draft_kv = draft.catch_up(draft_params, draft_cfg, draft_kv, inputs, backend)
    hidden, kv = registry.forward(params, cfg, kv, inputs, backend)
    logits, head_tokens = _on_used_positions(
        rows,
        lambda size, hidden: registry.logits_or_argmax(
            params, cfg, hidden[rows.sample_token_slots[:size]], rows.samples_greedily
        ),
        hidden,
    )
    next_tokens = _next_tokens(inputs, rows)
    greedy_tokens, last_token = _greedy_step(
        logits, head_tokens, next_tokens, rows, sampling, state, max_logprobs
    )
    out = Forwarded(
        logits,
        next_tokens,
        inputs.token_ids,
        hidden[rows.scored_token_slots],
        rows.scored_targets,
        buffers,
        jnp.where(rows.sample_has_draft, next_tokens, -1),
        greedy_tokens,
        layout,
    )
    state = dataclasses.replace(state, last_token=last_token, page_table=page_table)
    return out, kv, _replicated(state), draft_kv


def _greedy_step(
    logits: jax.Array,
    head_tokens: jax.Array | None,
    next_tokens: jax.Array,
    rows: RowInputs,
    sampling: SamplingInputs,
    state: BatchState,
    max_logprobs: int,
) -> tuple[jax.Array, jax.Array]:
    """The forward's sampling where RowInputs.samples_greedily: the step's tokens i32[W] (as
    the GREEDY sampling program would give them) and the slots' last tokens after them;
    otherwise (zeros, the last tokens unchanged) -- the sampling program follows. A
    conditional on CPU and TPU; on a GPU, where one costs a sync, the argmax always runs (a
    sampling program that follows overwrites every slot it wrote). `head_tokens`: the
    argmax the LM head's call took (registry.logits_or_argmax; the logits are undefined
    then), or None."""

    def greedy(last_token: jax.Array) -> tuple[jax.Array, jax.Array]:
        if head_tokens is not None:
            return head_tokens, _with_last_tokens(
                last_token, head_tokens, next_tokens, rows, sampling.slots
            )
        sampled = _on_used_positions(
            rows,
            lambda size, logits: sample(
                logits[:size],
                jax.tree.map(lambda a: a[:size], sampling),
                state.counts,
                max_logprobs,
                SamplerPlan.GREEDY,
            ),
            logits,
        )
        tokens = sampled.token_ids
        return tokens, _with_last_tokens(last_token, tokens, next_tokens, rows, sampling.slots)

    def skip(last_token: jax.Array) -> tuple[jax.Array, jax.Array]:
        return jnp.zeros(logits.shape[0], jnp.int32), last_token

    return if_needed(rows.samples_greedily, greedy, skip, state.last_token)


def _sample(
    forwarded: Forwarded,
    state: BatchState,
    token_bitmask: jax.Array,
    max_logprobs: int,
    plan: SamplerPlan = SamplerPlan.FULL,
) -> tuple[tuple[SampledTokens, jax.Array], BatchState]:
    """The step's second program: samples each position from the forward's logits as
    `plan` (static) says, under the token bitmask i32[W, ceil(V / 32)] (filled on the host
    while the forward ran). Under a full plan it first counts the fed tokens for penalties,
    if a row has one (the other plans have no penalty rows). A position whose
    draft the target's token equals accepts it; each slot's last token becomes its row's
    last token after verification. Returns the sampled tokens and each sampled position's
    proposal i32[W] (-1: none)."""
    _, sampling, rows = unpack(forwarded.buffers, forwarded.layout)[:3]
    sampling = dataclasses.replace(sampling, token_bitmask=token_bitmask)
    counts = state.counts
    if plan.full:
        counts = if_needed(
            jnp.any(penalties_active(sampling)),
            lambda c: count_tokens(
                c, rows.count_slots, forwarded.token_ids, rows.is_output, rows.reset_slots
            ),
            lambda c: c,
            counts,
        )
    sampled = _on_used_positions(
        rows,
        lambda size, logits: sample(
            logits[:size],
            jax.tree.map(lambda a: a[:size], sampling),
            counts,
            max_logprobs,
            plan,
        ),
        forwarded.logits,
    )
    last_token = _with_last_tokens(
        state.last_token, sampled.token_ids, forwarded.next_tokens, rows, sampling.slots
    )
    state = _replicated(BatchState(last_token, counts, state.page_table))
    return (sampled, forwarded.proposals), state


def _score(
    params: registry.Params,
    cfg: ModelConfig,
    hidden: jax.Array,
    targets: jax.Array,
    size: int,
    max_logprobs: int,
) -> ScoredLogprobs:
    """The step's third program, run only when it scores prompt positions: their logprobs
    (sampling.score_prompt) over the first `size` of the Q positions the forward gathered."""
    to_logits = functools.partial(registry.logits, params, cfg)
    return _replicated(score_prompt(hidden, targets, to_logits, max_logprobs, size))


def _write_pages(state: BatchState, writes: PageWrites) -> BatchState:
    """Page-table entries written before a step whose rows gained more pages than it
    carries (a prefix-cache hit's)."""
    return _replicated(dataclasses.replace(state, page_table=writes.apply(state.page_table)))


def _engine_step(
    params: registry.Params,
    cfg: ModelConfig,
    kv: KVCache,
    state: BatchState,
    buffers: tuple[jax.Array, jax.Array],
    layout: PackLayout,
    max_logprobs: int,
    backend: str = "reference",
    draft_params: registry.Params | None = None,
    draft_kv: KVCache | None = None,
    draft_cfg: ModelConfig | None = None,
    num_speculative: int = 0,
) -> tuple[tuple[SampledTokens, ScoredLogprobs, jax.Array], KVCache, BatchState, KVCache | None]:
    """The whole step as one program: `_forward`, `_sample` and `_score` as the runner
    dispatches them at their most (SamplerPlan.FULL, all Q scored positions), its buffers
    packed from (inputs, sampling, rows, token bitmask), as `ModelRunner.padding_inputs`
    gives them (what the AOT tools lower)."""
    forwarded, kv, state, draft_kv = _forward(
        params, cfg, kv, state, buffers, layout, max_logprobs, backend,
        draft_params, draft_kv, draft_cfg, num_speculative,
    )  # fmt: skip
    token_bitmask = unpack(buffers, layout)[3]
    (sampled, proposals), state = _sample(forwarded, state, token_bitmask, max_logprobs)
    hidden, targets = forwarded.scored_hidden, forwarded.scored_targets
    scored = _score(params, cfg, hidden, targets, targets.shape[0], max_logprobs)
    return (sampled, scored, proposals), kv, state, draft_kv


def _replicated(tree):
    """Under a mesh of several devices, `tree` replicated: the state comes out with the
    sharding it went in with, so the next step does not compile again."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return tree
    return jax.lax.with_sharding_constraint(tree, jax.sharding.PartitionSpec())


_FORWARD_JIT = dict(
    static_argnames=("cfg", "layout", "max_logprobs", "backend", "draft_cfg", "num_speculative"),
    donate_argnames=("kv", "state", "draft_kv"),
)
forward_step = jax.jit(_forward, **_FORWARD_JIT)
sample_step = jax.jit(_sample, static_argnames=("max_logprobs", "plan"), donate_argnames=("state",))
score_step = jax.jit(_score, static_argnames=("cfg", "size", "max_logprobs"))
engine_step = jax.jit(_engine_step, **_FORWARD_JIT)
write_pages_step = jax.jit(_write_pages, donate_argnames=("state",))
# every jitted step, for compile_count (engine_step: only AOT tools and tests run it)
_step_functions = {forward_step, sample_step, score_step, engine_step, write_pages_step}


# Platforms whose default array layouts can put the KV's dims out of order (a TPU does, see
# kv_row_major_format); CPU and GPU lay arrays out row-major by default.
PINNED_KV_PLATFORMS = ("tpu",)
TPU_LANES = 128


def kv_row_major_format(sharding: jax.sharding.Sharding) -> Format:
    """The KV array's format with its dims in order, minor-most last: what every kernel
    indexes. A TPU lays out an array by default as it sees fit: for [L, 2, K, pages, page,
    64] (head dim below its 128 lanes) that is the pages dim minor-most. Then XLA would wrap
    the Mosaic kernels in two whole-KV relayout copies every step (twice the KV's memory),
    found by compiling for a TPU topology (benchmarks/tpu_kernel_compile.py)."""
    return Format(Layout(major_to_minor=tuple(range(6))), sharding)


@functools.cache  # one per format: equal jit wrappers would share, and double-count, a cache
def _kv_pinned(kv_format: Format, fn):
    step = jax.jit(
        fn,
        # params, kv, state, buffers, draft params, draft KV (the draft's KV is not pinned)
        in_shardings=(None, kv_shardings(kv_format), None, None, None, None),
        out_shardings=(None, kv_shardings(kv_format), None, None),
        **_FORWARD_JIT,
    )
    _step_functions.add(step)
    return step


def kv_pinned_forward_step(kv_format: Format):
    """forward_step with the KV argument and result held in `kv_format`. Call it with every
    argument positional, as `ModelRunner.execute` does: with in_shardings set, jit takes no
    keyword arguments."""
    return _kv_pinned(kv_format, _forward)


def kv_pinned_engine_step(kv_format: Format):
    """engine_step (the whole step as one program) so pinned, for the AOT tools."""
    return _kv_pinned(kv_format, _engine_step)


def compile_count() -> int:
    """Entries in the jit caches of every engine step (one per compiled shape)."""
    return sum(step._cache_size() for step in _step_functions)

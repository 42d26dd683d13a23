"""The device side of a step: pad the scheduled batch to a bucket, run two jitted programs.

In: the scheduler's chunks. Out: one sampled token (+ logprobs) per row, and the prompt
logprobs of the positions the chunks score (sampling.score_prompt). The runner owns the
params, the KV array and the persistent batch (batch.py: host rows per slot, and the device's
BatchState: last sampled tokens, penalty counts and the page table). A step is two programs,
as SGLang's, and a third when it scores prompt positions:

    dispatch(chunks)          [write_pages_step: a prefix-cache hit's pages, when they do not
                              fit in the step's page writes               (BatchState donated)]
                              forward_step: the model; the sampled positions' logits and the
                              scored positions' hidden states stay on the device
                                                                          (KV donated)
    finish_dispatch(step)     the token bitmask, filled now from the grammars (batch.py);
                              sample_step: tokens, logprobs, proposals    (BatchState donated)
                              [score_step: prompt logprobs]
    fetch(in_flight)          waits for the outputs

All only dispatch (JAX runs them asynchronously), so the engine fills the bitmask, and
finishes the step before, while the forward runs. The host decides what the sampler and
the scorer compute (a sampling.SamplerPlan and a scored size, both static), so the programs
of a step whose rows sample greedily or plainly hold no conditional, which a GPU would run
with a wait for the work queued before it. `engine_step` is the three composed into one
program, for the AOT tools. Every step is padded to a (T tokens, S sequences, context)
bucket from EngineConfig; `warm_up` compiles all of them first (each sampler plan, each
scored size), so a serving workload never compiles.

The params and KV carry the model's ShardingPlan shardings and every step's inputs are
replicated over its mesh, the same in warm-up and serving, so sharding never recompiles.
With several processes (multihost.py), process 0's runner sends each step's inputs, and
then its bitmask, to the others, which run the same two programs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format, Layout
from tqdm import tqdm

from ksana_jax import draft, multihost
from ksana_jax.batch import (
    PackLayout,
    PageWrites,
    PersistentBatch,
    RowInputs,
    pack,
    sample_width,
    unpack,
)
from ksana_jax.config import EngineConfig, ModelConfig
from ksana_jax.kv_cache import (
    SINK_PAGE,
    KVCache,
    KVCacheSpec,
    allocate_kv,
    device_bytes_per_page,
    kv_shardings,
    num_pages_for_budget,
    resolve_kv_dtype,
)
from ksana_jax.model import Model
from ksana_jax.models import registry
from ksana_jax.pallas_kernels import linear_cpu, resolve_backend
from ksana_jax.sampling import (
    PenaltyCounts,
    SampledTokens,
    SamplerPlan,
    SamplingInputs,
    ScoredLogprobs,
    count_tokens,
    penalties_active,
    plan_for,
    sample,
    score_prompt,
    scored_size,
    scored_sizes,
)
from ksana_jax.sampling_params import MAX_LOGIT_BIAS
from ksana_jax.scheduler import ScheduledChunk
from ksana_jax.sharding import fetch
from ksana_jax.step_inputs import StepInputs

GIB = 1 << 30
MAX_SUPPRESSED_IDS = 8  # EOS + stop_token_ids banned while a request is below min_tokens


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
    """fn(size, *operands) over the first `size` of the W sampled positions, padded back to W.
    With proposals W exceeds min(T, S); a `lax.switch` on how many are in use then runs fn
    on min(T, S) positions unless more are, so a step without proposals pays for no more
    than before."""
    num_tokens, num_seqs = rows.last_token_slots.shape[0], rows.reset_slots.shape[0]
    width = rows.sample_token_slots.shape[0]

    def branch(size: int):
        def run(*operands):
            out = fn(size, *operands)
            return jax.tree.map(
                lambda a: jnp.pad(a, [(0, width - size)] + [(0, 0)] * (a.ndim - 1)), out
            )

        return run

    base = min(num_tokens, num_seqs)
    if width <= base:
        return branch(width)(*operands)
    index = (jnp.sum(rows.sample_rows < num_seqs) > base).astype(jnp.int32)
    return jax.lax.switch(index, [branch(base), branch(width)], *operands)


def _last_tokens(sampled: SampledTokens, next_tokens: jax.Array, rows: RowInputs) -> jax.Array:
    """bool[W]: the position whose token is its row's last after verification: the first
    whose draft the target rejected, or the last (spec_decode.py)."""
    num_seqs = rows.reset_slots.shape[0]
    match = rows.sample_has_draft & (sampled.token_ids == next_tokens)
    never = jnp.iinfo(jnp.int32).max
    first_miss = jnp.full(num_seqs + 1, never, jnp.int32)
    first_miss = first_miss.at[rows.sample_rows].min(jnp.where(match, never, rows.sample_offsets))
    return rows.sample_offsets == first_miss[rows.sample_rows]


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
    ],
    meta_fields=["layout"],
)
@dataclasses.dataclass(frozen=True)
class Forwarded:
    """What the forward program leaves on the device for the sampling and scoring programs."""

    logits: jax.Array  # f32[W, V]  each sampled position's logits (past those in use: 0)
    next_tokens: jax.Array  # i32[W]  the token after each sampled position (its proposal)
    token_ids: jax.Array  # i32[T]  the tokens the step fed (placeholders filled)
    scored_hidden: jax.Array  # f32[Q, D]  the final hidden states RowInputs scores
    scored_targets: jax.Array  # i32[Q]  the prompt token each one predicts (padding: -1)
    buffers: tuple[jax.Array, jax.Array]  # the step's packed inputs, for the sampler's rows
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
    RowInputs scores. It branches on nothing (see sampling.py: a GPU would wait for the
    work queued before it). With a draft model (draft.py) the draft first fills the
    drafted slots, then computes the step's tokens on its own KV."""
    inputs, _, rows = unpack(buffers, layout)[:3]
    page_table = rows.page_writes.apply(state.page_table)
    fed = state.last_token.at[rows.last_token_slots].get(mode="fill", fill_value=-1)
    inputs = dataclasses.replace(
        inputs,
        token_ids=jnp.where(fed >= 0, fed, inputs.token_ids),
        page_table=page_table[rows.row_slots, : rows.context_pages],
    )
    if draft_cfg is not None:
        inputs, draft_kv = draft.propose(
            draft_params, draft_cfg, draft_kv, inputs, rows, num_speculative, backend
        )
        draft_kv = draft.catch_up(draft_params, draft_cfg, draft_kv, inputs, backend)
    hidden, kv = registry.forward(params, cfg, kv, inputs, backend)
    logits = _on_used_positions(
        rows,
        lambda size, hidden: registry.logits(params, cfg, hidden[rows.sample_token_slots[:size]]),
        hidden,
    )
    out = Forwarded(
        logits,
        _next_tokens(inputs, rows),
        inputs.token_ids,
        hidden[rows.scored_token_slots],
        rows.scored_targets,
        buffers,
        layout,
    )
    return out, kv, _replicated(dataclasses.replace(state, page_table=page_table)), draft_kv


def _sample(
    forwarded: Forwarded,
    state: BatchState,
    token_bitmask: jax.Array,
    max_logprobs: int,
    plan: SamplerPlan = SamplerPlan.FULL,
) -> tuple[tuple[SampledTokens, jax.Array], BatchState]:
    """The step's second program: samples each position from the forward's logits as
    `plan` (static) says, under the token bitmask i32[W, ceil(V / 32)] (filled on the host
    while the forward ran). Under SamplerPlan.FULL it first counts the fed tokens for
    penalties, if a row has one (the other plans have no penalty rows). A position whose
    draft the target's token equals accepts it; each slot's last token becomes its row's
    last token after verification. Returns the sampled tokens and each sampled position's
    proposal i32[W] (-1: none)."""
    _, sampling, rows = unpack(forwarded.buffers, forwarded.layout)[:3]
    sampling = dataclasses.replace(sampling, token_bitmask=token_bitmask)
    counts = state.counts
    if plan is SamplerPlan.FULL:
        counts = jax.lax.cond(
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
    last = jnp.where(
        _last_tokens(sampled, forwarded.next_tokens, rows), sampling.slots, state.last_token.size
    )
    last_token = state.last_token.at[last].set(sampled.token_ids, mode="drop")
    proposals = jnp.where(rows.sample_has_draft, forwarded.next_tokens, -1)
    state = _replicated(BatchState(last_token, counts, state.page_table))
    return (sampled, proposals), state


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


class Forwarding(NamedTuple):
    """A step whose forward program is dispatched, its sampling not yet (runner.dispatch)."""

    forwarded: Forwarded
    chunks: list[ScheduledChunk]
    constrained: bool  # some row samples under a grammar: its bitmask is filled at sampling
    num_rows: int
    logprobs: bool
    num_scored: int
    drafted: bool
    sampler: SamplerPlan  # before the token mask: `ModelRunner.sample` widens it for one


class InFlight(NamedTuple):
    """A dispatched step: its device outputs, sampled positions that matter, whether any
    wants logprobs, how many prompt positions it scores."""

    out: tuple[SampledTokens, ScoredLogprobs | None, jax.Array]
    num_rows: int
    logprobs: bool
    num_scored: int
    drafted: bool = False  # a draft model proposed: the host reads the proposals


def _bucket(buckets: tuple[int, ...], n: int, what: str) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} {what} exceed the largest bucket {buckets[-1]}")


def _with_decode_buckets(config: EngineConfig, model: Model) -> EngineConfig:
    """`config` with decode-sized token buckets added when its token buckets are the derived
    default (left unset, or set to exactly those) and linear_cpu's kernel takes the model's
    matrices (bfloat16 or quantized weights on a CPU), where a step's products cost in
    proportion to its padded tokens:
    - a 1-token bucket for batch-1 decode and, with speculative decoding, one for a verifying
      row (its last token and k proposals, rounded up to a power of two), where the kernel
      takes that many rows: those steps stream the weights through the kernel instead of
      padding to the smallest derived bucket for XLA's dot;
    - each sequence bucket as a token bucket: a step of decode rows alone then pads its
      tokens no further than its rows (with the derived buckets, 17-32 decode rows padded
      to 64 tokens, 2-8 to 16 for XLA's dot instead of 8 for the kernel).
    Each adds a few compiled shapes (its sequence buckets with at most that many rows)."""
    derived = dataclasses.replace(config, token_buckets=()).token_buckets
    if config.token_buckets != derived:
        return config
    most = linear_cpu.rows_taken(model.params)
    if not most:
        return config
    small = {1}
    if config.speculative is not None:
        small.add(1 << config.speculative.num_speculative_tokens.bit_length())  # >= k + 1
    buckets = {b for b in small if b <= most} | set(config.seq_buckets) | set(derived)
    return dataclasses.replace(config, token_buckets=tuple(sorted(buckets)))


def resolve_num_pages(
    config: EngineConfig,
    model_config: ModelConfig,
    dtype: str,
    kv_shards: int = 1,
    lane_multiple: int = 1,
) -> int:
    """Pages for the KV array: explicit, from the GiB budget per device (the KV is split
    over `kv_shards` devices), or a bounded default; budgets count each head_dim row padded
    to a multiple of `lane_multiple` (see kv_cache.device_bytes_per_page)."""
    if config.num_pages is not None:
        return config.num_pages
    if config.kv_cache_memory_gib is not None:
        budget = int(config.kv_cache_memory_gib * GIB) * kv_shards
    else:
        full = device_bytes_per_page(model_config, config.page_size, dtype, lane_multiple)
        budget = min(
            2 * GIB * kv_shards, full * (config.max_num_seqs * config.max_pages_per_seq + 1)
        )
    return num_pages_for_budget(model_config, config.page_size, dtype, budget, lane_multiple)


class ModelRunner:
    def __init__(self, model: Model, config: EngineConfig, draft_model: Model | None = None):
        self.model = model
        self.draft = draft_model  # speculative decoding's draft model (draft.py), or None
        self.config = config = _with_decode_buckets(config, model)
        platform = jax.default_backend()
        capability = getattr(jax.local_devices()[0], "compute_capability", None)
        self.backend = resolve_backend(config.attention_backend, platform, capability)
        kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, model.dtype, platform, self.backend)
        self.plan = model.plan
        # A TPU pads the row-major KV's head_dim rows to its 128 lanes (kv_row_major_format).
        lanes = TPU_LANES if platform in PINNED_KV_PLATFORMS else 1
        self.num_pages = resolve_num_pages(
            config, model.config, kv_dtype, self.plan.kv_head_shards, lanes
        )
        if self.num_pages - 1 < config.max_pages_per_seq:
            raise ValueError(
                f"the KV cache has {self.num_pages - 1} usable pages, fewer than the "
                f"{config.max_pages_per_seq} one max_model_len={config.max_model_len} sequence "
                "needs; raise num_pages / kv_cache_memory_gib or lower max_model_len"
            )
        self.kv_spec = KVCacheSpec.for_model(
            model.config, self.num_pages, config.page_size, kv_dtype
        )
        self.backend.check(
            self.kv_spec.shape,
            self.kv_spec.dtype,
            specs=registry.attention_specs(model.config),
            num_heads=model.config.num_attention_heads,
            dtype=model.dtype,
            compute_capability=capability,
        )
        kv_sharding = self.plan.kv_sharding(self.kv_spec.shape)
        self.forward_step = forward_step
        if platform in PINNED_KV_PLATFORMS:
            kv_sharding = kv_row_major_format(kv_sharding)
            self.forward_step = kv_pinned_forward_step(kv_sharding)
        self.kv = allocate_kv(self.kv_spec, kv_sharding)
        self.draft_kv = None
        if draft_model is not None:  # the same pages, indexed by the same page ids
            spec = KVCacheSpec.for_model(
                draft_model.config, self.num_pages, config.page_size, kv_dtype
            )
            self.backend.check(
                spec.shape,
                spec.dtype,
                specs=registry.attention_specs(draft_model.config),
                num_heads=draft_model.config.num_attention_heads,
                dtype=draft_model.dtype,
                compute_capability=capability,
            )
            self.draft_kv = allocate_kv(spec, draft_model.plan.kv_sharding(spec.shape))
        num_slots = config.max_num_seqs + 1  # the last is the padding rows' sink
        self.batch = PersistentBatch(
            num_slots,
            config.max_pages_per_seq,
            config.page_size,
            MAX_SUPPRESSED_IDS,
            model.eos_token_ids,
            MAX_LOGIT_BIAS,
            config.max_num_scored_tokens,
            model.config.vocab_size,
        )
        self.state = self.plan.put_replicated(
            BatchState.zeros(num_slots, model.config.vocab_size, config.max_pages_per_seq)
        )
        # The cpu and xla backends loop over each sequence's own context, so the page
        # table's width costs them nothing (it stays on the device, see batch.py): one
        # context bucket (the largest) saves compiling the others.
        self.context_buckets = (
            config.context_buckets[-1:]
            if self.backend.loops_over_own_context
            else config.context_buckets
        )
        self.channel = multihost.leader_channel()  # on process 0 of several, else None
        self._all_allowed: dict[int, jax.Array] = {}  # W -> a device bitmask of all ones

    def forward(self, inputs: StepInputs, sampling: SamplingInputs, rows: RowInputs) -> Forwarded:
        """Dispatches a step's forward program on host inputs (sampling's token bitmask is
        not read); returns its outputs as device arrays (not waited for). With several
        processes every one runs it with the same inputs (process 0 sends them first, see
        multihost.py)."""
        if self.channel is not None:
            self.channel.send(inputs, sampling, rows)
        buffers, layout = pack((inputs, dataclasses.replace(sampling, token_bitmask=None), rows))
        if self.plan.mesh.size > 1:  # one device: jit's own transfer of numpy is faster
            buffers = self.plan.put_replicated(buffers)
        draft = self.draft
        with self.plan.activate():
            forwarded, self.kv, self.state, self.draft_kv = self.forward_step(
                self.model.params,
                self.model.config,
                self.kv,
                self.state,
                buffers,
                layout,
                self.config.max_logprobs,
                self.backend.name,
                None if draft is None else draft.params,
                self.draft_kv,
                None if draft is None else draft.config,
                self.config.num_speculative_tokens,
            )
        return forwarded

    def write_pages(self, writes: PageWrites) -> None:
        """Dispatches page-table writes (max_pages_per_seq of them) on the device's copy, before
        the step that reads them; process 0 of several sends them to the others first."""
        if self.channel is not None:
            self.channel.send_pages(writes)
        if self.plan.mesh.size > 1:
            writes = self.plan.put_replicated(writes)
        with self.plan.activate():
            self.state = write_pages_step(self.state, writes)

    def sample(
        self,
        forwarded: Forwarded,
        token_bitmask: np.ndarray | None,
        sampler: SamplerPlan,
        num_scored: int = 0,
    ) -> tuple[SampledTokens, ScoredLogprobs | None, jax.Array]:
        """Dispatches the sampling program of a step `forward` dispatched, as `sampler` says (a
        token mask that allows some row less than every token widens it to FULL), under
        token_bitmask i32[W, ceil(V / 32)] (None: every token allowed), and when the step
        scores `num_scored` prompt positions, its scoring program; returns their outputs as
        device arrays (not waited for): sampled tokens, scored prompt logprobs (None: none
        scored), proposals. Process 0 of several sends the sampler plan, the scored size and the
        bitmask to the others first, which run what it sends."""
        width = forwarded.logits.shape[0]
        if token_bitmask is not None and np.all(token_bitmask == -1):
            token_bitmask = None
        if token_bitmask is not None:
            sampler = SamplerPlan.FULL
        size = scored_size(num_scored, self.config.max_num_scored_tokens)
        if self.channel is not None:
            mask = self.batch.bitmasks([], width) if token_bitmask is None else token_bitmask
            self.channel.send_sample(sampler, size, mask)
        if token_bitmask is not None:
            token_bitmask = self._put(token_bitmask)
        else:  # kept on the device: an unconstrained step sends no mask
            if width not in self._all_allowed:
                self._all_allowed[width] = self._put(self.batch.bitmasks([], width))
            token_bitmask = self._all_allowed[width]
        with self.plan.activate():
            (sampled, proposals), self.state = sample_step(
                forwarded, self.state, token_bitmask, self.config.max_logprobs, sampler
            )
            scored = None
            if size:
                scored = score_step(
                    self.model.params,
                    self.model.config,
                    forwarded.scored_hidden,
                    forwarded.scored_targets,
                    size,
                    self.config.max_logprobs,
                )
        return sampled, scored, proposals

    def _put(self, array: np.ndarray) -> jax.Array:
        """A host array on the device(s), placed as every step's inputs are."""
        return self.plan.put_replicated(array) if self.plan.mesh.size > 1 else jnp.asarray(array)

    def execute(
        self,
        inputs: StepInputs,
        sampling: SamplingInputs,
        rows: RowInputs,
        token_bitmask: np.ndarray | None = None,
    ) -> tuple[SampledTokens, ScoredLogprobs | None, jax.Array]:
        """Dispatches one whole step (forward, then sampling under token_bitmask) on host
        inputs; returns its outputs as device arrays (not waited for)."""
        num_scored = int(np.count_nonzero(rows.scored_targets >= 0))
        forwarded = self.forward(inputs, sampling, rows)
        return self.sample(forwarded, token_bitmask, plan_for(sampling, False), num_scored)

    def dispatch(self, chunks: list[ScheduledChunk]) -> Forwarding:
        """Dispatches the forward program of the step running `chunks`; `finish_dispatch`
        then dispatches its sampling, and `fetch` waits for its result."""
        cfg = self.config
        num_tokens = _bucket(cfg.token_buckets, sum(c.num_tokens for c in chunks), "tokens")
        num_seqs = _bucket(cfg.seq_buckets, len(chunks), "sequences")
        # Attention reads only cached tokens from the pages, so the context bucket covers
        # the longest cached prefix; a fresh prompt's prefill gathers almost nothing.
        # A draft model's k decode steps attend to up to start + k - 1 cached tokens.
        drafting = self.draft is not None
        cached = max(c.start + drafting * len(c.draft_token_ids) for c in chunks)
        context = _bucket(self.context_buckets, cached, "cached tokens")
        width = sample_width(num_tokens, num_seqs, cfg.num_speculative_tokens)
        inputs, sampling, rows, page_writes = self.batch.prepare(
            chunks, num_tokens, num_seqs, context // cfg.page_size, width
        )
        for writes in page_writes:
            self.write_pages(writes)
        num_positions = sum(c.num_positions for c in chunks)
        logprobs = bool((sampling.num_logprobs[:num_positions] >= 0).any())
        num_scored = sum(c.num_scored for c in chunks)
        drafted = drafting and any(c.draft_token_ids for c in chunks)
        forwarded = self.forward(inputs, sampling, rows)
        constrained = any(c.samples and c.request.matcher for c in chunks)
        sampler = plan_for(sampling, masked=False)
        return Forwarding(
            forwarded, chunks, constrained, num_positions, logprobs, num_scored, drafted, sampler
        )

    def finish_dispatch(self, step: Forwarding) -> InFlight:
        """Dispatches the sampling program of a step `dispatch` began: its constrained rows'
        token bitmasks are filled now, from their grammars (up to date once the step before
        is fetched), while the forward runs on the device."""
        masks = None
        if step.constrained:
            masks = self.batch.bitmasks(step.chunks, step.forwarded.logits.shape[0])
        out = self.sample(step.forwarded, masks, step.sampler, step.num_scored)
        return InFlight(out, step.num_rows, step.logprobs, step.num_scored, step.drafted)

    @staticmethod
    def fetch(
        step: InFlight,
    ) -> tuple[SampledTokens, ScoredLogprobs | None, np.ndarray | None]:
        """Waits for a dispatched step: each sampled position's token and logprobs (each
        chunk's num_positions, chunk after chunk), the scored prompt positions' logprobs in
        chunk order (numpy; logprob arrays are copied only when some row asked for them,
        else None), and where a draft model proposed, each position's proposal (else None)."""
        n = step.num_rows
        out, scored, proposals = step.out
        proposals = fetch(proposals)[:n] if step.drafted else None
        if not step.logprobs:
            sampled = SampledTokens(fetch(out.token_ids)[:n], None, None, None)
        else:
            out = fetch(out)
            sampled = SampledTokens(
                out.token_ids[:n], out.logprobs[:n], out.top_ids[:n], out.top_logprobs[:n]
            )
        if not step.num_scored:
            return sampled, None, proposals
        q = step.num_scored
        return sampled, jax.tree.map(lambda a: a[:q], fetch(scored)), proposals

    def run(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[SampledTokens, ScoredLogprobs | None, np.ndarray | None]:
        """Runs one step and waits for it."""
        return self.fetch(self.finish_dispatch(self.dispatch(chunks)))

    def bucket_shapes(self) -> list[tuple[int, int, int]]:
        """The (T, S, context) step shapes this runner uses: the config's, with only the
        context buckets of this backend."""
        return [shape for shape in self.config.bucket_shapes() if shape[2] in self.context_buckets]

    def warm_up(self, progress: bool = True) -> int:
        """Compiles (by running on padding only) every bucket shape, its sampler under each
        SamplerPlan, and the scoring program at each scored size; returns the shapes."""
        shapes = self.bucket_shapes()
        for num_tokens, num_seqs, context in tqdm(
            shapes, desc="warm-up", unit="bucket", disable=not progress
        ):
            forwarded = self.forward(*self.padding_inputs(num_tokens, num_seqs, context)[:3])
            for sampler in SamplerPlan:
                self.sample(forwarded, None, sampler)
        for size in scored_sizes(self.config.max_num_scored_tokens):
            self.sample(forwarded, None, SamplerPlan.GREEDY, size)
        self.write_pages(PageWrites.padding(self.config.max_pages_per_seq, self.batch.num_slots))
        return len(shapes)

    def padding_inputs(
        self, num_tokens: int, num_seqs: int, context: int
    ) -> tuple[StepInputs, SamplingInputs, RowInputs, np.ndarray]:
        """Inputs of a (T, S, context) step holding padding only, and its token bitmask."""
        width = sample_width(num_tokens, num_seqs, self.config.num_speculative_tokens)
        inputs, sampling, rows = self.batch.padding(
            num_tokens, num_seqs, context // self.config.page_size, width
        )
        return inputs, sampling, rows, self.batch.bitmasks([], width)


def compile_count() -> int:
    """Entries in the jit caches of every engine step (one per compiled shape)."""
    return sum(step._cache_size() for step in _step_functions)

"""The device side of a step: pad the scheduled batch to a bucket, run one jitted call.

In: the scheduler's chunks. Out: one sampled token (+ logprobs) per row, and the prompt
logprobs of the positions the chunks score (sampling.score_prompt). The runner owns the
params, the KV array and the persistent batch (batch.py: host rows per slot, and the device's
BatchState: last sampled tokens and penalty counts); the jitted step (forward + sampling)
takes the KV and the BatchState donated and returns them, so both are updated in place.
`execute` only dispatches the step (JAX runs it asynchronously) and returns its device
outputs; `fetch` waits for them, so the engine can prepare and dispatch the next step first.
Every step is padded to a (T tokens, S sequences, context) bucket from EngineConfig;
`warm_up` compiles all of them first, so a serving workload never compiles.

The params and KV carry the model's ShardingPlan shardings and every step's inputs are
replicated over its mesh, the same in warm-up and serving, so sharding never recompiles.
With several processes (multihost.py), process 0's runner sends each step's inputs to the
others, which run the same step.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.layout import Format, Layout
from tqdm import tqdm

from ksana_jax import multihost
from ksana_jax.batch import PackLayout, PersistentBatch, RowInputs, pack, unpack
from ksana_jax.config import EngineConfig, ModelConfig
from ksana_jax.kv_cache import (
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
from ksana_jax.pallas_kernels import resolve_backend
from ksana_jax.sampling import (
    PenaltyCounts,
    SampledTokens,
    SamplingInputs,
    ScoredLogprobs,
    count_tokens,
    penalties_active,
    sample,
    score_prompt,
)
from ksana_jax.sampling_params import MAX_LOGIT_BIAS
from ksana_jax.scheduler import ScheduledChunk
from ksana_jax.sharding import fetch
from ksana_jax.step_inputs import StepInputs

GIB = 1 << 30
MAX_SUPPRESSED_IDS = 8  # EOS + stop_token_ids banned while a request is below min_tokens


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["last_token", "counts"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class BatchState:
    """The persistent batch's device side, one row per slot (R = max_num_seqs + 1: the last
    is the padding sink)."""

    last_token: jax.Array  # i32[R]  each slot's last sampled token
    counts: PenaltyCounts  # [R, V]  each slot's tokens so far, for penalties

    @classmethod
    def zeros(cls, num_slots: int, vocab: int) -> BatchState:
        return cls(jnp.zeros(num_slots, jnp.int32), PenaltyCounts.zeros(num_slots, vocab))


def _model_logits(params, cfg: ModelConfig, kv: KVCache, inputs: StepInputs, backend: str):
    """The model: forward over the ragged batch; logits f32[S, V] of each row's last token,
    and the final hidden states f32[T, D] (for scored prompt positions)."""
    hidden, kv = registry.forward(params, cfg, kv, inputs, backend)
    last = jnp.maximum(inputs.query_starts[1:] - 1, 0)  # [S]
    return registry.logits(params, cfg, hidden[last]), hidden, kv


def _engine_step(
    params: registry.Params,
    cfg: ModelConfig,
    kv: KVCache,
    state: BatchState,
    buffers: tuple[jax.Array, jax.Array],
    layout: PackLayout,
    max_logprobs: int,
    backend: str = "reference",
) -> tuple[tuple[SampledTokens, ScoredLogprobs], jax.Array, BatchState]:
    """Unpacks the step's inputs (StepInputs, SamplingInputs, RowInputs; see batch.pack),
    feeds placeholders their slot's last sampled token, counts the fed tokens for
    penalties, runs the model, samples each row's last token and scores the prompt
    positions RowInputs names."""
    inputs, sampling, rows = unpack(buffers, layout)
    fed = state.last_token.at[rows.last_token_slots].get(mode="fill", fill_value=-1)
    inputs = dataclasses.replace(inputs, token_ids=jnp.where(fed >= 0, fed, inputs.token_ids))
    counts = jax.lax.cond(
        jnp.any(penalties_active(sampling)),
        lambda c: count_tokens(
            c, rows.count_slots, inputs.token_ids, rows.is_output, rows.reset_slots
        ),
        lambda c: c,
        state.counts,
    )
    logits, hidden, kv = _model_logits(params, cfg, kv, inputs, backend)
    sampled = sample(logits, sampling, counts, max_logprobs)
    scored = score_prompt(
        hidden,
        rows.scored_token_slots,
        rows.scored_targets,
        functools.partial(registry.logits, params, cfg),
        max_logprobs,
    )
    last_token = state.last_token.at[sampling.slots].set(sampled.token_ids, mode="drop")
    return (sampled, scored), kv, _replicated(BatchState(last_token, counts))


def _replicated(tree):
    """Under a mesh of several devices, `tree` replicated: the state comes out with the
    sharding it went in with, so the next step does not compile again."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return tree
    return jax.lax.with_sharding_constraint(tree, jax.sharding.PartitionSpec())


_STEP_JIT = dict(
    static_argnames=("cfg", "layout", "max_logprobs", "backend"), donate_argnames=("kv", "state")
)
engine_step = jax.jit(_engine_step, **_STEP_JIT)
_step_functions = {engine_step}  # every jitted step, for compile_count


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
def kv_pinned_engine_step(kv_format: Format):
    """engine_step with the KV argument and result held in `kv_format`. Call it with every
    argument positional, as `ModelRunner.execute` does: with in_shardings set, jit takes no
    keyword arguments."""
    step = jax.jit(
        _engine_step,
        in_shardings=(None, kv_shardings(kv_format), None, None),  # params, kv, state, buffers
        out_shardings=(None, kv_shardings(kv_format), None),
        **_STEP_JIT,
    )
    _step_functions.add(step)
    return step


class InFlight(NamedTuple):
    """A dispatched step: its device outputs, rows that matter, whether any wants logprobs,
    how many prompt positions it scores."""

    out: tuple[SampledTokens, ScoredLogprobs]
    num_rows: int
    logprobs: bool
    num_scored: int


def _bucket(buckets: tuple[int, ...], n: int, what: str) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} {what} exceed the largest bucket {buckets[-1]}")


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
    def __init__(self, model: Model, config: EngineConfig):
        self.model = model
        self.config = config
        platform = jax.default_backend()
        self.backend = resolve_backend(
            config.attention_backend,
            platform,
            getattr(jax.local_devices()[0], "compute_capability", None),
        )
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
        )
        kv_sharding = self.plan.kv_sharding(self.kv_spec.shape)
        self.step = engine_step
        if platform in PINNED_KV_PLATFORMS:
            kv_sharding = kv_row_major_format(kv_sharding)
            self.step = kv_pinned_engine_step(kv_sharding)
        self.kv = allocate_kv(self.kv_spec, kv_sharding)
        num_slots = config.max_num_seqs + 1  # the last is the padding rows' sink
        self.batch = PersistentBatch(
            num_slots,
            config.max_pages_per_seq,
            config.page_size,
            MAX_SUPPRESSED_IDS,
            model.eos_token_ids,
            MAX_LOGIT_BIAS,
            config.max_num_scored_tokens,
        )
        self.state = self.plan.put_replicated(BatchState.zeros(num_slots, model.config.vocab_size))
        # The cpu and xla backends loop over each sequence's own context, so the page
        # table's width costs them nothing: one context bucket (the largest) saves compiling
        # the others.
        self.context_buckets = (
            config.context_buckets[-1:]
            if self.backend.loops_over_own_context
            else config.context_buckets
        )
        self.channel = multihost.leader_channel()  # on process 0 of several, else None

    def execute(
        self, inputs: StepInputs, sampling: SamplingInputs, rows: RowInputs
    ) -> tuple[SampledTokens, ScoredLogprobs]:
        """Dispatches one jitted step on host inputs; returns its outputs as device arrays
        (not waited for). With several processes every one runs it with the same inputs
        (process 0 sends them first, see multihost.py)."""
        if self.channel is not None:
            self.channel.send(inputs, sampling, rows)
        buffers, layout = pack((inputs, sampling, rows))
        if self.plan.mesh.size > 1:  # one device: jit's own transfer of numpy is faster
            buffers = self.plan.put_replicated(buffers)
        with self.plan.activate():
            out, self.kv, self.state = self.step(
                self.model.params,
                self.model.config,
                self.kv,
                self.state,
                buffers,
                layout,
                self.config.max_logprobs,
                self.backend.name,
            )
        return out

    def dispatch(self, chunks: list[ScheduledChunk]) -> InFlight:
        """Dispatches the step running `chunks`; `fetch` waits for its result."""
        cfg = self.config
        num_tokens = _bucket(cfg.token_buckets, sum(c.num_tokens for c in chunks), "tokens")
        num_seqs = _bucket(cfg.seq_buckets, len(chunks), "sequences")
        # Attention reads only cached tokens from the pages, so the context bucket covers
        # the longest cached prefix; a fresh prompt's prefill gathers almost nothing.
        context = _bucket(self.context_buckets, max(c.start for c in chunks), "cached tokens")
        inputs, sampling, rows = self.batch.prepare(
            chunks, num_tokens, num_seqs, context // cfg.page_size
        )
        logprobs = bool((sampling.num_logprobs[: len(chunks)] >= 0).any())
        num_scored = sum(c.num_scored for c in chunks)
        return InFlight(self.execute(inputs, sampling, rows), len(chunks), logprobs, num_scored)

    @staticmethod
    def fetch(step: InFlight) -> tuple[SampledTokens, ScoredLogprobs | None]:
        """Waits for a dispatched step: each chunk's sampled token and logprobs, and the
        scored prompt positions' logprobs in chunk order (numpy; logprob arrays are copied
        only when some row asked for them, else None)."""
        n = step.num_rows
        out, scored = step.out
        if not step.logprobs:
            sampled = SampledTokens(fetch(out.token_ids)[:n], None, None, None)
        else:
            out = fetch(out)
            sampled = SampledTokens(
                out.token_ids[:n], out.logprobs[:n], out.top_ids[:n], out.top_logprobs[:n]
            )
        if not step.num_scored:
            return sampled, None
        q = step.num_scored
        return sampled, jax.tree.map(lambda a: a[:q], fetch(scored))

    def run(self, chunks: list[ScheduledChunk]) -> tuple[SampledTokens, ScoredLogprobs | None]:
        """Runs one step and waits for it."""
        return self.fetch(self.dispatch(chunks))

    def bucket_shapes(self) -> list[tuple[int, int, int]]:
        """The (T, S, context) step shapes this runner uses: the config's, with only the
        context buckets of this backend."""
        return [shape for shape in self.config.bucket_shapes() if shape[2] in self.context_buckets]

    def warm_up(self, progress: bool = True) -> int:
        """Compiles (by running on padding only) every bucket shape; returns how many."""
        shapes = self.bucket_shapes()
        for num_tokens, num_seqs, context in tqdm(
            shapes, desc="warm-up", unit="bucket", disable=not progress
        ):
            self.execute(*self.padding_inputs(num_tokens, num_seqs, context))
        return len(shapes)

    def padding_inputs(
        self, num_tokens: int, num_seqs: int, context: int
    ) -> tuple[StepInputs, SamplingInputs, RowInputs]:
        """Inputs of a (T, S, context) step holding padding only."""
        return self.batch.padding(num_tokens, num_seqs, context // self.config.page_size)


def compile_count() -> int:
    """Entries in the jit caches of every engine step (one per compiled shape)."""
    return sum(step._cache_size() for step in _step_functions)

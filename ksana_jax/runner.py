"""The device side of a step: pad the scheduled batch to a bucket, run one jitted call.

In: the scheduler's chunks (host lists). Out: one sampled token (+ logprobs) per row, as
numpy. The runner owns the params and the KV array; the jitted step (forward + sampling)
takes the KV donated and returns it, so it is updated in place. Every step is padded to a
(T tokens, S sequences, context) bucket from EngineConfig; `warm_up` compiles all of them
first, so a serving workload never compiles.

The params and KV carry the model's ShardingPlan shardings and every step's inputs are
replicated over its mesh, the same in warm-up and serving, so sharding never recompiles.
With several processes (multihost.py), process 0's runner sends each step's inputs to the
others, which run the same step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format, Layout
from tqdm import tqdm

from ksana_jax import multihost
from ksana_jax.config import EngineConfig, ModelConfig
from ksana_jax.kv_cache import (
    KVCacheSpec,
    allocate_kv,
    device_bytes_per_page,
    num_pages_for_budget,
    resolve_kv_dtype,
)
from ksana_jax.model import Model
from ksana_jax.models import registry
from ksana_jax.pallas_kernels import resolve_backend
from ksana_jax.sampling import SampledTokens, SamplingInputs, sample
from ksana_jax.sampling_params import SamplingParams
from ksana_jax.scheduler import ScheduledChunk
from ksana_jax.sharding import fetch
from ksana_jax.step_inputs import SequenceChunk, StepInputs, build_step_inputs

GIB = 1 << 30
MAX_SUPPRESSED_IDS = 8  # EOS + stop_token_ids banned while a request is below min_tokens


def _engine_step(
    params: registry.Params,
    cfg: ModelConfig,
    kv: jax.Array,
    inputs: StepInputs,
    sampling: SamplingInputs,
    max_logprobs: int,
    backend: str = "reference",
) -> tuple[SampledTokens, jax.Array]:
    """Forward over the ragged batch, then sample each row's last token."""
    hidden, kv = registry.forward(params, cfg, kv, inputs, backend)
    last = jnp.maximum(inputs.query_starts[1:] - 1, 0)  # [S]
    logits = registry.logits(params, cfg, hidden[last])
    return sample(logits, sampling, max_logprobs), kv


_STEP_JIT = dict(static_argnames=("cfg", "max_logprobs", "backend"), donate_argnames=("kv",))
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
        in_shardings=(None, kv_format, None, None),  # params, kv, inputs, sampling
        out_shardings=(None, kv_format),
        **_STEP_JIT,
    )
    _step_functions.add(step)
    return step


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


def suppressed_ids(params: SamplingParams, eos_ids: tuple[int, ...]) -> list[int]:
    """Token ids a request may not sample before it has min_tokens outputs."""
    ids = [*params.stop_token_ids, *([] if params.ignore_eos else eos_ids)]
    return list(dict.fromkeys(ids))


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
        # The cpu and xla backends loop over each sequence's own context, so the page
        # table's width costs them nothing: one context bucket (the largest) saves compiling
        # the others.
        self.context_buckets = (
            config.context_buckets[-1:]
            if self.backend.loops_over_own_context
            else config.context_buckets
        )
        self.channel = multihost.leader_channel()  # on process 0 of several, else None

    def execute(self, inputs: StepInputs, sampling: SamplingInputs) -> SampledTokens:
        """One jitted step on host inputs, outputs as numpy; with several processes every
        one runs it with the same inputs (process 0 sends them first, see multihost.py)."""
        if self.channel is not None:
            self.channel.send(inputs, sampling)
        inputs, sampling = self.plan.put_replicated((inputs, sampling))
        with self.plan.activate():
            out, self.kv = self.step(
                self.model.params,
                self.model.config,
                self.kv,
                inputs,
                sampling,
                self.config.max_logprobs,
                self.backend.name,
            )
        return fetch(out)

    def run(self, chunks: list[ScheduledChunk]) -> SampledTokens:
        """Runs one step; returns each chunk's sampled token and logprobs (numpy, [rows])."""
        out = self.execute(*self._prepare(chunks))
        n = len(chunks)
        return SampledTokens(
            out.token_ids[:n], out.logprobs[:n], out.top_ids[:n], out.top_logprobs[:n]
        )

    def _prepare(self, chunks: list[ScheduledChunk]) -> tuple[StepInputs, SamplingInputs]:
        cfg = self.config
        num_tokens = _bucket(cfg.token_buckets, sum(c.num_tokens for c in chunks), "tokens")
        num_seqs = _bucket(cfg.seq_buckets, len(chunks), "sequences")
        # Attention reads only cached tokens from the pages, so the context bucket covers
        # the longest cached prefix; a fresh prompt's prefill gathers almost nothing.
        context = _bucket(self.context_buckets, max(c.start for c in chunks), "cached tokens")
        inputs = build_step_inputs(
            [SequenceChunk(c.token_ids, c.start, c.request.page_ids) for c in chunks],
            cfg.page_size,
            num_tokens,
            num_seqs,
            context // cfg.page_size,
        )
        return inputs, self._sampling_inputs([c.request for c in chunks], num_seqs)

    def _sampling_inputs(self, requests, num_seqs: int) -> SamplingInputs:
        def column(values, dtype, pad):
            out = np.full(num_seqs, pad, dtype)
            out[: len(values)] = values
            return out

        params = [r.params for r in requests]
        history = np.full((num_seqs, self.config.max_model_len), -1, np.int32)
        suppressed = np.full((num_seqs, MAX_SUPPRESSED_IDS), -1, np.int32)
        for i, r in enumerate(requests):
            ids = r.all_token_ids
            history[i, : len(ids)] = ids
            if len(r.output_token_ids) < r.params.min_tokens:
                banned = suppressed_ids(r.params, self.model.eos_token_ids)
                suppressed[i, : len(banned)] = banned
        return SamplingInputs(
            temperature=column([p.temperature for p in params], np.float32, 0.0),
            top_k=column([p.top_k for p in params], np.int32, 0),
            top_p=column([p.top_p for p in params], np.float32, 1.0),
            min_p=column([p.min_p for p in params], np.float32, 0.0),
            repetition_penalty=column([p.repetition_penalty for p in params], np.float32, 1.0),
            presence_penalty=column([p.presence_penalty for p in params], np.float32, 0.0),
            frequency_penalty=column([p.frequency_penalty for p in params], np.float32, 0.0),
            seeds=column([r.seed for r in requests], np.uint32, 0),
            num_generated=column([len(r.output_token_ids) for r in requests], np.int32, 0),
            history_ids=history,
            num_prompt_tokens=column([len(r.prompt_token_ids) for r in requests], np.int32, 0),
            suppressed_ids=suppressed,
            num_logprobs=column(
                [-1 if p.logprobs is None else p.logprobs for p in params], np.int32, -1
            ),
        )

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
    ) -> tuple[StepInputs, SamplingInputs]:
        """Inputs of a (T, S, context) step holding padding only."""
        inputs = build_step_inputs(
            [], self.config.page_size, num_tokens, num_seqs, context // self.config.page_size
        )
        return inputs, self._sampling_inputs([], num_seqs)


def compile_count() -> int:
    """Entries in the jit caches of every engine step (one per compiled shape)."""
    return sum(step._cache_size() for step in _step_functions)

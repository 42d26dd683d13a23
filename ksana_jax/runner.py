"""The host side of a step: pad the scheduled batch to a bucket, dispatch its jitted programs
(step_programs.py).

In: the scheduler's chunks. Out: one sampled token (+ logprobs) per row, and the prompt
logprobs of the positions the chunks score (sampling.score_prompt). The runner owns the
params, the KV array and the persistent batch (batch.py: host rows per slot, and the device's
BatchState: last sampled tokens, penalty counts and the page table). A step is two programs,
as SGLang's, and a third when it scores prompt positions:

    dispatch(chunks)          [write_pages_step: a prefix-cache hit's pages, when they do not
                              fit in the step's page writes]
                              forward_step: the model
    finish_dispatch(step)     the token bitmask, filled now from the grammars (batch.py);
                              sample_step: tokens, logprobs, proposals
                              [score_step: prompt logprobs]
    fetch(in_flight)          waits for the outputs

A step whose rows all sample greedily with nothing else to do (SamplerPlan.GREEDY: no
grammar, no logprobs, nothing scored) is one program: the forward samples it
(`samples_in_forward`). On XLA:CPU a program that waits for the one before starts when a
thread wakes for it: the second program cost a batch-1 step 0.2-0.3 ms when steps ran back
to back. In the engine the tiny benchmark model decodes 1.24x faster at 1 row and 1.08x at 64,
SmolLM2 at batch 1 1-7% (README).

All only dispatch (JAX runs them asynchronously), so the engine fills the bitmask, and
finishes the step before, while the forward runs. The host decides what the sampler and
the scorer compute (a sampling.SamplerPlan and a scored size, both static), so the programs
of a step whose rows sample greedily or plainly (with or without logprobs) hold no
conditional, which a GPU would run with a wait for the work queued before it. Every step is
padded to a (T tokens, S sequences, context) bucket from EngineConfig; `warm_up` compiles
all of them first (each sampler plan, each scored size), so a serving workload never
compiles.

The params and KV carry the model's ShardingPlan shardings and every step's inputs are
replicated over its mesh, the same in warm-up and serving, so sharding never recompiles.
With several processes (multihost.py), process 0's runner sends each step's inputs, and
then its plan and bitmask, to the others, which run the same programs.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from ksana_jax import host_memory, multihost
from ksana_jax.batch import (
    PageWrites,
    PersistentBatch,
    RowInputs,
    pack,
    sample_width,
)
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
from ksana_jax.pallas_kernels import linear_cpu, resolve_backend
from ksana_jax.sampling import (
    SampledTokens,
    SamplerPlan,
    SamplingInputs,
    ScoredLogprobs,
    plan_for,
    sampler_plans,
    scored_size,
    scored_sizes,
)
from ksana_jax.sampling_params import MAX_LOGIT_BIAS
from ksana_jax.scheduler import ScheduledChunk
from ksana_jax.sharding import fetch
from ksana_jax.step_inputs import StepInputs
from ksana_jax.step_programs import (
    PINNED_KV_PLATFORMS,
    TPU_LANES,
    BatchState,
    Forwarded,
    forward_step,
    kv_pinned_forward_step,
    kv_row_major_format,
    sample_step,
    score_step,
    write_pages_step,
)

log = logging.getLogger("ksana_jax.runner")
GIB = 1 << 30
MAX_SUPPRESSED_IDS = 8  # EOS + stop_token_ids banned while a request is below min_tokens


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
    sampled: bool  # the forward sampled the step (samples_in_forward): no sampling program


def samples_in_forward(sampler: SamplerPlan, constrained: bool, num_scored: int) -> bool:
    """Whether a step's forward program samples it (RowInputs.samples_greedily): its rows
    sample as SamplerPlan.GREEDY (the argmax, nothing else), no grammar's bitmask is filled
    while the forward runs, and it scores no prompt positions."""
    return sampler is SamplerPlan.GREEDY and not constrained and not num_scored


def _sampled_by_forward(
    forwarded: Forwarded,
) -> tuple[SampledTokens, ScoredLogprobs | None, jax.Array]:
    """What `ModelRunner.sample` returns, for a step its forward sampled."""
    return SampledTokens(forwarded.greedy_tokens, None, None, None), None, forwarded.proposals


class InFlight(NamedTuple):
    """A dispatched step: its device outputs, sampled positions that matter, whether any
    wants logprobs, how many prompt positions it scores."""

    out: tuple[SampledTokens, ScoredLogprobs | None, jax.Array]
    num_rows: int
    logprobs: bool
    num_scored: int
    drafted: bool = False  # a draft model proposed: the host reads the proposals


def _fetched(step: InFlight) -> list[jax.Array]:
    """The device arrays `ModelRunner.fetch` reads of a dispatched step."""
    out, scored, proposals = step.out
    arrays = [out if step.logprobs else out.token_ids]
    if step.drafted:
        arrays.append(proposals)
    if step.num_scored:
        arrays.append(scored)
    return arrays


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
        if model.quantization and model.config.dtype == "float32" and linear_cpu.indexes_layers():
            log.warning(
                "%s weights multiply float32 activations (dtype float32, the checkpoint's); "
                "the CPU kernel's integer dots take bfloat16 products: dtype='bfloat16' "
                "(--dtype bfloat16) decodes ~2x faster (README: Quantization)",
                model.quantization,
            )
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
        if platform == "cpu":  # every step reads every weight (host_memory.py)
            draft_params = None if draft_model is None else draft_model.params
            host_memory.back_with_huge_pages((model.params, draft_params))
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
        token mask that allows some row less than every token widens it to a full plan), under
        token_bitmask i32[W, ceil(V / 32)] (None: every token allowed), and when the step
        scores `num_scored` prompt positions, its scoring program; returns their outputs as
        device arrays (not waited for): sampled tokens, scored prompt logprobs (None: none
        scored), proposals. Process 0 of several sends the sampler plan, the scored size and the
        bitmask to the others first, which run what it sends."""
        width = forwarded.logits.shape[0]
        if token_bitmask is not None and np.all(token_bitmask == -1):
            token_bitmask = None
        if token_bitmask is not None:
            sampler = sampler.widened()
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
        """Dispatches one whole step (forward, then sampling under token_bitmask, unless the
        forward samples it) on host inputs; returns its outputs as device arrays (not waited
        for)."""
        num_scored = int(np.count_nonzero(rows.scored_targets >= 0))
        sampler = plan_for(sampling, False)
        constrained = token_bitmask is not None and not np.all(token_bitmask == -1)
        sampled = samples_in_forward(sampler, constrained, num_scored)
        rows = dataclasses.replace(rows, samples_greedily=np.array(sampled))
        forwarded = self.forward(inputs, sampling, rows)
        if sampled:
            return _sampled_by_forward(forwarded)
        return self.sample(forwarded, token_bitmask, sampler, num_scored)

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
        constrained = any(c.samples and c.request.matcher for c in chunks)
        sampler = plan_for(sampling, masked=False)
        sampled = samples_in_forward(sampler, constrained, num_scored)
        rows = dataclasses.replace(rows, samples_greedily=np.array(sampled))
        forwarded = self.forward(inputs, sampling, rows)
        return Forwarding(
            forwarded,
            chunks,
            constrained,
            num_positions,
            logprobs,
            num_scored,
            rows.drafts,
            sampler,
            sampled,
        )

    def finish_dispatch(self, step: Forwarding) -> InFlight:
        """Dispatches the sampling program of a step `dispatch` began, unless its forward
        sampled it: its constrained rows' token bitmasks are filled now, from their grammars
        (up to date once the step before is fetched), while the forward runs on the device.
        What `fetch` will read is copied to the host as soon as it is computed: asked for
        only at the fetch, XLA:CPU queued the copy behind the step dispatched meanwhile
        (async scheduling's next forward), so the host waited for that step too before
        dispatching the one after it."""
        if step.sampled:
            out = _sampled_by_forward(step.forwarded)
        else:
            masks = None
            if step.constrained:
                masks = self.batch.bitmasks(step.chunks, step.forwarded.logits.shape[0])
            out = self.sample(step.forwarded, masks, step.sampler, step.num_scored)
        in_flight = InFlight(out, step.num_rows, step.logprobs, step.num_scored, step.drafted)
        for array in jax.tree.leaves(_fetched(in_flight)):
            array.copy_to_host_async()
        return in_flight

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
        """Compiles (by running on padding only) every bucket shape under each of its static
        row variants (`row_variants`), its sampler under each plan this platform uses
        (`sampler_plans`), and the scoring program at each scored size; returns the shapes."""
        shapes = self.bucket_shapes()
        for num_tokens, num_seqs, context in tqdm(
            shapes, desc="warm-up", unit="bucket", disable=not progress
        ):
            inputs, sampling, rows, _ = self.padding_inputs(num_tokens, num_seqs, context)
            for variant in self.row_variants(rows):
                forwarded = self.forward(inputs, sampling, variant)
                for sampler in sampler_plans():
                    self.sample(forwarded, None, sampler)
        for size in scored_sizes(self.config.max_num_scored_tokens):
            self.sample(forwarded, None, SamplerPlan.GREEDY, size)
        self.write_pages(PageWrites.padding(self.config.max_pages_per_seq, self.batch.num_slots))
        return len(shapes)

    def row_variants(self, rows: RowInputs) -> list[RowInputs]:
        """A bucket's padding RowInputs under each static variant its steps can take: with
        proposals, the LM head and sampler over min(T, S) positions or all W (those in use,
        batch.sampled_positions); with a draft model, a step where some row drafts runs the
        draft (RowInputs.drafts), which then has proposals."""
        width = rows.sample_token_slots.shape[0]
        variants = [rows]
        if self.draft is not None:
            variants.append(dataclasses.replace(rows, drafts=True))
        if width > rows.sampled_positions:
            drafts = self.draft is not None  # a draft model's steps with proposals draft
            variants.append(dataclasses.replace(rows, sampled_positions=width, drafts=drafts))
        return variants

    def padding_inputs(
        self, num_tokens: int, num_seqs: int, context: int
    ) -> tuple[StepInputs, SamplingInputs, RowInputs, np.ndarray]:
        """Inputs of a (T, S, context) step holding padding only, and its token bitmask."""
        width = sample_width(num_tokens, num_seqs, self.config.num_speculative_tokens)
        inputs, sampling, rows = self.batch.padding(
            num_tokens, num_seqs, context // self.config.page_size, width
        )
        return inputs, sampling, rows, self.batch.bitmasks([], width)

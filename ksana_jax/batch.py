"""The persistent batch: per-slot state of the running requests, and each step's inputs
built from it by diffs.

Each running request holds a slot (`Request.slot`, given by the scheduler) in [0, R - 1);
slot R - 1 is the padding sink. The host keeps one numpy row per slot -- sampling
parameters, seed, the ids banned below min_tokens, the page table -- written when a request
joins a slot (is admitted or resumed) and, for the page table, when it gains pages. A
grammar-constrained row's token bitmask is filled each step from its matcher (structured.py),
apart from the other inputs: while the step's forward runs (runner.py). A step
then gathers its rows with one index per array, so its host work is O(rows joined + pages
gained + tokens scheduled), whatever the context lengths are.

The device keeps its own per-slot state (step_programs.BatchState): each slot's last sampled token,
which a decode row reads when its token is still a placeholder (async scheduling); the
penalty counts, updated in the step from the tokens it feeds; and the page table, [R,
max_pages_per_seq], written by the pages each row gained since its last step (`PageWrites`,
sent with the step; the host's copy computes the tokens' KV slots) and read by the step for
its rows' first P pages. So no step sends a page table: one would grow with max_model_len
on the cpu and xla backends, which compile one context bucket only, the largest. Entries of
a slot past its owner's pages keep a previous owner's page ids: attention reads only the
pages that hold a row's cached tokens. `RowInputs` tells the step where each token and row
goes in that state, and which of its tokens' hidden states to score for prompt logprobs (a
fixed Q positions, see sampling.score_prompt).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence

import jax
import numpy as np

from ksana_jax.kv_cache import SINK_PAGE
from ksana_jax.request import Request
from ksana_jax.sampling import SamplingInputs
from ksana_jax.scheduler import ScheduledChunk, has_penalty
from ksana_jax.spec_decode import DRAFTED
from ksana_jax.step_inputs import StepInputs
from ksana_jax.structured import fill_bitmasks


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["slots", "indices", "pages"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class PageWrites:
    """Page-table entries to write on the device: page_table[slots[i], indices[i]] = pages[i]
    (padding: slot R, dropped)."""

    slots: jax.Array  # i32[D]
    indices: jax.Array  # i32[D]
    pages: jax.Array  # i32[D]

    @classmethod
    def padding(cls, width: int, num_slots: int) -> PageWrites:
        return cls(
            np.full(width, num_slots, np.int32),
            np.zeros(width, np.int32),
            np.full(width, SINK_PAGE, np.int32),
        )

    def apply(self, page_table: jax.Array) -> jax.Array:
        """Inside a jitted program: `page_table` i32[R, max_pages] with the entries written."""
        return page_table.at[self.slots, self.indices].set(self.pages, mode="drop")


def page_writes_width(num_tokens: int, num_seqs: int, page_size: int) -> int:
    """D, the page writes a (T, S) step carries: S + ceil(T / page_size), more than its rows
    gain for the tokens they schedule (a row of n new tokens gains ceil(n / page_size) pages
    at most past those of its cached tokens). A prefix-cache hit's pages, gained with no
    tokens scheduled, may not fit: they are written before the step (`PersistentBatch.prepare`)."""
    return num_seqs + -(-num_tokens // page_size)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "row_slots",
        "page_writes",
        "last_token_slots",
        "count_slots",
        "is_output",
        "reset_slots",
        "scored_token_slots",
        "scored_targets",
        "sample_token_slots",
        "sample_rows",
        "sample_offsets",
        "sample_has_draft",
        "samples_greedily",
    ],
    meta_fields=["context_pages", "sampled_positions", "drafts"],
)
@dataclasses.dataclass(frozen=True)
class RowInputs:
    """Where a step's tokens and rows live in the device's per-slot state (R slots; the index
    R means none)."""

    row_slots: jax.Array  # i32[S]  each row's slot (padding: the sink, R - 1)
    page_writes: PageWrites  # [D]  pages the rows gained since their last step
    last_token_slots: jax.Array  # i32[T]  the token is that slot's last sampled one (else R)
    count_slots: jax.Array  # i32[T]  counts the token into that slot's penalty counts (else R)
    is_output: jax.Array  # bool[T]  the token is an output token (else a prompt token)
    reset_slots: jax.Array  # i32[S]  zero that slot's penalty counts first (else R)
    scored_token_slots: jax.Array  # i32[Q]  prompt logprobs: token slots scored (padding: 0)
    scored_targets: jax.Array  # i32[Q]  the prompt token each one predicts (padding: -1)
    # Sampled positions (W = sample_width(T, S, k)), in use first: each row's last token and,
    # with speculative proposals, the token before each proposal.
    sample_token_slots: jax.Array  # i32[W]  token slot whose logits are sampled (padding: 0)
    sample_rows: jax.Array  # i32[W]  its row (padding: S)
    sample_offsets: jax.Array  # i32[W]  j: it samples the row's j-th new token (padding: 0)
    sample_has_draft: jax.Array  # bool[W]  a proposal follows it (the next token slot)
    # bool[]  the forward program samples the step itself, the argmax of every row (its rows
    # are SamplerPlan.GREEDY's, unconstrained, nothing scored): no sampling program follows
    samples_greedily: jax.Array
    context_pages: int  # static: P, the page-table columns the step reads (its context bucket)
    # static: the sampled positions the LM head and the sampler run over, the first of W:
    # min(T, S), unless the step's proposals need more (`sampled_positions`)
    sampled_positions: int
    drafts: bool  # static: some row's proposals are a draft model's to fill in (draft.py)


def sample_width(num_tokens: int, num_seqs: int, num_speculative: int) -> int:
    """W, the sampled positions of a (T, S) step: each row's last token plus up to k
    proposals' positions, never more than T."""
    return min(num_tokens, num_seqs * (1 + num_speculative))


def sampled_positions(num_tokens: int, num_seqs: int, width: int, used: int) -> int:
    """The sampled positions a (T, S) step of W runs the LM head and sampler over, `used` of
    them in use: min(T, S) (no more than a step without proposals pays for) unless more are
    in use, then all W. The host knows it, so the programs hold no conditional on it (a GPU
    would copy the predicate to the host, waiting for the work queued before it)."""
    base = min(num_tokens, num_seqs, width)
    return width if used > base else base


def suppressed_ids(params, eos_ids: Sequence[int]) -> list[int]:
    """Token ids a request may not sample before it has min_tokens outputs."""
    ids = [*params.stop_token_ids, *([] if params.ignore_eos else eos_ids)]
    return list(dict.fromkeys(ids))


class PersistentBatch:
    """Host rows of the running requests' per-slot state; builds each step's inputs."""

    def __init__(
        self,
        num_slots: int,
        max_pages_per_seq: int,
        page_size: int,
        max_suppressed: int,
        eos_ids: Sequence[int],
        max_logit_bias: int = 1,
        num_scored: int = 1,
        vocab_size: int = 32,
    ):
        self.num_slots = num_slots  # R, the sink included
        self.sink = num_slots - 1
        self.page_size = page_size
        self.eos_ids = tuple(eos_ids)
        self.num_scored = num_scored  # Q
        self.mask_words = -(-vocab_size // 32)  # W: a token bitmask's int32 words
        self._owner: list[tuple[Request, int] | None] = [None] * num_slots
        self._num_pages = np.zeros(num_slots, np.int64)  # page-table entries written
        self.page_table = np.full((num_slots, max_pages_per_seq), SINK_PAGE, np.int32)
        self.temperature = np.zeros(num_slots, np.float32)
        self.top_k = np.zeros(num_slots, np.int32)
        self.top_p = np.ones(num_slots, np.float32)
        self.min_p = np.zeros(num_slots, np.float32)
        self.repetition_penalty = np.ones(num_slots, np.float32)
        self.presence_penalty = np.zeros(num_slots, np.float32)
        self.frequency_penalty = np.zeros(num_slots, np.float32)
        self.seeds = np.zeros(num_slots, np.uint32)
        self.num_prompt_tokens = np.zeros(num_slots, np.int32)
        self.min_tokens = np.zeros(num_slots, np.int32)
        self.suppressed = np.full((num_slots, max_suppressed), -1, np.int32)
        self.num_logprobs = np.full(num_slots, -1, np.int32)
        self.penalized = np.zeros(num_slots, bool)
        self.bias_ids = np.full((num_slots, max_logit_bias), -1, np.int32)
        self.bias_values = np.zeros((num_slots, max_logit_bias), np.float32)

    def _join(self, slot: int, request: Request) -> None:
        """Writes the row of a request that has just taken `slot`."""
        p = request.params
        self._owner[slot] = (request, request.num_preemptions)
        self.page_table[slot, : self._num_pages[slot]] = SINK_PAGE  # the previous owner's
        self._num_pages[slot] = 0
        self.temperature[slot] = p.temperature
        self.top_k[slot] = p.top_k
        self.top_p[slot] = p.top_p
        self.min_p[slot] = p.min_p
        self.repetition_penalty[slot] = p.repetition_penalty
        self.presence_penalty[slot] = p.presence_penalty
        self.frequency_penalty[slot] = p.frequency_penalty
        self.penalized[slot] = has_penalty(p)
        self.seeds[slot] = request.seed
        self.num_prompt_tokens[slot] = len(request.prompt_token_ids)
        self.min_tokens[slot] = p.min_tokens
        banned = suppressed_ids(p, self.eos_ids) if p.min_tokens else []
        self.suppressed[slot] = -1
        self.suppressed[slot, : len(banned)] = banned
        self.num_logprobs[slot] = -1 if p.logprobs is None else p.logprobs
        bias = p.logit_bias or {}
        self.bias_ids[slot] = -1
        self.bias_ids[slot, : len(bias)] = list(bias)
        self.bias_values[slot] = 0
        self.bias_values[slot, : len(bias)] = list(bias.values())

    def _sync(self, request: Request, writes: list[tuple[int, int, list[int]]]) -> int:
        """Brings the request's row up to date (join, new pages: appended to `writes` as
        (slot, first index, pages) for the device's copy); returns its slot."""
        slot = request.slot
        assert 0 <= slot < self.sink, f"request {request.request_id} holds no slot ({slot})"
        owner = self._owner[slot]
        if owner is None or owner[0] is not request or owner[1] != request.num_preemptions:
            self._join(slot, request)
        done = self._num_pages[slot]
        if len(request.page_ids) > done:
            new = request.page_ids[done:]
            self.page_table[slot, done : done + len(new)] = new
            self._num_pages[slot] = len(request.page_ids)
            writes.append((slot, int(done), new))
        return slot

    def _page_writes(
        self, writes: list[tuple[int, int, list[int]]], width: int
    ) -> tuple[PageWrites, list[PageWrites]]:
        """`writes` as the step's PageWrites of `width`, and those that do not fit in pieces
        of max_pages_per_seq, to write before it."""
        step = PageWrites.padding(width, self.num_slots)
        if not writes:
            return step, []
        counts = [len(pages) for _, _, pages in writes]
        slots = np.repeat(np.array([slot for slot, _, _ in writes], np.int32), counts)
        indices = np.concatenate(
            [np.arange(first, first + len(pages), dtype=np.int32) for _, first, pages in writes]
        )
        pages = np.concatenate([np.asarray(pages, np.int32) for _, _, pages in writes])
        most = self.page_table.shape[1]
        pieces = [(0, width), *((lo, most) for lo in range(width, len(pages), most))]
        parts = []
        for lo, size in pieces:
            part = step if lo == 0 else PageWrites.padding(size, self.num_slots)
            n = min(size, len(pages) - lo)
            part.slots[:n] = slots[lo : lo + n]
            part.indices[:n] = indices[lo : lo + n]
            part.pages[:n] = pages[lo : lo + n]
            parts.append(part)
        return step, parts[1:]

    def prepare(
        self,
        chunks: Sequence[ScheduledChunk],
        num_tokens: int,
        num_seqs: int,
        pages: int,
        num_positions: int,
    ) -> tuple[StepInputs, SamplingInputs, RowInputs, list[PageWrites]]:
        """The inputs of a step of bucket shape (T, S, P pages, W sampled positions) running
        `chunks`, and the page writes to run before it, if its rows gained more pages than
        it carries (page_writes_width); SamplingInputs has one row per sampled position.
        StepInputs.page_table is None: the step reads the device's."""
        n = len(chunks)
        ps = self.page_size
        writes: list[tuple[int, int, list[int]]] = []
        slots = np.full(num_seqs, self.sink, np.int32)
        slots[:n] = [self._sync(c.request, writes) for c in chunks]
        starts = np.fromiter((c.start for c in chunks), np.int32, n)
        lens = np.fromiter((c.num_tokens for c in chunks), np.int32, n)
        # A chunk's tokens are known but for a placeholder at its end (a decode row continuing
        # from a step still in flight): read from the device, 0 here.
        token_lists = [c.token_ids for c in chunks]
        known = np.fromiter((len(t) for t in token_lists), np.int32, n)
        total = int(lens.sum())
        if total > num_tokens or n > num_seqs:
            raise ValueError(
                f"{total} tokens in {n} sequences do not fit the bucket "
                f"(T={num_tokens}, S={num_seqs})"
            )
        ends = np.cumsum(lens, dtype=np.int32)
        query_starts = np.full(num_seqs + 1, total, np.int32)
        query_starts[:n] = ends - lens
        token_rows = np.repeat(np.arange(n, dtype=np.int32), lens)
        token_slots = slots[token_rows]
        positions = np.zeros(num_tokens, np.int32)
        pos = starts[token_rows] + np.arange(total, dtype=np.int32) - query_starts[token_rows]
        positions[:total] = pos
        slot_ids = np.full(num_tokens, SINK_PAGE * ps, np.int32)
        slot_ids[:total] = self.page_table[token_slots, pos // ps] * ps + pos % ps
        token_ids = np.zeros(num_tokens, np.int32)
        flat = np.fromiter(itertools.chain.from_iterable(token_lists), np.int32, int(known.sum()))
        is_known = pos < (starts + known)[token_rows]
        token_ids[:total][is_known] = flat
        seq_lens = np.zeros(num_seqs, np.int32)
        seq_lens[:n] = starts + lens
        inputs = StepInputs(token_ids, positions, slot_ids, None, seq_lens, query_starts)
        page_writes, before = self._page_writes(writes, page_writes_width(num_tokens, num_seqs, ps))
        # Sampled positions: each chunk's last 1 + len(drafts) tokens, chunk after chunk.
        num_drafts = np.fromiter((len(c.draft_token_ids) for c in chunks), np.int32, n)
        used = int(num_drafts.sum()) + n
        assert used <= num_positions, (used, num_positions)
        pos_rows = np.repeat(np.arange(n, dtype=np.int32), num_drafts + 1)
        offsets = (
            np.arange(used, dtype=np.int32) - (np.cumsum(num_drafts + 1) - num_drafts - 1)[pos_rows]
        )
        sample_token_slots = np.zeros(num_positions, np.int32)
        sample_token_slots[:used] = ends[pos_rows] - 1 - num_drafts[pos_rows] + offsets
        sample_rows = np.full(num_positions, num_seqs, np.int32)
        sample_rows[:used] = pos_rows
        sample_offsets = np.zeros(num_positions, np.int32)
        sample_offsets[:used] = offsets
        has_draft = np.zeros(num_positions, bool)
        has_draft[:used] = offsets < num_drafts[pos_rows]
        sample_slots = np.full(num_positions, self.sink, np.int32)
        sample_slots[:used] = slots[pos_rows]
        # outputs before the sampled token: the noise index of the output it samples
        num_generated = np.zeros(num_positions, np.int32)
        num_generated[:used] = np.maximum(
            positions[sample_token_slots[:used]] + 1 - self.num_prompt_tokens[sample_slots[:used]],
            0,
        )
        none = self.num_slots  # "no slot" in RowInputs
        last_token_slots = np.full(num_tokens, none, np.int32)
        last_token_slots[:total] = np.where(is_known, none, token_slots)
        count_slots = np.full(num_tokens, none, np.int32)
        count_slots[:total] = np.where(self.penalized[token_slots], token_slots, none)
        is_output = np.zeros(num_tokens, bool)
        is_output[:total] = pos >= self.num_prompt_tokens[token_slots]
        reset_slots = np.full(num_seqs, none, np.int32)
        reset_slots[:n] = np.where((starts == 0) & self.penalized[slots[:n]], slots[:n], none)
        rows = RowInputs(
            slots,
            page_writes,
            last_token_slots,
            count_slots,
            is_output,
            reset_slots,
            *self._scored(chunks, query_starts),
            sample_token_slots,
            sample_rows,
            sample_offsets,
            has_draft,
            np.zeros((), bool),  # the runner decides (runner.samples_in_forward)
            pages,
            sampled_positions(num_tokens, num_seqs, num_positions, used),
            used > n and any(c.draft_token_ids[:1] == (DRAFTED,) for c in chunks),
        )
        return inputs, self._sampling(sample_slots, num_generated), rows, before

    def bitmasks(self, chunks: Sequence[ScheduledChunk], num_positions: int) -> np.ndarray:
        """SamplingInputs.token_bitmask i32[W, ceil(V / 32)] of a step `prepare` built: the
        grammar's allowed tokens at the sampled position of each constrained chunk that samples
        (such a row never carries proposals: the scheduler proposes none for it), all ones
        elsewhere (so any mix runs the same step). Called once the grammars have taken the
        previous step's tokens; a request that finished meanwhile is left unconstrained (its
        token is dropped)."""
        masks = np.full((num_positions, self.mask_words), -1, np.int32)
        first = 0  # each chunk's first sampled position
        constrained = []
        for c in chunks:
            request = c.request
            if c.samples and request.matcher is not None and not request.is_finished:
                constrained.append((request.matcher, first))
            first += 1 + len(c.draft_token_ids)
        if constrained:
            fill_bitmasks(constrained, masks)
        return masks

    def _scored(
        self, chunks: Sequence[ScheduledChunk], query_starts: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """RowInputs' scored_token_slots and scored_targets: each chunk's scored positions, in
        chunk order (the scheduler keeps them within Q)."""
        token_slots = np.zeros(self.num_scored, np.int32)
        targets = np.full(self.num_scored, -1, np.int32)
        done = 0
        for i, c in enumerate(chunks):
            k = c.num_scored
            if k:
                assert done + k <= self.num_scored, (done, k, self.num_scored)
                token_slots[done : done + k] = np.arange(k) + query_starts[i]
                targets[done : done + k] = c.request.prompt_token_ids[c.start + 1 : c.start + 1 + k]
                done += k
        return token_slots, targets

    def _sampling(self, slots: np.ndarray, num_generated: np.ndarray) -> SamplingInputs:
        """The step's rows of the per-slot sampling parameters; the token bitmask is filled
        apart (`bitmasks`), once the grammars are up to date."""
        suppressed = self.suppressed[slots]
        suppressed[num_generated >= self.min_tokens[slots]] = -1
        return SamplingInputs(
            temperature=self.temperature[slots],
            top_k=self.top_k[slots],
            top_p=self.top_p[slots],
            min_p=self.min_p[slots],
            repetition_penalty=self.repetition_penalty[slots],
            presence_penalty=self.presence_penalty[slots],
            frequency_penalty=self.frequency_penalty[slots],
            seeds=self.seeds[slots],
            num_generated=num_generated,
            num_prompt_tokens=self.num_prompt_tokens[slots],
            suppressed_ids=suppressed,
            num_logprobs=self.num_logprobs[slots],
            slots=slots,
            bias_ids=self.bias_ids[slots],
            bias_values=self.bias_values[slots],
            token_bitmask=None,
        )

    def padding(
        self, num_tokens: int, num_seqs: int, pages: int, num_positions: int
    ) -> tuple[StepInputs, SamplingInputs, RowInputs]:
        """Inputs of a (T, S, P pages, W positions) step holding padding only."""
        return self.prepare([], num_tokens, num_seqs, pages, num_positions)[:3]


# A step's host inputs travel as two flat buffers (int32 and float32) rather than ~25 small
# arrays: each array put on the device costs the host tens of microseconds.
PackLayout = tuple  # (treedef, ((buffer, shape, dtype), ...)): static, hashable


def pack(trees) -> tuple[tuple[np.ndarray, np.ndarray], PackLayout]:
    """Host arrays -> (i32 buffer, f32 buffer) and the static layout `unpack` reads."""
    leaves, treedef = jax.tree.flatten(trees)
    is_float = [leaf.dtype == np.float32 for leaf in leaves]
    entries = tuple(
        (int(f), leaf.shape, leaf.dtype) for f, leaf in zip(is_float, leaves, strict=True)
    )
    # uint32 and bool ride in the int32 buffer: a wrapping (unsafe) cast keeps their bits
    ints = [leaf.ravel() for f, leaf in zip(is_float, leaves, strict=True) if not f]
    floats = [leaf.ravel() for f, leaf in zip(is_float, leaves, strict=True) if f]
    buffers = (
        np.concatenate(ints, dtype=np.int32, casting="unsafe") if ints else np.zeros(0, np.int32),
        np.concatenate(floats, dtype=np.float32) if floats else np.zeros(0, np.float32),
    )
    return buffers, (treedef, entries)


def unpack(buffers, layout: PackLayout):
    """Inside the jitted step: the trees `pack` flattened, as device arrays."""
    import jax.numpy as jnp

    treedef, entries = layout
    offsets = [0, 0]
    leaves = []
    for which, shape, dtype in entries:
        size = int(np.prod(shape, dtype=np.int64))
        flat = buffers[which][offsets[which] : offsets[which] + size]
        offsets[which] += size
        if dtype == np.uint32:
            flat = jax.lax.bitcast_convert_type(flat, jnp.uint32)
        elif dtype == np.bool_:
            flat = flat != 0
        leaves.append(flat.reshape(shape))
    return jax.tree.unflatten(treedef, leaves)

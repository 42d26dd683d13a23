"""Continuous batching: which requests run in the next step and how many tokens each.

Host side, no jax. Each step has two budgets, `max_num_seqs` rows and
`max_num_batched_tokens` tokens. Running requests go first (a decode token each, or the
next chunk of a prefill in progress), then waiting requests start their prefill in chunks
that fit the remaining token budget (chunked prefill). Order is `(priority, arrival)`:
lower priority values first, then first come first served.

Pages are allocated as a chunk needs them. When none are left, the newest lowest-priority
running request is preempted: its pages are freed and it goes back to waiting, to be
recomputed from its prompt plus what it has generated (its outputs are kept). Abort frees
everything a request holds, whatever its state.

Prefix cache (when the PageManager has one): a request starting from waiting first takes the
longest cached run of its leading full pages (shared by refcount) and computes only the
rest -- always at least its last token, whose logits the step samples. A page enters the
cache once all its tokens' K/V are computed: for running requests at the start of each
`schedule()` (after the engine has counted the previous step), and on release (finish,
abort, preemption), before the page is freed. So a page is never found while it is still
being written, a chunk cut mid-page is never cached, and generated tokens are cached too
(a follow-up turn or a preempted request finds its own pages again).

The scheduler owns request state. `schedule()` advances each scheduled request's
`num_computed_tokens` by its chunk and, for a chunk that samples, counts a placeholder for
the token being sampled; `update_from_output()` replaces the placeholders with the step's
sampled tokens, ends requests at a stop token, EOS or max_tokens, frees their pages, and
starts the other samples of an n > 1 request once the first has computed the prompt. With
async scheduling the engine schedules step N+1 before step N's tokens are known: a decode
chunk may then continue from a placeholder (the device feeds it), a request that step N
finishes may have run one step more (its token is discarded: `update_from_output` skips
finished requests), and a request whose max_tokens are all scheduled is not run again.
Each running request holds a slot of the persistent batch (`Request.slot`, in
[0, max_num_seqs)), so at most max_num_seqs requests run.

Speculative decoding (spec_decode.py): with a Speculator, `schedule()` asks it for proposals
for the running decode rows, and runs such a row as its last token plus its proposals (cut to
the token budget and to max_tokens: a step never adds more tokens than max_tokens allows);
`update_from_output()` keeps the proposals up to the first the target rejected, plus the
target's token there, and rolls num_computed_tokens back over the rejected ones (their K/V
slots are overwritten by later steps; a page is cached only once its tokens are known).

Prompt logprobs: a request that asks for them (its first sample, until its prompt is
computed) has each prompt position scored as its chunk computes it (`ScheduledChunk.
num_scored`), under a third budget, `max_num_scored_tokens` positions a step (a fixed shape
of the step), which may cut its chunks smaller. It skips the prefix cache lookup: a cached
page's positions would have no logits, so it recomputes its whole prompt (as vLLM does); its
pages still enter the cache for others.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import logging
from collections.abc import Sequence

from ksana_jax.page_manager import PageManager
from ksana_jax.prefix_cache import page_hash, root_hash
from ksana_jax.request import Request, RequestStatus
from ksana_jax.sampling_params import SamplingParams
from ksana_jax.spec_decode import Speculator

log = logging.getLogger("ksana_jax.scheduler")


def scores_prompt(request: Request) -> bool:
    """The request's next chunks must score their prompt positions: it asks for prompt
    logprobs (only the first of n samples computes them), and has no output yet."""
    return (
        request.params.prompt_logprobs is not None
        and request.index == 0
        and request.num_output_tokens == 0
    )


def has_penalty(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


@dataclasses.dataclass(frozen=True)
class ScheduledChunk:
    """`num_tokens` of `request`'s tokens from position `start` run this step; `samples`:
    the chunk reaches the request's last token, so its logits are sampled; `num_scored`:
    its first positions whose logprobs of the next prompt token are computed (prompt
    logprobs: positions start .. start + num_scored - 1); `draft_token_ids`: speculative
    proposals after the request's last token, the chunk's last tokens (spec_decode.py).

    The step samples the chunk's last 1 + len(draft_token_ids) positions (`num_positions`),
    chunk after chunk: the target's token after the last known token and after each draft."""

    request: Request
    start: int
    num_tokens: int
    samples: bool
    num_scored: int = 0
    draft_token_ids: tuple[int, ...] = ()

    @property
    def token_ids(self) -> list[int]:
        """The chunk's tokens known to the host (a placeholder at its end is not), drafts
        included."""
        end = self.start + self.num_tokens - len(self.draft_token_ids)
        return self.request.token_ids(self.start, end) + list(self.draft_token_ids)

    @property
    def num_positions(self) -> int:
        return 1 + len(self.draft_token_ids)


@dataclasses.dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    preempted: list[Request]
    # Prefix cache, in tokens, over the requests started this step for the first time (not
    # resumed after preemption): prompt tokens looked up, and those found cached.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_drafts(self) -> int:
        return sum(len(c.draft_token_ids) for c in self.chunks)


class Scheduler:
    def __init__(
        self,
        pages: PageManager,
        page_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        eos_token_ids: Sequence[int] = (),
        max_num_scored_tokens: int | None = None,
        speculator: Speculator | None = None,
    ):
        self.pages = pages
        self.cache = pages.cache
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_scored_tokens = max_num_scored_tokens or max_num_batched_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.speculator = speculator
        self.waiting: list[Request] = []  # sorted by sort_key
        self.running: list[Request] = []  # sorted by sort_key
        self._free_slots = list(range(max_num_seqs))  # a heap: lowest slot first
        # n > 1 with the prefix cache: samples that start once the first computed the prompt.
        self._after_prompt: dict[str, list[Request]] = {}

    def add(self, request: Request, after_prompt: Sequence[Request] = ()) -> None:
        """Queues a request; `after_prompt` (its siblings) are queued once it has sampled its
        first token, so they find its prompt's pages in the prefix cache."""
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)
        if after_prompt:
            self._after_prompt[request.request_id] = list(after_prompt)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: str) -> None:
        """Ends a request (stop, length or abort) and frees its pages."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._after_prompt.pop(request.request_id, None)

    def update_from_output(
        self,
        scheduled: SchedulerOutput,
        token_ids: Sequence[int],
        proposals: Sequence[int] | None = None,
    ) -> list[tuple[int, Request, int]]:
        """Applies a step's sampled tokens (`token_ids`: each chunk's num_positions, chunk
        after chunk). A sampling chunk whose request is not finished keeps its drafts up to the
        first the target disagrees with, plus the target's token there (rolling
        num_computed_tokens back over the rejected ones), and gets those tokens one by one
        until a stop token id, EOS (past min_tokens) or max_tokens ends it. Returns (position
        of its first token, request, tokens added) for each request that got tokens; a
        finished request's tokens are discarded (async scheduling ran it once more).
        `proposals` (like token_ids): a draft model's, filled in on the device where the
        chunk's drafts are spec_decode.DRAFTED."""
        advanced = []
        end = 0
        token_ids = _ints(token_ids)  # once: a numpy slice per row costs more than a row's work
        proposals = None if proposals is None else _ints(proposals)
        for chunk in scheduled.chunks:
            first = end
            end += chunk.num_positions
            request = chunk.request
            if not chunk.samples or request.is_finished:
                continue
            request.num_placeholders -= 1
            drafts = chunk.draft_token_ids
            if proposals is not None and drafts:
                drafts = proposals[first : first + len(drafts)]
            new = token_ids[first:end]
            num_accepted = 0
            while num_accepted < len(drafts) and new[num_accepted] == drafts[num_accepted]:
                num_accepted += 1
            if drafts:  # the rejected drafts' K/V are overwritten by the next steps
                request.num_computed_tokens -= len(drafts) - num_accepted
                self.speculator.record(request, len(drafts), num_accepted)
            added = 0
            for token in new[: num_accepted + 1]:
                added += 1
                if self._append(request, token):
                    break
            advanced.append((first, request, added))
        return advanced

    def _append(self, request: Request, token: int) -> bool:
        """Appends one output token; True if it ends the request."""
        request.output_token_ids.append(token)
        if len(request.output_token_ids) == 1:  # the prompt is computed
            for sibling in self._after_prompt.pop(request.request_id, ()):
                self.add(sibling)
        params = request.params
        num_out = len(request.output_token_ids)
        can_stop = num_out > params.min_tokens or num_out == params.max_tokens
        is_eos = token in self.eos_token_ids and not params.ignore_eos
        if can_stop and (is_eos or token in params.stop_token_ids):
            request.stopped_on_token = True
            request.stop_reason = None if is_eos else token  # vLLM's: EOS names no reason
            self.finish(request, "stop")
        elif request.matcher is not None and _grammar_ends(request, token):
            self.finish(request, "stop")
        elif num_out >= params.max_tokens:
            self.finish(request, "length")
        return request.is_finished

    def schedule(self) -> SchedulerOutput:
        for request in self.running:
            self._cache_computed_pages(request)
        budget = self.max_num_batched_tokens
        scored_budget = self.max_num_scored_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
        out = SchedulerOutput(chunks, preempted)
        drafts = (
            self.speculator.propose(self.running, len(self.running))
            if self.speculator is not None
            else {}
        )
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if request.num_output_tokens >= request.params.max_tokens:
                continue  # every token it may have is scheduled: it ends with its last one
            if budget == 0 or len(chunks) == self.max_num_seqs:
                break
            n = _fit_scored(
                request,
                min(request.num_tokens - request.num_computed_tokens, budget),
                scored_budget,
            )
            if n == 0:
                continue  # its prompt positions wait for the next step's scored budget
            # proposals fit the budget and max_tokens (the step adds up to 1 + len(draft))
            room = min(budget - n, request.params.max_tokens - request.num_output_tokens - 1)
            draft = tuple(drafts.get(request, ())[: max(room, 0)])
            n += len(draft)
            while not self._reserve_pages(request, request.num_computed_tokens + n):
                victim = max(self.running, key=lambda r: r.sort_key)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                chunks.append(self._chunk(request, n, draft))
                budget -= n
                scored_budget -= chunks[-1].num_scored
        # Start (or resume) waiting requests only when nothing had to be preempted.
        while (
            self.waiting
            and not preempted
            and budget
            and len(chunks) < self.max_num_seqs
            and len(self.running) < self.max_num_seqs
        ):
            request = self.waiting[0]
            n = self._admit(request, budget, scored_budget)
            if n == 0:
                break
            self.waiting.pop(0)
            request.status = RequestStatus.RUNNING
            request.slot = heapq.heappop(self._free_slots)
            bisect.insort(self.running, request, key=lambda r: r.sort_key)
            if self.cache is not None and not request.num_preemptions:
                out.prefix_cache_queries += request.num_tokens
                out.prefix_cache_hits += request.num_computed_tokens
            chunks.append(self._chunk(request, n))
            budget -= n
            scored_budget -= chunks[-1].num_scored
        for chunk in chunks:  # the step computes them; a sampling one adds a (future) token
            chunk.request.num_computed_tokens += chunk.num_tokens
            chunk.request.num_placeholders += chunk.samples
        return out

    @staticmethod
    def _chunk(request: Request, n: int, draft: tuple[int, ...] = ()) -> ScheduledChunk:
        assert n > 0 and not (request.num_placeholders and n > 1), (n, request.num_placeholders)
        start = request.num_computed_tokens
        num_scored = 0
        if scores_prompt(request):
            num_scored = max(0, min(start + n, len(request.prompt_token_ids) - 1) - start)
        samples = start + n == request.num_tokens + len(draft)
        return ScheduledChunk(request, start, n, samples, num_scored, draft)

    def _admit(self, request: Request, budget: int, scored_budget: int) -> int:
        """Gives a waiting request its cached prefix and the pages of its first chunk.

        Returns the chunk's size, or 0 if pages are short: then the request holds nothing,
        and its cached pages are back in the cache, now the most recently released.
        """
        assert not request.num_placeholders, "a request waits until its tokens are known"
        # Penalty counts are built from the tokens a request computes, so a request with a
        # penalty computes them all (batch.py), and so does one scoring its prompt (its
        # positions need logits); both still fill the cache for others.
        if (
            self.cache is not None
            and not has_penalty(request.params)
            and not scores_prompt(request)
        ):
            max_pages = (request.num_tokens - 1) // self.page_size  # the last token computes
            page_ids, hashes = self.cache.lookup(
                request.all_token_ids, max_pages, request.cache_salt
            )
            self.pages.share(page_ids)
            request.page_ids, request.page_hashes = page_ids, hashes
            request.num_computed_tokens = len(page_ids) * self.page_size
        n = _fit_scored(
            request, min(request.num_tokens - request.num_computed_tokens, budget), scored_budget
        )
        if n == 0 or not self._reserve_pages(request, request.num_computed_tokens + n):
            self._release(request)
            return 0
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = request.num_computed_tokens
        return n

    def _reserve_pages(self, request: Request, num_tokens: int) -> bool:
        """Makes the request hold pages for `num_tokens` tokens; False if none are left."""
        need = -(-num_tokens // self.page_size) - len(request.page_ids)
        if need <= 0:
            return True
        if not self.pages.can_allocate(need):
            return False
        request.page_ids += self.pages.allocate(need)
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.num_preemptions += 1
        self.add(request)

    def _release(self, request: Request) -> None:
        self._cache_computed_pages(request)
        # Last page first: parked pages are evicted oldest first, so a cached sequence is
        # evicted from its end, and the leading pages other prompts share stay longest.
        self.pages.free(reversed(request.page_ids))
        request.page_ids = []
        request.page_hashes = []
        request.num_computed_tokens = 0
        if request.slot >= 0:
            heapq.heappush(self._free_slots, request.slot)
            request.slot = -1

    def _cache_computed_pages(self, request: Request) -> None:
        """Names each of the request's pages whose tokens are all computed (and known: not a
        placeholder) in the cache."""
        num_full = min(request.num_computed_tokens, request.num_known_tokens) // self.page_size
        if self.cache is None or len(request.page_hashes) >= num_full:
            return
        token_ids = request.all_token_ids
        hashes = request.page_hashes
        for i in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else root_hash(request.cache_salt)
            hashes.append(
                page_hash(parent, token_ids[i * self.page_size : (i + 1) * self.page_size])
            )
            self.cache.insert(request.page_ids[i], hashes[-1])


def _grammar_ends(request: Request, token: int) -> bool:
    """Advances the request's grammar by its new token: True once the grammar has ended
    (nothing may follow). The step's mask allowed only the grammar's tokens, so a refused
    one is a bug: logged, and the request ends there."""
    if not request.matcher.accept(token):
        log.error(
            "request %s: token %d refused by its grammar: %s",
            request.request_id,
            token,
            request.matcher.error,
        )
        return True
    return request.matcher.is_terminated


def _fit_scored(request: Request, n: int, scored_budget: int) -> int:
    """`n` tokens of the request's next chunk, cut so that it scores at most `scored_budget`
    prompt positions (0: it must wait)."""
    if not scores_prompt(request):
        return n
    to_score = len(request.prompt_token_ids) - 1 - request.num_computed_tokens
    return n if to_score <= scored_budget else min(n, scored_budget)


def _ints(values: Sequence[int]) -> list[int]:
    """A step's sampled token ids (numpy, or a list) as a list of Python ints."""
    return values.tolist() if hasattr(values, "tolist") else [int(v) for v in values]

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
"""

from __future__ import annotations

import bisect
import dataclasses

from ksana_jax.page_manager import PageManager
from ksana_jax.prefix_cache import page_hash, root_hash
from ksana_jax.request import Request, RequestStatus


@dataclasses.dataclass(frozen=True)
class ScheduledChunk:
    """`num_tokens` of `request`'s known tokens from position `start` run this step."""

    request: Request
    start: int
    num_tokens: int

    @property
    def token_ids(self) -> list[int]:
        return self.request.all_token_ids[self.start : self.start + self.num_tokens]

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the last known token, so its logits are sampled."""
        return self.start + self.num_tokens == self.request.num_tokens


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


class Scheduler:
    def __init__(
        self, pages: PageManager, page_size: int, max_num_seqs: int, max_num_batched_tokens: int
    ):
        self.pages = pages
        self.cache = pages.cache
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Request] = []  # sorted by sort_key
        self.running: list[Request] = []  # sorted by sort_key

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

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

    def schedule(self) -> SchedulerOutput:
        for request in self.running:
            self._cache_computed_pages(request)
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
        out = SchedulerOutput(chunks, preempted)
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if budget == 0 or len(chunks) == self.max_num_seqs:
                break
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self._reserve_pages(request, request.num_computed_tokens + n):
                victim = max(self.running, key=lambda r: r.sort_key)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                chunks.append(ScheduledChunk(request, request.num_computed_tokens, n))
                budget -= n
        # Start (or resume) waiting requests only when nothing had to be preempted.
        while self.waiting and not preempted and budget and len(chunks) < self.max_num_seqs:
            request = self.waiting[0]
            n = self._admit(request, budget)
            if n == 0:
                break
            self.waiting.pop(0)
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=lambda r: r.sort_key)
            chunks.append(ScheduledChunk(request, request.num_computed_tokens, n))
            budget -= n
            if self.cache is not None and not request.num_preemptions:
                out.prefix_cache_queries += request.num_tokens
                out.prefix_cache_hits += request.num_computed_tokens
        return out

    def _admit(self, request: Request, budget: int) -> int:
        """Gives a waiting request its cached prefix and the pages of its first chunk.

        Returns the chunk's size, or 0 if pages are short: then the request holds nothing,
        and its cached pages are back in the cache, now the most recently released.
        """
        if self.cache is not None:
            max_pages = (request.num_tokens - 1) // self.page_size  # the last token computes
            page_ids, hashes = self.cache.lookup(
                request.all_token_ids, max_pages, request.cache_salt
            )
            self.pages.share(page_ids)
            request.page_ids, request.page_hashes = page_ids, hashes
            request.num_computed_tokens = len(page_ids) * self.page_size
        n = min(request.num_tokens - request.num_computed_tokens, budget)
        if not self._reserve_pages(request, request.num_computed_tokens + n):
            self._release(request)
            return 0
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

    def _cache_computed_pages(self, request: Request) -> None:
        """Names each of the request's pages whose tokens are all computed in the cache."""
        num_full = request.num_computed_tokens // self.page_size
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

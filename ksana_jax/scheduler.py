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
"""

from __future__ import annotations

import bisect
import dataclasses

from ksana_jax.page_manager import PageManager
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

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(
        self, pages: PageManager, page_size: int, max_num_seqs: int, max_num_batched_tokens: int
    ):
        self.pages = pages
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
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
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
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._reserve_pages(request, request.num_computed_tokens + n):
                break
            self.waiting.pop(0)
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=lambda r: r.sort_key)
            chunks.append(ScheduledChunk(request, request.num_computed_tokens, n))
            budget -= n
        return SchedulerOutput(chunks, preempted)

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
        self.pages.free(request.page_ids)
        request.page_ids = []
        request.num_computed_tokens = 0

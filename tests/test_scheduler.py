"""Page manager and scheduler (host side): property-based state machines plus unit tests.

The state machines drive `PageManager` and `Scheduler` through random add / step / abort /
finish sequences with a fake device that follows the engine's protocol (`LLMEngine.step` and
`_postprocess`): after `schedule()`, each chunk advances `num_computed_tokens` by its size and a
chunk that reaches the last known token appends one sampled token; a request finishes through
`scheduler.finish` ("length" at `max_tokens`, "stop" at a drawn point, "abort" at any time).
The fake device also keeps a fake KV cache: every chunk writes into the request's pages a
fingerprint of each position's token and all tokens before it (what real K/V depend on), then
reads back every position it attends to, so a page handed to two requests at once, freed while
still in use, or found in the prefix cache for the wrong prefix shows up as a wrong value.
A second scheduler machine runs with a prefix cache, on prompts that reuse earlier requests'
tokens, with an outsider that forces evictions.
"""

from __future__ import annotations

import collections
import itertools
import sys

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from ksana_jax.kv_cache import SINK_PAGE
from ksana_jax.page_manager import PageManager
from ksana_jax.prefix_cache import PrefixCache, page_hash, page_hashes, root_hash
from ksana_jax.request import Request, RequestStatus
from ksana_jax.sampling_params import SamplingParams
from ksana_jax.scheduler import Scheduler, SchedulerOutput

MACHINE_SETTINGS = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def contains(items, request) -> bool:
    """Identity membership (`Request` is a dataclass, so `in` compares fields)."""
    return any(r is request for r in items)


def make_request(arrival: int, prompt_len: int, max_tokens: int = 16, priority: int = 0) -> Request:
    return Request(
        request_id=f"r{arrival}",
        prompt_token_ids=[1000 * arrival + i for i in range(prompt_len)],
        params=SamplingParams(max_tokens=max_tokens),
        seed=0,
        priority=priority,
        arrival=arrival,
    )


def sampled_token(request: Request, index: int | None = None) -> int:
    """What the fake device samples: depends only on the request and the output's index
    (by default the next one)."""
    index = len(request.output_token_ids) if index is None else index
    return 10**6 + 1000 * request.arrival + index


def device_tokens(request: Request) -> list[int]:
    """The request's tokens as the fake device knows them: the known ones, then those still
    placeholders on the host (sampled by a step whose output is not applied yet)."""
    n = len(request.output_token_ids)
    pending = [sampled_token(request, n + k) for k in range(request.num_placeholders)]
    return request.all_token_ids + pending


def fingerprints(request: Request) -> list[int]:
    """What the fake device stores for each position: like real K/V, it depends on the token
    there, every token before it, and the cache salt."""
    chain = itertools.accumulate(
        device_tokens(request), lambda fp, t: hash((fp, t)), initial=hash(request.cache_salt)
    )
    return list(chain)[1:]


def check_pool(pages: PageManager, owners: list[list[int]]) -> None:
    """Refcounts equal owners; the refcount-0 pages are exactly the free list plus the cache's
    parked pages, never both; free pages have no hash, parked ones do; sink unused."""
    counts = collections.Counter(p for page_ids in owners for p in page_ids)
    assert SINK_PAGE not in counts, "the sink page was handed out"
    assert pages.refcounts[SINK_PAGE] == 0
    for p in range(pages.num_pages):
        assert pages.refcounts[p] == counts[p], (p, pages.refcounts[p], counts[p])
    free = list(pages._free)
    parked = list(pages.cache._lru) if pages.cache else []
    assert len(free + parked) == len(set(free + parked)), f"free twice: {free} {parked}"
    assert sorted(free + parked) == [
        p for p in range(pages.num_pages) if p != SINK_PAGE and pages.refcounts[p] == 0
    ]
    if pages.cache:
        assert not any(pages.cache.holds(p) for p in free), "a page is both free and cached"
        assert all(pages.cache.holds(p) for p in parked)
        hashes = pages.cache._hash_of
        assert {h: p for p, h in hashes.items()} == pages.cache._page_of, "not one-to-one"
        assert SINK_PAGE not in hashes
    used = sum(1 for c in pages.refcounts if c > 0)
    assert pages.num_free + used == pages.num_usable == pages.num_pages - 1
    assert pages.num_used == used


# --------------------------------------------------------------------------- page manager


class PageManagerMachine(RuleBasedStateMachine):
    """Owners allocate, share and free pages; refcounts must always equal the references."""

    def __init__(self):
        super().__init__()
        self.pages: PageManager | None = None
        self.owners: list[list[int]] = []

    @initialize(num_pages=st.integers(2, 24))
    def configure(self, num_pages):
        self.pages = PageManager(num_pages)

    @rule(n=st.integers(0, 10))
    def allocate(self, n):
        free_before = self.pages.num_free
        plain_free_before = len(self.pages._free)
        cache = self.pages.cache
        evictions_before = cache.num_evictions if cache else 0
        assert self.pages.can_allocate(n) == (n <= free_before)
        if n > free_before:
            with pytest.raises(RuntimeError):
                self.pages.allocate(n)
            assert self.pages.num_free == free_before
            return
        got = self.pages.allocate(n)
        assert len(got) == len(set(got)) == n
        assert all(self.pages.refcounts[p] == 1 for p in got)
        if cache:  # parked pages are taken only once no plain free page is left
            assert cache.num_evictions - evictions_before == max(0, n - plain_free_before)
            assert not any(cache.holds(p) for p in got)
        self.owners.append(got)

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def share(self, data):
        i = data.draw(st.integers(0, len(self.owners) - 1), label="owner")
        page_ids = list(self.owners[i])
        self.pages.share(page_ids)
        self.owners.append(page_ids)

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def free(self, data):
        i = data.draw(st.integers(0, len(self.owners) - 1), label="owner")
        page_ids = self.owners.pop(i)
        self.pages.free(page_ids)

    @invariant()
    def pool_consistent(self):
        if self.pages is not None:
            check_pool(self.pages, self.owners)

    def teardown(self):
        if self.pages is None or sys.exc_info()[1] is not None:
            return
        while self.owners:
            self.pages.free(self.owners.pop())
        check_pool(self.pages, [])
        assert self.pages.num_free == self.pages.num_usable


def test_page_manager_state_machine():
    run_state_machine_as_test(PageManagerMachine, settings=MACHINE_SETTINGS)


class CachingPageManagerMachine(PageManagerMachine):
    """The same with a prefix cache: owners name their pages with hashes, a named page whose
    last owner frees it is parked, later owners hit named pages (parked or in use), and
    allocation evicts parked pages, least recently released first, only when it must."""

    @initialize(num_pages=st.integers(2, 24))
    def configure(self, num_pages):
        self.pages = PageManager(num_pages, PrefixCache(page_size=1))
        self.names = itertools.count()

    @precondition(lambda self: any(self.owners))
    @rule(data=st.data())
    def name(self, data):
        page = data.draw(st.sampled_from([p for o in self.owners for p in o]), label="page")
        named = self.pages.cache.holds(page)
        assert self.pages.cache.insert(page, next(self.names).to_bytes(8)) is not named

    @precondition(lambda self: self.pages is not None and len(self.pages.cache))
    @rule(data=st.data())
    def hit(self, data):
        _, page = data.draw(st.sampled_from(self.pages.cache.items()), label="hit")
        self.pages.share([page])
        self.owners.append([page])

    @precondition(lambda self: self.pages is not None and self.pages.cache.num_parked)
    @rule()
    def take_everything(self):
        """Plain free pages go first, then parked ones in the order they were parked, each
        losing its hash."""
        plain = list(self.pages._free)
        parked = list(self.pages.cache._lru)
        taken = self.pages.allocate(self.pages.num_free)
        assert taken == plain + parked
        assert not any(self.pages.cache.holds(p) for p in taken)
        self.owners.append(taken)


def test_caching_page_manager_state_machine():
    run_state_machine_as_test(CachingPageManagerMachine, settings=MACHINE_SETTINGS)


# --------------------------------------------------------------------------- scheduler


STATS: collections.Counter = collections.Counter()


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / step / abort over a small pool, checked against the engine protocol.

    With `asynchronous`, the engine's async scheduling: a step's output is applied after the
    next step is scheduled (decode chunks then continue from placeholders, and a request
    that the late output finishes may have been scheduled once more)."""

    asynchronous = False

    def __init__(self):
        super().__init__()
        self.pending: SchedulerOutput | None = None  # scheduled, output not applied yet
        self.sched: Scheduler | None = None
        self.live: list[Request] = []  # added and not finished, in arrival order
        self.finished: list[Request] = []
        self.spec: dict[str, tuple[int, int | None]] = {}  # id -> (max_tokens, stop_at)
        self.expected_out: dict[str, list[int]] = {}
        self.kv: dict[int, list[int | None]] = {}  # the fake device's KV: page -> slots
        self.arrivals = 0

    # ---- rules

    @initialize(
        page_size=st.integers(2, 8),
        num_pages=st.integers(8, 40),
        max_num_seqs=st.integers(1, 8),
        max_num_batched_tokens=st.integers(1, 64),
    )
    def configure(self, page_size, num_pages, max_num_seqs, max_num_batched_tokens):
        self.page_size = page_size
        self.pages = self.make_pages(num_pages)
        self.sched = Scheduler(self.pages, page_size, max_num_seqs, max_num_batched_tokens)
        # A request never holds K/V for more than prompt + max_tokens - 1 tokens (the last
        # sampled token is not fed back), and that must fit the pool alone (liveness).
        self.capacity = self.pages.num_usable * page_size
        self.kv = {p: [None] * page_size for p in range(num_pages)}

    @rule(data=st.data(), priority=st.integers(0, 2))
    def add(self, data, priority):
        prompt_len = data.draw(st.integers(1, min(60, self.capacity)), label="prompt_len")
        self.submit(data, make_request(self.arrivals, prompt_len, priority=priority))

    def submit(self, data, request: Request) -> None:
        """Draws the request's length limits, then adds it to the scheduler."""
        prompt_len = len(request.prompt_token_ids)
        max_tokens = data.draw(
            st.integers(1, min(40, self.capacity - prompt_len + 1)), label="max_tokens"
        )
        stop_at = data.draw(st.none() | st.integers(1, max_tokens), label="stop_at")
        request.params = SamplingParams(max_tokens=max_tokens)
        self.arrivals += 1
        self.spec[request.request_id] = (max_tokens, stop_at)
        self.expected_out[request.request_id] = []
        self.sched.add(request)
        self.live.append(request)
        assert request.status is RequestStatus.WAITING

    @rule(times=st.integers(1, 4))
    def step(self, times):
        for _ in range(times):
            self.do_step()

    @precondition(lambda self: self.live)
    @rule(data=st.data(), prefer_preempted=st.booleans())
    def abort(self, data, prefer_preempted):
        preempted = [r for r in self.live if r.num_preemptions and contains(self.sched.waiting, r)]
        pool = preempted if prefer_preempted and preempted else self.live
        request = data.draw(st.sampled_from(pool), label="abort")
        if request.status is RequestStatus.RUNNING:
            event("abort running")
        elif request.num_preemptions:
            event("abort preempted")
            STATS["abort preempted"] += 1
        else:
            event("abort waiting")
        self.end(request, "abort")

    # ---- what the prefix-cache machine changes

    def make_pages(self, num_pages: int) -> PageManager:
        return PageManager(num_pages)

    def check_start(self, chunk, evicted: bool) -> None:
        """A request started from waiting: without a cache it computes from token 0."""
        assert chunk.start == 0

    def check_head_blocked(self, head: Request, budget_left: int) -> None:
        """Work conserving: the head of the queue stayed only because it needs more pages."""
        n = min(head.num_tokens - head.num_computed_tokens, budget_left)
        assert cdiv(n, self.page_size) > self.pages.num_free

    # ---- the engine protocol with a fake device

    def end(self, request: Request, reason: str) -> None:
        self.sched.finish(request, reason)
        self.retire(request, reason)

    def retire(self, request: Request, reason: str) -> None:
        assert request.status is RequestStatus.FINISHED
        assert request.finish_reason == reason
        assert request.page_ids == []
        assert not contains(self.sched.running, request)
        assert not contains(self.sched.waiting, request)
        self.live = [r for r in self.live if r is not request]
        self.finished.append(request)
        STATS[f"finish {reason}"] += 1

    def do_step(self) -> SchedulerOutput:
        sched = self.sched
        ps = self.page_size
        running_before = list(sched.running)
        waiting_before = list(sched.waiting)
        had_work = sched.has_unfinished()
        before = {
            r.request_id: (r.num_computed_tokens, list(r.output_token_ids)) for r in self.live
        }
        preemptions_before = {r.request_id: r.num_preemptions for r in self.live}
        cache = self.pages.cache
        evictions_before = cache.num_evictions if cache else 0

        out = sched.schedule()
        evicted = cache is not None and cache.num_evictions > evictions_before
        chunks = out.chunks
        requests = [c.request for c in chunks]

        # Budgets.
        assert len(chunks) <= sched.max_num_seqs
        assert out.num_tokens == sum(c.num_tokens for c in chunks)
        assert out.num_tokens <= sched.max_num_batched_tokens
        # Something always runs while something is unfinished (a max-size request fits),
        # unless (async) requests whose last token is in flight still hold pages or slots.
        waiting_for_last = [r for r in running_before if r.num_output_tokens >= r.params.max_tokens]
        stalled = self.pending is not None and bool(waiting_for_last)
        assert bool(chunks) == had_work or (stalled and not chunks)
        # No request twice in a step.
        assert len({id(r) for r in requests}) == len(requests)

        for c in chunks:
            r = c.request
            assert contains(self.live, r)
            assert r.status is RequestStatus.RUNNING and contains(sched.running, r)
            assert c.num_tokens >= 1
            if contains(running_before, r):
                assert c.start == before[r.request_id][0], "chunk does not start at computed"
            else:
                self.check_start(c, evicted)
            # (a sampling chunk has added a placeholder for its token)
            assert c.start + c.num_tokens <= r.num_tokens - c.samples
            assert c.samples == (c.start + c.num_tokens == r.num_tokens - c.samples)
            assert c.num_tokens == 1 or c.start + c.num_tokens <= r.num_known_tokens
            assert c.token_ids == r.all_token_ids[c.start : c.start + c.num_tokens]
            # Exactly the pages this chunk needs: enough, and no more.
            assert len(r.page_ids) == cdiv(c.start + c.num_tokens, ps)

        # Running requests first (in scheduling order), then waiting ones start in order.
        num_old = sum(1 for r in requests if contains(running_before, r))
        old, new = requests[:num_old], requests[num_old:]
        assert all(contains(running_before, r) for r in old)
        assert [r.sort_key for r in old] == sorted(r.sort_key for r in old)
        assert all(a is b for a, b in zip(new, waiting_before, strict=False))
        assert len(new) <= len(waiting_before)
        if running_before and not waiting_for_last:
            # The best-ranked running request always runs: it is only ever preempted when
            # it ranks last, i.e. alone, and alone it fits (this is what makes progress).
            assert requests and requests[0] is running_before[0]
        skipped = [
            r
            for r in running_before
            if not contains(old, r)
            and not contains(out.preempted, r)
            and not contains(waiting_for_last, r)
        ]
        budget_left = sched.max_num_batched_tokens - out.num_tokens
        seqs_left = sched.max_num_seqs - len(chunks)
        if skipped:
            # A running request is only left out when a budget is spent ...
            assert budget_left == 0 or seqs_left == 0
            # ... and then no waiting request may start instead of it.
            assert not new
        if out.preempted:
            assert not new, "a waiting request started in a step that had to preempt"
        elif (
            sched.waiting
            and budget_left
            and seqs_left
            and len(sched.running) < seqs_left + len(chunks)
        ):
            # (async: a request whose last token is in flight still holds its slot)
            self.check_head_blocked(sched.waiting[0], budget_left)

        # Preemption: the victims are running requests ranked below everything that ran.
        if out.preempted:
            STATS["preemptions"] += len(out.preempted)
            event("preempted")
        keys = [v.sort_key for v in out.preempted]
        assert keys == sorted(keys, reverse=True) and len(set(keys)) == len(keys)
        for v in out.preempted:
            assert contains(running_before, v)
            # Newest lowest-priority first: everything ranked below a victim went before it.
            assert all(
                contains(out.preempted, r) for r in running_before if r.sort_key > v.sort_key
            )
            assert not contains(requests, v)
            assert all(r.sort_key < v.sort_key for r in old)
            assert v.status is RequestStatus.WAITING and contains(sched.waiting, v)
            assert v.page_ids == [] and v.num_computed_tokens == 0
            assert v.output_token_ids == before[v.request_id][1], "preemption lost outputs"
            assert v.num_preemptions == preemptions_before[v.request_id] + 1

        # The fake device: write every chunk's K/V, then check every attended position.
        for c in chunks:
            r = c.request
            fps = fingerprints(r)
            for pos in range(c.start, c.start + c.num_tokens):
                page = r.page_ids[pos // ps]
                assert self.pages.refcounts[page] == 1, f"writing shared page {page}"
                self.kv[page][pos % ps] = fps[pos]
        for c in chunks:
            r = c.request
            seen = [
                self.kv[r.page_ids[pos // ps]][pos % ps] for pos in range(c.start + c.num_tokens)
            ]
            assert seen == fingerprints(r)[: c.start + c.num_tokens], "K/V clobbered"

        # Postprocess, as the engine does (async: the previous step's output).
        if self.asynchronous:
            self.pending, out = out, self.pending
        if out is not None:
            self.apply(out)
        STATS["steps"] += 1
        return self.pending if self.asynchronous else out

    def apply(self, out: SchedulerOutput) -> None:
        """A step's output: the scheduler appends the tokens and ends requests at max_tokens;
        the engine stops them at a drawn point (a stop string). A request that finished
        meanwhile (async) gets nothing."""
        chunks = [c for c in out.chunks if c.samples and not c.request.is_finished]
        tokens = [sampled_token(c.request) for c in chunks]
        advanced = self.sched.update_from_output(
            out, [sampled_token(c.request) if c.samples else -1 for c in out.chunks]
        )
        assert [r for _, r, _ in advanced] == [c.request for c in chunks]
        for (_, r, _), token in zip(advanced, tokens, strict=True):
            self.expected_out[r.request_id].append(token)
            if r.is_finished:
                assert r.finish_reason == "length"
                self.retire(r, "length")
            elif len(r.output_token_ids) == self.spec[r.request_id][1]:
                self.end(r, "stop")

    # ---- invariants

    @invariant()
    def consistent(self):
        if self.sched is None:
            return
        sched = self.sched
        check_pool(self.pages, [r.page_ids for r in self.live])
        counts = collections.Counter(p for r in self.live for p in r.page_ids)
        if self.pages.cache is None:
            assert all(c == 1 for c in counts.values()), "a page is owned twice"
        for lst in (sched.running, sched.waiting):
            keys = [r.sort_key for r in lst]
            assert keys == sorted(keys)
        assert sorted(id(r) for r in sched.running + sched.waiting) == sorted(
            id(r) for r in self.live
        )
        for r in self.live:
            max_tokens, _ = self.spec[r.request_id]
            assert r.output_token_ids == self.expected_out[r.request_id]
            assert len(r.output_token_ids) < max_tokens
            assert r.num_known_tokens <= len(r.prompt_token_ids) + max_tokens - 1
            if contains(sched.running, r):
                assert r.status is RequestStatus.RUNNING
                assert r.num_computed_tokens < r.num_tokens
                assert len(r.page_ids) == cdiv(r.num_computed_tokens, self.page_size)
            else:
                assert r.status is RequestStatus.WAITING
                assert r.page_ids == [] and r.num_computed_tokens == 0
        for r in self.finished:
            assert r.status is RequestStatus.FINISHED and r.page_ids == []

    def teardown(self):
        if self.sched is None or sys.exc_info()[1] is not None:
            return  # a rule already failed; let that error through
        # Liveness: without new requests everything finishes. Each step advances the
        # best-ranked running request, which is never preempted while it is ranked first,
        # so (number of requests) * (sum of their token counts) steps always suffice.
        sizes = [len(r.prompt_token_ids) + self.spec[r.request_id][0] for r in self.live]
        bound = len(sizes) * sum(sizes) + 1
        steps = 0
        while self.live:
            assert steps < bound, f"no progress after {steps} steps: livelock"
            self.do_step()
            self.consistent()
            steps += 1
        assert not self.sched.has_unfinished()
        assert not self.sched.schedule().chunks
        # The pool is full again.
        assert self.pages.num_free == self.pages.num_usable
        assert all(c == 0 for c in self.pages.refcounts)
        check_pool(self.pages, [])
        for r in self.finished:
            max_tokens, stop_at = self.spec[r.request_id]
            assert r.output_token_ids == self.expected_out[r.request_id]
            n = len(r.output_token_ids)
            if r.finish_reason == "length":
                assert n == max_tokens
            elif r.finish_reason == "stop":
                assert n == stop_at
            else:
                assert r.finish_reason == "abort" and n <= max_tokens


def test_scheduler_state_machine():
    STATS.clear()
    run_state_machine_as_test(SchedulerMachine, settings=MACHINE_SETTINGS)
    # The random runs really exercise the interesting paths.
    assert STATS["preemptions"] > 50, STATS
    assert STATS["abort preempted"] > 0, STATS
    assert STATS["finish length"] > 0 and STATS["finish stop"] > 0, STATS


class PrefixCacheSchedulerMachine(SchedulerMachine):
    """The scheduler machine with a prefix cache.

    New prompts reuse an earlier request's tokens (its prompt, or prompt plus generated
    tokens, cut on a page boundary, just past one, or anywhere) followed by fresh tokens,
    sometimes under another cache salt, so lookups hit pages in use and parked pages; an
    outsider takes and returns pages to force evictions. On top of the base checks: a page is
    only written while unshared, every cached page holds the fingerprints of its hash's
    tokens, and a request starts from the longest cached run of its pages.
    """

    def __init__(self):
        super().__init__()
        self.page_fps: dict[bytes, list[int]] = {}  # hash -> what its page must hold

    def make_pages(self, num_pages: int) -> PageManager:
        return PageManager(num_pages, PrefixCache(self.page_size))

    @precondition(lambda self: self.live or self.finished)
    @rule(data=st.data(), priority=st.integers(0, 2), whole_prompt=st.booleans())
    def add_sharing(self, data, priority, whole_prompt):
        ps = self.page_size
        source = data.draw(st.sampled_from(self.live + self.finished), label="source")
        tokens = source.prompt_token_ids if whole_prompt else source.all_token_ids
        boundaries = [b for i in range(1, len(tokens) // ps + 1) for b in (i * ps, i * ps + 1)]
        cut = data.draw(
            st.sampled_from([len(tokens), *(b for b in boundaries if b <= len(tokens))])
            | st.integers(0, len(tokens)),
            label="cut",
        )
        num_fresh = data.draw(st.integers(0 if cut else 1, 10), label="num_fresh")
        prompt = tokens[:cut] + [1000 * self.arrivals + 500 + i for i in range(num_fresh)]
        request = make_request(self.arrivals, 1, priority=priority)
        request.prompt_token_ids = prompt[: min(80, self.capacity)]
        request.cache_salt = data.draw(st.sampled_from(["", "", "lora-1"]), label="salt")
        self.submit(data, request)

    @rule(k=st.integers(1, 12))
    def evict(self, k):
        """An outsider takes k pages -- parked ones once the free list is empty -- writes
        over them and gives them back."""
        cache = self.pages.cache
        before = cache.num_evictions
        taken = self.pages.allocate(min(k, self.pages.num_free))
        for p in taken:
            assert not cache.holds(p) and self.pages.refcounts[p] == 1
            self.kv[p] = ["outsider"] * self.page_size
        self.pages.free(taken)
        STATS["evictions"] += cache.num_evictions - before

    def do_step(self) -> SchedulerOutput:
        out = super().do_step()
        ps = self.page_size
        for c in out.chunks:  # record what each page that is now computed must hold
            r = c.request
            fps = fingerprints(r)
            hashes = page_hashes(r.all_token_ids[: c.start + c.num_tokens], ps, r.cache_salt)
            for i, h in enumerate(hashes):
                want = fps[i * ps : (i + 1) * ps]
                assert self.page_fps.setdefault(h, want) == want, "hash collision"
        return out

    def check_start(self, chunk, evicted: bool) -> None:
        """The request took the longest cached run of its full pages, short of its last
        token; without an eviction in this step, the next page was not cached."""
        r, ps, cache = chunk.request, self.page_size, self.pages.cache
        num_hits, rest = divmod(chunk.start, ps)
        assert rest == 0 and chunk.start < r.num_tokens
        hashes = list(page_hashes(r.all_token_ids, ps, r.cache_salt))
        assert r.page_hashes == hashes[:num_hits]
        for i in range(num_hits):
            assert cache.page_of(hashes[i]) == r.page_ids[i]
        # The tokens it had before this step (a sampling chunk has added a placeholder): a
        # page that holds the last of them is computed again even when cached.
        if not evicted and num_hits < (r.num_tokens - chunk.samples - 1) // ps:
            assert cache.page_of(hashes[num_hits]) is None, "a cached page was missed"
        STATS["hit tokens"] += chunk.start
        STATS["parked hits"] += sum(self.pages.refcounts[p] == 1 for p in r.page_ids[:num_hits])

    def check_head_blocked(self, head: Request, budget_left: int) -> None:
        ps = self.page_size
        max_pages = (head.num_tokens - 1) // ps
        hits, _ = self.pages.cache.lookup(head.all_token_ids, max_pages, head.cache_salt)
        parked = sum(self.pages.refcounts[p] == 0 for p in hits)
        n = min(head.num_tokens - len(hits) * ps, budget_left)
        need = cdiv(len(hits) * ps + n, ps) - len(hits)
        assert need > self.pages.num_free - parked

    @invariant()
    def cache_holds_its_tokens(self):
        if self.sched is None:
            return
        ps = self.page_size
        for h, page in self.pages.cache.items():
            assert h in self.page_fps, f"page {page}'s hash names no tokens computed so far"
            assert self.kv[page] == self.page_fps[h], f"cached page {page} holds other tokens"
        for r in self.live:
            assert len(r.page_hashes) <= r.num_computed_tokens // ps
            for i, p in enumerate(r.page_ids):
                if self.pages.refcounts[p] > 1:  # shared: full and computed for every holder
                    assert (i + 1) * ps <= r.num_computed_tokens
                    STATS["shared pages"] += 1


def test_prefix_cache_scheduler_state_machine():
    STATS.clear()
    run_state_machine_as_test(PrefixCacheSchedulerMachine, settings=MACHINE_SETTINGS)
    assert STATS["hit tokens"] > 1000 and STATS["parked hits"] > 50, STATS
    assert STATS["shared pages"] > 50 and STATS["evictions"] > 20, STATS
    assert STATS["preemptions"] > 20 and STATS["abort preempted"] > 0, STATS


class AsyncSchedulerMachine(SchedulerMachine):
    asynchronous = True


class AsyncPrefixCacheSchedulerMachine(PrefixCacheSchedulerMachine):
    asynchronous = True


def test_scheduler_state_machine_with_async_scheduling():
    STATS.clear()
    run_state_machine_as_test(AsyncSchedulerMachine, settings=MACHINE_SETTINGS)
    assert STATS["preemptions"] > 50 and STATS["abort preempted"] > 0, STATS
    assert STATS["finish length"] > 0 and STATS["finish stop"] > 0, STATS


def test_prefix_cache_scheduler_state_machine_with_async_scheduling():
    STATS.clear()
    run_state_machine_as_test(AsyncPrefixCacheSchedulerMachine, settings=MACHINE_SETTINGS)
    assert STATS["hit tokens"] > 1000 and STATS["shared pages"] > 50, STATS
    assert STATS["preemptions"] > 20 and STATS["abort preempted"] > 0, STATS


# --------------------------------------------------------------------------- unit tests


def make_scheduler(num_pages=64, page_size=4, max_num_seqs=8, max_num_batched_tokens=64):
    pages = PageManager(num_pages)
    return Scheduler(pages, page_size, max_num_seqs, max_num_batched_tokens), pages


def engine_step(sched: Scheduler) -> SchedulerOutput:
    """One step of the engine protocol with a fake device; finishes at max_tokens.

    `out.sampled` records which chunks sampled (`chunk.samples` changes once a token is
    appended)."""
    out = sched.schedule()
    out.sampled = [c.samples for c in out.chunks]
    sched.update_from_output(out, [sampled_token(c.request) for c in out.chunks])
    return out


def summary(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks]


def start_order(sched: Scheduler, max_steps=1000) -> list[str]:
    """Runs to completion; the order in which requests were first scheduled."""
    order: list[str] = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return order
        for c in engine_step(sched).chunks:
            if c.request.request_id not in order:
                order.append(c.request.request_id)
    raise AssertionError("did not finish")


def test_fcfs_order():
    sched, pages = make_scheduler(max_num_seqs=1)
    reqs = [make_request(i, prompt_len=3 + i, max_tokens=2) for i in range(4)]
    for r in reqs:
        sched.add(r)
    assert [r.request_id for r in sched.waiting] == ["r0", "r1", "r2", "r3"]
    # One sequence at a time: each runs to completion before the next starts.
    out = engine_step(sched)
    assert summary(out) == [("r0", 0, 3)]
    assert start_order(sched) == ["r0", "r1", "r2", "r3"]
    assert all(r.finish_reason == "length" for r in reqs)
    assert pages.num_free == pages.num_usable


def test_fcfs_order_with_room_for_two():
    sched, _ = make_scheduler(max_num_seqs=2)
    for i in range(4):
        sched.add(make_request(i, prompt_len=4, max_tokens=3))
    assert summary(engine_step(sched)) == [("r0", 0, 4), ("r1", 0, 4)]
    assert summary(engine_step(sched)) == [("r0", 4, 1), ("r1", 4, 1)]
    assert start_order(sched) == ["r0", "r1", "r2", "r3"]


def test_priority_order():
    sched, pages = make_scheduler(max_num_seqs=1)
    # (arrival, priority): lower priority value first, ties by arrival.
    for arrival, priority in [(0, 1), (1, 0), (2, 0), (3, -1), (4, 1), (5, 2)]:
        sched.add(make_request(arrival, prompt_len=5, max_tokens=2, priority=priority))
    assert [r.request_id for r in sched.waiting] == ["r3", "r1", "r2", "r0", "r4", "r5"]
    assert start_order(sched) == ["r3", "r1", "r2", "r0", "r4", "r5"]
    assert pages.num_free == pages.num_usable


def test_priority_arrival_while_running():
    """A later, more urgent request is scheduled ahead of earlier waiting ones."""
    sched, _ = make_scheduler(max_num_seqs=1)
    sched.add(make_request(0, prompt_len=4, max_tokens=3))
    sched.add(make_request(1, prompt_len=4, max_tokens=3))
    assert summary(engine_step(sched)) == [("r0", 0, 4)]
    sched.add(make_request(2, prompt_len=4, max_tokens=3, priority=-1))
    # r0 keeps running (no preemption for priority alone); r2 is next, then r1.
    assert start_order(sched) == ["r0", "r2", "r1"]


def test_decode_first_then_chunked_prefill():
    sched, _ = make_scheduler(max_num_seqs=8, max_num_batched_tokens=16)
    for i in range(3):
        sched.add(make_request(i, prompt_len=4, max_tokens=10))
    out = engine_step(sched)
    assert summary(out) == [("r0", 0, 4), ("r1", 0, 4), ("r2", 0, 4)]
    assert out.sampled == [True] * 3
    long = make_request(3, prompt_len=40, max_tokens=10)
    sched.add(long)
    # Three decode tokens first, then a 13-token chunk of the new prompt (16 - 3).
    out = engine_step(sched)
    assert summary(out) == [("r0", 4, 1), ("r1", 4, 1), ("r2", 4, 1), ("r3", 0, 13)]
    assert out.sampled == [True, True, True, False]
    assert long.output_token_ids == [] and long.num_computed_tokens == 13
    out = engine_step(sched)
    assert summary(out) == [("r0", 5, 1), ("r1", 5, 1), ("r2", 5, 1), ("r3", 13, 13)]
    out = engine_step(sched)
    assert summary(out) == [("r0", 6, 1), ("r1", 6, 1), ("r2", 6, 1), ("r3", 26, 13)]
    # The last prompt token is alone in its chunk, and that chunk samples.
    out = engine_step(sched)
    assert summary(out) == [("r0", 7, 1), ("r1", 7, 1), ("r2", 7, 1), ("r3", 39, 1)]
    assert out.sampled == [True] * 4
    assert len(long.output_token_ids) == 1
    out = engine_step(sched)
    assert summary(out) == [("r0", 8, 1), ("r1", 8, 1), ("r2", 8, 1), ("r3", 40, 1)]


def test_chunked_prefill_alone_and_max_num_seqs():
    sched, _ = make_scheduler(max_num_seqs=2, max_num_batched_tokens=16)
    sched.add(make_request(0, prompt_len=40, max_tokens=2))
    sched.add(make_request(1, prompt_len=3, max_tokens=2))
    sched.add(make_request(2, prompt_len=3, max_tokens=2))
    assert summary(engine_step(sched)) == [("r0", 0, 16)]
    assert summary(engine_step(sched)) == [("r0", 16, 16)]
    # r0 takes 8, r1 takes 3 of the rest; r2 waits for a sequence slot, not for tokens.
    assert summary(engine_step(sched)) == [("r0", 32, 8), ("r1", 0, 3)]
    assert summary(engine_step(sched)) == [("r0", 40, 1), ("r1", 3, 1)]
    assert summary(engine_step(sched)) == [("r2", 0, 3)]


def test_preemption_picks_the_lowest_priority_newest_request():
    # 6 usable pages of 2 tokens. Three 4-token prompts fill the pool after prefill.
    sched, pages = make_scheduler(num_pages=7, page_size=2, max_num_batched_tokens=64)
    r0 = make_request(0, prompt_len=4, max_tokens=8, priority=0)
    r1 = make_request(1, prompt_len=4, max_tokens=8, priority=1)  # lowest priority
    r2 = make_request(2, prompt_len=4, max_tokens=8, priority=0)  # newest
    for r in (r0, r1, r2):
        sched.add(r)
    out = engine_step(sched)
    assert summary(out) == [("r0", 0, 4), ("r2", 0, 4), ("r1", 0, 4)]
    assert pages.num_free == 0
    outputs_r1 = list(r1.output_token_ids)
    # Decoding needs a third page each: r1 (largest (priority, arrival)) is preempted.
    late = make_request(3, prompt_len=2, max_tokens=2)
    sched.add(late)
    out = engine_step(sched)
    assert out.preempted == [r1]
    assert summary(out) == [("r0", 4, 1), ("r2", 4, 1)]
    assert r1.status is RequestStatus.WAITING and r1.page_ids == []
    assert r1.num_computed_tokens == 0 and r1.num_preemptions == 1
    assert r1.output_token_ids == outputs_r1 and len(outputs_r1) == 1
    # Requeued by (priority, arrival): behind the later but more urgent r3.
    assert [r.request_id for r in sched.waiting] == ["r3", "r1"]
    check_pool(pages, [r.page_ids for r in (r0, r1, r2, late)])
    # Run to the end: r1 is recomputed from its prompt plus its kept output.
    recomputed = []
    while sched.has_unfinished():
        out = engine_step(sched)
        recomputed += [c for c in out.chunks if c.request is r1 and c.start == 0]
        check_pool(pages, [r.page_ids for r in (r0, r1, r2, late) if not r.is_finished])
    assert recomputed and recomputed[0].num_tokens == 5
    assert recomputed[0].token_ids == r1.prompt_token_ids + outputs_r1
    assert len(r1.output_token_ids) == 8 and r1.output_token_ids[0] == outputs_r1[0]
    assert pages.num_free == pages.num_usable


def test_preempted_request_requeued_ahead_of_later_arrivals():
    sched, pages = make_scheduler(num_pages=7, page_size=2)
    reqs = [make_request(i, prompt_len=4, max_tokens=8) for i in range(3)]
    for r in reqs:
        sched.add(r)
    engine_step(sched)
    later = [make_request(i, prompt_len=2, max_tokens=2) for i in (3, 4)]
    for r in later:
        sched.add(r)
    out = engine_step(sched)
    # r0 and r1 need a page each; only the newest (r2) goes.
    assert out.preempted == [reqs[2]]
    assert summary(out) == [("r0", 4, 1), ("r1", 4, 1)]
    assert [r.request_id for r in sched.waiting] == ["r2", "r3", "r4"]
    # r2 resumes before the later arrivals start.
    assert start_order(sched) == ["r0", "r1", "r2", "r3", "r4"]
    assert pages.num_free == pages.num_usable


def test_request_preempts_itself_when_it_ranks_last():
    # 4 usable pages of 2 tokens. r0's decode fits its pages; r1's needs a fifth page.
    sched, pages = make_scheduler(num_pages=5, page_size=2)
    r0 = make_request(0, prompt_len=3, max_tokens=4)
    r1 = make_request(1, prompt_len=4, max_tokens=4)
    sched.add(r0)
    sched.add(r1)
    assert summary(engine_step(sched)) == [("r0", 0, 3), ("r1", 0, 4)]
    out = engine_step(sched)
    assert summary(out) == [("r0", 3, 1)]
    assert out.preempted == [r1]
    assert r1.page_ids == [] and len(r1.output_token_ids) == 1
    # r0 takes one of the freed pages; r1 (5 tokens to recompute, 3 pages) must wait.
    out = engine_step(sched)
    assert summary(out) == [("r0", 4, 1)] and out.preempted == []
    assert summary(engine_step(sched)) == [("r0", 5, 1)]
    assert r0.finish_reason == "length"
    out = engine_step(sched)
    assert summary(out) == [("r1", 0, 5)]
    assert out.chunks[0].token_ids == r1.prompt_token_ids + r1.output_token_ids[:1]
    while sched.has_unfinished():
        engine_step(sched)
    assert r0.finish_reason == r1.finish_reason == "length"
    assert len(r1.output_token_ids) == 4
    assert pages.num_free == pages.num_usable


def test_abort_waiting_running_and_preempted_frees_everything():
    sched, pages = make_scheduler(num_pages=7, page_size=2)
    reqs = [make_request(i, prompt_len=4, max_tokens=8) for i in range(3)]
    for r in reqs:
        sched.add(r)
    engine_step(sched)
    never_started = make_request(3, prompt_len=6, max_tokens=4)
    sched.add(never_started)
    out = engine_step(sched)
    preempted = reqs[2]
    assert out.preempted == [preempted]
    running = reqs[0]
    assert running.status is RequestStatus.RUNNING and running.page_ids

    for r in (preempted, never_started, running):
        sched.finish(r, "abort")
        assert r.status is RequestStatus.FINISHED and r.finish_reason == "abort"
        assert r.page_ids == [] and r.num_computed_tokens == 0
        assert not contains(sched.running, r) and not contains(sched.waiting, r)
        check_pool(pages, [x.page_ids for x in [*reqs, never_started] if not x.is_finished])
    assert preempted.output_token_ids  # outputs are kept for the abort's report
    assert [r.request_id for r in sched.running] == ["r1"]
    sched.finish(reqs[1], "abort")
    assert not sched.has_unfinished()
    assert pages.num_free == pages.num_usable
    assert all(c == 0 for c in pages.refcounts)
    out = sched.schedule()
    assert out.chunks == [] and out.preempted == []


def test_abort_mid_prefill_then_others_proceed():
    sched, pages = make_scheduler(num_pages=9, page_size=4, max_num_batched_tokens=8)
    big = make_request(0, prompt_len=30, max_tokens=2)
    small = make_request(1, prompt_len=3, max_tokens=2)
    sched.add(big)
    sched.add(small)
    assert summary(engine_step(sched)) == [("r0", 0, 8)]
    assert len(big.page_ids) == 2
    sched.finish(big, "abort")
    assert pages.num_free == pages.num_usable
    assert summary(engine_step(sched)) == [("r1", 0, 3)]
    engine_step(sched)
    assert small.finish_reason == "length"
    assert pages.num_free == pages.num_usable


# --------------------------------------------------------------------------- page manager


def test_page_manager_allocate_share_free():
    pm = PageManager(6)
    assert pm.num_usable == 5 and pm.num_free == 5
    a = pm.allocate(3)
    assert len(set(a)) == 3 and SINK_PAGE not in a
    assert all(pm.refcounts[p] == 1 for p in a) and pm.num_free == 2
    assert pm.can_allocate(2) and not pm.can_allocate(3)
    with pytest.raises(RuntimeError):
        pm.allocate(3)
    assert pm.num_free == 2
    pm.share(a[:2])
    assert [pm.refcounts[p] for p in a] == [2, 2, 1]
    pm.free(a)
    assert [pm.refcounts[p] for p in a] == [1, 1, 0] and pm.num_free == 3
    check_pool(pm, [a[:2]])
    pm.free(a[:2])
    assert pm.num_free == 5 and all(c == 0 for c in pm.refcounts)
    with pytest.raises(AssertionError, match="double free"):
        pm.free([a[0]])
    with pytest.raises(AssertionError, match="sharing free page"):
        pm.share([a[0]])
    b = pm.allocate(5)
    assert sorted(b) == [1, 2, 3, 4, 5]
    with pytest.raises(AssertionError, match="double free"):
        pm.free([SINK_PAGE])
    assert pm.allocate(0) == []
    pm.free(b)
    check_pool(pm, [])


def test_page_manager_rejects_tiny_pool():
    with pytest.raises(ValueError, match="num_pages"):
        PageManager(1)


# --------------------------------------------------------------------------- prefix cache


def test_page_hashes_chain_parent_tokens_and_salt():
    tokens = list(range(1, 10))
    hashes = list(page_hashes(tokens, 4))
    assert len(hashes) == 2  # the partial third page has no hash
    assert hashes[0] == page_hash(root_hash(), [1, 2, 3, 4])
    assert hashes[1] == page_hash(hashes[0], [5, 6, 7, 8])
    assert len(hashes[0]) == 32 and hashes[0] != hashes[1]
    # Same page tokens after a different first page: a different hash (K/V differ).
    other = list(page_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4))
    assert other[0] != hashes[0] and other[1] != hashes[1]
    salted = list(page_hashes(tokens, 4, cache_salt="lora-1"))
    assert salted[0] != hashes[0]
    assert page_hash(root_hash(), [2**40]) != page_hash(root_hash(), [0])  # no truncation


def test_prefix_cache_lookup_insert_park_evict():
    cache = PrefixCache(page_size=2)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    h = list(page_hashes(tokens, 2))
    assert cache.lookup(tokens, 3) == ([], [])
    assert cache.insert(5, h[0]) and cache.insert(6, h[1])
    assert not cache.insert(7, h[0]), "a hash names one page"
    assert not cache.insert(5, h[2]), "a page has one hash"
    assert cache.lookup(tokens, 3) == ([5, 6], h[:2])
    assert cache.lookup(tokens, 1) == ([5], h[:1])  # max_pages caps the walk
    assert cache.lookup(tokens[:3], 3) == ([5], h[:1])  # only full pages
    assert cache.lookup([9, *tokens[1:]], 3) == ([], [])  # the chain breaks at page 0
    assert cache.lookup(tokens, 3, cache_salt="lora-1") == ([], [])
    assert cache.insert(7, h[2])
    for page in (6, 5, 7):
        cache.park(page)
    cache.unpark(5)  # a hit
    assert cache.num_parked == 2
    assert cache.evict() == 6  # least recently parked first; its hash is forgotten
    assert cache.lookup(tokens, 3) == ([5], h[:1])
    assert cache.evict() == 7
    assert cache.num_parked == 0 and len(cache) == 1 and cache.num_evictions == 2
    assert cache.holds(5) and not cache.holds(6)


def test_page_manager_with_cache_parks_and_evicts_last():
    cache = PrefixCache(page_size=2)
    pm = PageManager(5, cache)
    a = pm.allocate(2)
    assert cache.insert(a[0], b"h0")
    pm.free(a)
    assert cache.is_parked(a[0]) and not cache.is_parked(a[1])
    assert pm.num_free == 4 and pm.num_used == 0
    check_pool(pm, [])
    pm.share([a[0]])  # a hit on a parked page
    assert pm.refcounts[a[0]] == 1 and not cache.is_parked(a[0]) and pm.num_free == 3
    pm.share([a[0]])  # a hit on a page in use
    pm.free([a[0], a[0]])
    check_pool(pm, [])
    got = pm.allocate(3)  # the plain free pages first
    assert a[0] not in got and cache.holds(a[0])
    got += pm.allocate(1)  # then the parked one, evicted
    assert got[-1] == a[0] and cache.page_of(b"h0") is None and cache.num_evictions == 1
    pm.free(got)
    check_pool(pm, [])
    assert pm.num_free == pm.num_usable
    with pytest.raises(AssertionError, match="sharing free page"):
        pm.share([a[1]])


def test_shared_prefix_hits_and_last_token_is_computed():
    """Unit walk-through: prompts sharing 2 full pages; a full-page prompt recomputes its
    last page; generated tokens are cached; a finished request's pages stay until evicted."""
    pages = PageManager(16, PrefixCache(page_size=4))
    sched = Scheduler(pages, 4, max_num_seqs=4, max_num_batched_tokens=64)
    system = list(range(100, 108))  # two full pages
    first = make_request(0, 1, max_tokens=3)
    first.prompt_token_ids = [*system, 1, 2]
    sched.add(first)
    out = engine_step(sched)
    assert summary(out) == [("r0", 0, 10)] and out.prefix_cache_queries == 10
    assert out.prefix_cache_hits == 0
    second = make_request(1, 1, max_tokens=2)
    second.prompt_token_ids = [*system, 3]
    sched.add(second)
    out = engine_step(sched)
    assert summary(out) == [("r0", 10, 1), ("r1", 8, 1)]  # r1 starts after the shared pages
    assert (out.prefix_cache_queries, out.prefix_cache_hits) == (9, 8)
    assert second.page_ids[:2] == first.page_ids[:2]
    assert [pages.refcounts[p] for p in first.page_ids] == [2, 2, 1]
    exact = make_request(2, 1, max_tokens=1)
    exact.prompt_token_ids = list(system)  # all of it cached: the last page is recomputed
    sched.add(exact)
    out = engine_step(sched)
    assert ("r2", 4, 4) in summary(out)
    assert exact.finish_reason == "length" and first.finish_reason == "length"
    # first's third page (tokens 1, 2 + two generated) was full and computed: cached.
    follow_up = make_request(3, 1, max_tokens=1)
    follow_up.prompt_token_ids = [*first.all_token_ids[:12], 9]
    while sched.has_unfinished():
        engine_step(sched)
    sched.add(follow_up)
    out = engine_step(sched)
    assert summary(out) == [("r3", 12, 1)]
    assert pages.num_free == pages.num_usable and pages.num_used == 0
    assert pages.cache.num_parked == len(pages.cache) > 0


def test_prompt_logprobs_chunks_fit_the_scored_budget_and_skip_the_cache():
    """A request with prompt_logprobs scores each prompt position but the last once (the
    last predicts its first output), within max_num_scored_tokens a step, which cuts only
    its own chunks; it recomputes a cached prefix, and its pages still enter the cache."""
    pages = PageManager(64, PrefixCache(4))
    sched = Scheduler(pages, 4, 8, 64, max_num_scored_tokens=5)
    cached = make_request(0, prompt_len=10, max_tokens=1)
    sched.add(cached)
    engine_step(sched)
    scoring = make_request(1, prompt_len=12, max_tokens=2)
    scoring.prompt_token_ids[:10] = cached.prompt_token_ids
    scoring.params = SamplingParams(max_tokens=2, prompt_logprobs=1)
    plain = make_request(2, prompt_len=9, max_tokens=2)
    sched.add(scoring)
    sched.add(plain)
    steps = []
    while sched.has_unfinished():
        out = engine_step(sched)
        steps.append(
            [(*row, c.num_scored) for row, c in zip(summary(out), out.chunks, strict=True)]
        )
    assert steps == [
        [("r1", 0, 5, 5), ("r2", 0, 9, 0)],  # no cache hit for r1; r2 is not cut
        [("r1", 5, 5, 5), ("r2", 9, 1, 0)],
        [("r1", 10, 2, 1)],  # position 11 (the last) samples, unscored
        [("r1", 12, 1, 0)],
    ]
    later = make_request(3, prompt_len=13, max_tokens=1)
    later.prompt_token_ids[:12] = scoring.prompt_token_ids
    sched.add(later)
    assert summary(engine_step(sched)) == [("r3", 12, 1)]  # r1's three pages

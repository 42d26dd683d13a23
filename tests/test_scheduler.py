"""The scheduler (host side): property-based state machines (the page manager's own machine
and unit tests are in test_page_manager.py, the policy's unit tests in
test_scheduler_policy.py).

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
import sys

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from scheduler_helpers import (
    MACHINE_SETTINGS,
    cdiv,
    check_pool,
    contains,
    fingerprints,
    make_request,
    sampled_token,
)

from ksana_jax.page_manager import PageManager
from ksana_jax.prefix_cache import PrefixCache, page_hashes
from ksana_jax.request import Request, RequestStatus
from ksana_jax.sampling_params import SamplingParams
from ksana_jax.scheduler import Scheduler, SchedulerOutput

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

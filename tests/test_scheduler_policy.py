"""The scheduler's policy, one scenario a test: FCFS and priority order, decode before
chunked prefill, preemption's victim and requeue, aborts freeing everything, prefix-cache
hits, prompt-logprob chunks within the scored budget."""

from __future__ import annotations

from scheduler_helpers import check_pool, contains, make_request, sampled_token

from ksana_jax.page_manager import PageManager
from ksana_jax.prefix_cache import PrefixCache
from ksana_jax.request import RequestStatus
from ksana_jax.sampling_params import SamplingParams
from ksana_jax.scheduler import Scheduler, SchedulerOutput

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

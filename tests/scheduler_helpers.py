"""Shared by the page manager and scheduler tests: test requests, the fake device's
tokens and K/V fingerprints, the page pool's invariants, hypothesis settings."""

from __future__ import annotations

import collections
import itertools

from hypothesis import HealthCheck, settings

from ksana_jax.kv_cache import SINK_PAGE
from ksana_jax.page_manager import PageManager
from ksana_jax.request import Request
from ksana_jax.sampling_params import SamplingParams

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

"""PageManager and PrefixCache: a property-based state machine (allocate, share, free,
with and without the cache, against the pool's invariants) and unit tests."""

from __future__ import annotations

import itertools
import sys

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from scheduler_helpers import MACHINE_SETTINGS, check_pool

from ksana_jax.kv_cache import SINK_PAGE
from ksana_jax.page_manager import PageManager
from ksana_jax.prefix_cache import PrefixCache, page_hash, page_hashes, root_hash

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

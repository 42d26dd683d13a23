"""Page allocator with reference counts (host side, no jax).

Pages 1..num_pages-1 are handed out; page 0 is the padding sink and never allocated.
Refcounts above 1 come from sharing (prefix-cache hits, the n samples of one request).

With a PrefixCache, a page whose refcount drops to 0 while it holds a hash is not freed but
parked on the cache's LRU list: a later request may hit it and share it again. Parked pages
still count as free (`num_free`), since `allocate` takes them -- evicting the least recently
released first -- once the plain free list is empty. Without a cache, a page is free exactly
when its refcount is 0.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from ksana_jax.kv_cache import SINK_PAGE
from ksana_jax.prefix_cache import PrefixCache


class PageManager:
    def __init__(self, num_pages: int, cache: PrefixCache | None = None):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the sink), got {num_pages}")
        self.num_pages = num_pages
        self.cache = cache
        self.refcounts = [0] * num_pages
        self._free = deque(p for p in range(num_pages) if p != SINK_PAGE)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out: plain free ones plus parked cached ones."""
        return len(self._free) + (self.cache.num_parked if self.cache else 0)

    @property
    def num_used(self) -> int:
        """Pages some request references (refcount > 0)."""
        return self.num_usable - self.num_free

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """n fresh pages with refcount 1; raises if fewer are free (check can_allocate).

        Plain free pages go first; then parked cached pages, least recently released first,
        each losing its hash."""
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} pages, {self.num_free} free")
        pages = [self._free.popleft() if self._free else self.cache.evict() for _ in range(n)]
        for p in pages:
            self.refcounts[p] = 1
        return pages

    def share(self, pages: Iterable[int]) -> None:
        """Adds a reference to each page: one in use, or a parked cached one (a hit)."""
        for p in pages:
            if self.refcounts[p] == 0:
                assert self.cache is not None and self.cache.is_parked(p), f"sharing free page {p}"
                self.cache.unpark(p)
            self.refcounts[p] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drops one reference to each page; at 0 a cached page is parked, others are freed."""
        for p in pages:
            assert self.refcounts[p] > 0, f"double free of page {p}"
            self.refcounts[p] -= 1
            if self.refcounts[p] == 0:
                if self.cache is not None and self.cache.holds(p):
                    self.cache.park(p)
                else:
                    self._free.append(p)

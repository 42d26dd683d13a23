"""Page allocator with reference counts (host side, no jax).

Pages 1..num_pages-1 are handed out; page 0 is the padding sink and never allocated. A page
is free exactly when its refcount is 0. Refcounts above 1 come from sharing (prefix cache,
n > 1 requests sharing a prompt).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from ksana_jax.kv_cache import SINK_PAGE


class PageManager:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the sink), got {num_pages}")
        self.num_pages = num_pages
        self.refcounts = [0] * num_pages
        self._free = deque(p for p in range(num_pages) if p != SINK_PAGE)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n fresh pages with refcount 1; raises if fewer are free (check can_allocate)."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self.refcounts[p] = 1
        return pages

    def share(self, pages: Iterable[int]) -> None:
        for p in pages:
            assert self.refcounts[p] > 0, f"sharing free page {p}"
            self.refcounts[p] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drops one reference to each page; pages reaching 0 become free."""
        for p in pages:
            assert self.refcounts[p] > 0, f"double free of page {p}"
            self.refcounts[p] -= 1
            if self.refcounts[p] == 0:
                self._free.append(p)

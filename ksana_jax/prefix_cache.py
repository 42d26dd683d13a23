"""Prefix cache: full KV pages found again by a chained hash of what they hold (host, no jax).

A page's K/V depend on its own tokens and on every token before it, so a full page is named
by a chained hash,

    hash(page i) = sha256(hash(page i - 1) || token ids of page i)
    hash(page -1) = sha256(cache salt)      (whatever else changes K/V, e.g. a LoRA id)

which makes two pages with equal hashes interchangeable. sha256 rather than Python's `hash`:
one request must not be able to craft a prompt that collides with another's pages.

In: the scheduler inserts a request's pages once every token in them has been computed
(`insert`), and looks up a new request's prompt (`lookup`: the longest run of its leading full
pages that are cached). Out: page ids the scheduler shares by refcount (PageManager.share).
The PageManager parks a cached page whose refcount drops to 0 on this cache's LRU list
instead of freeing it (`park`); a hit takes it off again (`unpark`); when no free page is
left, the least recently released one is evicted (`evict`), which forgets its hash.

Invariants: a hash names at most one page and a page has at most one hash; the LRU list
holds exactly the cached pages nobody references.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence


def root_hash(cache_salt: str = "") -> bytes:
    """The parent hash of a sequence's first page."""
    return hashlib.sha256(b"ksana-jax prefix cache v1\0" + cache_salt.encode()).digest()


def page_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The chained hash of one full page: its parent page's hash and its token ids."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def page_hashes(token_ids: Sequence[int], page_size: int, cache_salt: str = "") -> Iterator[bytes]:
    """Hashes of the full pages of `token_ids`, in order, computed lazily."""
    parent = root_hash(cache_salt)
    for i in range(len(token_ids) // page_size):
        parent = page_hash(parent, token_ids[i * page_size : (i + 1) * page_size])
        yield parent


class PrefixCache:
    """hash <-> page maps of full, computed pages, and the LRU list of unreferenced ones."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self._page_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # oldest release first
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._page_of)

    @property
    def num_parked(self) -> int:
        """Cached pages nobody references: reusable, and counted as free."""
        return len(self._lru)

    def holds(self, page: int) -> bool:
        return page in self._hash_of

    def is_parked(self, page: int) -> bool:
        return page in self._lru

    def page_of(self, page_hash_: bytes) -> int | None:
        return self._page_of.get(page_hash_)

    def items(self) -> list[tuple[bytes, int]]:
        """(hash, page) pairs, for tests and introspection."""
        return list(self._page_of.items())

    def lookup(
        self, token_ids: Sequence[int], max_pages: int, cache_salt: str = ""
    ) -> tuple[list[int], list[bytes]]:
        """The pages holding the longest cached run of `token_ids`' leading full pages.

        Walks at most `max_pages` pages and stops at the first miss. Returns the hit pages
        and their hashes (the parent chain the caller continues from).
        """
        pages: list[int] = []
        hashes: list[bytes] = []
        for h in page_hashes(token_ids[: max_pages * self.page_size], self.page_size, cache_salt):
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
            hashes.append(h)
        return pages, hashes

    def insert(self, page: int, page_hash_: bytes) -> bool:
        """Names `page` by `page_hash_`; False (and nothing changes) when the hash already
        names another page -- two requests computed the same prefix -- or `page` has a name."""
        if page_hash_ in self._page_of or page in self._hash_of:
            return False
        self._page_of[page_hash_] = page
        self._hash_of[page] = page_hash_
        return True

    def park(self, page: int) -> None:
        """A cached page's refcount dropped to 0: it stays cached, last in line for reuse."""
        assert page in self._hash_of and page not in self._lru, f"parking page {page}"
        self._lru[page] = None

    def unpark(self, page: int) -> None:
        """A parked page was hit: it is referenced again and no longer evictable."""
        del self._lru[page]

    def evict(self) -> int:
        """Forgets the least recently released parked page and returns it (now plain free)."""
        page, _ = self._lru.popitem(last=False)
        del self._page_of[self._hash_of.pop(page)]
        self.num_evictions += 1
        return page

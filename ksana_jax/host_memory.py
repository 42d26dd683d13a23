"""Host memory: make glibc's malloc keep freed blocks for the next XLA:CPU step, and put
the weights that every step reads on huge pages (`back_with_huge_pages`, at the engine's start).

XLA:CPU allocates every execution's temporaries as one block (113 MB for the 64-row step
of a 49,152-token vocabulary: the sampler's [rows, vocab] passes and the prompt-logprob
projection) and frees it when the step ends. glibc serves a block that large with a fresh
`mmap` from the runtime's worker threads, so every step page-faults in each page it touches:
the LM head's float32 logits alone are 12.6 MB, ~3,300 faults and ~6 ms of kernel time a
step (measured: benchmarks/host_overhead.py, tiny model, 64 rows), more than the product
itself (~5 ms). vLLM-CPU avoids the same cost by preloading tcmalloc into its workers.

`keep_freed_blocks` does it in-process with `mallopt`: no `mmap` for large blocks and no
trimming, so the step's block is reused from the heap and its pages stay mapped. Each
thread keeps its own arena. With one arena for all (as this module set before: every block
kept, the main arena's), the engine's thread dispatching a step and XLA's threads running
the last one queued on its lock, and a thread put to sleep there waits for a core: SmolLM2
int4 at batch 1 on 2 cores decoded 125-142 tok/s against 147-163 (median of 5, three
alternating rounds). The price: glibc maps a block larger than a thread's arena heap (64 MB)
afresh whatever the setting, so such a step still faults it in; the tiny model's 256-row
step (benchmarks/host_overhead.py) takes ~710 faults against 20-190 with one arena and
13,200 without the setting, and decodes as fast as with one arena.
The cost: freed memory is kept by the process for reuse rather than returned to the system
(its resident size stays at its peak). It runs when this module is imported, first thing
in `import ksana_jax`, before the JAX CPU runtime allocates its blocks (one mapped before
would be unmapped when freed); `KSANA_JAX_KEEP_FREED_MEMORY=0` in the environment turns it
off.

Only where JAX will compute on the CPU: `JAX_PLATFORMS` says cpu, or it is unset and the
machine has no GPU or TPU device files. With an accelerator the step's temporaries live in
device memory, and a host that stages a checkpoint through its RAM should get that memory
back (`KSANA_JAX_KEEP_FREED_MEMORY=1` forces the setting there).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys

ENV = "KSANA_JAX_KEEP_FREED_MEMORY"

# glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4

# Device files of NVIDIA GPUs and TPUs (v2-v4 /dev/accel*, v5e and later /dev/vfio).
ACCELERATOR_FILES = ("nvidia[0-9]*", "accel[0-9]*", "vfio/[0-9]*")


def computes_on_cpu(environ=os.environ, dev: str = "/dev") -> bool:
    """Whether JAX will compute on the CPU, judged without starting it: `JAX_PLATFORMS`
    names cpu first, or is unset and `dev` has no GPU or TPU device files."""
    platforms = environ.get("JAX_PLATFORMS", "").strip().lower()
    if platforms:
        return platforms.split(",")[0] == "cpu"
    return not any(glob.glob(os.path.join(dev, pattern)) for pattern in ACCELERATOR_FILES)


def keep_freed_blocks() -> bool:
    """Sets glibc's malloc to keep freed blocks (see the module docstring); True when it
    did, False where it does not apply (not Linux with glibc; an accelerator, unless
    `KSANA_JAX_KEEP_FREED_MEMORY` is 1) or `KSANA_JAX_KEEP_FREED_MEMORY` is 0, false, off
    or no."""
    setting = os.environ.get(ENV, "").strip().lower()
    if setting in ("0", "false", "off", "no"):
        return False
    if setting not in ("1", "true", "on", "yes") and not computes_on_cpu():
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    # glibc only (musl's mallopt does nothing)
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    done = [
        mallopt(_M_MMAP_MAX, 0),
        mallopt(_M_TRIM_THRESHOLD, 2**31 - 1),
    ]
    return all(done)


KEPT = keep_freed_blocks()

# linux/mman.h
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25  # Linux 6.1
HUGE_PAGE = 2 << 20  # x86-64's and arm64's (4 KB base pages) transparent huge page
HUGE_PAGES_ENV = "KSANA_JAX_HUGE_PAGES"


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


def huge_page_ranges(spans) -> list[tuple[int, int]]:
    """The 2 MiB-aligned ranges that cover the (address, bytes) spans, overlapping or
    touching ones merged."""
    ranges: list[tuple[int, int]] = []
    for start, size in sorted(spans):
        if size <= 0:
            continue
        lo = start // HUGE_PAGE * HUGE_PAGE
        hi = -(-(start + size) // HUGE_PAGE) * HUGE_PAGE
        if ranges and lo <= ranges[-1][1]:
            ranges[-1] = (ranges[-1][0], max(ranges[-1][1], hi))
        else:
            ranges.append((lo, hi))
    return ranges


def back_with_huge_pages(arrays) -> int:
    """Moves the CPU buffers of `arrays` (a pytree of jax.Arrays: a model's params) onto
    transparent huge pages; returns the bytes of the 2 MiB pages it collapsed (0 where the
    system cannot: not Linux, a kernel before 6.1, THP set to never). MADV_COLLAPSE is best
    effort: a 2 MiB page across two of the heap's mappings, or one without 2 MiB of free
    contiguous memory to go to, stays on 4 KB pages.

    A decode step reads every weight once: on 4 KB pages a page-table walk every 4 KB (the
    TLB reaches a few MB, a model's weights are tens of MB to GBs; in a virtual machine each
    walk is two tables'), and the hardware prefetcher stops at every 4 KB boundary. glibc's
    heap, where XLA:CPU's buffers live (keep_freed_blocks), gets huge pages only where
    someone asked (THP's default mode is "madvise"; numpy asks for its own large arrays, so
    which weights landed on huge pages was chance). Each buffer's range, widened to whole
    2 MiB pages (the neighbours in them are other buffers of the heap: a huge page changes
    how memory is mapped, not what it holds), is marked MADV_HUGEPAGE and collapsed now
    (MADV_COLLAPSE, a copy: ~0.2 s for SmolLM2's 84 MB of int4 weights, ~2.5 s a GB on this
    VM, once, at the engine's start). SmolLM2 int4 at batch 1, 2 cores, three alternating
    rounds: median 230-248 -> 237-249 tok/s, best-3 237-257 -> 255-265. The KV cache is
    left as it is: 2 GiB took 5.3 s, and attention's reads were not measured to gain.
    `KSANA_JAX_HUGE_PAGES=0` (or false, off, no) in the environment turns it off."""
    import jax  # not at the top: this module runs before JAX is set up (see above)

    if os.environ.get(HUGE_PAGES_ENV, "").strip().lower() in ("0", "false", "off", "no"):
        return 0
    madvise = _madvise()
    if madvise is None:
        return 0
    spans = []
    for leaf in jax.tree.leaves(arrays):
        if not isinstance(leaf, jax.Array):
            continue
        for shard in leaf.addressable_shards:
            if shard.device.platform != "cpu":
                continue
            data = shard.data
            spans.append((data.unsafe_buffer_pointer(), data.nbytes))
    collapsed = 0
    for lo, hi in huge_page_ranges(spans):
        madvise(lo, hi - lo, _MADV_HUGEPAGE)  # a hint: parts outside the heap just refuse it
        for page in range(lo, hi, HUGE_PAGE):  # one at a time: one that cannot, the rest can
            if madvise(page, HUGE_PAGE, _MADV_COLLAPSE) == 0:
                collapsed += HUGE_PAGE
    return collapsed

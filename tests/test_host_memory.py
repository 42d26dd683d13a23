"""host_memory.py: with `import ksana_jax`, XLA:CPU's large per-execution blocks are reused
from the heap instead of being mapped afresh (and page-faulted in) on every call; with
KSANA_JAX_KEEP_FREED_MEMORY=0 they are not. Each case runs in a fresh interpreter, since the
setting must precede the JAX CPU runtime's threads."""

import json
import os
import subprocess
import sys

import pytest

from ksana_jax import host_memory

# 40 MB out of every call: over glibc's largest mmap threshold (32 MB), so without the
# setting each call maps (and faults in) a new block; within a thread's arena heap (64 MB),
# where the setting keeps it (glibc maps a larger block from a thread other than the main
# one whatever the setting: see host_memory.py).
SCRIPT = """
import json, resource
import ksana_jax, jax, jax.numpy as jnp
from ksana_jax import host_memory
f = jax.jit(lambda x: x * 2.0)
x = jnp.ones(10 * 2**20, jnp.float32)
for _ in range(20):  # the heap settles after a few blocks (glibc keeps ~10 of these)
    f(x).block_until_ready()
counts = []
for _ in range(9):  # the median call: a result freed late now and then grows the heap once
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
faults = sorted(counts)[len(counts) // 2]
print(json.dumps({"kept": host_memory.KEPT, "faults": faults, "pages": x.nbytes // 4096}))
"""


def _run(env_value: str | None) -> dict:
    env = dict(os.environ)
    env.pop("KSANA_JAX_KEEP_FREED_MEMORY", None)
    if env_value is not None:
        env["KSANA_JAX_KEEP_FREED_MEMORY"] = env_value
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc only")
def test_large_blocks_are_reused_not_faulted_in_each_call():
    kept = _run(None)
    assert kept["kept"] is True
    assert kept["faults"] < kept["pages"] / 10, kept
    off = _run("0")
    assert off["kept"] is False
    assert off["faults"] > off["pages"] / 2, off


def test_only_where_jax_computes_on_the_cpu(tmp_path):
    from ksana_jax.host_memory import computes_on_cpu

    assert computes_on_cpu({}, str(tmp_path))  # no device files
    assert computes_on_cpu({"JAX_PLATFORMS": "cpu"}, str(tmp_path))
    assert not computes_on_cpu({"JAX_PLATFORMS": "cuda,cpu"}, str(tmp_path))
    (tmp_path / "nvidia0").touch()
    assert not computes_on_cpu({}, str(tmp_path))
    assert computes_on_cpu({"JAX_PLATFORMS": "cpu"}, str(tmp_path))
    (tmp_path / "nvidia0").unlink()
    (tmp_path / "vfio").mkdir()
    (tmp_path / "vfio" / "0").touch()  # a TPU v5e's
    assert not computes_on_cpu({}, str(tmp_path))


def test_huge_page_ranges_cover_and_merge():
    mib = 1 << 20
    # a span inside one huge page; one across a boundary; one touching the last: merged
    assert host_memory.huge_page_ranges([(3 * mib, mib)]) == [(2 * mib, 4 * mib)]
    assert host_memory.huge_page_ranges([(3 * mib, 2 * mib)]) == [(2 * mib, 6 * mib)]
    spans = [(9 * mib, mib), (3 * mib, 2 * mib), (6 * mib, 1), (20 * mib, 0)]
    assert host_memory.huge_page_ranges(spans) == [(2 * mib, 10 * mib)]
    assert host_memory.huge_page_ranges([(0, mib), (4 * mib, mib)]) == [
        (0, 2 * mib),
        (4 * mib, 6 * mib),
    ]


# In a fresh interpreter: a long-lived one (a test run) has its heap split into many small
# mappings (numpy marks its own large arrays MADV_HUGEPAGE, page by page), and a 2 MiB page
# across two mappings cannot be collapsed; the engine moves its weights right after loading.
# The weights are JAX's own buffer (numpy's arrays are on huge pages already where THP allows).
HUGE_SCRIPT = """
import json
import numpy as np
import jax, jax.numpy as jnp
from ksana_jax import host_memory

def huge_kb_around(address):
    found = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                lo, hi = (int(v, 16) for v in fields[0].split("-"))
                found = lo <= address < hi
            elif found and fields[0] == "AnonHugePages:":
                return int(fields[1])
    raise AssertionError(hex(address))

w = jax.jit(lambda: jnp.arange(6 << 20, dtype=jnp.float32) * 2.0)()  # 24 MiB
middle = w.unsafe_buffer_pointer() + w.nbytes // 2
before = huge_kb_around(middle)
collapsed = host_memory.back_with_huge_pages({"w": w, "none": None})
after = huge_kb_around(middle)
same = bool(np.array_equal(np.asarray(w), np.arange(6 << 20, dtype=np.float32) * 2.0))
print(json.dumps({"collapsed": collapsed, "before": before, "after": after, "same": same}))
"""


def _collapse_supported() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return False
        release = tuple(int(v) for v in os.uname().release.split(".")[:2])
    except (OSError, ValueError):
        return False
    return release >= (6, 1)


def _run_huge(env_value: str | None) -> dict:
    env = dict(os.environ)
    env.pop(host_memory.HUGE_PAGES_ENV, None)
    if env_value is not None:
        env[host_memory.HUGE_PAGES_ENV] = env_value
    out = subprocess.run(
        [sys.executable, "-c", HUGE_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not _collapse_supported(), reason="MADV_COLLAPSE: Linux 6.1, THP on")
def test_weights_move_onto_huge_pages_and_keep_their_values():
    result = _run_huge(None)
    # MADV_COLLAPSE is best effort (a huge page needs 2 MiB of free contiguous memory), so
    # not every page must make it; but the buffer's mapping gains huge pages, and they hold
    # the same values
    assert result["collapsed"] >= 2 * host_memory.HUGE_PAGE, result
    assert result["after"] >= result["before"] + 2 * 1024, result
    assert result["same"], result
    off = _run_huge("0")  # KSANA_JAX_HUGE_PAGES=0: nothing is touched
    assert off["collapsed"] == 0 and off["after"] == off["before"], off
    assert off["same"], off

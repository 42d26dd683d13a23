"""host_memory.py: with `import ksana_jax`, XLA:CPU's large per-execution blocks are reused
from the heap instead of being mapped afresh (and page-faulted in) on every call; with
KSANA_JAX_KEEP_FREED_MEMORY=0 they are not. Each case runs in a fresh interpreter, since the
setting must precede the JAX CPU runtime's threads."""

import json
import os
import subprocess
import sys

import pytest

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

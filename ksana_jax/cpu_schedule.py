"""XLA:CPU's program order: thunks one after another, not concurrently (set on import).

XLA:CPU orders a program for concurrency by default: thunks that do not depend on each other
run at once on its intra-op pool's threads. A decode step at a few rows is a chain of the
C++ kernels' calls (pallas_kernels/linear_cpu.py, ragged_paged_attention_cpu.py), which
share the cores through their own pool (cpu_pool.h); a thunk XLA runs beside them takes a
core from a product, whose items then run on its caller alone. Ordered for one thread, the
chain's thunks run one after another and the kernels' pool has the other cores.

Measured (2026-12-05, 2 cores, SmolLM2 from the demo checkpoint, one process per setting,
taken in turn, 3 runs a process): int4 at 1 row decoding 128 tokens, 175-202 tok/s with
concurrency (KSANA_JAX_SEQUENTIAL_CPU_SCHEDULE=0) against 201-250 in one thread's order,
every one of 3 rounds faster so (earlier, XLA_FLAGS set by hand: 156-229 against 199-258,
8 rounds, likewise). Neutral within this machine's noise: int4 at 16 rows (468-558 against
452-543), bfloat16 at 64 rows (534-640 against 526-625) and at 1 row (88-109 against
95-102). The option is read from XLA_FLAGS only: `jax.jit(..., compiler_options=...)`
naming it compiled the same program.

`sequential_cpu_schedule` appends `--xla_cpu_enable_concurrency_optimized_scheduler=false`
to XLA_FLAGS when `import ksana_jax` runs it, where JAX will compute on the CPU
(host_memory.computes_on_cpu), before JAX starts its CPU backend (XLA reads the variable
then; a process that has already run JAX keeps its order), and not when XLA_FLAGS names the
option already or `KSANA_JAX_SEQUENTIAL_CPU_SCHEDULE` is 0. Only for the jaxlib versions in
KNOWN: XLA ends the process on a flag it does not know.
"""

from __future__ import annotations

import importlib.metadata
import os

from ksana_jax.host_memory import computes_on_cpu

OPTION = "xla_cpu_enable_concurrency_optimized_scheduler"
ENV = "KSANA_JAX_SEQUENTIAL_CPU_SCHEDULE"
# jaxlib versions [low, high) whose XLA has OPTION (tested with 0.10.2).
KNOWN = ((0, 10, 2), (0, 11))


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for part in text.split("."):
        digits = "".join(c for c in part if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def sequential_cpu_schedule(environ=os.environ, jaxlib_version: str | None = None) -> bool:
    """Appends OPTION=false to `environ`'s XLA_FLAGS (see the module docstring); True when
    it did."""
    if environ.get(ENV, "").strip().lower() in ("0", "false", "off", "no"):
        return False
    flags = environ.get("XLA_FLAGS", "")
    if OPTION in flags or not computes_on_cpu(environ):
        return False
    if jaxlib_version is None:
        try:
            jaxlib_version = importlib.metadata.version("jaxlib")
        except importlib.metadata.PackageNotFoundError:
            return False
    low, high = KNOWN
    if not low <= _version(jaxlib_version) < high:
        return False
    environ["XLA_FLAGS"] = f"{flags} --{OPTION}=false".strip()
    return True


sequential_cpu_schedule()

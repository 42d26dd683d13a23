"""The jitted forward step without sampling: a ragged batch in, logits of chosen tokens and
the KV out. `Model.logits` and single-request `generate` use it; the engine's step is the
runner's programs (step_programs.py).

`cfg` is static (hashable config); the KV array is donated, so XLA writes the new K/V in
place and the compiled step holds no second KV-sized buffer. Shapes come only from the
inputs' sizes.
"""

from __future__ import annotations

import functools

import jax

from ksana_jax.config import ModelConfig
from ksana_jax.kv_cache import KVCache
from ksana_jax.models import registry
from ksana_jax.step_inputs import StepInputs


@functools.partial(jax.jit, static_argnames=("cfg", "backend"), donate_argnames=("kv",))
def logits_step(
    params: registry.Params,
    cfg: ModelConfig,
    kv: KVCache,
    inputs: StepInputs,
    logits_indices: jax.Array,
    backend: str = "reference",
) -> tuple[jax.Array, KVCache]:
    """Forward over the step's T tokens; logits f32[R, V] at token slots logits_indices i32[R].
    `backend` is the attention backend (see registry.forward)."""
    hidden, kv = registry.forward(params, cfg, kv, inputs, backend)
    return registry.logits(params, cfg, hidden[logits_indices]), kv

"""The engine step lowered for an accelerator that is only described, for the ahead-of-time
compile tools (gpu_aot_compile.py, tpu_kernel_compile.py): one decode bucket of the given
model, traced as the runner would trace it on that platform."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp

from ksana_jax import runner
from ksana_jax.batch import pack
from ksana_jax.config import EngineConfig
from ksana_jax.kv_cache import kv_shardings

# A 32-row decode bucket over contexts up to 1024 tokens.
DECODE_BUCKET = dict(
    max_model_len=1024,
    num_pages=1024,
    max_num_seqs=32,
    max_num_batched_tokens=32,
    token_buckets=(32,),
    seq_buckets=(32,),
    context_buckets=(1024,),
)


def placed(tree, sharding):
    """Shapes of `tree` (arrays or shapes) on `sharding` (or a Format)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def lower_decode_step(
    model, backend: str, platform: str, sharding, *, kv_sharding=None, step=None, **config
) -> tuple[jax.stages.Lowered, jax.ShapeDtypeStruct]:
    """The engine step (`step`, runner.engine_step by default) with attention `backend`,
    lowered for `platform` ("gpu", "tpu") with every argument on `sharding`, the KV on
    `kv_sharding` if given; `config`: more EngineConfig fields. Returns it and the KV's
    shape. The runner is built on this CPU for its shapes only; jax.default_backend says
    `platform` meanwhile, so the model traces the compiled kernels, not the interpreter."""
    config = EngineConfig(**DECODE_BUCKET, attention_backend=backend, **config)
    step_runner = runner.ModelRunner(model, config)
    buffers, layout = pack(
        step_runner.padding_inputs(
            config.max_num_batched_tokens, config.max_num_seqs, config.max_model_len
        )
    )
    kv = step_runner.kv
    if kv_sharding is None:
        placed_kv = placed(kv, sharding)
    else:  # the pages' sharding or Format; the scales alike (kv_cache.kv_shardings)
        placed_kv = jax.tree.map(placed, kv, kv_shardings(kv_sharding))
    default_backend = jax.default_backend
    jax.default_backend = lambda: platform
    try:
        lowered = (step or runner.engine_step).lower(
            placed(model.params, sharding),
            model.config,
            placed_kv,
            placed(step_runner.state, sharding),
            placed(buffers, sharding),
            layout,
            config.max_logprobs,
            backend,
            None,  # no draft model: its params, KV, config; k
            None,
            None,
            0,
        )
    finally:
        jax.default_backend = default_backend
    return lowered, jax.ShapeDtypeStruct(kv.pages.shape, kv.pages.dtype)


def whole_kv_copies(hlo_text: str, kv: jax.ShapeDtypeStruct) -> int:
    """How many copies of the whole KV array the compiled HLO makes."""
    hlo_type = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}[jnp.dtype(kv.dtype).name]
    kv_type = hlo_type + str(list(kv.shape)).replace(" ", "")
    return len(re.findall(re.escape(kv_type) + r"\{[^}]*\} copy\(", hlo_text))

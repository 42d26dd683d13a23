"""Llama-family decoder (Llama 2/3.x, Mistral, Qwen2/2.5, SmolLM2) as pure functions.

`forward(params, cfg, kv, inputs)` runs one ragged step: it embeds the step's new tokens,
runs the decoder layers, each attending through the page tables to earlier tokens' K/V,
then writes every layer's new K/V into the paged KV array at once (in place, the array is
donated) and returns the final hidden states and the updated KV. `logits` projects chosen
hidden states onto the vocabulary. Nothing is cached inside the model and no mode is fixed
at construction.

The layers are a Python loop over per-layer weight buffers, not a `lax.scan` over stacked
weights. Measured on XLA:CPU (jax 0.10.2, this repo's 2-core AVX512/AMX machine): a
bfloat16 matmul whose weight is a slice of a stacked array, or that sits inside a while
loop, misses the fast oneDNN path -- 30 layers of [576, 4608] bf16 weights at 16 tokens
take 115 ms under `lax.scan` and 15 ms unrolled over separate buffers (float32: ~40-55 ms
either way). Unrolling costs compile time (SmolLM2, 30 layers: ~4 s per bucket instead of
~1.5 s), which warm-up pays once and the persistent compilation cache amortises. The
checkpoint keeps the stacked layout; `params_from_flat` splits it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ksana_jax import pallas_kernels
from ksana_jax.config import ModelConfig
from ksana_jax.kv_cache import to_kv_dtype
from ksana_jax.models.layers import apply_rope, linear, rms_norm, rope_inv_freq, swiglu_mlp
from ksana_jax.pallas_kernels.attention_spec import AttentionSpec
from ksana_jax.step_inputs import StepInputs


@struct.dataclass
class LayerParams:
    """One decoder layer's weights; matrices are [out, in] (see `layers.linear`)."""

    attn_norm: jax.Array  # [D]
    wq: jax.Array  # [N*H, D]
    wk: jax.Array  # [K*H, D]
    wv: jax.Array  # [K*H, D]
    wo: jax.Array  # [D, N*H]
    mlp_norm: jax.Array  # [D]
    w_gate: jax.Array  # [F, D]
    w_up: jax.Array  # [F, D]
    w_down: jax.Array  # [D, F]
    bq: jax.Array | None = None  # [N*H]  (qkv_bias)
    bk: jax.Array | None = None  # [K*H]
    bv: jax.Array | None = None  # [K*H]
    bo: jax.Array | None = None  # [D]    (o_bias)


@struct.dataclass
class LlamaParams:
    embed: jax.Array  # [V, D]
    layers: tuple[LayerParams, ...]  # L separate layers (see the module docstring)
    final_norm: jax.Array  # [D]
    lm_head: jax.Array | None = None  # [V, D]; None when tied to embed


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Flat name -> shape of every parameter (the checkpoint's keys; layers stacked on L)."""
    n_layers, d, f = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size
    q_dim = cfg.num_attention_heads * cfg.head_dim
    kv_dim = cfg.num_key_value_heads * cfg.head_dim
    shapes = {
        "embed": (cfg.vocab_size, d),
        "final_norm": (d,),
        "layers.attn_norm": (n_layers, d),
        "layers.wq": (n_layers, q_dim, d),
        "layers.wk": (n_layers, kv_dim, d),
        "layers.wv": (n_layers, kv_dim, d),
        "layers.wo": (n_layers, d, q_dim),
        "layers.mlp_norm": (n_layers, d),
        "layers.w_gate": (n_layers, f, d),
        "layers.w_up": (n_layers, f, d),
        "layers.w_down": (n_layers, d, f),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, d)
    if cfg.qkv_bias:
        shapes |= {
            "layers.bq": (n_layers, q_dim),
            "layers.bk": (n_layers, kv_dim),
            "layers.bv": (n_layers, kv_dim),
        }
    if cfg.o_bias:
        shapes["layers.bo"] = (n_layers, d)
    return shapes


def params_from_flat(flat: dict[str, jax.Array]) -> LlamaParams:
    """Builds the params pytree from flat names, splitting layer-stacked arrays per layer."""
    stacked = {k.removeprefix("layers."): v for k, v in flat.items() if k.startswith("layers.")}
    num_layers = len(stacked["wq"])
    layers = tuple(
        LayerParams(**{name: value[i] for name, value in stacked.items()})
        for i in range(num_layers)
    )
    return LlamaParams(
        embed=flat["embed"],
        layers=layers,
        final_norm=flat["final_norm"],
        lm_head=flat.get("lm_head"),
    )


def params_to_flat(params: LlamaParams) -> dict[str, jax.Array]:
    """Inverse of params_from_flat (layers stacked again); absent parameters are left out."""
    flat = {"embed": params.embed, "final_norm": params.final_norm, "lm_head": params.lm_head}
    xp = np if isinstance(params.embed, np.ndarray) else jnp
    for name in LayerParams.__dataclass_fields__:
        values = [getattr(layer, name) for layer in params.layers]
        flat[f"layers.{name}"] = None if values[0] is None else xp.stack(values)
    return {k: v for k, v in flat.items() if v is not None}


def init_params(cfg: ModelConfig, seed: int = 0, dtype: str = "float32") -> LlamaParams:
    """Random weights (normal, std 0.02; norms around 1) for tests and benchmarks."""
    rng = np.random.default_rng(seed)
    flat = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith("norm"):
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            value = 0.02 * rng.standard_normal(shape)
        flat[name] = jnp.asarray(value, dtype=dtype)
    return params_from_flat(flat)


def _decoder_layer(
    cfg: ModelConfig,
    inputs: StepInputs,
    kv: jax.Array,
    x: jax.Array,
    layer_index: int,
    layer: LayerParams,
    backend: str,
) -> tuple[jax.Array, jax.Array]:
    """One decoder layer: x f32[T, D] -> f32[T, D], and kv with this layer's new K/V written.

    The write comes first and attention reads the written array (earlier tokens from the
    pages, this step's from k_new/v_new). That data dependency orders each layer's page
    reads before the next layer's write, so XLA updates the donated KV in place; reading
    first and writing after lets it schedule the write early and copy the whole array.
    """
    num_tokens = x.shape[0]
    n, k, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    inv_freq = rope_inv_freq(cfg)

    hidden = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
    q = linear(hidden, layer.wq, layer.bq).reshape(num_tokens, n, h)
    k_new = linear(hidden, layer.wk, layer.bk).reshape(num_tokens, k, h)
    v_new = linear(hidden, layer.wv, layer.bv).reshape(num_tokens, k, h)
    q = apply_rope(q, inputs.positions, inv_freq)
    k_new = apply_rope(k_new, inputs.positions, inv_freq)
    # Round through the KV dtype so this step attends to exactly what later steps will read.
    k_new, v_new = to_kv_dtype(k_new, kv.dtype), to_kv_dtype(v_new, kv.dtype)

    interpret = pallas_kernels.get_backend(backend).interpreted_here()
    write = pallas_kernels.get_layer_kv_writer(backend, interpret)
    kv = write(kv, layer_index, k_new, v_new, inputs.slot_ids)
    attn = pallas_kernels.get_attention(backend, interpret)(
        q,
        k_new,
        v_new,
        kv,
        jnp.int32(layer_index),
        inputs.page_table,
        inputs.seq_lens,
        inputs.query_starts,
        spec=AttentionSpec(h**-0.5),
    )
    x = x + linear(attn.reshape(num_tokens, n * h), layer.wo, layer.bo)

    hidden = rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)
    return x + swiglu_mlp(hidden, layer.w_gate, layer.w_up, layer.w_down), kv


def forward(
    params: LlamaParams,
    cfg: ModelConfig,
    kv: jax.Array,
    inputs: StepInputs,
    backend: str = "reference",
) -> tuple[jax.Array, jax.Array]:
    """One ragged step.

    Args:
      params: the model weights.
      cfg: static model configuration.
      kv: [L, 2, K, num_pages, page_size, H] paged KV (see kv_cache.py).
      inputs: the step's tokens and page tables (T tokens, S sequences).
      backend: attention backend, "reference" | "cpu" | "xla" | "pallas_tpu" | "pallas_gpu"
        (a Pallas backend on CPU runs in interpret mode: tests only).
    Returns: final-norm hidden states f32[T, D] and the updated kv.
    """
    x = params.embed[inputs.token_ids].astype(jnp.float32)  # [T, D]
    for i, layer in enumerate(params.layers):
        x, kv = _decoder_layer(cfg, inputs, kv, x, i, layer, backend)
    return rms_norm(x, params.final_norm, cfg.rms_norm_eps), kv


def logits(params: LlamaParams, hidden: jax.Array) -> jax.Array:
    """Vocabulary logits f32[R, V] of hidden states f32[R, D] (a separate LM head [V, D], or
    the embeddings [V, D] when tied)."""
    return linear(hidden, params.embed if params.lm_head is None else params.lm_head)

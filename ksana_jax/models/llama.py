"""Llama-family decoder (Llama 2/3.x, Mistral, Qwen2/2.5, SmolLM2) as pure functions.

`forward(params, cfg, kv, inputs)` runs one ragged step: it embeds the step's new tokens,
runs the decoder layers as one `lax.scan` over layer-stacked weights (compile time does not
grow with depth), writes each layer's new K/V into the paged KV array carried through the
scan (updated in place), attends through the page tables, and returns the final hidden
states and the updated KV. `logits` projects chosen hidden states onto the vocabulary.
Nothing is cached inside the model and no mode is fixed at construction.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ksana_jax.config import ModelConfig
from ksana_jax.models.layers import apply_rope, linear, rms_norm, rope_inv_freq, swiglu_mlp
from ksana_jax.pallas_kernels import reference
from ksana_jax.step_inputs import StepInputs


@struct.dataclass
class LayerParams:
    """Every decoder layer's weights stacked on a leading L axis; matrices are [in, out]."""

    attn_norm: jax.Array  # [L, D]
    wq: jax.Array  # [L, D, N*H]
    wk: jax.Array  # [L, D, K*H]
    wv: jax.Array  # [L, D, K*H]
    wo: jax.Array  # [L, N*H, D]
    mlp_norm: jax.Array  # [L, D]
    w_gate: jax.Array  # [L, D, F]
    w_up: jax.Array  # [L, D, F]
    w_down: jax.Array  # [L, F, D]
    bq: jax.Array | None = None  # [L, N*H]  (qkv_bias)
    bk: jax.Array | None = None  # [L, K*H]
    bv: jax.Array | None = None  # [L, K*H]
    bo: jax.Array | None = None  # [L, D]    (o_bias)


@struct.dataclass
class LlamaParams:
    embed: jax.Array  # [V, D]
    layers: LayerParams
    final_norm: jax.Array  # [D]
    lm_head: jax.Array | None = None  # [D, V]; None when tied to embed


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Flat name -> shape of every parameter this config has (the checkpoint's keys)."""
    n_layers, d, f = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size
    q_dim = cfg.num_attention_heads * cfg.head_dim
    kv_dim = cfg.num_key_value_heads * cfg.head_dim
    shapes = {
        "embed": (cfg.vocab_size, d),
        "final_norm": (d,),
        "layers.attn_norm": (n_layers, d),
        "layers.wq": (n_layers, d, q_dim),
        "layers.wk": (n_layers, d, kv_dim),
        "layers.wv": (n_layers, d, kv_dim),
        "layers.wo": (n_layers, q_dim, d),
        "layers.mlp_norm": (n_layers, d),
        "layers.w_gate": (n_layers, d, f),
        "layers.w_up": (n_layers, d, f),
        "layers.w_down": (n_layers, f, d),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (d, cfg.vocab_size)
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
    """Builds the params pytree from flat names (see param_shapes)."""
    layers = {k.removeprefix("layers."): v for k, v in flat.items() if k.startswith("layers.")}
    return LlamaParams(
        embed=flat["embed"],
        layers=LayerParams(**layers),
        final_norm=flat["final_norm"],
        lm_head=flat.get("lm_head"),
    )


def params_to_flat(params: LlamaParams) -> dict[str, jax.Array]:
    """Inverse of params_from_flat; absent (None) parameters are left out."""
    flat = {"embed": params.embed, "final_norm": params.final_norm, "lm_head": params.lm_head}
    for name in LayerParams.__dataclass_fields__:
        flat[f"layers.{name}"] = getattr(params.layers, name)
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
    layer_index: jax.Array,
    layer: LayerParams,
) -> tuple[jax.Array, jax.Array]:
    """One decoder layer: x f32[T, D] -> (f32[T, D], this layer's new K/V f32[2, T, K, H]).

    Reads earlier tokens' K/V from `kv`; the new K/V are returned, not written (see
    reference.py for why the write happens once after all layers).
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
    k_new, v_new = k_new.astype(kv.dtype), v_new.astype(kv.dtype)

    attn = reference.ragged_paged_attention(
        q,
        k_new,
        v_new,
        kv,
        layer_index,
        inputs.page_table,
        inputs.seq_lens,
        inputs.query_starts,
        sm_scale=h**-0.5,
    )
    x = x + linear(attn.reshape(num_tokens, n * h), layer.wo, layer.bo)

    hidden = rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)
    x = x + swiglu_mlp(hidden, layer.w_gate, layer.w_up, layer.w_down)
    return x, jnp.stack([k_new, v_new])


def forward(
    params: LlamaParams, cfg: ModelConfig, kv: jax.Array, inputs: StepInputs
) -> tuple[jax.Array, jax.Array]:
    """One ragged step.

    Args:
      params: the model weights.
      cfg: static model configuration.
      kv: [L, 2, K, num_pages, page_size, H] paged KV (see kv_cache.py).
      inputs: the step's tokens and page tables (T tokens, S sequences).
    Returns: final-norm hidden states f32[T, D] and the updated kv.
    """
    x = params.embed[inputs.token_ids].astype(jnp.float32)  # [T, D]

    def body(carry, layer):
        x, layer_index = carry
        x, new_kv = _decoder_layer(cfg, inputs, kv, x, layer_index, layer)
        return (x, layer_index + 1), new_kv

    (x, _), new_kv = jax.lax.scan(body, (x, jnp.int32(0)), params.layers)  # [L, 2, T, K, H]
    kv = reference.write_kv_pages(kv, new_kv, inputs.slot_ids)
    return rms_norm(x, params.final_norm, cfg.rms_norm_eps), kv


def logits(params: LlamaParams, hidden: jax.Array) -> jax.Array:
    """Vocabulary logits f32[R, V] of hidden states f32[R, D] (tied or separate LM head)."""
    if params.lm_head is not None:
        return linear(hidden, params.lm_head)
    embed = params.embed
    return jnp.einsum(
        "rd,vd->rv", hidden.astype(embed.dtype), embed, preferred_element_type=jnp.float32
    )

"""Llama-family decoder (Llama 2/3.x, Mistral, Qwen2/2.5, SmolLM2) as pure functions.

`forward(params, cfg, kv, inputs)` runs one ragged step: it embeds the step's new tokens,
runs the decoder layers, each writing its new K/V into the paged KV array (in place, the
array is donated) and attending through the page tables to earlier tokens' K/V, and returns
the final hidden states and the updated KV. `logits` projects chosen hidden states onto the
vocabulary. Nothing is cached inside the model and no mode is fixed at construction.

Options read from the config: q/k/v (and o) biases, q/k RMSNorm per head (`qk_norm`, used
by qwen3.py, which reuses this decoder), each layer's feed-forward, dense or mixture of
experts (`mlp_types`, moe.py; mixtral.py and qwen3_moe.py reuse the decoder), and per-layer
sliding windows (Mistral's
`sliding_window`, Qwen2's `use_sliding_window` above `max_window_layers`), which reach the
attention backend through each layer's static `AttentionSpec`.

The layers are a Python loop over per-layer weight buffers, not a `lax.scan` over stacked
weights: on XLA:CPU a bfloat16 matmul whose weight is a slice of a stacked array, or that
sits inside a while loop, misses the fast oneDNN path (measured several times slower).
Unrolling costs compile time per bucket, which warm-up pays once and the persistent
compilation cache amortises. The checkpoint keeps the stacked layout; the registry's
`params_from_flat` splits it. Quantized matrices that the CPU kernel multiplies stay stacked
(`registry.stack_layers`: the kernel reads its layer in place, no slice is copied); the loop
reads every layer through `registry.layer_params`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ksana_jax.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelConfig,
    gguf_common_fields,
    hf_common_fields,
    require_value,
)
from ksana_jax.kv_cache import KVCache
from ksana_jax.models.layers import (
    RMSNorm,
    embed_rows,
    linear,
    paged_attention,
    qkv_projection,
    rms_norm,
)
from ksana_jax.models.moe import feed_forward
from ksana_jax.models.registry import Family, LayerParams, Params, layer_params
from ksana_jax.step_inputs import StepInputs

# --------------------------------------------------------------------------- declarations


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
    if cfg.qk_norm:
        shapes |= {
            "layers.q_norm": (n_layers, cfg.head_dim),
            "layers.k_norm": (n_layers, cfg.head_dim),
        }
    return shapes


# Logical axes (sharding.py) of each parameter; matrices are [out, in].
PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("vocab", "embed"),
    "final_norm": ("embed",),
    "layers.attn_norm": ("layers", "embed"),
    "layers.mlp_norm": ("layers", "embed"),
    "layers.wq": ("layers", "q_heads", "embed"),
    "layers.wk": ("layers", "kv_heads", "embed"),
    "layers.wv": ("layers", "kv_heads", "embed"),
    "layers.wo": ("layers", "embed", "q_heads"),
    "layers.bq": ("layers", "q_heads"),
    "layers.bk": ("layers", "kv_heads"),
    "layers.bv": ("layers", "kv_heads"),
    "layers.bo": ("layers", "embed"),
    "layers.q_norm": ("layers", "head_dim"),
    "layers.k_norm": ("layers", "head_dim"),
    "layers.w_gate": ("layers", "mlp", "embed"),
    "layers.w_up": ("layers", "mlp", "embed"),
    "layers.w_down": ("layers", "embed", "mlp"),
    # fused at run time (fusion.py), split as their parts: wqkv by whole KV-head groups
    "layers.wqkv": ("layers", "kv_heads", "embed"),
    "layers.bqkv": ("layers", "kv_heads"),
    "layers.w_gate_up": ("layers", "mlp", "embed"),
}

# HF tensor name -> flat name. Matrices keep HF's (out, in) layout.
HF_TOP = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "final_norm",
    "lm_head.weight": "lm_head",
}
HF_LAYER = {
    "input_layernorm.weight": "layers.attn_norm",
    "self_attn.q_proj.weight": "layers.wq",
    "self_attn.k_proj.weight": "layers.wk",
    "self_attn.v_proj.weight": "layers.wv",
    "self_attn.o_proj.weight": "layers.wo",
    "self_attn.q_proj.bias": "layers.bq",
    "self_attn.k_proj.bias": "layers.bk",
    "self_attn.v_proj.bias": "layers.bv",
    "self_attn.o_proj.bias": "layers.bo",
    "self_attn.q_norm.weight": "layers.q_norm",
    "self_attn.k_norm.weight": "layers.k_norm",
    "post_attention_layernorm.weight": "layers.mlp_norm",
    "mlp.gate_proj.weight": "layers.w_gate",
    "mlp.up_proj.weight": "layers.w_up",
    "mlp.down_proj.weight": "layers.w_down",
}
# llama.cpp tensor name -> HF name (None: read by the config reader, not a parameter).
GGUF_TOP: dict[str, str | None] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": None,
}
GGUF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def sliding_layers(hf: Mapping[str, Any]) -> dict[str, Any]:
    """layer_types and sliding_window of a Qwen2/Qwen3 config: with use_sliding_window, layers
    from max_window_layers on slide (or `layer_types` as saved); without, none do."""
    num_layers = int(hf["num_hidden_layers"])
    if not hf.get("use_sliding_window"):
        return {}
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types") or [
        SLIDING_ATTENTION if i >= int(hf.get("max_window_layers", num_layers)) else FULL_ATTENTION
        for i in range(num_layers)
    ]
    return dict(layer_types=tuple(layer_types), sliding_window=window)


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Reads: the shared fields (config.hf_common_fields), hidden_act (silu), mlp_bias (false),
    attention_bias, sliding_window (mistral), use_sliding_window / max_window_layers /
    layer_types (qwen2), rope_freq_factors (ours, from a GGUF's rope_freqs.weight)."""
    model_type = hf["model_type"]
    require_value(hf, "hidden_act", ("silu",), default="silu")
    require_value(hf, "mlp_bias", (False,), default=False)
    bias = bool(hf.get("attention_bias", False))
    fields = hf_common_fields(hf)
    if model_type == "mistral" and hf.get("sliding_window") is not None:
        window = int(hf["sliding_window"])
        fields |= dict(layer_types=(SLIDING_ATTENTION,) * fields["num_hidden_layers"])
        fields |= dict(sliding_window=window)
    if model_type == "qwen2":
        fields |= sliding_layers(hf)
    factors = hf.get("rope_freq_factors")
    return ModelConfig(
        **fields,
        qkv_bias=model_type == "qwen2" or bias,
        o_bias=model_type != "qwen2" and bias,
        rope_freq_factors=None if factors is None else tuple(float(f) for f in factors),
    )


def config_from_gguf(
    metadata: Mapping[str, Any],
    tensor_names: set[str],
    dtype: str = "float32",
    read_tensor: Callable[[str], np.ndarray] | None = None,
) -> ModelConfig:
    """Reads the shared GGUF keys; `rope_freqs.weight` (Llama 3.1's rope factors) through
    `read_tensor`; refuses `{arch}.attention.sliding_window`."""
    arch = metadata["general.architecture"]
    if metadata.get(f"{arch}.attention.sliding_window"):
        raise ValueError(
            f"{arch}.attention.sliding_window is not supported for GGUF {arch}; "
            "supported: models without sliding-window attention (convert the HF checkpoint)"
        )
    fields = gguf_common_fields(metadata, tensor_names, dtype)
    factors = None
    if "rope_freqs.weight" in tensor_names:
        if read_tensor is None:
            raise ValueError("GGUF tensor rope_freqs.weight is present but was not read")
        factors = tuple(float(f) for f in np.asarray(read_tensor("rope_freqs.weight")).ravel())
        if len(factors) != fields["head_dim"] // 2:
            raise ValueError(
                f"GGUF tensor rope_freqs.weight has {len(factors)} values, expected "
                f"head_dim / 2 = {fields['head_dim'] // 2}"
            )
    return ModelConfig(**fields, qkv_bias=arch == "qwen2", rope_freq_factors=factors)


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation (interleaved -> rotate-half rotary)."""
    d_out = w.shape[0]
    head_dim = d_out // num_heads
    rest = w.shape[1:]
    return w.reshape(num_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(d_out, *rest)


def from_gguf(hf_name: str, value: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """llama.cpp permutes Q/K rows for its interleaved rotary, for the llama architecture only
    (not qwen2): undo it so the rotate-half rotary applies."""
    if cfg.model_type != "llama":
        return value
    return unpermute_qk(hf_name, value, cfg)


def unpermute_qk(hf_name: str, value: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """`value` with llama.cpp's Q/K row permutation undone when `hf_name` is wq or wk."""
    if not hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        return value
    heads = cfg.num_attention_heads if "q_proj" in hf_name else cfg.num_key_value_heads
    expected = (heads * cfg.head_dim, cfg.hidden_size)
    if value.shape != expected:
        raise ValueError(f"tensor {hf_name!r} has shape {value.shape}, expected {expected}")
    return unpermute_rows(value, heads)


# --------------------------------------------------------------------------- compute


def attention_block(
    cfg: ModelConfig,
    inputs: StepInputs,
    kv: KVCache,
    x: jax.Array,
    layer_index: int,
    layer: LayerParams,
    backend: str,
    norm_offset: float = 0.0,
    norm: RMSNorm | None = None,
    residual: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:
    """Projections, optional q/k norm, then rotary and paged attention (layers.paged_attention)
    of x f32[T, D] (normed by `norm` first when given) -> [residual +] the attention output
    projected back f32[T, D], and kv with this layer's K/V written. `norm_offset` is the q/k
    norms' (1.0 for Gemma's (1 + w) norms). The norm and the residual add run inside the
    products (layers.linear)."""
    num_tokens = x.shape[0]
    n, h = cfg.num_attention_heads, cfg.head_dim
    qkv = qkv_projection(cfg, layer, x, norm)  # [T, K, N/K + 2, H]
    if cfg.qk_norm:
        eps = cfg.rms_norm_eps
        qkv = jnp.concatenate(
            [
                rms_norm(qkv[:, :, :-2], layer["q_norm"], eps, norm_offset),
                rms_norm(qkv[:, :, -2:-1], layer["k_norm"], eps, norm_offset),
                qkv[:, :, -1:],
            ],
            axis=2,
        )
    attn, kv = paged_attention(cfg, inputs, kv, layer_index, qkv, backend)
    out = linear(attn.reshape(num_tokens, n * h), layer["wo"], layer.get("bo"), residual=residual)
    return out, kv


def forward(
    params: Params,
    cfg: ModelConfig,
    kv: KVCache,
    inputs: StepInputs,
    backend: str = "reference",
) -> tuple[jax.Array, KVCache]:
    """One ragged step.

    Args:
      params: the model weights (registry.Params).
      cfg: static model configuration.
      kv: the paged KV cache (kv_cache.KVCache: pages and scales).
      inputs: the step's tokens and page tables (T tokens, S sequences).
      backend: attention backend, "reference" | "cpu" | "xla" | "pallas_tpu" | "pallas_gpu"
        (a Pallas backend on CPU runs in interpret mode: tests only).
    Returns: final-norm hidden states f32[T, D] and the updated kv.
    """
    x = embed_rows(params["embed"], inputs.token_ids).astype(jnp.float32)  # [T, D]
    eps = cfg.rms_norm_eps
    for i, layer in enumerate(layer_params(params)):
        attn_norm = RMSNorm(layer["attn_norm"], eps)
        x, kv = attention_block(cfg, inputs, kv, x, i, layer, backend, norm=attn_norm, residual=x)
        x = feed_forward(cfg, i, layer, x, RMSNorm(layer["mlp_norm"], eps))  # dense or MoE
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), kv


def lm_head(params: Params) -> jax.Array:
    """The LM head [V, D]: a separate one, or the embeddings when tied."""
    return params.get("lm_head", params["embed"])


def logits(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Vocabulary logits f32[R, V] of hidden states f32[R, D]."""
    return linear(hidden, lm_head(params))


FAMILY = Family(
    name="llama",
    architectures={
        "llama": ("LlamaForCausalLM",),
        "mistral": ("MistralForCausalLM",),
        "qwen2": ("Qwen2ForCausalLM",),
    },
    gguf_architectures=("llama", "qwen2"),
    config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf,
    param_shapes=param_shapes,
    param_axes=PARAM_AXES,
    hf_top=HF_TOP,
    hf_layer=HF_LAYER,
    gguf_top=GGUF_TOP,
    gguf_layer=GGUF_LAYER,
    forward=forward,
    logits=logits,
    lm_head=lm_head,
    from_gguf=from_gguf,
)

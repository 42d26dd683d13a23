"""Gemma 2 and Gemma 3 (text) decoders as pure functions.

Differences from the Llama decoder (llama.py), all as transformers computes them:
- every RMSNorm scales by (1 + w) in float32 (weights stored around 0);
- four norms per layer: before and after attention, before and after the MLP (the "post"
  norms apply to the block's output before the residual add);
- GeGLU MLP (tanh-approximated gelu);
- embeddings multiplied by sqrt(D), rounded to the parameter dtype first;
- attention scores scaled by query_pre_attn_scalar ** -0.5, soft-capped (Gemma 2:
  attn_logit_softcapping), sliding-window layers alternating with global ones (Gemma 2:
  every other layer; Gemma 3: `layer_types`, five sliding to one global);
- final logits soft-capped (final_logit_softcapping; Gemma 3's attn_logit_softcapping is
  ignored, as transformers and llama.cpp ignore it);
- Gemma 3: q/k RMSNorm per head, a separate rope base for sliding layers (unscaled) and
  rope scaling on global ones.
A multimodal `gemma3` checkpoint (Gemma3ForConditionalGeneration) converts to its language
model: the vision tower and projector are skipped, with a warning that images are not
supported.

GGUF (llama.cpp's gemma2 / gemma3 architectures): llama.cpp's converter folds the +1 into
every `*norm.weight` and does not permute Q/K rows; it stores no query_pre_attn_scalar and
llama.cpp derives the scale from head sizes (27B models: D / N, others: H), no local rope
base (10000) and, unless `attention.sliding_window_pattern` says otherwise, the sliding
pattern 2 (gemma2) / 6 (gemma3).
"""

from __future__ import annotations

import warnings
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
    rope_from_parameters,
)
from ksana_jax.kv_cache import KVCache
from ksana_jax.models import llama
from ksana_jax.models.layers import RMSNorm, embed_rows, gated_mlp, linear, rms_norm, softcap
from ksana_jax.models.registry import Family, Params, layer_params
from ksana_jax.step_inputs import StepInputs

GELU_TANH = "gelu_pytorch_tanh"
PATTERN = {"gemma2": 2, "gemma3_text": 6}  # one global layer in every PATTERN layers
GGUF_MODEL_TYPE = {"gemma2": "gemma2", "gemma3": "gemma3_text"}
GGUF_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # llama.cpp's test for its D / N scale
GGUF_LOCAL_ROPE_THETA = 10000.0  # llama.cpp's rope_freq_base_train_swa for gemma3
GEMMA2_SOFTCAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}

# --------------------------------------------------------------------------- declarations


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Flat name -> shape: llama.py's parameters plus the post-attention and post-MLP norms."""
    n_layers, d = cfg.num_hidden_layers, cfg.hidden_size
    return llama.param_shapes(cfg) | {
        "layers.post_attn_norm": (n_layers, d),
        "layers.post_mlp_norm": (n_layers, d),
    }


PARAM_AXES = llama.PARAM_AXES | {
    "layers.post_attn_norm": ("layers", "embed"),
    "layers.post_mlp_norm": ("layers", "embed"),
}
HF_LAYER = llama.HF_LAYER | {
    "post_attention_layernorm.weight": "layers.post_attn_norm",
    "pre_feedforward_layernorm.weight": "layers.mlp_norm",
    "post_feedforward_layernorm.weight": "layers.post_mlp_norm",
}
GGUF_TOP = {k: v for k, v in llama.GGUF_TOP.items() if v is not None}
GGUF_LAYER = llama.GGUF_LAYER | {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def hf_rename(name: str) -> str | None:
    """A multimodal Gemma 3 checkpoint's language-model names as a text model's; its vision
    tower and projector are skipped (None)."""
    if name.startswith(_VISION_PREFIXES):
        return None
    for prefix in ("model.language_model.", "language_model.model."):
        if name.startswith(prefix):
            return "model." + name.removeprefix(prefix)
    return name.removeprefix("language_model.")  # language_model.lm_head.weight (4.x)


def _hidden_act(hf: Mapping[str, Any]) -> str:
    act = hf.get("hidden_activation") or hf.get("hidden_act") or GELU_TANH
    if act != GELU_TANH:
        raise ValueError(f"unsupported hidden_activation={act!r}; supported: ({GELU_TANH!r},)")
    return act


def _layer_types(hf: Mapping[str, Any], model_type: str) -> tuple[str, ...]:
    num_layers = int(hf["num_hidden_layers"])
    pattern = int(hf.get("sliding_window_pattern") or PATTERN[model_type])
    layer_types = hf.get("layer_types") or [
        SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers)
    ]
    return tuple(layer_types)


def _gemma3_rope(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 3's two rotary embeddings: 5.x `rope_parameters` keyed by layer type, or 4.x
    `rope_theta` + `rope_scaling` (global) and `rope_local_base_freq` (sliding)."""
    params = hf.get("rope_parameters") or {}
    if FULL_ATTENTION in params or SLIDING_ATTENTION in params:
        full = params.get(FULL_ATTENTION) or {}
        local = params.get(SLIDING_ATTENTION) or {}
        theta, scaling = rope_from_parameters(full, full.get("rope_theta"), 1_000_000.0)
        local_theta, local_scaling = rope_from_parameters(local, local.get("rope_theta"))
        if local_scaling is not None:
            raise ValueError(
                f"unsupported rope_parameters.sliding_attention rope_type "
                f"{local_scaling.rope_type!r}; supported: default"
            )
    else:
        theta, scaling = rope_from_parameters(
            hf.get("rope_scaling") or {}, hf.get("rope_theta"), 1_000_000.0
        )
        local_theta = float(hf.get("rope_local_base_freq") or 10000.0)
    return dict(rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta)


# Gemma3TextConfig's defaults: a multimodal checkpoint's text_config lists only the fields
# that differ from them (gemma-3-4b: hidden, MLP and layer sizes, rope scaling, window).
GEMMA3_TEXT_DEFAULTS = dict(
    vocab_size=262208,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    rms_norm_eps=1e-6,
    max_position_embeddings=131072,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    rope_theta=1_000_000.0,
    rope_local_base_freq=10000.0,
)


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Reads: the shared fields, hidden_activation (gelu_pytorch_tanh), attention_bias,
    query_pre_attn_scalar, sliding_window, layer_types (or sliding_window_pattern),
    attn_logit_softcapping, final_logit_softcapping, tie_word_embeddings (default true);
    Gemma 3 also rope_parameters per layer type or rope_local_base_freq; a multimodal
    `gemma3` config its `text_config`."""
    if hf["model_type"] == "gemma3":
        warnings.warn(
            "gemma3 multimodal checkpoint: loading its language model only; images are not "
            "supported",
            stacklevel=2,
        )
        text = GEMMA3_TEXT_DEFAULTS | dict(hf.get("text_config") or {})
        for name in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "dtype", "torch_dtype"):
            if name in hf and name not in text:
                text[name] = hf[name]
        hf = text | {"model_type": "gemma3_text"}
    model_type = hf["model_type"]
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=true is not supported; supported: false")
    fields = hf_common_fields(hf) | dict(tie_word_embeddings=hf.get("tie_word_embeddings", True))
    if model_type == "gemma3_text":
        fields |= _gemma3_rope(hf)
    bias = bool(hf.get("attention_bias", False))
    hidden_act = _hidden_act(hf)
    layer_types = _layer_types(hf, model_type)
    window = hf.get("sliding_window", 4096)  # transformers' default for both
    if window is None and SLIDING_ATTENTION in layer_types:
        raise ValueError("sliding_window=None with sliding layers in layer_types")
    return ModelConfig(
        **fields,
        qkv_bias=bias,
        o_bias=bias,
        hidden_act=hidden_act,
        qk_norm=model_type == "gemma3_text",
        layer_types=layer_types,
        sliding_window=None if window is None else int(window),
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        # transformers' Gemma 3 keeps attn_logit_softcapping but never applies it (q/k norms
        # replaced it; llama.cpp's gemma3 ignores it too): so do we.
        attn_logit_softcapping=None
        if model_type == "gemma3_text"
        else _float_or_none(hf, "attn_logit_softcapping", model_type),
        final_logit_softcapping=_float_or_none(hf, "final_logit_softcapping", model_type),
    )


def _float_or_none(hf: Mapping[str, Any], name: str, model_type: str) -> float | None:
    """A soft-cap field; absent means transformers' default (Gemma 2: 50 and 30)."""
    value = hf.get(name, GEMMA2_SOFTCAPS[name] if model_type == "gemma2" else None)
    return None if value is None else float(value)


def config_from_gguf(
    metadata: Mapping[str, Any],
    tensor_names: set[str],
    dtype: str = "float32",
    read_tensor: Callable[[str], np.ndarray] | None = None,
) -> ModelConfig:
    """Reads the shared GGUF keys, `{arch}.attention.sliding_window`,
    `{arch}.attention.sliding_window_pattern` (int or per-layer bools), `{arch}.attn_logit_
    softcapping`, `{arch}.final_logit_softcapping`; the rest is llama.cpp's fixed choices
    (module docstring)."""
    arch = metadata["general.architecture"]
    fields = gguf_common_fields(metadata, tensor_names, dtype)
    model_type = GGUF_MODEL_TYPE[arch]
    num_layers = fields["num_hidden_layers"]
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern", PATTERN[model_type])
    if isinstance(pattern, list | tuple):
        layer_types = tuple(SLIDING_ATTENTION if p else FULL_ATTENTION for p in pattern)
    else:
        layer_types = _layer_types(
            {"num_hidden_layers": num_layers, "sliding_window_pattern": pattern}, model_type
        )
    big = num_layers == GGUF_27B_LAYERS[arch]
    scalar = fields["hidden_size"] / fields["num_attention_heads"] if big else fields["head_dim"]
    if model_type == "gemma3_text":
        fields |= dict(rope_local_theta=GGUF_LOCAL_ROPE_THETA)
    window = metadata.get(f"{arch}.attention.sliding_window")
    caps = {
        name: None if metadata.get(f"{arch}.{name}") is None else float(metadata[f"{arch}.{name}"])
        for name in ("attn_logit_softcapping", "final_logit_softcapping")
    }
    if model_type == "gemma3_text":
        caps["attn_logit_softcapping"] = None  # see config_from_hf
    return ModelConfig(
        **fields | dict(model_type=model_type),
        hidden_act=GELU_TANH,
        qk_norm=model_type == "gemma3_text",
        layer_types=layer_types,
        sliding_window=None if window is None else int(window),
        query_pre_attn_scalar=float(scalar),
        **caps,
    )


def from_gguf(hf_name: str, value: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """llama.cpp stores Gemma norms with the +1 folded in: take it back out."""
    return value - 1.0 if hf_name.endswith("norm.weight") else value


# --------------------------------------------------------------------------- compute


def forward(
    params: Params,
    cfg: ModelConfig,
    kv: KVCache,
    inputs: StepInputs,
    backend: str = "reference",
) -> tuple[jax.Array, KVCache]:
    """One ragged step (arguments as llama.forward): final-norm hidden f32[T, D] and kv."""
    embed = params["embed"]
    # transformers multiplies in the parameter dtype by sqrt(D) rounded to it.
    x = (
        embed_rows(embed, inputs.token_ids) * jnp.asarray(cfg.hidden_size**0.5, embed.dtype)
    ).astype(jnp.float32)
    eps = cfg.rms_norm_eps
    for i, layer in enumerate(layer_params(params)):
        attn_norm = RMSNorm(layer["attn_norm"], eps, 1.0)
        attn, kv = llama.attention_block(cfg, inputs, kv, x, i, layer, backend, 1.0, attn_norm)
        x = x + rms_norm(attn, layer["post_attn_norm"], eps, 1.0)
        mlp = gated_mlp(x, layer, cfg.hidden_act, RMSNorm(layer["mlp_norm"], eps, 1.0))
        x = x + rms_norm(mlp, layer["post_mlp_norm"], eps, 1.0)
    return rms_norm(x, params["final_norm"], eps, 1.0), kv


def logits(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Vocabulary logits f32[R, V], soft-capped by final_logit_softcapping when set."""
    out = linear(hidden, params.get("lm_head", params["embed"]))
    return softcap(out, cfg.final_logit_softcapping)


FAMILY = Family(
    name="gemma",
    architectures={
        "gemma2": ("Gemma2ForCausalLM",),
        "gemma3_text": ("Gemma3ForCausalLM",),
        "gemma3": ("Gemma3ForConditionalGeneration",),
    },
    gguf_architectures=("gemma2", "gemma3"),
    config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf,
    param_shapes=param_shapes,
    param_axes=PARAM_AXES,
    hf_top=llama.HF_TOP,
    hf_layer=HF_LAYER,
    gguf_top=GGUF_TOP,
    gguf_layer=GGUF_LAYER,
    forward=forward,
    logits=logits,
    hf_rename=hf_rename,
    from_gguf=from_gguf,
)

"""Qwen3 dense decoders: a Llama decoder with an RMSNorm over each query and key head before
rotary (`q_norm`, `k_norm`, weights [H]), no q/k/v bias unless `attention_bias`, and optional
sliding-window layers (`use_sliding_window` from `max_window_layers` on, as Qwen2).

The family reuses llama.py's decoder, which reads `cfg.qk_norm`; what this module adds is
what the registry needs to know: the config fields Qwen3 reads, its parameters and their
names in HF and GGUF files (llama.cpp's `qwen3` architecture: the Llama names plus
`attn_q_norm` / `attn_k_norm`, Q/K rows not permuted). It is the example in the package
docstring of what adding a family takes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ksana_jax.config import ModelConfig, gguf_common_fields, hf_common_fields, require_value
from ksana_jax.models import llama
from ksana_jax.models.registry import Family


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Reads: the shared fields, hidden_act (silu), attention_bias (q, k, v and o together),
    use_sliding_window / max_window_layers / layer_types / sliding_window."""
    require_value(hf, "hidden_act", ("silu",), default="silu")
    bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        **hf_common_fields(hf) | llama.sliding_layers(hf), qkv_bias=bias, o_bias=bias, qk_norm=True
    )


def gguf_fields(metadata: Mapping[str, Any], tensor_names: set[str], dtype: str) -> dict:
    """The ModelConfig fields of a qwen3 (or qwen3moe) GGUF: the shared keys (llama.cpp
    writes no sliding window for either)."""
    arch = metadata["general.architecture"]
    if metadata.get(f"{arch}.attention.sliding_window"):
        raise ValueError(f"{arch}.attention.sliding_window is not supported for GGUF {arch}")
    return gguf_common_fields(metadata, tensor_names, dtype) | dict(qk_norm=True)


def config_from_gguf(
    metadata: Mapping[str, Any],
    tensor_names: set[str],
    dtype: str = "float32",
    read_tensor: Callable[[str], np.ndarray] | None = None,
) -> ModelConfig:
    return ModelConfig(**gguf_fields(metadata, tensor_names, dtype))


FAMILY = Family(
    name="qwen3",
    architectures={"qwen3": ("Qwen3ForCausalLM",)},
    gguf_architectures=("qwen3",),
    config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf,
    param_shapes=llama.param_shapes,  # with q_norm / k_norm, since cfg.qk_norm
    param_axes=llama.PARAM_AXES,
    hf_top=llama.HF_TOP,
    hf_layer=llama.HF_LAYER,
    gguf_top=llama.GGUF_TOP,
    gguf_layer=llama.GGUF_LAYER,
    forward=llama.forward,
    logits=llama.logits,
    lm_head=llama.lm_head,
)

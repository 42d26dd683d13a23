"""Mixtral: a Mistral decoder whose every feed-forward is a mixture of experts (moe.py): a
router `block_sparse_moe.gate` [E, D] and E SwiGLU experts (w1 = gate, w3 = up, w2 = down,
each [intermediate_size] wide), a softmax over the top-k router logits weighting the k
chosen experts (`norm_topk_prob` is always on: softmax over all, top k, renormalised, is the
same thing).

From HF safetensors each expert's matrices are stacked at conversion ([E, F, D]); from GGUF,
llama.cpp writes Mixtral as architecture `llama` with `llama.expert_count`, the router as
`ffn_gate_inp`, the experts already stacked as `ffn_{gate,up,down}_exps`, and Q/K rows
permuted as for any llama (undone here). The family claims such a file (`gguf_claims`:
a `llama` GGUF with an expert count), so the registry hands it to `config_from_gguf` below.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ksana_jax.config import (
    MOE_MLP,
    SLIDING_ATTENTION,
    ModelConfig,
    gguf_common_fields,
    hf_common_fields,
    require_value,
)
from ksana_jax.models import llama, moe
from ksana_jax.models.registry import Family


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Reads: the shared fields, hidden_act (silu), num_local_experts (or num_experts),
    num_experts_per_tok, intermediate_size (each expert's; or moe_intermediate_size),
    sliding_window; and mlp_types / layer_types as our own config.json writes them."""
    require_value(hf, "hidden_act", ("silu",), default="silu")
    fields = hf_common_fields(hf, default_rms_norm_eps=1e-5)
    num_layers = fields["num_hidden_layers"]
    if hf.get("sliding_window") is not None:
        fields |= dict(
            sliding_window=int(hf["sliding_window"]),
            layer_types=tuple(hf.get("layer_types") or (SLIDING_ATTENTION,) * num_layers),
        )
    return ModelConfig(
        **fields,
        mlp_types=tuple(hf.get("mlp_types") or (MOE_MLP,) * num_layers),
        num_experts=int(hf.get("num_local_experts") or hf.get("num_experts") or 0),
        num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(hf.get("moe_intermediate_size") or hf["intermediate_size"]),
        norm_topk_prob=True,
    )


def config_from_gguf(
    metadata: Mapping[str, Any],
    tensor_names: set[str],
    dtype: str = "float32",
    read_tensor: Callable[[str], np.ndarray] | None = None,
) -> ModelConfig:
    """A llama-architecture GGUF with experts: the shared keys plus expert_count,
    expert_used_count; each expert is feed_forward_length wide."""
    fields = gguf_common_fields(metadata, tensor_names, dtype) | dict(model_type="mixtral")
    moe_fields = moe.gguf_moe_fields(metadata, tensor_names, fields["num_hidden_layers"])
    return ModelConfig(
        **fields,
        **moe_fields,
        moe_intermediate_size=fields["intermediate_size"],
        norm_topk_prob=True,
    )


def is_llama_with_experts(metadata: Mapping[str, Any]) -> bool:
    """Whether a GGUF is llama.cpp's Mixtral: architecture `llama` with experts."""
    return metadata.get("general.architecture") == "llama" and bool(
        metadata.get("llama.expert_count")
    )


def from_gguf(hf_name: str, value: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    return llama.unpermute_qk(hf_name, value, cfg)  # written as a llama by llama.cpp


_DENSE = {"mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}
_EXPERTS_HF, _EXPERTS_GGUF = moe.expert_name_maps(
    "block_sparse_moe.gate.weight",
    "block_sparse_moe.experts.*.w1.weight",  # gate
    "block_sparse_moe.experts.*.w3.weight",  # up
    "block_sparse_moe.experts.*.w2.weight",  # down
)
HF_LAYER = {k: v for k, v in llama.HF_LAYER.items() if k not in _DENSE} | _EXPERTS_HF
GGUF_LAYER = llama.GGUF_LAYER | _EXPERTS_GGUF


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return moe.with_experts(llama.param_shapes(cfg), cfg)


FAMILY = Family(
    name="mixtral",
    architectures={"mixtral": ("MixtralForCausalLM",)},
    gguf_architectures=(),  # llama.cpp's "llama" with experts, claimed by gguf_claims
    config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf,
    param_shapes=param_shapes,
    param_axes=llama.PARAM_AXES | moe.PARAM_AXES,
    hf_top=llama.HF_TOP,
    hf_layer=HF_LAYER,
    gguf_top=llama.GGUF_TOP,
    gguf_layer=GGUF_LAYER,
    forward=llama.forward,
    logits=llama.logits,
    lm_head=llama.lm_head,
    from_gguf=from_gguf,
    param_layers=moe.param_layers,
    gguf_claims=is_llama_with_experts,
)

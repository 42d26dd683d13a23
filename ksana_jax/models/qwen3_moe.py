"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen3 decoder (q/k norms) whose
feed-forward is a mixture of experts (moe.py) on the layers `mlp_only_layers` leaves out and
`decoder_sparse_step` picks (layer i when (i + 1) % step == 0), a dense SwiGLU MLP
(`intermediate_size` wide) on the others. Routing: softmax over all experts, top k, and with
`norm_topk_prob` the k weights renormalised; each expert is `moe_intermediate_size` wide.

From HF safetensors the experts (`mlp.experts.{e}.{gate,up,down}_proj`) are stacked at
conversion; from GGUF (llama.cpp's `qwen3moe`) they come stacked as `ffn_*_exps`, the router as
`ffn_gate_inp`, each expert `expert_feed_forward_length` wide. llama.cpp always renormalises
qwen3moe's top-k weights, so a GGUF reads as norm_topk_prob = true.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ksana_jax.config import DENSE_MLP, MOE_MLP, ModelConfig
from ksana_jax.models import llama, moe, qwen3
from ksana_jax.models.registry import Family


def mlp_types(hf: Mapping[str, Any], num_experts: int) -> tuple[str, ...]:
    """Each layer's feed-forward: transformers' rule from mlp_only_layers and
    decoder_sparse_step (or our own config.json's mlp_types)."""
    if hf.get("mlp_types"):
        return tuple(hf["mlp_types"])
    dense_only = set(hf.get("mlp_only_layers") or ())
    step = int(hf.get("decoder_sparse_step") or 1)
    return tuple(
        MOE_MLP if i not in dense_only and num_experts > 0 and (i + 1) % step == 0 else DENSE_MLP
        for i in range(int(hf["num_hidden_layers"]))
    )


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Reads: Qwen3's fields (qwen3.config_from_hf), num_experts (or num_local_experts),
    num_experts_per_tok, moe_intermediate_size, norm_topk_prob, mlp_only_layers,
    decoder_sparse_step."""
    num_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    return dataclasses.replace(
        qwen3.config_from_hf(hf),
        mlp_types=mlp_types(hf, num_experts),
        num_experts=num_experts,
        num_experts_per_tok=int(hf.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(hf.get("moe_intermediate_size") or 0),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
    )


def config_from_gguf(
    metadata: Mapping[str, Any],
    tensor_names: set[str],
    dtype: str = "float32",
    read_tensor: Callable[[str], np.ndarray] | None = None,
) -> ModelConfig:
    """Qwen3's GGUF keys (qwen3.gguf_fields) plus expert_count, expert_used_count and
    expert_feed_forward_length."""
    arch = metadata["general.architecture"]
    key = f"{arch}.expert_feed_forward_length"
    if key not in metadata:
        raise ValueError(f"GGUF metadata is missing {key}")
    fields = qwen3.gguf_fields(metadata, tensor_names, dtype) | dict(model_type="qwen3_moe")
    return ModelConfig(
        **fields,
        **moe.gguf_moe_fields(metadata, tensor_names, fields["num_hidden_layers"]),
        moe_intermediate_size=int(metadata[key]),
        norm_topk_prob=True,
    )


_EXPERTS_HF, _EXPERTS_GGUF = moe.expert_name_maps(
    "mlp.gate.weight",
    "mlp.experts.*.gate_proj.weight",
    "mlp.experts.*.up_proj.weight",
    "mlp.experts.*.down_proj.weight",
)


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return moe.with_experts(llama.param_shapes(cfg), cfg)


FAMILY = Family(
    name="qwen3_moe",
    architectures={"qwen3_moe": ("Qwen3MoeForCausalLM",)},
    gguf_architectures=("qwen3moe",),
    config_from_hf=config_from_hf,
    config_from_gguf=config_from_gguf,
    param_shapes=param_shapes,
    param_axes=llama.PARAM_AXES | moe.PARAM_AXES,
    hf_top=llama.HF_TOP,
    hf_layer=llama.HF_LAYER | _EXPERTS_HF,
    gguf_top=llama.GGUF_TOP,
    gguf_layer=llama.GGUF_LAYER | _EXPERTS_GGUF,
    forward=llama.forward,
    logits=llama.logits,
    lm_head=llama.lm_head,
    param_layers=moe.param_layers,
)

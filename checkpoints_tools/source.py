"""What every reader produces: a model's config, params, tokenizer files and generation config.

Readers (`hf.py`, `gguf_source.py`) name tensors the Hugging Face way with (out, in) matrices,
which is also our layout; `ParamAssembler` checks each one's shape, casts it and places it
into the layer-stacked arrays, and finally reports anything missing by name.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax.numpy as jnp
import numpy as np

from ksana_jax.config import ModelConfig
from ksana_jax.models import llama


class ConversionError(ValueError):
    """A user-facing conversion problem (bad path, bad file, missing or misshapen tensor)."""


@dataclasses.dataclass
class Source:
    config: ModelConfig
    params: llama.LlamaParams  # numpy arrays in the target dtype
    tokenizer_files: dict[str, bytes]  # file name -> contents, written beside the params
    generation_config: dict[str, Any] | None


# HF tensor name -> our flat name. Matrices keep HF's (out, in) layout.
_TOP_LEVEL = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "final_norm",
    "lm_head.weight": "lm_head",
}
_PER_LAYER = {
    "input_layernorm.weight": "layers.attn_norm",
    "self_attn.q_proj.weight": "layers.wq",
    "self_attn.k_proj.weight": "layers.wk",
    "self_attn.v_proj.weight": "layers.wv",
    "self_attn.o_proj.weight": "layers.wo",
    "self_attn.q_proj.bias": "layers.bq",
    "self_attn.k_proj.bias": "layers.bk",
    "self_attn.v_proj.bias": "layers.bv",
    "self_attn.o_proj.bias": "layers.bo",
    "post_attention_layernorm.weight": "layers.mlp_norm",
    "mlp.gate_proj.weight": "layers.w_gate",
    "mlp.up_proj.weight": "layers.w_up",
    "mlp.down_proj.weight": "layers.w_down",
}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Buffers some exporters save that carry no weights.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def hf_tensor_names(cfg: ModelConfig) -> list[str]:
    """Every HF tensor name this config needs, in a stable order."""
    shapes = llama.param_shapes(cfg)
    names = [hf for hf, ours in _TOP_LEVEL.items() if ours in shapes]
    for i in range(cfg.num_hidden_layers):
        names += [f"model.layers.{i}.{hf}" for hf, ours in _PER_LAYER.items() if ours in shapes]
    return names


class ParamAssembler:
    """Fills layer-stacked param arrays from HF-named tensors, checking every shape."""

    def __init__(self, cfg: ModelConfig, dtype: str):
        self._cfg = cfg
        self._dtype = np.dtype(jnp.dtype(dtype))
        self._shapes = llama.param_shapes(cfg)
        self._arrays = {name: np.empty(shape, self._dtype) for name, shape in self._shapes.items()}
        self._missing = set(hf_tensor_names(cfg))

    def _target(self, hf_name: str) -> tuple[str, int | None] | None:
        if hf_name in _TOP_LEVEL:
            return _TOP_LEVEL[hf_name], None
        match = _LAYER_NAME.fullmatch(hf_name)
        if match and match.group(2) in _PER_LAYER:
            return _PER_LAYER[match.group(2)], int(match.group(1))
        return None

    def put(self, hf_name: str, value: np.ndarray) -> None:
        """Places one HF-named tensor ((out, in) for matrices)."""
        target = self._target(hf_name)
        if target is None:
            if _IGNORED.fullmatch(hf_name):
                return
            raise ConversionError(
                f"unexpected tensor {hf_name!r} for a {self._cfg.model_type} "
                "model (is the architecture supported?)"
            )
        name, layer = target
        if name not in self._shapes:
            if name == "lm_head" and self._cfg.tie_word_embeddings:
                return  # tied checkpoints sometimes store a copy of the embeddings
            raise ConversionError(f"unexpected tensor {hf_name!r}: the config does not use it")
        shape = self._shapes[name][1:] if layer is not None else self._shapes[name]
        if layer is not None and layer >= self._cfg.num_hidden_layers:
            raise ConversionError(
                f"tensor {hf_name!r} is for layer {layer}, but the config has "
                f"{self._cfg.num_hidden_layers} layers"
            )
        if tuple(value.shape) != tuple(shape):
            raise ConversionError(
                f"tensor {hf_name!r} has shape {tuple(value.shape)}, expected {tuple(shape)}"
            )
        if layer is None:
            self._arrays[name][...] = value.astype(self._dtype)
        else:
            self._arrays[name][layer] = value.astype(self._dtype)
        self._missing.discard(hf_name)

    def finish(self) -> llama.LlamaParams:
        """The assembled params; raises naming every tensor that never arrived."""
        if self._missing:
            missing = sorted(self._missing)
            shown = ", ".join(missing[:5]) + (
                f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            )
            raise ConversionError(f"missing tensor(s): {shown}")
        return llama.params_from_flat(self._arrays)

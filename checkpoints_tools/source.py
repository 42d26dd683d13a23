"""What every reader produces: a model's config, params, tokenizer files and generation config.

Readers (`hf.py`, `gguf_source.py`) name tensors the Hugging Face way with (out, in) matrices,
which is also our layout; `ParamAssembler` maps each name through the model family's
declarations (ksana_jax.models.registry), checks its shape, casts it and places it into the
layer-stacked arrays, and finally reports anything missing by name.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax.numpy as jnp
import numpy as np

from ksana_jax.config import ModelConfig
from ksana_jax.models import registry


class ConversionError(ValueError):
    """A user-facing conversion problem (bad path, bad file, missing or misshapen tensor)."""


@dataclasses.dataclass
class Source:
    config: ModelConfig
    params: registry.Params  # numpy arrays in the target dtype
    tokenizer_files: dict[str, bytes]  # file name -> contents, written beside the params
    generation_config: dict[str, Any] | None


# Buffers some exporters save that carry no weights.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def hf_tensor_names(cfg: ModelConfig) -> list[str]:
    """Every HF tensor name this config needs, in a stable order."""
    family = registry.family_of(cfg.model_type)
    shapes = family.param_shapes(cfg)
    names = [hf for hf, ours in family.hf_top.items() if ours in shapes]
    for i in range(cfg.num_hidden_layers):
        names += [
            f"model.layers.{i}.{hf}" for hf, ours in family.hf_layer.items() if ours in shapes
        ]
    return names


class ParamAssembler:
    """Fills layer-stacked param arrays from HF-named tensors, checking every shape; the
    names come from the config's family (registry.Family.hf_top / hf_layer / hf_rename)."""

    def __init__(self, cfg: ModelConfig, dtype: str):
        self._cfg = cfg
        self._family = registry.family_of(cfg.model_type)
        self._dtype = np.dtype(jnp.dtype(dtype))
        self._shapes = self._family.param_shapes(cfg)
        self._arrays = {name: np.empty(shape, self._dtype) for name, shape in self._shapes.items()}
        self._missing = set(hf_tensor_names(cfg))

    def _target(self, hf_name: str) -> tuple[str, int | None] | None:
        if hf_name in self._family.hf_top:
            return self._family.hf_top[hf_name], None
        match = registry.HF_LAYER.fullmatch(hf_name)
        if match and match.group(2) in self._family.hf_layer:
            return self._family.hf_layer[match.group(2)], int(match.group(1))
        return None

    def put(self, hf_name: str, value: np.ndarray) -> None:
        """Places one HF-named tensor ((out, in) for matrices)."""
        renamed = self._family.hf_rename(hf_name)
        if renamed is None:
            return  # a part of the checkpoint the family does not use (a vision tower)
        hf_name = renamed
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

    def finish(self) -> registry.Params:
        """The assembled params; raises naming every tensor that never arrived."""
        if self._missing:
            missing = sorted(self._missing)
            shown = ", ".join(missing[:5]) + (
                f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            )
            raise ConversionError(f"missing tensor(s): {shown}")
        return registry.params_from_flat(self._arrays)

"""What every reader produces: a model's config, params, tokenizer files and generation config.

Readers (`hf.py`, `gguf_source.py`) name tensors the Hugging Face way with (out, in) matrices,
which is also our layout; `ParamAssembler` maps each name through the model family's
declarations (ksana_jax.models.registry), checks its shape, casts it and places it into the
layer-stacked arrays, and finally reports anything missing by name.

With a quantization ("int8" | "int4", ksana_jax/quant.py) every matrix is quantized as it
arrives; a reader may also hand over a matrix already quantized (a GGUF's Q4_0 / Q4_1 / Q8_0
blocks), which is kept as it is.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ksana_jax import quant
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
    quantization: str | None = None  # what was asked for; params say each matrix's format
    # Source tensor name -> its source type, for tensors quantized in a type other than the
    # target's that were requantized from their dequantized values (GGUF K-quants, ...).
    requantized: dict[str, str] = dataclasses.field(default_factory=dict)


# Buffers some exporters save that carry no weights.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def hf_tensor_names(cfg: ModelConfig) -> list[str]:
    """Every HF tensor name this config needs, in a stable order (one per expert)."""
    family = registry.family_of(cfg.model_type)
    shapes = family.param_shapes(cfg)
    names = [hf for hf, ours in family.hf_top.items() if ours in shapes]
    for i in range(cfg.num_hidden_layers):
        for hf, ours in family.hf_layer.items():
            if ours in shapes and i in family.param_layers(cfg, ours):
                names += [f"model.layers.{i}.{name}" for name in _experts(hf, shapes[ours])]
    return names


def _experts(hf: str, shape: tuple[int, ...]) -> list[str]:
    """A per-layer HF name, or for an expert's ("experts.*.") one name per expert."""
    return [hf.replace(".*.", f".{e}.") for e in range(shape[1])] if ".*." in hf else [hf]


class ParamAssembler:
    """Fills layer-stacked param arrays from HF-named tensors, checking every shape; the
    names come from the config's family (registry.Family.hf_top / hf_layer / hf_rename)."""

    def __init__(self, cfg: ModelConfig, dtype: str, quantization: str | None = None):
        if quantization is not None:
            quant.check_format(quantization)
            try:
                quant.check_model(cfg)
            except ValueError as e:
                raise ConversionError(str(e)) from None
        self._cfg = cfg
        self._family = registry.family_of(cfg.model_type)
        self._dtype = np.dtype(jnp.dtype(dtype))
        self._quantization = quantization
        self._shapes = self._family.param_shapes(cfg)
        self._quantized = {
            name: {}
            for name, shape in self._shapes.items()
            if quantization is not None and quant.quantizable(name, shape)
        }
        self._arrays = {
            name: np.empty(shape, self._dtype)
            for name, shape in self._shapes.items()
            if name not in self._quantized
        }
        self._missing = set(hf_tensor_names(cfg))
        self.requantized_mixed: list[str] = []  # flat names, see _stack

    def _target(self, hf_name: str) -> tuple[str, int | None, int | None] | None:
        """(flat name, layer or None, expert or None) of an HF name."""
        if hf_name in self._family.hf_top:
            return self._family.hf_top[hf_name], None, None
        match = registry.HF_LAYER.fullmatch(hf_name)
        if match:
            name, expert = registry.expert_name(match.group(2))
            if name in self._family.hf_layer:
                return self._family.hf_layer[name], int(match.group(1)), expert
        return None

    def _slot(self, hf_name: str, name: str, layer: int | None, expert: int | None) -> tuple:
        """The index into the stacked array `name` that `hf_name` fills, and its shape."""
        shape = self._shapes[name]
        if layer is None:
            return (), shape
        if layer >= self._cfg.num_hidden_layers:
            raise ConversionError(
                f"tensor {hf_name!r} is for layer {layer}, but the config has "
                f"{self._cfg.num_hidden_layers} layers"
            )
        holders = self._family.param_layers(self._cfg, name)
        if layer not in holders:
            raise ConversionError(
                f"unexpected tensor {hf_name!r}: layer {layer} of this config has no {name} "
                f"(layers {list(holders)} do)"
            )
        index = (holders.index(layer),)
        if expert is not None:
            if expert >= shape[1]:
                raise ConversionError(
                    f"tensor {hf_name!r} is for expert {expert}, but the config has "
                    f"{shape[1]} experts"
                )
            return (*index, expert), shape[2:]
        return index, shape[1:]

    def put(self, hf_name: str, value: np.ndarray | quant.QuantizedMatrix) -> None:
        """Places one HF-named tensor ((out, in) for matrices), float or already quantized
        (kept when the target is quantized, else dequantized)."""
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
        name, layer, expert = target
        if name not in self._shapes:
            if name == "lm_head" and self._cfg.tie_word_embeddings:
                return  # tied checkpoints sometimes store a copy of the embeddings
            raise ConversionError(f"unexpected tensor {hf_name!r}: the config does not use it")
        index, shape = self._slot(hf_name, name, layer, expert)
        if tuple(value.shape) != tuple(shape):
            raise ConversionError(
                f"tensor {hf_name!r} has shape {tuple(value.shape)}, expected {tuple(shape)}"
            )
        if name in self._quantized:
            if not quant.is_quantized(value):
                try:
                    value = quant.quantize(value, self._quantization, str(self._dtype))
                except ValueError as e:
                    raise ConversionError(f"tensor {hf_name!r}: {e}") from None
            self._quantized[name][index[0] if index else None] = dataclasses.replace(
                value, dtype=str(self._dtype)
            )
        else:
            self._arrays[name][index] = _float(value).astype(self._dtype)
        if ".*." in hf_name:  # a stacked tensor of every expert (GGUF's ffn_*_exps)
            self._missing -= set(_experts(hf_name, self._shapes[name]))
        self._missing.discard(hf_name)

    def finish(self) -> registry.Params:
        """The assembled params; raises naming every tensor that never arrived."""
        if self._missing:
            missing = sorted(self._missing)
            shown = ", ".join(missing[:5]) + (
                f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            )
            raise ConversionError(f"missing tensor(s): {shown}")
        flat: dict[str, Any] = dict(self._arrays)
        for name, parts in self._quantized.items():
            flat[name] = parts[None] if None in parts else self._stack(name, parts)
        return registry.params_from_flat(flat, self._cfg)

    def _stack(self, name: str, parts: dict[int, quant.QuantizedMatrix]) -> Any:
        """The layers' matrices stacked on L. Layers kept in different formats (a GGUF that
        mixes block types for one tensor across layers) are all requantized to the target."""
        layers = [parts[i] for i in range(len(parts))]
        kinds = {(type(m), tuple(a.shape for a in quant.to_arrays(m).values())) for m in layers}
        if len(kinds) > 1:
            self.requantized_mixed.append(name)
            layers = [
                quant.quantize(quant.dequantize(m, "float32"), self._quantization, m.dtype)
                for m in layers
            ]
        return jax.tree.map(lambda *a: np.stack(a), *layers)


def _float(value: np.ndarray | quant.QuantizedMatrix) -> np.ndarray:
    return quant.dequantize(value, "float32") if quant.is_quantized(value) else value

"""Reads a llama.cpp GGUF file into a `Source`.

Every tensor type the `gguf` package can dequantize (F32, F16, BF16, Q8_0, Q4_0, Q4_1,
K-quants, ...) becomes float32 and then the target dtype. The family registered for the
file's `general.architecture` names each tensor the Hugging Face way (`Family.gguf_top`,
`gguf_layer`) and undoes what llama.cpp's converter changed (`Family.from_gguf`: the Q/K row
permutation of `llama` models, the +1 folded into Gemma norms). A file without
`output.weight` has tied embeddings. The tokenizer is rebuilt from the GGUF vocabulary
(see gguf_tokenizer.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
from tqdm import tqdm

from checkpoints_tools.gguf_tokenizer import tokenizer_files_from_gguf
from checkpoints_tools.source import ConversionError, ParamAssembler, Source
from ksana_jax.config import ModelConfig
from ksana_jax.models import registry


def hf_name(gguf_name: str, family: registry.Family) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name in `family`'s map (unknown names pass
    through, to be refused by the assembler; None for a tensor the config reader consumed)."""
    if gguf_name in family.gguf_top:
        return family.gguf_top[gguf_name]
    match = registry.GGUF_LAYER.fullmatch(gguf_name)
    if match and match.group(2) in family.gguf_layer:
        return f"model.layers.{match.group(1)}.{family.gguf_layer[match.group(2)]}"
    return gguf_name


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    return {
        name: field.contents()
        for name, field in reader.fields.items()
        if not name.startswith("GGUF.")
    }


def dequantize(tensor: Any) -> np.ndarray:
    """A reader tensor as float32 in numpy (out, in) order, or a clear error."""
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise ConversionError(
            f"tensor {tensor.name!r} uses quantization type {tensor.tensor_type.name}, which "
            f"the gguf package cannot dequantize ({e})"
        ) from e
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.asarray(values, np.float32).reshape(shape)


def read_gguf(path: Path, dtype: str = "float32") -> Source:
    """Reads config, dequantized weights (as `dtype`) and tokenizer from a GGUF file."""
    path = Path(path)
    try:
        reader = gguf.GGUFReader(path)
        metadata = read_metadata(reader)
        names = {t.name for t in reader.tensors}
    except (OSError, ValueError, IndexError) as e:  # IndexError: a header cut short
        raise ConversionError(f"cannot read GGUF file {path}: {e}") from e
    by_name = {t.name: t for t in reader.tensors}
    try:
        config = ModelConfig.from_gguf_metadata(
            metadata, names, dtype=dtype, read_tensor=lambda name: dequantize(by_name[name])
        )
    except ValueError as e:
        raise ConversionError(f"{path}: {e}") from e

    family = registry.family_of(config.model_type)
    assembler = ParamAssembler(config, dtype)
    for tensor in tqdm(reader.tensors, desc=path.name, unit="tensor", leave=False, disable=None):
        name = hf_name(tensor.name, family)
        if name is None:
            continue
        try:
            assembler.put(name, family.from_gguf(name, dequantize(tensor), config))
        except ValueError as e:  # ConversionError included
            raise ConversionError(f"GGUF tensor {tensor.name!r}: {e}") from e
    generation = {"eos_token_id": list(config.eos_token_ids)} if config.eos_token_ids else None
    if generation is not None and config.bos_token_id is not None:
        generation["bos_token_id"] = config.bos_token_id
    files = tokenizer_files_from_gguf(metadata)
    return Source(config, assembler.finish(), files, generation)

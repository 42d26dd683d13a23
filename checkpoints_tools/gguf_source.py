"""Reads a llama.cpp GGUF file into a `Source`.

Every tensor type the `gguf` package can dequantize (F32, F16, BF16, Q8_0, Q4_0, Q4_1,
K-quants, ...) becomes float32 and then the target dtype. The family registered for the
file's `general.architecture` names each tensor the Hugging Face way (`Family.gguf_top`,
`gguf_layer`) and undoes what llama.cpp's converter changed (`Family.from_gguf`: the Q/K row
permutation of `llama` models, the +1 folded into Gemma norms). A file without
`output.weight` has tied embeddings. The tokenizer is rebuilt from the GGUF vocabulary
(see gguf_tokenizer.py).

With a quantization (ksana_jax/quant.py), Q4_0, Q4_1 and Q8_0 matrices keep their blocks,
re-packed without a round trip through float, whichever of int8 / int4 was asked for (the
option decides what happens to the other matrices): Q4_1 is int4 exactly (same nibble
order), Q4_0 is int4 with min = -8 * scale (exact: a power-of-two multiple of a float16),
Q8_0 is int8 in groups of 32. A row permutation by `Family.from_gguf` (Q/K rows) moves
whole rows of blocks. Float matrices are quantized; matrices of any other quantized type
(K-quants, Q5_x, ...) are requantized from their dequantized values, and listed in
`Source.requantized`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import jax
import numpy as np
from tqdm import tqdm

from checkpoints_tools.gguf_tokenizer import tokenizer_files_from_gguf
from checkpoints_tools.source import ConversionError, ParamAssembler, Source
from ksana_jax import quant
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


Q = gguf.GGMLQuantizationType
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
KEPT_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q8_0)


def blocks(tensor: Any) -> quant.QuantizedMatrix:
    """A Q4_0 / Q4_1 / Q8_0 matrix's blocks as a quantized matrix [O, I], values unchanged.

    Blocks of 32 along I: Q8_0 = f16 scale, 32 x int8; Q4_0 = f16 scale, 16 bytes of
    nibbles (q - 8); Q4_1 = f16 scale, f16 min, 16 bytes of nibbles (byte j: elements j and
    j + 16, quant.py's order).
    """
    rows, cols = (int(d) for d in reversed(tensor.shape))
    groups = cols // quant.GROUP_SIZE
    raw = np.asarray(tensor.data, np.uint8).reshape(rows, groups, -1)
    scales = np.ascontiguousarray(raw[..., 0:2]).view(np.float16)[..., 0]
    if tensor.tensor_type == Q.Q8_0:
        values = np.ascontiguousarray(raw[..., 2:]).view(np.int8).reshape(rows, cols)
        return quant.Int8Matrix(values, scales)
    if tensor.tensor_type == Q.Q4_0:
        mins = (scales.astype(np.float32) * -8).astype(np.float16)
        packed = raw[..., 2:]
    else:
        mins = np.ascontiguousarray(raw[..., 2:4]).view(np.float16)[..., 0]
        packed = raw[..., 4:]
    return quant.Int4Matrix(np.ascontiguousarray(packed).reshape(rows, cols // 2), scales, mins)


def from_gguf_quantized(
    family: registry.Family, name: str, m: quant.QuantizedMatrix, config: ModelConfig
) -> quant.QuantizedMatrix | np.ndarray:
    """`family.from_gguf` applied to kept blocks: a row permutation (what it does to Q/K
    rows) moves rows of every array; anything else gets the dequantized values."""
    rows, cols = m.shape
    index = np.broadcast_to(np.arange(rows, dtype=np.float32)[:, None], (rows, cols))
    moved = family.from_gguf(name, np.array(index), config)
    perm = moved[:, 0].astype(np.int64)
    if moved.shape == (rows, cols) and (moved == perm[:, None]).all():
        if (perm == np.arange(rows)).all():
            return m
        if sorted(perm) == list(range(rows)):
            return jax.tree.map(lambda a: a[perm], m)
    return family.from_gguf(name, quant.dequantize(m, "float32"), config)


def read_gguf(path: Path, dtype: str = "float32", quantization: str | None = None) -> Source:
    """Reads config, weights (dequantized as `dtype`, or with `quantization` kept or
    quantized as the module docstring says) and tokenizer from a GGUF file."""
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
    assembler = ParamAssembler(config, dtype, quantization)
    requantized = {}
    for tensor in tqdm(reader.tensors, desc=path.name, unit="tensor", leave=False, disable=None):
        name = hf_name(tensor.name, family)
        if name is None:
            continue
        matrix = len(tensor.shape) == 2 and quantization is not None
        try:
            if matrix and tensor.tensor_type in KEPT_TYPES:
                value = from_gguf_quantized(family, name, blocks(tensor), config)
            else:
                value = family.from_gguf(name, dequantize(tensor), config)
                if matrix and tensor.tensor_type not in FLOAT_TYPES:
                    requantized[tensor.name] = tensor.tensor_type.name
            assembler.put(name, value)
        except ValueError as e:  # ConversionError included
            raise ConversionError(f"GGUF tensor {tensor.name!r}: {e}") from e
    generation = {"eos_token_id": list(config.eos_token_ids)} if config.eos_token_ids else None
    if generation is not None and config.bos_token_id is not None:
        generation["bos_token_id"] = config.bos_token_id
    files = tokenizer_files_from_gguf(metadata)
    params = assembler.finish()
    for name in assembler.requantized_mixed:
        requantized[name] = "mixed block types across layers"
    return Source(config, params, files, generation, quantization, requantized)

"""Reads a llama.cpp GGUF file into a `Source`.

Every tensor type the `gguf` package can dequantize (F32, F16, BF16, Q8_0, Q4_0, Q4_1,
K-quants, ...) becomes float32 and then the target dtype. llama.cpp stores the Q and K
projection rows of `llama`-architecture models permuted for its interleaved rotary; they
are un-permuted here so the model's rotate-half rotary applies. A file without
`output.weight` has tied embeddings. The tokenizer is rebuilt from the GGUF vocabulary
(see gguf_tokenizer.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from tqdm import tqdm

from checkpoints_tools.gguf_tokenizer import tokenizer_files_from_gguf
from checkpoints_tools.source import ConversionError, ParamAssembler, Source
from ksana_jax.config import ModelConfig

_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_TO_HF = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a llama.cpp tensor name (unknown names pass through)."""
    if gguf_name in _GGUF_TO_HF:
        return _GGUF_TO_HF[gguf_name]
    match = _BLOCK.fullmatch(gguf_name)
    if match and match.group(2) in _GGUF_LAYER_TO_HF:
        return f"model.layers.{match.group(1)}.{_GGUF_LAYER_TO_HF[match.group(2)]}"
    return gguf_name


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation (interleaved -> rotate-half rotary)."""
    d_out = w.shape[0]
    head_dim = d_out // num_heads
    rest = w.shape[1:]
    return w.reshape(num_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(d_out, *rest)


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


def _llama_cpp_to_hf(tensor: Any, config: ModelConfig) -> np.ndarray:
    """The tensor dequantized, with Q/K rows un-permuted where llama.cpp permuted them."""
    value = dequantize(tensor)
    name = hf_name(tensor.name)
    # convert_hf_to_gguf permutes only for the llama architecture (not qwen2).
    if config.model_type != "llama" or not name.endswith(("q_proj.weight", "k_proj.weight")):
        return value
    heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
    expected = (heads * config.head_dim, config.hidden_size)
    if value.shape != expected:
        raise ConversionError(f"tensor {name!r} has shape {value.shape}, expected {expected}")
    return unpermute_rows(value, heads)


def read_gguf(path: Path, dtype: str = "float32") -> Source:
    """Reads config, dequantized weights (as `dtype`) and tokenizer from a GGUF file."""
    path = Path(path)
    try:
        reader = gguf.GGUFReader(path)
        metadata = read_metadata(reader)
        names = {t.name for t in reader.tensors}
    except (OSError, ValueError, IndexError) as e:  # IndexError: a header cut short
        raise ConversionError(f"cannot read GGUF file {path}: {e}") from e
    try:
        config = ModelConfig.from_gguf_metadata(metadata, names, dtype=dtype)
    except ValueError as e:
        raise ConversionError(f"{path}: {e}") from e

    assembler = ParamAssembler(config, dtype)
    for tensor in tqdm(reader.tensors, desc=path.name, unit="tensor", leave=False, disable=None):
        try:
            assembler.put(hf_name(tensor.name), _llama_cpp_to_hf(tensor, config))
        except ConversionError as e:
            raise ConversionError(f"GGUF tensor {tensor.name!r}: {e}") from e
    generation = {"eos_token_id": list(config.eos_token_ids)} if config.eos_token_ids else None
    if generation is not None and config.bos_token_id is not None:
        generation["bos_token_id"] = config.bos_token_id
    files = tokenizer_files_from_gguf(metadata)
    return Source(config, assembler.finish(), files, generation)

"""Reads a Hugging Face checkpoint directory (safetensors) into a `Source`.

Accepts both layouts found in the wild: transformers 4.x (rope at the top of config.json,
chat template inside tokenizer_config.json) and 5.x (`rope_parameters`, a separate
chat_template.jinja); a single model.safetensors or shards listed in
model.safetensors.index.json; tokenizer.json and/or tokenizer.model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import safetensors
from tqdm import tqdm

from checkpoints_tools.source import ConversionError, ParamAssembler, Source
from ksana_jax.config import ModelConfig
from ksana_jax.tokenizer import (
    TOKENIZER_CONFIG,
    TOKENIZER_JSON,
    TOKENIZER_MODEL,
    Tokenizer,
    read_tokenizer_config,
)

SAFETENSORS_INDEX = "model.safetensors.index.json"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"cannot read {path}: {e}") from e


def safetensors_files(path: Path) -> list[Path]:
    """The weight files of an HF directory, from the shard index or model.safetensors."""
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        shards = sorted(set(_read_json(index).get("weight_map", {}).values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ConversionError(f"{index} lists shard(s) that do not exist: {missing}")
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        found = sorted(p.name for p in path.iterdir())
        raise ConversionError(
            f"no weights in {path}: expected model.safetensors or {SAFETENSORS_INDEX} "
            f"(found {found}; pytorch_model.bin is not supported, re-save with safetensors)"
        )
    return files


def read_tokenizer_files(path: Path) -> dict[str, bytes]:
    """The tokenizer files to copy, with the chat template normalised into tokenizer_config."""
    files = {
        name: (path / name).read_bytes()
        for name in (TOKENIZER_JSON, TOKENIZER_MODEL)
        if (path / name).is_file()
    }
    if not files:
        raise ConversionError(
            f"no tokenizer in {path}: expected {TOKENIZER_JSON} or {TOKENIZER_MODEL}"
        )
    try:
        config = read_tokenizer_config(path)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"cannot read {path / TOKENIZER_CONFIG}: {e}") from e
    files[TOKENIZER_CONFIG] = json.dumps(config, indent=2, ensure_ascii=False).encode()
    try:
        Tokenizer.from_files(files)  # fail now, not when the checkpoint is loaded
    except Exception as e:
        name = TOKENIZER_JSON if TOKENIZER_JSON in files else TOKENIZER_MODEL
        raise ConversionError(f"cannot read {path / name}: {e}") from e
    return files


def read_hf_dir(path: Path, dtype: str | None = None, quantization: str | None = None) -> Source:
    """Reads config, weights (cast to `dtype`, default the checkpoint's; every matrix
    quantized as it arrives when `quantization` is given), tokenizer."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ConversionError(f"{path} is not a Hugging Face checkpoint: no config.json")
    hf_config = _read_json(path / "config.json")
    try:
        config = ModelConfig.from_hf_dict(hf_config)
    except ValueError as e:
        raise ConversionError(f"{path / 'config.json'}: {e}") from e
    files = safetensors_files(path)
    tokenizer_files = read_tokenizer_files(path)
    generation_path = path / "generation_config.json"
    generation = _read_json(generation_path) if generation_path.is_file() else None

    assembler = ParamAssembler(config, dtype or config.dtype, quantization)
    for file in files:
        try:
            # The "flax" framework returns jax arrays, which (unlike numpy) cover bfloat16.
            with safetensors.safe_open(file, framework="flax") as f:
                names = list(f.keys())
                # disable=None: a bar on a terminal only, never in piped logs.
                for name in tqdm(names, desc=file.name, unit="tensor", leave=False, disable=None):
                    assembler.put(name, np.asarray(f.get_tensor(name)))
        except (OSError, safetensors.SafetensorError) as e:
            raise ConversionError(f"cannot read {file}: {e}") from e
    if dtype:
        config = dataclasses.replace(config, dtype=dtype)
    return Source(config, assembler.finish(), tokenizer_files, generation, quantization)

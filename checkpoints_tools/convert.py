"""`ksana-jax convert SOURCE OUTPUT_DIR`: HF directory or GGUF file -> checkpoint directory.

The output (layout in ksana_jax/checkpoint.py) is written into a staging directory beside
OUTPUT_DIR and swapped into place only when complete, under a lock that keeps a second
convert out (output_dir.py): OUTPUT_DIR always holds a complete checkpoint, old or new.
An existing OUTPUT_DIR is kept unless `force` is set.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from checkpoints_tools import staging as staged
from checkpoints_tools.hf import read_hf_dir
from checkpoints_tools.source import ConversionError, Source
from ksana_jax import checkpoint
from ksana_jax.config import QUANTIZATIONS

DTYPES = ("float32", "bfloat16")


def read_source(
    path: str | Path, dtype: str | None = None, quantization: str | None = None
) -> Source:
    """Reads an HF checkpoint directory or a .gguf file; `dtype` None keeps the source's;
    `quantization` "int8" | "int4" quantizes every matrix (a GGUF's Q4_0 / Q4_1 / Q8_0 blocks
    are kept as they are)."""
    if dtype is not None and dtype not in DTYPES:
        raise ConversionError(f"unsupported --dtype {dtype!r}; supported: {DTYPES}")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ConversionError(
            f"unsupported --quantization {quantization!r}; supported: {QUANTIZATIONS}"
        )
    path = Path(path)
    if not path.exists():
        raise ConversionError(f"{path} does not exist")
    if path.is_dir():
        return read_hf_dir(path, dtype, quantization)
    if path.suffix.lower() == ".gguf":
        # Imported here: loading an HF directory or an orbax checkpoint needs no `gguf`.
        from checkpoints_tools.gguf_source import read_gguf

        return read_gguf(path, dtype or "float32", quantization)
    raise ConversionError(f"{path} is neither a Hugging Face checkpoint directory nor a .gguf file")


def _check_output_dir(output_dir: Path, force: bool) -> None:
    if output_dir.exists() and not force:
        raise ConversionError(f"{output_dir} already exists; pass --force to overwrite it")
    if output_dir.exists() and not output_dir.is_dir():
        raise ConversionError(f"{output_dir} exists and is not a directory")


@contextlib.contextmanager
def _exclusive(output_dir: Path, force: bool) -> Iterator[None]:
    """OUTPUT_DIR's lock held, stale staging directories removed, OUTPUT_DIR re-checked
    (a convert that finished while this one started makes it exist now)."""
    _check_output_dir(output_dir, force)
    try:
        output_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConversionError(f"cannot create {output_dir}: {e}") from e
    with staged.locked(output_dir):
        staged.remove_stale(output_dir)
        _check_output_dir(output_dir, force)
        yield


def _write_staged(source: Source, output_dir: Path) -> None:
    """Writes `source` into a staging directory beside `output_dir`, then swaps it in."""
    try:
        staging = staged.make_staging(output_dir)
    except OSError as e:
        raise ConversionError(f"cannot create {output_dir}: {e}") from e
    try:
        (staging / checkpoint.CONFIG_FILE).write_text(
            json.dumps(source.config.to_hf_dict(), indent=2) + "\n"
        )
        for name, contents in source.tokenizer_files.items():
            (staging / name).write_bytes(contents)
        if source.generation_config is not None:
            (staging / checkpoint.GENERATION_CONFIG_FILE).write_text(
                json.dumps(source.generation_config, indent=2) + "\n"
            )
        checkpoint.save_params(staging / checkpoint.PARAMS_DIR, source.params, source.config)
        checkpoint.write_quantization(staging, source.params, source.config, source.quantization)
        checkpoint.write_layout(staging)  # the marker, last: only a complete directory has it
        staged.swap_in(staging, output_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def write_checkpoint(source: Source, output_dir: str | Path, force: bool = False) -> Path:
    """Writes `source` as a checkpoint directory at `output_dir`, atomically and exclusively."""
    output_dir = Path(output_dir)
    with _exclusive(output_dir, force):
        _write_staged(source, output_dir)
    return output_dir


def convert(
    source_path: str | Path,
    output_dir: str | Path,
    dtype: str | None = None,
    force: bool = False,
    quantization: str | None = None,
    generation_config: Mapping[str, Any] | None = None,
) -> Path:
    """Reads SOURCE and writes the checkpoint directory; returns its path. Tensors
    requantized from another quantized type are named on stderr. `generation_config` values
    are written over the source's generation_config.json (the demo's recommended sampling)."""
    output_dir = Path(output_dir)
    with _exclusive(output_dir, force):  # fails before the slow part
        source = read_source(source_path, dtype, quantization)
        if generation_config:
            merged = {**(source.generation_config or {}), **generation_config}
            source = dataclasses.replace(source, generation_config=merged)
        if source.requantized:
            names = ", ".join(f"{n} ({t})" for n, t in source.requantized.items())
            print(
                f"requantized to {quantization} from their dequantized values: {names}",
                file=sys.stderr,
            )
        _write_staged(source, output_dir)
    return output_dir

"""Helpers of the `ksana-jax convert` tests (test_convert*.py): reading and editing a tiny
Hugging Face checkpoint's JSON files and tensors, a directory's files, the CLI's error lines."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import safetensors.numpy

PREFIX = "ksana-jax convert: error:"


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    data = read_json(path)
    edit(data)
    path.write_text(json.dumps(data))


def edit_tensors(path: Path, edit: Callable[[dict[str, np.ndarray]], None]) -> None:
    """Rewrites `path`/model.safetensors (float32, so the numpy framework suffices)."""
    file = path / "model.safetensors"
    tensors = safetensors.numpy.load_file(file)
    edit(tensors)
    safetensors.numpy.save_file(tensors, file, metadata={"format": "pt"})


def all_tensors(path: Path) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors |= safetensors.numpy.load_file(file)
    return tensors


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file under `path`, relative name -> contents."""
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]

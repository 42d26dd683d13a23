"""Orbax save/restore of the params pytree, and the checkpoint directory's file names.

A checkpoint directory (written by checkpoints_tools, read by `ksana_jax.load`):

    config.json              ModelConfig as a transformers-style config
    params/                  orbax checkpoint of the flat {name: array} params dict
    params_layout.json       {"matrices": "out_in"}: weight matrices are [out, in]
    tokenizer.json | tokenizer.model, tokenizer_config.json (chat template inside)
    generation_config.json   when the source had one

Params are stored flat ("layers.wq", ...) so the tree has no None leaves; restore takes an
abstract tree and can place every array straight into a sharding.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from ksana_jax.config import ModelConfig
from ksana_jax.models import registry

CONFIG_FILE = "config.json"
PARAMS_DIR = "params"
GENERATION_CONFIG_FILE = "generation_config.json"
LAYOUT_FILE = "params_layout.json"
# Weight matrices are [out, in]. Checkpoints written before this file existed hold
# [in, out] matrices; their square ones would restore without a shape error, so the file's
# absence is refused by name rather than guessed at.
LAYOUT = {"matrices": "out_in"}


def is_checkpoint_dir(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file() and (path / PARAMS_DIR).is_dir()


def write_layout(path: Path) -> None:
    (Path(path) / LAYOUT_FILE).write_text(json.dumps(LAYOUT) + "\n")


def has_current_layout(path: Path) -> bool:
    try:
        return json.loads((Path(path) / LAYOUT_FILE).read_text()) == LAYOUT
    except (OSError, ValueError):
        return False


def save_params(path: Path, params: registry.Params) -> None:
    """Writes params as an orbax checkpoint at `path` (which must not exist)."""
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(Path(path).absolute(), registry.params_to_flat(params))
    checkpointer.wait_until_finished()


def read_config(path: Path) -> ModelConfig:
    return ModelConfig.from_hf_dict(json.loads((Path(path) / CONFIG_FILE).read_text()))


def load_params(
    path: Path,
    cfg: ModelConfig,
    dtype: str,
    sharding_for: Callable[[str], jax.sharding.Sharding] | None = None,
) -> registry.Params:
    """Restores a checkpoint directory's params as `dtype`, optionally straight into shardings.

    `sharding_for(flat_name)` gives each array's sharding; by default the first device.
    Raises ValueError for a checkpoint of an older layout (no params_layout.json).
    """
    if not has_current_layout(path):
        raise ValueError(
            f"{path} was written by an older ksana-jax ([in, out] weight matrices, no "
            f"{LAYOUT_FILE}); convert its source again: ksana-jax convert SOURCE {path} --force"
        )
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = {
        name: jax.ShapeDtypeStruct(
            shape, jnp.dtype(dtype), sharding=sharding_for(name) if sharding_for else device
        )
        for name, shape in registry.param_shapes(cfg).items()
    }
    with ocp.StandardCheckpointer() as checkpointer:
        flat = checkpointer.restore((Path(path) / PARAMS_DIR).absolute(), abstract)
    return registry.params_from_flat(flat)

"""Orbax save/restore of the params pytree, and the checkpoint directory's file names.

A checkpoint directory (written by checkpoints_tools, read by `ksana_jax.load`):

    config.json              ModelConfig as a transformers-style config
    params/                  orbax checkpoint of the flat {name: array} params dict
    params_layout.json       {"matrices": "out_in"}: weight matrices are [out, in]
    quantization.json        only for quantized params: {"quantization": "int4", "formats":
                             {"layers.wq": "int4", "embed": "int8", ...}}; each named
                             parameter is stored as its arrays (params/NAME/packed, ...,
                             see quant.py), the others as float arrays
    tokenizer.json | tokenizer.model, tokenizer_config.json (chat template inside)
    generation_config.json   when the source had one

Params are stored flat ("layers.wq", ...) so the tree has no None leaves; restore takes an
abstract tree and can place every array straight into a sharding.

A directory is a checkpoint when it holds params_layout.json (written last, so only a
complete directory has it) or params/ (checkpoints from before that file): such a directory
is never read as a Hugging Face one. Loading checks it before the slow restore: every file
there, JSON parsed, config.json's shapes against the shapes params/ records. A damaged
checkpoint raises `CheckpointError` (a ValueError) naming the file or parameter, in one line
that says to convert again; the CLI prints that line, not a traceback.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from ksana_jax import quant
from ksana_jax.config import ModelConfig
from ksana_jax.models import registry
from ksana_jax.tokenizer import TOKENIZER_JSON, TOKENIZER_MODEL, Tokenizer

CONFIG_FILE = "config.json"
PARAMS_DIR = "params"
GENERATION_CONFIG_FILE = "generation_config.json"
LAYOUT_FILE = "params_layout.json"
QUANTIZATION_FILE = "quantization.json"
# Weight matrices are [out, in]. Checkpoints written before this file existed hold
# [in, out] matrices; their square ones would restore without a shape error, so the file's
# absence is refused by name rather than guessed at.
LAYOUT = {"matrices": "out_in"}


TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# Read later, but parsed up front so a damaged one is named before the slow restore.
_OPTIONAL_JSON = (
    LAYOUT_FILE,
    GENERATION_CONFIG_FILE,
    TOKENIZER_JSON,
    TOKENIZER_CONFIG_FILE,
    QUANTIZATION_FILE,
)


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names what and where."""


def is_checkpoint_dir(path: Path) -> bool:
    """True for a directory `ksana-jax convert` wrote (complete or damaged), by its own files."""
    path = Path(path)
    return path.is_dir() and ((path / LAYOUT_FILE).exists() or (path / PARAMS_DIR).exists())


def _redo(path: Path) -> str:
    return f"convert its source again: ksana-jax convert SOURCE {path} --force"


def _damaged(path: Path, what: str, why: object) -> CheckpointError:
    why = " ".join(str(why).split())  # one line
    if len(why) > 200:
        why = why[:200] + "..."
    return CheckpointError(f"{what} in {path} is damaged ({why}); {_redo(path)}")


def _read_json(path: Path, name: str) -> Any:
    try:
        return json.loads((path / name).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{name} is missing from {path}; {_redo(path)}") from None
    except (OSError, ValueError) as e:  # ValueError: bad JSON or bad UTF-8
        raise _damaged(path, name, e) from None


def validate(path: Path) -> ModelConfig:
    """Checks a checkpoint directory before anything slow reads it; returns its config.

    Raises CheckpointError naming the first missing or unreadable file, or the first
    parameter whose stored shape differs from what config.json implies.
    """
    path = Path(path)
    config = read_config(path)
    for name in _OPTIONAL_JSON:  # a missing params_layout.json: load_params says why
        if (path / name).exists():
            _read_json(path, name)
    if not (path / TOKENIZER_JSON).is_file() and not (path / TOKENIZER_MODEL).is_file():
        raise CheckpointError(
            f"{TOKENIZER_JSON} (or {TOKENIZER_MODEL}) is missing from {path}; {_redo(path)}"
        )
    check_param_shapes(path, config)
    return config


def read_config(path: Path) -> ModelConfig:
    hf = _read_json(Path(path), CONFIG_FILE)
    try:
        return ModelConfig.from_hf_dict(hf)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise _damaged(Path(path), CONFIG_FILE, e) from None


def _stored_metadata(path: Path) -> dict[str, Any]:
    """params/'s metadata: name -> ArrayMetadata, or for a quantized matrix a dict of them."""
    params = Path(path) / PARAMS_DIR
    if not params.is_dir():
        raise CheckpointError(f"{PARAMS_DIR}/ is missing from {path}; {_redo(path)}")
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            tree = checkpointer.metadata(params.absolute()).item_metadata
        return {
            name: dict(meta) if isinstance(meta, dict) else meta
            for name, meta in dict(tree).items()
        }
    except Exception as e:  # orbax raises many kinds (JSON, FileNotFound, ValueError, ...)
        raise _damaged(path, f"{PARAMS_DIR}/ (its metadata)", e) from None


def read_quantization(path: Path) -> dict[str, Any] | None:
    """quantization.json's contents, or None for a float checkpoint."""
    if not (Path(path) / QUANTIZATION_FILE).exists():
        return None
    data = _read_json(Path(path), QUANTIZATION_FILE)
    if not isinstance(data, dict) or not isinstance(data.get("formats"), dict):
        raise _damaged(Path(path), QUANTIZATION_FILE, "no formats object")
    for name, fmt in data["formats"].items():
        if fmt not in quant.QUANTIZATIONS:
            raise _damaged(Path(path), QUANTIZATION_FILE, f"{name}: unknown format {fmt!r}")
    return data


def stored_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape as params/ records it (its metadata; no array is read); a
    quantized matrix's is the float matrix's it stands for."""
    formats = (read_quantization(path) or {}).get("formats", {})
    shapes = {}
    for name, meta in _stored_metadata(path).items():
        if isinstance(meta, dict):
            if name not in formats:
                raise _damaged(Path(path), QUANTIZATION_FILE, f"no format for {name}")
            arrays = {k: tuple(v.shape) for k, v in meta.items()}
            shapes[name] = quant.logical_shape(formats[name], arrays)
        else:
            shapes[name] = tuple(meta.shape)
    return shapes


def check_param_shapes(path: Path, config: ModelConfig) -> None:
    """Raises CheckpointError when config.json's parameter shapes are not the stored ones."""
    stored = stored_shapes(path)
    for name, shape in registry.param_shapes(config).items():
        if name not in stored:
            raise CheckpointError(
                f"parameter {name} (which {CONFIG_FILE} implies) is not in {path / PARAMS_DIR}; "
                f"{_redo(path)}"
            )
        if tuple(stored[name]) != tuple(shape):
            raise CheckpointError(
                f"{CONFIG_FILE} in {path} does not match its params: parameter {name} is stored "
                f"as {tuple(stored[name])} but {CONFIG_FILE} implies {tuple(shape)}; {_redo(path)}"
            )


def read_tokenizer(path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_dir(path)
    except Exception as e:  # tokenizers / sentencepiece raise their own kinds
        names = [n for n in (TOKENIZER_JSON, TOKENIZER_MODEL) if (Path(path) / n).is_file()]
        raise _damaged(Path(path), " / ".join(names) or "the tokenizer", e) from None


def read_generation_config(path: Path) -> dict[str, Any]:
    """generation_config.json's contents ({} when the source had none)."""
    if not (Path(path) / GENERATION_CONFIG_FILE).exists():
        return {}
    data = _read_json(Path(path), GENERATION_CONFIG_FILE)
    if not isinstance(data, dict):
        raise _damaged(Path(path), GENERATION_CONFIG_FILE, "not a JSON object")
    return data


def write_layout(path: Path) -> None:
    (Path(path) / LAYOUT_FILE).write_text(json.dumps(LAYOUT) + "\n")


def has_current_layout(path: Path) -> bool:
    try:
        return json.loads((Path(path) / LAYOUT_FILE).read_text()) == LAYOUT
    except (OSError, ValueError):
        return False


def save_params(path: Path, params: registry.Params, cfg: ModelConfig) -> None:
    """Writes params as an orbax checkpoint at `path` (which must not exist); a quantized
    matrix as a dict of its arrays (write_quantization names its format)."""
    flat = {
        name: quant.to_arrays(value) if quant.is_quantized(value) else value
        for name, value in registry.params_to_flat(params, cfg).items()
    }
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(Path(path).absolute(), flat)
    checkpointer.wait_until_finished()


def write_quantization(
    path: Path, params: registry.Params, cfg: ModelConfig, quantization: str | None
) -> None:
    """quantization.json naming each quantized parameter's format (nothing for float params)."""
    formats = quant.formats(registry.params_to_flat(params, cfg))
    if quantization is None and not formats:
        return
    data = {"quantization": quantization, "formats": formats}
    (Path(path) / QUANTIZATION_FILE).write_text(json.dumps(data, indent=2) + "\n")


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
    formats = (read_quantization(path) or {}).get("formats", {})
    stored = _stored_metadata(path) if formats else {}
    abstract: dict[str, Any] = {}
    for name, shape in registry.param_shapes(cfg).items():
        where = sharding_for(name) if sharding_for else device
        if name in formats:  # its arrays as stored: integer values, float16 / float32 scales
            # Each array has the matrix's axes (quant.py), so the matrix's sharding fits it;
            # one whose dims do not divide is replicated, as sharding.py does.
            abstract[name] = {
                k: jax.ShapeDtypeStruct(
                    tuple(m.shape), m.dtype, sharding=_fitting(where, tuple(m.shape))
                )
                for k, m in stored[name].items()
            }
        else:
            abstract[name] = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=where)
    previous_hook = _quiet_late_reads()
    # When a read fails, the other reads' futures fail too and, never awaited, asyncio logs
    # each one as it is collected ("Future exception was never retrieved"), some while the
    # restore is still running: the error below says it once. Kept after a failure.
    asyncio_log = logging.getLogger("asyncio")
    asyncio_log.addFilter(_unretrieved_futures)
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            flat = checkpointer.restore((Path(path) / PARAMS_DIR).absolute(), abstract)
    except Exception as e:  # TensorStore and orbax errors: name the parameter
        name = _failed_param(e)
        what = f"parameter {name}" if name else "a parameter"
        raise CheckpointError(
            f"{what} in {Path(path) / PARAMS_DIR} is damaged or truncated "
            f"({_first_line(e)}); {_redo(Path(path))}"
        ) from None
    sys.unraisablehook = previous_hook  # nothing failed, so nothing late to silence
    asyncio_log.removeFilter(_unretrieved_futures)
    for name, fmt in formats.items():
        flat[name] = quant.from_arrays(fmt, flat[name], dtype)
    return registry.params_from_flat(flat, cfg)


def _fitting(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> jax.sharding.Sharding:
    """`sharding` when every split dim of `shape` divides by its devices, else replicated."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    for dim, axes in zip(shape, sharding.spec, strict=False):
        axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
        if dim % max(1, int(np.prod([sharding.mesh.shape[a] for a in axes]))):
            return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return sharding


def _unretrieved_futures(record: logging.LogRecord) -> bool:
    """A logging filter dropping asyncio's "... exception was never retrieved" records (the
    message's first line; the lines after it name the future)."""
    first = record.getMessage().split("\n", 1)[0]
    return not first.endswith("exception was never retrieved")


def _quiet_late_reads() -> Callable[[Any], None]:
    """After a failed restore, TensorStore's reads of the other parameters finish after
    orbax has closed its event loop: each reports "Event loop is closed", and each of
    orbax's read coroutines left unfinished reports its own read error, as unraisable
    exceptions (tracebacks on stderr, some during the restore). Installed for the restore
    and kept after a failure, which is reported once already: drops exactly those, passes
    the rest on. Returns the hook it replaced."""
    previous = sys.unraisablehook
    if getattr(previous, "_ksana_quiet", False):
        return previous

    def hook(unraisable: Any) -> None:
        exc, obj = unraisable.exc_value, unraisable.object
        code = getattr(obj, "cr_code", None)
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return
        if code is not None and "orbax" in code.co_filename:
            return
        previous(unraisable)

    hook._ksana_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
    return previous


_READING = re.compile(r'Error reading "([^"/]+)/')
_KVSTORE_PATH = re.compile(r"'path': '([^'/]+)/'")


def _failed_param(e: BaseException) -> str | None:
    """The parameter a TensorStore error names (it reads NAME/CHUNK from the OCDBT store)."""
    seen: BaseException | None = e
    while seen is not None:
        for pattern in (_READING, _KVSTORE_PATH):
            if match := pattern.search(str(seen)):
                return match.group(1)
        seen = seen.__cause__ or seen.__context__
    return None


def _first_line(e: BaseException) -> str:
    """The innermost cause's message, cut to one short line."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = " ".join(str(e).split(" See full TensorStore details")[0].split())
    return text[:200] + ("..." if len(text) > 200 else "")

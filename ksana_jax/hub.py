"""Models named by their Hugging Face id (`org/name`): fetched once, converted once.

`hub_checkpoint("org/name", revision)` downloads only what conversion reads (config,
tokenizer, generation config, chat template and safetensors files) with `huggingface_hub`,
which shows its own progress bars, honours `HF_HUB_OFFLINE=1` (then only the local HF cache
is read), `HF_HUB_CACHE`/`HF_HOME`, and takes the token from `HF_TOKEN`. The snapshot is
converted into the ksana-jax cache as `<cache>/hub/org--name/<commit>`, in the source's own
dtype: `load(..., dtype=...)` casts at load time, so one conversion serves every dtype, and a
new commit of the repository is a new directory. Later calls find it and convert nothing.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from ksana_jax import checkpoint

# What conversion reads (checkpoints_tools/hf.py); weights only as safetensors.
ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "*.safetensors",
    "model.safetensors.index.json",
]
# Hugging Face repository ids: `owner/name`, letters, digits, `-`, `_`, `.`.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def is_hub_id(model: str) -> bool:
    """True for `owner/name` that is not an existing local path."""
    return _HUB_ID.fullmatch(model) is not None and not Path(model).exists()


def hub_checkpoint(repo_id: str, revision: str | None, cache: Path) -> Path:
    """The converted checkpoint directory of `repo_id` at `revision` (None: main), kept under
    `cache` (the ksana-jax cache directory).

    Raises ValueError naming the id when it cannot be fetched (offline and not in the local
    HF cache, no such repository or revision, no access) or holds no safetensors weights.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        snapshot = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                allow_patterns=ALLOW_PATTERNS,
                token=os.environ.get("HF_TOKEN") or None,
            )
        )
    except LocalEntryNotFoundError as e:
        raise ValueError(
            f"model {repo_id!r} is not a local path, and as a Hugging Face id{_at(revision)} it "
            "is not in the local Hugging Face cache while the hub cannot be reached "
            f"(HF_HUB_OFFLINE set, or no network): {_first_line(e)}"
        ) from None
    except (HfHubHTTPError, OSError) as e:
        raise ValueError(
            f"model {repo_id!r} is not a local path, and as a Hugging Face id{_at(revision)} "
            f"it could not be fetched: {_first_line(e)}"
        ) from None
    if not any(snapshot.glob("*.safetensors")):
        raise ValueError(
            f"model {repo_id!r}{_at(revision)} has no .safetensors weights (found: "
            f"{sorted(p.name for p in snapshot.iterdir())}); ksana-jax converts safetensors only"
        )
    # The snapshot directory is named by the commit the revision resolved to.
    out = cache / "hub" / repo_id.replace("/", "--") / snapshot.name
    if not (checkpoint.is_checkpoint_dir(out) and checkpoint.has_current_layout(out)):
        from checkpoints_tools import convert  # conversion lives above the engine

        print(f"converting {repo_id}{_at(revision)} into {out} (once)", file=sys.stderr)
        convert(snapshot, out, force=True)
    return out


def _at(revision: str | None) -> str:
    return "" if revision is None else f" at revision {revision!r}"


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]

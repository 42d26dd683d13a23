"""Default sampling parameters from the model's generation_config.json.

As vLLM does with `--generation-config auto` (its default): a server request that leaves one
of these fields out (or sends null), and an `LLM` call without SamplingParams, get the
model's value, and the OpenAI default only where the model has none. A field the request
sets always wins. HF's `do_sample` is not read (vLLM does not either): a model whose
generation_config.json says `temperature: 0.6` samples at 0.6.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ksana_jax.sampling_params import SamplingParams

log = logging.getLogger("ksana_jax")

# Request field -> the default when the model's generation config has no value for it.
OPENAI_DEFAULTS: dict[str, float | int] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


def sampling_defaults(generation_config: Mapping[str, Any]) -> dict[str, float | int]:
    """The defaults for OPENAI_DEFAULTS' fields: the model's where it has a valid one."""
    defaults = dict(OPENAI_DEFAULTS)
    for name in OPENAI_DEFAULTS:
        value = generation_config.get(name)
        if value is None or isinstance(value, bool):
            continue
        try:
            SamplingParams(**{name: value})
        except (ValueError, TypeError) as e:
            log.warning("ignoring %s=%r from generation_config.json: %s", name, value, e)
            continue
        defaults[name] = value
    return defaults


def described(defaults: Mapping[str, float | int]) -> str:
    """`temperature 0.2, top_p 0.9`: the fields whose default is the model's own."""
    changed = [f"{k} {v}" for k, v in defaults.items() if v != OPENAI_DEFAULTS[k]]
    return ", ".join(changed) or "OpenAI's (the model's generation_config.json sets none)"

"""Per-request sampling options, with vLLM's field names (host side, no jax).

Validated on construction: a bad value is a `ValueError` naming the field, so the server can
answer 400 with it. Options the engine cannot honour do not exist here, so none is silently
ignored.
"""

from __future__ import annotations

import dataclasses
import enum
import json as _json
from collections.abc import Mapping, Sequence
from typing import Any

MAX_LOGIT_BIAS = 128  # logit_bias entries per request: a fixed-shape row of the step's inputs
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's StructuredOutputsParams): a JSON schema
    (dict or JSON text), a regular expression the whole output matches, one of `choice`'s
    strings, a grammar (Lark, or EBNF/GBNF as llama.cpp writes it), or any JSON object."""

    json: str | dict | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of {', '.join(STRUCTURED_KINDS)}, got "
                f"{given or 'none'}"
            )
        # as text: equal schemas share one compile (key order kept: it is the output order)
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", _json.dumps(self.json))
        if self.choice is not None:
            if (
                isinstance(self.choice, str)
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise ValueError(
                    f"structured_outputs.choice must be a non-empty list of non-empty strings, got "
                    f"{self.choice!r}"
                )
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, Any]:
        """Identifies the compiled grammar (the compile cache's key)."""
        return self.kind, getattr(self, self.kind)


class RequestOutputKind(enum.IntEnum):
    """Which outputs `LLMEngine.step` gives a request (vLLM's names and values)."""

    CUMULATIVE = 0  # everything so far, at each step: not offered (the engine emits deltas;
    # LLM and AsyncEngine add them up, RequestOutput.add does it for a caller of step())
    DELTA = 1  # after each step that advanced it, only what is new (the default)
    FINAL_ONLY = 2  # one output, when it finishes, holding everything (LLM.generate's)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 or -1 = all tokens
    min_p: float = 0.0  # [0, 1]
    repetition_penalty: float = 1.0  # > 0; on prompt and output tokens (HF/vLLM)
    presence_penalty: float = 0.0  # [-2, 2]; on output tokens
    frequency_penalty: float = 0.0  # [-2, 2]; on output tokens
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to the context limit
    min_tokens: int = 0
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs of each sampled token
    # top-N logprobs of each prompt token after the first (vLLM); the request recomputes its
    # whole prompt (no prefix-cache hit) so every position's logits exist
    prompt_logprobs: int | None = None
    # OpenAI: token id -> bias in [-100, 100] added to the logits before sampling (the
    # logprobs reported stay the model's raw ones); ids are checked against the vocabulary
    # by the engine
    logit_bias: Mapping[int, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # constrain the output to a JSON schema, regex, choice or grammar (ksana_jax/structured.py)
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.DELTA

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        checks = [
            ("n", self.n >= 1, "must be >= 1"),
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k >= -1, "must be -1, 0 (disabled) or positive"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0, "must be > 0"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be >= 1"),
            ("min_tokens", self.min_tokens >= 0, "must be >= 0"),
            ("logprobs", self.logprobs is None or self.logprobs >= 0, "must be >= 0"),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or self.prompt_logprobs >= 0,
                "must be >= 0",
            ),
            ("seed", self.seed is None or 0 <= self.seed < 2**32, "must be in [0, 2**32)"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
        ]
        if self.output_kind in (RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY):
            object.__setattr__(self, "output_kind", RequestOutputKind(self.output_kind))
        else:
            raise ValueError(
                f"output_kind must be RequestOutputKind.DELTA or FINAL_ONLY, got "
                f"{self.output_kind!r} (the engine emits deltas: RequestOutput.add adds them up)"
            )
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"{name} {rule}, got {getattr(self, name)!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got {self.min_tokens} > {self.max_tokens}"
            )

    def __hash__(self) -> int:  # logit_bias is a dict: hash what identifies the rest
        return hash(tuple(v for k, v in vars(self).items() if k != "logit_bias"))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _logit_bias(bias: Mapping[int, float]) -> dict[int, float]:
    """A logit_bias mapping as {int id: float bias}, checked: at most MAX_LOGIT_BIAS entries,
    ids >= 0 (JSON's string keys accepted), biases in [-100, 100]."""
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias must be a mapping of token id to bias, got {bias!r}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
    out = {}
    for key, value in bias.items():
        try:
            token_id, b = int(key), float(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"logit_bias must map token ids to numbers, got {key!r}: {value!r}"
            ) from None
        if token_id < 0:
            raise ValueError(f"logit_bias token ids must be >= 0, got {key!r}")
        if not -100 <= b <= 100:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {value!r} for {key!r}")
        out[token_id] = b
    return out

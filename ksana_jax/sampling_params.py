"""Per-request sampling options, with vLLM's field names (host side, no jax).

Validated on construction: a bad value is a `ValueError` naming the field, so the server can
answer 400 with it. Options the engine cannot honour do not exist here, so none is silently
ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


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
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
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
            ("seed", self.seed is None or 0 <= self.seed < 2**32, "must be in [0, 2**32)"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"{name} {rule}, got {getattr(self, name)!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got {self.min_tokens} > {self.max_tokens}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

"""Speculative decoding on the host: the configuration, and n-gram (prompt lookup) proposals.

In: the running requests at the start of a schedule. Out: up to k proposed next tokens per
decode row (with a draft model, k DRAFTED placeholders the step fills in on the device with
the draft's greedy proposals, see draft.py; the host learns them with the step's tokens).
The scheduler runs each such row as a chunk of its last token plus its proposals (counted
against the token budget, with pages for them); the step samples the target at all
1 + k positions and the scheduler keeps the longest prefix of proposals the target agrees
with plus the target's own token after it (`num_accepted`), rolling `num_computed_tokens`
back over the rest, whose KV slots the next steps overwrite.

Verification is exact (runner._sample_positions): at each position the step draws the
target's token with the same seeded noise the non-speculative sampler uses for that output
index, and a proposal is accepted iff it equals that draw. For a one-hot draft (n-gram, or
a greedy draft model) this *is* rejection sampling -- accept d with probability p(d), else
draw from p with d removed, renormalised -- and it makes a request's tokens identical with
speculation on or off, so speculation may switch itself on and off per step without changing
outputs.

Speculation turns itself down where it does not pay: no proposals while more than
`disable_by_batch_size` requests run (a batch is already compute-bound), and none for a row
whose running acceptance (an exponential average of accepted / proposed) is below
`min_acceptance` (it recovers slowly while the row does not speculate, so it is retried).
Rows with penalties or still below min_tokens never speculate: their sampling depends on
tokens before each position in ways the per-row inputs do not carry. Nor do rows with a
grammar constraint: the token mask at each position depends on the tokens before it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

METHODS = ("ngram", "draft_model")
DRAFTED = -1  # a draft model's proposal: the step fills it in on the device (draft.py)
ACCEPTANCE_DECAY = 0.8  # weight of the past in a row's running acceptance
ACCEPTANCE_RECOVERY = 0.005  # per step without proposals a turned-down row drifts back to 1
# (from 0.15 to 0.2 in ~12 steps: a row that stopped paying is retried now and then)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` names; `disable_by_batch_size` and `min_acceptance` say
    where speculation turns itself down."""

    method: str | None = None  # "ngram", or "draft_model" when `model` is given
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None
    disable_by_batch_size: int = 8
    min_acceptance: float = 0.2

    def __post_init__(self) -> None:
        if self.method is None:
            object.__setattr__(self, "method", "ngram" if self.model is None else "draft_model")
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {METHODS}, got {self.method!r}"
            )
        if (self.method == "draft_model") != isinstance(self.model, str):
            raise ValueError(
                f"speculative_config.model must be a draft model's path exactly when the method "
                f"is 'draft_model' (method {self.method!r}, model {self.model!r})"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_min", "disable_by_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.prompt_lookup_max, int) or not (
            self.prompt_lookup_min <= self.prompt_lookup_max
        ):
            raise ValueError(
                f"speculative_config.prompt_lookup_max must be an int >= prompt_lookup_min "
                f"({self.prompt_lookup_min}), got {self.prompt_lookup_max!r}"
            )
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError(
                f"speculative_config.min_acceptance must be in [0, 1], got {self.min_acceptance}"
            )

    @classmethod
    def from_dict(cls, value: Mapping[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """From vLLM's dict; an unknown key is a ValueError naming it."""
        if isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown keys {unknown}; known: {sorted(known)}"
            )
        return cls(**value)


def ngram_proposal(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> np.ndarray:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix
    (n_max down to n_min tokens) of `tokens` i64[L]; empty if no suffix recurs."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        # windows starting at 0 .. L - n - 1 (not the suffix itself), compared to the suffix
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if len(hits):
            start = hits[-1] + n
            return tokens[start : start + k]
    return tokens[:0]


class Speculator:
    """Proposes tokens for the rows that should speculate, and keeps acceptance counts."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        k = config.num_speculative_tokens
        self.num_drafted = 0
        self.num_accepted = 0
        self.accepted_per_position = [0] * k  # proposals accepted at position j
        self.drafted_per_position = [0] * k

    def propose(self, requests: Sequence, num_running: int) -> dict[Any, list[int]]:
        """Proposals for the decode rows among `requests` (all tokens known and computed but
        the last), when at most disable_by_batch_size requests run."""
        cfg = self.config
        if num_running > cfg.disable_by_batch_size:
            return {}
        out = {}
        for r in requests:
            if not _can_speculate(r):
                continue
            if r.spec_acceptance < cfg.min_acceptance:
                r.spec_acceptance += (1.0 - r.spec_acceptance) * ACCEPTANCE_RECOVERY
                continue
            if r.num_placeholders or r.num_computed_tokens != r.num_known_tokens - 1:
                continue  # its last token is not on the host yet, or it is still prefilling
            if cfg.method == "draft_model":
                out[r] = [DRAFTED] * cfg.num_speculative_tokens
                continue
            tokens = np.asarray(r.all_token_ids, np.int64)
            draft = ngram_proposal(
                tokens, cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max
            )
            if len(draft):
                out[r] = draft.tolist()
        return out

    def may_propose(self, requests: Sequence) -> bool:
        """Whether the next `propose` could propose for any of `requests` (the running ones)
        once their last tokens are on the host: the engine finishes a step before the next
        only then, and overlaps steps while every row is turned down."""
        cfg = self.config
        return len(requests) <= cfg.disable_by_batch_size and any(
            _can_speculate(r) and r.spec_acceptance >= cfg.min_acceptance for r in requests
        )

    def record(self, request, num_drafted: int, num_accepted: int) -> None:
        """Counts one verified row: num_accepted of its num_drafted proposals held."""
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        for j in range(num_drafted):
            self.drafted_per_position[j] += 1
            self.accepted_per_position[j] += j < num_accepted
        request.spec_acceptance = ACCEPTANCE_DECAY * request.spec_acceptance + (
            1 - ACCEPTANCE_DECAY
        ) * (num_accepted / num_drafted)


def _can_speculate(request) -> bool:
    """Rows with penalties, below min_tokens or with a grammar never speculate (module doc)."""
    p = request.params
    return (
        p.repetition_penalty == 1.0
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
        and len(request.output_token_ids) >= p.min_tokens
        and request.matcher is None
    )

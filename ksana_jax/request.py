"""One request's host-side state (no jax): tokens, pages, progress, and outputs.

A request with `n > 1` samples is run as n `Request`s (one per sample) that share the
parent's id; each holds its own pages, output tokens and detokenizer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from ksana_jax.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: scheduler queues look requests up with `in` / remove
class Request:
    request_id: str  # unique per sample: "<parent id>" or "<parent id>#<index>"
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # resolved seed (params.seed + index, or drawn by the engine)
    parent_id: str = ""
    index: int = 0  # sample index within the parent (n > 1)
    priority: int = 0  # lower runs first (vLLM's convention); ties by arrival
    arrival: int = 0  # engine-wide sequence number
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    page_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in (or being written to) its pages
    # Sampled by a step still in flight, not yet known on the host (0 or 1): the next step
    # feeds it from the device (async scheduling). Counted in num_tokens.
    num_placeholders: int = 0
    slot: int = -1  # row of the persistent batch while running (scheduler-assigned)
    # Prefix cache: the chained hashes of the pages whose tokens are all computed, and what
    # besides token ids changes K/V (a future LoRA id): only equal salts share pages.
    page_hashes: list[bytes] = field(default_factory=list)
    cache_salt: str = ""
    num_preemptions: int = 0
    # Prompt tokens the prefix cache held when it was first scheduled (vLLM's; -1: not yet)
    num_cached_tokens: int = -1
    # Speculative decoding: running fraction of proposals the target accepted (spec_decode.py)
    spec_acceptance: float = 1.0
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stopped_on_token: bool = False  # ended by a stop token id or EOS (not part of the text)
    # vLLM's: the stop string or stop token id that ended it; None for EOS, length, abort
    stop_reason: str | int | None = None
    # structured output: the grammar's position (structured.GrammarMatcher), advanced by the
    # scheduler with each sampled token; None when unconstrained
    matcher: Any = None
    text: str = ""  # detokenized output (host postprocessing fills it)
    text_offsets: list[int] = field(default_factory=list)  # per output token, in `text`
    # What the engine's outputs have carried so far (it emits deltas).
    num_emitted_tokens: int = 0
    num_emitted_chars: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens plus placeholders: what the next step continues from."""
        return self.num_known_tokens + self.num_placeholders

    @property
    def num_output_tokens(self) -> int:
        """Outputs known and in flight."""
        return len(self.output_token_ids) + self.num_placeholders

    def token_ids(self, start: int, end: int) -> list[int]:
        """Known tokens at positions [start, end), without concatenating the whole history."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:end] + self.output_token_ids[: max(0, end - num_prompt)]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, int]:
        """Scheduling order: priority first, then first come first served."""
        return (self.priority, self.arrival)

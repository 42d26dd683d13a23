"""What the engine hands back per request (vLLM's shapes and names).

`LLMEngine.step()` emits deltas: each CompletionOutput holds only what is new since the
request's previous output -- token ids, text (from the request's own detokenizer, held back
while it could still be the start of a stop string), logprobs, and each new token's offset
in the text -- so emitting costs the same at token 10 as at token 10,000. `RequestOutput.add`
accumulates deltas into the cumulative output `LLM` returns and `AsyncEngine` streams.
A request with `prompt_logprobs` gets them whole in its first delta (they are complete once
the prompt is computed, when its first token is sampled).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Logprob:
    """One token's entry in a prompt-logprobs dict (vLLM's `Logprob`)."""

    logprob: float
    rank: int  # 1 + the number of tokens the model gave a higher logprob
    decoded_token: str | None = None


# Per prompt token: None for the first, then {token id: Logprob} holding the actual token
# and the top-k of the distribution that predicted it.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # per token: {token id: logprob}, top-N + sampled
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    # Per token: where its text starts in the choice's text (before a stop string cut).
    text_offsets: list[int] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (vLLM's)
    error: str | None = None  # set when processing this request raised (it is finished)
    prompt_logprobs: PromptLogprobs | None = None  # SamplingParams.prompt_logprobs

    def add(self, delta: RequestOutput) -> None:
        """Appends the engine's next delta output of this request to this (cumulative) one."""
        for c, d in zip(self.outputs, delta.outputs, strict=True):
            assert c.index == d.index, (c.index, d.index)
            c.text += d.text
            c.token_ids.extend(d.token_ids)
            # Extended in place (a new list each time would make accumulating quadratic in
            # the output's length); the engine hands every delta lists of its own.
            if d.logprobs is not None:
                c.logprobs = c.logprobs if c.logprobs is not None else []
                c.logprobs.extend(d.logprobs)
            if d.text_offsets is not None:
                c.text_offsets = c.text_offsets if c.text_offsets is not None else []
                c.text_offsets.extend(d.text_offsets)
            c.finish_reason = d.finish_reason
            c.stop_reason = d.stop_reason
        self.finished = delta.finished
        self.error = delta.error
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs

    def copy(self) -> RequestOutput:
        """A copy whose lists later `add` calls do not touch."""
        outputs = [
            dataclasses.replace(
                c,
                token_ids=list(c.token_ids),
                logprobs=None if c.logprobs is None else list(c.logprobs),
                text_offsets=None if c.text_offsets is None else list(c.text_offsets),
            )
            for c in self.outputs
        ]
        return dataclasses.replace(self, outputs=outputs)

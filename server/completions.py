"""POST /v1/completions: prompt(s) -> text, streamed (SSE) or whole.

    in:  a CompletionRequest: one prompt or several (text, token ids, or lists of either),
         sampling fields, n, echo, logprobs, stream
    out: a CompletionResponse with n choices per prompt (choice index = prompt * n + sample),
         or, streaming, one CompletionResponse chunk per choice per engine delta, the usage
         chunk if asked for, then `[DONE]`

Each prompt is one engine request (streaming.py). Streamed chunks are the engine's deltas as
they come; the whole response adds them up. Both build their choices with `_choice`, so the
chunks of a stream join to the whole response: text, logprobs and text offsets alike.

`echo` puts the prompt before each choice's text (in a stream, in the choice's first chunk).
With `logprobs: N` too, the prompt's tokens lead the choice's logprobs: the engine computes
the prompt's logprobs (SamplingParams.prompt_logprobs = N, as vLLM does for echo), the first
token's are null. `max_tokens: 0` with echo scores the prompt and generates nothing (what
lm-evaluation-harness's loglikelihood requests ask); without echo it is a 400, as in vLLM.
A stream holds a prompt's deltas back until its prompt logprobs have come (with the first
sample's first token), so each choice's first chunk carries its whole echo.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from litestar import Request, post

from ksana_jax.outputs import CompletionOutput, RequestOutput
from server import schemas as s
from server.admission import admit, renamed, require_api_key, sampling_params, state_of
from server.errors import APIError
from server.logprobs import completion_logprobs, echo_logprobs, joined
from server.streaming import ChoiceProgress, Prompt, Run, collect, event_stream
from server.structured import constraint


def _completion_prompts(prompt: str | list) -> list[Prompt]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, list) for p in prompt):
        return [list(p) for p in prompt]
    raise APIError(
        400,
        "prompt must be a string, a list of strings, a list of token ids or a list of "
        "token-id lists (not a mix)",
        param="prompt",
    )


@post("/v1/completions", status_code=200, guards=[require_api_key])
async def create_completion(request: Request, data: s.CompletionRequest) -> Any:
    state = state_of(request)
    prompts = _completion_prompts(data.prompt)
    admit(state, data, len(prompts))
    score_only = data.max_tokens == 0
    if score_only and not data.echo:
        raise APIError(
            400,
            "max_tokens must be at least 1, got 0 (0 is allowed with echo: the prompt is "
            "scored and nothing is generated)",
            "max_tokens",
        )
    echo_scores = data.echo and data.logprobs is not None
    structured, sent_as = constraint(data.response_format, data.structured_outputs)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    request.state.request_id = request_id
    try:
        params = sampling_params(
            state,
            data,
            1 if score_only else data.max_tokens,
            data.logprobs,
            prompt_logprobs=data.logprobs if echo_scores else None,
            structured_outputs=structured,
        )
        run = await Run.start(state, request_id, prompts, params, score_only=score_only)
    except APIError as e:
        raise renamed(e, sent_as) from None
    tokenizer = state.engine.tokenizer
    n, created = params.n, int(time.time())

    echoes: dict[int, tuple[str, s.CompletionLogprobs | None]] = {}

    def echo(i: int, out: RequestOutput) -> tuple[str, s.CompletionLogprobs | None]:
        """Prompt i's echo: its text and, with logprobs, its tokens' (made once, for all n
        choices; `out` carries the prompt logprobs when they are asked for)."""
        if i not in echoes:
            text = prompts[i]
            if not isinstance(text, str):
                text = tokenizer.decode(out.prompt_token_ids)
            scores = None
            if echo_scores:
                scores = echo_logprobs(tokenizer, out.prompt_token_ids, out.prompt_logprobs)
            echoes[i] = text, scores
        return echoes[i]

    def choice(i: int, out: RequestOutput, c: CompletionOutput, first: bool) -> s.CompletionChoice:
        """`c`'s tokens (a delta or all of them) as a choice; the echo leads its first."""
        text, scores = echo(i, out) if data.echo else ("", None)
        logprobs = None
        if data.logprobs is not None:
            logprobs = completion_logprobs(tokenizer, c, data.logprobs, len(text))
            if first and scores is not None:
                logprobs = joined(scores, logprobs)
        text = text + c.text if first else c.text
        return s.CompletionChoice(i * n + c.index, text, logprobs, c.finish_reason, c.stop_reason)

    if not data.stream:
        finals = await collect(request, run)
        choices = [choice(i, out, c, True) for i, out in enumerate(finals) for c in out.outputs]
        return s.CompletionResponse(request_id, created, state.model_name, choices, run.usage())

    progress = ChoiceProgress()
    held: dict[int, RequestOutput] = {}  # prompt -> its deltas until its prompt logprobs come
    scored: set[int] = set()  # prompts whose prompt logprobs have come

    def chunks(i: int, delta: RequestOutput) -> list[s.CompletionResponse]:
        if echo_scores and i not in scored:
            if i in held:
                held[i].add(delta)
            else:
                held[i] = delta.copy()
            if held[i].prompt_logprobs is None:
                return []
            delta = held.pop(i)
            scored.add(i)
        result = []
        for c in delta.outputs:
            moved = progress.advance((i, c.index), c)
            if moved is None:
                continue
            first, finished = moved
            if (first and data.echo) or c.text or c.token_ids or finished:
                result.append(
                    s.CompletionResponse(
                        request_id, created, state.model_name, [choice(i, delta, c, first)]
                    )
                )
        return result

    def final() -> list[s.CompletionResponse]:
        if data.stream_options is None or not data.stream_options.include_usage:
            return []
        return [s.CompletionResponse(request_id, created, state.model_name, [], run.usage())]

    return event_stream(run, chunks, final)

"""POST /v1/completions: prompt(s) -> text, streamed (SSE) or whole.

    in:  a CompletionRequest: one prompt or several (text, token ids, or lists of either),
         sampling fields, n, echo, logprobs, stream
    out: a CompletionResponse with n choices per prompt (choice index = prompt * n + sample),
         or, streaming, one CompletionResponse chunk per choice per engine delta, the usage
         chunk if asked for, then `[DONE]`

Each prompt is one engine request (streaming.py). Streamed chunks are the engine's deltas as
they come; the whole response adds them up. Both build their choices with `_choice`, so the
chunks of a stream join to the whole response: text, logprobs and text offsets alike.
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
from server.logprobs import completion_logprobs
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
    if data.echo and data.logprobs is not None:
        raise APIError(400, "echo with logprobs is not supported (no prompt logprobs)", "echo")
    structured, sent_as = constraint(data.response_format, data.structured_outputs)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    request.state.request_id = request_id
    try:
        params = sampling_params(state, data, data.max_tokens, data.logprobs, structured)
        run = await Run.start(state, request_id, prompts, params)
    except APIError as e:
        raise renamed(e, sent_as) from None
    tokenizer = state.engine.tokenizer
    n, created = params.n, int(time.time())

    def echo(i: int, out: RequestOutput) -> str:
        if not data.echo:
            return ""
        text = prompts[i]
        return text if isinstance(text, str) else tokenizer.decode(out.prompt_token_ids)

    def choice(i: int, out: RequestOutput, c: CompletionOutput, text: str) -> s.CompletionChoice:
        """`c`'s tokens (a delta or all of them) as choice `text`."""
        logprobs = None
        if data.logprobs is not None:
            logprobs = completion_logprobs(tokenizer, c, data.logprobs, len(echo(i, out)))
        return s.CompletionChoice(i * n + c.index, text, logprobs, c.finish_reason)

    if not data.stream:
        finals = await collect(request, run)
        choices = [
            choice(i, out, c, echo(i, out) + c.text)
            for i, out in enumerate(finals)
            for c in out.outputs
        ]
        return s.CompletionResponse(request_id, created, state.model_name, choices, run.usage())

    progress = ChoiceProgress()

    def chunks(i: int, delta: RequestOutput) -> list[s.CompletionResponse]:
        result = []
        for c in delta.outputs:
            moved = progress.advance((i, c.index), c)
            if moved is None:
                continue
            first, finished = moved
            text = echo(i, delta) + c.text if first else c.text
            if text or c.token_ids or finished:
                result.append(
                    s.CompletionResponse(
                        request_id, created, state.model_name, [choice(i, delta, c, text)]
                    )
                )
        return result

    def final() -> list[s.CompletionResponse]:
        if data.stream_options is None or not data.stream_options.include_usage:
            return []
        return [s.CompletionResponse(request_id, created, state.model_name, [], run.usage())]

    return event_stream(run, chunks, final)

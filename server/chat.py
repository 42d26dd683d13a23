"""POST /v1/chat/completions: messages -> the checkpoint's chat template -> text.

    in:  a ChatCompletionRequest: messages (text content, or text parts joined; an
         assistant's tool_calls, tool results), tools/tool_choice, sampling fields, n,
         logprobs/top_logprobs, max_completion_tokens, stream
    out: a ChatCompletionResponse with n assistant messages (content, reasoning_content,
         tool_calls: server/tools.py), or, streaming, per choice a role chunk, delta chunks
         (the engine's deltas as they come, split into content, reasoning and tool-call
         deltas), a finish chunk, the usage chunk if asked for, then `[DONE]`

The template is applied in a worker thread and its text encoded in a worker process
(tokenize_pool.py), off the event loop. Errors name the fields as the chat client sent them
(`top_logprobs`, `max_completion_tokens`), not as the engine calls them.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from litestar import Request, post

from ksana_jax.outputs import CompletionOutput, RequestOutput
from ksana_jax.tokenizer import TemplateError, Tokenizer
from server import schemas as s
from server.admission import (
    ServerState,
    admit,
    renamed,
    require_api_key,
    sampling_params,
    state_of,
)
from server.errors import APIError
from server.logprobs import chat_logprobs
from server.streaming import ChoiceProgress, Run, collect, event_stream
from server.structured import constraint
from server.tools import Answer, ChoiceStream, template_messages


async def _chat_prompt(state: ServerState, data: s.ChatCompletionRequest) -> list[int]:
    """The chat template (a worker thread) applied and encoded (a worker process)."""
    text = await state.work.run(chat_text, state.engine.tokenizer, data)
    return await state.work.encode(text, add_special_tokens=False)


# What the body's own fields (or the tokenizer) set: chat_template_kwargs may not replace it.
_RESERVED = {
    "messages", "tools", "add_generation_prompt", "continue_final_message", "chat_template",
    "bos_token", "eos_token",
}  # fmt: skip


def chat_text(tokenizer: Tokenizer, data: s.ChatCompletionRequest | s.TokenizeRequest) -> str:
    """The chat template applied to a body's messages and tools (run it off the event loop):
    the checkpoint's or the body's `chat_template`, with `chat_template_kwargs` as more
    template variables and vLLM's `add_generation_prompt` / `continue_final_message`."""
    extra = dict(data.chat_template_kwargs or {})
    taken = sorted(set(extra) & _RESERVED)
    if taken:
        raise APIError(
            400,
            f"chat_template_kwargs may not set {', '.join(taken)} (the body's own fields do)",
            param="chat_template_kwargs",
        )
    if data.tools is not None:
        extra["tools"] = data.tools
    add_generation_prompt = data.add_generation_prompt is not False  # null: the default
    continue_final = bool(data.continue_final_message)
    if continue_final and add_generation_prompt:  # vLLM's rule: send it false
        raise APIError(
            400,
            "continue_final_message and add_generation_prompt cannot both be true",
            param="continue_final_message",
        )
    try:
        return tokenizer.apply_chat_template(
            template_messages(data.messages),
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final,
            chat_template=data.chat_template,
            **extra,
        )
    except (TemplateError, ValueError) as e:
        param = "chat_template" if data.chat_template is not None else "messages"
        raise APIError(400, f"chat template: {e}", param=param) from None


@post("/v1/chat/completions", status_code=200, guards=[require_api_key])
async def create_chat_completion(request: Request, data: s.ChatCompletionRequest) -> Any:
    state = state_of(request)
    admit(state, data, 1)
    if data.top_logprobs is not None and not data.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    n_top = data.top_logprobs or 0
    max_tokens = data.max_completion_tokens or data.max_tokens
    # The engine's names for what a chat client sent under other names.
    sent_as = {"logprobs": "top_logprobs"}
    if data.max_completion_tokens is not None:
        sent_as["max_tokens"] = "max_completion_tokens"
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    request.state.request_id = request_id
    structured, names = constraint(data.response_format, data.structured_outputs)
    answer = Answer.of(data, state.tool_parser, state.reasoning, structured is not None)
    if answer.constraint is not None:
        structured = answer.constraint
        names = {"structured_outputs.json": answer.constraint_field}
    sent_as |= names
    try:
        params = sampling_params(
            state,
            data,
            max_tokens,
            n_top if data.logprobs else None,
            structured_outputs=structured,
        )
        run = await Run.start(state, request_id, [await _chat_prompt(state, data)], params)
    except APIError as e:
        raise renamed(e, sent_as) from None
    tokenizer = state.engine.tokenizer
    created = int(time.time())

    def logprobs(c: CompletionOutput) -> s.ChoiceLogprobs | None:
        return chat_logprobs(tokenizer, c, n_top) if data.logprobs else None

    if not data.stream:
        (out,) = await collect(request, run)
        choices = []
        for c in out.outputs:
            message, finish_reason = answer.message(c.text, c.finish_reason)
            choices.append(
                s.ChatChoice(c.index, message, logprobs(c), finish_reason, c.stop_reason)
            )
        return s.ChatCompletionResponse(request_id, created, state.model_name, choices, run.usage())

    progress = ChoiceProgress()
    streams: dict[int, ChoiceStream] = {}

    def chunk(choice: s.ChatChunkChoice | None, usage: s.Usage | None = None):
        choices = [] if choice is None else [choice]
        return s.ChatCompletionChunk(request_id, created, state.model_name, choices, usage)

    def chunks(_: int, delta: RequestOutput) -> list[s.ChatCompletionChunk]:
        result = []
        for c in delta.outputs:
            moved = progress.advance((0, c.index), c)
            if moved is None:
                continue
            first, finished = moved
            if first:
                streams[c.index] = answer.stream()
                result.append(chunk(s.ChatChunkChoice(c.index, s.Delta("assistant", ""))))
            stream = streams[c.index]
            if c.text or c.token_ids:
                delta = stream.feed(c.text)  # None: held (a tool call may be starting)
                if delta is not None or data.logprobs:  # logprobs come with their tokens
                    delta = delta or s.Delta(content="")
                    result.append(chunk(s.ChatChunkChoice(c.index, delta, logprobs(c))))
            if finished:
                held, reason = stream.finish(c.finish_reason)
                if held is not None:
                    result.append(chunk(s.ChatChunkChoice(c.index, held)))
                last = s.ChatChunkChoice(c.index, s.Delta(), None, reason, c.stop_reason)
                result.append(chunk(last))
        return result

    def final() -> list[s.ChatCompletionChunk]:
        if data.stream_options is None or not data.stream_options.include_usage:
            return []
        return [chunk(None, run.usage())]

    return event_stream(run, chunks, final)

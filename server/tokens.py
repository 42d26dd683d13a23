"""POST /tokenize and POST /detokenize (vLLM's routes and shapes).

    /tokenize    in: {prompt} or {messages} (the chat template applied, with
                     add_generation_prompt), add_special_tokens (default: True for a prompt,
                     False for messages, as vLLM)
                 out: {count, max_model_len, tokens, token_strs: null}
    /detokenize  in: {tokens}    out: {prompt}: the ids decoded

Tokenizing runs off the event loop like a completion's prompt (tokenize_pool.py); the engine
is not involved, so both answer while it warms up. A body naming another model is a 404, ids
outside the vocabulary a 400 naming `tokens`.
"""

from __future__ import annotations

from litestar import Request, post

from server import schemas as s
from server.admission import ServerState, require_api_key, state_of
from server.chat import chat_text
from server.errors import APIError, clip


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(
            404,
            f"the model `{clip(model)}` does not exist; this server serves `{state.model_name}`",
            param="model",
            code="model_not_found",
        )


@post("/tokenize", status_code=200, guards=[require_api_key])
async def tokenize(request: Request, data: s.TokenizeRequest) -> s.TokenizeResponse:
    state = state_of(request)
    _check_model(state, data.model)
    if (data.prompt is None) == (data.messages is None):
        raise APIError(400, "send exactly one of prompt and messages", param="prompt")
    tokenizer = state.engine.tokenizer
    if data.messages is not None:
        text = await state.work.run(chat_text, tokenizer, data)
        special = bool(data.add_special_tokens)
    else:
        text = data.prompt
        special = data.add_special_tokens is not False
    tokens = list(await state.work.encode(text, add_special_tokens=special))
    return s.TokenizeResponse(len(tokens), state.engine.max_model_len, tokens)


@post("/detokenize", status_code=200, guards=[require_api_key])
async def detokenize(request: Request, data: s.DetokenizeRequest) -> s.DetokenizeResponse:
    state = state_of(request)
    _check_model(state, data.model)
    tokenizer = state.engine.tokenizer
    vocab = tokenizer.vocab_size
    bad = [t for t in data.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(
            400, f"tokens must be ids in [0, {vocab}), got {clip(str(bad[:8]))}", param="tokens"
        )
    return s.DetokenizeResponse(await state.work.run(tokenizer.decode, data.tokens))

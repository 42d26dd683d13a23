"""What a request must pass before anything is queued, and the server state it is checked on.

    in:  the connection's headers (API key), the raw body (depth, strict types: limits.py),
         the decoded body (readiness, model name, unsupported fields, stop strings, room for
         its sequences)
    out: SamplingParams for the engine, or an APIError (a 4xx, or a 503 while warming up,
         shutting down or full) in OpenAI's error body

`ServerState` is the one object a handler reaches everything through (the engine, limits,
metrics, the tokenizer workers, the count of sequences in flight); it lives in the app's
state, never in a module global. ValueErrors from SamplingParams or the engine's own checks
become 400s naming the field (`bad_request`), as the client sent it (`renamed`).
"""

from __future__ import annotations

import dataclasses
import hmac
import time
from typing import Any

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler

from ksana_jax.async_engine import AsyncEngine
from ksana_jax.sampling_params import SamplingParams, StructuredOutputsParams
from server import schemas as s
from server.errors import APIError, clip
from server.limits import RequestLimits, check_body, check_stop
from server.metrics import Metrics
from server.reasoning import ThinkParser
from server.tokenize_pool import HostWork


@dataclasses.dataclass
class ServerState:
    engine: AsyncEngine
    model_name: str
    api_keys: tuple[str, ...]  # empty: no key needed
    max_pending_requests: int
    metrics: Metrics
    limits: RequestLimits
    work: HostWork  # tokenizing and checking requests, off the event loop
    sampling: tuple[tuple[str, Any], ...] = ()  # (field, default) for fields left out
    tool_parser: str = "hermes"  # how "auto" tool calls are read (server/tool_parsers.py)
    reasoning: ThinkParser | None = None  # --reasoning-parser (server/reasoning.py)
    prompt_tokens_details: bool = False  # usage reports cached prompt tokens
    draining: bool = False  # shutting down: no new requests
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    pending: int = 0  # engine requests (one per prompt and sample) queued or running


def state_of(request: Request) -> ServerState:
    return request.app.state.server


def require_api_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """A route guard: with API keys set, `Authorization: Bearer KEY` must name one."""
    keys = connection.app.state.server.api_keys
    if not keys:
        return
    auth = connection.headers.get("authorization", "").encode()
    # Constant time, and every key compared: the time taken says nothing about any key.
    matches = [hmac.compare_digest(auth, f"Bearer {key}".encode()) for key in keys]
    if not any(matches):
        raise APIError(401, "missing or invalid API key (send `Authorization: Bearer KEY`)")


_BODY_TYPES = {
    "/v1/completions": s.CompletionRequest,
    "/v1/chat/completions": s.ChatCompletionRequest,
}


async def check_raw_body(request: Request) -> None:
    """Before a POST body is decoded: its depth, then its types, strictly (limits.py)."""
    struct = _BODY_TYPES.get(request.url.path)
    if struct is not None and request.method == "POST":
        state = state_of(request)
        await check_body(request, struct, state.limits, state.work.run)


def admit(state: ServerState, body: s._Sampling, num_prompts: int) -> None:
    """Checks that do not depend on the prompt: readiness, model name, unsupported fields."""
    if state.engine.is_dead:
        raise APIError(503, "the engine stopped; see the server log")
    if state.draining:
        raise APIError(503, "the server is shutting down")
    if not state.engine.ready.is_set():
        raise APIError(503, "warming up (compiling the step shapes)", headers={"Retry-After": "5"})
    if body.model is not None and body.model != state.model_name:
        raise APIError(
            404,
            f"the model `{clip(body.model)}` does not exist; this server serves "
            f"`{state.model_name}`",
            param="model",
            code="model_not_found",
        )
    for name in s.UNSUPPORTED_FIELDS:
        if getattr(body, name) is not None:
            raise APIError(400, f"{name} is not supported by ksana-jax", param=name)
    check_stop([body.stop] if isinstance(body.stop, str) else body.stop or [], state.limits)
    wanted = num_prompts * body.n
    if wanted > state.max_pending_requests:  # could never be admitted: the client's error
        raise APIError(
            400,
            f"this request asks for {wanted} sequences ({num_prompts} prompt(s) x n={body.n}); "
            f"this server runs at most {state.max_pending_requests} at once "
            "(--max-pending-requests)",
            param="n" if body.n > 1 else "prompt",
        )
    if state.pending + wanted > state.max_pending_requests:
        raise APIError(
            503,
            f"too many requests in flight ({state.pending}); try again shortly",
            headers={"Retry-After": "1"},
        )


def sampling_params(
    state: ServerState,
    body: s._Sampling,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """The engine's SamplingParams for a body; a bad value is a 400 naming its field."""
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    # Fields the request left out take the model's defaults (ksana_jax/sampling_defaults.py).
    model = {k: v if getattr(body, k) is None else getattr(body, k) for k, v in state.sampling}
    try:
        return SamplingParams(
            n=body.n,
            **model,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            seed=body.seed,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=stop,
            stop_token_ids=body.stop_token_ids or (),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=body.logit_bias,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            structured_outputs=structured_outputs,
        )
    except ValueError as e:
        raise bad_request(e) from None


_ENGINE_PARAMS = ("max_tokens", "logprobs", "min_tokens", "prompt", "stop", "stop_token_ids")


def bad_request(e: ValueError, default_param: str | None = None) -> APIError:
    """A ValueError from SamplingParams or the engine, whose message starts with the field."""
    message = str(e)
    first = message.split(" ", 1)[0].strip("(,:")
    root = first.split(".", 1)[0]  # structured_outputs.json: the constraint's field
    param = first if root in _ENGINE_PARAMS or root in s._Sampling.__struct_fields__ else None
    return APIError(400, message, param=param or default_param)


def renamed(error: APIError, sent_as: dict[str, str]) -> APIError:
    """`error` naming the field as the client sent it (`sent_as`: engine name -> client's)."""
    name = sent_as.get(error.param or "")
    if name is None:
        return error
    message = error.message
    if message.startswith(error.param):  # engine messages start with the field's name
        message = name + message[len(error.param) :]
    return APIError(error.status, message, name, error.code, error.headers)

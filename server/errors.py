"""OpenAI's error body for every failure: `{"error": {"message", "type", "param", "code"}}`.

Handlers raise `APIError`; Litestar's own errors (a body that does not decode or validate,
an unknown route, a body over the size limit) are mapped to the same body here, so a client
never sees another shape. Anything else is a bug in serving that one request: it is logged
with the request id and answered 500, and the server goes on.
"""

from __future__ import annotations

import logging
import re

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from server.schemas import ErrorInfo, ErrorResponse

log = logging.getLogger("ksana_jax.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    499: "invalid_request_error",  # the client closed the request
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


MAX_MESSAGE_CHARS = 1000


def clip(text: str, limit: int = 100) -> str:
    """`text` cut to `limit` characters (a client's own input echoed in a message)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def error_body(status: int, message: str, param: str | None = None, code=None) -> bytes:
    # Messages may quote the client's input (a model name, an enum value): never all of it.
    message = clip(message, MAX_MESSAGE_CHARS)
    info = ErrorInfo(message, _TYPES.get(status, "server_error"), param, code)
    return msgspec.json.encode(ErrorResponse(info))


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    return Response(
        error_body(status, message, param, code),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def _api_error(_: Request, exc: APIError) -> Response:
    return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)


_FIELD = re.compile(r"field `([A-Za-z_]\w*)`")
_NAME = re.compile(r"[A-Za-z_]\w*")


def _validation_error(_: Request, exc: ValidationException) -> Response:
    """A body msgspec could not decode into the route's Struct: name the field."""
    message, param = exc.detail, None
    items = exc.extra if isinstance(exc.extra, list) else []
    for item in items:
        if isinstance(item, dict) and item.get("message"):
            message = str(item["message"])
            key = str(item.get("key") or "")
            if key == "data":  # the body as a whole
                if message == "'data'":  # how Litestar says there was no body
                    message = "the request body is empty or missing: expected a JSON object"
            elif match := _NAME.match(key):  # "logit_bias[...]", "messages[0]": the field
                param = match.group(0)
                message = f"{key}: {message}"
            break
    if param is None and (match := _FIELD.search(message)):  # unknown or missing field
        param = match.group(1)
    return error_response(400, message, param)


# What Litestar raises (as a 500) when the client leaves while its body is being read.
_CLIENT_GONE = "client disconnected prematurely"


def _http_error(_: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    if exc.detail == _CLIENT_GONE:  # nobody to answer and nothing went wrong here
        log.info("a client left while sending its request")
        return error_response(499, exc.detail)
    if status >= 500:  # Litestar's own 5xx (none expected) is still one request's failure
        log.error("HTTP %s: %s", status, exc.detail)
    return error_response(status, exc.detail or "error", headers=exc.headers)


def _internal_error(request: Request, exc: Exception) -> Response:
    request_id = getattr(request.state, "request_id", None)
    log.exception("request %s failed: %r", request_id, exc, exc_info=exc)
    return error_response(500, f"internal error while serving request {request_id}")


EXCEPTION_HANDLERS = {
    APIError: _api_error,
    ValidationException: _validation_error,
    HTTPException: _http_error,
    Exception: _internal_error,
}

"""What one request may cost, checked before anything expensive reads it.

    RequestLimits       the limits, each a `ksana-jax serve` flag with a default
    json_depth(body)    how deeply a JSON body nests arrays and objects (numpy, no recursion)
    check_body(...)     for a `before_request` hook: depth limit, then a strict decode
    check_stop(...)     the number and total length of stop strings

A body nested ~1,000 levels deep made the JSON decoder raise RecursionError (a 500); the
depth is now measured on the raw bytes first and anything deeper than `max_json_depth` is a
400. Litestar decodes bodies leniently (`"2"` and `1e3` become the int 2 and 1000); the hook
decodes the body strictly first, as OpenAI does, so a wrong type is a 400 naming the field.
Stop strings are matched on the engine thread for every generated token, so their number and
length are bounded: a few requests with 300,000 of them slowed every other user ~4x.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Awaitable, Callable

import msgspec
import numpy as np
from litestar import Request

from server.errors import APIError

_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPEN_BRACE, _CLOSE_BRACE = ord("{"), ord("}")
_PATH = re.compile(r" - at `\$\.?(.*)`$")
_FIELD = re.compile(r"field `([A-Za-z_]\w*)`")


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    max_json_depth: int = 64
    max_stop_strings: int = 16
    max_stop_chars: int = 4096  # all stop strings of a request together

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if getattr(self, field.name) < 1:
                raise ValueError(f"{field.name} must be >= 1, got {getattr(self, field.name)}")


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects in `body` (JSON, assumed well formed
    enough: brackets inside strings do not count). Linear in len(body), all in numpy (which
    lets other threads run meanwhile)."""
    a = np.frombuffer(body, np.uint8)
    folded = a | 0x20  # "[" -> "{", "]" -> "}"
    brackets = np.flatnonzero((folded == _OPEN_BRACE) | (folded == _CLOSE_BRACE))
    if brackets.size == 0:
        return 0
    quotes = np.flatnonzero(a == _QUOTE)
    if quotes.size and (a == _BACKSLASH).any():
        # A quote is escaped when an odd run of backslashes ends right before it.
        slash = (a == _BACKSLASH).astype(np.int32)
        count = np.cumsum(slash)
        run = count - np.maximum.accumulate(np.where(slash == 0, count, 0))
        before = run[np.maximum(quotes - 1, 0)]
        quotes = quotes[(quotes == 0) | (before % 2 == 0)]
    # A bracket is inside a string when an odd number of (unescaped) quotes precede it.
    outside = brackets[np.searchsorted(quotes, brackets) % 2 == 0]
    if outside.size == 0:
        return 0
    steps = np.where(folded[outside] == _OPEN_BRACE, 1, -1).astype(np.int32)
    return int(np.cumsum(steps).max())


async def check_body(
    request: Request,
    struct: type,
    limits: RequestLimits,
    run: Callable[..., Awaitable[int]],
) -> None:
    """Depth limit, then a strict decode of the body into `struct` (the route's type).
    `run(fn, *args)` runs the depth scan off the event loop."""
    body = await request.body()
    depth = await run(json_depth, body)
    if depth > limits.max_json_depth:
        raise APIError(
            400,
            f"the request body nests arrays and objects {depth} levels deep; at most "
            f"{limits.max_json_depth} are allowed",
        )
    try:
        msgspec.json.decode(body, type=struct, strict=True)
    except msgspec.ValidationError as e:
        raise _field_error(str(e)) from None
    except (msgspec.DecodeError, RecursionError):
        return  # not JSON: Litestar's own decoder says so, with its message


def _field_error(message: str) -> APIError:
    """msgspec's "Expected `int`, got `str` - at `$.max_tokens`" -> a 400 naming the field."""
    match = _PATH.search(message)
    if match is None or not match.group(1):  # the body itself: unknown or missing field
        message = message if match is None else message[: match.start()]
        field = _FIELD.search(message)
        return APIError(400, message, param=field.group(1) if field else None)
    path = match.group(1)
    param = re.match(r"[A-Za-z_]\w*", path)
    return APIError(
        400, f"{path}: {message[: match.start()]}", param=param.group(0) if param else None
    )


def check_stop(stop: list[str], limits: RequestLimits) -> None:
    if len(stop) > limits.max_stop_strings:
        raise APIError(
            400,
            f"stop has {len(stop)} strings; at most {limits.max_stop_strings} are allowed "
            "(--max-stop-strings)",
            param="stop",
        )
    total = sum(len(s) for s in stop)
    if total > limits.max_stop_chars:
        raise APIError(
            400,
            f"stop strings hold {total} characters together; at most {limits.max_stop_chars} "
            "are allowed (--max-stop-chars)",
            param="stop",
        )

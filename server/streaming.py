"""Running a response's engine requests, and the SSE event stream that carries them.

    in:  prompts (text or token ids) and SamplingParams, one engine request per prompt
    out: the engine's delta outputs of all of them, merged as they come (`Run.outputs`):
         either as Server-Sent Events (`event_stream`; the handler turns each delta into
         chunks) or added up into whole outputs (`collect`)

The engine emits per request only what is new (token ids, the text its own detokenizer
made, logprobs, each token's offset in the text), so a chunk is a delta as it comes, never
a second detokenisation here. A client that goes away -- mid-stream, before a stream was
first read, or while waiting for a whole response -- has its requests aborted, which frees
their KV pages and their slots in `ServerState.pending`. Tokenizing and the engine's
request checks run off the event loop (tokenize_pool.py).

A score-only run (a completion's `max_tokens: 0` with `echo`) is run as vLLM runs it: one
token is sampled (the prompt's logprobs come with a request's first token) and dropped here,
so every consumer -- chunks, whole responses, usage -- sees choices that generated nothing
and ended at "length".
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import msgspec
from litestar import Request
from litestar.response import Stream

from ksana_jax.async_engine import EngineDeadError, RequestAbortedError, RequestFailedError
from ksana_jax.outputs import CompletionOutput, RequestOutput
from ksana_jax.sampling_params import SamplingParams
from server import schemas as s
from server.admission import ServerState, bad_request
from server.errors import APIError, error_body

Prompt = str | list[int]


@dataclasses.dataclass
class Run:
    """One engine request per prompt, with the counts usage and the metrics need."""

    state: ServerState
    n: int
    score_only: bool = False  # the sampled token is dropped (max_tokens 0, run as 1)
    streams: list[AsyncIterator[RequestOutput]] = dataclasses.field(default_factory=list)
    request_ids: list[str] = dataclasses.field(default_factory=list)
    closed: bool = False
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    first_token: list[float | None] = dataclasses.field(default_factory=list)
    num_prompt_tokens: list[int] = dataclasses.field(default_factory=list)
    num_cached_tokens: list[int] = dataclasses.field(default_factory=list)
    num_output_tokens: list[list[int]] = dataclasses.field(default_factory=list)  # [prompt][n]

    @classmethod
    async def start(
        cls,
        state: ServerState,
        request_id: str,
        prompts: Sequence[Prompt],
        params: SamplingParams,
        score_only: bool = False,
    ) -> Run:
        """Queues one engine request per prompt (all or none: a bad one aborts the others)."""
        run = cls(state, params.n, score_only)
        try:
            for i, prompt in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                run.streams.append(await _add_request(state, rid, prompt, params))
                run.request_ids.append(rid)
                state.pending += params.n
        except ValueError as e:
            run.close()
            raise bad_request(e, default_param="prompt") from None
        except EngineDeadError as e:
            run.close()
            raise APIError(503, str(e)) from None
        except BaseException:
            run.close()
            raise
        run.first_token = [None] * len(prompts)
        run.num_prompt_tokens = [0] * len(prompts)
        run.num_cached_tokens = [0] * len(prompts)
        run.num_output_tokens = [[0] * params.n for _ in prompts]
        return run

    def close(self) -> None:
        """Aborts what is still running (a no-op for finished requests); idempotent."""
        if self.closed:
            return
        self.closed = True
        for rid in self.request_ids:
            self.state.engine.abort(rid)
        self.state.pending -= self.n * len(self.request_ids)

    def usage(self) -> s.Usage:
        """Tokens of the prompts and of everything generated so far."""
        prompt = sum(self.num_prompt_tokens)
        completion = sum(sum(counts) for counts in self.num_output_tokens)
        details = None
        if self.state.prompt_tokens_details:
            details = s.PromptTokensDetails(sum(self.num_cached_tokens))
        return s.Usage(prompt, completion, prompt + completion, details)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, delta output) as the engine produces them, for all prompts."""
        merged: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in stream:
                    await merged.put((i, out))
            except Exception as e:  # delivered to the consumer, which raises it
                await merged.put((i, e))
            finally:
                await merged.put((i, done))

        tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(self.streams)]
        remaining = len(tasks)
        try:
            while remaining:
                i, item = await merged.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    if self.score_only:
                        item = _nothing_generated(item)
                    self._count(i, item)
                    yield i, item
        finally:
            self.close()  # a consumer that stops early aborts what is left
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _count(self, i: int, delta: RequestOutput) -> None:
        self.num_prompt_tokens[i] = len(delta.prompt_token_ids)
        self.num_cached_tokens[i] = delta.num_cached_tokens
        counts = self.num_output_tokens[i]
        for c in delta.outputs:
            counts[c.index] += len(c.token_ids)
        if self.first_token[i] is None and any(c.token_ids for c in delta.outputs):
            self.first_token[i] = time.perf_counter()
        if delta.finished:
            self._record(i, delta)

    def _record(self, i: int, out: RequestOutput) -> None:
        metrics = self.state.metrics
        now = time.perf_counter()
        for choice in out.outputs:
            if choice.finish_reason in ("stop", "length"):
                metrics.request_success.labels(choice.finish_reason).inc()
        first = self.first_token[i]
        if first is None:
            return
        metrics.time_to_first_token.observe(first - self.arrival)
        metrics.e2e_request_latency.observe(now - self.arrival)
        longest = max(self.num_output_tokens[i])
        if longest > 1:
            metrics.time_per_output_token.observe((now - first) / (longest - 1))


def _nothing_generated(delta: RequestOutput) -> RequestOutput:
    """A score-only request's delta without its sampled token; a finished choice ends at
    "length" (it generated as many tokens as it was allowed: none)."""
    outputs = [
        CompletionOutput(
            c.index,
            "",
            [],
            None if c.logprobs is None else [],
            "length" if c.finish_reason not in (None, "abort") else c.finish_reason,
            text_offsets=[],
        )
        for c in delta.outputs
    ]
    return dataclasses.replace(delta, outputs=outputs)


async def _add_request(
    state: ServerState, request_id: str, prompt: Prompt, params: SamplingParams
) -> AsyncIterator[RequestOutput]:
    """Tokenizes (a worker process) and checks (a worker thread) a prompt off the event loop,
    then queues it; returns its stream of delta outputs."""
    engine = state.engine
    if engine.is_dead:
        raise EngineDeadError(f"the engine stopped: {engine.error!r}")
    if state.draining:
        raise APIError(503, "the server is shutting down")
    token_ids = await state.work.encode(prompt) if isinstance(prompt, str) else prompt
    group = await state.work.run(engine.make_group, request_id, token_ids, params)
    return await engine.add_group(group, delta=True)


class ChoiceProgress:
    """Which choices of a streamed response have started and which have finished: the
    engine's output of a request holds every choice, also those with nothing new."""

    def __init__(self) -> None:
        self._started: set[tuple[int, int]] = set()
        self._finished: set[tuple[int, int]] = set()

    def advance(self, key: tuple[int, int], choice: CompletionOutput) -> tuple[bool, bool] | None:
        """(first time this choice is seen, it finished now); None once it has finished."""
        if key in self._finished:
            return None
        first = key not in self._started
        self._started.add(key)
        if choice.finished:
            self._finished.add(key)
        return first, choice.finished


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(request: Request, run: Run) -> list[RequestOutput]:
    """The whole outputs of a non-streaming run, one per prompt (its deltas added up); aborts
    it if the client goes away first."""
    totals: list[RequestOutput | None] = [None] * len(run.streams)

    async def consume() -> None:
        async with contextlib.aclosing(run.outputs()) as outputs:
            async for i, delta in outputs:
                total = totals[i]
                if total is None:
                    totals[i] = delta
                else:
                    total.add(delta)

    consumer = asyncio.create_task(consume())
    watcher = asyncio.create_task(_until_disconnect(request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not consumer.done():
            consumer.cancel()  # the client left: abort
    await asyncio.wait({consumer})
    if consumer.cancelled():
        raise APIError(499, "client disconnected")
    _raise_failure(consumer.exception())
    return [t for t in totals if t is not None]


def _raise_failure(exc: BaseException | None) -> None:
    if exc is None:
        return
    if isinstance(exc, RequestFailedError):
        raise APIError(500, f"the request failed: {exc}")
    if isinstance(exc, EngineDeadError | RequestAbortedError):
        raise APIError(503, str(exc))
    raise exc


def _sse(data: Any) -> bytes:
    return b"data: " + (data if isinstance(data, bytes) else msgspec.json.encode(data)) + b"\n\n"


class _EventStream(Stream):
    """A Stream whose own media type wins: Litestar lets the route's (JSON) override it."""

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> Any:
        return super().to_asgi_response(*args, **(kwargs | {"media_type": self.media_type}))


def event_stream(
    run: Run, chunks: Callable[[int, RequestOutput], list[Any]], final: Callable[[], list[Any]]
) -> Stream:
    """SSE: `chunks(prompt index, delta)` of each delta as it comes, then `final()`, then
    `[DONE]`; a request that fails ends the stream with an error event."""

    async def events() -> AsyncIterator[bytes]:
        try:
            async with contextlib.aclosing(run.outputs()) as outputs:
                async for i, out in outputs:
                    for chunk in chunks(i, out):
                        yield _sse(chunk)
            for chunk in final():
                yield _sse(chunk)
        except (RequestFailedError, EngineDeadError, RequestAbortedError) as e:
            status = 500 if isinstance(e, RequestFailedError) else 503
            yield _sse(error_body(status, f"the request failed: {e}"))
        yield b"data: [DONE]\n\n"

    body = events()
    # A body that is never iterated (the client left before the response started) runs no
    # `finally`: the run is closed -- its requests aborted, its pages freed -- when the
    # generator is dropped instead (close() is idempotent).
    weakref.finalize(body, run.close)
    return _EventStream(
        body,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )

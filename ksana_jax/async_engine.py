"""The asyncio face of the engine, for the server.

One background thread owns the LLMEngine and the device: it applies queued commands (add,
abort), runs `engine.step()` while there is work, and hands each RequestOutput to the
asyncio queue of its request on that request's event loop; the request's iterator yields
those deltas (`delta=True`, what the server streams), or by default adds them up and yields
cumulative outputs. `add_request` validates and tokenizes in the caller (so bad input raises
right there, before anything is queued) and returns an async iterator of outputs; leaving
the iterator early (e.g. a client disconnect) aborts the request, which frees its pages.
With `warm_up=True` the thread compiles every step bucket before taking requests and sets
`ready` when done (the server's health check waits for it).

This is the server's only way to the engine: besides requests it offers the tokenizer, the
context length and the model's generation config, read-only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from ksana_jax.engine import LLMEngine, _Group
from ksana_jax.outputs import RequestOutput
from ksana_jax.sampling_params import SamplingParams
from ksana_jax.step_metrics import StepTimer
from ksana_jax.step_programs import compile_count
from ksana_jax.tokenizer import Tokenizer


class EngineDeadError(RuntimeError):
    """The engine thread stopped (on an unexpected error, or shut down); no request can
    proceed."""


class RequestFailedError(RuntimeError):
    """Processing one request raised; that request ended, the engine goes on."""


class RequestAbortedError(RuntimeError):
    """`abort_all` or `shutdown` ended the request (the server is stopping); its pages are
    freed."""


@dataclasses.dataclass(frozen=True)
class EngineSnapshot:
    """Engine numbers for metrics, read without stopping the engine thread."""

    running: int
    waiting: int
    kv_cache_usage: float
    prompt_tokens: int
    generation_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int
    compilations: int
    # speculative decoding (zeros without it): proposals verified, accepted, and by position
    spec_draft_tokens: int
    spec_accepted_tokens: int
    spec_drafted_per_position: tuple[int, ...]
    spec_accepted_per_position: tuple[int, ...]
    step_timer: StepTimer  # a copy: host and device ms per step, device-idle time


class AsyncEngine:
    def __init__(self, engine: LLMEngine, warm_up: bool = False):
        self.engine = engine
        self.ready = threading.Event()
        self._warm_up = warm_up
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._closed = False  # shut down: no new streams
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="ksana-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer (thread-safe to read: encode, decode, chat template)."""
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        """Prompt plus output tokens, at most, of one request."""
        return self.engine.config.max_model_len

    @property
    def generation_config(self) -> dict[str, Any]:
        """The checkpoint's generation_config.json (the server's sampling defaults)."""
        return self.engine.model.generation_config

    def make_group(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        priority: int = 0,
    ) -> _Group:
        """Validates and tokenizes a request for `add_group`, touching no engine state: safe
        in any thread (the server calls it off the event loop). Bad input: ValueError."""
        return self.engine.make_group(request_id, prompt, params, priority)

    async def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        delta: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Queues a request; returns an async iterator of its outputs (last one finished):
        the engine's deltas with `delta=True`, else cumulative outputs (each a copy)."""
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        return await self.add_group(self.make_group(request_id, prompt, params, priority), delta)

    async def add_group(self, group: _Group, delta: bool = False) -> AsyncIterator[RequestOutput]:
        """Queues a request that `make_group` made; returns an async iterator of its
        outputs (deltas or cumulative, as `add_request`)."""
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        request_id = group.request_id
        outputs: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self._closed:
                raise EngineDeadError("the engine was shut down")
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already running")
            self._streams[request_id] = (asyncio.get_running_loop(), outputs)

        def add() -> None:
            try:
                self.engine.add_group(group)
            except ValueError as e:  # e.g. the id is still held by a request being aborted
                self._deliver(e, request_id)

        self._commands.put(add)
        return self._iterate(request_id, outputs, delta)

    async def _iterate(
        self, request_id: str, outputs: asyncio.Queue, delta: bool
    ) -> AsyncIterator[RequestOutput]:
        finished = False
        total: RequestOutput | None = None
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, ValueError | RequestAbortedError):
                    finished = True  # (an aborted one is aborted in the engine already)
                    raise item
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine stopped: {item!r}") from item
                finished = item.finished
                if item.error is not None:
                    raise RequestFailedError(item.error)
                if delta:
                    yield item
                    continue
                if total is None:
                    total = item
                else:
                    total.add(item)
                yield total.copy()
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Aborts a request from any thread; its pages are freed by the engine thread."""
        with self._lock:
            self._streams.pop(request_id, None)
        self._commands.put(lambda: self.engine.abort_request(request_id))

    def abort_all(self, reason: str) -> int:
        """Ends every request now, from any thread: each stream raises RequestAbortedError
        (`reason`) and the engine thread frees the requests' pages. Returns how many."""
        with self._lock:
            request_ids = list(self._streams)
        for request_id in request_ids:
            self._deliver(RequestAbortedError(reason), request_id)
            self._commands.put(lambda rid=request_id: self.engine.abort_request(rid))
        return len(request_ids)

    @property
    def is_dead(self) -> bool:
        return self.error is not None or not self._thread.is_alive()

    def snapshot(self) -> EngineSnapshot:
        engine = self.engine
        stats = engine.stats
        spec = engine.speculator
        return EngineSnapshot(
            running=len(engine.scheduler.running),
            waiting=len(engine.scheduler.waiting),
            kv_cache_usage=engine.kv_cache_usage,
            prompt_tokens=stats.prompt_tokens,
            generation_tokens=stats.generation_tokens,
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            preemptions=stats.preemptions,
            compilations=compile_count(),
            spec_draft_tokens=spec.num_drafted if spec else 0,
            spec_accepted_tokens=spec.num_accepted if spec else 0,
            spec_drafted_per_position=tuple(spec.drafted_per_position) if spec else (),
            spec_accepted_per_position=tuple(spec.accepted_per_position) if spec else (),
            step_timer=engine.timer.copy(),
        )

    def shutdown(self, timeout: float = 30) -> None:
        """Stops the engine thread after the commands already queued (aborts included);
        requests still running then are aborted (their streams raise RequestAbortedError) and
        new ones refused. Waits up to `timeout` seconds (a warm-up compile is not
        interrupted)."""
        self._stopped.set()
        self._commands.put(lambda: None)
        self._thread.join(timeout=timeout)

    def _deliver(self, output: RequestOutput | BaseException, request_id: str) -> None:
        with self._lock:
            target = self._streams.get(request_id)
            if target is not None and (isinstance(output, BaseException) or output.finished):
                del self._streams[request_id]
        if target is not None:
            loop, outputs = target
            loop.call_soon_threadsafe(outputs.put_nowait, output)

    def _run_commands(self, block: bool) -> None:
        """Runs the queued commands (waiting for a first one when `block`)."""
        try:
            command = self._commands.get(block=block)
            command()
            while True:
                self._commands.get_nowait()()
        except queue.Empty:
            pass

    def _run(self) -> None:
        try:
            if self._warm_up:
                self.engine.warm_up(progress=False)
            self.ready.set()
            while not self._stopped.is_set():
                # Block for a command only when there is nothing to compute.
                self._run_commands(block=not self.engine.has_unfinished_requests())
                for output in self.engine.step():
                    self._deliver(output, output.request_id)
            with self._lock:
                self._closed = True  # add_group refuses from now on
            self.abort_all("the engine was shut down")
            # What was queued before the stop still runs (a server's stop aborts every
            # request, then stops this thread, maybe mid-step), then those aborts.
            self._run_commands(block=False)
        except BaseException as e:  # surface to every waiting client, never hang them
            self.error = e
            self.ready.set()  # waiters see is_dead instead of hanging
            with self._lock:
                pending = list(self._streams)
            for request_id in pending:
                self._deliver(e, request_id)
            raise

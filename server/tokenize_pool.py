"""Tokenisation, chat templates and request checks off the event loop, behind a bounded queue.

    HostWork(tokenizer)         made once per app
      await work.encode(text)   token ids, computed in a worker process
      await work.run(fn, *a)    fn(*a) in a worker thread

The `tokenizers` library holds the GIL while it encodes (a 4 MB prompt: over a second in which
no other Python thread runs), so encoding goes to worker processes, each holding its own copy
of the tokenizer. They are spawned, not forked: the server process runs JAX's threads, which a
fork would copy mid-state. Chat templates (jinja2) and the engine's request checks are plain
Python, which gives up the GIL every few milliseconds, so a thread keeps them off the event
loop well enough. Jobs queued or running in either pool are counted together; past
`max_queued` a request gets 503 with Retry-After instead of waiting behind them.
"""

from __future__ import annotations

import array
import asyncio
import concurrent.futures
import functools
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ksana_jax.tokenizer import Tokenizer
from server.errors import APIError

log = logging.getLogger("ksana_jax.server")
T = TypeVar("T")

_worker_tokenizer: Tokenizer | None = None  # in each worker process
INLINE_CHARS = 16384  # texts up to this long are encoded in a thread, not a process


def _init_worker(tokenizer: Tokenizer, server_pid: int) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer
    threading.Thread(target=_exit_with_server, args=(server_pid,), daemon=True).start()


def _exit_with_server(server_pid: int) -> None:
    """Ends this worker once the server process is gone: a server killed with SIGKILL never
    shuts its pool down, and the worker (re-parented) would otherwise live on, holding a
    tokenizer's memory, until the machine restarts."""
    while os.getppid() == server_pid:
        time.sleep(0.5)
    os._exit(0)


def _encode_in_worker(text: str, add_special_tokens: bool) -> array.array:
    # An array crosses the pipe as one buffer: unpickling a list of a million ints holds the
    # server's GIL for a fifth of a second. The caller iterates it in a worker thread.
    assert _worker_tokenizer is not None
    return array.array("i", _worker_tokenizer.encode(text, add_special_tokens=add_special_tokens))


class HostWork:
    def __init__(
        self,
        tokenizer: Tokenizer,
        num_processes: int = 1,
        num_threads: int = 2,
        max_queued: int = 1024,
    ):
        """`num_processes` 0 encodes in the threads instead (tests, tiny tokenizers)."""
        self._tokenizer = tokenizer
        self._num_processes = num_processes
        self._threads = concurrent.futures.ThreadPoolExecutor(num_threads, "ksana-host")
        self._processes: concurrent.futures.ProcessPoolExecutor | None = None
        self._max_queued = max_queued
        self._queued = 0

    def start(self) -> None:
        """Starts the worker processes now rather than at the first long prompt
        (idempotent); `serve` calls it at startup."""
        if self._num_processes and self._processes is None:
            try:
                self._processes = concurrent.futures.ProcessPoolExecutor(
                    self._num_processes,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_init_worker,
                    initargs=(self._tokenizer, os.getpid()),
                )
                for _ in range(self._num_processes):  # spawns them, in the background
                    self._processes.submit(_encode_in_worker, "", False)
            except Exception as e:  # e.g. a tokenizer that cannot be pickled
                log.warning("tokenizing in threads: no worker process (%r)", e)
                self._num_processes, self._processes = 0, None

    def shutdown(self) -> None:
        """Stops both pools without waiting for their jobs; the worker processes are
        terminated (one may still be starting up, and would hold the server's terminal open a
        while longer).

        It then waits, briefly, for the process pool's manager thread to end. That thread
        closes a pipe that CPython's exit hook for process pools writes to without the pool's
        lock (CPython 3.11): a server that exits while the thread is closing it prints an
        `OSError: Bad file descriptor` traceback on its way out."""
        self._threads.shutdown(wait=False, cancel_futures=True)
        if self._processes is not None:
            workers = list((getattr(self._processes, "_processes", None) or {}).values())
            manager = getattr(self._processes, "_executor_manager_thread", None)
            self._processes.shutdown(wait=False, cancel_futures=True)
            for worker in workers:
                worker.terminate()
            if manager is not None:
                manager.join(timeout=5)  # it ends once it sees the workers gone
            self._processes = None

    async def _submit(self, pool: concurrent.futures.Executor, fn: Callable[..., T], *args) -> T:
        if self._queued >= self._max_queued:
            raise APIError(
                503,
                f"{self._queued} requests are being tokenized; try again shortly",
                headers={"Retry-After": "1"},
            )
        self._queued += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
        finally:
            self._queued -= 1

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._submit(self._threads, fn, *args)

    async def encode(self, text: str, add_special_tokens: bool = True) -> Sequence[int]:
        # A short text encodes in a few milliseconds: a thread spares it the round trip.
        if not self._num_processes or len(text) <= INLINE_CHARS:
            tokenizer = self._tokenizer
            encode = functools.partial(tokenizer.encode, add_special_tokens=add_special_tokens)
            return await self._submit(self._threads, encode, text)
        self.start()
        if self._processes is None:  # it could not start
            return await self.encode(text, add_special_tokens)
        try:
            return await self._submit(self._processes, _encode_in_worker, text, add_special_tokens)
        except concurrent.futures.process.BrokenProcessPool:
            log.error("the tokenizer process died; starting another")
            self._processes = None
            retry = {"Retry-After": "1"}
            raise APIError(503, "the tokenizer process died; try again", headers=retry) from None

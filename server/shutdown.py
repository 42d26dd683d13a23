"""Stopping `ksana-jax serve`, and closing connections that stall before their request.

    first SIGTERM   stop accepting (uvicorn closes its sockets; /health and new requests
                    answer 503), let running requests finish for up to --shutdown-timeout
                    seconds, then abort what is left: each client gets a final error event
                    (a 503 when not streaming) and the requests' KV pages are freed. Exit 0.
    SIGINT (Ctrl-C), or a second signal   abort at once, then the same.
    a third signal  exit without waiting for anything.

uvicorn's own handling drains without a deadline, ignores a second SIGTERM, cancels tasks
mid-stream (the client sees a cut connection, not an error) and re-raises the signal at exit
(status 143); `Server` replaces it. `H11HeaderTimeout` closes a connection whose request
line and headers do not arrive within --header-timeout seconds (uvicorn has no such limit:
a client sending a header byte a minute holds a connection forever).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol


class Server(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        drain: Callable[[], None],
        abort_all: Callable[[], int],
        shutdown_timeout: float,
    ):
        """`drain()`: stop taking requests; `abort_all()`: end every running request and
        say how many (both called from a signal handler or a timer: quick, thread-safe)."""
        super().__init__(config)
        self._drain, self._abort_all = drain, abort_all
        self._shutdown_timeout = shutdown_timeout
        self._num_signals = 0
        self._aborted = threading.Event()
        self.stopping = threading.Event()  # set at the first signal
        self.num_aborted = 0

    def abort_now(self) -> None:
        if not self._aborted.is_set():
            self._aborted.set()
            self.num_aborted = self._abort_all()

    def handle_exit(self, sig: int, frame: Any) -> None:
        self._num_signals += 1
        if self._num_signals == 1:
            self.stopping.set()
            self._drain()
            self.should_exit = True
            if sig == signal.SIGINT:
                self.abort_now()
            else:
                timer = threading.Timer(self._shutdown_timeout, self.abort_now)
                timer.daemon = True
                timer.start()
        elif self._num_signals == 2:
            self.abort_now()
        else:
            self.force_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:  # unlike uvicorn's, re-raises nothing: a requested stop exits 0
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class H11HeaderTimeout(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head stalls."""

    header_timeout: float = 10.0  # set on a subclass by `with_header_timeout`

    def data_received(self, data: bytes) -> None:
        waiting_for_head = self.conn.their_state is h11.IDLE
        if waiting_for_head and getattr(self, "_head_timer", None) is None:
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._cancel_head_timer()

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._cancel_head_timer()  # until the next request's first byte (keep-alive covers it)

    def _cancel_head_timer(self) -> None:
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def with_header_timeout(seconds: float) -> type[H11HeaderTimeout]:
    return type("H11HeaderTimeoutProtocol", (H11HeaderTimeout,), {"header_timeout": seconds})

"""Stopping a real `ksana-jax serve` (server/shutdown.py): SIGTERM drains for at most
--shutdown-timeout seconds and then aborts what is left, a second signal or Ctrl-C aborts at
once, Ctrl-C while loading or compiling exits at once, every streaming client sees its
stream end or an error event, the KV pages are all free at exit, and nothing prints a
traceback. Also: a connection whose request head stalls is closed (--header-timeout)."""

from __future__ import annotations

import json
import os
import pty
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import write_tiny_hf
from tests.servers import free_port, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
# Long enough that no stream finishes between the signals even on a fast, quiet machine.
LONG = {"prompt": "w5 w6", "max_tokens": 4000, "ignore_eos": True, "stream": True}
FLAGS = ["--max-model-len=4096", "--max-num-seqs=32", "--max-num-batched-tokens=64"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-shutdown")
    write_tiny_hf(path, max_position_embeddings=4096)
    return path


class Served:
    """`ksana-jax serve` with its output on a pty (as in a terminal), read into `.log`."""

    def __init__(self, model: Path | str, *args: str, cache: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cache = cache or os.environ.get(
            "KSANA_TEST_JAX_CACHE", str(Path.home() / ".cache/ksana-jax/jax")
        )
        cmd = [sys.executable, "-m", "ksana_jax.cli", "serve", str(model)]
        cmd += ["--port", str(self.port), "--compilation-cache-dir", cache, *args]
        master, slave = pty.openpty()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=slave, stdout=slave, stderr=slave)
        os.close(slave)
        self._chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._read, args=(master,), daemon=True)
        self._reader.start()

    def _read(self, fd: int) -> None:
        while True:
            try:
                data = os.read(fd, 65536)
            except OSError:
                break
            if not data:
                break
            self._chunks.append(data)
        os.close(fd)

    @property
    def log(self) -> str:
        return b"".join(self._chunks).decode(errors="replace")

    def wait_for(self, text: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"{text!r} never printed: {self.log[-3000:]}")
            time.sleep(0.05)

    def wait_healthy(self) -> None:
        wait_healthy(self.url, self.proc, 300, lambda: self.log, interval=0.1)

    def wait_exit(self, timeout: float) -> tuple[int, float]:
        start = time.monotonic()
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"still running {timeout} s later: {self.log[-3000:]}")
        took = time.monotonic() - start
        self._reader.join(timeout=5)
        return rc, took


def stream(url: str, events: list[list[str]], body=LONG) -> None:
    """One streaming completion; appends the list of its SSE data lines to `events`."""
    mine: list[str] = []
    events.append(mine)
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    mine.append(line[6:])
    except httpx.HTTPError as e:
        mine.append(f"CUT {e!r}")


def start_streams(url: str, n: int, body=LONG) -> tuple[list[list[str]], list[threading.Thread]]:
    events: list[list[str]] = []
    threads = [threading.Thread(target=stream, args=(url, events, body)) for _ in range(n)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while sum(1 for e in events if e) < n and time.monotonic() < deadline:
        time.sleep(0.05)  # every stream has its first chunk
    assert sum(1 for e in events if e) == n, events
    return events, threads


def ended(events: list[str]) -> str:
    """How a stream ended: "done" (finished normally), "error" (an error event), or "cut"."""
    if not events or events[-1] != "[DONE]":
        return "cut"
    chunks = [json.loads(e) for e in events[:-1]]
    return "error" if "error" in chunks[-1] else "done"


def assert_clean_exit(served: Served, rc: int) -> None:
    log = served.log
    assert "Traceback" not in log and "Error" not in log.replace("error event", ""), log
    assert rc == 0, log
    assert "KV cache usage 0%" in log, log


def test_sigterm_drains_then_aborts_within_the_timeout(tiny_dir):
    served = Served(tiny_dir, *FLAGS, "--shutdown-timeout", "1", "--log-level", "warning")
    served.wait_healthy()
    events, threads = start_streams(served.url, 20)
    # Running (its first chunk read) before the signal, so that it finishes while draining.
    short, [short_thread] = start_streams(served.url, 1, LONG | {"max_tokens": 8})
    served.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(httpx.TransportError):  # no longer accepting
        httpx.get(f"{served.url}/health", timeout=5)
    rc, _ = served.wait_exit(timeout=1 + 5)
    for thread in [*threads, short_thread]:
        thread.join(timeout=10)
    endings = [ended(e) for e in events]
    assert set(endings) <= {"done", "error"}, events  # never cut without a word
    assert ended(short[0]) == "done"  # finished while draining
    aborted = endings.count("error")
    assert aborted, "every long stream finished within the timeout: make them longer"
    error = json.loads(events[endings.index("error")][-2])["error"]
    assert "shutting down" in error["message"], error
    assert_clean_exit(served, rc)
    assert f"{aborted} request(s) aborted" in served.log


def test_a_second_sigterm_aborts_at_once(tiny_dir):
    served = Served(tiny_dir, *FLAGS, "--shutdown-timeout", "60", "--log-level", "warning")
    served.wait_healthy()
    events, threads = start_streams(served.url, 4)
    served.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    served.proc.send_signal(signal.SIGTERM)
    rc, _ = served.wait_exit(timeout=10)
    for thread in threads:
        thread.join(timeout=10)
    assert [ended(e) for e in events] == ["error"] * 4, events
    assert_clean_exit(served, rc)


def test_ctrl_c_with_a_stream_in_flight(tiny_dir):
    served = Served(tiny_dir, *FLAGS, "--log-level", "warning")
    served.wait_healthy()
    events, threads = start_streams(served.url, 1)
    served.proc.send_signal(signal.SIGINT)
    rc, took = served.wait_exit(timeout=10)
    threads[0].join(timeout=10)
    assert ended(events[0]) == "error", events
    assert_clean_exit(served, rc)
    assert took < 5


def test_ctrl_c_during_warm_up(tiny_dir, tmp_path):
    # A cold compilation cache and many step shapes: a long warm-up.
    buckets = ["--token-buckets", "8,16,24,32,40,48,56,64", "--seq-buckets", "1,2,4,8,16,32"]
    served = Served(tiny_dir, *FLAGS, *buckets, cache=str(tmp_path / "cold-cache"))
    served.wait_for("before /health turns 200")
    time.sleep(2)  # uvicorn is listening, the engine thread compiling
    served.proc.send_signal(signal.SIGINT)
    rc, took = served.wait_exit(timeout=10)
    log = served.log
    assert "Traceback" not in log, log
    assert "ready in" not in log and "curl" not in log, log
    # 0 once uvicorn handles the signal, 130 if it came just before uvicorn started.
    assert rc in (0, 130) and took < 5, (rc, took, log)


def test_ctrl_c_during_load(smollm2_dir):
    served = Served(smollm2_dir, "--log-level", "warning")
    served.wait_for("ksana-jax: loading")
    served.proc.send_signal(signal.SIGINT)
    rc, took = served.wait_exit(timeout=10)
    log = served.log
    assert "Traceback" not in log, log
    assert log.strip().splitlines()[-1].strip() == "ksana-jax serve: interrupted", log
    assert rc == 130 and took < 5, (rc, took)


def test_a_stalled_request_head_is_closed(tiny_dir):
    served = Served(tiny_dir, *FLAGS, "--header-timeout", "1", "--log-level", "warning")
    served.wait_healthy()
    try:
        with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finished
            start = time.monotonic()
            assert sock.recv(1024) == b""  # closed by the server
            assert 0.5 < time.monotonic() - start < 5
        # A prompt one still gets its answer, on the same kind of connection.
        with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(1024).startswith(b"HTTP/1.1 200")
            time.sleep(1.5)  # idle after a response: the keep-alive timeout's business
    finally:
        served.proc.send_signal(signal.SIGTERM)
        rc, _ = served.wait_exit(timeout=30)
    assert rc == 0 and "Traceback" not in served.log

"""Helpers for tests that start `ksana-jax serve` in a subprocess: a free port, and waiting
for the server's /health to turn 200."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(
    url: str, proc: subprocess.Popen, timeout: float, log: Callable[[], str], interval=0.5
) -> None:
    """Polls `url`/health until it answers 200; fails the test, with the end of `log()`, if
    `proc` exits first or `timeout` seconds pass (`log` may stop the process to read it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}: {log()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(interval)
    pytest.fail(f"no healthy server after {timeout} s: {log()[-4000:]}")

"""Helpers for tests that start `ksana-jax serve` in a subprocess (a free port, waiting for
/health, starting and stopping, raw posts, /metrics values), and the configuration of the
tiny OpenAI server that conftest's `openai_server` starts once for the test_server*.py
modules."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
# The shared tiny server (conftest's openai_server): its key, name and engine flags.
API_KEY = "test-key"
MODEL_NAME = "tiny"
ENGINE_FLAGS = {
    "max_model_len": 128,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 64,
    "max_logprobs": 5,
}
MAX_PENDING = 80
OK = {"model": MODEL_NAME, "prompt": "w5 w6", "max_tokens": 4}  # a request it serves
CHAT_OK = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 4}


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


def jax_cache_dir() -> str:
    """The persistent compilation cache of the servers (and processes) tests start."""
    return os.environ.get("KSANA_TEST_JAX_CACHE", str(Path.home() / ".cache/ksana-jax/jax"))


def start_server(
    model: Path | str, *args: str, timeout: float = 600
) -> tuple[subprocess.Popen, str]:
    """Starts `ksana-jax serve` and waits for /health to turn 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "ksana_jax.cli", "serve", str(model), "--port", str(port)]
    cmd += ["--compilation-cache-dir", jax_cache_dir(), "--log-level", "warning", *args]
    # The log goes to a file, so that a test can read it while the server runs.
    log_file = tempfile.NamedTemporaryFile(prefix="ksana-serve-", suffix=".log")  # noqa: SIM115 (stop_server closes it)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)
    proc.log_file = log_file
    url = f"http://127.0.0.1:{port}"

    def log() -> str:
        proc.kill()
        proc.wait()
        return server_log(proc)

    wait_healthy(url, proc, timeout, log, interval=0.2)
    return proc, url


def server_log(proc: subprocess.Popen) -> str:
    """What a server started by `start_server` has printed so far."""
    return Path(proc.log_file.name).read_bytes().decode()


def stop_server(proc: subprocess.Popen) -> str:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log = server_log(proc)
    proc.log_file.close()
    return log


def post(url: str, path: str, body, headers=None, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}"} | (headers or {})
    content = body if isinstance(body, bytes | str) else json.dumps(body)
    headers.setdefault("Content-Type", "application/json")
    return httpx.post(f"{url}{path}", content=content, headers=headers, timeout=60, **kw)


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{url}/metrics").text
    match = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.M)
    assert match, f"{name}{labels} missing from /metrics"
    return float(match.group(1))

"""What a request may cost (server/limits.py) and how it is let in: JSON depth, strict types,
stop-string limits, echoed input cut short, several API keys compared in constant time.
In-process: the app over a tiny engine through Litestar's test client."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import write_tiny_hf

from ksana_jax import cli
from server.limits import RequestLimits, json_depth

MODEL_NAME = "tiny"
KEYS = ("key-one", "key-two")
ENGINE_FLAGS = {"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 64}
OK = {"model": MODEL_NAME, "prompt": "w5 w6", "max_tokens": 1}
CHAT_OK = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 1}
AUTH = {"Authorization": f"Bearer {KEYS[0]}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    from litestar.testing import TestClient

    from ksana_jax import EngineConfig, load
    from ksana_jax.async_engine import AsyncEngine
    from ksana_jax.engine import LLMEngine
    from server import create_app

    path = tmp_path_factory.mktemp("tiny-limits")
    write_tiny_hf(path)
    engine = AsyncEngine(LLMEngine(load(path), EngineConfig(**ENGINE_FLAGS)))
    limits = RequestLimits(max_stop_strings=4, max_stop_chars=64)
    app = create_app(engine, MODEL_NAME, list(KEYS), limits=limits)
    with TestClient(app) as client:
        yield client
    engine.shutdown()


def post(http, path: str, body, headers=None):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.post(path, content=content, headers=AUTH | (headers or {}))


def nested(kind: str, depth: int) -> str:
    if kind == "array":
        return "[" * depth + "]" * depth
    return '{"a":' * depth + "1" + "}" * depth


# ---------------------------------------------------------------------------- depth


@pytest.mark.parametrize(
    "body, depth",
    [
        (b'{"a": 1}', 1),
        (b"[]", 1),
        (b'"[[[["', 0),
        (b'{"s": "]]]{{{[[[", "t": [[1]]}', 3),
        (b'{"s": "a\\"[[[[", "t": [1]}', 2),  # an escaped quote does not end the string
        (b'{"s": "a\\\\", "t": [[[1]]]}', 4),  # an escaped backslash does not escape the quote
        (b'{"s": "\\\\\\"[[[[[", "t": 1}', 1),
        (nested("array", 1000).encode(), 1000),
        (nested("object", 500).encode(), 500),
    ],
)
def test_json_depth(body, depth):
    assert json_depth(body) == depth
    if depth < 100:
        json.loads(body)  # valid JSON


FIELDS = sorted(
    {
        *json.loads(json.dumps(OK)),
        *json.loads(json.dumps(CHAT_OK)),
        "stop",
        "stop_token_ids",
        "logit_bias",
        "tools",
        "response_format",
        "stream_options",
        "messages",
    }
)


@pytest.mark.parametrize("kind", ["array", "object"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_depth_bomb_in_any_field_is_400(http, path, kind):
    base = OK if path == "/v1/completions" else CHAT_OK
    for field in [*FIELDS, "frobnicate"]:
        for depth in (65, 1000, 100_000):
            body = json.dumps(base)[:-1] + f', "{field}": {nested(kind, depth)}}}'
            response = post(http, path, body.encode())
            assert response.status_code == 400, (field, depth, response.text[:300])
            assert "64" in response.json()["error"]["message"]
    # A whole body that is one deep array, and nesting inside a message.
    assert post(http, path, nested(kind, 5000).encode()).status_code == 400
    deep_message = CHAT_OK | {
        "messages": [{"role": "user", "content": json.loads(nested(kind, 70))}]
    }
    assert post(http, "/v1/chat/completions", deep_message).status_code == 400


def test_nesting_within_the_limit_is_judged_on_its_content(http):
    response = post(
        http, "/v1/completions", OK | {"response_format": json.loads(nested("object", 60))}
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "response_format.type"
    assert "response_format.type must be" in response.json()["error"]["message"]


# ---------------------------------------------------------------------------- strict types


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", "2"),
        ("max_tokens", 1e3),
        ("max_tokens", 2.0),
        ("n", "1"),
        ("seed", 1.5),
        ("temperature", "0.5"),
        ("stream", "true"),
        ("stream", 1),
        ("top_k", True),
        ("stop_token_ids", ["2"]),
    ],
)
def test_wrong_types_are_400_not_coerced(http, field, value):
    body = json.dumps(OK | {field: value}).replace("1000.0", "1e3").encode()
    response = post(http, "/v1/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"], error


def test_chat_wrong_type_names_the_nested_field(http):
    body = CHAT_OK | {"messages": [{"role": "user", "content": 5}]}
    error = post(http, "/v1/chat/completions", body).json()["error"]
    assert error["param"] == "messages" and "messages[0].content" in error["message"], error
    body = CHAT_OK | {"max_completion_tokens": "3"}
    error = post(http, "/v1/chat/completions", body).json()["error"]
    assert error["param"] == "max_completion_tokens", error


def test_right_types_still_served(http):
    # An int where a float is wanted is a number, as in OpenAI's API.
    response = post(http, "/v1/completions", OK | {"temperature": 0, "top_p": 1})
    assert response.status_code == 200, response.text
    response = post(http, "/v1/chat/completions", CHAT_OK | {"temperature": 0})
    assert response.status_code == 200, response.text


# ---------------------------------------------------------------------------- echoed input


def test_a_long_model_name_is_cut_in_the_error(http):
    name = "m" * 1_000_000
    response = post(http, "/v1/completions", OK | {"model": name})
    assert response.status_code == 404
    message = response.json()["error"]["message"]
    assert len(response.content) < 1000 and "1000000 characters" in message


def test_a_long_enum_value_is_cut_in_the_error(http):
    body = CHAT_OK | {"messages": [{"role": "r" * 1_000_000, "content": "w5"}]}
    response = post(http, "/v1/chat/completions", body)
    assert response.status_code == 400
    assert len(response.content) < 2000


# ---------------------------------------------------------------------------- stop strings


@pytest.mark.parametrize(
    "stop, ok",
    [
        (["a", "b", "c", "d"], True),
        (["a", "b", "c", "d", "e"], False),
        ("x" * 64, True),
        ("x" * 65, False),
        (["x" * 32, "y" * 33], False),
    ],
)
def test_stop_string_limits(http, stop, ok):
    response = post(http, "/v1/completions", OK | {"stop": stop})
    if ok:
        assert response.status_code == 200, response.text
        return
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "stop" and "--max-stop-" in error["message"]
    chat = post(http, "/v1/chat/completions", CHAT_OK | {"stop": stop})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "stop"


# ---------------------------------------------------------------------------- API keys


def test_any_of_several_keys_is_accepted(http):
    for key in KEYS:
        headers = {"Authorization": f"Bearer {key}"}
        assert http.get("/v1/models", headers=headers).status_code == 200
    for auth in ("", "Bearer", "Bearer key-three", f"Bearer {KEYS[0]}x", KEYS[0]):
        response = http.get("/v1/models", headers={"Authorization": auth})
        assert response.status_code == 401, auth


def test_api_key_file(tmp_path, capsys):
    from server.serve import read_api_keys

    keys = tmp_path / "keys"
    keys.write_text("# team A\nalpha\n\n  beta  \n")
    assert read_api_keys(str(keys)) == ["alpha", "beta"]
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    for path, expected in ((empty, "holds no key"), (tmp_path / "missing", "cannot read")):
        assert cli.main(["serve", "demo", "--api-key-file", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expected in err and "Traceback" not in err


def test_limits_must_be_positive(capsys):
    assert cli.main(["serve", "demo", "--max-stop-strings", "0"]) == 2
    assert "max_stop_strings must be >= 1" in capsys.readouterr().err


# ---------------------------------------------------------------------------- host work


class _Words:
    """A stand-in tokenizer: one id per word. Holds a lock, so it cannot be pickled."""

    def __init__(self):
        import threading

        self.lock = threading.Lock()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(w) for w in text.split()]


def test_host_work_encodes_long_texts_in_a_process(tmp_path):
    import asyncio

    from ksana_jax.tokenizer import Tokenizer
    from server.tokenize_pool import INLINE_CHARS, HostWork

    write_tiny_hf(tmp_path)
    tokenizer = Tokenizer.from_dir(tmp_path)
    work = HostWork(tokenizer, num_processes=1)
    text = "w5 w6 w7 " * (INLINE_CHARS // 4)

    async def main():
        return await work.encode(text), await work.encode("w5 w6")

    try:
        long, short = asyncio.run(main())
        manager = work._processes._executor_manager_thread
    finally:
        work.shutdown()
    assert list(long) == tokenizer.encode(text) and list(short) == [5, 6]
    # Shut down means the pool's manager thread has ended: a server exiting while it closes
    # its pipe got a traceback from CPython's exit hook (a CI run failed on it).
    assert not manager.is_alive()


def test_host_work_queue_is_bounded_and_falls_back_to_threads(caplog):
    import asyncio
    import threading

    from server.errors import APIError
    from server.tokenize_pool import INLINE_CHARS, HostWork

    work = HostWork(_Words(), num_processes=1, max_queued=1)
    release = threading.Event()

    async def main():
        blocked = asyncio.ensure_future(work.run(release.wait))
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as info:
            await work.run(len, "x")
        assert info.value.status == 503 and info.value.headers["Retry-After"]
        release.set()
        await blocked
        # The tokenizer cannot go to a process: a warning, and threads do the work.
        return await work.encode("a bb ccc " * INLINE_CHARS)

    try:
        ids = asyncio.run(main())
    finally:
        work.shutdown()
    assert ids[:3] == [1, 2, 3]
    assert "tokenizing in threads" in caplog.text


def test_tokenizer_worker_exits_when_the_server_is_killed(tmp_path):
    """A server killed with SIGKILL never shuts its pool down: its worker must notice and go."""
    import os
    import signal
    import subprocess
    import sys
    import time

    write_tiny_hf(tmp_path)
    script = f"""
import asyncio, sys, time
from ksana_jax.tokenizer import Tokenizer
from server.tokenize_pool import INLINE_CHARS, HostWork
work = HostWork(Tokenizer.from_dir({str(tmp_path)!r}), num_processes=1)
asyncio.run(work.encode("w5 " * INLINE_CHARS))
print(*[p.pid for p in work._processes._processes.values()], flush=True)
time.sleep(600)
"""
    repo = Path(__file__).resolve().parent.parent
    server = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=repo
    )

    def alive(pid: int) -> bool:  # a zombie (exited, not yet reaped by init) is gone too
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
        except (FileNotFoundError, ProcessLookupError):
            return False

    try:
        worker = int(server.stdout.readline())
        assert alive(worker)
    finally:
        server.send_signal(signal.SIGKILL)
        server.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not alive(worker):
            return
        time.sleep(0.2)
    os.kill(worker, signal.SIGKILL)
    pytest.fail(f"the tokenizer worker {worker} outlived its server by 10 s")

"""The HTTP server given bad input and meeting faults: every malformed or out-of-range field a
400 naming it, never a 5xx (schemathesis fuzzes the OpenAPI schema), on the shared tiny
`ksana-jax serve` process (conftest's `openai_server`); and, on the app over an engine in
this process (Litestar's test client, for fault injection), warm-up and a full server
answering 503, a failing request failing alone, an unread stream freeing its requests.
"""

from __future__ import annotations

import collections
import time

import httpx
import pytest

from tests.servers import API_KEY, CHAT_OK, ENGINE_FLAGS, MAX_PENDING, MODEL_NAME, OK, post

# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", OK | {"temperature": -0.5}, "temperature"),
        ("/v1/completions", OK | {"temperature": "hot"}, "temperature"),
        ("/v1/completions", OK | {"top_p": 0}, "top_p"),
        ("/v1/completions", OK | {"top_p": 1.5}, "top_p"),
        ("/v1/completions", OK | {"max_tokens": 0}, "max_tokens"),
        ("/v1/completions", OK | {"n": 0}, "n"),
        ("/v1/completions", OK | {"logprobs": 6}, "logprobs"),
        ("/v1/completions", OK | {"min_tokens": 5}, "min_tokens"),
        ("/v1/completions", OK | {"logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/completions", OK | {"logit_bias": {"999999": 1}}, "logit_bias"),
        ("/v1/chat/completions", CHAT_OK | {"logit_bias": {"-1": 1}}, "logit_bias"),
        ("/v1/completions", OK | {"best_of": 2}, "best_of"),
        ("/v1/completions", OK | {"stop_token_ids": [2**40]}, "stop_token_ids"),
        ("/v1/completions", OK | {"frobnicate": 1}, "frobnicate"),
        ("/v1/completions", {"model": MODEL_NAME}, "prompt"),
        ("/v1/completions", OK | {"prompt": [5, "w5"]}, "prompt"),
        ("/v1/completions", OK | {"prompt": [[5, 6], [99999]]}, "prompt"),
        ("/v1/completions", OK | {"prompt": []}, "prompt"),
        ("/v1/chat/completions", CHAT_OK | {"tools": [{"type": "function"}]}, "tools[0].function"),
        ("/v1/completions", OK | {"tools": []}, "tools"),  # chat only
        ("/v1/chat/completions", CHAT_OK | {"messages": []}, "messages"),
        ("/v1/chat/completions", CHAT_OK | {"messages": [{"role": "x", "content": "a"}]}, None),
        ("/v1/chat/completions", CHAT_OK | {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", CHAT_OK | {"logprobs": True, "top_logprobs": 9}, "top_logprobs"),
        ("/v1/chat/completions", CHAT_OK | {"max_completion_tokens": 500}, "max_completion_tokens"),
        ("/v1/chat/completions", CHAT_OK | {"max_tokens": 500}, "max_tokens"),
        ("/v1/completions", OK | {"logit_bias": {"5": "x"}}, "logit_bias"),
        ("/v1/completions", OK | {"stop": ["a", 5]}, "stop"),
        ("/v1/completions", b"", None),
    ],
)
def test_bad_request_is_400_naming_the_field(openai_server, path, body, param):
    response = post(openai_server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param, error
        assert param in error["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_logit_bias_forces_and_bans_tokens(openai_server, path):
    """OpenAI's logit_bias on both routes: +100 makes a token the greedy choice, -100 bans
    the token greedy decoding picked without it."""
    base = (OK if path == "/v1/completions" else CHAT_OK) | {"temperature": 0, "ignore_eos": True}

    def words(bias):
        response = post(openai_server, path, base | {"logit_bias": bias})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return (choice.get("text") or choice["message"]["content"]).split()

    plain = words({})
    assert words({"9": 100}) == ["w9"] * 4 != plain
    banned = int(plain[0].removeprefix("w"))
    assert words({str(banned): -100})[0] != plain[0]


def test_null_means_the_default(openai_server):
    """OpenAI's nullable fields sent as null (as LiteLLM and LangChain do) act as absent."""
    nullable = ["temperature", "top_p", "n", "stream", "presence_penalty", "frequency_penalty"]
    nullable += ["top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "echo"]
    body = OK | {"seed": 7, "max_tokens": 6, "stream_options": {"include_usage": None}}
    want = post(openai_server, "/v1/completions", body)
    got = post(openai_server, "/v1/completions", body | dict.fromkeys(nullable))
    assert want.status_code == got.status_code == 200, got.text
    assert got.json()["choices"] == want.json()["choices"]
    chat = CHAT_OK | {"seed": 7}
    want = post(openai_server, "/v1/chat/completions", chat)
    nulls = dict.fromkeys(["logprobs", "add_generation_prompt", "temperature", "n"])
    got = post(openai_server, "/v1/chat/completions", chat | nulls)
    assert want.status_code == got.status_code == 200, got.text
    assert got.json()["choices"] == want.json()["choices"]


def test_chat_takes_vllms_template_fields(openai_server):
    """continue_final_message (with add_generation_prompt false) prompts with the template
    /tokenize renders for the same fields; both true is a 400 naming the field."""
    messages = [{"role": "user", "content": "w5"}, {"role": "assistant", "content": "w6 w7"}]
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    body = CHAT_OK | {"messages": messages, "max_tokens": 1} | fields
    got = post(openai_server, "/v1/chat/completions", body)
    assert got.status_code == 200, got.text
    tokens = post(openai_server, "/tokenize", {"messages": messages} | fields)
    assert got.json()["usage"]["prompt_tokens"] == tokens.json()["count"]
    both = post(openai_server, "/v1/chat/completions", body | {"add_generation_prompt": True})
    assert both.status_code == 400, both.text
    assert both.json()["error"]["param"] == "continue_final_message"


def test_other_errors(openai_server):
    too_long = post(openai_server, "/v1/completions", OK | {"max_tokens": 127})
    assert too_long.status_code == 400
    assert "127" in too_long.json()["error"]["message"]
    assert "128" in too_long.json()["error"]["message"]  # max_model_len

    malformed = post(openai_server, "/v1/completions", b'{"prompt": "w5",')
    assert malformed.status_code == 400 and malformed.json()["error"]["message"]
    empty = post(openai_server, "/v1/completions", b"")
    assert empty.status_code == 400 and "empty" in empty.json()["error"]["message"]

    unknown = post(openai_server, "/v1/completions", OK | {"model": "gpt-4"})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"

    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}):
        denied = post(openai_server, "/v1/completions", OK, headers=headers)
        assert (
            denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
        )
    assert httpx.get(f"{openai_server}/v1/models").status_code == 401

    # More sequences than the server ever runs at once: the request's own fault (400).
    for too_many in ({"prompt": ["w5"] * (MAX_PENDING + 1)}, {"n": MAX_PENDING + 1}):
        refused = post(openai_server, "/v1/completions", OK | too_many)
        assert refused.status_code == 400, refused.text
        assert str(MAX_PENDING) in refused.json()["error"]["message"]
        assert refused.json()["error"]["param"] == ("n" if "n" in too_many else "prompt")

    huge = post(openai_server, "/v1/completions", OK | {"prompt": "w5 " * 2_000_000})
    assert huge.status_code == 413 and huge.json()["error"]["message"]

    # top_k beyond the vocabulary (and beyond int32) means every token.
    assert post(openai_server, "/v1/completions", OK | {"top_k": 2272561036178}).status_code == 200

    # ... and the server still serves.
    assert post(openai_server, "/v1/completions", OK).status_code == 200


def test_fuzzed_requests_never_5xx(openai_server):
    """schemathesis generates bodies from the OpenAPI schema, valid ones and invalid ones:
    none may get a 5xx, and some of each kind are served and rejected."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    raw = httpx.get(f"{openai_server}/schema/openapi.json").json()
    for component in raw["components"]["schemas"].values():
        if component.get("type") == "object":  # the server rejects unknown fields
            component["additionalProperties"] = False
    schema = schemathesis.openapi.from_dict(raw)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    failures, statuses = [], collections.Counter()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):

            @settings(
                max_examples=25,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=schema[path]["POST"].as_strategy(generation_mode=mode))
            def fuzz(case):
                response = case.call(base_url=openai_server, headers=auth, timeout=120)
                statuses[response.status_code] += 1
                if response.status_code >= 500:
                    failures.append((case.body, response.status_code, response.text))

            fuzz()
    assert not failures, failures[:3]
    assert statuses[200] and statuses[400], statuses
    assert httpx.get(f"{openai_server}/health").status_code == 200


# ---------------------------------------------------------------------------- in-process


@pytest.fixture()
def inprocess(openai_server_dir):
    """The app over an engine in this process (for fault injection), via Litestar's client."""
    from litestar.testing import TestClient

    from ksana_jax import EngineConfig, load
    from ksana_jax.async_engine import AsyncEngine
    from ksana_jax.engine import LLMEngine
    from server import create_app

    engine = AsyncEngine(LLMEngine(load(openai_server_dir), EngineConfig(**ENGINE_FLAGS)))
    with TestClient(create_app(engine, MODEL_NAME)) as test_client:
        yield engine, test_client
    engine.shutdown()


def test_health_and_requests_wait_for_warm_up(inprocess):
    engine, http = inprocess
    assert engine.ready.wait(60)
    engine.ready.clear()  # as while the engine thread compiles
    assert http.get("/health").status_code == 503
    busy = http.post("/v1/completions", json=OK)
    assert busy.status_code == 503 and busy.headers["retry-after"]
    assert "warming up" in busy.json()["error"]["message"]
    engine.ready.set()
    assert http.get("/health").status_code == 200
    assert http.post("/v1/completions", json=OK).status_code == 200


def test_a_full_server_answers_503_with_retry_after(inprocess):
    """A request that fits, arriving while the pending sequences are at the limit, is told
    to retry; once they drain it is served."""
    engine, http = inprocess
    assert engine.ready.wait(60)
    state = http.app.state.server
    state.pending = state.max_pending_requests  # as with that many sequences in flight
    try:
        busy = http.post("/v1/completions", json=OK)
        assert busy.status_code == 503 and busy.headers["retry-after"]
        assert "too many requests in flight" in busy.json()["error"]["message"]
    finally:
        state.pending = 0
    assert http.post("/v1/completions", json=OK).status_code == 200


def test_a_failing_request_fails_alone(inprocess, monkeypatch, caplog):
    from ksana_jax.tokenizer import IncrementalDetokenizer

    engine, http = inprocess
    original = IncrementalDetokenizer.add

    def add(self, token_id):  # a bug that only requests starting with w150 meet
        if self._ids[0] == 150:
            raise RuntimeError("injected failure")
        return original(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "add", add)
    failed = http.post("/v1/completions", json=OK | {"prompt": "w150 w3"})
    assert failed.status_code == 500
    assert "injected failure" in failed.json()["error"]["message"]
    assert "injected failure" in caplog.text  # logged, with the request id
    stream = http.post("/v1/completions", json=OK | {"prompt": "w150 w4", "stream": True})
    assert stream.status_code == 200 and '"error"' in stream.text
    assert stream.text.rstrip().endswith("data: [DONE]")
    fine = http.post("/v1/completions", json=OK)
    assert fine.status_code == 200 and fine.json()["choices"][0]["text"]
    assert engine.error is None and http.get("/health").status_code == 200
    assert engine.engine.pages.num_free == engine.engine.pages.num_usable


def test_a_stream_never_started_still_frees_its_requests(inprocess):
    """A client that leaves before the SSE body is first iterated: the body's `finally`
    never runs, so dropping the body must abort the requests and release the pending slots."""
    import gc

    from ksana_jax import SamplingParams
    from server.streaming import Run as _Run
    from server.streaming import event_stream as _event_stream

    engine, http = inprocess
    assert engine.ready.wait(60)
    state = http.app.state.server
    params = SamplingParams(max_tokens=100, ignore_eos=True)

    async def start_and_drop():
        run = await _Run.start(state, "never-read", ["w5 w6", "w7"], params)
        assert state.pending == 2
        _event_stream(run, lambda i, out: [], list)  # built, then dropped unread
        del run
        gc.collect()

    http.blocking_portal.call(start_and_drop)  # on the app's event loop, as a handler runs
    deadline = time.monotonic() + 60
    while engine.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state.pending == 0
    assert not engine.engine.has_unfinished_requests()
    assert engine.engine.pages.num_free == engine.engine.pages.num_usable

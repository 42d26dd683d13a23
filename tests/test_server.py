"""The HTTP server as clients see it: a real `ksana-jax serve` process on 127.0.0.1, driven by
the official `openai` client, raw httpx for bad input and disconnects, and schemathesis.

The model is a tiny random-weight Llama (word-level tokenizer, so texts are `w12 w40 ...`);
expected texts come from `LLM.generate` on the same checkpoint and engine configuration.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest

from ksana_jax import LLM, SamplingParams
from tests.conftest import write_tiny_hf
from tests.servers import free_port, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
API_KEY = "test-key"
MODEL_NAME = "tiny"
ENGINE_FLAGS = {
    "max_model_len": 128,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 64,
    "max_logprobs": 5,
}
MAX_PENDING = 80
PROMPTS = ["w5 w6 w7", "w100 w3", "w42 w43 w44 w45 w46 w47 w48 w49 w50", "w9"]


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


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-server")
    write_tiny_hf(path)
    return path


@pytest.fixture(scope="module")
def server_process(tiny_dir):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_FLAGS.items()]
    proc, url = start_server(
        tiny_dir,
        *flags,
        "--api-key",
        API_KEY,
        "--served-model-name",
        MODEL_NAME,
        "--max-pending-requests",
        str(MAX_PENDING),
    )
    yield proc, url
    log = stop_server(proc)
    assert "Traceback" not in log, log


@pytest.fixture(scope="module")
def server(server_process):
    return server_process[1]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(tiny_dir, **ENGINE_FLAGS)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


def greedy(llm, prompts, max_tokens=12, **kw):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


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


# ---------------------------------------------------------------------------- the happy path


def test_completions_equal_llm_generate(client, llm):
    want = greedy(llm, PROMPTS)
    got = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, temperature=0, max_tokens=12)
    assert [c.text for c in got.choices] == [w.text for w in want]
    assert [c.index for c in got.choices] == list(range(len(PROMPTS)))
    assert all(c.finish_reason == w.finish_reason for c, w in zip(got.choices, want, strict=True))
    prompt_tokens = sum(len(llm.tokenizer.encode(p)) for p in PROMPTS)
    assert got.usage.prompt_tokens == prompt_tokens
    assert got.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    # Token-id prompts and a single string give the same texts.
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, temperature=0, max_tokens=12)
    assert [c.text for c in by_ids.choices] == [w.text for w in want]
    one = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], temperature=0, max_tokens=12
    )
    assert one.choices[0].text == want[1].text


def test_streaming_completion_concatenates_to_the_same_text(client, llm):
    (want,) = greedy(llm, [PROMPTS[2]], max_tokens=20)
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[2],
        temperature=0,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert len([c for c in chunks if c.choices]) > 2  # streamed, not one blob


def test_echo_n_seed_and_logprobs(client, llm):
    prompt = PROMPTS[0]
    echo = client.completions.create(
        model=MODEL_NAME, prompt=prompt, temperature=0, max_tokens=4, echo=True
    )
    (want,) = greedy(llm, [prompt], max_tokens=4)
    assert echo.choices[0].text == prompt + want.text

    sampled = dict(model=MODEL_NAME, prompt=prompt, temperature=1.0, max_tokens=8, n=3, seed=7)
    first = client.completions.create(**sampled)
    again = client.completions.create(**sampled)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1  # the n samples differ
    params = SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=7)
    (offline,) = llm.generate([prompt], params, use_tqdm=False)
    assert [c.text for c in first.choices] == [o.text for o in offline.outputs]

    got = client.completions.create(
        model=MODEL_NAME, prompt=prompt, temperature=0, max_tokens=6, logprobs=3
    )
    (want,) = greedy(llm, [prompt], max_tokens=6, logprobs=3)
    lp = got.choices[0].logprobs
    assert lp.tokens == [llm.tokenizer.decode([t]) for t in want.token_ids]
    for i, token_id in enumerate(want.token_ids):
        assert lp.token_logprobs[i] == pytest.approx(want.logprobs[i][token_id], abs=1e-5)
        assert len(lp.top_logprobs[i]) == 3
        # Greedy: the sampled token is the most likely one.
        assert max(lp.top_logprobs[i].values()) == pytest.approx(lp.token_logprobs[i], abs=1e-6)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_streamed_logprobs_equal_whole_ones(client):
    """Streamed chunks' logprobs, joined, equal the whole response's, text offsets included,
    also while a stop string holds text back; each token is at its offset in the text."""
    for extra in ({}, {"stop": ["zzz"]}, {"n": 2, "temperature": 1.0, "seed": 3}):
        kw = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=8, logprobs=2)
        kw |= {"temperature": 0} | extra
        whole = client.completions.create(**kw)
        streamed = collections.defaultdict(lambda: ([], [], []))
        for chunk in client.completions.create(**kw, stream=True):
            for c in chunk.choices:
                if c.logprobs is not None:
                    tokens, offsets, logprobs = streamed[c.index]
                    tokens += c.logprobs.tokens
                    offsets += c.logprobs.text_offset
                    logprobs += c.logprobs.token_logprobs
        for c in whole.choices:
            lp = c.logprobs
            assert streamed[c.index] == (lp.tokens, lp.text_offset, lp.token_logprobs), extra
            for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
                if token not in ("<s>", "</s>", "<unk>"):  # special tokens: not in the text
                    assert c.text[offset:].lstrip().startswith(token), (c.text, offset)


def test_stop_strings(client, llm):
    (full,) = greedy(llm, [PROMPTS[0]], max_tokens=12)
    words = full.text.split()
    stop = words[3]
    cut = full.text[: full.text.index(stop)]
    got = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], temperature=0, max_tokens=12, stop=[stop]
    )
    assert got.choices[0].text == cut
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].model_extra["stop_reason"] == stop  # vLLM's field
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPTS[0], temperature=0, max_tokens=12, stop=stop,
            stream=True,
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == cut
    assert [c.choices[0].model_extra["stop_reason"] for c in chunks if c.choices][-1] == stop
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "w1"}], temperature=0,
        max_completion_tokens=12,
    )  # fmt: skip
    assert chat.choices[0].finish_reason == "length"
    assert chat.choices[0].model_extra["stop_reason"] is None


def test_chat_streaming_and_not(client, llm):
    messages = [
        {"role": "system", "content": "w7 w8"},
        {"role": "user", "content": [{"type": "text", "text": "w20 w21"}]},
    ]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=2)
    plain = [{"role": "system", "content": "w7 w8"}, {"role": "user", "content": "w20 w21"}]
    (want,) = [o.outputs[0] for o in llm.chat(plain, params, use_tqdm=False)]
    got = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        temperature=0,
        max_completion_tokens=10,
        logprobs=True,
        top_logprobs=2,
    )
    choice = got.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.finish_reason == want.finish_reason
    content = choice.logprobs.content
    assert [c.token for c in content] == [llm.tokenizer.decode([t]) for t in want.token_ids]
    assert all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].logprob == pytest.approx(want.logprobs[0][want.token_ids[0]], abs=1e-5)

    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        temperature=0,
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == want.finish_reason and set(reasons[:-1]) == {None}
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_streamed_chat_equals_whole_with_n_and_logprobs(client):
    """Per choice: a role chunk first, then content and logprobs that join to the whole
    response's, then one finish chunk; usage equals the whole response's."""
    kw = dict(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "w20 w21"}],
        n=2,
        temperature=1.0,
        seed=11,
        max_tokens=8,
        stop=["w3"],
        logprobs=True,
        top_logprobs=2,
    )
    whole = client.chat.completions.create(**kw)
    stream = client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    for want in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == want.index]
        assert mine[0].delta.role == "assistant"
        assert [m.finish_reason for m in mine[1:]] == [None] * (len(mine) - 2) + [
            want.finish_reason
        ]
        assert "".join(m.delta.content or "" for m in mine) == want.message.content
        tokens = [t for m in mine if m.logprobs for t in m.logprobs.content]
        assert tokens == want.logprobs.content
    assert chunks[-1].usage == whole.usage


def test_models_health_and_metrics(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert httpx.get(f"{server}/health").status_code == 200
    text = httpx.get(f"{server}/metrics").text
    for name in (
        "ksana_num_requests_running",
        "ksana_num_requests_waiting",
        "ksana_kv_cache_usage_ratio",
        "ksana_prefix_cache_queries_total",
        "ksana_prefix_cache_hits_total",
        "ksana_prompt_tokens_total",
        "ksana_generation_tokens_total",
        "ksana_request_success_total",
        "ksana_time_to_first_token_seconds_bucket",
        "ksana_time_per_output_token_seconds_bucket",
        "ksana_e2e_request_latency_seconds_bucket",
        "ksana_compilations_total",
    ):
        assert name in text, name
    schema = httpx.get(f"{server}/schema/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions"} <= set(schema["paths"])


def test_startup_log_says_the_plan_and_prints_a_curl_line_that_works(server_process):
    """The log names the mesh and attention backend, and its ready line, pasted into a shell
    with $KSANA_API_KEY set, completes; the key itself is never printed."""
    proc, url = server_process
    deadline = time.monotonic() + 30  # printed once warm-up ends, about when /health turns 200
    while "curl " not in (log := server_log(proc)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "mesh (data 1 x model 1 x kv_replica 1): one device" in log, log
    assert "attention backend cpu" in log, log
    assert API_KEY not in log
    (line,) = [x.strip() for x in log.splitlines() if x.strip().startswith("curl ")]
    command, hint = line.split("  (first: ")
    assert command.startswith(f"curl {url}/v1/completions")
    assert hint == "export KSANA_API_KEY=<your --api-key>)"  # the key came from --api-key
    env = {**os.environ, "KSANA_API_KEY": API_KEY}
    done = subprocess.run(["bash", "-c", command], env=env, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    assert body["object"] == "text_completion" and body["choices"][0]["text"], body
    without_key = {k: v for k, v in env.items() if k != "KSANA_API_KEY"}
    done = subprocess.run(["bash", "-c", command], env=without_key, capture_output=True)
    assert "invalid API key" in done.stdout.decode()  # so the header is what authorised it


# ---------------------------------------------------------------------------- under load


def test_64_concurrent_streams_all_correct(server, llm):
    prompts = [f"w{3 + i % 50} w{60 + i % 37} w{100 + i % 13}" for i in range(64)]
    want = [o.text for o in greedy(llm, prompts, max_tokens=10)]
    compilations = metric(server, "ksana_compilations_total")

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(
            model=MODEL_NAME, prompt=prompt, temperature=0, max_tokens=10, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=300
        ) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(main()) == want
    assert metric(server, "ksana_compilations_total") == compilations


def test_a_client_that_leaves_mid_body_is_no_server_error(server_process):
    """A request whose client closes the connection before its body is all sent: nothing is
    queued and the log has no error (it logged "HTTP 500" at ERROR)."""
    proc, url = server_process
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps(OK).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body) + 50}\r\n\r\n"
    )
    before = server_log(proc)
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(head.encode() + body)  # 50 bytes short
    time.sleep(1)
    assert post(url, "/v1/completions", OK).status_code == 200
    new_lines = server_log(proc)[len(before) :]
    assert "ERROR" not in new_lines and "500" not in new_lines, new_lines
    assert (
        metric(url, "ksana_num_requests_waiting") == metric(url, "ksana_num_requests_running") == 0
    )


def test_disconnects_abort_and_free_pages(server):
    idle = metric(server, "ksana_kv_cache_usage_ratio")
    generated = metric(server, "ksana_generation_tokens_total")
    body = {"model": MODEL_NAME, "prompt": "w5 w6", "max_tokens": 100, "stream": True}
    body["ignore_eos"] = True
    aborted = 0

    async def leave(client: httpx.AsyncClient, i: int) -> None:
        nonlocal aborted
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with client.stream(
            "POST", f"{server}/v1/completions", json=body | {"seed": i}, headers=headers
        ) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    aborted += 1
                    return  # closes the connection mid-stream

    async def main() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            await asyncio.gather(*(leave(client, i) for i in range(50)))

    asyncio.run(main())
    assert aborted == 50
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        running = metric(server, "ksana_num_requests_running")
        waiting = metric(server, "ksana_num_requests_waiting")
        usage = metric(server, "ksana_kv_cache_usage_ratio")
        if running == waiting == 0 and usage == idle:
            break
        time.sleep(0.2)
    assert (running, waiting, usage) == (0, 0, idle)
    # Nowhere near 50 x 100 tokens were generated: the requests really stopped.
    assert metric(server, "ksana_generation_tokens_total") - generated < 50 * 100 / 2


# ---------------------------------------------------------------------------- bad input

OK = {"model": MODEL_NAME, "prompt": "w5 w6", "max_tokens": 4}
CHAT_OK = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "w5"}], "max_tokens": 4}


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
def test_bad_request_is_400_naming_the_field(server, path, body, param):
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param, error
        assert param in error["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_logit_bias_forces_and_bans_tokens(server, path):
    """OpenAI's logit_bias on both routes: +100 makes a token the greedy choice, -100 bans
    the token greedy decoding picked without it."""
    base = (OK if path == "/v1/completions" else CHAT_OK) | {"temperature": 0, "ignore_eos": True}

    def words(bias):
        response = post(server, path, base | {"logit_bias": bias})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return (choice.get("text") or choice["message"]["content"]).split()

    plain = words({})
    assert words({"9": 100}) == ["w9"] * 4 != plain
    banned = int(plain[0].removeprefix("w"))
    assert words({str(banned): -100})[0] != plain[0]


def test_null_means_the_default(server):
    """OpenAI's nullable fields sent as null (as LiteLLM and LangChain do) act as absent."""
    nullable = ["temperature", "top_p", "n", "stream", "presence_penalty", "frequency_penalty"]
    nullable += ["top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "echo"]
    body = OK | {"seed": 7, "max_tokens": 6, "stream_options": {"include_usage": None}}
    want = post(server, "/v1/completions", body)
    got = post(server, "/v1/completions", body | dict.fromkeys(nullable))
    assert want.status_code == got.status_code == 200, got.text
    assert got.json()["choices"] == want.json()["choices"]
    chat = CHAT_OK | {"seed": 7}
    want = post(server, "/v1/chat/completions", chat)
    nulls = dict.fromkeys(["logprobs", "add_generation_prompt", "temperature", "n"])
    got = post(server, "/v1/chat/completions", chat | nulls)
    assert want.status_code == got.status_code == 200, got.text
    assert got.json()["choices"] == want.json()["choices"]


def test_chat_takes_vllms_template_fields(server):
    """continue_final_message (with add_generation_prompt false) prompts with the template
    /tokenize renders for the same fields; both true is a 400 naming the field."""
    messages = [{"role": "user", "content": "w5"}, {"role": "assistant", "content": "w6 w7"}]
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    body = CHAT_OK | {"messages": messages, "max_tokens": 1} | fields
    got = post(server, "/v1/chat/completions", body)
    assert got.status_code == 200, got.text
    tokens = post(server, "/tokenize", {"messages": messages} | fields)
    assert got.json()["usage"]["prompt_tokens"] == tokens.json()["count"]
    both = post(server, "/v1/chat/completions", body | {"add_generation_prompt": True})
    assert both.status_code == 400, both.text
    assert both.json()["error"]["param"] == "continue_final_message"


def test_other_errors(server):
    too_long = post(server, "/v1/completions", OK | {"max_tokens": 127})
    assert too_long.status_code == 400
    assert "127" in too_long.json()["error"]["message"]
    assert "128" in too_long.json()["error"]["message"]  # max_model_len

    malformed = post(server, "/v1/completions", b'{"prompt": "w5",')
    assert malformed.status_code == 400 and malformed.json()["error"]["message"]
    empty = post(server, "/v1/completions", b"")
    assert empty.status_code == 400 and "empty" in empty.json()["error"]["message"]

    unknown = post(server, "/v1/completions", OK | {"model": "gpt-4"})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"

    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}):
        denied = post(server, "/v1/completions", OK, headers=headers)
        assert (
            denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
        )
    assert httpx.get(f"{server}/v1/models").status_code == 401

    # More sequences than the server ever runs at once: the request's own fault (400).
    for too_many in ({"prompt": ["w5"] * (MAX_PENDING + 1)}, {"n": MAX_PENDING + 1}):
        refused = post(server, "/v1/completions", OK | too_many)
        assert refused.status_code == 400, refused.text
        assert str(MAX_PENDING) in refused.json()["error"]["message"]
        assert refused.json()["error"]["param"] == ("n" if "n" in too_many else "prompt")

    huge = post(server, "/v1/completions", OK | {"prompt": "w5 " * 2_000_000})
    assert huge.status_code == 413 and huge.json()["error"]["message"]

    # top_k beyond the vocabulary (and beyond int32) means every token.
    assert post(server, "/v1/completions", OK | {"top_k": 2272561036178}).status_code == 200

    # ... and the server still serves.
    assert post(server, "/v1/completions", OK).status_code == 200


def test_fuzzed_requests_never_5xx(server):
    """schemathesis generates bodies from the OpenAPI schema, valid ones and invalid ones:
    none may get a 5xx, and some of each kind are served and rejected."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    raw = httpx.get(f"{server}/schema/openapi.json").json()
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
                response = case.call(base_url=server, headers=auth, timeout=120)
                statuses[response.status_code] += 1
                if response.status_code >= 500:
                    failures.append((case.body, response.status_code, response.text))

            fuzz()
    assert not failures, failures[:3]
    assert statuses[200] and statuses[400], statuses
    assert httpx.get(f"{server}/health").status_code == 200


# ---------------------------------------------------------------------------- in-process


@pytest.fixture()
def inprocess(tiny_dir):
    """The app over an engine in this process (for fault injection), via Litestar's client."""
    from litestar.testing import TestClient

    from ksana_jax import EngineConfig, load
    from ksana_jax.async_engine import AsyncEngine
    from ksana_jax.engine import LLMEngine
    from server import create_app

    engine = AsyncEngine(LLMEngine(load(tiny_dir), EngineConfig(**ENGINE_FLAGS)))
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


# ---------------------------------------------------------------------------- SmolLM2

SMOL_FLAGS = {"max_model_len": 256, "max_num_seqs": 4, "max_num_batched_tokens": 64}


@pytest.mark.slow
def test_smollm2_server_equals_llm(smollm2_dir):
    """The real model through HTTP and the openai client: same greedy text as `LLM`."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SMOL_FLAGS.items()]
    proc, url = start_server(smollm2_dir, *flags)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        (name,) = [m.id for m in client.models.list().data]
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        chat = client.chat.completions.create(
            model=name, messages=messages, temperature=0, max_tokens=24
        )
        prompt = "The three primary colours are"
        completion = client.completions.create(
            model=name, prompt=prompt, temperature=0, max_tokens=24
        )
        # Byte-level tokens that hold parts of a character: their bytes rebuild the text.
        emoji = [{"role": "user", "content": "Reply with only emojis: 🎉🎉🎉😀😀"}]
        with_logprobs = client.chat.completions.create(
            model=name, messages=emoji, temperature=0, max_tokens=12, logprobs=True
        )
    finally:
        log = stop_server(proc)
    assert "Traceback" not in log, log
    llm = LLM(smollm2_dir, warm_up=False, **SMOL_FLAGS)
    params = SamplingParams(temperature=0, max_tokens=24)
    (want_chat,) = llm.chat(messages, params, use_tqdm=False)
    (want_completion,) = llm.generate(prompt, params, use_tqdm=False)
    assert chat.choices[0].message.content == want_chat.outputs[0].text
    assert "Paris" in chat.choices[0].message.content
    assert completion.choices[0].text == want_completion.outputs[0].text
    (choice,) = with_logprobs.choices
    joined = b"".join(bytes(t.bytes) for t in choice.logprobs.content)
    assert joined.decode(errors="ignore").startswith(choice.message.content)
    assert any(ord(ch) > 0xFFFF for ch in choice.message.content)  # an emoji, 4 UTF-8 bytes

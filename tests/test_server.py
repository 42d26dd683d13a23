"""The HTTP server as clients see it, on the happy path and under load: the shared tiny
`ksana-jax serve` process on 127.0.0.1 (conftest's `openai_server`), driven by the official
`openai` client and raw httpx for disconnects; and the real SmolLM2 through its own server.

The model is a tiny random-weight Llama (word-level tokenizer, so texts are `w12 w40 ...`);
expected texts come from `LLM.generate` on the same checkpoint and engine configuration.
Bad input and faults: test_server_errors.py.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import socket
import subprocess
import time

import httpx
import openai
import pytest

from ksana_jax import LLM, SamplingParams
from tests.servers import (
    API_KEY,
    ENGINE_FLAGS,
    MODEL_NAME,
    OK,
    metric,
    post,
    server_log,
    start_server,
    stop_server,
)

PROMPTS = ["w5 w6 w7", "w100 w3", "w42 w43 w44 w45 w46 w47 w48 w49 w50", "w9"]


@pytest.fixture(scope="module")
def llm(openai_server_dir):
    return LLM(openai_server_dir, **ENGINE_FLAGS)


@pytest.fixture(scope="module")
def client(openai_server):
    return openai.OpenAI(base_url=f"{openai_server}/v1", api_key=API_KEY, max_retries=0)


def greedy(llm, prompts, max_tokens=12, **kw):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


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


def test_models_health_and_metrics(client, openai_server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert httpx.get(f"{openai_server}/health").status_code == 200
    text = httpx.get(f"{openai_server}/metrics").text
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
    schema = httpx.get(f"{openai_server}/schema/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions"} <= set(schema["paths"])


def test_startup_log_says_the_plan_and_prints_a_curl_line_that_works(openai_server_process):
    """The log names the mesh and attention backend, and its ready line, pasted into a shell
    with $KSANA_API_KEY set, completes; the key itself is never printed."""
    proc, url = openai_server_process
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


def test_64_concurrent_streams_all_correct(openai_server, llm):
    prompts = [f"w{3 + i % 50} w{60 + i % 37} w{100 + i % 13}" for i in range(64)]
    want = [o.text for o in greedy(llm, prompts, max_tokens=10)]
    compilations = metric(openai_server, "ksana_compilations_total")

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(
            model=MODEL_NAME, prompt=prompt, temperature=0, max_tokens=10, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=f"{openai_server}/v1", api_key=API_KEY, max_retries=0, timeout=300
        ) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(main()) == want
    assert metric(openai_server, "ksana_compilations_total") == compilations


def test_a_client_that_leaves_mid_body_is_no_server_error(openai_server_process):
    """A request whose client closes the connection before its body is all sent: nothing is
    queued and the log has no error (it logged "HTTP 500" at ERROR)."""
    proc, url = openai_server_process
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


def test_disconnects_abort_and_free_pages(openai_server):
    idle = metric(openai_server, "ksana_kv_cache_usage_ratio")
    generated = metric(openai_server, "ksana_generation_tokens_total")
    body = {"model": MODEL_NAME, "prompt": "w5 w6", "max_tokens": 100, "stream": True}
    body["ignore_eos"] = True
    aborted = 0

    async def leave(client: httpx.AsyncClient, i: int) -> None:
        nonlocal aborted
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with client.stream(
            "POST", f"{openai_server}/v1/completions", json=body | {"seed": i}, headers=headers
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
        running = metric(openai_server, "ksana_num_requests_running")
        waiting = metric(openai_server, "ksana_num_requests_waiting")
        usage = metric(openai_server, "ksana_kv_cache_usage_ratio")
        if running == waiting == 0 and usage == idle:
            break
        time.sleep(0.2)
    assert (running, waiting, usage) == (0, 0, idle)
    # Nowhere near 50 x 100 tokens were generated: the requests really stopped.
    assert metric(openai_server, "ksana_generation_tokens_total") - generated < 50 * 100 / 2


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

"""usage.prompt_tokens_details.cached_tokens (vLLM's --enable-prompt-tokens-details): the
prompt tokens the prefix cache held, through the official `openai` client; left out of usage
unless enabled."""

from __future__ import annotations

import openai
import pytest
from conftest import write_tiny_hf

MODEL_NAME = "tiny"
PAGE_SIZE = 8
PROMPT = list(range(5, 45))  # 40 token ids: 5 pages of 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from ksana_jax import load

    path = tmp_path_factory.mktemp("tiny-usage")
    write_tiny_hf(path)
    return load(path)


def openai_client(model, **app_options):
    """(openai client, test client) over the app on a fresh engine."""
    from litestar.testing import TestClient

    from ksana_jax import EngineConfig
    from ksana_jax.async_engine import AsyncEngine
    from ksana_jax.engine import LLMEngine
    from server import create_app

    config = EngineConfig(
        max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, page_size=PAGE_SIZE
    )
    engine = AsyncEngine(LLMEngine(model, config))
    http = TestClient(create_app(engine, MODEL_NAME, tokenizer_processes=0, **app_options))
    client = openai.OpenAI(
        base_url=f"{str(http.base_url).rstrip('/')}/v1",
        api_key="unused",
        http_client=http,
        max_retries=0,
    )
    return client, http, engine


def test_usage_counts_the_cached_prompt_tokens_when_enabled(model):
    client, http, engine = openai_client(model, enable_prompt_tokens_details=True)
    with http:
        kw = dict(model=MODEL_NAME, prompt=PROMPT, temperature=0, max_tokens=4)
        first = client.completions.create(**kw)
        second = client.completions.create(**kw)
        streamed = list(
            client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
        )
    engine.shutdown()
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == len(PROMPT)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # every full page of the prompt but the one holding its last token, which computes
    cached = (len(PROMPT) - 1) // PAGE_SIZE * PAGE_SIZE
    assert second.usage.prompt_tokens_details.cached_tokens == cached == 32
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == cached
    assert second.choices[0].text == first.choices[0].text


def test_usage_has_no_prompt_tokens_details_by_default(model):
    client, http, engine = openai_client(model)
    with http:
        kw = dict(model=MODEL_NAME, prompt=PROMPT, temperature=0, max_tokens=4)
        client.completions.create(**kw)
        raw = http.post("/v1/completions", json=kw)
    engine.shutdown()
    assert raw.status_code == 200, raw.text
    assert "prompt_tokens_details" not in raw.json()["usage"]
    assert raw.json()["usage"]["prompt_tokens"] == len(PROMPT)

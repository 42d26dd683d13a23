"""POST /tokenize and /detokenize (vLLM's shapes) against the app over a tiny model: the ids
are the tokenizer's own, chat messages go through the checkpoint's template, detokenize
round-trips, and bad bodies are 4xx naming the field."""

from __future__ import annotations

import pytest
from conftest import write_tiny_hf

MODEL_NAME = "tiny"


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """(test client, the model's tokenizer): the engine is not warmed up, the routes need
    only its tokenizer."""
    from litestar.testing import TestClient

    from ksana_jax import EngineConfig, load
    from ksana_jax.async_engine import AsyncEngine
    from ksana_jax.engine import LLMEngine
    from server import create_app

    path = tmp_path_factory.mktemp("tiny-tokens")
    write_tiny_hf(path)
    model = load(path)
    config = EngineConfig(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64)
    engine = AsyncEngine(LLMEngine(model, config))
    with TestClient(create_app(engine, MODEL_NAME, tokenizer_processes=0)) as client:
        yield client, model.tokenizer
    engine.shutdown()


def test_tokenize_a_prompt_and_detokenize_it_back(app):
    http, tokenizer = app
    text = "w5 w6 w17 w5"
    response = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": text})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["tokens"] == tokenizer.encode(text) == [5, 6, 17, 5]
    assert body["count"] == 4 and body["max_model_len"] == 128
    back = http.post("/detokenize", json={"tokens": body["tokens"]})
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": tokenizer.decode(body["tokens"])}
    assert back.json()["prompt"].split() == text.split()


def test_tokenize_chat_messages_through_the_template(app):
    http, tokenizer = app
    messages = [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w7"}]
    response = http.post("/tokenize", json={"messages": messages})
    assert response.status_code == 200, response.text
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert response.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False)


def test_tokenize_chat_with_vllms_template_fields(app):
    """continue_final_message, a body's own chat_template and chat_template_kwargs render
    as the tokenizer renders them; clashes are 400s naming the field."""
    http, tokenizer = app
    messages = [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w7 w8"}]
    body = {"messages": messages, "add_generation_prompt": False}
    response = http.post("/tokenize", json=body | {"continue_final_message": True})
    assert response.status_code == 200, response.text
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True
    )
    assert text.rstrip().endswith("w7 w8")
    assert response.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    template = "{% for m in messages %}{{ greeting }} {{ m['content'] }} {% endfor %}"
    own = body | {"chat_template": template, "chat_template_kwargs": {"greeting": "w9"}}
    response = http.post("/tokenize", json=own)
    assert response.status_code == 200, response.text
    assert response.json()["tokens"] == tokenizer.encode(
        "w9 w5 w6 w9 w7 w8 ", add_special_tokens=False
    )
    for bad, param in [
        ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"chat_template": "{% for %}"}, "chat_template"),
    ]:
        response = http.post("/tokenize", json={"messages": messages} | bad)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/tokenize", {}, 400, "prompt"),
        (
            "/tokenize",
            {"prompt": "w5", "messages": [{"role": "user", "content": "w5"}]},
            400,
            "prompt",
        ),
        ("/tokenize", {"prompt": "w5", "model": "other"}, 404, "model"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/detokenize", {"tokens": [5, 10**6]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
    ],
)
def test_bad_bodies_name_the_field(app, path, body, status, param):
    http, _ = app
    response = http.post(path, json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param

"""What a new user meets first: the server samples with the model's own defaults
(generation_config.json, as vLLM does), the demo converts with SmolLM2-Instruct's recommended
ones and answers the quick-start question, `demo` works wherever a model or a convert source
does, and `generate` takes the flags its errors name, shows progress and refuses an empty chat."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import write_tiny_hf

from ksana_jax import cli
from ksana_jax.sampling_defaults import OPENAI_DEFAULTS, sampling_defaults

MODEL_NAME = "tiny"
QUICK_START = {"prompt": "The capital of France is", "max_tokens": 16}  # serve's curl line


def test_sampling_defaults_come_from_the_generation_config():
    assert sampling_defaults({}) == OPENAI_DEFAULTS
    got = sampling_defaults({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True})
    assert got == OPENAI_DEFAULTS | {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    # Values SamplingParams refuses are ignored (logged), not fatal.
    bad = {"temperature": -1, "top_p": 0, "min_p": "x", "repetition_penalty": True}
    assert sampling_defaults(bad) == OPENAI_DEFAULTS


@pytest.fixture(scope="module")
def greedy_by_default(tmp_path_factory):
    """The app over a tiny model whose generation_config.json says temperature 0."""
    from litestar.testing import TestClient

    from ksana_jax import EngineConfig, load
    from ksana_jax.async_engine import AsyncEngine
    from ksana_jax.engine import LLMEngine
    from server import create_app

    path = tmp_path_factory.mktemp("tiny-defaults")
    write_tiny_hf(path)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps(config | {"temperature": 0.0}))
    config = EngineConfig(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64)
    engine = AsyncEngine(LLMEngine(load(path), config))
    with TestClient(create_app(engine, MODEL_NAME, tokenizer_processes=0)) as client:
        yield client
    engine.shutdown()


def test_llm_without_sampling_params_takes_the_models_defaults(tmp_path):
    """`LLM.generate(prompts)` samples as the model's generation_config.json says (vLLM's
    get_default_sampling_params): temperature 0 there makes it greedy, seeds or not."""
    from ksana_jax import LLM, SamplingParams

    write_tiny_hf(tmp_path, initializer_range=0.2)
    config = json.loads((tmp_path / "generation_config.json").read_text())
    config |= {"temperature": 0.0, "top_k": 7}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    llm = LLM(tmp_path, warm_up=False, max_model_len=64, max_num_seqs=2)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p) == (0.0, 7, 1.0)
    prompt = [5, 6, 7]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    got = llm.generate([prompt], use_tqdm=False)[0].outputs[0]
    assert got.token_ids[: len(want)] == want[: len(got.token_ids)] and got.token_ids


def completion(http, **fields) -> str:
    body = {"prompt": "w5 w6 w7", "max_tokens": 12, "ignore_eos": True} | fields
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_a_request_without_temperature_takes_the_models(greedy_by_default):
    http = greedy_by_default
    greedy = completion(http, temperature=0)
    assert {completion(http, seed=seed) for seed in range(4)} == {greedy}
    assert completion(http, seed=0, temperature=None) == greedy  # null: the default too
    # The request's own value wins.
    sampled = {completion(http, seed=seed, temperature=1.0) for seed in range(4)}
    assert sampled != {greedy}


def test_generate_refuses_an_empty_chat_prompt(capsys):
    for prompt in ("", "  \n"):
        assert cli.main(["generate", "demo", prompt, "--chat"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("ksana-jax generate: error: PROMPT is empty") and err.count("\n") == 1


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from checkpoints_tools import convert

    root = tmp_path_factory.mktemp("tiny-generate")
    write_tiny_hf(root / "hf")
    return convert(root / "hf", root / "ckpt")


def test_generate_takes_engine_flags_and_shows_progress(tiny_ckpt, capsys):
    argv = ["generate", str(tiny_ckpt), "w5 w6", "--max-tokens", "200"]
    assert cli.main([*argv, "--max-model-len", "100"]) == 2
    err = capsys.readouterr().err
    # The error names max_model_len, which is now a flag of generate.
    assert err.strip() == (
        "ksana-jax generate: error: max_tokens (200) + prompt (2 tokens) exceed max_model_len (100)"
    )
    assert cli.main([*argv, "--max-model-len", "256", "--json"]) == 0
    captured = capsys.readouterr()
    assert len(json.loads(captured.out)["token_ids"]) <= 200
    assert re.search(r"\d+/200 \[", captured.err), captured.err  # the progress bar
    assert cli.main(["generate", str(tiny_ckpt), "w5 w6", "--max-tokens", "4"]) == 0
    assert capsys.readouterr().err == ""  # short outputs: no bar


# ---------------------------------------------------------------------------- the demo


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory, smollm2_gguf):
    """`demo` as a user's first call meets it: converted into an empty user cache."""
    import os

    import ksana_jax

    cache = tmp_path_factory.mktemp("xdg-cache")
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(cache)
    try:
        model = ksana_jax.load("demo")  # converts it, once
        from ksana_jax.demo import demo_checkpoint

        path = demo_checkpoint()
    finally:
        if old is None:
            del os.environ["XDG_CACHE_HOME"]
        else:
            os.environ["XDG_CACHE_HOME"] = old
    assert path.parent == cache / "ksana-jax"
    return path, model


def test_demo_converts_with_its_recommended_sampling(demo_dir, tmp_path, capsys):
    path, model = demo_dir
    assert model.generation_config["temperature"] == 0.2
    assert model.generation_config["top_p"] == 0.9
    # `demo` as a convert SOURCE, on the command line.
    out = tmp_path / "my-demo"
    assert cli.main(["convert", "demo", str(out)]) == 0
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation == json.loads((Path(path) / "generation_config.json").read_text())
    assert generation["temperature"] == 0.2 and generation["top_p"] == 0.9


def test_quick_start_question_answers_paris_at_the_demos_defaults(demo_dir):
    """The curl line `serve` prints, at the demo's default sampling, for ten seeds."""
    from litestar.testing import TestClient

    from ksana_jax import EngineConfig
    from ksana_jax.async_engine import AsyncEngine
    from ksana_jax.engine import LLMEngine
    from server import create_app

    _, model = demo_dir
    config = EngineConfig(max_model_len=128, max_num_seqs=10, max_num_batched_tokens=64)
    engine = AsyncEngine(LLMEngine(model, config))
    try:
        with TestClient(create_app(engine, tokenizer_processes=0)) as http:
            texts = []
            for seed in range(10):
                response = http.post("/v1/completions", json=QUICK_START | {"seed": seed})
                assert response.status_code == 200, response.text
                texts.append(response.json()["choices"][0]["text"])
    finally:
        engine.shutdown()
    assert sum("Paris" in text for text in texts) >= 9, texts

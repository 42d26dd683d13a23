"""Structured output as clients see it: SmolLM2 behind a real `ksana-jax serve` process,
driven by the official openai client. Every JSON-schema answer validates (jsonschema) and
finishes with "stop", greedy and sampled; `beta.chat.completions.parse` fills a pydantic
model; regex, choice and json_object answers hold; bad constraints are 400s naming the
field; nothing compiles after warm-up; offline `LLM` gives the server's greedy answers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import subprocess
import sys

import jsonschema
import openai
import pydantic
import pytest

from ksana_jax import LLM, SamplingParams, StructuredOutputsParams
from tests.test_server import ROOT, jax_cache_dir, metric, start_server, stop_server

pytestmark = pytest.mark.slow
FLAGS = {"max_model_len": 512, "max_num_seqs": 8, "max_num_batched_tokens": 128}


def _object(**properties) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


NAME = {"type": "string", "minLength": 1, "maxLength": 20}
SCHEMAS = {
    "nested": (
        "Describe a famous scientist as JSON.",
        _object(person=_object(name=NAME, age={"type": "integer", "minimum": 0, "maximum": 120})),
    ),
    "array": (
        "List some colours of the rainbow as JSON.",
        _object(colors={"type": "array", "items": NAME, "minItems": 2, "maxItems": 3}),
    ),
    "enum+range": (
        "Is the sky blue? Answer as JSON with your confidence from 1 to 5.",
        _object(
            answer={"enum": ["yes", "no", "maybe"]},
            confidence={"type": "integer", "minimum": 1, "maximum": 5},
        ),
    ),
    "pattern+length": (
        "Invent a product code and a short word as JSON.",
        _object(
            code={"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
            word={"type": "string", "minLength": 3, "maxLength": 8},
        ),
    ),
    "anyOf": (
        "Give me a small value as JSON.",
        _object(value={"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5}, NAME]}),
    ),
    "nullable": (
        "Give a nickname (or null) and a score from 0 to 10 (or null) as JSON.",
        _object(
            nickname={"type": ["string", "null"], "maxLength": 10},
            score={"anyOf": [{"type": "integer", "minimum": 0, "maximum": 10}, {"type": "null"}]},
        ),
    ),
}


@pytest.fixture(scope="module")
def served(smollm2_dir):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in FLAGS.items()]
    proc, url = start_server(smollm2_dir, *flags, "--served-model-name", "smol")
    yield url
    log = stop_server(proc)
    assert "Traceback" not in log, log


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served}/v1", api_key="none", max_retries=0)


def _json_schema(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_every_schema_answer_validates_greedy_and_sampled(served):
    compiles = metric(served, "ksana_compilations_total")
    client = openai.AsyncOpenAI(base_url=f"{served}/v1", api_key="none", max_retries=0)

    async def ask(name: str, greedy: bool):
        prompt, schema = SCHEMAS[name]
        sampling = dict(temperature=0) if greedy else dict(n=2, temperature=0.8, seed=7)
        return await client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": prompt}],
            response_format=_json_schema(name.replace("+", "_"), schema),
            max_tokens=200,
            **sampling,
        )

    async def everything():
        jobs = [ask(name, greedy) for name in SCHEMAS for greedy in (True, False)]
        return await asyncio.gather(*jobs)

    answers = asyncio.run(everything())
    for (name, greedy), answer in zip(
        [(n, g) for n in SCHEMAS for g in (True, False)], answers, strict=True
    ):
        assert len(answer.choices) == (1 if greedy else 2)
        for choice in answer.choices:
            assert choice.finish_reason == "stop", (name, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name][1])
    assert metric(served, "ksana_compilations_total") == compiles


class Capital(pydantic.BaseModel):
    country: str = pydantic.Field(max_length=30)
    capital: str = pydantic.Field(max_length=30)
    population_millions: int = pydantic.Field(ge=0, le=2000)


def test_pydantic_parse(client):
    parsed = client.beta.chat.completions.parse(
        model="smol",
        messages=[{"role": "user", "content": "What is the capital of France? Answer as JSON."}],
        response_format=Capital,
        temperature=0,
        max_tokens=100,
    )
    choice = parsed.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Capital)


def test_regex_choice_and_json_object(client):
    phone = r"\(\d{3}\) \d{3}-\d{4}"

    def regex(**sampling):
        return client.completions.create(
            model="smol",
            prompt="My phone number is ",
            max_tokens=30,
            extra_body={"structured_outputs": {"regex": phone}},
            **sampling,
        )

    def choice(**sampling):
        return client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": "Is Paris in France?"}],
            max_tokens=10,
            extra_body={"structured_outputs": {"choice": ["Yes", "No"]}},
            **sampling,
        )

    def json_object(**sampling):
        return client.chat.completions.create(
            model="smol",
            messages=[
                {"role": "user", "content": "A JSON object with a cat's name and colour, short."}
            ],
            max_tokens=250,
            response_format={"type": "json_object"},
            **sampling,
        )

    # All six at once: they batch in the engine.
    samplings = (dict(n=1, temperature=0), dict(n=2, temperature=0.8, seed=3))
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        jobs = {
            (ask.__name__, i): pool.submit(ask, **sampling)
            for ask in (regex, choice, json_object)
            for i, sampling in enumerate(samplings)
        }
        answers = {key: job.result() for key, job in jobs.items()}
    for i in range(len(samplings)):
        for c in answers["regex", i].choices:
            assert re.fullmatch(phone, c.text) and c.finish_reason == "stop", c
        for c in answers["choice", i].choices:
            assert c.message.content in ("Yes", "No") and c.finish_reason == "stop", c
        for c in answers["json_object", i].choices:
            assert c.finish_reason == "stop", c
            assert isinstance(json.loads(c.message.content), dict), c


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"response_format": _json_schema("x", {"type": "objekt"})},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn"),
    ],
)
def test_bad_constraints_are_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "hi"}], extra_body=body
        )
    assert e.value.body["param"] == param, e.value.body


OFFLINE_REGEX = ("The year it happened was ", "1[89][0-9]{2}")


def offline_answers(model_dir: str, jax_cache: str) -> None:
    """Prints the offline `LLM`'s greedy answers to the requests of
    test_offline_llm_equals_the_server (run in a fresh process: the server's compilation cache
    makes its start cheap, and the test process keeps no engine)."""
    prompt, schema = SCHEMAS["nested"]
    llm = LLM(model_dir, warm_up=False, compilation_cache_dir=jax_cache, **FLAGS)
    chat_params = SamplingParams(
        temperature=0, max_tokens=200, structured_outputs=StructuredOutputsParams(json=schema)
    )
    (chat,) = llm.chat([{"role": "user", "content": prompt}], chat_params, use_tqdm=False)
    regex_params = SamplingParams(
        temperature=0,
        max_tokens=10,
        structured_outputs=StructuredOutputsParams(regex=OFFLINE_REGEX[1]),
    )
    (regex,) = llm.generate(OFFLINE_REGEX[0], regex_params, use_tqdm=False)
    print(json.dumps([chat.outputs[0].text, regex.outputs[0].text]))


def test_offline_llm_equals_the_server(client, smollm2_dir):
    prompt, schema = SCHEMAS["nested"]
    served_chat = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": prompt}],
        response_format=_json_schema("nested", schema),
        temperature=0,
        max_tokens=200,
    )
    served_regex = client.completions.create(
        model="smol",
        prompt=OFFLINE_REGEX[0],
        temperature=0,
        max_tokens=10,
        extra_body={"structured_outputs": {"regex": OFFLINE_REGEX[1]}},
    )
    code = "import sys, tests.test_structured_server as t; t.offline_answers(*sys.argv[1:])"
    done = subprocess.run(
        [sys.executable, "-c", code, str(smollm2_dir), jax_cache_dir()],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    chat, regex = json.loads(done.stdout.strip().splitlines()[-1])
    assert chat == served_chat.choices[0].message.content
    assert regex == served_regex.choices[0].text

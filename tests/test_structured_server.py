"""Structured output, tools and reasoning as clients see it: SmolLM2 behind a real
`ksana-jax serve` process, driven by the official openai client. Every JSON-schema answer
validates (jsonschema) and finishes with "stop", greedy and sampled; `beta.chat.completions.
parse` fills a pydantic model; regex, choice and json_object answers hold; forced tool calls
(named, "required") always have valid arguments, streamed or not; a tool result round-trips;
"auto" reads Hermes-style calls and --reasoning-parser splits <think>; bad constraints and
tool choices are 400s naming the field; nothing compiles after warm-up; offline `LLM` gives
the server's greedy answers."""

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
from tests.servers import ROOT, jax_cache_dir, metric, start_server, stop_server

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
    proc, url = start_server(
        smollm2_dir,
        *flags,
        "--served-model-name",
        "smol",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
    )
    yield url
    log = stop_server(proc)
    assert "Traceback" not in log, log


@pytest.fixture(scope="module", autouse=True)
def offline(served, smollm2_dir):
    """The offline `LLM`'s answers (`offline_answers`), computed in a fresh process that
    starts once the server has filled the compilation cache and runs beside the tests."""
    code = "import sys, tests.test_structured_server as t; t.offline_answers(*sys.argv[1:])"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(smollm2_dir), jax_cache_dir()],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    yield proc
    proc.kill()
    proc.communicate()


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


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": _object(city=NAME, unit={"enum": ["celsius", "fahrenheit"]}),
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_population",
            "description": "How many people live in a country",
            "parameters": _object(
                country=NAME, year={"type": "integer", "minimum": 1900, "maximum": 2030}
            ),
        },
    },
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def _tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def _named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


async def _streamed_calls(stream) -> list[tuple[list[dict], str]]:
    """Per choice: its calls (id, name, arguments joined from the fragments) and finish
    reason, checking OpenAI's order: a call's first delta has its index, id, type, name and
    empty arguments; later ones only argument fragments."""
    calls: dict[int, list[dict]] = {}
    finish: dict[int, str] = {}
    async for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                mine = calls.setdefault(choice.index, [])
                if delta.index == len(mine):
                    assert delta.id.startswith("call_") and delta.type == "function", delta
                    assert delta.function.name and delta.function.arguments == "", delta
                    mine.append({"id": delta.id, "name": delta.function.name, "arguments": ""})
                else:
                    assert delta.id is None and delta.function.name is None, delta
                    mine[delta.index]["arguments"] += delta.function.arguments
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return [(calls.get(i, []), finish[i]) for i in sorted(finish)]


def _valid_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), PARAMETERS[name])


def test_forced_tool_calls_validate_streamed_and_not(served):
    """Named and "required" tool_choice, greedy and sampled, streamed and not: every call's
    arguments validate against its function's parameters; nothing compiles."""
    compiles = metric(served, "ksana_compilations_total")
    client = openai.AsyncOpenAI(base_url=f"{served}/v1", api_key="none", max_retries=0)
    choices = {"named": _named("get_weather"), "required": "required"}
    samplings = {"greedy": dict(temperature=0), "sampled": dict(n=2, temperature=0.8, seed=5)}

    async def ask(choice: str, sampling: str, stream: bool):
        answer = await client.chat.completions.create(
            model="smol",
            messages=WEATHER_QUESTION,
            tools=TOOLS,
            tool_choice=choices[choice],
            max_tokens=60,
            stream=stream,
            **samplings[sampling],
        )
        if stream:
            return await _streamed_calls(answer)
        got = []
        for c in answer.choices:
            assert c.message.content is None, c
            calls = [
                {"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
                for t in c.message.tool_calls
            ]
            got.append((calls, c.finish_reason))
        return got

    cases = [(c, s, stream) for c in choices for s in samplings for stream in (False, True)]

    async def everything():
        return await asyncio.gather(*(ask(*case) for case in cases))

    for (choice, sampling, stream), answers in zip(cases, asyncio.run(everything()), strict=True):
        assert len(answers) == (1 if sampling == "greedy" else 2)
        for calls, finish_reason in answers:
            assert finish_reason == "tool_calls", (choice, sampling, stream, calls)
            assert calls and all(c["id"].startswith("call_") for c in calls)
            if choice == "named":
                assert [c["name"] for c in calls] == ["get_weather"]
            for call in calls:
                _valid_call(call["name"], call["arguments"])
    assert metric(served, "ksana_compilations_total") == compiles


def test_tool_result_round_trips_and_auto_reads_hermes_calls(client):
    """A conversation with the assistant's tool call and the tool's result is answered; under
    "auto" a Hermes-style call the model writes (forced here by a regex) becomes tool_calls,
    whole and streamed. (Requests that do not wait for each other are sent at once.)"""
    hermes = (
        r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
        r'\{"city": "[A-Z][a-z]{2,12}", "unit": "(celsius|fahrenheit)"\}\}\n</tool_call>'
    )
    auto = dict(
        model="smol",
        messages=WEATHER_QUESTION,
        tools=TOOLS,
        tool_choice="auto",
        temperature=0,
        max_tokens=60,
        extra_body={"structured_outputs": {"regex": hermes}},
    )

    def auto_streamed():
        content, calls, finish = "", {}, None
        for chunk in client.chat.completions.create(**auto, stream=True):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for d in choice.delta.tool_calls or []:
                    calls.setdefault(d.index, []).append(d)
                finish = choice.finish_reason or finish
        return content, calls, finish

    def chat(messages, **fields):
        return client.chat.completions.create(
            model="smol", messages=messages, tools=TOOLS, temperature=0, **fields
        )

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        auto_whole = pool.submit(client.chat.completions.create, **auto)
        auto_stream = pool.submit(auto_streamed)
        first = chat(WEATHER_QUESTION, tool_choice=_named("get_weather"), max_tokens=60)
        (call,) = first.choices[0].message.tool_calls
        messages = [
            *WEATHER_QUESTION,
            first.choices[0].message,  # sent back as the openai client holds it
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
        ]
        second = pool.submit(chat, messages, max_tokens=20)
        without = pool.submit(chat, messages[:2], max_tokens=1)
        second, without = second.result(), without.result()
        whole = auto_whole.result().choices[0]
        content, calls, finish = auto_stream.result()
    assert second.choices[0].message.content
    assert second.choices[0].finish_reason in ("stop", "length")
    # The tool's result reached the prompt (the template renders the tool message).
    assert second.usage.prompt_tokens > without.usage.prompt_tokens + 5

    assert whole.finish_reason == "tool_calls", whole
    assert whole.message.content == "Checking."
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather"
    _valid_call(call.function.name, call.function.arguments)
    assert content.strip() == "Checking." and finish == "tool_calls"
    head, *rest = calls[0]
    assert head.id.startswith("call_") and head.function.name == "get_weather"
    arguments = "".join(d.function.arguments for d in [head, *rest])
    assert json.loads(arguments) == json.loads(call.function.arguments)


def test_reasoning_content_whole_and_streamed(client):
    """--reasoning-parser qwen3: <think>...</think> (forced by a regex) is reasoning_content,
    the rest content; streamed, the reasoning deltas come first."""
    think = r"<think>[a-z ]{3,40}</think>[A-Z][a-z ]{2,30}\."
    ask = dict(
        model="smol",
        messages=[{"role": "user", "content": "Is the sky blue? Think first."}],
        temperature=0,
        max_tokens=60,
        extra_body={"structured_outputs": {"regex": think}},
    )
    whole = client.chat.completions.create(**ask).choices[0]
    reasoning = whole.message.model_extra["reasoning_content"]
    assert re.fullmatch(r"[a-z ]{3,40}", reasoning), whole
    assert re.fullmatch(r"[A-Z][a-z ]{2,30}\.", whole.message.content), whole
    kinds, streamed = [], {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            for kind in streamed:
                text = (choice.delta.model_extra or {}).get(kind) or getattr(
                    choice.delta, kind, None
                )
                if text:
                    streamed[kind] += text
                    kinds.append(kind)
    assert streamed == {"reasoning_content": reasoning, "content": whole.message.content}
    assert kinds == sorted(kinds, key=["reasoning_content", "content"].index)


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
        ({"tools": TOOLS, "tool_choice": _named("get_time")}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        ({"tools": [*TOOLS, TOOLS[0]]}, "tools[2].function.name"),
        (
            {
                "tools": [*TOOLS, _tool("unique", {"type": "array", "uniqueItems": True})],
                "tool_choice": _named("unique"),
            },
            "tools[2].function.parameters",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
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
    test_offline_llm_equals_the_server (run in a fresh process, the `offline` fixture: the
    server's compilation cache makes its start cheap, and the test process keeps no engine)."""
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


def test_offline_llm_equals_the_server(client, offline):
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
    stdout, stderr = offline.communicate(timeout=600)
    assert offline.returncode == 0, stderr[-4000:]
    chat, regex = json.loads(stdout.strip().splitlines()[-1])
    assert chat == served_chat.choices[0].message.content
    assert regex == served_regex.choices[0].text

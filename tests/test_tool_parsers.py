"""Tool-call and reasoning parsers on fixed strings (no model): calls are found where the
family's format has them, malformed ones stay text, and streaming them in any split gives
what parsing the whole text gives."""

from __future__ import annotations

import json

import pytest

from server.reasoning import ThinkParser
from server.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    ToolCallStream,
    parser_for_template,
    required_calls,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
HERMES = [
    # (text, content, [(name, arguments)])
    (
        f"<tool_call>\n{WEATHER}\n</tool_call>",
        None,
        [("get_weather", {"city": "Paris", "days": 2})],
    ),
    (
        f"Let me look.\n<tool_call>{WEATHER}</tool_call>\n<tool_call>"
        '{"name": "now", "arguments": {}}</tool_call>',
        "Let me look.",
        [("get_weather", {"city": "Paris", "days": 2}), ("now", {})],
    ),
    # arguments given as JSON text, and under "parameters"
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', None, [("f", {"x": 1})]),
    ('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>', None, [("f", {"x": 1})]),
    # text after the calls stays content
    (
        f"Sure.\n<tool_call>{WEATHER}</tool_call>\nDone.",
        "Sure.\nDone.",
        [("get_weather", {"city": "Paris", "days": 2})],
    ),
]
HERMES_MALFORMED = [
    "The weather is fine.",
    "<tool_call>{'name': 'f'}</tool_call>",  # not JSON
    '<tool_call>{"name": "f", "arguments": {"x": 1}}',  # never closed
    '<tool_call>{"arguments": {"x": 1}}</tool_call>',  # no name
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
    f"<tool_call>{WEATHER}</tool_call><tool_call>oops</tool_call>",  # one bad block: all text
    f"<tool_call>{WEATHER}</tool_call><tool_call>{WEATHER}",  # the second never closed
]
LLAMA = [
    ('{"name": "f", "parameters": {"x": 1}}', [("f", {"x": 1})]),
    ('<|python_tag|>{"name": "f", "parameters": {"x": 1}}', [("f", {"x": 1})]),
    (
        '{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"y": "z"}}',
        [("f", {}), ("g", {"y": "z"})],
    ),
]
LLAMA_MALFORMED = [
    "Hello there",
    '{"name": "f", "parameters": {"x": 1}',  # cut off
    '{"parameters": {"x": 1}}',
    'Sure: {"name": "f", "parameters": {}}',
    '{"name": "f", "parameters": {}} trailing words',
]


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("text", "content", "want"), HERMES)
def test_hermes_finds_calls(text, content, want):
    got_content, calls = HermesParser().parse(text)
    assert got_content == content
    assert _calls(calls) == want
    assert all(c.id.startswith("call_") for c in calls)
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize("parser", [HermesParser(), Llama3JsonParser()])
@pytest.mark.parametrize("text", HERMES_MALFORMED + LLAMA_MALFORMED)
def test_malformed_calls_stay_text(parser, text):
    content, calls = parser.parse(text)
    if calls:  # only a well-formed call of the *other* family may parse here
        pytest.fail(f"{type(parser).__name__} found {calls} in {text!r}")
    assert content == text


@pytest.mark.parametrize(("text", "want"), LLAMA)
def test_llama3_json_finds_calls(text, want):
    content, calls = Llama3JsonParser().parse(text)
    assert content is None
    assert _calls(calls) == want


def _streamed(parser, text: str, size: int):
    stream = ToolCallStream(parser)
    content, deltas = "", []
    for i in range(0, len(text), size):
        out = stream.feed(text[i : i + size])
        content += out.content
        deltas += out.calls
    end = stream.finish()
    return content + end.content, deltas + end.calls


@pytest.mark.parametrize("size", [1, 3, 1000])
@pytest.mark.parametrize(
    ("parser", "text"),
    [(HermesParser(), t) for t, _, _ in HERMES]
    + [(HermesParser(), t) for t in HERMES_MALFORMED]
    + [(Llama3JsonParser(), t) for t, _ in LLAMA]
    + [(Llama3JsonParser(), t) for t in LLAMA_MALFORMED],
)
def test_streaming_gives_what_parsing_gives(parser, text, size):
    want_content, want_calls = parser.parse(text)
    content, deltas = _streamed(parser, text, size)
    if not want_calls:
        assert content == text and deltas == []
        return
    # Content streams as it comes (whitespace around it included).
    assert content.split() == (want_content or "").split()
    heads = [d for d in deltas if "id" in d]
    assert [(h["index"], h["type"], h["function"]["name"]) for h in heads] == [
        (i, "function", c.name) for i, c in enumerate(want_calls)
    ]
    assert all(h["id"].startswith("call_") and h["function"]["arguments"] == "" for h in heads)
    for i, call in enumerate(want_calls):
        fragments = [d["function"]["arguments"] for d in deltas if d["index"] == i]
        assert json.loads("".join(fragments)) == json.loads(call.arguments)


def test_parser_from_the_chat_template():
    assert parser_for_template("{% if tools %}<tool_call>{{ tool | tojson }}{% endif %}") == (
        "hermes"
    )
    assert parser_for_template('<|python_tag|>{"name": ..., "parameters": ...}') == "llama3_json"
    assert parser_for_template("<|im_start|>{{ message.content }}") == "hermes"


def test_required_calls():
    text = '[{"name": "f", "parameters": {"x": 1}}, {"name": "g", "parameters": {}}]'
    assert _calls(required_calls(text)) == [("f", {"x": 1}), ("g", {})]
    for bad in ("[]", '{"name": "f", "parameters": {}}', "[{", '[{"name": 1}]'):
        assert required_calls(bad) is None, bad


REASONING = [
    # (parser, text, reasoning, content)
    ("qwen3", "<think>\nHmm, 2+2.\n</think>\n\n4", "\nHmm, 2+2.\n", "\n\n4"),
    ("qwen3", "4", None, "4"),
    ("qwen3", "<think>still thinking", None, "<think>still thinking"),  # no end: all content
    ("qwen3", "a </think> b", None, "a </think> b"),  # no start: content
    ("qwen3", "<think></think>x", None, "x"),
    ("deepseek_r1", "Hmm.</think>The answer.", "Hmm.", "The answer."),
    ("deepseek_r1", "<think>Hmm.</think>The answer.", "Hmm.", "The answer."),
    ("deepseek_r1", "cut off while thinking", "cut off while thinking", None),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), REASONING)
@pytest.mark.parametrize("size", [1, 2, 1000])
def test_reasoning_split_whole_and_streamed(name, text, reasoning, content, size):
    parser = ThinkParser(name)
    assert parser.parse(text) == (reasoning, content)
    stream = parser.stream()
    got_reasoning, got_content = "", ""
    for i in range(0, len(text), size):
        r, c = stream.feed(text[i : i + size])
        got_reasoning, got_content = got_reasoning + r, got_content + c
    r, c = stream.finish()
    got_reasoning, got_content = got_reasoning + r, got_content + c
    if name == "qwen3" and text.startswith("<think>") and "</think>" not in text:
        # Streaming cannot wait for a </think> that never comes: it streams the thoughts.
        assert got_reasoning + got_content in (text, text.removeprefix("<think>"))
        return
    assert (got_reasoning or None, got_content or None) == (reasoning, content)


def test_unknown_reasoning_parser_names_the_option():
    with pytest.raises(ValueError, match="reasoning_parser"):
        ThinkParser("o1")


# A Qwen2.5-style template (ChatML, tools listed in the system turn, calls in <tool_call>
# blocks, results in <tool_response> blocks).
HERMES_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\nYou are a helpful assistant.\\n\\n# Tools\\n<tools>' }}
{%- for tool in tools %}
{{- '\\n' + tool | tojson }}
{%- endfor %}
{{- '\\n</tools><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- set tool_call = tool_call.function %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
{{- tool_call.arguments | tojson }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content }}
{{- '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""


def test_tools_and_tool_messages_render_as_transformers_renders_them(tmp_path):
    """The server's rendering of tools, an assistant's tool calls (arguments sent as JSON
    text) and a tool result equals transformers' apply_chat_template on the same
    conversation, which takes the arguments as an object."""
    import msgspec
    import transformers

    from ksana_jax.tokenizer import Tokenizer
    from server import schemas as s
    from server.chat import chat_text
    from tests.conftest import write_tiny_tokenizer

    write_tiny_tokenizer(tmp_path, chat_template=HERMES_TEMPLATE)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    arguments = {"city": "Paris", "note": "caf\u00e9"}
    body = {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": json.dumps(arguments)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        ],
        "tools": tools,
    }
    got = chat_text(Tokenizer.from_dir(tmp_path), msgspec.convert(body, s.ChatCompletionRequest))
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    messages = [dict(m) for m in body["messages"]]
    messages[1] = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": arguments},
            }
        ],
    }
    want = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert got == want
    assert '"arguments": {"city": "Paris", "note": "caf\u00e9"}' in got
    assert "<tool_response>" in got and '"name": "get_weather"' in got
    assert parser_for_template(HERMES_TEMPLATE) == "hermes"

"""Tool calls in a model's text, per model family, and the streams that carry them.

    in:  the text a chat choice generated (whole, or its deltas as they come)
    out: (content, calls): the text that is not a tool call, and ToolCall(name, arguments as
         JSON text) for each call the model wrote; text that does not parse stays content

Parsers, chosen by `--tool-call-parser` or from the chat template (`parser_for_template`):

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one block a call
                 (Qwen2.5, Qwen3, SmolLM2, Hermes, NousResearch templates)
    llama3_json  {"name": ..., "parameters": {...}} as the whole answer, optionally after
                 <|python_tag|>, several joined by ";" (Llama 3.1 / 3.2 / 3.3)

A malformed call (bad JSON, no name, an unfinished block) leaves the whole text as content,
as vLLM's parsers do; text around well-formed Hermes blocks stays content. `tool_choice`
"required" and a named function do not parse the model's format: their output is
constrained to JSON (server/tools.py) and read by `required_calls` / as the arguments.

Streaming (`ToolCallStream`): content streams as it comes until a tool call may start; from
there the text is held and parsed when the choice finishes, each call sent as OpenAI sends
one (a delta with index, id, type and name and empty arguments, then the arguments).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Protocol


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = dataclasses.field(default_factory=call_id)


class ToolParser(Protocol):
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content or None, calls); no calls: the text is all content."""
        ...

    def hold_from(self, text: str) -> int:
        """Where a call may start in a partial answer (streaming sends content up to here
        and holds the rest); len(text) when none may."""
        ...


def _call(obj: object, arguments_keys: tuple[str, ...]) -> ToolCall | None:
    """A ToolCall from a decoded {"name": str, <arguments key>: object}, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in arguments_keys if k in obj), None)
    arguments = {} if key is None else obj[key]
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


class HermesParser:
    start = "<tool_call>"
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        head, sep, _ = text.partition(self.start)
        if not sep:
            return text, []
        rest = text[len(head) :]
        calls = []
        for match in self._block.finditer(rest):
            try:
                call = _call(json.loads(match.group(1)), ("arguments", "parameters"))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        outside = self._block.sub("", rest)
        if not calls or self.start in outside:  # a block never closed
            return text, []
        # Text around the blocks stays content (as vLLM keeps the text before them).
        content = "\n".join(part.strip() for part in (head, outside) if part.strip())
        return content or None, calls

    def hold_from(self, text: str) -> int:
        at = text.find(self.start)
        if at >= 0:
            return at
        # An end that may be the first characters of a start tag.
        for k in range(min(len(self.start) - 1, len(text)), 0, -1):
            if text.endswith(self.start[:k]):
                return len(text) - k
        return len(text)


class Llama3JsonParser:
    _tag = "<|python_tag|>"

    def hold_from(self, text: str) -> int:
        body = text.lstrip()
        # A JSON call is the whole answer: hold an answer that starts (or may start) as one.
        if not body or body.startswith(("{", self._tag)) or self._tag.startswith(body):
            return 0
        return len(text)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        body = body.removeprefix(self._tag).strip()
        if not body.startswith("{"):
            return text, []
        decoder = json.JSONDecoder()
        calls, at = [], 0
        while at < len(body):
            try:
                obj, end = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return text, []
            call = _call(obj, ("parameters", "arguments"))
            if call is None:
                return text, []
            calls.append(call)
            at = end
            while at < len(body) and body[at] in " \t\n;":
                at += 1
        return None, calls


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def parser_for_template(template: str | None) -> str:
    """The parser a chat template's own tool-call format needs: Llama 3's JSON where the
    template speaks of <|python_tag|> or "parameters", else Hermes-style blocks (also the
    choice for templates that say nothing of tools, such as SmolLM2's)."""
    text = template or ""
    if "<tool_call>" in text:
        return "hermes"
    if "<|python_tag|>" in text or '"parameters"' in text:
        return "llama3_json"
    return "hermes"


def required_calls(text: str) -> list[ToolCall] | None:
    """The calls of a `tool_choice: "required"` answer: a JSON array of
    {"name", "parameters"} (the grammar's shape, as vLLM's); None if it does not parse."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = [_call(item, ("parameters",)) for item in items]
    return None if any(c is None for c in calls) else calls


@dataclasses.dataclass
class StreamDelta:
    """What one chunk of a streamed choice carries: content and/or tool-call deltas."""

    content: str = ""
    calls: list[dict] = dataclasses.field(default_factory=list)  # OpenAI's delta.tool_calls


def call_deltas(calls: list[ToolCall]) -> list[dict]:
    """OpenAI's streamed form of whole calls: per call a head (index, id, type, name, empty
    arguments), then its arguments."""
    deltas = []
    for i, call in enumerate(calls):
        deltas.append(
            {
                "index": i,
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": ""},
            }
        )
        deltas.append({"index": i, "function": {"arguments": call.arguments}})
    return deltas


class ToolCallStream:
    """One streamed choice under "auto": content until a call may start (the parser's
    `hold_from`), then held text that is parsed when the choice finishes."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""  # everything so far
        self.sent = 0  # chars of `text` sent as content

    def feed(self, delta: str) -> StreamDelta:
        self.text += delta
        end = max(self.sent, self.parser.hold_from(self.text))
        out, self.sent = self.text[self.sent : end], end
        return StreamDelta(out)

    def finish(self) -> StreamDelta:
        """At the choice's end: the held text as calls, or as content if it does not parse."""
        held, self.sent = self.text[self.sent :], len(self.text)
        if not held:
            return StreamDelta()
        content, calls = self.parser.parse(held)  # what was sent is content before a call
        if not calls:
            return StreamDelta(held)
        return StreamDelta(content or "", call_deltas(calls))

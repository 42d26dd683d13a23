"""A chat request's tools and the shape of its answer: what the chat template gets, the
constraint `tool_choice` asks for, and each choice's text made into a message (content,
reasoning_content, tool_calls), whole or streamed.

    in:  `tools` [{"type": "function", "function": {name, description, parameters}}],
         `tool_choice` ("none" | "auto" | "required" | {"type": "function",
         "function": {"name"}}; default "auto" with tools, else "none"),
         `parallel_tool_calls`, and the server's --tool-call-parser / --reasoning-parser
    out: an Answer: its constraint (StructuredOutputsParams or None) and, per choice, a
         message or a stream of deltas

As vLLM does, a named function constrains the output to JSON of its `parameters` schema,
which is the call's arguments; "required" constrains it to a JSON array of
{"name", "parameters"} items, one per call (at most one without parallel_tool_calls); both
always give arguments that validate. "auto" lets the model write its own format, which the
family's parser reads (tool_parsers.py). A choice that made calls and stopped finishes with
"tool_calls".
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ksana_jax.sampling_params import StructuredOutputsParams
from server import schemas as s
from server.errors import APIError
from server.reasoning import ThinkParser
from server.tool_parsers import (
    PARSERS,
    ToolCall,
    ToolCallStream,
    ToolParser,
    call_deltas,
    required_calls,
)

_ANY_OBJECT = {"type": "object"}


def _check_tools(tools: list[dict[str, Any]]) -> dict[str, dict]:
    """name -> parameters schema; a malformed tool is a 400 naming it."""
    found: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise APIError(400, f'{where}.type must be "function"', param=f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise APIError(400, f"{where}.function must be an object", param=f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(
                400,
                f"{where}.function.name must be a non-empty string",
                param=f"{where}.function.name",
            )
        parameters = function.get("parameters", _ANY_OBJECT)
        if not isinstance(parameters, dict):
            raise APIError(
                400,
                f"{where}.function.parameters must be a JSON schema object",
                param=f"{where}.function.parameters",
            )
        if name in found:
            raise APIError(
                400,
                f"{where}.function.name {name!r} is the name of an earlier tool",
                param=f"{where}.function.name",
            )
        found[name] = parameters or _ANY_OBJECT
    return found


def _mode(tool_choice: str | dict | None, functions: dict[str, dict]) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "named", the named function)."""
    if tool_choice is None:
        return ("auto" if functions else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise APIError(
                400,
                f'tool_choice must be "none", "auto", "required" or {{"type": "function", '
                f'"function": {{"name": ...}}}}, got {tool_choice!r}',
                param="tool_choice",
            )
        if tool_choice != "none" and not functions:
            raise APIError(400, f'tool_choice "{tool_choice}" needs tools', param="tool_choice")
        return tool_choice, None
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if tool_choice.get("type") != "function" or not isinstance(name, str):
        raise APIError(
            400,
            'tool_choice as an object must be {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in functions:
        raise APIError(
            400,
            f"tool_choice names the function {name!r}, which is not in tools ({sorted(functions)})",
            param="tool_choice",
        )
    return "named", name


def _required_schema(functions: dict[str, dict], parallel: bool) -> dict:
    """vLLM's schema for "required": an array of {"name": one tool, "parameters": its args}."""
    items = [
        {
            "type": "object",
            "properties": {"name": {"enum": [name]}, "parameters": parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, parameters in functions.items()
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


@dataclasses.dataclass(frozen=True)
class Answer:
    """How one chat request's choices become messages."""

    mode: str = "none"  # "none" | "auto" | "required" | "named"
    function: str | None = None  # the named function
    parser: ToolParser | None = None  # "auto"
    reasoning: ThinkParser | None = None
    constraint: StructuredOutputsParams | None = None  # "required" / "named"
    constraint_field: str = "tools"  # what an invalid constraint is named as in a 400

    @classmethod
    def of(
        cls,
        data: s.ChatCompletionRequest,
        tool_parser: str,
        reasoning: ThinkParser | None,
        constrained: bool,
    ) -> Answer:
        """The request's answer shape; `constrained`: it has its own response_format or
        structured_outputs (which a forced tool call cannot be combined with)."""
        functions = _check_tools(data.tools or [])
        mode, function = _mode(data.tool_choice, functions)
        constraint, field = None, "tools"
        if mode == "named":
            constraint = StructuredOutputsParams(json=functions[function])
            field = f"tools[{list(functions).index(function)}].function.parameters"
        elif mode == "required":
            parallel = data.parallel_tool_calls is not False
            constraint = StructuredOutputsParams(json=_required_schema(functions, parallel))
        if constraint is not None and constrained:
            raise APIError(
                400,
                f"tool_choice {data.tool_choice!r} constrains the output itself; it cannot be "
                "combined with response_format or structured_outputs",
                param="tool_choice",
            )
        parser = PARSERS[tool_parser]() if mode == "auto" else None
        return cls(mode, function, parser, reasoning, constraint, field)

    def _calls(self, content: str | None) -> tuple[str | None, list[ToolCall]]:
        if self.mode == "none" or content is None:
            return content, []
        if self.mode == "named":
            try:
                ok = isinstance(json.loads(content), dict)
            except json.JSONDecodeError:
                ok = False
            return (None, [ToolCall(self.function, content)]) if ok else (content, [])
        if self.mode == "required":
            calls = required_calls(content)
            return (None, calls) if calls else (content, [])
        return self.parser.parse(content)

    def message(
        self, text: str, finish_reason: str | None
    ) -> tuple[s.AssistantMessage, str | None]:
        """A whole choice's message and its finish reason."""
        reasoning, content = self.reasoning.parse(text) if self.reasoning else (None, text)
        content, calls = self._calls(content)
        if not calls:
            return s.AssistantMessage(content or "", reasoning_content=reasoning), finish_reason
        tool_calls = [s.ToolCallOut(c.id, s.FunctionCall(c.name, c.arguments)) for c in calls]
        reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return s.AssistantMessage(
            content, tool_calls=tool_calls, reasoning_content=reasoning
        ), reason

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


class ChoiceStream:
    """One streamed choice: its text deltas as Delta fields (reasoning_content, content,
    tool_calls). A named function's arguments stream as they come; "required" answers are
    held and sent as calls at the end; "auto" holds text from where a call may start."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.reasoning = answer.reasoning.stream() if answer.reasoning else None
        self.auto = ToolCallStream(answer.parser) if answer.mode == "auto" else None
        self.held = ""  # "required"
        self.call: ToolCall | None = None  # "named": its head is sent
        self.made_calls = False

    def feed(self, text: str) -> s.Delta | None:
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        return self._delta(reasoning, content)

    def finish(self, finish_reason: str | None) -> tuple[s.Delta | None, str | None]:
        """What was held, at the choice's end, and its finish reason."""
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        delta = self._delta(reasoning, content, final=True)
        if self.made_calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return delta, finish_reason

    def _delta(self, reasoning: str, content: str, final: bool = False) -> s.Delta | None:
        mode, calls = self.answer.mode, []
        if mode == "named" and content:
            if self.call is None:
                self.call = ToolCall(self.answer.function, "")
                calls = call_deltas([self.call])[:1]
                self.made_calls = True
            calls.append({"index": 0, "function": {"arguments": content}})
            content = ""
        elif mode == "required":
            self.held += content
            content = ""
            if final:
                found = required_calls(self.held)
                if found:
                    calls, self.made_calls = call_deltas(found), True
                else:
                    content = self.held
        elif mode == "auto":
            out = self.auto.feed(content)
            if final:
                end = self.auto.finish()
                out.content += end.content
                out.calls, self.made_calls = end.calls, bool(end.calls)
            content, calls = out.content, out.calls
        if not (reasoning or content or calls):
            return None
        return s.Delta(
            content=content or None, reasoning_content=reasoning or None, tool_calls=calls or None
        )


def template_messages(messages: list[s.ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates read them (Hugging Face's conventions): text parts joined,
    an assistant's tool calls with their arguments decoded (templates write them with
    `tojson`), a tool result with its tool_call_id."""
    out = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": _decoded(c.function.arguments),
                    },
                }
                for c in m.tool_calls
            ]
        out.append(message)
    return out


def _decoded(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments

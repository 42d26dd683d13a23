"""Reasoning text (`<think>...</think>`) split from a chat answer's content.

    in:  the text a chat choice generated (whole, or its deltas as they come)
    out: (reasoning_content, content), each None when empty; streamed, per delta the
         reasoning part and the content part

`--reasoning-parser`, as vLLM names them:

    qwen3        <think>reasoning</think>content; an answer without both tags is all content
                 (Qwen3 with thinking off writes no tags)
    deepseek_r1  the template opens <think> in the prompt, so the answer may start inside
                 it: everything before </think> is reasoning (an opening tag is dropped), and
                 an answer without </think> is all reasoning (cut off while thinking)
"""

from __future__ import annotations

START, END = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


class ThinkParser:
    def __init__(self, name: str) -> None:
        if name not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got {name!r}")
        self.name = name
        # deepseek_r1: the answer starts inside <think> (the prompt opened it)
        self.starts_inside = name == "deepseek_r1"

    def parse(self, text: str) -> tuple[str | None, str | None]:
        body = text.lstrip()
        opened = body.startswith(START)
        body = body[len(START) :] if opened else text
        reasoning, closed, content = body.partition(END)
        if not closed:
            if self.starts_inside:
                return body or None, None
            return None, text or None
        if not (opened or self.starts_inside):
            return None, text or None
        return reasoning or None, content or None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


class ReasoningStream:
    """One streamed choice: reasoning deltas until </think>, then content deltas (a partial
    tag is held until the next delta tells what it is)."""

    def __init__(self, parser: ThinkParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0
        self.phase = "start"  # -> "reasoning" -> "content"

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) that `delta` adds."""
        self.text += delta
        reasoning = ""
        if self.phase == "start":
            body = self.text.lstrip()
            if body.startswith(START):
                self.sent = len(self.text) - len(body) + len(START)
                self.phase = "reasoning"
            elif START.startswith(body):  # may still become <think>
                return "", ""
            else:
                self.phase = "reasoning" if self.parser.starts_inside else "content"
        if self.phase == "reasoning":
            at = self.text.find(END, self.sent)
            if at < 0:
                end = max(self.sent, len(self.text) - _partial_suffix(self.text, END))
                reasoning, self.sent = self.text[self.sent : end], end
                return reasoning, ""
            reasoning, self.sent, self.phase = self.text[self.sent : at], at + len(END), "content"
        content, self.sent = self.text[self.sent :], len(self.text)
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held at the end: a partial tag, as text of the phase it was in."""
        held, self.sent = self.text[self.sent :], len(self.text)
        return (held, "") if self.phase == "reasoning" else ("", held)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0

"""Logprobs in OpenAI's two shapes, from a choice's tokens (a delta or a whole output).

    in:  a CompletionOutput's token ids, its per-token {token id: logprob} (top-N first, then
         the sampled token) and, for completions, each token's offset in the choice's text
         (the engine reads it off the same detokenizer that makes the text)
    out: CompletionLogprobs (tokens, token_logprobs, top_logprobs, text_offset) or
         ChoiceLogprobs (chat: per token its text, logprob, bytes and top alternatives)

The same function serves a streamed delta and a whole response, so the chunks of a stream
join to exactly what the whole response holds.
"""

from __future__ import annotations

from ksana_jax.outputs import CompletionOutput
from ksana_jax.tokenizer import Tokenizer
from server import schemas as s


def token_text(tokenizer: Tokenizer, token_id: int) -> tuple[str, bytes]:
    """A token's text and raw bytes, for logprobs. A token holding part of a UTF-8
    character reads "bytes:\\xf0\\x9f" (escaped), its bytes exact: joined, the bytes of a
    choice's tokens rebuild its text."""
    raw = tokenizer.token_bytes(token_id)
    try:
        return raw.decode(), raw
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


def completion_logprobs(
    tokenizer: Tokenizer, choice: CompletionOutput, n_top: int, text_start: int
) -> s.CompletionLogprobs:
    """`text_start`: where the choice's text starts in the response's (after an echo)."""
    texts, lps, tops = [], [], []
    for token_id, entry in zip(choice.token_ids, choice.logprobs, strict=True):
        texts.append(token_text(tokenizer, token_id)[0])
        lps.append(entry[token_id])
        tops.append({token_text(tokenizer, i)[0]: lp for i, lp in list(entry.items())[:n_top]})
    offsets = [text_start + offset for offset in choice.text_offsets]
    return s.CompletionLogprobs(texts, lps, tops, offsets)


def chat_logprobs(tokenizer: Tokenizer, choice: CompletionOutput, n_top: int) -> s.ChoiceLogprobs:
    content = []
    for token_id, entry in zip(choice.token_ids, choice.logprobs, strict=True):
        top = []
        for i, lp in list(entry.items())[:n_top]:
            text, raw = token_text(tokenizer, i)
            top.append(s.TopLogprob(text, lp, list(raw)))
        text, raw = token_text(tokenizer, token_id)
        content.append(s.TokenLogprob(text, entry[token_id], list(raw), top))
    return s.ChoiceLogprobs(content)

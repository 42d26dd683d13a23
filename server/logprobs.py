"""Logprobs in OpenAI's two shapes, from a choice's tokens (a delta or a whole output).

    in:  a CompletionOutput's token ids, its per-token {token id: logprob} (top-N first, then
         the sampled token) and, for completions, each token's offset in the choice's text
         (the engine reads it off the same detokenizer that makes the text); for an echoed
         prompt, the engine's prompt logprobs (per prompt token None or {id: Logprob})
    out: CompletionLogprobs (tokens, token_logprobs, top_logprobs, text_offset) or
         ChoiceLogprobs (chat: per token its text, logprob, bytes and top alternatives)

The same function serves a streamed delta and a whole response, so the chunks of a stream
join to exactly what the whole response holds. Completions' top_logprobs hold the top N and
the chosen token (N + 1 entries when it is not among them), as OpenAI's legacy API and vLLM;
an echoed prompt's first token has no logprob: null in token_logprobs and top_logprobs.
"""

from __future__ import annotations

from ksana_jax.outputs import CompletionOutput, PromptLogprobs
from ksana_jax.tokenizer import IncrementalDetokenizer, Tokenizer
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
        # The engine's entry holds the top n_top (SamplingParams.logprobs) and the chosen one.
        tops.append({token_text(tokenizer, i)[0]: lp for i, lp in entry.items()})
    offsets = [text_start + offset for offset in choice.text_offsets]
    return s.CompletionLogprobs(texts, lps, tops, offsets)


def echo_logprobs(
    tokenizer: Tokenizer, prompt_ids: list[int], prompt_logprobs: PromptLogprobs
) -> s.CompletionLogprobs:
    """An echoed prompt's tokens in the legacy shape: the first has null logprobs, each other
    its logprob given the tokens before it and, as top_logprobs, itself and the top N (the
    engine's entry). Text offsets are into the decoded prompt, by the incremental detokenizer
    that places generated tokens (the decode of a window at a time: linear in the length)."""
    texts, lps, tops, offsets = [], [], [], []
    detok = IncrementalDetokenizer(tokenizer, (), skip_special_tokens=False)
    for token_id, entry in zip(prompt_ids, prompt_logprobs, strict=True):
        texts.append(token_text(tokenizer, token_id)[0])
        offsets.append(detok.num_chars)
        detok.add(token_id)
        if entry is None:
            lps.append(None)
            tops.append(None)
        else:
            lps.append(entry[token_id].logprob)
            tops.append({token_text(tokenizer, i)[0]: lp.logprob for i, lp in entry.items()})
    return s.CompletionLogprobs(texts, lps, tops, offsets)


def joined(first: s.CompletionLogprobs, then: s.CompletionLogprobs) -> s.CompletionLogprobs:
    """The tokens of `first` followed by those of `then` (an echoed prompt, then output)."""
    return s.CompletionLogprobs(
        first.tokens + then.tokens,
        first.token_logprobs + then.token_logprobs,
        first.top_logprobs + then.top_logprobs,
        first.text_offset + then.text_offset,
    )


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

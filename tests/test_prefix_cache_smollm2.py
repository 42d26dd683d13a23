"""Prefix cache on the real model: SmolLM2 chats sharing a system prompt give the same greedy
tokens with the cache on and off, and the later ones are served mostly from cached pages."""

from __future__ import annotations

import pytest

from ksana_jax import LLM, SamplingParams

CONFIG = dict(
    max_model_len=256,
    page_size=16,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    token_buckets=(16, 64),
    seq_buckets=(4,),
    context_buckets=(64, 256),
)
SYSTEM = (
    "You are a careful assistant for a small bakery. Answer in one short sentence, "
    "mention prices in euros, and never invent opening hours."
)
QUESTIONS = ["How much is a croissant?", "Do you sell bread?", "What is in a baguette?"]
GREEDY = SamplingParams(temperature=0, max_tokens=12)


def chat_prompts(tokenizer) -> list[list[int]]:
    prompts = []
    for question in QUESTIONS:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(messages)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


@pytest.fixture(scope="module")
def prompts(smollm2):
    shared = chat_prompts(smollm2.tokenizer)
    # The system part alone, cut on a page boundary: a prompt that is a prefix of the others.
    common = next(i for i, ts in enumerate(zip(*shared, strict=False)) if len(set(ts)) > 1)
    assert common >= 32
    return [*shared, shared[0][: common // 16 * 16]]


def test_smollm2_greedy_equal_with_cache_on_and_off(smollm2, prompts):
    runs = {}
    for caching in (False, True):
        llm = LLM(smollm2, warm_up=False, enable_prefix_caching=caching, **CONFIG)
        first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
        runs[caching] = [o.outputs[0].token_ids for o in first + rest], llm.engine.stats
    (want, _), (got, stats) = runs[False], runs[True]
    for prompt, g, w in zip(prompts, got, want, strict=True):
        if g != w:  # equal unless the reference met a true float tie
            i = next(k for k, (a, b) in enumerate(zip(g, w, strict=False)) if a != b)
            top2 = sorted(smollm2.logits(prompt + w[:i])[-1])[-2:]
            assert top2[1] - top2[0] < 1e-3, (i, g, w)
    # Every later prompt found the system prompt's full pages cached.
    common = len(prompts[-1])
    assert stats.prefix_cache_hits >= 2 * common + (common - 16)
    assert stats.prefix_cache_queries == sum(len(p) for p in prompts)

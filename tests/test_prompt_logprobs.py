"""Prompt logprobs through the whole engine path on a tiny random model, against
transformers' float32 logits: whole prefills, small chunks, a small scored-position budget,
async scheduling, preemption, n > 1 and prefix-cache hits (the request recomputes its prompt
and still fills the cache for others). Also logit_bias, which rides the same per-slot rows."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from conftest import TINY_VOCAB, hf_logits, write_tiny_hf

import ksana_jax
from ksana_jax import LLM, SamplingParams

TOL = 1e-4  # float32, against transformers
RNG = np.random.default_rng(23)
PROMPTS = [[int(t) for t in RNG.integers(3, TINY_VOCAB, n)] for n in (1, 2, 19, 45, 70)]
BASE = dict(
    max_model_len=256,
    page_size=4,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    context_buckets=(64, 256),
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(our model, transformers' model) of the same tiny random checkpoint."""
    path = tmp_path_factory.mktemp("tiny") / "hf"
    hf = write_tiny_hf(path, initializer_range=0.2, eos_token_id=None)
    return ksana_jax.load(path), hf


def reference(hf, prompt) -> np.ndarray:
    """transformers' log_softmax f64[len(prompt), V] at every prompt position."""
    logits = torch.tensor(hf_logits(hf, prompt), dtype=torch.float64)
    return torch.log_softmax(logits, dim=-1).numpy()


def assert_prompt_logprobs(got, prompt, want: np.ndarray, k: int) -> None:
    """vLLM's shape (first None, then a dict per token holding it and the top k), each
    logprob within TOL of `want`, ranks right (up to float ties), the top k the reference's."""
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        ref, token, entry = want[i - 1], prompt[i], got[i]
        assert token in entry and k <= len(entry) <= k + 1
        for tid, lp in entry.items():
            assert abs(lp.logprob - ref[tid]) < TOL, (i, tid, lp, ref[tid])
            assert lp.decoded_token == ["<unk>", "<s>", "</s>"][tid] if tid < 3 else f"w{tid}"
        higher = (ref > ref[token] + TOL).sum(), (ref > ref[token] - TOL).sum()
        assert higher[0] + 1 <= entry[token].rank <= higher[1] + 1
        top = sorted((lp.rank, tid) for tid, lp in entry.items() if tid != token or lp.rank <= k)
        assert [rank for rank, _ in top] == list(range(1, k + 1))
        np.testing.assert_allclose(
            [entry[tid].logprob for _, tid in top], np.sort(ref)[::-1][:k], atol=TOL
        )


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # all prompts in one or two steps
        {"max_num_batched_tokens": 16, "token_buckets": (16,)},  # chunks of 16
        # 5 positions a step: prompt-logprob prefills cut to chunks of 5, the others not
        {"max_num_scored_tokens": 5, "async_scheduling": True},
        {"num_pages": 25, "max_model_len": 96, "context_buckets": (32, 96)},  # preemption
    ],
    ids=["batched", "chunks16", "scored5_async", "preemption"],
)
def test_prompt_logprobs_match_transformers(tiny, overrides):
    model, hf = tiny
    llm = LLM(model, warm_up=False, **(BASE | overrides))
    ks = [3, 0, None, 5, 2]  # a request without prompt logprobs among them
    params = [
        SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=k, ignore_eos=True) for k in ks
    ]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, k, out in zip(PROMPTS, ks, outs, strict=True):
        if k is None:
            assert out.prompt_logprobs is None
        else:
            assert_prompt_logprobs(out.prompt_logprobs, prompt, reference(hf, prompt), k)
    if "num_pages" in overrides:
        assert llm.engine.stats.preemptions > 0


def test_prompt_logprobs_recompute_a_cached_prefix_and_fill_the_cache(tiny):
    """A prompt whose prefix is cached is recomputed (its positions need logits) and is
    exact; its own pages then serve others' cache hits: with n = 2 the second sample finds
    the first's prompt pages. The prompt logprobs come once, from the first sample."""
    model, hf = tiny
    llm = LLM(model, warm_up=False, **BASE)
    shared = PROMPTS[4][:48]
    first, second = shared + PROMPTS[2][:9], shared + PROMPTS[3][:9]  # 57 tokens each
    stats = llm.engine.stats
    llm.generate([first], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert stats.prefix_cache_hits == 0 and stats.prefix_cache_queries == 57
    params = SamplingParams(n=2, temperature=0.8, max_tokens=3, prompt_logprobs=1)
    out = llm.generate([second], params, use_tqdm=False)[0]
    # The first sample took none of the 48 cached tokens; the second took the first's 56.
    assert stats.prefix_cache_hits == 56
    assert_prompt_logprobs(out.prompt_logprobs, second, reference(hf, second), 1)
    assert len(out.outputs) == 2 and all(len(c.token_ids) == 3 for c in out.outputs)


def test_prompt_logprobs_arrive_once_in_the_first_delta(tiny):
    """The engine's delta outputs carry the prompt logprobs once, with the first token."""
    model, _ = tiny
    llm = LLM(model, warm_up=False, **(BASE | {"max_num_batched_tokens": 16}))
    engine = llm.engine
    engine.add_request("r", PROMPTS[3], SamplingParams(max_tokens=3, prompt_logprobs=0))
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    assert [d.prompt_logprobs is not None for d in deltas] == [True, False, False]
    assert [len(d.outputs[0].token_ids) for d in deltas] == [1, 1, 1]


def test_bad_prompt_logprobs_and_logit_bias_are_value_errors_naming_the_field(tiny):
    model, _ = tiny
    engine = LLM(model, warm_up=False, **(BASE | {"max_logprobs": 4})).engine
    cases = [
        (SamplingParams(prompt_logprobs=5), r"prompt_logprobs must be <= max_logprobs \(4\)"),
        (SamplingParams(logit_bias={TINY_VOCAB: 1.0}), "logit_bias token ids"),
    ]
    for params, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.add_request("bad", PROMPTS[2], params)
    assert not engine.has_unfinished_requests()


def test_logit_bias_forces_and_bans_tokens_without_touching_other_rows(tiny):
    model, _ = tiny
    llm = LLM(model, warm_up=False, **BASE)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[2:], greedy, use_tqdm=False)]
    favourite = plain[0][0]
    forced = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={7: 100})
    banned = SamplingParams(
        temperature=0.9, seed=4, max_tokens=6, ignore_eos=True, logit_bias={favourite: -100}
    )
    outs = llm.generate(
        [PROMPTS[2], PROMPTS[2], PROMPTS[3], PROMPTS[2], PROMPTS[4]],
        [forced, banned, greedy, dataclasses.replace(greedy, logit_bias={favourite: -100}), greedy],
        use_tqdm=False,
    )
    tokens = [o.outputs[0].token_ids for o in outs]
    assert tokens[0] == [7] * 6
    assert favourite not in tokens[1] and favourite not in tokens[3]
    logits = np.array(model.logits(PROMPTS[2])[-1])
    logits[favourite] = -np.inf
    assert tokens[3][0] == int(np.argmax(logits))  # the next best, greedy
    assert tokens[2] == plain[1] and tokens[4] == plain[2]  # rows without a bias: unchanged


@pytest.mark.slow
def test_smollm2_prompt_logprobs_match_transformers(smollm2, hf_smollm2):
    """The real model, one short prompt in chunks of 16: within 1e-3 of transformers."""
    hf_model, hf_tok = hf_smollm2
    prompt = hf_tok("The capital of France is Paris, and the capital of Italy is")["input_ids"]
    llm = LLM(
        smollm2,
        warm_up=False,
        max_model_len=128,
        max_num_seqs=2,
        max_num_batched_tokens=16,
        context_buckets=(128,),
    )
    params = SamplingParams(max_tokens=1, prompt_logprobs=2)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    want = reference(hf_model, prompt)
    got = out.prompt_logprobs
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        for tid, lp in got[i].items():
            assert abs(lp.logprob - want[i - 1, tid]) < 1e-3, (i, tid)
        ref = want[i - 1]
        assert got[i][prompt[i]].rank == 1 + (ref > ref[prompt[i]]).sum()
        assert set(got[i]) >= set(np.argsort(ref)[-2:])

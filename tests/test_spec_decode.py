"""Speculative decoding (n-gram prompt lookup): configuration errors, the proposer, outputs
equal to those without speculation (greedy and seeded sampling, on SmolLM2 and a tiny model,
with chunked prefill, prefix-cache hits, preemption, stop strings, n > 1, logprobs and the
async scheduler), the verified tokens' distribution against an exact one, and no
compilation after warm-up."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from conftest import TINY_VOCAB, write_tiny_hf
from workloads import record_compilations, run_varied_workload

import ksana_jax
from ksana_jax import LLM, SamplingParams
from ksana_jax.cli import build_parser
from ksana_jax.config import EngineConfig
from ksana_jax.spec_decode import ngram_proposal
from ksana_jax.step_programs import compile_count

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}  # fmt: skip


@pytest.mark.parametrize(
    "spec, option",
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookup": 3}, "unknown keys"),
        ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
        ({"method": "ngram", "model": "/some/draft"}, "speculative_config.model"),
        ("ngram", "must be a dict"),
    ],
)
def test_bad_speculative_config_names_the_option(spec, option):
    with pytest.raises(ValueError, match=option):
        EngineConfig(speculative_config=spec)


def test_serve_flag_takes_json():
    args = build_parser().parse_args(
        ["serve", "demo", "--speculative-config", '{"num_speculative_tokens": 3}']
    )
    assert args.speculative_config == {"num_speculative_tokens": 3}
    draft = '{"model": "/ckpt/small", "num_speculative_tokens": 2}'
    args = build_parser().parse_args(["serve", "demo", "--speculative-config", draft])
    assert EngineConfig(speculative_config=args.speculative_config).speculative.method == (
        "draft_model"
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "demo", "--speculative-config", "[1]"])


def test_ngram_proposal_takes_the_longest_recent_match():
    tokens = np.array([5, 1, 2, 3, 9, 1, 2, 3, 7, 8, 4, 2, 3])
    # suffix [2, 3] (n=2) last occurred at 6..7, followed by 7, 8, 4
    assert ngram_proposal(tokens, 3, 2, 4).tolist() == [7, 8, 4]
    tokens = np.array([1, 2, 3, 4, 0, 2, 3, 5, 1, 2, 3])
    # suffix [1, 2, 3] (n=3) beats the more recent [2, 3] match
    assert ngram_proposal(tokens, 2, 2, 4).tolist() == [4, 0]
    assert ngram_proposal(np.array([1, 2, 3, 4]), 3, 1, 4).tolist() == []


# ------------------------------------------------------------------ SmolLM2, greedy

TEXT = (
    "The committee met on Tuesday to review the budget. Members agreed that the library "
    "needs new shelves, that the park benches must be repainted before summer, and that the "
    "town hall roof should be inspected by a qualified engineer within two months."
)


def _chat(tokenizer, content: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": content}]))


@pytest.fixture(scope="module")
def smollm2_runs(smollm2):
    """One mixed batch through SmolLM2 with and without speculation, in a small KV pool
    (preemption) and 32-token steps (chunked prefill), prefix caching on."""
    tok = smollm2.tokenizer
    copy = _chat(tok, "Repeat this text exactly:\n" + TEXT)
    edit = _chat(tok, "Rewrite this text with 'Tuesday' replaced by 'Friday':\n" + TEXT)
    prompts = [
        copy,
        edit,
        copy,  # a prefix-cache hit on the first
        _chat(tok, "Write a short poem about the sea."),
        _chat(tok, "Repeat this text exactly:\n" + TEXT[:120]),
    ]
    greedy = SamplingParams(temperature=0, max_tokens=48)
    params = [
        greedy,
        SamplingParams(temperature=0, max_tokens=48, logprobs=2),
        SamplingParams(temperature=0, max_tokens=48, stop=["park benches"]),
        greedy,
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, n=2, max_tokens=40),
    ]
    config = dict(
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        num_pages=20,
        page_size=16,
        warm_up=False,
    )
    runs = {}
    for name, spec in (("plain", None), ("ngram", NGRAM)):
        llm = LLM(smollm2, speculative_config=spec, **config)
        runs[name] = (llm.generate(prompts, params, use_tqdm=False), llm.engine)
    return runs


def test_smollm2_outputs_equal_without_speculation(smollm2_runs):
    plain, _ = smollm2_runs["plain"]
    ngram, engine = smollm2_runs["ngram"]
    for want, got in zip(plain, ngram, strict=True):
        for w, g in zip(want.outputs, got.outputs, strict=True):
            assert g.token_ids == w.token_ids
            assert g.text == w.text and g.finish_reason == w.finish_reason
            if w.logprobs is not None:
                for a, b in zip(w.logprobs, g.logprobs, strict=True):
                    assert a.keys() == b.keys()
                    for t in a:
                        assert abs(a[t] - b[t]) < 1e-3
    assert ngram[2].outputs[0].finish_reason == "stop"  # the stop string inside a copy
    assert engine.stats.preemptions > 0
    assert engine.stats.prefix_cache_hits > 0
    spec = engine.speculator
    assert spec.num_accepted > 0 and spec.num_drafted >= spec.num_accepted
    # fewer steps than tokens: proposals were accepted
    assert engine.stats.steps < smollm2_runs["plain"][1].stats.steps


# ------------------------------------------------------------------ tiny model

BASE = dict(
    max_model_len=256,
    page_size=4,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    context_buckets=(64, 256),
)
LOOKUP_1 = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2, "disable_by_batch_size": 32}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_written(tmp_path_factory):
    """The tiny model's directory, and transformers' model (the reference)."""
    path = tmp_path_factory.mktemp("tiny-spec") / "hf"
    return path, write_tiny_hf(path, initializer_range=0.2, eos_token_id=None)


@pytest.fixture(scope="module")
def tiny_pair(tiny_written):
    """The tiny model, and transformers' own (the reference)."""
    path, hf = tiny_written
    return ksana_jax.load(path), hf


@pytest.fixture(scope="module")
def tiny_model(tiny_pair):
    return tiny_pair[0]


def _repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        motif = [int(t) for t in rng.integers(3, TINY_VOCAB, int(rng.integers(3, 9)))]
        out.append((motif * 8)[: int(rng.integers(20, 60))])
    return out


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_tiny_seeded_sampling_equals_without(tiny_model, async_scheduling):
    """Each verified token is the target's own seeded draw: sampled outputs are the same
    token for token, with the async scheduler too."""
    prompts = _repetitive_prompts(6)
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=3, max_tokens=20, logprobs=1),
        SamplingParams(temperature=1.0, top_k=20, seed=5, n=2, max_tokens=20),
    ] * 2
    want = LLM(tiny_model, warm_up=False, **BASE).generate(prompts, params, use_tqdm=False)
    llm = LLM(
        tiny_model,
        warm_up=False,
        speculative_config=LOOKUP_1,
        async_scheduling=async_scheduling,
        **BASE,
    )
    got = llm.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
    assert llm.engine.speculator.num_accepted > 0


def test_turned_down_rows_let_async_steps_overlap(tiny_model):
    """Random prompts: n-gram lookup keeps missing, each row's acceptance falls below
    min_acceptance, and from then on the async engine overlaps steps (a step is still in
    flight when `step` returns) with the same tokens as without speculation."""
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(3, TINY_VOCAB, 24)] for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = LLM(tiny_model, warm_up=False, **BASE).generate(prompts, params, use_tqdm=False)
    spec = NGRAM | {"prompt_lookup_min": 1, "min_acceptance": 0.9}
    llm = LLM(tiny_model, warm_up=False, speculative_config=spec, async_scheduling=True, **BASE)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    got, overlapped = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        overlapped += engine._in_flight is not None
    assert [got[str(i)] for i in range(3)] == [w.outputs[0].token_ids for w in want]
    assert engine.speculator.num_drafted > 0  # rows did speculate before turning down
    assert overlapped > 10
    assert engine.pages.num_free == engine.pages.num_usable


def test_no_compilation_after_warm_up_with_speculation(tiny_model):
    compiles = record_compilations()
    llm = LLM(tiny_model, speculative_config=LOOKUP_1, **(BASE | {"num_pages": 70}))
    warm = compile_count()
    compiles.clear()
    engine = llm.engine
    run_varied_workload(engine, TINY_VOCAB)
    for i, prompt in enumerate(_repetitive_prompts(8, seed=1)):
        engine.add_request(f"s{i}", prompt, SamplingParams(temperature=0, max_tokens=24))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.speculator.num_accepted > 0
    assert compile_count() == warm
    assert compiles == []
    assert engine.pages.num_free == engine.pages.num_usable


def _chi2_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi-squared(dof), Wilson-Hilferty's normal approximation."""
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of observed counts against probs, bins with expectation < 5 merged."""
    expected = probs * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return _chi2_sf(stat, int(keep.sum()) - 1)


NUM_SAMPLES = 1000


def test_verified_token_follows_the_target_distribution(tiny_pair):
    """The second output token is the first one a verify step samples (n-gram proposes D
    after whatever the first token is). Its empirical distribution over 1000 seeded samples
    must match the exact marginal computed from transformers' logits, and must not match
    what an unnormalised residual (the draft left in the rejection distribution) gives."""
    import torch

    tiny_model, hf = tiny_pair
    draft, bias, temperature = 7, 6.0, 1.0
    others = [t for t in range(3, TINY_VOCAB) if t != draft]
    prompt = [t for v in others for t in (v, draft)]  # every token followed by D
    params = [
        SamplingParams(temperature=temperature, seed=s, max_tokens=3, logit_bias={draft: bias})
        for s in range(NUM_SAMPLES)
    ]
    config = BASE | {"max_model_len": 512, "max_num_seqs": 32, "max_num_batched_tokens": 64,
                     "context_buckets": (512,)}  # fmt: skip
    llm = LLM(
        tiny_model,
        warm_up=False,
        speculative_config=LOOKUP_1 | {"num_speculative_tokens": 1},
        **config,
    )
    outs = llm.generate([prompt] * NUM_SAMPLES, params, use_tqdm=False)
    spec = llm.engine.speculator
    assert spec.drafted_per_position[0] >= 0.95 * NUM_SAMPLES  # nearly all verified D once
    counts = np.bincount([o.outputs[0].token_ids[1] for o in outs], minlength=TINY_VOCAB)

    def probs(logits):
        z = logits.astype(np.float64)
        z[draft] += bias
        z = np.exp((z - z.max()) / temperature)
        return z / z.sum()

    batch = torch.tensor([[*prompt, t1] for t1 in range(TINY_VOCAB)])
    with torch.no_grad():
        logits = hf(batch).logits.numpy()  # [V, L + 1, V]: every first token t1 at once
    first = probs(logits[0, -2])
    exact = np.zeros(TINY_VOCAB)
    broken = np.zeros(TINY_VOCAB)
    for t1 in range(TINY_VOCAB):
        p = probs(logits[t1, -1])
        exact += first[t1] * p
        # the proposal after t1 is D (for t1 = D too: D's last occurrence is followed by t1)
        residual = p  # unnormalised: D not removed from the rejection distribution
        wrong = (1 - p[draft]) * residual
        wrong[draft] += p[draft]
        broken += first[t1] * wrong
    assert exact[draft] > 0.2  # the proposal is often right: acceptance matters
    good, bad = _chi2(counts, exact), _chi2(counts, broken)
    print(f"p-value against the exact distribution {good:.3g}, against the broken {bad:.3g}")
    assert good > 1e-3
    assert bad < 1e-6


# ------------------------------------------------------------------ draft models


def _draft(path, k: int = 3) -> dict:
    return {"model": str(path), "num_speculative_tokens": k, "disable_by_batch_size": 32}


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """A different, smaller random model with the tiny model's vocabulary."""
    path = tmp_path_factory.mktemp("tiny-draft") / "hf"
    write_tiny_hf(path, seed=1, num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                  intermediate_size=80, eos_token_id=None)  # fmt: skip
    return path


def test_draft_with_another_vocabulary_is_refused(tiny_model, tmp_path):
    path = tmp_path / "hf"
    write_tiny_hf(path, vocab_size=TINY_VOCAB + 32, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"speculative_config\.model.*vocabulary"):
        LLM(tiny_model, warm_up=False, speculative_config=_draft(path), **BASE)
    with pytest.raises(ValueError, match=r"speculative_config\.model.*cannot load"):
        LLM(tiny_model, warm_up=False, speculative_config=_draft(tmp_path / "none"), **BASE)


# small KV (preemption), 24-token steps (chunked prefill), prefix caching on; one bucket
DRAFT_CONFIG = BASE | {"max_model_len": 128, "num_pages": 34, "max_num_batched_tokens": 24,
                       "token_buckets": (24,), "seq_buckets": (8,), "context_buckets": (128,),
                       "enable_prefix_caching": True}  # fmt: skip


@pytest.fixture(scope="module")
def draft_runs(tiny_model, tiny_written, small_draft):
    """One greedy mixed batch without speculation, with the target as its own draft (warmed
    up, compilations counted) and with a smaller draft."""
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(3, TINY_VOCAB, int(n))] for n in (50, 9, 30, 61)]
    prompts.insert(2, prompts[0])  # a prefix-cache hit
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(tiny_model, warm_up=False, **DRAFT_CONFIG)
    want = plain.generate(prompts, greedy, use_tqdm=False)
    stop = want[1].outputs[0].text.split()[6]  # a word it generates: the stop string
    params = [greedy, dataclasses.replace(greedy, stop=[stop]), greedy, greedy, greedy]
    want = plain.generate(prompts, params, use_tqdm=False)
    assert want[1].outputs[0].finish_reason == "stop"
    runs = {"plain": (want, plain.engine)}
    self_draft = LLM(tiny_model, speculative_config=_draft(tiny_written[0]), **DRAFT_CONFIG)
    compiles = record_compilations()
    warm = compile_count()
    runs["self"] = (self_draft.generate(prompts, params, use_tqdm=False), self_draft.engine)
    runs["compiles"] = (compile_count() - warm, list(compiles))
    small = LLM(tiny_model, warm_up=False, speculative_config=_draft(small_draft, 4),
                **DRAFT_CONFIG)  # fmt: skip
    runs["small"] = (small.generate(prompts, params, use_tqdm=False), small.engine)
    return runs


@pytest.mark.parametrize("draft", ["self", "small"])
def test_draft_model_greedy_outputs_equal_without(draft_runs, draft):
    want, plain = draft_runs["plain"]
    got, engine = draft_runs[draft]
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert (g.outputs[0].text, g.outputs[0].finish_reason) == (
            w.outputs[0].text,
            w.outputs[0].finish_reason,
        )
    assert engine.stats.preemptions > 0 and engine.stats.prefix_cache_hits > 0
    spec = engine.speculator
    assert spec.num_drafted > 0
    if draft == "self":  # the target proposes what it then samples: all accepted
        assert spec.num_accepted == spec.num_drafted
        assert spec.accepted_per_position == spec.drafted_per_position
        assert engine.stats.steps < plain.stats.steps


def test_no_compilation_after_warm_up_with_a_draft_model(draft_runs):
    assert draft_runs["compiles"] == (0, [])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_draft_model_seeded_sampling_equals_without(tiny_model, small_draft, async_scheduling):
    """Seeded outputs equal; with the async scheduler, steps overlap while more than 2 rows
    run (the draft still computes their tokens) and speculate once fewer do."""
    prompts = _repetitive_prompts(4, seed=3)
    params = [
        SamplingParams(temperature=0.7, seed=3, max_tokens=16, logprobs=1),
        SamplingParams(temperature=1.0, top_k=20, seed=5, n=2, max_tokens=16),
    ] * 2
    config = DRAFT_CONFIG  # the steps draft_runs compiled
    want = LLM(tiny_model, warm_up=False, **config).generate(prompts, params, use_tqdm=False)
    spec = _draft(small_draft, 4) | {"disable_by_batch_size": 2 if async_scheduling else 32}
    llm = LLM(
        tiny_model,
        warm_up=False,
        speculative_config=spec,
        async_scheduling=async_scheduling,
        **config,
    )
    got = llm.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        if w.outputs[0].logprobs is not None:
            for a, b in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
                assert a.keys() == b.keys()
    assert llm.engine.speculator.num_drafted > 0

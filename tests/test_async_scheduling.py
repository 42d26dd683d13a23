"""Async scheduling (the next step dispatched before this one's tokens are fetched) changes
nothing a client sees: the same tokens, text, logprobs and finish reasons as the sequential
loop in every scenario, nothing past a stop or an abort, no compilation after warm-up, and
every page back in the pool. Also: penalties through the persistent batch's on-device counts
equal a rollout with the numpy oracle."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TINY_VOCAB, write_tiny_hf
from sampling_oracle import np_penalties
from workloads import record_compilations, run_varied_workload

import ksana_jax
from ksana_jax import LLM, SamplingParams
from ksana_jax.step_programs import compile_count

RNG = np.random.default_rng(23)
PROMPTS = [[int(t) for t in RNG.integers(3, TINY_VOCAB, n)] for n in (1, 5, 17, 33, 64, 9)]
SHARED = PROMPTS[3][:24]
BASE = dict(
    max_model_len=256,
    page_size=4,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    context_buckets=(64, 256),
)
SMALL_POOL = {"num_pages": 30, "max_model_len": 96, "context_buckets": (32, 96)}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "hf"
    write_tiny_hf(path, initializer_range=0.2, eos_token_id=2)
    return ksana_jax.load(path)


def summary(outs):
    return [[(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in o.outputs] for o in outs]


def generate(model, prompts, params, asynchronous: bool, **overrides):
    llm = LLM(model, warm_up=False, async_scheduling=asynchronous, **(BASE | overrides))
    outs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    assert engine.pages.num_free == engine.pages.num_usable
    assert not engine.scheduler.has_unfinished()
    return summary(outs), engine


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=5, max_tokens=10)
PENALIZED = SamplingParams(
    temperature=0.8,
    seed=9,
    max_tokens=14,
    repetition_penalty=1.3,
    presence_penalty=0.4,
    frequency_penalty=0.3,
    ignore_eos=True,
)
SCENARIOS = {
    "greedy": (PROMPTS, GREEDY, {}),
    "chunks16": (PROMPTS, GREEDY, {"max_num_batched_tokens": 16, "token_buckets": (16,)}),
    "preemption": (PROMPTS, GREEDY, SMALL_POOL),
    "seeded_eos": (PROMPTS, SEEDED, {}),
    "penalties_preemption": (PROMPTS, PENALIZED, SMALL_POOL),
    "n3_prefix_cache": (
        [[*SHARED, 5, 6], [*SHARED, 7]],
        SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=7, ignore_eos=True),
        {},
    ),
    "stops_and_limits": (
        PROMPTS,
        [
            SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[PROMPTS[0][0]]),
            SamplingParams(temperature=0, max_tokens=1),
            SamplingParams(temperature=0, max_tokens=9, min_tokens=4, stop=["w1", "w2"]),
            SamplingParams(temperature=0, max_tokens=12, stop=["w3"], ignore_eos=True),
            SamplingParams(temperature=0.5, seed=1, max_tokens=12, logprobs=3),
            SamplingParams(
                temperature=0, max_tokens=5, stop=["w"], include_stop_str_in_output=True
            ),
        ],
        {},
    ),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_async_scheduling_changes_no_output(tiny_model, name):
    prompts, params, overrides = SCENARIOS[name]
    want, sync_engine = generate(tiny_model, prompts, params, False, **overrides)
    got, engine = generate(tiny_model, prompts, params, True, **overrides)
    assert got == want
    if "num_pages" in overrides:
        assert engine.stats.preemptions > 0 and sync_engine.stats.preemptions > 0
    if name == "n3_prefix_cache":
        assert engine.stats.prefix_cache_hits > 0
    assert engine.stats.generation_tokens == sync_engine.stats.generation_tokens


def test_prefix_cache_hits_and_stop_strings_over_waves(tiny_model):
    """A second wave that hits the first's pages (prompts and generated tokens)."""
    results = []
    for asynchronous in (False, True):
        llm = LLM(tiny_model, warm_up=False, async_scheduling=asynchronous, **BASE)
        first = llm.generate(PROMPTS[2:5], GREEDY, use_tqdm=False)
        follow = [p + o.outputs[0].token_ids[:6] for p, o in zip(PROMPTS[2:5], first, strict=True)]
        second = llm.generate(follow + PROMPTS[2:4], GREEDY, use_tqdm=False)
        assert llm.engine.stats.prefix_cache_hits > 60
        assert llm.engine.pages.num_free == llm.engine.pages.num_usable
        results.append(summary(first) + summary(second))
    assert results[0] == results[1]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_abort_mid_stream_emits_nothing_past_it(tiny_model, asynchronous):
    llm = LLM(tiny_model, warm_up=False, async_scheduling=asynchronous, **BASE)
    full = llm.generate([PROMPTS[2]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.engine
    engine.add_request("other", PROMPTS[4], GREEDY)
    seen = []
    for out in llm.stream(PROMPTS[2], GREEDY):
        seen.append(list(out.outputs[0].token_ids))
        if len(seen[-1]) == 5:
            aborted = engine.abort_request(out.request_id)
            break
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert aborted.outputs[0].token_ids == []  # a delta: nothing past what was streamed
    assert seen[-1] == full[:5]
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "other"
    assert engine.pages.num_free == engine.pages.num_usable


def test_async_step_returns_the_previous_steps_tokens(tiny_model):
    llm = LLM(tiny_model, warm_up=False, async_scheduling=True, **BASE)
    engine = llm.engine
    engine.add_request("a", PROMPTS[1], GREEDY)
    assert engine.step() == []  # the prefill is dispatched, its token not yet fetched
    assert engine._in_flight is not None
    (out,) = engine.step()  # the first decode is dispatched, then the prefill's token read
    assert len(out.outputs[0].token_ids) == 1
    engine.abort_request("a")
    assert engine.step() == []  # the in-flight decode's token is discarded
    assert engine.pages.num_free == engine.pages.num_usable


@pytest.mark.parametrize("asynchronous", [False, True])
def test_engine_emits_deltas_that_add_up_to_the_outputs(tiny_model, asynchronous):
    params = [
        SamplingParams(temperature=0, max_tokens=12, stop=["w1", "w2"], logprobs=2),
        SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=9, ignore_eos=True),
    ]
    llm = LLM(
        tiny_model,
        warm_up=False,
        async_scheduling=asynchronous,
        enable_prefix_caching=False,  # the second run computes exactly as the first
        **BASE,
    )
    want = summary(llm.generate(PROMPTS[1:3], params, use_tqdm=False))
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(PROMPTS[1:3], params, strict=True)):
        engine.add_request(f"d{i}", prompt, p)
    deltas = {"d0": [], "d1": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas[out.request_id].append(out)
    got = []
    for request_deltas in deltas.values():
        assert sum(d.finished for d in request_deltas) == 1 and request_deltas[-1].finished
        choices = []
        for index in range(len(request_deltas[0].outputs)):
            parts = [d.outputs[index] for d in request_deltas]
            assert all(len(c.token_ids) <= 1 for c in parts)  # one step: one token at most
            token_ids = [t for c in parts for t in c.token_ids]
            logprobs = [e for c in parts for e in (c.logprobs or [])] or parts[0].logprobs
            offsets = [o for c in parts for o in c.text_offsets]
            assert len(offsets) == len(token_ids) and offsets == sorted(offsets)
            text = "".join(c.text for c in parts)
            choices.append((token_ids, text, parts[-1].finish_reason, logprobs))
        got.append(choices)
    assert got == want


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 2}  # fmt: skip
GREEDY_STEPS = {
    "greedy": (PROMPTS, GREEDY, {}),
    "greedy_preemption": (PROMPTS, GREEDY, SMALL_POOL),
    "stops_and_limits": SCENARIOS["stops_and_limits"],  # min_tokens: a full plan's steps
    "greedy_beside_sampled": (PROMPTS, [GREEDY, SEEDED] * 3, {}),
    "ngram_proposals": (
        [(p * 6)[:40] for p in (PROMPTS[1], PROMPTS[5], PROMPTS[0] + [7, 8])],
        GREEDY,
        {"speculative_config": NGRAM},
    ),
}


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("name", list(GREEDY_STEPS))
def test_forward_samples_greedy_steps_as_the_sampling_program_would(
    tiny_model, name, asynchronous, monkeypatch
):
    """A step whose rows all sample greedily with nothing else to do is one program: the
    forward samples it (runner.samples_in_forward). Its tokens, stops, proposals' verdicts
    and the slots' last tokens the next step reads equal the two-program step's (the
    sampling program, patched in for every step), and such steps dispatch no sampling
    program, while the others still do."""
    from ksana_jax import runner

    prompts, params, overrides = GREEDY_STEPS[name]
    samples = []  # each sampling program's plan
    sample = runner.ModelRunner.sample

    def counted(self, forwarded, token_bitmask, sampler, num_scored=0):
        samples.append(sampler)
        return sample(self, forwarded, token_bitmask, sampler, num_scored)

    monkeypatch.setattr(runner.ModelRunner, "sample", counted)
    got, engine = generate(tiny_model, prompts, params, asynchronous, **overrides)
    by_forward = engine.stats.steps - len(samples)
    samples.clear()
    monkeypatch.setattr(runner, "samples_in_forward", lambda *_: False)
    want, two_programs = generate(tiny_model, prompts, params, asynchronous, **overrides)
    assert got == want
    assert engine.stats.steps == two_programs.stats.steps == len(samples)
    if name in ("greedy", "greedy_preemption", "ngram_proposals"):
        assert by_forward == engine.stats.steps  # no sampling program at all
    else:  # a plan other than GREEDY: the sampling program ran for those steps
        assert engine.stats.steps - by_forward > 0
    if name == "ngram_proposals":
        assert engine.speculator.num_accepted > 0


def test_no_compilation_after_warm_up_with_async_scheduling(tiny_model):
    compiles = record_compilations()
    llm = LLM(tiny_model, async_scheduling=True, **(BASE | {"num_pages": 70}))
    warm = compile_count()
    compiles.clear()
    engine = llm.engine
    run_varied_workload(engine, TINY_VOCAB)
    assert engine.stats.preemptions > 0 and engine.stats.prefix_cache_hits > 0
    assert compile_count() == warm
    assert compiles == []
    assert engine.pages.num_free == engine.pages.num_usable


def test_penalties_equal_a_rollout_with_the_numpy_oracle(tiny_model):
    """Greedy with every penalty, through chunked prefill and decode: the engine's on-device
    counts give the argmax of the oracle's penalized logits at every step."""
    params = SamplingParams(
        temperature=0,
        max_tokens=10,
        repetition_penalty=3.0,
        presence_penalty=2.0,
        frequency_penalty=2.0,
        ignore_eos=True,
    )
    llm = LLM(tiny_model, warm_up=False, **(BASE | {"max_num_batched_tokens": 16}))
    # The prompt holds what greedy would generate, so the penalties steer away from it.
    start = PROMPTS[3][:20]
    prompt = start + llm.generate([start], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    got = llm.generate([prompt, PROMPTS[1]], params, use_tqdm=False)[0].outputs[0].token_ids
    tokens = list(prompt)
    for _ in range(10):
        logits = tiny_model.logits(tokens)[-1][None].astype(np.float64)
        history = np.asarray([tokens])
        penalized = np_penalties(logits, history, [len(prompt)], [3.0], [2.0], [2.0])
        tokens.append(int(penalized.argmax()))
    assert got == tokens[len(prompt) :]
    plain = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert plain[:10] != got  # the penalties mattered

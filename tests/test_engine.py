"""The whole engine path on a tiny random model: continuous batching, chunked prefill and
preemption give the same greedy tokens as one request at a time; seeded sampling is
batch-invariant; nothing compiles after warm-up; aborts free every page."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import TINY_VOCAB, write_tiny_hf
from workloads import record_compilations, run_varied_workload

import ksana_jax
from ksana_jax import LLM, SamplingParams
from ksana_jax.pallas_kernels import linear_cpu
from ksana_jax.runner import ModelRunner
from ksana_jax.sampling_params import RequestOutputKind
from ksana_jax.step_programs import compile_count

# Gaps between the top two logits below this are float-noise ties: batch shape may flip them.
TIE = 1e-4
RNG = np.random.default_rng(11)
PROMPTS = [[int(t) for t in RNG.integers(3, TINY_VOCAB, n)] for n in (1, 5, 17, 33, 64, 9)]
BASE = dict(
    max_model_len=256,
    page_size=4,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    context_buckets=(64, 256),
)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "hf"
    # A wider init than usual gives peaked logits, so greedy ties are rare (and handled).
    write_tiny_hf(path, initializer_range=0.2, eos_token_id=None)
    return ksana_jax.load(path)


def assert_same_greedy(model, prompt, got, want):
    """Token lists equal, or equal up to a position where the reference had a true tie."""
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            logits = model.logits(list(prompt) + list(want[:i]))[-1]
            top2 = np.sort(logits)[-2:]
            assert top2[1] - top2[0] < TIE, f"diverged at {i}: {got} vs {want}"
            return
    assert len(got) == len(want)


def alone(model, prompt, max_tokens):
    return ksana_jax.generate(model, prompt, max_tokens=max_tokens, stop_token_ids=[])


@pytest.fixture(scope="module")
def reference_outputs(tiny_model):
    return [alone(tiny_model, p, 12) for p in PROMPTS]


# 29 usable pages of 4 tokens, while the prompts and outputs above need about 55.
SMALL_POOL = {"num_pages": 30, "max_model_len": 96, "context_buckets": (32, 96)}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # everything at once, chunked prefill under a 64-token budget
        {"max_num_batched_tokens": 16, "token_buckets": (16,)},  # small chunks
        {"max_num_batched_tokens": 32, "max_num_seqs": 2, "seq_buckets": (2,)},
        SMALL_POOL,  # too small for all at once: preemption
    ],
    ids=["batched", "chunks16", "two_rows", "preemption"],
)
def test_batched_greedy_equals_one_at_a_time(tiny_model, reference_outputs, overrides):
    llm = LLM(tiny_model, warm_up=False, **(BASE | overrides))
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, out, want in zip(PROMPTS, outs, reference_outputs, strict=True):
        assert out.outputs[0].finish_reason == "length"
        assert_same_greedy(tiny_model, prompt, out.outputs[0].token_ids, want)
    if "num_pages" in overrides:
        assert llm.engine.stats.preemptions > 0
    assert llm.engine.pages.num_free == llm.engine.pages.num_usable


def test_seeded_sampling_does_not_depend_on_batch_mates(tiny_model):
    llm = LLM(tiny_model, warm_up=False, **BASE)
    params = SamplingParams(
        temperature=0.9, top_k=20, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True
    )
    alone_out = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0].outputs[0].token_ids
    mates = SamplingParams(
        temperature=1.3, seed=7, max_tokens=14, ignore_eos=True, presence_penalty=0.5
    )
    for mix in ([PROMPTS[2], PROMPTS[4]], [PROMPTS[0], PROMPTS[2], PROMPTS[3], PROMPTS[5]]):
        outs = llm.generate(
            mix, [params if p is PROMPTS[2] else mates for p in mix], use_tqdm=False
        )
        got = next(o for o, p in zip(outs, mix, strict=True) if p is PROMPTS[2])
        assert got.outputs[0].token_ids == alone_out
    # Under preemption too (recompute must not replay different noise).
    small = LLM(tiny_model, warm_up=False, **(BASE | SMALL_POOL))
    outs = small.generate(PROMPTS, [params] * len(PROMPTS), use_tqdm=False)
    assert small.engine.stats.preemptions > 0
    assert outs[2].outputs[0].token_ids == alone_out


def test_n_samples_use_consecutive_seeds(tiny_model):
    llm = LLM(tiny_model, warm_up=False, **BASE)
    params = SamplingParams(n=3, temperature=1.0, seed=40, max_tokens=8, ignore_eos=True)
    out = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for c in out.outputs:
        single = SamplingParams(temperature=1.0, seed=40 + c.index, max_tokens=8, ignore_eos=True)
        want = llm.generate([PROMPTS[1]], single, use_tqdm=False)[0].outputs[0].token_ids
        assert c.token_ids == want
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_no_compilation_after_warm_up(tiny_model):
    compiles = record_compilations()
    llm = LLM(tiny_model, **(BASE | {"num_pages": 70}))
    warm = compile_count()
    assert warm >= len(llm.engine.runner.bucket_shapes())
    compiles.clear()
    engine = llm.engine
    run_varied_workload(engine, TINY_VOCAB)
    assert engine.stats.preemptions > 0
    assert engine.stats.prefix_cache_hits > 0
    assert compile_count() == warm
    assert compiles == []
    assert engine.pages.num_free == engine.pages.num_usable


def test_abort_frees_pages_at_any_point(tiny_model):
    llm = LLM(
        tiny_model, warm_up=False, **(BASE | {"max_num_batched_tokens": 16, "token_buckets": (16,)})
    )
    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"a{i}", p, SamplingParams(temperature=0, max_tokens=30))
    engine.step()  # the 64-token prompt is mid-prefill, others waiting or decoding
    assert engine.abort_request("a4").finished
    for _ in range(3):
        engine.step()
    for i in range(len(PROMPTS)):
        engine.abort_request(f"a{i}")
    assert not engine.has_unfinished_requests()
    assert engine.pages.num_free == engine.pages.num_usable
    assert engine.abort_request("a0") is None  # unknown now


def test_limits_and_stops(tiny_model):
    llm = LLM(tiny_model, warm_up=False, **BASE)
    prompt = PROMPTS[3]
    free_run = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    tokens = free_run.token_ids
    # stop_token_ids: ends at the first occurrence, token kept in token_ids.
    stop_at = tokens[4]
    first = tokens.index(stop_at)
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]),
        use_tqdm=False,
    )
    assert out[0].outputs[0].token_ids == tokens[: first + 1]
    assert out[0].outputs[0].finish_reason == "stop"
    assert out[0].outputs[0].stop_reason == stop_at  # vLLM's: the token id that ended it
    assert free_run.finish_reason == "length" and free_run.stop_reason is None
    # min_tokens defers that stop.
    out = llm.generate(
        [prompt],
        SamplingParams(
            temperature=0, max_tokens=12, min_tokens=first + 2, stop_token_ids=[stop_at]
        ),
        use_tqdm=False,
    )
    deferred = out[0].outputs[0].token_ids
    assert len(deferred) >= first + 2
    assert stop_at not in deferred[: first + 2]  # banned on device until min_tokens
    # A stop string spanning tokens is cut from the text.
    text = free_run.text
    stop = text[len(text) // 2 - 3 : len(text) // 2 + 3]
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == text[: text.find(stop)]
    assert out.stop_reason == stop
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=12, stop=stop, include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.text == text[: text.find(stop) + len(stop)]


def test_logprobs_are_the_models(tiny_model):
    llm = LLM(tiny_model, warm_up=False, **BASE)
    prompt = PROMPTS[2]
    out = llm.generate(
        [prompt], SamplingParams(temperature=0.7, seed=3, max_tokens=4, logprobs=3), use_tqdm=False
    )[0].outputs[0]
    assert len(out.logprobs) == 4
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        logits = tiny_model.logits(prompt + out.token_ids[:i])[-1].astype(np.float64)
        ref = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
        assert token in entry and 3 <= len(entry) <= 4
        for tid, lp in entry.items():
            assert abs(lp - ref[tid]) < 1e-4
        assert set(np.argsort(ref)[-3:]) <= set(entry)


def test_bad_requests_are_value_errors_and_leave_nothing(tiny_model):
    llm = LLM(tiny_model, warm_up=False, **BASE)
    engine = llm.engine
    cases = [
        ([], SamplingParams(), "at least one token"),
        ([TINY_VOCAB + 5], SamplingParams(), "outside the vocabulary"),
        (PROMPTS[4], SamplingParams(max_tokens=250), "max_model_len"),
        (PROMPTS[0], SamplingParams(logprobs=50), "max_logprobs"),
        ([5] * 256, SamplingParams(max_tokens=None), "shorter than max_model_len"),
    ]
    for prompt, params, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="unknown engine option"):
        LLM(tiny_model, warm_up=False, max_num_sequences=4)


def test_final_only_requests_get_one_output_holding_the_deltas_sum(tiny_model):
    """output_kind=FINAL_ONLY (vLLM's; LLM.generate's): one output per request, at its end,
    the same as its DELTA outputs added up -- text, tokens, logprobs, offsets, reasons, a stop
    string cut -- beside DELTA requests in the same batch, and for an aborted one."""
    llm = LLM(tiny_model, warm_up=False, **BASE)
    engine = llm.engine
    text = llm.generate([PROMPTS[3]], GREEDY, use_tqdm=False)[0].outputs[0].text
    kinds = {"delta": RequestOutputKind.DELTA, "final": RequestOutputKind.FINAL_ONLY}
    options = [
        dict(temperature=0.8, seed=5, max_tokens=9, logprobs=2, n=2),
        dict(temperature=0, max_tokens=12, stop=[text[len(text) // 2 : len(text) // 2 + 3]]),
        dict(temperature=0, max_tokens=12, ignore_eos=True),
    ]
    for i, option in enumerate(options):
        for name, kind in kinds.items():
            params = SamplingParams(**option, output_kind=kind)
            engine.add_request(f"{name}{i}", PROMPTS[3], params)
    engine.add_request(
        "final-aborted",
        PROMPTS[1],
        SamplingParams(temperature=0, max_tokens=12, output_kind=RequestOutputKind.FINAL_ONLY),
    )
    seen: dict[str, list] = {}
    for _ in range(3):
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    aborted = engine.abort_request("final-aborted")
    assert "final-aborted" not in seen and aborted.finished
    assert aborted.outputs[0].finish_reason == "abort" and aborted.outputs[0].token_ids
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    for i in range(len(options)):
        deltas, finals = seen[f"delta{i}"], seen[f"final{i}"]
        assert len(deltas) > 1 and len(finals) == 1 and finals[0].finished
        total = deltas[0]
        for delta in deltas[1:]:
            total.add(delta)
        assert finals[0].outputs == total.outputs
    assert seen["final1"][0].outputs[0].finish_reason == "stop"
    assert engine.pages.num_used == 0
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=RequestOutputKind.CUMULATIVE)


def test_stream_and_chat(tiny_model):
    llm = LLM(tiny_model, warm_up=False, **BASE)
    steps = list(llm.stream(PROMPTS[1], GREEDY))
    assert steps[-1].finished and not steps[0].finished
    lengths = [len(s.outputs[0].token_ids) for s in steps]
    assert lengths == sorted(lengths) and lengths[-1] == 12
    chat = llm.chat([{"role": "user", "content": "w5 w6"}], GREEDY, use_tqdm=False)[0]
    template = llm.tokenizer.apply_chat_template([{"role": "user", "content": "w5 w6"}])
    assert chat.prompt_token_ids == llm.tokenizer.encode(template, add_special_tokens=False)


def test_bfloat16_on_cpu_decodes_one_sequence_in_a_one_token_step(tiny_model):
    """linear_cpu's kernel takes bfloat16 matrices at one row, so on CPU the derived token
    buckets start with 1 (batch-1 decode runs the kernel instead of 16 padded rows through
    XLA's dot) and hold each sequence bucket (8 decode rows take an 8-token step, not 16);
    warm-up compiles those steps too. Buckets set to other than the derived ones, and
    float32 weights (XLA's matrix-vector product), keep their buckets."""
    compiles = record_compilations()
    llm = LLM(tiny_model, dtype="bfloat16", **BASE)
    decode = (1, 8) if linear_cpu.available() else ()
    assert llm.engine.runner.config.token_buckets == (*decode, 16, 64)
    assert llm.engine.config.token_buckets == (16, 64)
    warm = compile_count()
    compiles.clear()
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.generate([PROMPTS[2]], greedy, use_tqdm=False)
    assert compile_count() == warm and compiles == []
    chosen = LLM(tiny_model, warm_up=False, dtype="bfloat16", **(BASE | {"token_buckets": (8, 64)}))
    assert chosen.engine.runner.config.token_buckets == (8, 64)
    assert LLM(tiny_model, warm_up=False, **BASE).engine.runner.config.token_buckets == (16, 64)
    # With speculation, a verifying row's k + 1 tokens get a step of their own (k = 3: 4).
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    verifying = LLM(tiny_model, warm_up=False, dtype="bfloat16", speculative_config=spec, **BASE)
    small = (1, 4, 8) if linear_cpu.available() else ()
    assert verifying.engine.runner.config.token_buckets == (*small, 16, 64)


def test_bfloat16_engine_keeps_a_float16_kv_on_cpu(tiny_model):
    llm = LLM(tiny_model, warm_up=False, dtype="bfloat16", **BASE)
    assert llm.model.dtype == "bfloat16" and tiny_model.dtype == "float32"
    assert llm.engine.runner.kv.pages.dtype == jax.numpy.float16  # see kv_cache.resolve_kv_dtype
    out = llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [12, 12, 12]
    # The TPU kernel (interpreted here) keeps bfloat16: Mosaic loads no float16 vectors.
    tpu_config = {**BASE, "page_size": 16}  # Mosaic's bfloat16 tiling: 16-row pages
    tpu = LLM(
        tiny_model, warm_up=False, dtype="bfloat16", attention_backend="pallas_tpu", **tpu_config
    )
    assert tpu.engine.runner.kv.pages.dtype == jax.numpy.bfloat16


def test_pinned_kv_layout_path_generates_the_same_tokens(tiny_model, monkeypatch):
    """On a TPU the runner holds the KV row-major through a jitted forward program whose KV
    argument and result are pinned to that layout (runner.kv_row_major_format). That path,
    forced here on CPU: same greedy tokens as the plain step, the KV donated and kept in the
    layout, and its compilations counted."""
    from ksana_jax import runner

    plain = LLM(tiny_model, warm_up=False, **BASE)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)]
    monkeypatch.setattr(runner, "PINNED_KV_PLATFORMS", (jax.default_backend(),))
    before = compile_count()
    # A GiB budget on such a platform counts head_dim rows padded to 128 lanes.
    config = {**BASE, "kv_cache_memory_gib": 0.002}
    llm = LLM(tiny_model, warm_up=False, **config)
    step_runner = llm.engine.runner
    padded, plain = (
        runner.resolve_num_pages(
            step_runner.config, tiny_model.config, "float32", lane_multiple=lanes
        )
        for lanes in (128, 1)
    )
    assert step_runner.num_pages == padded < plain
    assert step_runner.forward_step is not runner.forward_step
    # one pinned step per format: a second engine shares it, and compile_count counts once
    assert (
        LLM(tiny_model, warm_up=False, **config).engine.runner.forward_step
        is step_runner.forward_step
    )
    kv = step_runner.kv.pages
    assert kv.format.layout.major_to_minor == tuple(range(6))
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == want
    assert kv.is_deleted()  # donated to the first step
    assert step_runner.kv.pages.format.layout.major_to_minor == tuple(range(6))
    assert compile_count() > before


# --------------------------------------------------------------------------- prefix cache

RNG_PREFIX = np.random.default_rng(5)


def random_tokens(n: int) -> list[int]:
    return [int(t) for t in RNG_PREFIX.integers(3, TINY_VOCAB, n)]


LONG_SYSTEM = random_tokens(41)  # 10 full pages of 4 and one token
SHORT_SYSTEM = random_tokens(5)
OTHER = random_tokens(30)
FIRST_WAVE = [LONG_SYSTEM + random_tokens(7), SHORT_SYSTEM + random_tokens(9), OTHER]


SUFFIXES = [random_tokens(n) for n in (6, 20, 5, 5, 3)]


def second_wave(first_output: list[int]) -> list[list[int]]:
    """Prompts that reuse the first wave's prompts (and generated tokens) in every way."""
    return [
        LONG_SYSTEM + SUFFIXES[0],  # long shared prefix
        SHORT_SYSTEM + SUFFIXES[1],  # short one (a page and a token)
        LONG_SYSTEM[:32] + SUFFIXES[2],  # ends exactly on a page boundary
        LONG_SYSTEM[:33] + SUFFIXES[3],  # one token past it
        OTHER[:20],  # entirely a prefix of an earlier prompt, on a boundary
        OTHER[:23],  # ... and not on one
        list(OTHER),  # the same prompt again: all its full pages cached
        FIRST_WAVE[0] + first_output[:9] + SUFFIXES[4],  # a follow-up turn
    ]


def run_waves(model, params, **overrides):
    """Generates the first wave, then the second; returns token ids and the engine."""
    llm = LLM(model, warm_up=False, **(BASE | overrides))
    first = [o.outputs for o in llm.generate(FIRST_WAVE, params, use_tqdm=False)]
    first_ids = [[c.token_ids for c in outs] for outs in first]
    second = llm.generate(second_wave(first_ids[0][0]), params, use_tqdm=False)
    second_ids = [[c.token_ids for c in o.outputs] for o in second]
    return first_ids + second_ids, llm.engine


@pytest.mark.parametrize(
    "overrides",
    [{}, {"max_num_batched_tokens": 16, "token_buckets": (16,)}, SMALL_POOL],
    ids=["batched", "chunks16", "eviction"],
)
def test_prefix_cache_greedy_equals_cache_off(tiny_model, overrides, monkeypatch):
    want, _ = run_waves(tiny_model, GREEDY, enable_prefix_caching=False, **overrides)
    written_before = []  # page writes that did not fit in their step's (a hit's pages)
    write_pages = ModelRunner.write_pages
    monkeypatch.setattr(
        ModelRunner,
        "write_pages",
        lambda self, writes: (written_before.append(writes), write_pages(self, writes))[1],
    )
    got, engine = run_waves(tiny_model, GREEDY, **overrides)
    prompts = FIRST_WAVE + second_wave(want[0][0])
    for prompt, g, w in zip(prompts, got, want, strict=True):
        assert_same_greedy(tiny_model, prompt, g[0], w[0])
    stats = engine.stats
    assert stats.prefix_cache_queries == sum(len(p) for p in prompts)
    assert stats.prefix_cache_hits >= 4 * 25, stats  # most of the second wave's full pages
    if "num_pages" in overrides:  # 29 pages, while the working set needs about 100
        assert engine.pages.cache.num_evictions > 0 and stats.preemptions > 0
    assert engine.pages.num_free == engine.pages.num_usable
    assert engine.kv_cache_usage == 0.0
    # The device's page table, written by diffs only, holds what the host's copy does.
    batch = engine.runner.batch
    written = np.arange(batch.page_table.shape[1]) < batch._num_pages[:, None]
    device = np.asarray(engine.runner.state.page_table)
    np.testing.assert_array_equal(device[written], batch.page_table[written])
    if "token_buckets" in overrides:  # 16-token steps carry 8 + 4 writes, a hit has 10 pages
        assert any((w.slots < batch.num_slots).any() for w in written_before)


def test_outputs_count_the_prompt_tokens_found_in_the_cache(tiny_model):
    llm = LLM(tiny_model, warm_up=False, **BASE)
    prompt = LONG_SYSTEM + SUFFIXES[0]  # 47 tokens: 11 full pages of 4
    first, second = (llm.generate([prompt], GREEDY, use_tqdm=False)[0] for _ in range(2))
    assert first.num_cached_tokens == 0
    # every full page but one whose last token is the prompt's last (it must be computed)
    assert second.num_cached_tokens == (len(prompt) - 1) // 4 * 4 == 44
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_prefix_cache_seeded_sampling_equals_cache_off(tiny_model):
    params = [
        SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=10, ignore_eos=True),
        SamplingParams(n=3, temperature=1.1, top_p=0.9, seed=11, max_tokens=8, ignore_eos=True),
    ]
    for p in params:
        want, _ = run_waves(tiny_model, p, enable_prefix_caching=False)
        got, engine = run_waves(tiny_model, p)
        assert got == want
        assert engine.stats.prefix_cache_hits > 0


def test_n_samples_share_the_prompt_pages(tiny_model):
    prompt = LONG_SYSTEM[:33]  # 8 full pages and one token
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    usage = {}
    for caching in (True, False):
        # Step by step, each step's tokens fetched by the step itself (no async scheduling).
        config = BASE | {"enable_prefix_caching": caching, "async_scheduling": False}
        llm = LLM(tiny_model, warm_up=False, **config)
        engine = llm.engine
        engine.add_request("n3", prompt, params)
        samples = engine._groups["n3"].samples
        engine.step()  # the first sample computes the prompt; the others wait for it
        if caching:
            assert [len(s.output_token_ids) for s in samples] == [1, 0, 0]
        engine.step()
        assert all(s.output_token_ids for s in samples)
        usage[caching] = engine.kv_cache_usage
        if caching:
            leader = samples[0].page_ids[:8]
            assert all(s.page_ids[:8] == leader for s in samples[1:])
            assert all(engine.pages.refcounts[p] == 3 for p in leader)
            assert engine.stats.prefix_cache_hits == 2 * 32
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.kv_cache_usage == 0.0
    assert usage[True] < usage[False]


def test_prefix_caching_off_has_no_cache(tiny_model):
    llm = LLM(tiny_model, warm_up=False, enable_prefix_caching=False, **BASE)
    llm.generate([OTHER, OTHER], GREEDY, use_tqdm=False)
    assert llm.engine.pages.cache is None
    assert llm.engine.stats.prefix_cache_queries == llm.engine.stats.prefix_cache_hits == 0
    with pytest.raises(ValueError, match="enable_prefix_caching must be a bool"):
        LLM(tiny_model, warm_up=False, enable_prefix_caching="false", **BASE)


def test_vllm_prompt_dicts(tiny_model, reference_outputs):
    llm = LLM(tiny_model, warm_up=False, **BASE)
    text = " ".join(f"w{t}" for t in PROMPTS[3])
    outs = llm.generate(
        [{"prompt_token_ids": PROMPTS[1]}, {"prompt": text}, text], GREEDY, use_tqdm=False
    )
    assert_same_greedy(tiny_model, PROMPTS[1], outs[0].outputs[0].token_ids, reference_outputs[1])
    assert outs[1].prompt_token_ids == outs[2].prompt_token_ids
    assert outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids
    one = llm.generate({"prompt_token_ids": PROMPTS[1]}, GREEDY, use_tqdm=False)
    assert one[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    for bad in ({"prompt": text, "prompt_token_ids": PROMPTS[1]}, {"text": text}, {}):
        with pytest.raises(ValueError, match="exactly one of"):
            llm.generate(bad, GREEDY, use_tqdm=False)
    assert llm.engine.pages.num_free == llm.engine.pages.num_usable

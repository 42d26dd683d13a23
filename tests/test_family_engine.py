"""The engine on windowed and soft-capped families: greedy continuations equal transformers'
(full-recompute greedy, eager attention) when batched with other prompts, under chunked
prefill whose chunk boundaries fall inside and across the sliding window, with prefix-cache
hits and under preemption; nothing compiles after warm-up.

The scenarios run on the `reference` attention backend (the oracle) and on `cpu`, the
engine's default here; the zero-recompile check uses the default.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TINY_VOCAB
from family_models import WINDOW, hf_greedy, hf_logits, write_case
from workloads import record_compilations, run_varied_workload

import ksana_jax
from ksana_jax import LLM, SamplingParams
from ksana_jax.step_programs import compile_count

STEPS = 10
TIE = 1e-4  # top-2 logit gaps below this are float noise: a batch shape may flip the pick
RNG = np.random.default_rng(7)
PROMPTS = [[int(t) for t in RNG.integers(3, TINY_VOCAB, n)] for n in (2, 5, 13, 23, 31)]
BASE = dict(
    max_model_len=64,
    page_size=4,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    context_buckets=(64,),
)
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
SCENARIOS = {
    "batched": {},
    # chunk boundaries every 5 tokens: inside the 6-token window of the current chunk
    "chunks5_inside_window": {"max_num_batched_tokens": 5, "max_num_seqs": 2},
    # 11-token chunks: each spans more than the window, boundaries across it
    "chunks11_across_window": {"max_num_batched_tokens": 11, "max_num_seqs": 4},
    # 19 usable pages of 4 tokens, while the five requests need about 30
    "preemption": {"num_pages": 20},
}


@pytest.fixture(scope="module", params=["mistral_window", "gemma2_softcap", "gemma3_text"])
def family(request, tmp_path_factory):
    """(transformers model, converted model, transformers' greedy outputs per prompt)."""
    path = tmp_path_factory.mktemp(request.param) / "hf"
    hf_model = write_case(path, request.param, eos_token_id=None)
    model = ksana_jax.load(path)
    assert model.config.sliding_window == WINDOW
    return hf_model, model, [hf_greedy(hf_model, p, STEPS)[0] for p in PROMPTS]


def assert_same_greedy(hf_model, prompt, got, want):
    """Equal, or equal up to a position where transformers' top two logits were a tie."""
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            top2 = np.sort(hf_logits(hf_model, list(prompt) + list(want[:i]))[-1])[-2:]
            assert top2[1] - top2[0] < TIE, f"diverged at {i}: {got} vs {want}"
            return
    assert len(got) == len(want)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_batched_greedy_equals_transformers(family, scenario, backend):
    hf_model, model, want = family
    config = BASE | SCENARIOS[scenario] | {"attention_backend": backend}
    llm = LLM(model, warm_up=False, **config)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, out, expected in zip(PROMPTS, outs, want, strict=True):
        assert_same_greedy(hf_model, prompt, out.outputs[0].token_ids, expected)
    if scenario == "preemption":
        assert llm.engine.stats.preemptions > 0
    assert llm.engine.pages.num_free == llm.engine.pages.num_usable


def test_prefix_cache_hits_keep_greedy_outputs(family):
    """Prompts sharing a prefix longer than the window: the second wave reuses the first's
    pages (the cached K/V of positions the window has already left included)."""
    hf_model, model, _ = family
    shared = PROMPTS[4] + PROMPTS[3][:9]  # 40 tokens: ten full pages
    prompts = [shared + p[:3] for p in PROMPTS[:3]]
    llm = LLM(model, warm_up=False, attention_backend="reference", **BASE)
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    hits = llm.engine.stats.prefix_cache_hits
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.stats.prefix_cache_hits > hits
    for prompt, a, b in zip(prompts, first, again, strict=True):
        want = hf_greedy(hf_model, prompt, STEPS)[0]
        assert_same_greedy(hf_model, prompt, a.outputs[0].token_ids, want)
        assert_same_greedy(hf_model, prompt, b.outputs[0].token_ids, want)


@pytest.mark.parametrize(
    "case", ["gemma2_softcap", "gemma3_text", "qwen3_window", "mistral_window"]
)
def test_no_compilation_after_warm_up(tmp_path, case):
    """Every family on the default backend, windowed and soft-capped where it has them: the
    per-layer window and caps are static, so serving after warm-up compiles nothing."""
    compiles = record_compilations()
    write_case(tmp_path / "hf", case, eos_token_id=None)
    model = ksana_jax.load(tmp_path / "hf")
    config = BASE | dict(max_model_len=256, context_buckets=(64, 256), num_pages=70)
    llm = LLM(model, **config)
    warm = compile_count()
    assert warm >= len(llm.engine.runner.bucket_shapes())
    compiles.clear()
    run_varied_workload(llm.engine, TINY_VOCAB)
    assert llm.engine.stats.preemptions > 0 and llm.engine.stats.prefix_cache_hits > 0
    assert compile_count() == warm
    assert compiles == []

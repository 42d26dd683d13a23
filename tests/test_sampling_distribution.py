"""The sampler's draws against the oracle's distribution: 4,000 draws per setting (each its own
seed and step; ties, permuted logits, each filter and their combinations, penalties), one
sampler call per setting: nothing sampled outside the oracle's set, every token of >= 1% seen,
each token's frequency within 0.03 of its probability."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from sampling_oracle import (
    DEFAULTS,
    M,
    V,
    make_inputs,
    np_allowed,
    np_penalties,
    np_probs,
    run,
)

from ksana_jax import sampling

DRAWS = 4000
_rng = np.random.default_rng(1234)
_BASE = np.sort(_rng.normal(size=V) * 1.3)[::-1].astype(np.float32)
_PERMUTED = _rng.permutation(_BASE)  # the same values, not in id order
_TIES = np.array([2.0, 2.0, 2.0, 1.0, 0.5, 0.3, 0.0, -0.5] * 2, np.float32)
_TIES[8:] -= 2.0
_HISTORY = np.array([1, 2, 3, 3, 0, 0, 0, 5, 1, -1, -1, -1])

STAT_CONFIGS = {  # name: (logits, sampler settings)
    "plain": (_BASE, dict()),
    "plain_permuted": (_PERMUTED, dict()),
    "temperature_0.5": (_BASE, dict(temperature=0.5)),
    "temperature_2": (_PERMUTED, dict(temperature=2.0)),
    "top_k_3": (_PERMUTED, dict(top_k=3)),
    "top_p_0.6": (_PERMUTED, dict(top_p=0.6, temperature=2.0)),
    "min_p_0.2": (_PERMUTED, dict(min_p=0.2, temperature=2.5)),
    "top_k_5_min_p_0.3": (_PERMUTED, dict(top_k=5, min_p=0.3, temperature=2.0)),
    "top_p_0.8_min_p_0.05": (_PERMUTED, dict(top_p=0.8, min_p=0.05, temperature=1.5)),
    "top_k_4_top_p_0.75": (_BASE, dict(top_k=4, top_p=0.75, temperature=1.5)),
    "top_k_6_top_p_0.6": (_PERMUTED, dict(top_k=6, top_p=0.6, temperature=2.5)),
    "top_k_8_top_p_0.7": (_PERMUTED, dict(top_k=8, top_p=0.7, temperature=3.0)),
    "top_k_1": (_PERMUTED, dict(top_k=1)),
    "top_p_tiny": (_PERMUTED, dict(top_p=1e-6)),
    "min_p_1": (_PERMUTED, dict(min_p=1.0)),
    "ties_top_p_0.2": (_TIES, dict(top_p=0.2)),
    "ties_top_k_2": (_TIES, dict(top_k=2)),
    "penalties": (
        _PERMUTED,
        dict(
            temperature=0.8,
            top_k=10,
            repetition_penalty=1.7,
            frequency_penalty=0.4,
            presence_penalty=0.3,
            num_prompt_tokens=3,
            history=_HISTORY,
        ),
    ),
}


def stat_oracle(logits, settings):
    settings = DEFAULTS | settings
    history = settings.get("history", np.full(M, -1))
    penalized = np_penalties(
        logits[None],
        history[None],
        [settings["num_prompt_tokens"]],
        [settings["repetition_penalty"]],
        [settings["presence_penalty"]],
        [settings["frequency_penalty"]],
    )[0]
    filters = {k: settings[k] for k in ("top_k", "top_p", "min_p")}
    return np_probs(penalized, settings["temperature"], **filters)


@pytest.fixture(scope="module", params=[None, (4, 8)], ids=["sorted", "largest4-8"])
def stat_draws(request):
    """DRAWS samples per config, all configs in one call, every row its own seed and step:
    over the whole vocabulary sorted (V = 16), or as XLA:CPU draws for a large one, among
    the 4 or 8 largest logits where they hold every kept token (sampling.FILTER_PREFIXES)."""
    with pytest.MonkeyPatch.context() as patch:
        if request.param is not None:
            patch.setattr(sampling, "FILTER_PREFIXES", request.param)
        jax.clear_caches()  # the sampler is traced afresh under these sizes
        yield draw_every_config()
    jax.clear_caches()


def draw_every_config():
    """Each config's draws in a sampler call of their own (a batch's rows share its way:
    one row keeping every token would draw every row's noise over the whole vocabulary)."""
    rng = np.random.default_rng(99)
    draws = {}
    for name, (row_logits, settings) in STAT_CONFIGS.items():
        settings = dict(settings)
        history = settings.pop("history", None)
        if history is not None:
            history = np.tile(history, (DRAWS, 1))
        seeds = rng.choice(2**32, size=DRAWS, replace=False)
        steps = rng.integers(0, 5000, DRAWS)
        rows = make_inputs(DRAWS, history, seeds=seeds, num_generated=steps, **settings)
        draws[name] = run(np.tile(row_logits, (DRAWS, 1)), rows).token_ids
    return draws


@pytest.mark.parametrize("name", list(STAT_CONFIGS))
def test_sampled_distribution_matches_oracle(stat_draws, name):
    probs = stat_oracle(*STAT_CONFIGS[name])
    tokens = stat_draws[name]
    allowed = set(np.flatnonzero(probs > 0).tolist())
    sampled = set(np.unique(tokens).tolist())
    assert sampled <= allowed, f"sampled {sorted(sampled - allowed)} outside {sorted(allowed)}"
    freq = np.bincount(tokens, minlength=V) / DRAWS
    # One standard error is at most sqrt(0.25 / 4000) = 0.008.
    assert np.abs(freq - probs).max() < 0.03, (np.round(freq, 3), np.round(probs, 3))
    # Every token the oracle gives >= 1% shows up (expected count >= 40).
    assert {int(t) for t in np.flatnonzero(probs >= 0.01)} <= sampled


def test_stat_configs_exercise_what_they_claim():
    """Guards the test inputs: only the deterministic configs are degenerate, and the
    combined filters really differ from each filter alone."""
    for name, config in STAT_CONFIGS.items():
        num_allowed = np.count_nonzero(stat_oracle(*config))
        assert num_allowed == 1 if name in ("top_k_1", "top_p_tiny", "min_p_1") else num_allowed > 1
    assert np.count_nonzero(stat_oracle(*STAT_CONFIGS["top_k_5_min_p_0.3"])) < 5
    for name in ("top_k_4_top_p_0.75", "top_k_6_top_p_0.6", "top_k_8_top_p_0.7"):
        logits, settings = STAT_CONFIGS[name]
        temperature = settings.get("temperature", 1.0)
        k, p = settings["top_k"], settings["top_p"]
        # top-p over the top-k survivors keeps fewer tokens than top-p over the whole
        # vocabulary intersected with top-k, so these configs tell the two orders apart.
        combined = np_allowed(logits, temperature, top_k=k, top_p=p)[0]
        separate = np_allowed(logits, temperature, top_k=k)[0]
        separate &= np_allowed(logits, temperature, top_p=p)[0]
        assert combined.sum() < separate.sum(), name
    probs = stat_oracle(*STAT_CONFIGS["ties_top_p_0.2"])
    np.testing.assert_allclose(probs[:3], 1 / 3)
    assert np.count_nonzero(probs) == 3
    assert np.count_nonzero(stat_oracle(*STAT_CONFIGS["ties_top_k_2"])) == 3
    plain = stat_oracle(*STAT_CONFIGS["plain_permuted"])
    assert np.abs(stat_oracle(*STAT_CONFIGS["penalties"]) - plain).max() > 0.05

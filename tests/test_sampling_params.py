"""SamplingParams validation: each bad value named in its error, the edges accepted,
stop strings and ids normalized."""

from __future__ import annotations

import numpy as np
import pytest

from ksana_jax.sampling_params import MAX_LOGIT_BIAS, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(n=0), "n"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=-0.01), "min_p"),
        (dict(min_p=1.01), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(presence_penalty=-2.01), "presence_penalty"),
        (dict(presence_penalty=2.01), "presence_penalty"),
        (dict(frequency_penalty=-2.01), "frequency_penalty"),
        (dict(frequency_penalty=2.01), "frequency_penalty"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens"),
        (dict(logprobs=-1), "logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(logit_bias={1: 100.5}), "logit_bias"),
        (dict(logit_bias={1: -101}), "logit_bias"),
        (dict(logit_bias={1: float("nan")}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={"x": 1.0}), "logit_bias"),
        (dict(logit_bias=[1, 2]), "logit_bias"),
        (dict(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}), "logit_bias"),
        (dict(seed=-1), "seed"),
        (dict(seed=2**32), "seed"),
        (dict(stop=""), "stop"),
        (dict(stop=["ok", ""]), "stop"),
    ],
)
def test_sampling_params_rejects(kwargs, field):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams(**kwargs)


def test_sampling_params_accepts_edges():
    for kwargs in [
        dict(n=1, temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0),
        dict(top_p=1e-9, top_k=0, min_p=1.0, repetition_penalty=1e-3),
        dict(presence_penalty=-2, frequency_penalty=2, seed=0, logprobs=0),
        dict(presence_penalty=2, frequency_penalty=-2, seed=2**32 - 1),
        dict(max_tokens=None, min_tokens=100),
        dict(max_tokens=4, min_tokens=4),
        dict(prompt_logprobs=0, logit_bias={i: -100 for i in range(MAX_LOGIT_BIAS)}),
    ]:
        SamplingParams(**kwargs)
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.5).greedy


def test_sampling_params_stop_normalized():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams().stop == ()
    assert SamplingParams(stop_token_ids=[3, np.int64(4)]).stop_token_ids == (3, 4)
    # JSON gives logit_bias string keys
    assert SamplingParams(logit_bias={"7": -100, 3: 5}).logit_bias == {7: -100.0, 3: 5.0}

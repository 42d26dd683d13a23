"""Engine integration of the attention backends: greedy tokens from the real SmolLM2 with the
xla backend and the Pallas ones (interpret mode on CPU) equal the reference backend's."""

from __future__ import annotations

import pytest

from ksana_jax import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def add(a, b):", "Water boils at"]
CONFIG = dict(
    max_model_len=128,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    token_buckets=(32,),
    seq_buckets=(4,),
    context_buckets=(32, 128),
)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def reference_tokens(smollm2):
    llm = LLM(smollm2, warm_up=False, attention_backend="reference", **CONFIG)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
def test_pallas_backend_greedy_equals_reference(smollm2, reference_tokens, backend):
    llm = LLM(smollm2, warm_up=False, attention_backend=backend, **CONFIG)
    assert llm.engine.runner.backend == backend
    with pytest.warns(UserWarning, match="interpret mode"):
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference_tokens


def test_xla_backend_greedy_equals_reference(smollm2, reference_tokens):
    llm = LLM(smollm2, warm_up=False, attention_backend="xla", **CONFIG)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference_tokens


def test_auto_backend_is_xla_on_cpu(smollm2):
    llm = LLM(smollm2, warm_up=False, **CONFIG)
    assert llm.engine.runner.backend == "xla"
    assert llm.engine.runner.context_buckets == (128,)  # the page-table width costs it nothing

"""Mixture-of-experts: the layer against a dense oracle (every expert on every token), for
both grouped-product forms, routings that send every token to one expert or spread them
evenly (one compiled function for all: routing is data), and the Mixtral / Qwen3-MoE
families through the engine: greedy continuations equal transformers' batched, under
chunked prefill, with prefix-cache hits and under preemption; nothing compiles after warm-up.

Logits of every MoE case against transformers are in test_families.py (family_models.py's
mixtral_* and qwen3_moe_* cases: top-k 1, 2 and 4, with and without renormalisation, dense
and sparse layers mixed).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_VOCAB
from family_models import hf_greedy, write_case
from test_family_engine import BASE, GREEDY, PROMPTS, SCENARIOS, STEPS, assert_same_greedy
from workloads import record_compilations, run_varied_workload

import ksana_jax
from checkpoints_tools import ConversionError, read_source
from ksana_jax import LLM, sharding
from ksana_jax.config import MOE_MLP, ModelConfig
from ksana_jax.models import moe
from ksana_jax.runner import compile_count

E, D, F, T = 8, 32, 24, 12


def moe_config(top_k: int, norm: bool) -> ModelConfig:
    return ModelConfig(
        "qwen3_moe", TINY_VOCAB, D, 16, 1, 2, 1, 16,
        mlp_types=(MOE_MLP,), num_experts=E, num_experts_per_tok=top_k,
        moe_intermediate_size=F, norm_topk_prob=norm,
    )  # fmt: skip


def weights(seed: int = 0):
    rng = np.random.default_rng(seed)
    shapes = {"w_gate_exps": (E, F, D), "w_up_exps": (E, F, D), "w_down_exps": (E, D, F)}
    return {k: jnp.asarray(0.3 * rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}


def layer_output(cfg, layer, x, router, method):
    routing = moe.route(x, router, cfg)
    experts = (layer["w_gate_exps"], layer["w_up_exps"], layer["w_down_exps"])
    return moe.expert_ffn(x, *routing, *experts, method=method)


@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("method", moe.METHODS)
def test_layer_equals_the_dense_oracle(top_k, norm, method):
    cfg, layer = moe_config(top_k, norm), weights()
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    router = jnp.asarray(rng.standard_normal((E, D)), jnp.float32)
    want = moe.reference_moe(x, router, *layer.values(), cfg)
    got = jax.jit(layer_output, static_argnums=(0, 4))(cfg, layer, x, router, method)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)


def test_experts_split_over_devices_sum_to_the_whole():
    """What each device computes under expert parallelism: its experts' share, others 0."""
    cfg, layer = moe_config(2, True), weights()
    x = jnp.asarray(np.random.default_rng(2).standard_normal((T, D)), jnp.float32)
    routing = moe.route(x, jnp.asarray(np.random.default_rng(3).standard_normal((E, D))), cfg)
    whole = moe.expert_ffn(x, *routing, *layer.values())
    for method in moe.METHODS:
        parts = [
            moe.expert_ffn(x, *routing, *(w[i : i + 2] for w in layer.values()), i, method)
            for i in range(0, E, 2)
        ]
        np.testing.assert_allclose(np.asarray(sum(parts)), np.asarray(whole), atol=2e-5)


def routings() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(x, router): all tokens to expert 0; tokens spread evenly, T / E to each expert."""
    same = np.zeros((E, D), np.float32)
    same[0] = 1.0
    x_same = np.abs(np.random.default_rng(4).standard_normal((T, D))).astype(np.float32) + 0.1
    even = np.eye(E, D, dtype=np.float32)
    x_even = 0.01 * np.random.default_rng(5).standard_normal((T, D)).astype(np.float32)
    x_even[np.arange(T), np.arange(T) % E] += 5.0
    return {"same": (x_same, same), "even": (x_even, even)}


def test_same_expert_and_even_routing_compile_once_and_equal_the_oracle():
    cfg, layer = moe_config(1, False), weights()
    step = jax.jit(lambda layer, x, router: layer_output(cfg, layer, x, router, "ragged"))
    cases = routings()
    wants = {}
    for name, (x, router) in cases.items():
        ids = np.asarray(moe.route(jnp.asarray(x), jnp.asarray(router), cfg)[1])[:, 0]
        counts = np.bincount(ids, minlength=E)
        assert counts.max() == (T if name == "same" else -(-T // E)), (name, counts)
        wants[name] = moe.reference_moe(jnp.asarray(x), jnp.asarray(router), *layer.values(), cfg)
    compiles = record_compilations()
    for name, (x, router) in cases.items():
        got = step(layer, x, router)
        np.testing.assert_allclose(np.asarray(got), np.asarray(wants[name]), atol=2e-5, rtol=0)
    assert step._cache_size() == 1 and len(compiles) == 1, compiles


# ----------------------------------------------------------------------------- families


@pytest.fixture(scope="module", params=["mixtral_top1_window", "qwen3_moe_mixed_top2"])
def moe_family(request, tmp_path_factory):
    """(transformers model, converted model, transformers' greedy outputs per prompt)."""
    path = tmp_path_factory.mktemp(request.param) / "hf"
    hf_model = write_case(path, request.param, eos_token_id=None)
    model = ksana_jax.load(path)
    return hf_model, model, [hf_greedy(hf_model, p, STEPS)[0] for p in PROMPTS]


@pytest.mark.parametrize("scenario", ["batched", "chunks5_inside_window", "preemption"])
def test_moe_greedy_equals_transformers(moe_family, scenario):
    hf_model, model, want = moe_family
    llm = LLM(model, warm_up=False, **BASE | SCENARIOS[scenario])
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, out, expected in zip(PROMPTS, outs, want, strict=True):
        assert_same_greedy(hf_model, prompt, out.outputs[0].token_ids, expected)
    if scenario == "preemption":
        assert llm.engine.stats.preemptions > 0


def test_moe_prefix_cache_hits_keep_greedy_outputs(moe_family):
    hf_model, model, _ = moe_family
    prompts = [PROMPTS[4] + PROMPTS[3][:9] + p[:3] for p in PROMPTS[:3]]
    llm = LLM(model, warm_up=False, **BASE)
    llm.generate(prompts, GREEDY, use_tqdm=False)
    hits = llm.engine.stats.prefix_cache_hits
    again = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.stats.prefix_cache_hits > hits
    for prompt, out in zip(prompts, again, strict=True):
        want = hf_greedy(hf_model, prompt, STEPS)[0]
        assert_same_greedy(hf_model, prompt, out.outputs[0].token_ids, want)


def test_moe_no_compilation_after_warm_up(moe_family):
    """Tokens of every workload route differently; the compiled steps stay the same."""
    _, model, _ = moe_family
    if model.config.model_type != "qwen3_moe":
        pytest.skip("one family: the MoE layer is the same code in both")
    compiles = record_compilations()
    config = BASE | dict(max_model_len=256, context_buckets=(64, 256), num_pages=70)
    llm = LLM(model, **config)
    warm = compile_count()
    compiles.clear()
    run_varied_workload(llm.engine, TINY_VOCAB)
    assert llm.engine.stats.preemptions > 0 and llm.engine.stats.prefix_cache_hits > 0
    assert compile_count() == warm and compiles == []


def test_quantizing_an_moe_model_is_refused(moe_family, tmp_path):
    _, model, _ = moe_family
    with pytest.raises(ValueError, match="not supported for mixture-of-experts"):
        model.with_quantization("int8")
    write_case(tmp_path / "hf", "qwen3_moe_top4_norm")
    with pytest.raises(ConversionError, match="not supported for mixture-of-experts"):
        read_source(tmp_path / "hf", quantization="int4")


def test_expert_count_that_tp_does_not_divide_is_refused():
    cfg = dataclasses.replace(moe_config(2, True), expert_parallel=True)
    with pytest.raises(ValueError, match=r"num_experts \(8\) divisible by"):
        sharding.make_plan(cfg, 3)


# ----------------------------------------------------------------------------- tensor parallel


def test_tensor_and_expert_parallel_match_one_device(tmp_path):
    """tp 2 and 4 (4 CPU devices), experts split by F or whole (expert parallel): the greedy
    tokens and logits of one device; with expert parallelism each device holds 1/tp of the
    expert bytes (from the arrays' shards), and attention stays split by heads."""
    from test_sharding import LOGITS_RTOL, run_worker

    from checkpoints_tools import convert

    heads = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=16)
    write_case(tmp_path / "hf", "qwen3_moe_mixed_top2", eos_token_id=None, **heads)
    runs = run_worker("moe", convert(tmp_path / "hf", tmp_path / "ckpt"))
    print({k: (r["expert_bytes_per_device"], r["bytes"]["per_device"]) for k, r in runs.items()})
    for name, run in runs.items():
        tp = int(name[0])
        assert run["shardings_match_plan"], name
        assert run["tokens"] == runs["1"]["tokens"], name
        assert run["logits_max_diff"] <= LOGITS_RTOL * run["logits_max_abs"], name
        per_device = run["expert_bytes_per_device"]
        assert len(per_device) == tp and max(per_device) <= run["expert_bytes_total"] / tp, name
        if tp > 1:
            assert "split by heads" in run["plan"], run["plan"]
            assert ("expert parallel" in run["plan"]) == name.endswith("-ep"), run["plan"]

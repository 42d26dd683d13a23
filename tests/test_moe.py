"""Mixture-of-experts: the layer in every grouped-product form against a dense oracle (every
expert on every token), whole and split over expert ranges; routings that send every token to
one expert or spread them evenly (one compiled function for all: routing is data); and the
Mixtral / Qwen3-MoE families through the engine: one run per family, batched with chunked
prefill, preemption and prefix-cache hits, whose greedy continuations equal transformers'
and which compiles nothing after warm-up.

Logits of every MoE case against transformers are in test_families.py (family_models.py's
mixtral_* and qwen3_moe_* cases: top-k 1, 2 and 4, with and without renormalisation, dense
and sparse layers mixed).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_VOCAB
from family_models import hf_greedy, write_case
from test_family_engine import BASE, GREEDY, PROMPTS, STEPS, assert_same_greedy
from workloads import record_compilations

import ksana_jax
from checkpoints_tools import ConversionError, read_source
from ksana_jax import LLM, sharding
from ksana_jax.config import MOE_MLP, ModelConfig
from ksana_jax.models import moe
from ksana_jax.step_programs import compile_count

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


def all_forms(cfg: ModelConfig, layer: dict, x: jax.Array, router: jax.Array, split: bool):
    """The layer's output in every form (moe.METHODS), and with `split` also as the sum of two
    devices' expert ranges (what each computes under expert parallelism)."""
    weights, ids = moe.route(x, router, cfg)
    experts = (layer["w_gate_exps"], layer["w_up_exps"], layer["w_down_exps"])
    out = {}
    for method in moe.METHODS:
        out[method] = moe.expert_ffn(x, weights, ids, *experts, method=method)
        if split:
            halves = [(w[: E // 2], w[E // 2 :]) for w in experts]
            low, high = ([h[i] for h in halves] for i in (0, 1))
            out[f"{method} split"] = moe.expert_ffn(
                x, weights, ids, *low, 0, method
            ) + moe.expert_ffn(x, weights, ids, *high, E // 2, method)
    return out


@pytest.mark.parametrize(("top_k", "norm"), [(1, False), (2, True), (4, False)])
def test_every_form_equals_the_dense_oracle(top_k, norm):
    cfg, layer = moe_config(top_k, norm), weights()
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    router = jnp.asarray(rng.standard_normal((E, D)), jnp.float32)
    want = np.asarray(moe.reference_moe(x, router, *layer.values(), cfg))
    split = top_k == 2
    got = jax.jit(all_forms, static_argnums=(0, 4))(cfg, layer, x, router, split)
    assert len(got) == len(moe.METHODS) * (1 + split)
    for form, out in got.items():
        np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=0, err_msg=form)


def test_the_platform_picks_the_form():
    assert moe.choose_method(4, 8, "cpu") == moe.choose_method(4, 8, "tpu") == "gather"
    assert moe.choose_method(64, 8, "cpu") == "blocks"
    assert moe.choose_method(64, 8, "tpu") == moe.choose_method(64, 8, "gpu") == "ragged"


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
    """Every form in one compiled function; both routings run it without compiling again."""
    cfg, layer = moe_config(1, False), weights()
    step = jax.jit(functools.partial(all_forms, cfg, split=False))
    cases = routings()
    wants = {}
    for name, (x, router) in cases.items():
        ids = np.asarray(moe.route(jnp.asarray(x), jnp.asarray(router), cfg)[1])[:, 0]
        counts = np.bincount(ids, minlength=E)
        assert counts.max() == (T if name == "same" else -(-T // E)), (name, counts)
        wants[name] = moe.reference_moe(jnp.asarray(x), jnp.asarray(router), *layer.values(), cfg)
    compiles = record_compilations()
    for name, (x, router) in cases.items():
        for form, out in step(layer, x, router).items():
            np.testing.assert_allclose(
                np.asarray(out), np.asarray(wants[name]), atol=2e-5, rtol=0, err_msg=form
            )
    assert step._cache_size() == 1 and len(compiles) == 1, compiles


# ----------------------------------------------------------------------------- families


@pytest.fixture(scope="module", params=["mixtral_top1", "qwen3_moe_mixed_top2"])
def moe_family(request, tmp_path_factory):
    """(HF directory, transformers model, converted model)."""
    path = tmp_path_factory.mktemp(request.param) / "hf"
    hf_model = write_case(path, request.param, eos_token_id=None)
    return path, hf_model, ksana_jax.load(path)


# Batched (4 sequences a step), chunked (11-token chunks; prompts up to 43), preempted (19
# usable pages of 4 tokens for requests needing about 30) and, in the second wave, prompts
# opening with the first wave's longest one: prefix-cache hits.
ENGINE = BASE | dict(max_num_batched_tokens=11, max_num_seqs=4, num_pages=20)


def test_moe_engine_greedy_equals_transformers_and_compiles_nothing_after_warm_up(moe_family):
    """Tokens of every step route differently; the compiled steps stay those of warm-up."""
    _, hf_model, model = moe_family
    compiles = record_compilations()
    llm = LLM(model, **ENGINE)
    warm = compile_count()
    compiles.clear()
    waves = [PROMPTS, [PROMPTS[4] + PROMPTS[3][:9] + p[:3] for p in PROMPTS[:3]]]
    for wave in waves:
        outs = llm.generate(wave, GREEDY, use_tqdm=False)
        for prompt, out in zip(wave, outs, strict=True):
            want = hf_greedy(hf_model, prompt, STEPS)[0]
            assert_same_greedy(hf_model, prompt, out.outputs[0].token_ids, want)
    stats = llm.engine.stats
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0, stats
    assert compile_count() == warm and compiles == []


def test_quantizing_an_moe_model_is_refused(moe_family):
    path, _, model = moe_family
    with pytest.raises(ValueError, match="not supported for mixture-of-experts"):
        model.with_quantization("int8")
    with pytest.raises(ConversionError, match="not supported for mixture-of-experts"):
        read_source(path, quantization="int4")


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
    layers = dict(num_hidden_layers=2, mlp_only_layers=[], decoder_sparse_step=2)  # dense, MoE
    write_case(tmp_path / "hf", "qwen3_moe_mixed_top2", eos_token_id=None, **heads | layers)
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

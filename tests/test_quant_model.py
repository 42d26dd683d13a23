"""Whole models with quantized weights: load-time quantization of a tiny random Llama against
its float model, the engine with `quantization=`, the bytes the params take."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from conftest import TINY_VOCAB, run_on_cpu_devices, write_tiny_hf
from workloads import record_compilations, run_varied_workload

import ksana_jax
from ksana_jax import LLM, EngineConfig, SamplingParams, quant
from ksana_jax.models import registry
from ksana_jax.pallas_kernels import linear_cpu
from ksana_jax.step_programs import compile_count

TOKENS = [int(t) for t in np.random.default_rng(0).integers(3, TINY_VOCAB, 40)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "hf"
    # intermediate 128: every input dim (96, 128) divides into int4's groups of 32.
    write_tiny_hf(path, intermediate_size=128, initializer_range=0.02)
    return path


@pytest.fixture(scope="module")
def float_model(tiny_dir):
    return ksana_jax.load(tiny_dir)


def dequantized(model):
    """The float model holding exactly the values the quantized one stands for."""
    params = jax.tree.map(
        lambda x: quant.dequantize(x) if quant.is_quantized(x) else x,
        model.params,
        is_leaf=quant.is_quantized,
    )
    return dataclasses.replace(model, params=model.plan.shard_params(params), quantization=None)


@pytest.mark.parametrize("fmt", quant.QUANTIZATIONS)
def test_quantized_model_equals_its_dequantized_float_model(tiny_dir, fmt):
    model = ksana_jax.load(tiny_dir, quantization=fmt)
    assert model.quantization == fmt and model.dtype == "float32"
    kinds = {type(x) for x in jax.tree.leaves(model.params, is_leaf=quant.is_quantized)}
    assert quant.Int8Matrix in kinds or quant.Int4Matrix in kinds
    got, want = model.logits(TOKENS), dequantized(model).logits(TOKENS)
    # Same weight values; only where XLA rounds the float32 products differs.
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


# Tolerances, derived: round to nearest leaves a uniform error of RMS step / sqrt(12) per
# weight. int8 per channel: step = max|w| / 127 and a Gaussian row of ~100 weights has
# max|w| ~ 2.6 sigma, so ~0.6% of the weights' RMS; int4 groups of 32: step = range / 15
# ~ 4 sigma / 15, so ~7.7%. The logits go through ~13 matrices in series here (3 layers x
# q/k/v/o + gate/up/down, the LM head); independent errors add in quadrature, so expect
# ~sqrt(13) x that: ~2.2% (int8), ~28% (int4) of the logits' spread (measured: 1.7%, 21%).
# Bounds: 1.5x those expectations for the RMS, and 5x the int8 RMS for the largest entry.
@pytest.mark.parametrize(("fmt", "rms_bound"), [("int8", 0.03), ("int4", 0.40)])
def test_quantized_logits_are_close_to_float(tiny_dir, float_model, fmt, rms_bound):
    want = float_model.logits(TOKENS)
    got = ksana_jax.load(tiny_dir, quantization=fmt).logits(TOKENS)
    spread = want.std()
    assert np.sqrt(np.mean((got - want) ** 2)) <= rms_bound * spread
    if fmt == "int8":
        assert np.abs(got - want).max() <= 0.15 * spread
        assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.parametrize(("fmt", "bound"), [("int8", 0.55), ("int4", 0.35)])
def test_params_take_the_packed_bytes(tiny_dir, fmt, bound):
    """int8 is 1 byte a weight (+ a float32 scale per row), int4 half a byte (+ 2 float16
    per 32): ~1/2 and ~5/16 of bfloat16; norms stay float32."""
    bf16 = quant.nbytes(ksana_jax.load(tiny_dir, dtype="bfloat16").params)
    model = ksana_jax.load(tiny_dir, dtype="bfloat16", quantization=fmt)
    assert model.dtype == "bfloat16"
    assert quant.nbytes(model.params) <= bound * bf16
    on_device = sum(x.nbytes for x in jax.tree.leaves(model.params))  # the device arrays
    assert on_device == quant.nbytes(model.params)


def test_engine_quantizes_a_float_model_and_never_recompiles(float_model):
    compiles = record_compilations()
    llm = LLM(
        float_model,
        quantization="int4",
        max_model_len=256,
        page_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        context_buckets=(64, 256),
        num_pages=70,
    )
    assert llm.engine.model.quantization == "int4"
    warm = compile_count()
    compiles.clear()
    run_varied_workload(llm.engine, TINY_VOCAB)
    assert compile_count() == warm
    assert compiles == []
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = llm.generate([TOKENS], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert got[0] == int(llm.engine.model.logits(TOKENS)[-1].argmax())


def test_bad_quantization_is_refused_by_name(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="unsupported quantization 'int3'"):
        ksana_jax.load(tiny_dir, quantization="int3")
    odd = tmp_path / "odd"
    write_tiny_hf(odd)  # intermediate_size 112: w_down's input dim is not a multiple of 32
    with pytest.raises(ValueError, match=r"down_proj.*divisible by 32"):
        ksana_jax.load(odd, quantization="int4")
    assert ksana_jax.load(odd, quantization="int8").quantization == "int8"


def test_cli_has_the_quantization_flag():
    from ksana_jax.cli import build_parser

    parser = build_parser()
    serve = parser.parse_args(["serve", "demo", "--quantization", "int4"])
    generate = parser.parse_args(["generate", "demo", "hi", "--quantization", "int8"])
    assert serve.quantization == "int4" and generate.quantization == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "demo", "--quantization", "int3"])


TP_SCRIPT = """
import json, sys
import numpy as np
import ksana_jax
from checkpoints_tools import convert
from ksana_jax import sharding
hf, out, tokens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
convert(hf, out, quantization="int4")
result = {}
for tp in (1, 2, 4):
    for name, path in (("load", hf), ("checkpoint", out)):
        model = ksana_jax.load(path, tensor_parallel_size=tp, quantization="int4")
        per_device = sharding.bytes_per_device(model.params)
        stacked = "stacked_layers" in model.params
        result[f"{name}{tp}"] = [model.logits(tokens).tolist(), max(per_device.values()), stacked]
print(json.dumps(result))
"""


def test_tensor_parallel_int4_equals_one_device(tiny_dir, tmp_path):
    """tp=2 and 4 on forced CPU devices: the packed arrays and their scales shard like the
    matrices (scales along the same out axis), and the logits equal tp=1's, whose layer
    matrices are held stacked for the CPU kernel (registry.stack_layers) where a mesh's are
    per layer."""
    result = run_on_cpu_devices(
        TP_SCRIPT, str(tiny_dir), str(tmp_path / "ckpt"), json.dumps(TOKENS)
    )
    want = np.asarray(result["load1"][0])
    for key, (_, _, stacked) in result.items():
        assert stacked == (key.endswith("1") and linear_cpu.indexes_layers()), key
    for key, (logits, _, _) in result.items():
        np.testing.assert_allclose(np.asarray(logits), want, rtol=0, atol=1e-5, err_msg=key)
    assert result["load2"][1] < 0.8 * result["load1"][1]  # split, not replicated
    assert result["checkpoint2"][1] == result["load2"][1]


@pytest.mark.skipif(not linear_cpu.indexes_layers(), reason="no CPU kernel to index them")
def test_one_device_holds_quantized_layer_matrices_stacked(tiny_dir):
    """On one CPU device the int4 layer matrices are held stacked over the layers
    (registry.stack_layers: the kernel reads each layer's in place), so a step takes one set
    of arrays for each instead of one a layer; the logits are exactly those of the same
    matrices held per layer, and the checkpoint's flat params are the same either way."""
    model = ksana_jax.load(tiny_dir, quantization="int4")
    num_layers = model.config.num_hidden_layers
    stacked = model.params[registry.STACKED]
    assert sorted(stacked) == ["w_down", "w_gate_up", "wo", "wqkv"]
    assert all(m.packed.shape[0] == num_layers and m.layer is None for m in stacked.values())
    per_layer = registry.unstack(model.params)
    assert registry.STACKED not in per_layer and "wqkv" in per_layer["layers"][-1]
    arrays = [len(jax.tree.leaves(p)) for p in (per_layer, model.params)]
    assert arrays[0] - arrays[1] == 4 * 3 * (num_layers - 1)  # packed, scales, mins
    views = registry.layer_params(model.params)
    assert [v["wo"].layer for v in views] == list(range(num_layers))
    flat = [registry.params_to_flat(p, model.config) for p in (model.params, per_layer)]
    assert jax.tree.structure(flat[0]) == jax.tree.structure(flat[1])
    for a, b in zip(jax.tree.leaves(flat[0]), jax.tree.leaves(flat[1]), strict=True):
        np.testing.assert_array_equal(a, b)
    per_layer_model = dataclasses.replace(model, params=per_layer)
    np.testing.assert_array_equal(model.logits(TOKENS), per_layer_model.logits(TOKENS))
    assert registry.STACKED in model.plan.shard_params(per_layer)  # placing stacks them again
    bf16 = model.with_dtype("bfloat16").params  # placed again, stacked as they were
    assert sorted(bf16[registry.STACKED]) == sorted(stacked) and "wo" not in bf16["layers"][0]


def test_with_dtype_changes_the_matmul_dtype_not_the_packed_values(tiny_dir):
    model = ksana_jax.load(tiny_dir, quantization="int4")
    bf16 = model.with_dtype("bfloat16")
    wq, wq16 = (quant.unstacked(registry.layer_params(m.params)[0]["wqkv"]) for m in (model, bf16))
    assert bf16.dtype == "bfloat16" and wq16.dtype == "bfloat16"
    np.testing.assert_array_equal(np.asarray(wq16.packed), np.asarray(wq.packed))
    assert bf16.params["final_norm"].dtype == jax.numpy.bfloat16
    got, want = bf16.logits(TOKENS), model.logits(TOKENS)
    assert np.sqrt(np.mean((got - want) ** 2)) <= 0.05 * want.std()


def step_memory(model):
    """(argument bytes, temporary bytes) of the compiled 16-token logits step."""
    from ksana_jax.kv_cache import KVCacheSpec, allocate_kv
    from ksana_jax.step import logits_step
    from ksana_jax.step_inputs import SequenceChunk, build_step_inputs

    spec = KVCacheSpec.for_model(model.config, 3, 16, "bfloat16")
    inputs = build_step_inputs([SequenceChunk([5] * 16, 0, range(1, 3))], 16, 16, 1, 2)
    kv = allocate_kv(spec, model.plan.kv_sharding(spec.shape))
    indices = np.arange(16, dtype=np.int32)
    compiled = logits_step.lower(model.params, model.config, kv, inputs, indices).compile()
    analysis = compiled.memory_analysis()
    return analysis.argument_size_in_bytes, analysis.temp_size_in_bytes


@pytest.mark.parametrize("fmt", quant.QUANTIZATIONS)
def test_compiled_step_holds_packed_weights_and_one_dequantized_matrix(tiny_dir, fmt):
    """The step's arguments are the packed bytes, and its temporaries hold at most one
    dequantized matrix at a time (quant.after), not a dequantized copy of the model."""
    dense = ksana_jax.load(tiny_dir, dtype="bfloat16")
    model = dense.with_quantization(fmt)
    dense_args, dense_temp = step_memory(dense)
    args, temp = step_memory(model)
    assert args - dense_args == quant.nbytes(model.params) - quant.nbytes(dense.params)
    largest = max(x.size * 2 for x in jax.tree.leaves(dense.params))  # bfloat16 bytes
    assert temp <= dense_temp + largest


@pytest.mark.skipif(not linear_cpu.indexes_layers(), reason="no CPU linear kernel here")
def test_a_quantized_float32_model_on_cpu_says_bfloat16_decodes_faster(float_model, caplog):
    """int4 weights in float32 products miss the CPU kernel's integer dots (bfloat16 products
    only): the engine says so once, naming the option; not for a bfloat16 model."""
    options = dict(quantization="int4", max_model_len=64, max_num_seqs=1, warm_up=False)
    with caplog.at_level("WARNING", logger="ksana_jax.runner"):
        LLM(float_model, **options)
    assert [r.getMessage() for r in caplog.records if "dtype='bfloat16'" in r.getMessage()]
    caplog.clear()
    with caplog.at_level("WARNING", logger="ksana_jax.runner"):
        LLM(float_model, dtype="bfloat16", **options)
    assert not [r for r in caplog.records if "dtype='bfloat16'" in r.getMessage()]

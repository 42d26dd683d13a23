"""q/k/v and gate/up fused at load (ksana_jax/models/fusion.py): the fused matrices give the
parts' products exactly, split back into the checkpoint's parts bit for bit (float, int8
of either grouping, int4), put whole KV-head groups and whole MLP rows on each device of
a contiguous split, and parts that cannot be fused stay apart and still run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ksana_jax import quant
from ksana_jax.config import ModelConfig
from ksana_jax.models import fusion, layers, registry
from ksana_jax.pallas_kernels import reference

RNG = np.random.default_rng(11)
# 8 query heads, 4 KV heads of 16 (groups of 2), D 64, F 96, 3 layers, with q/k/v biases.
CFG = ModelConfig("qwen2", 50, 64, 96, 3, 8, 4, 16, qkv_bias=True)
N, K, H, D, F, L = 8, 4, 16, 64, 96, 3


def parts() -> dict[str, np.ndarray]:
    shapes = {
        "layers.wq": (L, N * H, D),
        "layers.wk": (L, K * H, D),
        "layers.wv": (L, K * H, D),
        "layers.bq": (L, N * H),
        "layers.bk": (L, K * H),
        "layers.bv": (L, K * H),
        "layers.w_gate": (L, F, D),
        "layers.w_up": (L, F, D),
    }
    return {k: RNG.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def quantized(flat: dict, fmt: str) -> dict:
    """`flat` with its weight matrices (not the biases) quantized to `fmt`."""
    return {k: quant.quantize(v, fmt) if k.startswith("layers.w") else v for k, v in flat.items()}


@pytest.mark.parametrize("fmt", [None, "int8", "int4"])
def test_fuse_then_unfuse_gives_the_parts_back(fmt):
    flat = parts()
    if fmt:
        flat = quantized(flat, fmt)
    fused = fusion.fuse(flat, CFG)
    assert set(fused) == {"layers.wqkv", "layers.bqkv", "layers.w_gate_up"}
    assert fused["layers.wqkv"].shape == (L, (N + 2 * K) * H, D)
    assert fused["layers.w_gate_up"].shape == (L, 2 * F, D)
    back = fusion.unfuse(fused, CFG)
    assert set(back) == set(flat)
    for name, want in flat.items():
        got = back[name]
        assert type(got) is type(want), name
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=name)


def test_rows_are_grouped_by_kv_head_and_by_mlp_row():
    """The first half of wqkv's rows (what the first of two devices holds when the KV heads
    are split over two) is KV heads 0-1 with their query heads 0-3; w_gate_up's rows
    alternate gate row f, up row f."""
    flat = parts()
    fused = fusion.fuse(flat, CFG)
    wqkv, half = fused["layers.wqkv"][0], (N + 2 * K) * H // 2
    q, k, v = (flat[f"layers.w{p}"][0] for p in "qkv")
    group = [q[: 2 * H], k[:H], v[:H], q[2 * H : 4 * H], k[H : 2 * H], v[H : 2 * H]]
    np.testing.assert_array_equal(wqkv[:half], np.concatenate(group))
    gate_up = fused["layers.w_gate_up"][1]
    np.testing.assert_array_equal(gate_up[0::2], flat["layers.w_gate"][1])
    np.testing.assert_array_equal(gate_up[1::2], flat["layers.w_up"][1])


@pytest.mark.parametrize("fmt", [None, "int4"])
def test_fused_products_equal_the_parts_products(fmt):
    """qkv_projection and gated_mlp on the fused layer equal the same on the parts kept
    apart (the path for parts that cannot be fused) and the jnp products by hand."""
    flat = parts()
    if fmt:
        flat = quantized(flat, fmt)
    flat["layers.w_down"] = RNG.standard_normal((L, D, F)).astype(np.float32)
    fused = registry.params_from_flat(flat, CFG)["layers"][1]
    apart = {k.removeprefix("layers."): jax.tree.map(lambda a: a[1], v) for k, v in flat.items()}
    assert "wqkv" in fused and "wq" not in fused and "wq" in apart
    x = jnp.asarray(RNG.standard_normal((5, D)), jnp.float32)
    got = layers.qkv_projection(CFG, fused, x)
    assert got.shape == (5, K, N // K + 2, H)
    np.testing.assert_allclose(got, layers.qkv_projection(CFG, apart, x), rtol=0, atol=1e-4)
    w = {k: quant.dequantize(v) if quant.is_quantized(v) else v for k, v in apart.items()}
    q = (x @ w["wq"].T + w["bq"]).reshape(5, N, H)
    k = (x @ w["wk"].T + w["bk"]).reshape(5, K, H)
    got_q, got_k, _ = reference.split_qkv(got)
    np.testing.assert_allclose(got_q, q, rtol=0, atol=1e-4)
    np.testing.assert_allclose(got_k, k, rtol=0, atol=1e-4)
    mlp = (jax.nn.silu(x @ w["w_gate"].T) * (x @ w["w_up"].T)) @ w["w_down"].T
    np.testing.assert_allclose(layers.gated_mlp(x, fused), mlp, rtol=0, atol=1e-3)
    np.testing.assert_allclose(layers.gated_mlp(x, apart), mlp, rtol=0, atol=1e-3)


def test_int8_scales_of_both_groupings_fuse_exactly():
    """A GGUF's Q8_0 blocks (groups of 32, float16 scales) beside a requantized per-channel
    matrix fuse with float32 per-group scales: the same dequantized values."""
    flat = parts()
    per_channel = quant.quantize(flat["layers.wk"], "int8")
    q8 = flat["layers.wq"].reshape(L, N * H, D // 32, 32)
    scales = (np.abs(q8).max(-1) / 127).astype(np.float16)
    values = np.rint(q8 / scales.astype(np.float32)[..., None]).astype(np.int8)
    blocks = quant.Int8Matrix(values.reshape(L, N * H, D), scales)
    flat |= {"layers.wq": blocks, "layers.wk": per_channel, "layers.wv": per_channel}
    fused = fusion.fuse(flat, CFG)["layers.wqkv"]
    assert isinstance(fused, quant.Int8Matrix) and fused.scales.dtype == np.float32
    back = fusion.unfuse({"layers.wqkv": fused}, CFG)
    for name in ("layers.wq", "layers.wk"):
        np.testing.assert_array_equal(quant.dequantize(back[name]), quant.dequantize(flat[name]))


def test_parts_of_different_formats_stay_apart():
    """Kept Q4_0 blocks beside kept Q8_0 ones cannot share one matrix: q/k/v stay apart (and
    so do their biases); gate/up still fuse."""
    flat = parts()
    flat["layers.wq"] = quant.quantize(flat["layers.wq"], "int4")
    flat["layers.wk"] = quant.quantize(flat["layers.wk"], "int8")
    fused = fusion.fuse(flat, CFG)
    assert {"layers.wq", "layers.wk", "layers.wv", "layers.bq"} <= set(fused)
    assert "layers.wqkv" not in fused and "layers.bqkv" not in fused
    assert "layers.w_gate_up" in fused
    back = fusion.unfuse(fused, CFG)
    assert set(back) == set(flat)


def test_a_layer_passes_six_arrays_where_it_passed_nine():
    """Structural: a Llama layer without biases is attn_norm, wqkv, wo, mlp_norm, w_gate_up,
    w_down -- 6 arrays, not 9; an int4 layer 14 (3 per matrix), not 23."""
    cfg = ModelConfig("llama", 64, 64, 96, 2, 4, 2, 16)
    params = registry.init_params(cfg)
    assert sorted(params["layers"][0]) == sorted(
        ["attn_norm", "wqkv", "wo", "mlp_norm", "w_gate_up", "w_down"]
    )
    int4 = quant.quantize_params(params, "int4")
    assert len(jax.tree.leaves(int4["layers"][0])) == 2 + 4 * 3

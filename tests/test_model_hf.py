"""Tiny random checkpoints written by transformers -> convert -> logits equal transformers'."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TINY_VOCAB, hf_logits, write_tiny_hf

import ksana_jax
from checkpoints_tools import convert

RNG = np.random.default_rng(1234)
TOKENS = [int(t) for t in RNG.integers(3, TINY_VOCAB, 45)]  # spans several 16-token pages

CASES = {
    "llama_untied": dict(kind="llama"),
    "llama_tied": dict(kind="llama", tie_word_embeddings=True),
    "llama_attention_bias": dict(kind="llama", attention_bias=True),
    "llama3_rope": dict(
        kind="llama",
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "linear_rope": dict(
        kind="llama", rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    ),
    "explicit_head_dim": dict(kind="llama", head_dim=32),
    "mha_no_gqa": dict(kind="llama", num_key_value_heads=6),
    "qwen2": dict(kind="qwen2"),
    "mistral": dict(kind="mistral"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_converted_logits_match_transformers(tmp_path, case):
    hf_model = write_tiny_hf(tmp_path / "hf", **CASES[case])
    out = convert(tmp_path / "hf", tmp_path / "ckpt")
    model = ksana_jax.load(out)
    got = model.logits(TOKENS)
    want = hf_logits(hf_model, TOKENS)
    assert got.shape == (len(TOKENS), TINY_VOCAB)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("layout", ["4.x", "5.x"])
def test_sharded_safetensors_and_both_config_layouts(tmp_path, layout):
    hf_model = write_tiny_hf(
        tmp_path / "hf",
        layout=layout,
        max_shard_size="40KB",
        rope_parameters={"rope_type": "linear", "rope_theta": 5e4, "factor": 4.0},
    )
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    model = ksana_jax.load(tmp_path / "hf")  # in-memory conversion of the HF directory
    assert model.config.rope_scaling is not None and model.config.rope_theta == 5e4
    np.testing.assert_allclose(model.logits(TOKENS), hf_logits(hf_model, TOKENS), atol=1e-4)


def test_bfloat16_params_stay_close_to_float32(tmp_path):
    hf_model = write_tiny_hf(tmp_path / "hf")
    out = convert(tmp_path / "hf", tmp_path / "ckpt", dtype="bfloat16")
    model = ksana_jax.load(out)
    assert model.dtype == "bfloat16" and model.config.dtype == "bfloat16"
    want = hf_logits(hf_model, TOKENS)
    got = model.logits(TOKENS)
    assert got.dtype == np.float32
    # bf16 weights carry ~3 significant digits; logits of this model are O(0.1).
    np.testing.assert_allclose(got, want, atol=2e-2)
    assert np.abs(got - want).max() > 1e-6  # it really ran in bfloat16


def test_bfloat16_checkpoint_loads_as_its_own_dtype(tmp_path):
    write_tiny_hf(tmp_path / "hf", dtype="bfloat16")
    model = ksana_jax.load(tmp_path / "hf")
    assert model.dtype == "bfloat16"
    float32 = ksana_jax.load(tmp_path / "hf", dtype="float32")
    assert float32.dtype == "float32"
    np.testing.assert_allclose(model.logits(TOKENS), float32.logits(TOKENS), atol=2e-2)

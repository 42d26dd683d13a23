"""GGUF files of the newer families, written by the `gguf` package the way llama.cpp's
convert_hf_to_gguf writes them (tensor names from gguf's own TensorNameMap, Gemma norms with
the +1 folded in, Q/K rows not permuted), convert to the same logits as the safetensors route;
a Llama 3.1 GGUF's rope_freqs.weight gives transformers' llama3 rope."""

from __future__ import annotations

import dataclasses
import math

import gguf
import numpy as np
import pytest
import torch
from conftest import tiny_hf_config, write_tiny_tokenizer
from family_models import PROMPT, build, hf_config, hf_logits
from gguf_files import write_model_gguf
from test_gguf import write_gguf

import ksana_jax
from checkpoints_tools import read_source

GGUF_ARCH = {"qwen3": "qwen3", "gemma2": "gemma2", "gemma3_text": "gemma3"}


def gguf_tensors(model: torch.nn.Module, arch: str) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names, as its converter stores them."""
    cfg = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    tensors = {}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        value = p.detach().float().numpy().copy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            value = value + 1.0  # Gemma's (1 + w) folded in by convert_hf_to_gguf
        base, suffix = name.rsplit(".", 1)
        tensors[f"{names.get_name(base)}.{suffix}"] = value
    return tensors


def write_family_gguf(path, model: torch.nn.Module) -> None:
    cfg = model.config
    arch = GGUF_ARCH[cfg.model_type]
    rope = cfg.rope_parameters
    if arch == "gemma3":
        rope = rope["full_attention"]

    def family_keys(writer):
        if arch == "gemma3" and rope.get("rope_type", "default") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
        if arch.startswith("gemma"):
            writer.add_sliding_window(cfg.sliding_window)
        if arch == "gemma2":
            writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)

    tensors = gguf_tensors(model, arch)
    write_model_gguf(path, arch, cfg, tensors, rope["rope_theta"], family_keys)


# llama.cpp stores no query_pre_attn_scalar (it scales by head_dim below 27B) and no local rope
# base (10000), and writes the default sliding pattern: the checkpoints keep to those.
CASES = {
    "qwen3": ("qwen3_gqa", {}),
    "qwen3_tied_odd": ("qwen3_odd_tied_bias", {"attention_bias": False}),
    "gemma2": ("gemma2_softcap", {"query_pre_attn_scalar": 16}),
    "gemma3": (
        "gemma3_text_odd_final_softcap",
        {
            "query_pre_attn_scalar": 24,
            "final_logit_softcapping": None,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        },
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_gguf_converts_to_the_safetensors_logits(tmp_path, name):
    case, overrides = CASES[name]
    hf_model = build(hf_config(case, **overrides))
    hf_model.save_pretrained(tmp_path / "hf")
    write_tiny_tokenizer(tmp_path / "hf")
    write_family_gguf(tmp_path / "model.gguf", hf_model)

    from_gguf = read_source(tmp_path / "model.gguf")
    from_hf = read_source(tmp_path / "hf")
    assert from_gguf.config.layer_types == from_hf.config.layer_types
    assert from_gguf.config.sm_scale == from_hf.config.sm_scale
    got = ksana_jax.load(tmp_path / "model.gguf").logits(PROMPT)
    safetensors = ksana_jax.load(tmp_path / "hf").logits(PROMPT)
    want = hf_logits(hf_model, PROMPT)
    print(f"{name} GGUF: max |logit difference| {np.abs(got - want).max():.2e}")
    np.testing.assert_allclose(got, safetensors, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def llama_cpp_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel rope_freqs.weight for llama3 rope scaling."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, np.float32)


def test_llama31_gguf_rope_freqs_give_llama3_rope(tmp_path):
    """A Llama 3.1 GGUF carries its rope scaling as rope_freqs.weight (per-frequency divisors)
    and no scaling metadata: converted, it matches transformers' llama3 rope."""
    import transformers

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    torch.manual_seed(3)
    config = tiny_hf_config("llama", intermediate_size=128, rope_parameters=rope)
    hf_model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    factors = llama_cpp_rope_factors(rope, config.hidden_size // config.num_attention_heads)
    assert factors.max() == 8.0 and (factors == 1.0).any()  # long and short wavelengths

    def add_rope_freqs(tensors):
        tensors["rope_freqs.weight"] = factors

    path = write_gguf(tmp_path / "llama31.gguf", hf_model, edit=add_rope_freqs)
    model = ksana_jax.load(path)
    assert model.config.rope_freq_factors == tuple(float(f) for f in factors)
    assert model.config.rope_scaling is None
    want = hf_logits(hf_model, PROMPT)
    got = model.logits(PROMPT)
    print(f"llama3.1 GGUF rope_freqs: max |logit difference| {np.abs(got - want).max():.2e}")
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    unscaled = dataclasses.replace(model.config, rope_freq_factors=None)
    assert np.abs(dataclasses.replace(model, config=unscaled).logits(PROMPT) - got).max() > 1e-3
    # Converted to a checkpoint directory, the factors survive config.json.
    from checkpoints_tools import convert

    again = ksana_jax.load(convert(path, tmp_path / "ckpt"))
    assert again.config == model.config

"""MoE GGUF files written the way llama.cpp's convert_hf_to_gguf writes them -- Qwen3-MoE as
`qwen3moe`, Mixtral as a `llama` with `expert_count` (Q/K rows permuted) -- with each layer's
experts stacked into ffn_{gate,up,down}_exps and the router as ffn_gate_inp: their logits are
transformers' (as the safetensors route's are, test_families.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import write_tiny_tokenizer
from family_models import PROMPT, build, hf_config, hf_logits
from gguf_files import write_model_gguf

import ksana_jax
from checkpoints_tools import read_source
from ksana_jax.models import registry

ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}


def permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation for its interleaved rotary (convert_hf_to_gguf)."""
    rest = w.shape[1:]
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *rest).swapaxes(1, 2).reshape(w.shape)
    )


def gguf_tensors(model: torch.nn.Module, hf_dir) -> dict[str, np.ndarray]:
    """The saved model's tensors (transformers saves one per expert) under llama.cpp's names;
    experts stacked [E, out, in]."""
    from safetensors.numpy import load_file

    cfg = model.config
    family = registry.family_of(cfg.model_type)
    to_gguf = {hf: g for g, hf in family.gguf_layer.items()}
    top = {hf: g for g, hf in family.gguf_top.items() if hf is not None}
    state = load_file(hf_dir / "model.safetensors")
    tensors = {}
    for i in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{i}."
        names = {
            registry.expert_name(k.removeprefix(prefix))[0] for k in state if k.startswith(prefix)
        }
        for name in names:
            if ".*." in name:
                value = np.stack(
                    [
                        state[prefix + name.replace("*", str(e))]
                        for e in range(cfg.num_local_experts)
                    ]
                )
            else:
                value = state[prefix + name]
            if cfg.model_type == "mixtral" and name in (
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
            ):
                heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
                value = permute(value, heads)
            tensors[f"blk.{i}.{to_gguf[name]}"] = value
    for hf, g in top.items():
        if hf in state:
            tensors[g] = state[hf]
    return tensors


def write_moe_gguf(path, model: torch.nn.Module, hf_dir) -> None:
    cfg = model.config
    arch = ARCH[cfg.model_type]

    def expert_keys(writer):
        writer.add_expert_count(cfg.num_local_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if arch == "qwen3moe":
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)

    tensors = gguf_tensors(model, hf_dir)
    write_model_gguf(path, arch, cfg, tensors, cfg.rope_parameters["rope_theta"], expert_keys)


# llama.cpp's qwen3moe always renormalises the top-k weights: a GGUF reads norm_topk_prob.
@pytest.mark.parametrize("case", ["qwen3_moe_top4_norm", "mixtral_top1"])
def test_moe_gguf_logits_match_transformers(tmp_path, case):
    hf_model = build(hf_config(case))
    hf_model.save_pretrained(tmp_path / "hf")
    write_tiny_tokenizer(tmp_path / "hf")
    write_moe_gguf(tmp_path / "model.gguf", hf_model, tmp_path / "hf")

    from_gguf = read_source(tmp_path / "model.gguf")
    assert from_gguf.config.model_type == hf_model.config.model_type
    assert from_gguf.config.mlp_types == read_source(tmp_path / "hf").config.mlp_types
    got = ksana_jax.load(tmp_path / "model.gguf").logits(PROMPT)
    want = hf_logits(hf_model, PROMPT)
    print(f"{case} GGUF: max |logit difference| {np.abs(got - want).max():.2e}")
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)

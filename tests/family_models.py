"""Tiny random checkpoints of every registered family, written by transformers' own
save_pretrained, and transformers' answers on them (eager attention, float32): the references
of test_families.py, test_family_engine.py and test_family_gguf.py.

Every case has a prompt longer than its sliding window, and the configurations cover odd head
counts, grouped and multi-head attention, tied and untied embeddings, biases, soft-caps that
bite (a wide init makes attention scores reach the cap) and per-layer rope bases.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from conftest import TINY_VOCAB, write_tiny_tokenizer

COMMON = dict(
    vocab_size=TINY_VOCAB,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.1,  # peaked attention, so windows and soft-caps change the output
)
GQA = dict(
    hidden_size=96, intermediate_size=112, num_attention_heads=6, num_key_value_heads=2, head_dim=16
)
ODD = dict(
    hidden_size=80, intermediate_size=72, num_attention_heads=5, num_key_value_heads=1, head_dim=24
)
MHA = dict(
    hidden_size=96, intermediate_size=64, num_attention_heads=3, num_key_value_heads=3, head_dim=32
)
WINDOW = 6  # tokens; prompts are 37 long
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1e3},
}

# Mixtures of experts: 8 experts of F = 40 (the dense layers' F differs, so a mix-up shows)
MOE = GQA | dict(num_local_experts=8, num_experts=8, moe_intermediate_size=40)

# case -> (transformers config class, its arguments)
CASES: dict[str, tuple[str, dict]] = {
    "qwen3_gqa": ("Qwen3Config", GQA | dict(num_hidden_layers=3)),
    "qwen3_odd_tied_bias": (
        "Qwen3Config",
        ODD | dict(num_hidden_layers=2, tie_word_embeddings=True, attention_bias=True),
    ),
    "qwen3_window": (
        "Qwen3Config",
        GQA
        | dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW)
        | dict(max_window_layers=1),  # Qwen: layers from this index on slide
    ),
    "qwen2_window": (
        "Qwen2Config",
        MHA
        | dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=5)
        | dict(max_window_layers=1),
    ),
    "mistral_window": ("MistralConfig", GQA | dict(num_hidden_layers=2, sliding_window=WINDOW)),
    "mistral_odd_window": ("MistralConfig", ODD | dict(num_hidden_layers=2, sliding_window=9)),
    "gemma2_softcap": (
        "Gemma2Config",
        GQA
        | dict(
            num_hidden_layers=3,
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=2.0,
        ),
    ),
    "gemma2_odd_untied": (
        "Gemma2Config",
        ODD
        | dict(
            num_hidden_layers=2,
            sliding_window=5,
            query_pre_attn_scalar=24,
            tie_word_embeddings=False,
            attn_logit_softcapping=None,  # soft-caps are optional (null in config.json)
            final_logit_softcapping=None,
        ),
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        GQA
        | dict(
            num_hidden_layers=3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=WINDOW,
            query_pre_attn_scalar=16,
            rope_parameters=GEMMA3_ROPE,
        ),
    ),
    "gemma3_text_odd_final_softcap": (
        "Gemma3TextConfig",
        ODD
        | dict(
            num_hidden_layers=6,  # the default pattern: five sliding layers, then a global one
            sliding_window=5,
            attn_logit_softcapping=4.0,  # transformers' Gemma 3 ignores it; so must we
            final_logit_softcapping=3.0,
            rope_parameters=GEMMA3_ROPE,
        ),
    ),
    # Mixtral renormalises its top k (a softmax over the top-k logits); no window: llama.cpp's
    # Mixtral GGUF has none (test_moe_gguf.py)
    "mixtral_top1": (
        "MixtralConfig",
        ODD | dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=1),
    ),
    "qwen3_moe_top4_norm": (
        "Qwen3MoeConfig",
        MOE | dict(num_hidden_layers=2, num_experts_per_tok=4, norm_topk_prob=True),
    ),
    # dense layers 0 and 3 (mlp_only_layers), sparse 1, dense 2 (decoder_sparse_step 2)
    "qwen3_moe_mixed_top2": (
        "Qwen3MoeConfig",
        MOE
        | dict(
            num_hidden_layers=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            mlp_only_layers=[3],
            decoder_sparse_step=2,
        ),
    ),
}
MOE_CASES = tuple(c for c in CASES if "moe" in c or "mixtral" in c)

RNG = np.random.default_rng(2024)
PROMPT = [int(t) for t in RNG.integers(3, TINY_VOCAB, 37)]


def hf_config(case: str, **overrides):
    import transformers

    class_name, kwargs = CASES[case]
    return getattr(transformers, class_name)(**(COMMON | kwargs | overrides))


def perturb(model: torch.nn.Module) -> torch.nn.Module:
    """Norms (Gemma's around 0, others around 1) and biases moved off their init, so a
    missing or misread one shows up."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
    return model.float().eval()


def build(config, seed: int = 0) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return perturb(model)


def write_case(path: Path, case: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """Random-init model of `case` saved with save_pretrained (plus a tokenizer); returns it."""
    model = build(hf_config(case, **overrides), seed)
    model.save_pretrained(path)
    write_tiny_tokenizer(path)
    return model


def hf_logits(model: torch.nn.Module, token_ids) -> np.ndarray:
    """transformers' float32 logits f32[T, V] at every position (eager attention)."""
    with torch.no_grad():
        return model(torch.tensor([list(token_ids)])).logits[0].float().numpy()


def hf_greedy(model: torch.nn.Module, prompt, steps: int) -> tuple[list[int], float]:
    """Greedy continuation by full forwards (no cache): the tokens, and the smallest gap between
    the top two logits met on the way (below float noise, a batch shape may flip the pick)."""
    tokens, gap = list(prompt), np.inf
    for _ in range(steps):
        last = hf_logits(model, tokens)[-1]
        top2 = np.sort(last)[-2:]
        gap = min(gap, float(top2[1] - top2[0]))
        tokens.append(int(np.argmax(last)))
    return tokens[len(prompt) :], gap

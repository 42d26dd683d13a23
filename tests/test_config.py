"""ModelConfig from HF config.json layouts and GGUF metadata; clear errors for the rest;
EngineConfig's step shapes."""

from __future__ import annotations

import numpy as np
import pytest

from ksana_jax.config import EngineConfig, ModelConfig, RopeScaling
from ksana_jax.models.layers import rope_inv_freq

LLAMA2 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
}
LLAMA31_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LLAMA31 = LLAMA2 | {
    "vocab_size": 128256,
    "intermediate_size": 14336,
    "num_key_value_heads": 8,
    "rope_theta": 500000.0,
    "rope_scaling": LLAMA31_SCALING,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 131072,
    "eos_token_id": [128001, 128008, 128009],
}


def test_llama2_and_llama31():
    cfg = ModelConfig.from_hf_dict(LLAMA2)
    assert (cfg.head_dim, cfg.num_queries_per_kv, cfg.dtype) == (128, 1, "float16")
    assert cfg.rope_scaling is None and cfg.eos_token_ids == (2,)
    cfg = ModelConfig.from_hf_dict(LLAMA31)
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert cfg.eos_token_ids == (128001, 128008, 128009) and cfg.num_queries_per_kv == 4


def test_transformers_5_layout_reads_the_same():
    v5 = {
        k: v for k, v in LLAMA31.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")
    }
    v5 |= {"rope_parameters": LLAMA31_SCALING | {"rope_theta": 500000.0}, "dtype": "bfloat16"}
    assert ModelConfig.from_hf_dict(v5) == ModelConfig.from_hf_dict(LLAMA31)


def test_round_trip_through_our_config_json():
    for hf in (
        LLAMA2,
        LLAMA31,
        LLAMA2 | {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},
    ):
        cfg = ModelConfig.from_hf_dict(hf)
        assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_sliding_windows_per_family():
    """Mistral slides on every layer, Qwen2 from max_window_layers on, Gemma 2 on every other
    layer; the layer's window, scale and rope come out of the config."""
    mistral = ModelConfig.from_hf_dict(
        LLAMA2 | {"model_type": "mistral", "architectures": None, "sliding_window": 64}
    )
    assert {mistral.layer_window(i) for i in range(32)} == {64}
    qwen2 = LLAMA2 | {"model_type": "qwen2", "architectures": None, "sliding_window": 64}
    qwen2 |= {"use_sliding_window": True, "max_window_layers": 30}
    cfg = ModelConfig.from_hf_dict(qwen2)
    assert [cfg.layer_window(i) for i in (0, 29, 30, 31)] == [None, None, 64, 64]
    gemma2 = LLAMA2 | {"model_type": "gemma2", "architectures": None, "sliding_window": 16}
    gemma2 |= {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 64}
    del gemma2["tie_word_embeddings"]  # transformers leaves Gemma's default (true) out
    cfg = ModelConfig.from_hf_dict(gemma2)
    assert [cfg.layer_window(i) for i in range(4)] == [16, None, 16, None]
    assert cfg.sm_scale == 64**-0.5 and cfg.tie_word_embeddings
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (50.0, 30.0)
    for c in (mistral, ModelConfig.from_hf_dict(qwen2), cfg):
        assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c


def test_gemma3_rope_bases_per_layer_type():
    """5.x rope_parameters per layer type and 4.x rope_theta / rope_local_base_freq read the
    same: sliding layers rotate with the local base, unscaled; global ones are scaled."""
    gemma3 = LLAMA2 | {"model_type": "gemma3_text", "architectures": None, "num_hidden_layers": 6}
    gemma3 |= {"hidden_activation": "gelu_pytorch_tanh", "sliding_window": 8}
    v5 = gemma3 | {
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        }
    }
    v4 = {k: v for k, v in gemma3.items() if k != "rope_theta"}
    v4 |= {"rope_theta": 1e6, "rope_local_base_freq": 1e4}
    v4 |= {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    cfg = ModelConfig.from_hf_dict(v5)
    assert ModelConfig.from_hf_dict(v4) == cfg == ModelConfig.from_hf_dict(cfg.to_hf_dict())
    assert cfg.layer_types[4:] == ("sliding_attention", "full_attention")
    assert cfg.layer_rope(0) == (1e4, None)
    assert cfg.layer_rope(5) == (1e6, RopeScaling("linear", 8.0))
    np.testing.assert_allclose(rope_inv_freq(cfg, 5)[0], 1 / 8.0)
    np.testing.assert_allclose(rope_inv_freq(cfg, 0)[0], 1.0)


def test_gemma3_multimodal_config_reads_its_text_config_over_the_defaults():
    """A hub gemma-3-4b config.json lists in text_config only what differs from
    Gemma3TextConfig's defaults; the rest (heads, head_dim, vocabulary, rope bases) is filled
    in, and the model is its language model."""
    hf = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "eos_token_id": [1, 106],
        "torch_dtype": "bfloat16",
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "vision_config": {"model_type": "siglip_vision_model"},
    }
    with pytest.warns(UserWarning, match="images are not supported"):
        cfg = ModelConfig.from_hf_dict(hf)
    assert (cfg.model_type, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        "gemma3_text",
        8,
        4,
    )
    assert (cfg.head_dim, cfg.vocab_size, cfg.dtype, cfg.eos_token_ids) == (
        256,
        262208,
        "bfloat16",
        (1, 106),
    )
    assert cfg.tie_word_embeddings and cfg.qk_norm and cfg.sm_scale == 256**-0.5
    assert cfg.layer_types[:6] == ("sliding_attention",) * 5 + ("full_attention",)
    assert cfg.layer_rope(0) == (10000.0, None) and cfg.layer_window(0) == 1024
    assert cfg.layer_rope(5) == (1e6, RopeScaling("linear", 8.0)) and cfg.layer_window(5) is None


def test_qwen2_has_qkv_bias_and_no_o_bias():
    cfg = ModelConfig.from_hf_dict(
        LLAMA2
        | {
            "model_type": "qwen2",
            "architectures": ["Qwen2ForCausalLM"],
            "use_sliding_window": False,
            "sliding_window": 4096,
        }
    )
    assert cfg.qkv_bias and not cfg.o_bias


def test_llama3_rope_matches_transformers():
    import torch
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.LlamaConfig(
        **{
            k: v
            for k, v in LLAMA31.items()
            if k not in ("architectures", "model_type", "torch_dtype", "rope_scaling", "rope_theta")
        },
        rope_parameters=LLAMA31_SCALING | {"rope_theta": 500000.0},
    )
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, torch.device("cpu"))
    got = rope_inv_freq(ModelConfig.from_hf_dict(LLAMA31))
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"model_type": "gemma", "architectures": ["GemmaForCausalLM"]},
            r"model_type 'gemma'.*supported: \(.*'llama', 'mistral', 'mixtral', 'qwen2', "
            r"'qwen3', 'qwen3_moe'\)",
        ),
        (
            {"architectures": ["LlamaForSequenceClassification"]},
            "architecture 'LlamaForSequenceClassification'",
        ),
        (
            {
                "model_type": "gemma2",
                "architectures": ["Gemma2ForCausalLM"],
                "hidden_activation": "gelu",
            },
            "hidden_activation='gelu'",
        ),
        (
            {
                "model_type": "gemma2",
                "architectures": ["Gemma2ForCausalLM"],
                "hidden_act": "gelu_pytorch_tanh",
                "layer_types": ["x"],
            },
            r"layer_types has 1 entries, expected num_hidden_layers \(32\)",
        ),
        (
            {
                "model_type": "gemma3_text",
                "architectures": ["Gemma3ForCausalLM"],
                "hidden_act": "gelu_pytorch_tanh",
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0},
                    "full_attention": {"rope_type": "default"},
                },
            },
            "sliding_attention rope_type 'linear'",
        ),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'.*supported"),
        ({"rope_scaling": {"rope_type": "linear"}}, "needs a 'factor'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"mlp_bias": True}, "mlp_bias=True"),
        ({"num_key_value_heads": 5}, r"num_attention_heads \(32\) must be a multiple"),
        ({"torch_dtype": "int8"}, "dtype 'int8'"),
    ],
)
def test_unsupported_values_name_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(LLAMA2 | change)


def test_missing_field_is_named():
    hf = dict(LLAMA2)
    del hf["hidden_size"]
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.from_hf_dict(hf)


GGUF = {
    "general.architecture": "llama",
    "llama.block_count": 30,
    "llama.context_length": 8192,
    "llama.embedding_length": 576,
    "llama.feed_forward_length": 1536,
    "llama.attention.head_count": 9,
    "llama.attention.head_count_kv": 3,
    "llama.attention.layer_norm_rms_epsilon": 1e-5,
    "llama.rope.freq_base": 100000.0,
    "tokenizer.ggml.tokens": ["t"] * 49152,
    "tokenizer.ggml.bos_token_id": 1,
    "tokenizer.ggml.eos_token_id": 2,
}


def test_gguf_metadata():
    cfg = ModelConfig.from_gguf_metadata(GGUF, {"token_embd.weight"})
    assert cfg.tie_word_embeddings and cfg.head_dim == 64 and cfg.vocab_size == 49152
    assert cfg.eos_token_ids == (2,) and cfg.rope_theta == 100000.0
    cfg = ModelConfig.from_gguf_metadata(
        GGUF | {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0},
        {"token_embd.weight", "output.weight"},
    )
    assert not cfg.tie_word_embeddings and cfg.rope_scaling == RopeScaling("linear", 2.0)


@pytest.mark.parametrize(
    ("change", "tensors", "message"),
    [
        ({"general.architecture": "gemma"}, set(), "general.architecture 'gemma'"),
        ({"llama.rope.scaling.type": "yarn"}, set(), "scaling.type 'yarn'"),
        ({"llama.attention.sliding_window": 4096}, set(), "sliding_window"),
        ({}, {"rope_freqs.weight"}, "rope_freqs.weight"),
    ],
)
def test_gguf_unsupported(change, tensors, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_gguf_metadata(GGUF | change, tensors)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"max_num_seqs": 64, "max_num_batched_tokens": 512},
        {"token_buckets": (1, 16, 256), "seq_buckets": (8, 32)},
        {"max_num_seqs": 3, "max_num_batched_tokens": 40, "token_buckets": (2, 7, 40)},
    ],
)
def test_bucket_shapes_are_exactly_the_reachable_step_shapes(fields):
    """Every (rows, tokens) a step can hold -- r rows of at least one token each, r <=
    max_num_seqs, r <= n <= max_num_batched_tokens -- pads to a warmed-up shape, and every
    warmed-up shape is reached by some step (a missing one compiles while serving)."""
    cfg = EngineConfig(**fields)

    def pad(buckets, n):
        return min(b for b in buckets if b >= n)

    reachable = {
        (pad(cfg.token_buckets, n), pad(cfg.seq_buckets, r))
        for r in range(1, cfg.max_num_seqs + 1)
        for n in range(r, cfg.max_num_batched_tokens + 1)
    }
    shapes = cfg.bucket_shapes()
    assert {(t, s) for t, s, _ in shapes} == reachable
    assert len(shapes) == len(reachable) * len(cfg.context_buckets)


def test_kv_budget_counts_the_tpu_lane_padding():
    """On a TPU the row-major KV pads each head_dim row to 128 lanes: a 64-wide head takes
    twice its bytes, a 128-wide one none more, and a GiB budget buys pages accordingly."""
    from ksana_jax.kv_cache import device_bytes_per_page
    from ksana_jax.runner import resolve_num_pages

    llama = ModelConfig.from_hf_dict(LLAMA31)  # head_dim 128
    narrow = ModelConfig.from_hf_dict(LLAMA31 | {"head_dim": 64})
    for cfg, factor in ((llama, 1), (narrow, 2)):
        plain = device_bytes_per_page(cfg, 16, "bfloat16")
        assert plain == 2 * 32 * 8 * 16 * cfg.head_dim * 2  # K and V, layers, heads, bf16
        assert device_bytes_per_page(cfg, 16, "bfloat16", lane_multiple=128) == factor * plain
        config = EngineConfig(kv_cache_memory_gib=1.0, max_model_len=1024)
        pages = resolve_num_pages(config, cfg, "bfloat16")
        padded = resolve_num_pages(config, cfg, "bfloat16", lane_multiple=128)
        assert padded == pages // factor

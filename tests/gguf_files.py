"""GGUF files of tiny transformers models, written by the `gguf` package with the keys
llama.cpp's convert_hf_to_gguf writes: test_family_gguf.py's and test_moe_gguf.py's."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import gguf
import numpy as np
from test_gguf import stub_vocab


def write_model_gguf(
    path,
    arch: str,
    cfg,
    tensors: Mapping[str, np.ndarray],
    rope_theta: float,
    extra: Callable[[gguf.GGUFWriter], None] | None = None,
) -> None:
    """Writes a GGUF of architecture `arch`: the shape keys of HF config `cfg`, rotary base
    `rope_theta`, `extra(writer)`'s architecture keys, a stub vocabulary of cfg's size, and
    `tensors` (llama.cpp names -> values)."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(rope_theta)
    if extra is not None:
        extra(writer)
    vocab = stub_vocab(cfg.vocab_size)
    writer.add_tokenizer_model(vocab["model"])
    writer.add_token_list(vocab["tokens"])
    writer.add_token_scores(vocab["scores"])
    writer.add_token_types(vocab["types"])
    writer.add_bos_token_id(vocab["bos"])
    writer.add_eos_token_id(vocab["eos"])
    writer.add_unk_token_id(vocab["unk"])
    for name, value in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

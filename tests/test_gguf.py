"""GGUF files written from scratch with gguf.GGUFWriter, the way llama.cpp's convert_hf_to_gguf
writes them, then read back by checkpoints_tools / ksana_jax.load.

References are independent of the reader: logits come from transformers models (for quantized
files, a transformers model whose weights were replaced by `gguf.quants.dequantize` of what was
written), token ids from the original sentencepiece processor.
"""

from __future__ import annotations

import io
import json
import re

import gguf
import numpy as np
import pytest
import torch
import transformers
from conftest import TINY_VOCAB, hf_logits, tiny_hf_config
from gguf import GGMLQuantizationType

import ksana_jax
from checkpoints_tools import ConversionError, convert, read_source
from ksana_jax.models import registry

RNG = np.random.default_rng(4321)
TOKENS = [int(t) for t in RNG.integers(3, TINY_VOCAB, 37)]  # spans three 16-token pages
# intermediate_size 128 (not conftest's 112) so every matrix row is a multiple of the 32-wide
# Q8_0 / Q4_0 blocks; a non-default rope theta so a misread rope.freq_base shows up.
LLAMA = dict(intermediate_size=128, rope_parameters={"rope_type": "default", "rope_theta": 5e4})

# GGUF token types (sentencepiece's ModelProto.SentencePiece.Type values).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6

_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "attn_q",
    "self_attn.k_proj.weight": "attn_k",
    "self_attn.v_proj.weight": "attn_v",
    "self_attn.o_proj.weight": "attn_output",
    "self_attn.q_proj.bias": "attn_q",
    "self_attn.k_proj.bias": "attn_k",
    "self_attn.v_proj.bias": "attn_v",
    "post_attention_layernorm.weight": "ffn_norm",
    "mlp.gate_proj.weight": "ffn_gate",
    "mlp.up_proj.weight": "ffn_up",
    "mlp.down_proj.weight": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in _TOP:
        return _TOP[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.N.<rest>
    return f"blk.{layer}.{_LAYER[rest]}.{rest.rsplit('.', 1)[1]}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: rotate-half rows -> interleaved pairs."""
    d_out, d_in = w.shape
    return w.reshape(n_head, 2, d_out // n_head // 2, d_in).swapaxes(1, 2).reshape(d_out, d_in)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    d_out, d_in = w.shape
    return w.reshape(n_head, d_out // n_head // 2, 2, d_in).swapaxes(1, 2).reshape(d_out, d_in)


def tiny_model(kind: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    """A random float32 transformers model with norms and biases away from their init."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_hf_config(kind, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model.float().eval()


def quantized_type(name: str, value: np.ndarray, qtype: GGMLQuantizationType):
    """The type convert_hf_to_gguf would store: norms, biases and odd rows stay F32."""
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if value.ndim != 2 or value.shape[-1] % block or name.endswith("norm.weight"):
        return GGMLQuantizationType.F32
    return qtype


def dequantized_copy(model: torch.nn.Module, qtype: GGMLQuantizationType) -> torch.nn.Module:
    """The same model with every quantized weight replaced by its dequantized value."""
    ref = type(model)(model.config).eval()
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, p in ref.named_parameters():
            value = p.detach().numpy()
            kind = quantized_type(gguf_name(name), value, qtype)
            if kind != GGMLQuantizationType.F32:
                q = gguf.quants.quantize(value, kind)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(q, kind).reshape(value.shape)))
    return ref


def stub_vocab(size: int) -> dict:
    """A sentencepiece-style (`llama`) vocabulary of `size` word pieces."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, size)]
    return {
        "model": "llama",
        "tokens": tokens,
        "scores": [0.0, 0.0, 0.0] + [-float(i) for i in range(3, size)],
        "types": [UNKNOWN, CONTROL, CONTROL] + [NORMAL] * (size - 3),
        "bos": 1,
        "eos": 2,
        "unk": 0,
    }


def write_gguf(
    path,
    model: torch.nn.Module,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    arch: str | None = None,
    vocab: dict | None = None,
    edit=None,
):
    """Writes `model` as convert_hf_to_gguf would; `edit(tensors)` may mutate the tensor dict
    (GGUF name -> float32 numpy array) before it is quantized and written."""
    cfg = model.config
    arch = arch or cfg.model_type
    n_head, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    tensors = {}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for tied embeddings
        value = p.detach().float().numpy().copy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            value = llama_cpp_permute(value, n_head)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            value = llama_cpp_permute(value, n_kv)
        tensors[gguf_name(name)] = value
    if edit is not None:
        edit(tensors)

    writer = gguf.GGUFWriter(path, arch)
    writer.add_name("tiny")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(cfg.hidden_size // n_head)
    if arch == "llama":  # LlamaModel.set_gguf_parameters writes it; Qwen2Model does not
        writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(int(qtype))
    vocab = vocab or stub_vocab(cfg.vocab_size)
    writer.add_tokenizer_model(vocab["model"])
    if vocab.get("pre"):
        writer.add_tokenizer_pre(vocab["pre"])
    if vocab.get("tokens") is not None:
        writer.add_token_list(vocab["tokens"])
        writer.add_token_scores(vocab["scores"])
        writer.add_token_types(vocab["types"])
    if "merges" in vocab:
        writer.add_token_merges(vocab["merges"])
    writer.add_bos_token_id(vocab["bos"])
    writer.add_eos_token_id(vocab["eos"])
    writer.add_unk_token_id(vocab["unk"])
    if "add_bos" in vocab:
        writer.add_add_bos_token(vocab["add_bos"])
    if "add_space_prefix" in vocab:
        writer.add_add_space_prefix(vocab["add_space_prefix"])
    for name, value in tensors.items():
        kind = quantized_type(name, value, qtype)
        if kind == GGMLQuantizationType.F32:
            writer.add_tensor(name, value)
        elif kind == GGMLQuantizationType.F16:
            writer.add_tensor(name, value.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(value, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --- Llama: the Q/K permutation, F32 and quantized weights, tied embeddings ----------------


def test_permute_is_llama_cpp_interleave_and_inverse_of_unpermute():
    from ksana_jax.models.llama import unpermute_rows

    # One head of dim 8: llama.cpp pairs row i with row i + 4 (interleaved rotary).
    rows = np.arange(8, dtype=np.float32)[:, None]
    assert llama_cpp_permute(rows, 1)[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    w = RNG.standard_normal((6 * 16, 40)).astype(np.float32)
    for n_head in (1, 2, 6):
        permuted = llama_cpp_permute(w, n_head)
        assert not np.array_equal(permuted, w)
        np.testing.assert_array_equal(unpermute(permuted, n_head), w)
        np.testing.assert_array_equal(unpermute_rows(permuted, n_head), w)
        np.testing.assert_array_equal(llama_cpp_permute(unpermute(w, n_head), n_head), w)


def test_llama_f32_matches_transformers(tmp_path):
    hf = tiny_model("llama", **LLAMA)
    path = write_gguf(tmp_path / "tiny.gguf", hf)
    model = ksana_jax.load(path)
    cfg = model.config
    assert (cfg.model_type, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (
        "llama",
        TINY_VOCAB,
        96,
        128,
    )
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (3, 6, 2)
    assert cfg.head_dim == 16 and cfg.rope_theta == 5e4 and cfg.max_position_embeddings == 512
    assert cfg.rms_norm_eps == pytest.approx(1e-5) and not cfg.tie_word_embeddings
    assert cfg.bos_token_id == 1 and model.eos_token_ids == (2,)
    # F32 weights come back bit-exact, Q and K un-permuted to the Hugging Face row order.
    attn = hf.model.layers[1].self_attn
    flat = registry.params_to_flat(model.params, model.config)
    np.testing.assert_array_equal(np.asarray(flat["layers.wq"][1]), attn.q_proj.weight.detach())
    np.testing.assert_array_equal(np.asarray(flat["layers.wk"][1]), attn.k_proj.weight.detach())

    want = hf_logits(hf, TOKENS)
    np.testing.assert_allclose(model.logits(TOKENS), want, atol=1e-4, rtol=0)
    converted = ksana_jax.load(convert(path, tmp_path / "ckpt"))  # via a checkpoint directory
    assert converted.config == cfg
    np.testing.assert_allclose(converted.logits(TOKENS), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0"])
def test_llama_quantized_matches_dequantized_transformers(tmp_path, qtype):
    qtype = GGMLQuantizationType[qtype]
    hf = tiny_model("llama", seed=1, **LLAMA)
    path = write_gguf(tmp_path / "tiny.gguf", hf, qtype)
    stored = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert stored["token_embd.weight"] == stored["blk.0.ffn_down.weight"] == qtype
    assert stored["blk.0.attn_norm.weight"] == GGMLQuantizationType.F32

    reference = dequantized_copy(hf, qtype)
    want = hf_logits(reference, TOKENS)
    if qtype in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0):
        # The reference really is the quantized model, not the original one.
        assert np.abs(want - hf_logits(hf, TOKENS)).max() > 1e-3
    got = ksana_jax.load(path).logits(TOKENS)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_llama_tied_embeddings(tmp_path, qtype):
    qtype = GGMLQuantizationType[qtype]
    hf = tiny_model("llama", seed=2, tie_word_embeddings=True, **LLAMA)
    path = write_gguf(tmp_path / "tied.gguf", hf, qtype)
    assert "output.weight" not in {t.name for t in gguf.GGUFReader(path).tensors}
    model = ksana_jax.load(path)
    assert model.config.tie_word_embeddings and "lm_head" not in model.params
    want = hf_logits(dequantized_copy(hf, qtype), TOKENS)
    np.testing.assert_allclose(model.logits(TOKENS), want, atol=1e-4, rtol=0)


# --- Qwen2: q/k/v biases, no Q/K permutation, a `gpt2` vocabulary ---------------------------


def test_qwen2_matches_transformers(tmp_path):
    hf = tiny_model("qwen2", seed=3, **LLAMA)
    # A small byte-level BPE vocabulary ("Ġ" is the byte-level space), padded to the model's.
    tokens = ["<unk>", "<|im_start|>", "<|endoftext|>", "Ġ"]
    tokens += [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["ab", "Ġab"]
    tokens += [f"<extra_{i}>" for i in range(TINY_VOCAB - len(tokens))]
    vocab = {
        "model": "gpt2",
        "pre": "qwen2",
        "tokens": tokens,
        "scores": [0.0] * TINY_VOCAB,
        "types": [CONTROL] * 3 + [NORMAL] * (TINY_VOCAB - 3),
        "merges": ["a b", "Ġ ab"],
        "bos": 1,
        "eos": 2,
        "unk": 0,
        "add_bos": False,
    }
    path = write_gguf(tmp_path / "qwen2.gguf", hf, vocab=vocab)
    assert "blk.0.attn_q.bias" in {t.name for t in gguf.GGUFReader(path).tensors}
    model = ksana_jax.load(path)
    assert model.config.model_type == "qwen2" and model.config.qkv_bias
    # No Q/K permutation for qwen2: the weights come back as written.
    attn = hf.model.layers[2].self_attn
    flat = registry.params_to_flat(model.params, model.config)
    np.testing.assert_array_equal(np.asarray(flat["layers.wq"][2]), attn.q_proj.weight.detach())
    np.testing.assert_array_equal(np.asarray(flat["layers.bk"][2]), attn.k_proj.bias.detach())
    np.testing.assert_allclose(model.logits(TOKENS), hf_logits(hf, TOKENS), atol=1e-4, rtol=0)

    ids = model.tokenizer.encode("<|im_start|>ab abc")
    assert ids == [1, tokens.index("ab"), tokens.index("Ġab"), tokens.index("c")]
    assert model.tokenizer.decode(ids) == "<|im_start|>ab abc"
    assert model.eos_token_ids == (2,)


# --- A `llama` (sentencepiece) vocabulary -----------------------------------------------------

_WORDS_TEXT = (
    "the quick brown fox jumps over lazy dog llama model token byte fallback whitespace "
    "café naïve résumé über straße señor façade déjà vu crème brûlée jalapeño garçon "
    "numbers 123 4567 89 punctuation , . ! ? ; : ( ) [ ] hello world again and again"
)


def train_sentencepiece(add_dummy_prefix: bool):
    import sentencepiece as spm

    rng = np.random.default_rng(7)
    corpus = [" ".join(rng.choice(_WORDS_TEXT.split(), size=12)) for _ in range(400)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus),
        model_writer=model,
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=add_dummy_prefix,
        user_defined_symbols=["<tool>"],
        control_symbols=["<ctrl>"],
        unk_id=0,
        bos_id=1,
        eos_id=2,
        num_threads=1,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


TEXTS = [
    "the quick brown fox",
    "Crème brûlée, déjà vu — naïve Señor!",
    "emoji 🦙🔥 and 漢字 fall back to bytes",
    "  leading spaces, double  spaces,\ttabs\nand newlines\n\n",
    "numbers 12345 and <tool> user symbol",
    " ",
]


@pytest.mark.parametrize(("add_bos", "add_dummy_prefix"), [(True, True), (False, False)])
def test_sentencepiece_vocabulary_roundtrip(tmp_path, add_bos, add_dummy_prefix):
    from sentencepiece import sentencepiece_model_pb2 as sp_pb2

    sp = train_sentencepiece(add_dummy_prefix)
    proto = sp_pb2.ModelProto.FromString(sp.serialized_model_proto())
    n = len(proto.pieces)
    assert n == sp.get_piece_size() == 400
    types = [int(p.type) for p in proto.pieces]
    assert {UNKNOWN, CONTROL, USER_DEFINED, BYTE, NORMAL} <= set(types)
    vocab = {
        "model": "llama",
        "tokens": [p.piece for p in proto.pieces],
        "scores": [p.score for p in proto.pieces],
        "types": types,
        "bos": sp.bos_id(),
        "eos": sp.eos_id(),
        "unk": sp.unk_id(),
        "add_bos": add_bos,
        "add_space_prefix": add_dummy_prefix,
    }
    # A model whose vocabulary covers every piece.
    hf = tiny_model("llama", seed=4, vocab_size=n, **LLAMA)
    path = write_gguf(tmp_path / "spm.gguf", hf, vocab=vocab)
    out = convert(path, tmp_path / "ckpt")
    rebuilt = sp_pb2.ModelProto.FromString((out / "tokenizer.model").read_bytes())
    assert [(p.piece, p.score, p.type) for p in rebuilt.pieces] == [
        (p.piece, p.score, p.type) for p in proto.pieces
    ]
    assert rebuilt.trainer_spec.byte_fallback
    assert rebuilt.normalizer_spec.add_dummy_prefix is add_dummy_prefix
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is add_bos
    tok = ksana_jax.load(out).tokenizer
    assert tok.vocab_size == n
    assert (tok.bos_token_id, tok.eos_token_id) == (sp.bos_id(), sp.eos_id()) == (1, 2)
    assert tok.id_to_token(3) == proto.pieces[3].piece

    prefix = [sp.bos_id()] if add_bos else []
    for text in TEXTS:
        want = sp.encode(text)
        assert tok.encode(text, add_special_tokens=False) == want, text
        ids = tok.encode(text)
        assert ids == prefix + want, text
        assert tok.decode(ids, skip_special_tokens=True) == sp.decode(want) == text
    # Emoji are not pieces: they fall back to their UTF-8 bytes.
    emoji = tok.encode("🦙", add_special_tokens=False)
    assert len(emoji) >= 4 and all(sp.is_byte(i) for i in emoji[-4:])
    assert tok.decode(emoji) == "🦙"
    assert sp.piece_to_id("<tool>") in tok.encode("<tool>")
    # tokenizer.ggml.add_space_prefix, not a default, decides the leading "▁".
    first = tok.id_to_token(tok.encode("the", add_special_tokens=False)[0])
    assert first.startswith("▁") is add_dummy_prefix


# --- GGUF-specific errors -------------------------------------------------------------------


def _drop(name):
    return lambda tensors: tensors.pop(name)


def _set(name, shape):
    return lambda tensors: tensors.__setitem__(name, np.zeros(shape, np.float32))


ERRORS = {
    "architecture": (dict(arch="gemma"), r"general\.architecture 'gemma'"),
    "wrong_shape": (
        dict(edit=_set("blk.1.ffn_up.weight", (128, 95))),
        r"layers\.1\.mlp\.up_proj.*\(128, 95\).*expected \(128, 96\)",
    ),
    "missing_tensor": (
        dict(edit=_drop("blk.2.attn_v.weight")),
        r"missing tensor.*layers\.2\.self_attn\.v_proj",
    ),
    "rope_freqs": (
        dict(edit=_set("rope_freqs.weight", (5,))),
        r"rope_freqs\.weight has 5 values, expected head_dim / 2 = 8",
    ),
    "tokenizer_model": (
        dict(vocab=stub_vocab(TINY_VOCAB) | {"model": "bert"}),
        r"tokenizer\.ggml\.model 'bert'",
    ),
    "no_vocabulary": (
        dict(vocab=stub_vocab(TINY_VOCAB) | {"tokens": None}),
        r"tokenizer\.ggml\.tokens",
    ),
}


@pytest.fixture(scope="module")
def small_llama():
    return tiny_model("llama", seed=5, num_hidden_layers=3, **LLAMA)


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_gguf_errors_are_conversion_errors(tmp_path, small_llama, case):
    kwargs, message = ERRORS[case]
    path = write_gguf(tmp_path / "bad.gguf", small_llama, **kwargs)
    with pytest.raises(ConversionError, match=message):
        convert(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConversionError, match=message):
        ksana_jax.load(path)


@pytest.mark.parametrize("case", ["garbage", "empty", "truncated_header", "truncated_data"])
def test_unreadable_gguf(tmp_path, small_llama, case):
    good = write_gguf(tmp_path / "good.gguf", small_llama).read_bytes()
    contents = {
        "garbage": b"this is not a GGUF file\n" * 10,
        "empty": b"",
        "truncated_header": good[:100],
        "truncated_data": good[: len(good) - 1000],
    }[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(contents)
    with pytest.raises(ConversionError, match=r"cannot read GGUF file .*bad\.gguf"):
        convert(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --- Malformed files -------------------------------------------------------------------------


def test_truncated_at_any_header_byte_is_conversion_error(tmp_path, small_llama):
    good = write_gguf(tmp_path / "good.gguf", small_llama).read_bytes()
    data_offset = gguf.GGUFReader(tmp_path / "good.gguf").data_offset
    path = tmp_path / "bad.gguf"
    for n in range(0, data_offset, 3):
        path.write_bytes(good[:n])
        with pytest.raises(ConversionError, match="cannot read GGUF file"):
            read_source(path)


@pytest.mark.parametrize(
    ("name", "shape"), [("blk.0.attn_q.weight", (90, 96)), ("blk.2.attn_k.weight", (30, 96))]
)
def test_wrong_qk_row_count_is_conversion_error(tmp_path, small_llama, name, shape):
    path = write_gguf(tmp_path / "bad.gguf", small_llama, edit=_set(name, shape))
    with pytest.raises(ConversionError, match=re.escape(str(shape))):
        read_source(path)


def test_special_token_id_out_of_range_is_conversion_error(tmp_path, small_llama):
    vocab = stub_vocab(TINY_VOCAB) | {"eos": TINY_VOCAB + 5}
    path = write_gguf(tmp_path / "bad.gguf", small_llama, vocab=vocab)
    with pytest.raises(ConversionError, match="eos"):
        read_source(path)


def test_bad_bpe_merges_are_conversion_error(tmp_path, small_llama):
    vocab = stub_vocab(TINY_VOCAB) | {"model": "gpt2", "pre": "qwen2", "merges": ["x y"]}
    path = write_gguf(tmp_path / "bad.gguf", small_llama, vocab=vocab)
    with pytest.raises(ConversionError):
        read_source(path)

"""Every registered family: tiny random checkpoints written by transformers -> convert -> the
paged forward's logits at every position within 1e-4 of transformers' (float32, eager), on a
prompt longer than the sliding window; the window and the soft-caps provably bite; a
multimodal Gemma 3 checkpoint converts to its language model."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import TINY_VOCAB, write_tiny_tokenizer
from family_models import CASES, PROMPT, hf_config, hf_logits, perturb, write_case

import ksana_jax
from checkpoints_tools import ConversionError, convert, read_source
from ksana_jax.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from ksana_jax.kv_cache import KVCacheSpec, allocate_kv
from ksana_jax.models import registry
from ksana_jax.pallas_kernels import linear_cpu
from ksana_jax.step import logits_step
from ksana_jax.step_inputs import SequenceChunk, build_step_inputs

ATOL = 1e-4


@pytest.fixture(scope="module", params=sorted(CASES))
def converted(request, tmp_path_factory):
    """(case, transformers model, loaded converted checkpoint)."""
    tmp = tmp_path_factory.mktemp(request.param)
    hf_model = write_case(tmp / "hf", request.param)
    return request.param, hf_model, ksana_jax.load(convert(tmp / "hf", tmp / "ckpt"))


def test_all_position_logits_match_transformers(converted):
    case, hf_model, model = converted
    want = hf_logits(hf_model, PROMPT)
    got = model.logits(PROMPT)
    assert got.shape == (len(PROMPT), TINY_VOCAB)
    diff = float(np.abs(got - want).max())
    print(f"{case}: max |logit difference| {diff:.2e} (logits up to {np.abs(want).max():.2f})")
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    # The last position alone, from a prompt cut short (its own prefill, another bucket).
    np.testing.assert_allclose(model.logits(PROMPT[:29])[-1], want[28], atol=ATOL, rtol=0)


def chunked_prefill_logits(model, chunks, backend: str, page_size: int = 4) -> np.ndarray:
    """Logits at every prompt position, the prompt fed in `chunks` (sizes) through the jitted
    paged step on shuffled pages: later chunks read earlier ones' K/V from the pages."""
    kv = allocate_kv(KVCacheSpec.for_model(model.config, 24, page_size, "float32"))
    pages = [int(p) for p in np.random.default_rng(1).permutation(np.arange(1, 24))[:12]]
    out, start = [], 0
    for size in chunks:
        chunk = SequenceChunk(PROMPT[start : start + size], start, pages)
        inputs = build_step_inputs([chunk], page_size, 16, 1, 12)
        indices = jnp.arange(size, dtype=jnp.int32)
        logits, kv = logits_step(model.params, model.config, kv, inputs, indices, backend)
        out.append(np.asarray(logits))
        start += size
    return np.concatenate(out)


# Chunk boundaries at 3, 9, 10, 21, 27 and 37 tokens: inside one window and across several.
CHUNKS = [3, 6, 1, 11, 6, 10]


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_chunked_prefill_around_the_window_matches_transformers(converted, backend):
    case, hf_model, model = converted
    if model.config.sliding_window is None:
        pytest.skip(f"{case} has no window")
    assert sum(CHUNKS) == len(PROMPT)
    got = chunked_prefill_logits(model, CHUNKS, backend)
    np.testing.assert_allclose(got, hf_logits(hf_model, PROMPT), atol=ATOL, rtol=0)


def _variant_logits(model, **changes) -> np.ndarray:
    config = dataclasses.replace(model.config, **changes)
    return dataclasses.replace(model, config=config).logits(PROMPT)


def test_window_and_softcaps_change_the_output(converted):
    """Without the window (or a cap) our logits move far beyond the tolerance: the matches
    above compared windowed, capped attention, not something that happens to agree."""
    case, _, model = converted
    cfg = model.config
    base = model.logits(PROMPT)
    changes = []
    if SLIDING_ATTENTION in cfg.layer_types:
        assert cfg.sliding_window < len(PROMPT)
        changes.append(dict(layer_types=(FULL_ATTENTION,) * cfg.num_hidden_layers))
    if cfg.attn_logit_softcapping is not None:
        changes.append(dict(attn_logit_softcapping=None))
    if cfg.final_logit_softcapping is not None:
        changes.append(dict(final_logit_softcapping=None))
    if not changes:
        pytest.skip(f"{case} has no window or soft-cap")
    for change in changes:
        assert np.abs(_variant_logits(model, **change) - base).max() > 100 * ATOL, change


def test_bfloat16_params_stay_close(converted):
    """In bfloat16 (Gemma's sqrt(D) embedding scale rounded to it, as transformers does) the
    logits stay near float32's."""
    case, _, model = converted
    if case not in ("gemma2_softcap", "gemma3_text", "qwen3_window"):
        pytest.skip("one case per family")
    want = model.logits(PROMPT)
    got = model.with_dtype("bfloat16").logits(PROMPT)
    assert 1e-6 < np.abs(got - want).max() < 0.1


def test_lm_head_argmax_is_the_first_max_of_the_logits(converted):
    """registry.logits_or_argmax, the forward's LM head: its logits are registry.logits';
    where the family's logits are its LM head's product (Family.lm_head: not Gemma's, which
    are soft-capped) and the CPU kernel takes it, the argmax from that call is the first
    largest logit of each row, and otherwise there is none."""
    case, _, model = converted
    cfg, params = model.config, model.params
    rng = np.random.default_rng(1)
    hidden = jnp.asarray(rng.standard_normal((8, cfg.hidden_size)), jnp.float32)
    logits = np.asarray(jax.jit(registry.logits, static_argnums=1)(params, cfg, hidden))
    head = jax.jit(registry.logits_or_argmax, static_argnums=1)
    got, _ = head(params, cfg, hidden, jnp.bool_(False))
    np.testing.assert_array_equal(got, logits)
    _, ids = head(params, cfg, hidden, jnp.bool_(True))
    family = registry.family_of(cfg.model_type)
    assert (family.lm_head is None) == case.startswith("gemma")
    if family.lm_head is None:
        assert ids is None
        return
    assert (ids is not None) == linear_cpu.takes(hidden, family.lm_head(params))
    assert (ids is not None) == linear_cpu.available()  # float32 at 8 rows: the kernel's
    if ids is not None:
        np.testing.assert_array_equal(ids, np.argmax(logits, axis=1))


def test_config_json_round_trips(converted):
    _, _, model = converted
    assert ModelConfig.from_hf_dict(model.config.to_hf_dict()) == model.config


def test_every_parameter_has_sharding_axes_and_hf_names(converted):
    """The family's declarations agree: shapes, sharding axes and HF names cover the same
    parameters (a parameter missing from one would fail only on a multi-device mesh)."""
    _, _, model = converted
    family = registry.family_of(model.config.model_type)
    shapes = registry.param_shapes(model.config)
    assert set(shapes) <= set(family.param_axes)
    for name, shape in shapes.items():
        assert len(family.param_axes[name]) == len(shape), name
    named = set(family.hf_top.values()) | set(family.hf_layer.values())
    assert set(shapes) <= named
    flat = registry.params_to_flat(model.params, model.config)
    assert {k: tuple(v.shape) for k, v in flat.items()} == shapes


def test_tensor_parallel_families_match_one_device(tmp_path):
    """Gemma 3 (q/k norms, post norms, windows) and a windowed Qwen3 split over two devices
    by heads: same logits within float32 reordering, same greedy tokens, every parameter in
    the sharding its family's axes give."""
    from test_sharding import LOGITS_RTOL, run_worker

    paths = []
    for case in ("gemma3_text", "qwen3_window"):
        write_case(tmp_path / case, case, eos_token_id=None)
        paths.append(convert(tmp_path / case, tmp_path / f"{case}_ckpt"))
    for path, runs in run_worker("families", *paths).items():
        assert "split by heads" in runs["2"]["plan"], (path, runs["2"]["plan"])
        assert runs["1"]["shardings_match_plan"] and runs["2"]["shardings_match_plan"], path
        assert runs["2"]["tokens"] == runs["1"]["tokens"], path
        assert runs["2"]["logits_max_diff"] <= LOGITS_RTOL * runs["2"]["logits_max_abs"], path


# ----------------------------------------------------------------------------- Gemma 3 multimodal


def _tiny_gemma3_multimodal(seed: int = 0):
    import transformers

    text = hf_config("gemma3_text").to_dict()
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=16,
        patch_size=4,
    )
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=5
    )
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config)
    model.config._attn_implementation = "eager"
    model.model.language_model.config._attn_implementation = "eager"
    return perturb(model)


def test_gemma3_multimodal_checkpoint_loads_its_language_model(tmp_path):
    hf_model = _tiny_gemma3_multimodal()
    hf_model.save_pretrained(tmp_path / "hf")
    write_tiny_tokenizer(tmp_path / "hf")
    with pytest.warns(UserWarning, match="images are not supported"):
        source = read_source(tmp_path / "hf")
    assert source.config.model_type == "gemma3_text"
    with pytest.warns(UserWarning, match="images are not supported"):
        model = ksana_jax.load(convert(tmp_path / "hf", tmp_path / "ckpt"))
    tokens = [t for t in PROMPT if t != 5]  # no image token: text only
    want = hf_logits(hf_model, tokens)
    got = model.logits(tokens)
    print(f"gemma3 multimodal: max |logit difference| {np.abs(got - want).max():.2e}")
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- refused configs


@pytest.mark.parametrize(
    ("case", "change", "message"),
    [
        ("gemma2_softcap", {"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
        ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("qwen3_gqa", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        (
            "gemma3_text",
            {"rope_parameters": {"sliding_attention": {"rope_type": "yarn", "factor": 2.0}}},
            "rope_type 'yarn'",
        ),
    ],
)
def test_unsupported_family_configs_name_the_field(tmp_path, case, change, message):
    import json

    write_case(tmp_path / "hf", case)
    config = json.loads((tmp_path / "hf" / "config.json").read_text()) | change
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=message):
        read_source(tmp_path / "hf")

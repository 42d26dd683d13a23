"""Lowering checks without the hardware: `jax.export` lowers each Pallas kernel for TPU
(Pallas -> Mosaic, with Mosaic's block-shape rules) and for CUDA (Pallas -> Triton IR, with
its power-of-two shape rules) on this CPU-only machine, at the real model shapes.

What this does not check: Mosaic's and Triton's own compilers run only on the device
(vector layouts, register allocation), so a kernel that lowers here can still fail there.

The Triton lowering's custom call (`__gpu$xla.gpu.triton`) has no serialization
compatibility guarantee, so `jax.export` refuses it unless the caller opts in with
`disabled_checks`; the documented refusal is asserted too.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from ksana_jax.kv_cache import KVCache, KVCacheSpec, abstract_kv
from ksana_jax.pallas_kernels import (
    paged_attention_gpu,
    ragged_paged_attention_tpu,
    write_kv_pages_gpu,
    write_kv_pages_tpu,
)
from ksana_jax.pallas_kernels.attention_spec import AttentionSpec
from ksana_jax.sampling import SamplerPlan

# (name, layers, query heads, KV heads, head dim): SmolLM2-135M and a Llama-3-8B-like model.
MODELS = [("smollm2", 30, 9, 3, 64), ("llama3_8b", 32, 32, 8, 128)]
PAGE_SIZE, NUM_PAGES = 16, 512
NUM_TOKENS, NUM_SEQS, PAGES_PER_SEQ = 128, 16, 64  # a mixed bucket, contexts up to 1024
TRITON = [jax.export.DisabledSafetyCheck.custom_call(paged_attention_gpu.TRITON_CUSTOM_CALL)]


def kv_sds(shape, dtype) -> KVCache:
    """The abstract KVCache of float pages of `shape` (placeholder scales)."""
    return abstract_kv(KVCacheSpec(shape[0], shape[2], shape[3], shape[4], shape[5], dtype))


def attention_args(
    num_layers, num_heads, num_kv_heads, head_dim, dtype, pages_per_seq=PAGES_PER_SEQ
):
    sds = jax.ShapeDtypeStruct
    return (
        sds((NUM_TOKENS, num_heads, head_dim), jnp.float32),
        sds((NUM_TOKENS, num_kv_heads, head_dim), dtype),
        sds((NUM_TOKENS, num_kv_heads, head_dim), dtype),
        kv_sds((num_layers, 2, num_kv_heads, NUM_PAGES, PAGE_SIZE, head_dim), dtype),
        sds((), jnp.int32),
        sds((NUM_SEQS, pages_per_seq), jnp.int32),
        sds((NUM_SEQS,), jnp.int32),
        sds((NUM_SEQS + 1,), jnp.int32),
    )


def write_args(num_layers, num_kv_heads, head_dim, dtype):
    sds = jax.ShapeDtypeStruct
    return (
        kv_sds((num_layers, 2, num_kv_heads, NUM_PAGES, PAGE_SIZE, head_dim), dtype),
        sds((num_layers, 2, NUM_TOKENS, num_kv_heads, head_dim), dtype),
        sds((NUM_TOKENS,), jnp.int32),
    )


PARAMS = [
    pytest.param(*model, dtype, id=f"{model[0]}-{jnp.dtype(dtype).name}")
    for model in MODELS
    for dtype in (jnp.bfloat16, jnp.float32)
]


@pytest.mark.parametrize("name,num_layers,num_heads,num_kv_heads,head_dim,dtype", PARAMS)
def test_tpu_attention_lowers_to_mosaic(name, num_layers, num_heads, num_kv_heads, head_dim, dtype):
    attention = functools.partial(
        ragged_paged_attention_tpu.ragged_paged_attention, spec=AttentionSpec(head_dim**-0.5)
    )
    args = attention_args(num_layers, num_heads, num_kv_heads, head_dim, dtype)
    exported = jax.export.export(jax.jit(attention), platforms=["tpu"])(*args)
    module = exported.mlir_module()
    assert "tpu_custom_call" in module
    assert exported.out_avals[0].shape == (NUM_TOKENS, num_heads, head_dim)
    assert "stablehlo.while" not in module  # the row lookup is one fused op, not a loop


@pytest.mark.parametrize("name,num_layers,num_heads,num_kv_heads,head_dim,dtype", PARAMS)
def test_gpu_attention_lowers_to_triton(name, num_layers, num_heads, num_kv_heads, head_dim, dtype):
    attention = functools.partial(
        paged_attention_gpu.ragged_paged_attention, spec=AttentionSpec(head_dim**-0.5)
    )
    args = attention_args(num_layers, num_heads, num_kv_heads, head_dim, dtype)
    exported = jax.export.export(jax.jit(attention), platforms=["cuda"], disabled_checks=TRITON)(
        *args
    )
    module = exported.mlir_module()
    assert paged_attention_gpu.TRITON_CUSTOM_CALL in module
    assert exported.out_avals[0].shape == (NUM_TOKENS, num_heads, head_dim)
    # Loop-free around the kernel: an XLA while loop on a GPU waits for the host each trip.
    assert "stablehlo.while" not in module


def test_triton_export_needs_the_documented_opt_in():
    attention = functools.partial(
        paged_attention_gpu.ragged_paged_attention, spec=AttentionSpec(0.125)
    )
    args = attention_args(30, 9, 3, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match="custom calls whose targets have no compatibility"):
        jax.export.export(jax.jit(attention), platforms=["cuda"])(*args)


# Gemma-3-4B-like: 34 layers, 8 query / 4 KV heads of 256, its local layers' 1024-token
# window (and Gemma 2's attention soft-cap, 50), over a 4096-token page table.
GEMMA3 = (34, 8, 4, 256)
GEMMA3_SPEC = AttentionSpec(256**-0.5, sliding_window=1024, logit_softcap=50.0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_attention_with_window_and_softcap_lowers_at_gemma3_shapes(platform, dtype):
    kernel = {"tpu": ragged_paged_attention_tpu, "cuda": paged_attention_gpu}[platform]
    attention = functools.partial(kernel.ragged_paged_attention, spec=GEMMA3_SPEC)
    args = attention_args(*GEMMA3, dtype, pages_per_seq=256)
    exported = jax.export.export(jax.jit(attention), platforms=[platform], disabled_checks=TRITON)(
        *args
    )
    module = exported.mlir_module()
    custom_call = "tpu_custom_call" if platform == "tpu" else paged_attention_gpu.TRITON_CUSTOM_CALL
    assert custom_call in module
    assert exported.out_avals[0].shape == (NUM_TOKENS, 8, 256)
    assert "stablehlo.while" not in module


@pytest.mark.parametrize("name,num_layers,num_heads,num_kv_heads,head_dim,dtype", PARAMS[::2])
@pytest.mark.parametrize(
    "writer,platform",
    [(write_kv_pages_tpu.write_kv_pages, "tpu"), (write_kv_pages_gpu.write_kv_pages, "cuda")],
    ids=["tpu", "cuda"],
)
def test_kv_write_lowers_with_the_kv_aliased(
    writer, platform, name, num_layers, num_heads, num_kv_heads, head_dim, dtype
):
    args = write_args(num_layers, num_kv_heads, head_dim, dtype)
    exported = jax.export.export(
        jax.jit(writer, donate_argnums=0), platforms=[platform], disabled_checks=TRITON
    )(*args)
    module = exported.mlir_module()
    # The kernel's output is its KV operand, and the jitted function's output is its
    # donated KV argument: no KV-sized copy.
    assert re.search(r"output_operand_aliases = \[#stablehlo.output_operand_alias", module)
    assert "tf.aliasing_output = 0" in module


@pytest.mark.parametrize(
    "writer,platform",
    [(write_kv_pages_tpu.write_layer_kv, "tpu"), (write_kv_pages_gpu.write_layer_kv, "cuda")],
    ids=["tpu", "cuda"],
)
def test_layer_kv_write_lowers_with_the_kv_aliased(writer, platform):
    """The one-layer write the model does before each layer's attention (SmolLM2, bf16)."""
    sds = jax.ShapeDtypeStruct
    kv = kv_sds((30, 2, 3, NUM_PAGES, PAGE_SIZE, 64), jnp.bfloat16)
    k_new = sds((NUM_TOKENS, 3, 64), jnp.bfloat16)
    slots = sds((NUM_TOKENS,), jnp.int32)
    layer = sds((), jnp.int32)
    exported = jax.export.export(
        jax.jit(writer, donate_argnums=0), platforms=[platform], disabled_checks=TRITON
    )(kv, layer, k_new, k_new, slots)
    module = exported.mlir_module()
    assert re.search(r"output_operand_aliases = \[#stablehlo.output_operand_alias", module)
    assert "tf.aliasing_output = 0" in module


def _lowered_for_cuda(tmp_path, monkeypatch, make_step, num_speculative: int = 0) -> str:
    """The MLIR module of a step exported for CUDA: the tiny model's runner (pallas_gpu
    backend) on one (T=32, S=4, context 128) step of padding, traced as a GPU would trace
    it (the model picks compiled kernels, not the interpreter). make_step(model config,
    layout, max_logprobs) gives the step, called (params, kv, state, buffers, bitmask), its
    buffers packed from (inputs, sampling, rows, bitmask). With num_speculative, the model
    is its own draft model proposing that many tokens, and the step's rows are the variant
    where rows draft and all W sampled positions are in use (runner.row_variants)."""
    from conftest import write_tiny_hf

    import ksana_jax
    from ksana_jax import runner
    from ksana_jax.batch import pack
    from ksana_jax.config import EngineConfig

    write_tiny_hf(tmp_path / "hf", eos_token_id=None)
    model = ksana_jax.load(tmp_path / "hf")
    config = EngineConfig(
        max_model_len=128,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        token_buckets=(32,),
        seq_buckets=(4,),
        context_buckets=(128,),
        attention_backend="pallas_gpu",
        speculative_config=(
            {"model": str(tmp_path / "hf"), "num_speculative_tokens": num_speculative}
            if num_speculative
            else None
        ),
    )
    step_runner = runner.ModelRunner(model, config, model if num_speculative else None)
    inputs = step_runner.padding_inputs(32, 4, 128)
    if num_speculative:
        rows = step_runner.row_variants(inputs[2])[-1]
        assert rows.drafts and rows.sampled_positions == 4 * (1 + num_speculative), rows
        inputs = (*inputs[:2], rows, inputs[3])
    buffers, layout = pack(inputs)
    step = make_step(model.config, layout, config.max_logprobs)
    kv = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), step_runner.kv)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    exported = jax.export.export(jax.jit(step), platforms=["cuda"], disabled_checks=TRITON)(
        model.params, kv, step_runner.state, buffers, inputs[3]
    )
    return exported.mlir_module()


def test_engine_step_lowers_for_cuda_without_a_while_loop(tmp_path, monkeypatch):
    """The whole jitted engine step (tiny model, pallas_gpu backend) lowered as a GPU would
    trace it: Triton kernels for attention and the KV write, and no XLA while loop (on a GPU
    every trip of one waits for the host)."""
    from ksana_jax.step_programs import engine_step

    def make_step(cfg, layout, max_logprobs):
        def step(params, kv, state, buffers, bitmask):
            return engine_step(params, cfg, kv, state, buffers, layout, max_logprobs, "pallas_gpu")

        return step

    module = _lowered_for_cuda(tmp_path, monkeypatch, make_step)
    assert module.count(paged_attention_gpu.TRITON_CUSTOM_CALL) >= 2  # attention, KV write
    assert "stablehlo.while" not in module


@pytest.mark.parametrize("plan", [p.value for p in SamplerPlan])
def test_decode_step_programs_lower_for_cuda_without_a_conditional(plan, tmp_path, monkeypatch):
    """A step's forward and sampling programs as the runner dispatches them under each
    sampler plan (sampling.SamplerPlan: greedy or sampled rows, with logprobs, with
    penalties, bias, banned ids or masks), lowered for a GPU: no conditional, which XLA:GPU
    runs by copying its predicate to the host, so dispatching the program would wait for the
    work queued before it (an H200 measured the sampler's dispatch at the forward's 4.4 ms).
    The full plans skip work with conditionals on CPU and TPU only (sampling.if_needed)."""
    from ksana_jax.step_programs import forward_step, sample_step

    def make_step(cfg, layout, max_logprobs):
        def step(params, kv, state, buffers, bitmask):
            forwarded, kv, state, _ = forward_step(
                params, cfg, kv, state, buffers, layout, max_logprobs, "pallas_gpu"
            )
            out, state = sample_step(forwarded, state, bitmask, max_logprobs, SamplerPlan(plan))
            return out, kv, state

        return step

    module = _lowered_for_cuda(tmp_path, monkeypatch, make_step)
    assert module.count(paged_attention_gpu.TRITON_CUSTOM_CALL) >= 2
    conditionals = re.findall(r"stablehlo\.(case|if|while)\b", module)
    assert conditionals == [], conditionals


def test_speculative_step_programs_lower_for_cuda_without_a_conditional(tmp_path, monkeypatch):
    """With a draft model proposing 2 tokens, the forward and sampling programs of a step
    whose rows draft and use all W sampled positions, lowered for a GPU: no conditional and
    no loop. The host knows whether some row drafts and how many positions are in use
    (RowInputs' static fields), and the draft's k steps are unrolled; before, a lax.cond
    around a while loop ran the draft and a lax.switch picked the positions."""
    from ksana_jax.step_programs import forward_step, sample_step

    def make_step(cfg, layout, max_logprobs):
        def step(params, kv, state, buffers, bitmask):
            draft_kv = jax.tree.map(jnp.zeros_like, kv)
            forwarded, kv, state, draft_kv = forward_step(
                params, cfg, kv, state, buffers, layout, max_logprobs, "pallas_gpu",
                params, draft_kv, cfg, 2,
            )  # fmt: skip
            out, state = sample_step(forwarded, state, bitmask, max_logprobs, SamplerPlan.RANDOM)
            return out, kv, state, draft_kv

        return step

    module = _lowered_for_cuda(tmp_path, monkeypatch, make_step, num_speculative=2)
    # the target's and the draft's attention and KV writes
    assert module.count(paged_attention_gpu.TRITON_CUSTOM_CALL) >= 4
    assert re.findall(r"stablehlo\.(case|if|while)\b", module) == []

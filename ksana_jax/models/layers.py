"""Pure building blocks shared by the decoder families: norms, rotary, projections, gated MLP,
soft-capping and the call into the attention backend.

Activations flow in float32 (the residual stream); weights may be float32 or bfloat16 and
each matmul accumulates in float32, so norms, softmax and logits are always computed in
float32 whatever the parameter dtype.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ksana_jax import pallas_kernels, quant
from ksana_jax.config import ModelConfig
from ksana_jax.kv_cache import KVCache
from ksana_jax.models import fusion
from ksana_jax.pallas_kernels import linear_cpu, quant_matmul
from ksana_jax.pallas_kernels.attention_spec import AttentionSpec
from ksana_jax.step_inputs import StepInputs


class RMSNorm(NamedTuple):
    """An RMS norm (`rms_norm`'s arguments) for `linear` to apply to x before its product."""

    weight: jax.Array
    eps: float
    offset: float = 0.0


def linear(
    x: jax.Array,
    w: jax.Array | quant.QuantizedMatrix,
    b: jax.Array | None = None,
    *,
    norm: RMSNorm | None = None,
    residual: jax.Array | None = None,
    gate: str | None = None,
) -> jax.Array:
    """[residual +] norm(x) times w transposed (+ b): x f32[..., I] (RMS-normed first when
    `norm` is given; with a `gate` activation, x f32[..., 2I] holds (gate, up) pairs and the
    input is `gate_up_activation(x, gate)`), w [O, I], b [O], residual f32[..., O] ->
    f32[..., O], accumulated in float32. The CPU kernel takes the norm, the gate and the
    residual into its call (a decoder layer's norms, residual adds and act(gate) * up are
    otherwise XLA:CPU thunks of their own, ~12 of its ~19 at batch 1); elsewhere they are the
    jnp ops that XLA fuses with their neighbours.

    On CPU, a few rows (decode) go through pallas_kernels/linear_cpu.py, a C++ kernel that
    streams w's bytes (quantized ones as they are) on every core; `linear_cpu.takes` decides
    at trace time. On TPU and GPU an int4 w goes through pallas_kernels/quant_matmul.py,
    which dequantizes tiles in VMEM / registers (XLA does not fuse int4's dequantize into
    the dot there), per device on its shard under tensor parallelism; an int8 w with one
    scale per output channel is multiplied as (x . values^T) * scales, which XLA fuses into
    one GEMM (quant.scaled_product). Otherwise a quantized w (quant.py) is dequantized to
    its `dtype` inside the step and multiplied as a float weight by XLA (the reference path).

    Weights are [out, in] (torch's layout): XLA:CPU's bfloat16 products (YNNPACK) stream
    them faster than [in, out] at decode's few rows -- SmolLM2 batch-1 decode 50.5 -> 40.1
    ms, 64 rows 117 -> 105 ms (measured, jax 0.10.2).
    """
    if linear_cpu.takes(x, w):
        fused = residual if b is None else None  # the bias comes before the residual
        y = linear_cpu.linear(x, w, norm, fused, gate)
        y = y if b is None else y + b.astype(jnp.float32)
        return y if residual is None or fused is not None else residual + y
    if quant.is_quantized(w):
        w = quant.unstacked(w)  # a layer view's own matrix (quant.py)
    if gate is not None:
        x = gate_up_activation(x, gate)
    if norm is not None:
        x = rms_norm(x, *norm)
    y = _product(x, w, b)
    return y if residual is None else residual + y


def lm_head(
    x: jax.Array, w: jax.Array | quant.QuantizedMatrix, argmax_if: jax.Array
) -> tuple[jax.Array, jax.Array | None]:
    """The logits `linear(x, w)` f32[R, V] and, where the CPU kernel takes the product, each
    row's first largest logit i32[R] from the same call (linear_cpu.linear_argmax): where
    `argmax_if` (bool[]) holds, the kernel folds its sums into each row's maximum and never
    writes the logits (undefined then), so greedy decoding neither stores them nor reads
    them again. Elsewhere (logits, None): the sampler takes the argmax."""
    if linear_cpu.takes(x, w):
        return linear_cpu.linear_argmax(x, w, argmax_if)
    return linear(x, w), None


def _product(x: jax.Array, w: jax.Array | quant.QuantizedMatrix, b: jax.Array | None) -> jax.Array:
    """`linear` off the CPU kernel: x f32[..., I] . w^T (+ b)."""
    if quant_matmul.supports(platform := jax.default_backend(), x, w):
        y = quant_matmul.matmul(x, w, platform)
        return y if b is None else y + b.astype(jnp.float32)
    per_channel = isinstance(w, quant.Int8Matrix) and w.group_size == w.shape[-1]
    if per_channel and platform in ("gpu", "tpu"):
        y = quant.scaled_product(x, w)  # one GEMM reading the int8 bytes
        return y if b is None else y + b.astype(jnp.float32)
    if x.ndim == 2 and x.shape[0] == 1 and w.dtype != jnp.float32:
        # One row takes XLA:CPU's matrix-vector path, 2x slower than two rows for bfloat16
        # weights (measured: 561 vs 259 us for 576 x 1536); a zero row costs nothing there.
        # Float32 weights are the opposite: two rows stream them ~1.4x slower (SmolLM2 batch-1
        # float32 decode, 30 layers + LM head of products only: 38.8 vs 28.1 ms).
        return _product(jnp.pad(x, ((0, 1), (0, 0))), w, b)[:1]
    if quant.is_quantized(w):
        w = quant.dequantize(quant.after(w, x))
    contract = (((x.ndim - 1,), (1,)), ((), ()))
    y = jax.lax.dot_general(x.astype(w.dtype), w, contract, preferred_element_type=jnp.float32)
    return y if b is None else y + b.astype(jnp.float32)


def embed_rows(table: jax.Array | quant.QuantizedMatrix, token_ids: jax.Array) -> jax.Array:
    """Rows `token_ids` i32[T] of the embedding table [V, D] -> [T, D] in the table's dtype;
    a quantized table gathers the packed rows first, then dequantizes only those."""
    if quant.is_quantized(table):
        return quant.take_rows(table, token_ids)
    return table[token_ids]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm over the last axis in float32: x f32[..., D], weight [D] -> f32[..., D].

    The scale is `offset + weight` computed in float32: Gemma stores weights around 0 and
    scales by (1 + w), exactly as transformers' Gemma RMSNorm.
    """
    x = x.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * (offset + weight.astype(jnp.float32))


def rope_inv_freq(cfg: ModelConfig, layer_index: int = 0) -> np.ndarray:
    """Inverse rotary frequencies f32[H // 2] of layer `layer_index`, with its rope base and
    scaling (`cfg.layer_rope`) and the GGUF rope factors (`cfg.rope_freq_factors`) applied.

    Computed in float32 exactly as transformers does, so positions rotate identically.
    """
    dim = cfg.head_dim
    theta, scaling = cfg.layer_rope(layer_index)
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
    if cfg.rope_freq_factors is not None:
        # llama.cpp's rope_freqs.weight: theta_i = pos * base^(-2i/H) / factor_i.
        inv_freq = (inv_freq / np.asarray(cfg.rope_freq_factors, np.float32)).astype(np.float32)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    # llama3: long wavelengths are divided by `factor`, short ones kept, the band between
    # them interpolated smoothly (Llama 3.1 paper, section 3.3; transformers' formula).
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos and sin f32[T, H/2] of each token's rotary angles, positions i32[T] times
    `inv_freq` (rope_inv_freq): what `reference.rotate` turns q and k by."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    return jnp.cos(freqs), jnp.sin(freqs)


def qkv_projection(
    cfg: ModelConfig, layer: dict, x: jax.Array, norm: RMSNorm | None = None
) -> jax.Array:
    """x f32[T, D] (normed by `norm` first when given) -> qkv f32[T, K, N/K + 2, H], per KV
    head its query heads, its key and its value (biases added): the product with the layer's
    fused `wqkv` (fusion.py) as it comes, or three products with wq / wk / wv, where the
    checkpoint's parts could not be fused, put in that order."""
    t, k, h = x.shape[0], cfg.num_key_value_heads, cfg.head_dim
    if "wqkv" in layer:
        return linear(x, layer["wqkv"], layer.get("bqkv"), norm=norm).reshape(t, k, -1, h)
    if norm is not None:
        x = rms_norm(x, *norm)
    q, k_new, v_new = (
        linear(x, layer[w], layer.get(b)).reshape(t, k, -1, h)
        for w, b in (("wq", "bq"), ("wk", "bk"), ("wv", "bv"))
    )
    return jnp.concatenate([q, k_new, v_new], axis=2)


def gated_mlp(
    x: jax.Array,
    mlp: dict,
    act: str = "silu",
    norm: RMSNorm | None = None,
    residual: jax.Array | None = None,
) -> jax.Array:
    """[residual +] down(act(gate(x)) * up(x)): x f32[T, D] (normed by `norm` first when
    given) -> f32[T, D]; act "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU with the tanh
    approximation, Gemma). `mlp` holds w_down and either the fused w_gate_up (fusion.py: a
    dense layer's) or w_gate and w_up (an expert's, or parts that could not be fused)."""
    if "w_gate_up" in mlp:  # act(gate) * up inside the down product (the CPU kernel's call)
        gate_up = linear(x, mlp["w_gate_up"], norm=norm)
        return linear(gate_up, mlp["w_down"], residual=residual, gate=act)
    x = x if norm is None else rms_norm(x, *norm)
    hidden = activation(linear(x, mlp["w_gate"]), act) * linear(x, mlp["w_up"])
    return linear(hidden, mlp["w_down"], residual=residual)


def activation(gate: jax.Array, act: str) -> jax.Array:
    """The gated MLP's activation: "silu" or "gelu_pytorch_tanh" (GELU, tanh approximation)."""
    return jax.nn.silu(gate) if act == "silu" else jax.nn.gelu(gate, approximate=True)


def gate_up_activation(gate_up: jax.Array, act: str) -> jax.Array:
    """act(gate) * up of gate_up f32[..., 2F] holding (gate, up) pairs (the fused gate/up
    product's layout, fusion.py) -> f32[..., F]."""
    gate, up = fusion.split_gate_up(gate_up)
    return activation(gate, act) * up


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap), or x when cap is None (Gemma 2's logit soft-capping)."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def attention_spec(cfg: ModelConfig, layer_index: int) -> AttentionSpec:
    """Layer `layer_index`'s static attention description: scale, window, soft-cap."""
    return AttentionSpec(
        sm_scale=cfg.sm_scale,
        sliding_window=cfg.layer_window(layer_index),
        logit_softcap=cfg.attn_logit_softcapping,
    )


def attention_specs(cfg: ModelConfig) -> tuple[AttentionSpec, ...]:
    """Every layer's AttentionSpec, in order (what a backend must support to run `cfg`)."""
    return tuple(attention_spec(cfg, i) for i in range(cfg.num_hidden_layers))


def paged_attention(
    cfg: ModelConfig,
    inputs: StepInputs,
    kv: KVCache,
    layer_index: int,
    qkv: jax.Array,
    backend: str,
) -> tuple[jax.Array, KVCache]:
    """qkv f32[T, K, N/K + 2, H] (`qkv_projection`) -> rotary on q and k (at the tokens'
    positions, with the layer's frequencies), this step's K/V written into the pages, then
    attention -> (f32[T, N, H], kv): the backend's `layer_attention`
    (`reference.attend_layer`'s semantics; the cpu backend runs it as one call)."""
    cos, sin = rope_tables(inputs.positions, rope_inv_freq(cfg, layer_index))
    kernels = pallas_kernels.get_backend(backend)
    attend = kernels.layer_attention(kernels.interpreted_here())
    if inputs.page_rows is not None:  # only a backend that reads_page_rows gets them
        attend = functools.partial(attend, page_rows=inputs.page_rows)
    return attend(
        qkv,
        kv,
        layer_index,
        cos,
        sin,
        inputs.slot_ids,
        inputs.page_table,
        inputs.seq_lens,
        inputs.query_starts,
        spec=attention_spec(cfg, layer_index),
    )

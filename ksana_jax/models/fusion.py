"""Projections that read the same input, held as one matrix at run time: q/k/v as `wqkv`
(and their biases as `bqkv`), gate/up as `w_gate_up` -- vLLM's QKVParallelLinear and
MergedColumnParallelLinear.

Why: one product instead of two or three, and fewer arrays for every step to pass. At batch
1 on a small host the jitted step's call costs host time per parameter array (PjRt's
argument checks, 2.5-4.5 us each on the 2-core test machine; benchmarks/cpu_step_profile.py
prints it), on the same cores as the matmuls: SmolLM2 in int4 passes 694 arrays a step
unfused and 424 fused, in bfloat16 272 and 182.

The checkpoint keeps the separate matrices (HF's and GGUF's names, stacked on L);
`registry.params_from_flat` fuses, `registry.params_to_flat` splits again, so the fused
layout exists only in the params pytree the forward functions read.

Row order, chosen so that a contiguous split of the fused rows -- what sharding.py makes
of a dim split over devices -- gives each device whole parts and no reshuffle is needed:

    wqkv       per KV head g: its N/K query heads, K head g, V head g   [(N + 2K) * H, D]
    w_gate_up  per row f of the MLP: gate row f, up row f               [2F, D]

so tensor parallelism splits `wqkv` by KV heads (logical axis "kv_heads") and `w_gate_up`
by MLP rows ("mlp"), as it splits the parts. With fewer KV heads than devices (a
kv_replica axis > 1) `wqkv` is split over the model axis only and each device computes the
query heads of its KV heads for the devices replicating them: exact, at some extra q FLOPs.

Quantized parts (quant.py) fuse field by field: every field has the matrix's rows on its
second-to-last axis. Int8 parts with different scale groups (a GGUF's kept Q8_0 blocks
beside a requantized per-channel tensor) get per-group float32 scales, which is exact.
Parts of different formats (kept Q4_0 and Q8_0 blocks in one GGUF) stay apart: the model
reads either form.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ksana_jax import quant
from ksana_jax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Fusion:
    name: str  # flat name of the fused parameter
    parts: tuple[str, ...]  # flat names of its parts, in row order within a group
    by_kv_head: bool  # groups: the KV heads (q/k/v); else every row of the parts (gate/up)
    matrix: bool  # rows on the second-to-last axis (weights), else the last (biases)
    after: str | None = None  # fused only where this fusion was (biases: their weights')

    def rows_axis(self, a: Any) -> int:
        """The rows axis of `a`, this fusion's fused parameter or a part (stacked or not)."""
        return len(a.shape) - (2 if self.matrix else 1)

    def part_rows(self, cfg: ModelConfig, fused_rows: int) -> list[int]:
        """Rows of each part of a fused parameter with `fused_rows` rows."""
        if self.by_kv_head:
            n, k, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
            return [n * h, k * h, k * h]
        return [fused_rows // len(self.parts)] * len(self.parts)

    def groups(self, cfg: ModelConfig, part_rows: int) -> int:
        """Row groups of the fused parameter, its first part having `part_rows` rows: each
        group holds one slice of every part."""
        return cfg.num_key_value_heads if self.by_kv_head else part_rows


FUSIONS = (
    Fusion("layers.wqkv", ("layers.wq", "layers.wk", "layers.wv"), True, matrix=True),
    Fusion("layers.bqkv", ("layers.bq", "layers.bk", "layers.bv"), True, False, "layers.wqkv"),
    Fusion("layers.w_gate_up", ("layers.w_gate", "layers.w_up"), False, matrix=True),
)
PART_OF = {f.name: f.parts[0] for f in FUSIONS}  # fused name -> a part (same layers, axes)


def _xp(a: Any) -> Any:
    return np if isinstance(a, np.ndarray) else jnp


def _interleave(arrays: list[Any], groups: int, axis: int) -> Any:
    """Arrays that differ only in `axis` -> one, `groups` slices of each in turn along it."""
    xp = _xp(arrays[0])
    pieces = [
        a.reshape(*a.shape[:axis], groups, a.shape[axis] // groups, *a.shape[axis + 1 :])
        for a in arrays
    ]
    out = xp.concatenate(pieces, axis=axis + 1)
    return out.reshape(*out.shape[:axis], -1, *out.shape[axis + 2 :])


def _deinterleave(a: Any, sizes: list[int], groups: int, axis: int) -> list[Any]:
    """Inverse of _interleave: parts of `sizes` rows along `axis`."""
    grouped = a.reshape(*a.shape[:axis], groups, a.shape[axis] // groups, *a.shape[axis + 1 :])
    cuts = np.cumsum([s // groups for s in sizes])[:-1].tolist()
    pieces = _xp(a).split(grouped, cuts, axis=axis + 1)
    return [p.reshape(*p.shape[:axis], -1, *p.shape[axis + 2 :]) for p in pieces]


def _same_int8_groups(parts: list[quant.Int8Matrix]) -> list[quant.Int8Matrix] | None:
    """Int8 parts given scales of one grouping and dtype: float32 scales of the finest
    grouping where they differ (a per-channel scale repeated per group gives the same
    products exactly); None when the groupings do not nest (never the case for what quant.py
    and the GGUF reader make)."""
    groups = {p.scales.shape[-1] for p in parts}
    dtypes = {jnp.dtype(p.scales.dtype) for p in parts}
    if len(groups) == 1 and len(dtypes) == 1:
        return parts
    most = max(groups)
    if groups - {1, most}:
        return None
    out = []
    for p in parts:
        scales = p.scales.astype(np.float32)
        if scales.shape[-1] != most:
            scales = _xp(scales).repeat(scales, most, axis=-1)
        out.append(dataclasses.replace(p, scales=scales))
    return out


def _fused(f: Fusion, parts: list[Any], groups: int) -> Any | None:
    """The parts fused, or None when they cannot be: different kinds (a GGUF's kept Q8_0
    blocks beside kept Q4_0 ones) or product dtypes."""
    if len({type(p) for p in parts}) != 1 or len({jnp.dtype(p.dtype) for p in parts}) != 1:
        return None
    if not quant.is_quantized(parts[0]):
        return _interleave(parts, groups, f.rows_axis(parts[0]))
    if isinstance(parts[0], quant.Int8Matrix) and (parts := _same_int8_groups(parts)) is None:
        return None
    fields = {
        k: _interleave([getattr(p, k) for p in parts], groups, getattr(parts[0], k).ndim - 2)
        for k in parts[0].data_fields
    }
    return dataclasses.replace(parts[0], **fields)


def fuse(flat: Mapping[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """Flat params (checkpoint names, layers stacked) with each fusion's parts replaced by the
    fused parameter. Parts that are absent (no biases) or cannot be fused (`_fused`) stay as
    they are, and so do the biases of weights that stay apart; the model reads either
    (models/layers.py: qkv_projection, gated_mlp)."""
    out = dict(flat)
    for f in FUSIONS:
        if not all(p in out for p in f.parts) or (f.after and f.after not in out):
            continue
        parts = [out[p] for p in f.parts]
        fused = _fused(f, parts, f.groups(cfg, parts[0].shape[f.rows_axis(parts[0])]))
        if fused is not None:
            out = {k: v for k, v in out.items() if k not in f.parts} | {f.name: fused}
    return out


def unfuse(flat: Mapping[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """Inverse of `fuse`: flat params with the checkpoint's separate parts (int8 parts whose
    scales `fuse` regrouped keep the float32 per-group scales: the same values)."""
    out = dict(flat)
    for f in FUSIONS:
        if f.name not in out:
            continue
        fused = out.pop(f.name)
        sizes = f.part_rows(cfg, fused.shape[f.rows_axis(fused)])
        groups = f.groups(cfg, sizes[0])
        if quant.is_quantized(fused):
            split = {
                k: _deinterleave(getattr(fused, k), sizes, groups, getattr(fused, k).ndim - 2)
                for k in fused.data_fields
            }
            pieces = [
                dataclasses.replace(fused, **{k: v[i] for k, v in split.items()})
                for i in range(len(f.parts))
            ]
        else:
            pieces = _deinterleave(fused, sizes, groups, f.rows_axis(fused))
        out |= dict(zip(f.parts, pieces, strict=True))
    return out


# --------------------------------------------------------------------------- compute


def split_gate_up(y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The product of x f32[T, D] and `w_gate_up` f32[T, 2F] -> gate, up f32[T, F]."""
    pairs = y.reshape(*y.shape[:-1], -1, 2)
    return pairs[..., 0], pairs[..., 1]

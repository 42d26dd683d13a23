"""The device mesh and every array's NamedSharding, derived from logical axis names.

In: the tensor-parallel size (`EngineConfig.tensor_parallel_size`), the number of replicas
(`data_parallel_size`) and the model's head counts. Out: a `ShardingPlan` -- the `Mesh`,
the sharding of each parameter (by its checkpoint name), of the KV array and of the step's
inputs (replicated). The jitted step is plain GSPMD: its arguments carry these shardings and
XLA partitions the computation, adding one all-reduce of f32[T, D] after each row-parallel
matmul. Only the Pallas kernels, which XLA cannot partition, run under `shard_map`: the
attention ones by heads (`shard_over_heads`, used by pallas_kernels), the int4 matmuls by
the split `with_splits` records on each int4 matrix (pallas_kernels/quant_matmul.py). One
device is the 1 x 1 x 1 mesh of the same code.

Mesh axes (tp = model x kv_replica devices hold one copy of the model between them):

    data        replicas; params and KV are replicated along it (size 1 in the engine today)
    model       devices holding different KV heads
    kv_replica  devices holding the same KV heads: > 1 only when the model has fewer KV
                heads than tp (K=2, tp=4: model 2 x kv_replica 2, each device holds one
                whole KV head and half of that head's query heads)

Logical axes -> mesh axes (Megatron-style; matrices are [out, in]; each family declares its
parameters' logical axes, e.g. llama.PARAM_AXES):

    q_heads  N*H   wq, bq column-split; wo row-split (its input)   -> (model, kv_replica)
    kv_heads K*H   wk, wv, bk, bv column-split; KV pages by head   -> model
    mlp      F     w_gate, w_up column-split; w_down row-split     -> (model, kv_replica)
    vocab    V     embed and lm_head, both [V, D], split by vocab  -> (model, kv_replica)
    expert_mlp  F of each expert (MoE, models/moe.py), split as mlp -> (model, kv_replica)
    experts  E     with expert parallelism instead: whole experts  -> (model, kv_replica)
    embed    D, layers L, head_dim H, pages, ...                   -> never split

A mixture of experts is tensor-parallel like the dense MLP (every device holds every expert's
slice of F), or with `ModelConfig.expert_parallel` (EngineConfig.enable_expert_parallel) each
device holds E / tp whole experts, which tp must divide; attention is split by heads either way.
The MoE layer runs under shard_map and ends with one all-reduce (moe.py says why).

Embeddings and the LM head are split by vocabulary, not by model dim: the LM head is then
column-parallel, each device computes its V/tp logits with no communication, and sampling
reduces over the vocabulary (max, sums, top-k) on f32[S, V/tp] pieces. Split by D, every
device would produce partial logits of the full f32[S, V] to all-reduce. The (tied)
embedding lookup becomes a masked local gather plus one all-reduce of f32[T, D], the same
cost as a row-parallel matmul.

Attention is split by whole heads when the heads allow it (`attention_split`): K % tp == 0,
or tp % K == 0 with each KV head's query group divisible by tp / K. Otherwise (SmolLM2's
9 query / 3 KV heads at tp=2 or 4) attention -- wq, wk, wv, wo and the KV pages -- is
replicated and every device computes all heads, while the MLP, embeddings and LM head are
still split. That is exact and keeps the checkpoint's shapes; the alternative, padding the
heads to a multiple of tp with zero weights (9/3 -> 12/4 at tp=4), would split attention
too at the cost of 33% more attention FLOPs and a reshaped checkpoint. A dimension that does
not divide by its mesh axes (a vocabulary of 32001) is replicated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ksana_jax import quant
from ksana_jax.config import ModelConfig
from ksana_jax.kv_cache import KVCache
from ksana_jax.models import registry

DATA, MODEL, KV_REPLICA = "data", "model", "kv_replica"
TENSOR = (MODEL, KV_REPLICA)  # the tensor-parallel devices, for column and row splits

# kv [L, 2, K, num_pages, page_size, H] (kv_cache.py)
KV_AXES = ("layers", "kv_pair", "kv_heads", "pages", "page_slots", "head_dim")


def attention_split(num_heads: int, num_kv_heads: int, tp: int) -> tuple[int, int] | None:
    """(model, kv_replica) sizes splitting attention over `tp` devices by whole heads, or
    None when the heads do not allow it (attention is then replicated).

    Device (i, j) of the two axes holds KV heads [i*K/model, (i+1)*K/model) and query heads
    [(i*kv_replica + j) * N/tp, ...): always query heads of its own KV heads.
    """
    group = num_heads // num_kv_heads
    if num_kv_heads % tp == 0:
        return tp, 1
    if tp % num_kv_heads == 0 and group % (tp // num_kv_heads) == 0:
        return num_kv_heads, tp // num_kv_heads
    return None


def heads_are_split(mesh: Mesh | jax.sharding.AbstractMesh, num_kv_heads: int) -> bool:
    """Whether a mesh built by `make_plan` splits attention by heads (else replicates it).

    make_plan's model axis has K / (K / model) = model KV-head groups when attention is split
    and is tp, which does not divide K, when it is replicated.
    """
    model, replica = mesh.shape[MODEL], mesh.shape[KV_REPLICA]
    return model * replica > 1 and num_kv_heads % model == 0


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """A mesh and the mesh axes of each logical axis; gives every array's NamedSharding."""

    mesh: Mesh
    rules: dict[str, tuple[str, ...]]  # logical axis -> mesh axes; absent = replicated
    heads_split: bool  # attention split by heads (else replicated)
    # parameter's flat name -> logical axes (its family's declaration, registry.param_axes)
    param_axes: Mapping[str, tuple[str | None, ...]] = dataclasses.field(default_factory=dict)
    # on one device, quantized layer matrices held stacked over the layers
    # (registry.stack_layers): where the CPU kernel indexes them (model.py decides)
    stack_layers: bool = False

    @property
    def tensor_parallel_size(self) -> int:
        return self.mesh.shape[MODEL] * self.mesh.shape[KV_REPLICA]

    @property
    def kv_head_shards(self) -> int:
        """Devices the KV array's heads are divided between (1 when it is replicated)."""
        return self.mesh.shape[MODEL] if self.heads_split else 1

    def spec(self, logical_axes: Sequence[str | None], shape: Sequence[int]) -> P:
        """PartitionSpec of an array; a dim that its mesh axes do not divide is replicated."""
        if len(logical_axes) != len(shape):
            raise ValueError(f"logical axes {logical_axes} do not match shape {shape}")
        parts = []
        for name, size in zip(logical_axes, shape, strict=True):
            axes = self.rules.get(name, ()) if name else ()
            devices = math.prod(self.mesh.shape[a] for a in axes)
            split = axes and devices > 1 and size % devices == 0
            parts.append((axes[0] if len(axes) == 1 else axes) if split else None)
        while parts and parts[-1] is None:  # the canonical form, as jit returns shardings
            parts.pop()
        return P(*parts)

    def sharding(self, logical_axes: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical_axes, shape))

    def param_sharding(self, name: str, shape: Sequence[int]) -> NamedSharding:
        """Sharding of the parameter stored under checkpoint name `name` (stacked layers)."""
        if name not in self.param_axes:
            raise ValueError(
                f"no logical axes for parameter {name!r}; known: {list(self.param_axes)}"
            )
        return self.sharding(self.param_axes[name], shape)

    def kv_sharding(self, shape: Sequence[int]) -> NamedSharding:
        return self.sharding(KV_AXES, shape)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def param_shardings(self, params: Any) -> Any:
        """A tree like `params` (registry.Params, one entry per layer) of each leaf's sharding."""

        def one(path, leaf):
            axes = self.param_axes[registry.flat_name(path)]
            if len(leaf.shape) == len(axes) - 1:  # one layer of a stacked parameter
                axes = axes[1:]
            return self.sharding(axes, leaf.shape)

        return jax.tree_util.tree_map_with_path(one, params)

    def shard_params(self, params: Any) -> Any:
        """`params` placed in their shardings (a no-op for arrays already there), each int4
        matrix marked with its split (`with_splits`), the quantized layer matrices stacked as
        `stack_layers` says (on one device) and else held per layer."""
        stacked = self.stack_layers and self.mesh.size == 1
        params = self.with_splits(registry.stack_layers(params, stacked))
        return jax.device_put(params, self.param_shardings(params))

    def with_splits(self, params: Any) -> Any:
        """`params` with each int4 matrix's `split` set to the mesh axes this plan splits its
        out and in dims over (quant.Int4Matrix.split: the Pallas kernels run per device under
        `shard_map` with it); None where the packed bytes and the scales split differently
        (an input dim whose groups of 32 do not divide among the devices)."""

        def one(path, leaf):
            if not isinstance(leaf, quant.Int4Matrix):
                return leaf
            axes = self.param_axes[registry.flat_name(path)]
            axes = axes[len(axes) - leaf.packed.ndim :]
            packed, scales = (self.spec(axes, a.shape) for a in (leaf.packed, leaf.scales))
            split = None
            if packed == scales:
                dims = (*packed, *[None] * (leaf.packed.ndim - len(packed)))[-2:]
                split = tuple(() if d is None else (d,) if isinstance(d, str) else d for d in dims)
            return dataclasses.replace(leaf, split=split)

        return jax.tree_util.tree_map_with_path(one, params, is_leaf=quant.is_quantized)

    def put_replicated(self, tree: Any) -> Any:
        """Host arrays (step inputs) as arrays replicated over the mesh; works multi-process,
        where every process passes the same values."""
        sharding = self.replicated
        if jax.process_count() == 1:
            return jax.device_put(tree, sharding)  # one call for the tree: ~10x faster
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), tree
        )

    @contextlib.contextmanager
    def activate(self) -> Iterator[None]:
        """Makes the mesh the context mesh (shard_map around Pallas kernels reads it)."""
        with jax.set_mesh(self.mesh):
            yield

    def describe(self) -> str:
        shape = " x ".join(f"{k} {v}" for k, v in self.mesh.shape.items())
        if self.mesh.size == 1:
            return f"mesh ({shape}): one device"
        attention = "split by heads" if self.heads_split else "replicated (heads do not divide)"
        experts = "; experts split whole (expert parallel)" if "experts" in self.rules else ""
        return f"mesh ({shape}) over {self.mesh.size} devices; attention {attention}{experts}"


def make_plan(
    cfg: ModelConfig,
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    devices: Sequence[jax.Device] | None = None,
    stack_layers: bool = False,
) -> ShardingPlan:
    """The mesh and sharding rules for `cfg` on the first tp * dp devices (all processes');
    `stack_layers`: ShardingPlan.stack_layers.

    Raises ValueError when fewer devices exist than requested.
    """
    tp, dp = tensor_parallel_size, data_parallel_size
    if tp < 1 or dp < 1:
        raise ValueError(f"tensor_parallel_size ({tp}) and data_parallel_size ({dp}) must be >= 1")
    if cfg.expert_parallel and cfg.num_experts % tp:
        raise ValueError(
            f"enable_expert_parallel needs num_experts ({cfg.num_experts}) divisible by "
            f"tensor_parallel_size ({tp})"
        )
    devices = list(jax.devices() if devices is None else devices)
    if tp * dp > len(devices):
        raise ValueError(
            f"tensor_parallel_size {tp} x data_parallel_size {dp} needs {tp * dp} devices, "
            f"found {len(devices)} ({jax.default_backend()}); on CPU, "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={tp * dp} fakes them"
        )
    if jax.process_count() > 1 and tp * dp != len(devices):
        raise ValueError(
            f"with {jax.process_count()} processes the mesh must span all {len(devices)} "
            f"devices, but tensor_parallel_size {tp} x data_parallel_size {dp} = {tp * dp}"
        )
    split = attention_split(cfg.num_attention_heads, cfg.num_key_value_heads, tp)
    model, replica = split or (tp, 1)
    mesh = jax.make_mesh(
        (dp, model, replica),
        (DATA, MODEL, KV_REPLICA),
        axis_types=(AxisType.Auto,) * 3,
        devices=devices[: tp * dp],
    )
    rules = {"vocab": TENSOR, "mlp": TENSOR}
    if cfg.expert_parallel:
        rules["experts"] = TENSOR
    else:
        rules["expert_mlp"] = TENSOR
    if split is not None and tp > 1:
        rules |= {"q_heads": TENSOR, "kv_heads": (MODEL,)}
    return ShardingPlan(
        mesh,
        rules,
        heads_split=split is not None and tp > 1,
        param_axes=registry.param_axes(cfg),
        stack_layers=stack_layers,
    )


def bytes_per_device(tree: Any) -> dict[jax.Device, int]:
    """Bytes each device holds of the arrays in `tree` (its addressable shards)."""
    out: dict[jax.Device, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


def fetch(tree: Any) -> Any:
    """Device arrays -> numpy, from any process: a replicated array is read from a local
    shard; one split across processes is all-gathered (a collective every process runs)."""

    def one(x: jax.Array) -> np.ndarray:
        if x.is_fully_addressable:
            return np.asarray(x)
        if x.sharding.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return multihost_utils.process_allgather(x, tiled=True)

    return jax.tree.map(one, tree)


def shard_over_heads(fn: Callable[..., jax.Array], kind: str) -> Callable[..., jax.Array]:
    """`fn` -- a Pallas attention (kind "attention"), one-layer KV write ("write_layer") or
    a layer's rotary, write and attention ("attend_layer"), with the signatures in
    pallas_kernels -- run per device under `shard_map` over the context mesh; without one
    (or on one device), `fn` itself.

    Each device runs the kernel on its own heads: q [T, N/tp, H], k_new/v_new [T, K/model, H]
    and its shard of the KV array; when attention is replicated it runs on all heads.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or MODEL not in mesh.shape or mesh.size == 1:
        return fn

    def specs(num_kv_heads: int) -> tuple[P, P, Any]:
        split = heads_are_split(mesh, num_kv_heads)
        q_axes, kv_axes = (TENSOR, MODEL) if split else (None, None)
        # q [T, N, H]; k_new, v_new [T, K, H]; kv pages [L, 2, K, num_pages, page_size, H]
        # and scales [L, 2, K, ...]: both split by KV heads (axis 2)
        kv_spec = KVCache(P(None, None, kv_axes), P(None, None, kv_axes))
        return P(None, q_axes, None), P(None, kv_axes, None), kv_spec

    def attention(q, k_new, v_new, kv, layer_index, page_table, seq_lens, query_starts, **kw):
        q_spec, heads, kv_spec = specs(kv.pages.shape[2])
        local = jax.shard_map(
            lambda *args: fn(*args, **kw),
            mesh=mesh,
            in_specs=(q_spec, heads, heads, kv_spec, P(), P(), P(), P()),
            out_specs=q_spec,
            check_vma=False,
        )
        return local(q, k_new, v_new, kv, layer_index, page_table, seq_lens, query_starts)

    def write_layer(kv, layer_index, k_new, v_new, slot_ids):
        _, heads, kv_spec = specs(kv.pages.shape[2])
        local = jax.shard_map(
            fn,
            mesh=mesh,
            in_specs=(kv_spec, P(), heads, heads, P()),
            out_specs=kv_spec,
            check_vma=False,
        )
        return local(kv, layer_index, k_new, v_new, slot_ids)

    def attend_layer(qkv, kv, layer_index, cos, sin, *rows, **kw):
        # qkv [T, K, G + 2, H] by KV heads; the output [T, K * G, H] follows them
        _, heads, kv_spec = specs(kv.pages.shape[2])
        by_kv_head = P(None, heads[1], None, None)
        local = jax.shard_map(
            lambda *args: fn(*args, **kw),
            mesh=mesh,
            in_specs=(by_kv_head, kv_spec, P(), P(), P(), *[P()] * len(rows)),
            out_specs=(heads, kv_spec),
            check_vma=False,
        )
        return local(qkv, kv, layer_index, cos, sin, *rows)

    wrappers = {"attention": attention, "write_layer": write_layer, "attend_layer": attend_layer}
    if kind not in wrappers:
        raise ValueError(f"kind must be one of {list(wrappers)}, got {kind!r}")
    return wrappers[kind]

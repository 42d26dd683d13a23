"""The mixture-of-experts feed-forward layer, beside the dense gated MLP (layers.gated_mlp).

In: a layer's normed hidden states x f32[T, D], its router [E, D] and its stacked expert
weights w_gate_exps / w_up_exps [E, F, D], w_down_exps [E, D, F] ([out, in] per expert, as
HF stores each expert and llama.cpp stacks them). Out: f32[T, D], the sum over each token's
top-k experts of weight * down(silu(gate(x)) * up(x)).

Routing (`route`) is a softmax over all E router logits in float32, the top k of it, and with
`norm_topk_prob` those k renormalised to sum to 1: Qwen3-MoE's rule, and with renormalisation
exactly Mixtral's (a softmax over the top-k logits). The routing is data inside the jitted
step: which experts a token picks changes no shape, so no routing pattern recompiles, and
no token is dropped (there is no capacity).

The grouped products (`expert_ffn`) have three forms, all exact, one chosen at trace time
from the step's token bucket and the platform (`choose_method`):
- `gather`: when there are fewer assignments than experts (decode), each assignment's expert
  matrices are gathered and multiplied as a batch: the step reads only the chosen experts'
  weights, the point of a mixture of experts at batch 1, on every platform.
- `ragged` (TPU, GPU): the T*k (token, expert) assignments sorted by expert, and one
  `jax.lax.ragged_dot_general` per projection over the sorted rows with the experts' group
  sizes: XLA's grouped matmul there, whose work is T*k rows of one expert each. XLA:CPU has
  no grouped matmul; jax lowers ragged_dot there to masked products over every expert.
- `blocks` (CPU): megablox gmm's tiling in plain jnp. The sorted rows of each expert are
  padded to a multiple of B rows, and a loop runs once per non-empty block: a dense [B, D]
  product with that block's expert (a dynamic index into the stacked weights). The loop's
  length is data (no recompile), its work T*k rows plus padding, and it reads each routed
  expert's weights once per block.

On a mesh (sharding.py) the layer runs under `shard_map` over the tensor-parallel devices,
which all hold every token (the residual stream is replicated under tensor parallelism):
- without expert parallelism each device holds every expert's slice of F (column-split gate
  and up, row-split down, as the dense MLP) and computes its partial sum of every assignment;
- with expert parallelism (`ModelConfig.expert_parallel`) each device holds E / tp whole
  experts and computes the assignments routed to its own experts (the others are sorted last,
  outside every group, and weigh 0).
Either way the devices' partial outputs meet in one all-reduce (psum) of f32[T, D], the same
collective a row-parallel dense MLP ends with. We chose it over an all-to-all dispatch of the
T*k token rows to their experts' devices and back: the tokens are already on every device,
the reduce moves T*D values where the two all-to-alls would move 2*T*k*D, and it needs no
per-device capacity (which would drop tokens or bound the routing).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ksana_jax.config import DENSE_MLP, MOE_MLP, ModelConfig
from ksana_jax.models.layers import RMSNorm, gated_mlp, linear, rms_norm
from ksana_jax.sharding import KV_REPLICA, MODEL, TENSOR

# --------------------------------------------------------------------------- declarations

DENSE_PARAMS = ("layers.w_gate", "layers.w_up", "layers.w_down")
EXPERT_PARAMS = ("layers.router", "layers.w_gate_exps", "layers.w_up_exps", "layers.w_down_exps")
# Logical axes (sharding.py): "experts" is split with expert parallelism, "expert_mlp" (F)
# without; the router [E, D] is small and replicated.
PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "layers.router": ("layers", None, "embed"),
    "layers.w_gate_exps": ("layers", "experts", "expert_mlp", "embed"),
    "layers.w_up_exps": ("layers", "experts", "expert_mlp", "embed"),
    "layers.w_down_exps": ("layers", "experts", "embed", "expert_mlp"),
}


def with_experts(shapes: dict[str, tuple[int, ...]], cfg: ModelConfig) -> dict[str, tuple]:
    """A dense decoder's parameter shapes with the feed-forward split by kind: the dense MLP's
    stacked over the dense layers only, the router and experts over the MoE layers (a kind no
    layer has is left out)."""
    num_dense, num_moe = len(cfg.layer_ids(DENSE_MLP)), len(cfg.layer_ids(MOE_MLP))
    out = {k: v for k, v in shapes.items() if k not in DENSE_PARAMS}
    if num_dense:
        out |= {k: (num_dense, *shapes[k][1:]) for k in DENSE_PARAMS}
    if num_moe:
        e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        out |= {
            "layers.router": (num_moe, e, d),
            "layers.w_gate_exps": (num_moe, e, f, d),
            "layers.w_up_exps": (num_moe, e, f, d),
            "layers.w_down_exps": (num_moe, e, d, f),
        }
    return out


def expert_name_maps(
    router: str, gate: str, up: str, down: str
) -> tuple[dict[str, str], dict[str, str]]:
    """A family's per-layer names of the router and the experts, from their HF names (the
    expert index written "*"): HF -> flat name, and llama.cpp's (experts stacked as
    ffn_*_exps, the router as ffn_gate_inp) -> HF name."""
    hf_names = (router, gate, up, down)
    gguf_names = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
    hf_layer = dict(zip(hf_names, EXPERT_PARAMS, strict=True))
    gguf_layer = {f"{g}.weight": hf for g, hf in zip(gguf_names, hf_names, strict=True)}
    return hf_layer, gguf_layer


def gguf_moe_fields(
    metadata: Mapping[str, Any], tensor_names: set[str], num_layers: int
) -> dict[str, Any]:
    """The MoE fields of a GGUF (llama.cpp's keys): a layer is MoE when it has a router."""
    arch = metadata["general.architecture"]
    mlp_types = tuple(
        MOE_MLP if f"blk.{i}.ffn_gate_inp.weight" in tensor_names else DENSE_MLP
        for i in range(num_layers)
    )
    return dict(
        mlp_types=mlp_types,
        num_experts=int(metadata.get(f"{arch}.expert_count", 0)),
        num_experts_per_tok=int(metadata.get(f"{arch}.expert_used_count", 0)),
    )


def param_layers(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    """The layers holding parameter `name` (its stacked array's first axis, in order)."""
    if name in DENSE_PARAMS:
        return cfg.layer_ids(DENSE_MLP)
    if name in EXPERT_PARAMS:
        return cfg.layer_ids(MOE_MLP)
    return tuple(range(cfg.num_hidden_layers))


# --------------------------------------------------------------------------- compute


def feed_forward(
    cfg: ModelConfig, layer_index: int, layer: dict, x: jax.Array, norm: RMSNorm
) -> jax.Array:
    """x f32[T, D] plus layer `layer_index`'s feed-forward of norm(x): the dense gated MLP
    (the norm and the residual add in its products, layers.linear) or the mixture of
    experts, as `cfg.mlp_types` says."""
    if cfg.mlp_types[layer_index] == MOE_MLP:
        return x + moe_mlp(cfg, layer, rms_norm(x, *norm))
    return gated_mlp(x, layer, cfg.hidden_act, norm=norm, residual=x)


def route(x: jax.Array, router: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Routing of x f32[T, D] by router [E, D] -> (weights f32[T, k], expert ids i32[T, k])."""
    probs = jax.nn.softmax(linear(x, router), axis=-1)  # f32[T, E]
    weights, ids = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def moe_mlp(cfg: ModelConfig, layer: dict, x: jax.Array) -> jax.Array:
    """The MoE feed-forward of x f32[T, D] -> f32[T, D], under shard_map on a mesh."""
    weights, ids = route(x, layer["router"], cfg)
    experts = (layer["w_gate_exps"], layer["w_up_exps"], layer["w_down_exps"])
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or MODEL not in mesh.shape or mesh.size == 1:
        return expert_ffn(x, weights, ids, *experts, first_expert=0)
    tp = mesh.shape[MODEL] * mesh.shape[KV_REPLICA]
    num_experts, f = experts[0].shape[0], experts[0].shape[1]
    if cfg.expert_parallel:
        # sharding.make_plan refuses an expert count that tp does not divide
        gate_spec = down_spec = P(TENSOR)
    elif f % tp == 0:
        gate_spec, down_spec = P(None, TENSOR), P(None, None, TENSOR)
    else:  # the plan replicates experts whose F does not divide: every device computes all
        return expert_ffn(x, weights, ids, *experts, first_expert=0)

    def local(x, weights, ids, w_gate, w_up, w_down):
        first = jax.lax.axis_index(TENSOR) * w_gate.shape[0] if cfg.expert_parallel else 0
        partial = expert_ffn(x, weights, ids, w_gate, w_up, w_down, first_expert=first)
        return jax.lax.psum(partial, TENSOR)

    assert not cfg.expert_parallel or num_experts % tp == 0
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), P(), P(), gate_spec, gate_spec, down_spec),
        out_specs=P(),
        check_vma=False,
    )(x, weights, ids, *experts)


def expert_ffn(
    x: jax.Array,
    weights: jax.Array,
    ids: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    first_expert: jax.Array | int = 0,
    method: str = "auto",
) -> jax.Array:
    """Sum over each token's assignments to experts [first_expert, first_expert + E_local)
    of weight * down(silu(gate(x)) * up(x)); other assignments add nothing.

    Args:
      x: f32[T, D] tokens; weights f32[T, k] and ids i32[T, k] their routing.
      w_gate, w_up: [E_local, F, D]; w_down: [E_local, D, F] (this device's experts).
      first_expert: global id of w_gate[0] (traced under shard_map).
      method: one of METHODS, or "auto" (`choose_method`; see the module docstring).
    Returns: f32[T, D].
    """
    num_tokens, top_k = ids.shape
    num_local = w_gate.shape[0]
    if method == "auto":
        method = choose_method(num_tokens * top_k, num_local)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS} or 'auto', got {method!r}")
    local = ids.reshape(-1) - first_expert  # [R], R = T*k assignments, token-major
    is_local = (local >= 0) & (local < num_local)
    row_weights = jnp.where(is_local, weights.reshape(-1), 0.0)
    token_of = jnp.arange(num_tokens * top_k, dtype=jnp.int32) // top_k
    if method == "gather":
        expert = jnp.clip(local, 0, num_local - 1)
        rows = _gathered_ffn(x[token_of], expert, w_gate, w_up, w_down)
        rows = jnp.where(is_local[:, None], rows, 0.0)
        return jnp.zeros(x.shape, jnp.float32).at[token_of].add(rows * row_weights[:, None])
    key = jnp.where(is_local, local, num_local)  # other devices' assignments sort last
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
    token_of, row_weights = token_of[order], row_weights[order]
    if method == "blocks":
        return _blocked_ffn(x, token_of, row_weights, key[order], sizes, w_gate, w_up, w_down)
    rows = _ragged_ffn(x[token_of], sizes, w_gate, w_up, w_down)
    in_group = jnp.arange(rows.shape[0]) < jnp.sum(sizes)
    rows = jnp.where(in_group[:, None], rows, 0.0)  # rows past the groups: unspecified
    return jnp.zeros(x.shape, jnp.float32).at[token_of].add(rows * row_weights[:, None])


METHODS = ("ragged", "gather", "blocks")


def choose_method(num_assignments: int, num_experts: int, platform: str | None = None) -> str:
    """The grouped-product form for R = T*k assignments over E local experts, at trace time.

    `gather` when R < E (decode: reads only the chosen experts, on every platform). Else on
    TPU and GPU `ragged` (ragged_dot is XLA's grouped matmul there); on CPU, where XLA lowers
    ragged_dot to masked products over every expert, `blocks`."""
    if num_assignments < num_experts:
        return "gather"
    platform = platform or jax.default_backend()
    return "blocks" if platform == "cpu" else "ragged"


def block_rows(num_assignments: int, num_experts: int) -> int:
    """Rows per block of the `blocks` form: the power of two at or above twice the mean rows
    per expert, between 4 and 128. Each non-empty expert pads its rows to a multiple of it:
    larger blocks are faster products, smaller ones less padding."""
    mean = -(-num_assignments // num_experts)
    return min(128, max(4, 1 << (2 * mean - 1).bit_length()))


def _blocked_ffn(x, token_of, row_weights, key, sizes, w_gate, w_up, w_down) -> jax.Array:
    """The `blocks` form (megablox gmm's tiling in plain jnp): each expert's rows, sorted,
    padded to a multiple of B rows; a loop over the non-empty blocks multiplies each [B, D]
    with its one expert's weights (a dynamic index) and adds the rows into the output.

    token_of i32[R], row_weights f32[R]: the assignments sorted by key i32[R] (local expert,
    or E for other devices' assignments, last); sizes i32[E] rows per local expert. The loop
    runs sum(ceil(size / B)) times (data: no shape depends on the routing), at most
    (R + min(E, R) * (B - 1)) / B, the static length of the padded row arrays."""
    num_rows, num_local = token_of.shape[0], w_gate.shape[0]
    block = block_rows(num_rows, num_local)
    num_blocks = (num_rows + min(num_local, num_rows) * (block - 1)) // block
    padded = (sizes + block - 1) // block * block  # i32[E]
    padded_end = jnp.cumsum(padded)
    group_start = jnp.cumsum(sizes) - sizes
    # sorted assignment i of expert e goes to padded row (padded_end - padded)[e] + i - start[e]
    e = jnp.minimum(key, num_local - 1)
    pos = padded_end[e] - padded[e] + jnp.arange(num_rows) - group_start[e]
    pos = jnp.where(key < num_local, pos, num_blocks * block)  # out of range: dropped
    padded_token = jnp.zeros(num_blocks * block, jnp.int32).at[pos].set(token_of, mode="drop")
    padded_weight = jnp.zeros(num_blocks * block, jnp.float32).at[pos].set(row_weights, mode="drop")
    starts = jnp.arange(num_blocks, dtype=jnp.int32) * block
    block_expert = jnp.minimum(jnp.searchsorted(padded_end, starts, side="right"), num_local - 1)

    def one_block(b, carry):
        out, w_gate, w_up, w_down = carry
        tokens = jax.lax.dynamic_slice_in_dim(padded_token, b * block, block)
        row_w = jax.lax.dynamic_slice_in_dim(padded_weight, b * block, block)
        expert = block_expert[b]
        rows = x[tokens]  # [B, D]
        mlp = dict(w_gate=w_gate[expert], w_up=w_up[expert], w_down=w_down[expert])
        hidden = gated_mlp(rows, mlp)
        out = out.at[tokens].add(hidden * row_w[:, None])
        # The experts ride in the loop state behind a barrier, so XLA cannot hoist work on
        # them out of the loop: XLA:CPU computes a bfloat16 dynamic index in float32, and
        # hoisted, that conversion covers every expert each step (80 ms for 50 MB).
        return out, *jax.lax.optimization_barrier((w_gate, w_up, w_down))

    used = padded_end[-1] // block
    out = jnp.zeros(x.shape, jnp.float32)
    return jax.lax.fori_loop(0, used, one_block, (out, w_gate, w_up, w_down))[0]


# [R, in] x [G, out, in] -> [R, out], rows grouped on R, groups on the weights' first axis.
_RAGGED_OUT_IN = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)


def _ragged(rows: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot_general(
        rows.astype(w.dtype),
        w,
        sizes,
        _RAGGED_OUT_IN,
        preferred_element_type=jnp.float32,
    )


def _ragged_ffn(rows, sizes, w_gate, w_up, w_down) -> jax.Array:
    """Rows f32[R, D] sorted by expert, `sizes` i32[E] rows per expert -> f32[R, D]."""
    hidden = jax.nn.silu(_ragged(rows, w_gate, sizes)) * _ragged(rows, w_up, sizes)
    return _ragged(hidden, w_down, sizes)


def _gathered_ffn(rows, expert, w_gate, w_up, w_down) -> jax.Array:
    """Rows f32[R, D], each with its expert i32[R] -> f32[R, D], reading R experts' weights."""

    def product(a: jax.Array, w: jax.Array) -> jax.Array:
        w = w[expert]  # [R, out, in]
        return jnp.einsum("ri,roi->ro", a.astype(w.dtype), w, preferred_element_type=jnp.float32)

    hidden = jax.nn.silu(product(rows, w_gate)) * product(rows, w_up)
    return product(hidden, w_down)


def reference_moe(
    x: jax.Array, router: jax.Array, w_gate, w_up, w_down, cfg: ModelConfig
) -> jax.Array:
    """The oracle: every expert on every token, weighted by the routing (zero off the top k)."""
    weights, ids = route(x, router, cfg)
    dense = jnp.zeros((x.shape[0], w_gate.shape[0]), jnp.float32)
    dense = dense.at[jnp.arange(x.shape[0])[:, None], ids].set(weights)  # [T, E]
    outs = jnp.stack(
        [
            gated_mlp(x, dict(w_gate=w_gate[e], w_up=w_up[e], w_down=w_down[e]))
            for e in range(w_gate.shape[0])
        ],
        axis=1,
    )
    return jnp.einsum("te,ted->td", dense, outs)

"""A mixture-of-experts layer (models/moe.py) against a dense gated MLP of the same active
size: the dense MLP is top_k * F wide, so both do tokens x top_k x one expert's FLOPs.

For 1, 16 and 256 tokens it prints the median and the best time of one jitted layer call
(routing, sort, grouped products, combine) and of the dense MLP, the ratio of the best times
(a shared machine's load moves the median more than the best), and the bytes XLA's cost
analysis says each compiled call accesses (`compiled.cost_analysis()['bytes accessed']`;
for a loop it counts every operand whole). "routed" is how many distinct experts the tokens
picked and their weights' MB: what any exact MoE layer must read, beside the dense MLP's
top_k experts' worth. The MoE layer is timed in every grouped-product form (moe.METHODS) and
as `auto`, what the engine runs on this platform (moe.choose_method).

What to expect: on TPU/GPU, ragged_dot is XLA's grouped matmul and `ragged` should stay near
the dense layer. On CPU jax lowers ragged_dot to masked products over all E experts (E times
the work, slower still), and `blocks` is the form whose cost follows tokens x top_k: near
the dense layer at 1 and 256 tokens; at 16 tokens (64 assignments over 32 experts) the
tokens route to most experts, so the layer reads several times the dense layer's bytes.

    python benchmarks/moe.py [--shape small|qwen3_30b_a3b] [--dtype bfloat16] [--repeats 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from ksana_jax.config import MOE_MLP, ModelConfig
from ksana_jax.models import layers, moe

# hidden D, experts E, top k, expert F
SHAPES = {"small": (1024, 32, 4, 256), "qwen3_30b_a3b": (2048, 128, 8, 768)}
TOKENS = (1, 16, 256)


def config(d: int, e: int, k: int, f: int) -> ModelConfig:
    return ModelConfig(
        "qwen3_moe", 128, d, k * f, 1, 8, 4, d // 8, mlp_types=(MOE_MLP,), num_experts=e,
        num_experts_per_tok=k, moe_intermediate_size=f, norm_topk_prob=True,
    )  # fmt: skip


def weights(cfg: ModelConfig, dtype: str) -> dict[str, jax.Array]:
    d, e, f, k = (
        cfg.hidden_size,
        cfg.num_experts,
        cfg.moe_intermediate_size,
        cfg.num_experts_per_tok,
    )
    key = jax.random.key(0)
    shapes = {
        "router": (e, d),
        "w_gate_exps": (e, f, d),
        "w_up_exps": (e, f, d),
        "w_down_exps": (e, d, f),
        "w_gate": (k * f, d),
        "w_up": (k * f, d),
        "w_down": (d, k * f),
    }
    out = {}
    for i, (name, shape) in enumerate(shapes.items()):
        out[name] = (0.02 * jax.random.normal(jax.random.fold_in(key, i), shape)).astype(dtype)
    return out


def moe_layer(cfg: ModelConfig, method: str):
    def run(w, x):
        routing = moe.route(x, w["router"], cfg)
        experts = (w["w_gate_exps"], w["w_up_exps"], w["w_down_exps"])
        return moe.expert_ffn(x, *routing, *experts, method=method)

    return run


def dense_layer(w, x):
    return layers.gated_mlp(x, w)  # w_gate and w_up apart, as an expert's


def measure(fn, w, x, repeats: int) -> tuple[float, float, float]:
    """(median and best seconds per call, bytes accessed per XLA's cost analysis)."""
    compiled = jax.jit(fn).lower(w, x).compile()
    compiled(w, x).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        compiled(w, x).block_until_ready()
        times.append(time.perf_counter() - start)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    bytes_accessed = float(cost.get("bytes accessed", float("nan")))
    return statistics.median(times), min(times), bytes_accessed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    args = parser.parse_args()
    cfg = config(*SHAPES[args.shape])
    w = weights(cfg, args.dtype)
    itemsize = jnp.dtype(args.dtype).itemsize
    one_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * itemsize
    d, e, k, f = SHAPES[args.shape]
    print(f"{jax.devices()[0].platform}: D {d}, E {e}, top-{k}, expert F {f}, {args.dtype}")
    print(
        f"expert weights: all {e * one_expert / 1e6:.1f} MB, active (top-{k}) "
        f"{k * one_expert / 1e6:.2f} MB; dense MLP of the active size {k * one_expert / 1e6:.2f} MB"
    )
    print(
        f"{'tokens':>6} {'layer':>12} {'ms':>9} {'best ms':>9} {'x dense':>8} "
        f"{'MB accessed':>12} {'routed':>7} {'routed MB':>10}"
    )
    for num_tokens in (int(t) for t in args.tokens.split(",")):
        x = jax.random.normal(jax.random.key(1), (num_tokens, d), jnp.float32)
        routed = len(np.unique(np.asarray(moe.route(x, w["router"], cfg)[1])))
        dense = measure(dense_layer, w, x, args.repeats)
        rows = [("dense", *dense)]
        for method in ("auto", *moe.METHODS):
            if method == "gather" and num_tokens * k > 4 * e:
                continue  # gathers a weight copy per assignment: too large to be a choice
            if method == "ragged" and num_tokens * k > 4 * e and jax.default_backend() == "cpu":
                continue  # masked products over every expert: seconds, no information
            rows.append((f"moe {method}", *measure(moe_layer(cfg, method), w, x, args.repeats)))
        for name, median, best, b in rows:
            experts = f"{routed:>7} {routed * one_expert / 1e6:>10.2f}" if name != "dense" else ""
            print(
                f"{num_tokens:>6} {name:>12} {1e3 * median:>9.3f} {1e3 * best:>9.3f} "
                f"{best / dense[1]:>8.2f} {b / 1e6:>12.2f} {experts}"
            )


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()

"""The engine step lowered for an accelerator that is only described, for the ahead-of-time
compile tools (gpu_aot_compile.py, tpu_kernel_compile.py): one decode bucket of the given
model, traced as the runner would trace it on that platform.

The model is the demo checkpoint (SmolLM2) or one of MODEL_SHAPES: a published model's
config with abstract weights (ShapeDtypeStructs, nothing allocated), placed by the engine's
own sharding plan over the described devices, tensor-parallel and with or without expert
parallelism, in bfloat16 or with its matrices quantized (quant.py's formats). `step_report`
gives what the compiled step says: memory (arguments, temporaries, outputs), the collectives
in its HLO, whole-KV copies and the whole dequantized matrices it materialises."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from ksana_jax import quant, runner
from ksana_jax.batch import pack
from ksana_jax.config import EngineConfig
from ksana_jax.kv_cache import abstract_kv, kv_shardings
from ksana_jax.model import Model, with_expert_parallel
from ksana_jax.models import registry
from ksana_jax.sharding import make_plan
from ksana_jax.step_programs import engine_step, kv_pinned_engine_step, kv_row_major_format

# A 32-row decode bucket over contexts up to 1024 tokens.
DECODE_BUCKET = dict(
    max_model_len=1024,
    num_pages=1024,
    max_num_seqs=32,
    max_num_batched_tokens=32,
    token_buckets=(32,),
    seq_buckets=(32,),
    context_buckets=(1024,),
)

# Published models' shapes (their config.json fields) to compile with abstract weights:
# `--engine-model NAME` of both tools. One entry per model; the family reads it as it would
# the checkpoint's config.json.
MODEL_SHAPES: dict[str, dict] = {
    "qwen3_30b_a3b": dict(  # Qwen/Qwen3-30B-A3B: 48 layers, 128 experts, top 8
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        num_hidden_layers=48,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        eos_token_id=151645,
        dtype="bfloat16",
    ),
    "llama3_8b": dict(  # Meta-Llama-3-8B(-Instruct)
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        bos_token_id=128000,
        eos_token_id=[128001, 128009],
        dtype="bfloat16",
    ),
}


def placed(tree, sharding):
    """Shapes of `tree` (arrays or shapes) on `sharding` (or a Format)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def abstract_model(
    name: str,
    devices: Sequence[jax.Device],
    tensor_parallel_size: int = 1,
    enable_expert_parallel: bool = False,
    quantization: str | None = None,
) -> Model:
    """MODEL_SHAPES[name] with abstract weights, placed by the engine's plan on the first
    `tensor_parallel_size` of `devices` (described ones: nothing is allocated), every matrix
    quantized to `quantization` if given, as load time would. Its tokenizer is the demo's, a
    stand-in: the step's shapes do not depend on it."""
    from ksana_jax.checkpoint import read_tokenizer
    from ksana_jax.demo import demo_checkpoint

    config = with_expert_parallel(
        registry.config_from_hf(MODEL_SHAPES[name]), enable_expert_parallel
    )
    plan = make_plan(config, tensor_parallel_size, devices=devices)
    dtype = jnp.dtype(config.dtype)
    flat = {
        n: quant.abstract(quantization, shape, config.dtype)
        if quantization and quant.quantizable(n, shape)
        else jax.ShapeDtypeStruct(shape, dtype)
        for n, shape in registry.param_shapes(config).items()
    }
    params = jax.eval_shape(lambda f: registry.params_from_flat(f, config), flat)
    params = plan.with_splits(params)  # as shard_params marks them
    params = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        params,
        plan.param_shardings(params),
    )
    tokenizer = read_tokenizer(demo_checkpoint())
    return Model(config, params, tokenizer, {}, plan, quantization=quantization)


def parse_placements(text: str) -> list[tuple[int, bool]]:
    """ "1,8,8ep" -> [(1, False), (8, False), (8, True)]: tensor-parallel sizes, "ep" with
    expert parallelism."""
    out = []
    for item in text.split(","):
        tp = item.removesuffix("ep")
        if not tp.isdigit() or int(tp) < 1:
            raise ValueError(f"placement {item!r} is not N or Nep (N devices, ep: experts split)")
        out.append((int(tp), item.endswith("ep")))
    return out


def add_engine_model_arguments(parser, devices: str) -> None:
    """The tools' --engine-model and --engine-placements (tensor-parallel sizes over
    `devices`, words for the tool's described devices)."""
    parser.add_argument(
        "--engine-model",
        default="smollm2",
        help="the engine step's model: smollm2 (the demo checkpoint) or a name of "
        "aot_engine_step.MODEL_SHAPES (abstract weights): qwen3_30b_a3b, llama3_8b",
    )
    parser.add_argument(
        "--engine-placements",
        default="1",
        help=f"a MODEL_SHAPES model's placements: tensor-parallel sizes over {devices}, "
        "'ep' with expert parallelism, e.g. 1,8,8ep",
    )
    parser.add_argument(
        "--quantization", choices=quant.QUANTIZATIONS, help="the engine step's weights"
    )


def engine_models(
    name: str, placements: str, devices: Sequence[jax.Device], quantization: str | None = None
):
    """(label, model, sharding) of each engine step to compile, its matrices quantized to
    `quantization` if given: for "smollm2" the demo checkpoint (bfloat16) with every argument
    on the first of `devices`; for a MODEL_SHAPES name, that model with abstract weights at
    each of `placements` (parse_placements) over `devices`, sharding None (lower_decode_step
    places it by its plan)."""
    if name == "smollm2":
        import ksana_jax
        from ksana_jax.demo import demo_checkpoint

        mesh = jax.sharding.Mesh(devices[:1], ("x",))
        one = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        model = ksana_jax.load(demo_checkpoint(), dtype="bfloat16", quantization=quantization)
        yield f"SmolLM2 {quantization or 'bfloat16'}", model, one
        return
    if name not in MODEL_SHAPES:
        raise ValueError(f"unknown model {name!r}; known: smollm2, {', '.join(MODEL_SHAPES)}")
    for tp, ep in parse_placements(placements):
        label = f"{name} {quantization or 'bfloat16'} tp{tp}" + (" expert-parallel" if ep else "")
        yield label, abstract_model(name, devices, tp, ep, quantization), None


def lower_decode_step(
    model,
    backend: str,
    platform: str,
    sharding=None,
    *,
    kv_sharding=None,
    step=None,
    pinned: bool = False,
    **config,
) -> tuple[jax.stages.Lowered, jax.ShapeDtypeStruct]:
    """The engine step (`step`, step_programs.engine_step by default) with attention `backend`,
    lowered for `platform` ("gpu", "tpu"); `config`: more EngineConfig fields. Returns it and
    the KV's shape.

    Placement: with `sharding`, every argument on it (the KV on `kv_sharding` if given);
    without, the model's own plan (`model.plan`, whose mesh may span described devices):
    each parameter as the plan places it, the KV by heads (or on `kv_sharding`, a Format of
    the plan's KV sharding), the rest replicated, lowered with the plan's mesh active as the
    runner runs it (the MoE layer and the Pallas kernels run under shard_map over it).
    `pinned`: the KV argument and result in row-major format (step_programs.kv_pinned_engine_step),
    as the runner holds them on a TPU.

    The runner is built on this CPU for its shapes only (with the fewest pages: its KV is
    allocated; the step is lowered for the KV of `num_pages`); jax.default_backend says
    `platform` meanwhile, so the model traces the compiled kernels, not the interpreter."""
    config = EngineConfig(**{**DECODE_BUCKET, **config}, attention_backend=backend)
    host_plan = make_plan(model.config, 1, devices=jax.devices("cpu"))
    fewest_pages = dataclasses.replace(config, num_pages=config.max_pages_per_seq + 1)
    step_runner = runner.ModelRunner(dataclasses.replace(model, plan=host_plan), fewest_pages)
    buffers, layout = pack(
        step_runner.padding_inputs(
            config.max_num_batched_tokens, config.max_num_seqs, config.max_model_len
        )
    )
    kv = abstract_kv(dataclasses.replace(step_runner.kv_spec, num_pages=config.num_pages))
    if sharding is not None:
        replicated, params = sharding, placed(model.params, sharding)
        mesh = contextlib.nullcontext()
    else:
        plan = model.plan
        replicated, mesh = plan.replicated, plan.activate()
        params = jax.tree.map(placed, model.params, plan.param_shardings(model.params))
        kv_sharding = kv_sharding or plan.kv_sharding(kv.pages.shape)
    if pinned:
        kv_sharding = kv_row_major_format(kv_sharding or sharding)
        step = kv_pinned_engine_step(kv_sharding)
    if kv_sharding is None:
        placed_kv = placed(kv, sharding)
    else:  # the pages' sharding or Format; the scales alike (kv_cache.kv_shardings)
        placed_kv = jax.tree.map(placed, kv, kv_shardings(kv_sharding))
    default_backend = jax.default_backend
    jax.default_backend = lambda: platform
    try:
        with mesh:
            lowered = (step or engine_step).lower(
                params,
                model.config,
                placed_kv,
                placed(step_runner.state, replicated),
                placed(buffers, replicated),
                layout,
                config.max_logprobs,
                backend,
                None,  # no draft model: its params, KV, config; k
                None,
                None,
                0,
            )
    finally:
        jax.default_backend = default_backend
    return lowered, jax.ShapeDtypeStruct(kv.pages.shape, kv.pages.dtype)


_HLO_TYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


def whole_kv_copies(hlo_text: str, kv: jax.ShapeDtypeStruct) -> int:
    """How many copies of the whole KV array the compiled HLO makes."""
    hlo_type = _HLO_TYPES[jnp.dtype(kv.dtype).name]
    kv_type = hlo_type + str(list(kv.shape)).replace(" ", "")
    return len(re.findall(re.escape(kv_type) + r"\{[^}]*\} copy\(", hlo_text))


COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute")
_COLLECTIVE = re.compile(
    r"= (?P<shape>\(*[a-z0-9]+\[[^=]*?) (?P<op>"
    + "|".join(COLLECTIVES)
    + r")(?P<part>-start|-done)?\("
)
_ARRAY = re.compile(r"\b(pred|[suf]8|u8|[suf]16|bf16|[suf]32|[suf]64|f8e4m3fn)\[([\d,]*)\]")


def collectives(hlo_text: str) -> dict[str, tuple[int, int]]:
    """Collective op -> (how many the compiled HLO runs, their result bytes), over every
    computation; an async pair counts once, by its done op (whose shape is the result)."""
    found: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for match in _COLLECTIVE.finditer(hlo_text):
        if match["part"] == "-start":
            continue
        found[match["op"]][0] += 1
        for dtype, dims in _ARRAY.findall(match["shape"]):
            found[match["op"]][1] += _bytes(dtype) * _prod(dims)
    return {op: tuple(v) for op, v in sorted(found.items())}


def _bytes(dtype: str) -> int:
    return 1 if dtype == "pred" or dtype.startswith("f8") else int(re.sub(r"\D", "", dtype)) // 8


def _prod(dims: str) -> int:
    out = 1
    for d in filter(None, dims.split(",")):
        out *= int(d)
    return out


def step_report(compiled, kv: jax.ShapeDtypeStruct, model: Model) -> dict:
    """A compiled step's (an executable's) memory per device in bytes (arguments: params, KV,
    batch state; temporaries; outputs, aliased), its collectives (collectives()), its whole-KV
    copies and the whole dequantized matrices it materialises (a quantized model)."""
    memory = compiled.memory_analysis()
    hlo = compiled.as_text()
    return {
        "kv_bytes": kv.size * kv.dtype.itemsize,
        "kv_copies": whole_kv_copies(hlo, kv),
        "params_bytes": quant.nbytes(model.params),
        "argument_bytes": memory.argument_size_in_bytes,
        "temp_bytes": memory.temp_size_in_bytes,
        "output_bytes": memory.output_size_in_bytes,
        "alias_bytes": memory.alias_size_in_bytes,
        "weight_copies": unfused_weight_copies(hlo, model),
        "largest_dequantized": largest_dequantized_matrix(model),
        "collectives": collectives(hlo),
    }


def describe_report(report: dict) -> str:
    """One line of step_report's numbers (MB per device)."""
    mb = {k: report[k] / 1e6 for k in ("argument_bytes", "temp_bytes", "output_bytes")}
    found = ", ".join(
        f"{count} {op} ({size / 1e6:.2f} MB)" for op, (count, size) in report["collectives"].items()
    )
    return (
        f"per device: arguments {mb['argument_bytes']:.0f} MB, temporaries "
        f"{mb['temp_bytes']:.0f} MB, outputs {mb['output_bytes']:.0f} MB "
        f"({report['alias_bytes'] / 1e6:.0f} MB aliased); collectives: {found or 'none'}"
    )


def memory_report(record: dict, device_bytes: float) -> str:
    """The step's memory analysis and what of `device_bytes` is left for more KV: the device
    holds the arguments (params, KV, batch state), the outputs not aliased to an argument, and
    the temporaries at once."""
    gb = {k: v / 1e9 for k, v in record.items() if k.endswith("bytes")}
    held = gb["argument_bytes"] + gb["output_bytes"] - gb["alias_bytes"] + gb["temp_bytes"]
    room = device_bytes / 1e9 - held
    return (
        f"params {gb['params_bytes']:.2f} GB; arguments {gb['argument_bytes']:.2f} GB (KV "
        f"{gb['kv_bytes']:.2f}); outputs {gb['output_bytes']:.2f} GB ({gb['alias_bytes']:.2f} "
        f"aliased); temporaries {gb['temp_bytes']:.3f} GB (largest matrix dequantized: "
        f"{record['largest_dequantized'] / 1e9:.3f} GB; whole dequantized matrices "
        f"materialised: {record['weight_copies']}); of {device_bytes / 1e9:.0f} GB: "
        f"{room:.2f} GB left beside this step's KV, {room + gb['kv_bytes']:.2f} GB for KV in all"
    )


_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", re.M)


def unfused_weight_copies(hlo_text: str, model: Model) -> int:
    """How many buffers of the compiled HLO hold a whole dequantized matrix, or a device's
    whole shard of one: instructions outside fusions (in the entry and loop computations: a
    fusion's output, or a bitcast of one) whose result has one quantized matrix's shape, or
    its shard's, in its compute dtype. A dequantize XLA fuses into its dot produces no such
    buffer; each one found is a matrix materialised before its product."""
    shapes = set()
    for m in jax.tree.leaves(model.params, is_leaf=quant.is_quantized):
        if not quant.is_quantized(m):
            continue
        first = jax.tree.leaves(m)[0]  # packed or values [O, cols]
        sharding = getattr(first, "sharding", None)
        local = sharding.shard_shape(first.shape) if sharding is not None else first.shape
        local = (*local[:-1], local[-1] * m.shape[-1] // first.shape[-1])
        for shape in (m.shape, local):
            shapes.add(f"{_HLO_TYPES[jnp.dtype(m.dtype).name]}{list(shape)}".replace(" ", ""))
    fused = set(re.findall(r"calls=%?([\w.\-]+)", hlo_text))
    count, inside = 0, False
    for line in hlo_text.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            inside = head.group(1) in fused
        elif not inside and " = " in line:
            result = line.split(" = ", 1)[1].split(" ", 1)[0]
            count += result.split("{")[0] in shapes
    return count


def largest_dequantized_matrix(model: Model) -> int:
    """Bytes of the model's largest quantized matrix dequantized to its compute dtype: a
    step whose temporaries stay near this dequantizes one matrix at a time at most, never a
    whole model."""
    leaves = jax.tree.leaves(model.params, is_leaf=quant.is_quantized)
    sizes = [
        math.prod(m.shape) * jnp.dtype(m.dtype).itemsize for m in leaves if quant.is_quantized(m)
    ]
    return max(sizes, default=0)

"""The engine step lowered for an accelerator that is only described, for the ahead-of-time
compile tools (gpu_aot_compile.py, tpu_kernel_compile.py): one decode bucket of the given
model, traced as the runner would trace it on that platform. The model is the demo
checkpoint or one of MODEL_SHAPES, described without weights (`described_model`), in
bfloat16 or with its matrices quantized (quant.py's formats)."""

from __future__ import annotations

import math
import re
import types

import jax
import jax.numpy as jnp

from ksana_jax import quant, runner, sharding
from ksana_jax.batch import pack
from ksana_jax.config import EngineConfig, ModelConfig
from ksana_jax.kv_cache import kv_shardings
from ksana_jax.model import Model
from ksana_jax.models import registry

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


# Model shapes to compile at without a checkpoint: config.json's hyperparameters.
MODEL_SHAPES = {
    "llama3_8b": dict(  # Meta-Llama-3-8B(-Instruct)
        model_type="llama",
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
        eos_token_ids=(128001, 128009),
    ),
}
NO_TOKENIZER = types.SimpleNamespace(eos_token_id=None)  # a described model has no vocabulary


def load_model(name: str, quantization: str | None = None) -> Model:
    """ "smollm2" (the demo checkpoint, loaded) or a MODEL_SHAPES name (described), in
    bfloat16, with `quantization` (quant.py's formats) or float."""
    if name == "smollm2":
        import ksana_jax
        from ksana_jax.demo import demo_checkpoint

        return ksana_jax.load(demo_checkpoint(), dtype="bfloat16", quantization=quantization)
    return described_model(name, quantization=quantization)


def described_model(name: str, dtype: str = "bfloat16", quantization: str | None = None) -> Model:
    """A model of MODEL_SHAPES[name] whose params are ShapeDtypeStructs (nothing is
    allocated): every matrix quantized to `quantization` if given, as load time would."""
    cfg = ModelConfig(**MODEL_SHAPES[name], dtype=dtype)
    flat = {}
    for param, shape in registry.param_shapes(cfg).items():
        if quantization and quant.quantizable(param, shape):
            flat[param] = quant.abstract(quantization, shape, dtype)
        else:
            flat[param] = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
    params = jax.eval_shape(lambda f: registry.params_from_flat(f, cfg), flat)
    plan = sharding.make_plan(cfg, 1)
    return Model(cfg, params, NO_TOKENIZER, {}, plan, quantization=quantization)


def largest_dequantized_matrix(model: Model) -> int:
    """Bytes of the model's largest quantized matrix dequantized to its compute dtype: a
    step's temporaries below this hold no dequantized copy of any whole matrix."""
    leaves = jax.tree.leaves(model.params, is_leaf=quant.is_quantized)
    sizes = [
        math.prod(m.shape) * jnp.dtype(m.dtype).itemsize for m in leaves if quant.is_quantized(m)
    ]
    return max(sizes, default=0)


def placed(tree, sharding):
    """Shapes of `tree` (arrays or shapes) on `sharding` (or a Format)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def lower_decode_step(
    model, backend: str, platform: str, sharding, *, kv_sharding=None, step=None, **config
) -> tuple[jax.stages.Lowered, jax.ShapeDtypeStruct]:
    """The engine step (`step`, runner.engine_step by default) with attention `backend`,
    lowered for `platform` ("gpu", "tpu") with every argument on `sharding`, the KV on
    `kv_sharding` if given; `config`: more EngineConfig fields. Returns it and the KV's
    shape. The runner is built on this CPU for its shapes only; jax.default_backend says
    `platform` meanwhile, so the model traces the compiled kernels, not the interpreter."""
    config = EngineConfig(**DECODE_BUCKET, attention_backend=backend, **config)
    step_runner = runner.ModelRunner(model, config)
    buffers, layout = pack(
        step_runner.padding_inputs(
            config.max_num_batched_tokens, config.max_num_seqs, config.max_model_len
        )
    )
    kv = step_runner.kv
    if kv_sharding is None:
        placed_kv = placed(kv, sharding)
    else:  # the pages' sharding or Format; the scales alike (kv_cache.kv_shardings)
        placed_kv = jax.tree.map(placed, kv, kv_shardings(kv_sharding))
    default_backend = jax.default_backend
    jax.default_backend = lambda: platform
    try:
        lowered = (step or runner.engine_step).lower(
            placed(model.params, sharding),
            model.config,
            placed_kv,
            placed(step_runner.state, sharding),
            placed(buffers, sharding),
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


def whole_kv_copies(hlo_text: str, kv: jax.ShapeDtypeStruct) -> int:
    """How many copies of the whole KV array the compiled HLO makes."""
    hlo_type = _HLO_TYPES[jnp.dtype(kv.dtype).name]
    kv_type = hlo_type + str(list(kv.shape)).replace(" ", "")
    return len(re.findall(re.escape(kv_type) + r"\{[^}]*\} copy\(", hlo_text))


def memory_record(executable, kv: jax.ShapeDtypeStruct, model: Model) -> dict:
    """A compiled engine step's memory analysis in bytes (arguments: params, KV, batch
    state), its whole-KV copies, and the whole dequantized matrices it materialises."""
    memory = executable.memory_analysis()
    hlo = executable.as_text()
    return {
        "kv_bytes": kv.size * kv.dtype.itemsize,
        "kv_copies": whole_kv_copies(hlo, kv),
        "params_bytes": quant.nbytes(model.params),
        "argument_bytes": memory.argument_size_in_bytes,
        "output_bytes": memory.output_size_in_bytes,
        "alias_bytes": memory.alias_size_in_bytes,
        "temp_bytes": memory.temp_size_in_bytes,
        "weight_copies": unfused_weight_copies(hlo, model),
        "largest_dequantized": largest_dequantized_matrix(model),
    }


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
    """How many buffers of the compiled HLO hold a whole dequantized matrix: instructions
    outside fusions (in the entry and loop computations) whose result has one quantized
    matrix's shape in its compute dtype. A dequantize XLA fuses into its dot produces no such
    buffer; each one found is a matrix materialised before its product."""
    leaves = jax.tree.leaves(model.params, is_leaf=quant.is_quantized)
    shapes = {
        f"{_HLO_TYPES[jnp.dtype(m.dtype).name]}{list(m.shape)}".replace(" ", "")
        for m in leaves
        if quant.is_quantized(m)
    }
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


_HLO_TYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}

"""The model registry: which family serves a `model_type` or GGUF architecture, and the
family-agnostic face of a model (config readers, params pytree, forward, logits).

A family module (llama.py, qwen3.py, gemma.py) ends with `FAMILY = Family(...)`; the registry
imports every module of this package on first use and registers each `FAMILY` it finds, so a
new family is one new file. Everything outside `models/` -- runner, step, model, sharding,
checkpoint and checkpoints_tools -- goes through the functions here and never imports a
family.

Params are a plain pytree of named arrays, the same shape for every family:

    {"embed": [V, D], "final_norm": [D], "lm_head": [V, D] (untied only), ...,
     "layers": ({"wqkv": [(N+2K)*H, D], ...}, ...)}  one dict per layer (see llama.py for why)

A model whose quantized matrices the CPU kernel multiplies keeps those stacked over the layers
instead, under "stacked_layers" (`stack_layers`), so a step takes one array where it took one
a layer; the model's loop reads its layers through `layer_params`, which gives each layer's
dict a view of them (quant.py's layer views).

Flat names ("embed", "layers.wq") key the checkpoint (layers stacked on a first L axis), the
family's parameter shapes, HF name maps and sharding axes. The pytree holds q/k/v and
gate/up fused (fusion.py: "layers.wqkv", "layers.w_gate_up"), which the families' axes
declare too; params_from_flat fuses and params_to_flat splits them. A parameter that only
some layers have (an MoE model's experts, or the dense MLP of its dense layers) is stacked
over those layers only (`Family.param_layers`); each layer's dict then holds the names it
has.

HF names of an MoE layer's experts carry the expert index ("mlp.experts.3.gate_proj.weight");
the name maps write it as "*" ("mlp.experts.*.gate_proj.weight") and the converter stacks the
experts [E, ...] (a GGUF's stacked ffn_*_exps tensor arrives under the "*" name whole).
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np

from ksana_jax import quant
from ksana_jax.config import ModelConfig
from ksana_jax.kv_cache import KVCache
from ksana_jax.models import fusion
from ksana_jax.pallas_kernels.attention_spec import AttentionSpec
from ksana_jax.step_inputs import StepInputs

LayerParams: TypeAlias = dict[str, jax.Array]
Params: TypeAlias = dict[str, "jax.Array | tuple[LayerParams, ...]"]
LAYER_PREFIX = "layers."
STACKED = "stacked_layers"  # matrices held stacked over the layers (stack_layers)
HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
GGUF_LAYER = re.compile(r"blk\.(\d+)\.(.+)")
HF_EXPERT = re.compile(r"(.*\.experts)\.(\d+|\*)\.(.+)")  # "mlp.experts.3.gate_proj.weight"


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: its maps are dicts
class Family:
    """What a model family declares. Names: `flat` = ours ("layers.wq"), HF = transformers'
    ("model.layers.{i}.self_attn.q_proj.weight"), GGUF = llama.cpp's ("blk.{i}.attn_q.weight").

    Per-layer entries of the name maps are relative to the layer ("self_attn.q_proj.weight",
    "attn_q.weight"); `hf_top` / `gguf_top` hold the rest.
    """

    name: str
    architectures: Mapping[str, tuple[str, ...]]  # HF model_type -> its architecture classes
    gguf_architectures: tuple[str, ...]  # GGUF general.architecture values
    config_from_hf: Callable[[Mapping[str, Any]], ModelConfig]
    # (metadata, tensor names, dtype, read_tensor(name) -> values) -> config
    config_from_gguf: Callable[..., ModelConfig]
    param_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]]  # flat name -> shape
    param_axes: Mapping[str, tuple[str | None, ...]]  # flat name -> logical axes (sharding.py)
    hf_top: Mapping[str, str]  # HF name -> flat name
    hf_layer: Mapping[str, str]  # per-layer HF name -> flat name
    gguf_top: Mapping[str, str | None]  # GGUF name -> HF name; None: read by the config
    gguf_layer: Mapping[str, str]  # per-layer GGUF name -> per-layer HF name
    # (params, cfg, kv, inputs, backend) -> (final hidden f32[T, D], kv)
    forward: Callable[..., tuple[jax.Array, KVCache]]
    logits: Callable[[Params, ModelConfig, jax.Array], jax.Array]  # hidden [R, D] -> [R, V]
    # An HF tensor name as written in the checkpoint -> its name in hf_top / hf_layer terms,
    # or None for a tensor to skip (a multimodal checkpoint's vision tower).
    hf_rename: Callable[[str], str | None] = lambda name: name
    # (HF name, float32 value from GGUF, cfg) -> the value as transformers holds it.
    from_gguf: Callable[[str, np.ndarray, ModelConfig], np.ndarray] = lambda n, v, c: v
    # (cfg, flat name) -> the layers holding that parameter, in the order its stacked array
    # keeps them; by default every layer (MoE families: the dense MLP's and the experts'
    # parameters live on their own layers only, moe.param_layers).
    param_layers: Callable[[ModelConfig, str], tuple[int, ...]] = lambda cfg, name: tuple(
        range(cfg.num_hidden_layers)
    )
    # GGUF metadata -> whether this family reads the file although its general.architecture
    # is another family's (llama.cpp writes Mixtral as a `llama` with experts). A file that
    # one family claims goes to it; one no family claims goes by its architecture.
    gguf_claims: Callable[[Mapping[str, Any]], bool] = lambda metadata: False
    # params -> the LM head's weight [V, D] where the logits are its product with the hidden
    # states and nothing more (`logits_or_argmax` may then fold greedy decoding's argmax into
    # that product); None where they are more (Gemma's soft-capping).
    lm_head: Callable[[Params], Any] | None = None

    def architecture(self, model_type: str) -> str:
        return self.architectures[model_type][0]


@dataclasses.dataclass(frozen=True)
class _Registry:
    by_model_type: dict[str, Family]
    by_gguf_architecture: dict[str, Family]


_registry: _Registry | None = None


def family_modules() -> list[str]:
    """The modules of this package that declare a FAMILY, by name."""
    package = importlib.import_module(__package__)
    names = [f"{__package__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)]
    return [name for name in sorted(names) if hasattr(importlib.import_module(name), "FAMILY")]


def _load() -> _Registry:
    global _registry
    if _registry is None:
        tables: tuple[dict[str, Family], dict[str, Family]] = ({}, {})
        for module in family_modules():
            family = importlib.import_module(module).FAMILY
            names = (family.architectures, family.gguf_architectures)
            for table, keys in zip(tables, names, strict=True):
                for key in keys:
                    if key in table:
                        raise ValueError(
                            f"{key!r} is claimed by families {table[key].name} and {family.name}"
                        )
                    table[key] = family
        _registry = _Registry(*tables)
    return _registry


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(_load().by_model_type))


def supported_gguf_architectures() -> tuple[str, ...]:
    return tuple(sorted(_load().by_gguf_architecture))


def supported_architectures() -> tuple[str, ...]:
    families = _load().by_model_type
    return tuple(a for t in sorted(families) for a in families[t].architectures[t])


def family_of(model_type: str) -> Family:
    """The family registered for HF `model_type`; ValueError listing the supported ones."""
    families = _load().by_model_type
    if model_type not in families:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {supported_model_types()}"
        )
    return families[model_type]


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """ModelConfig from a transformers config.json dict, read by its family."""
    model_type = hf.get("model_type")
    families = _load().by_model_type
    if model_type not in families:
        raise ValueError(
            f"unsupported model_type {model_type!r} (architectures {hf.get('architectures')}); "
            f"supported: {supported_model_types()} ({', '.join(supported_architectures())})"
        )
    family = families[model_type]
    architectures = hf.get("architectures") or [family.architecture(model_type)]
    if architectures[0] not in family.architectures[model_type]:
        raise ValueError(
            f"unsupported architecture {architectures[0]!r} for model_type {model_type!r}; "
            f"supported: {family.architectures[model_type]} (all: "
            f"{', '.join(supported_architectures())})"
        )
    return family.config_from_hf(hf)


def config_from_gguf(
    metadata: Mapping[str, Any],
    tensor_names: set[str],
    dtype: str = "float32",
    read_tensor: Callable[[str], np.ndarray] | None = None,
) -> ModelConfig:
    """ModelConfig from GGUF metadata and tensor names, read by the family that claims the
    file (`Family.gguf_claims`) or else by the architecture's; `read_tensor(name)` gives a
    tensor's float32 values where the config needs them (a Llama 3.1 GGUF's
    rope_freqs.weight)."""
    arch = metadata.get("general.architecture")
    claims = [f for f in _load().by_model_type.values() if f.gguf_claims(metadata)]
    claims = list({id(f): f for f in claims}.values())  # a family serves several model types
    if len(claims) > 1:
        names = [f.name for f in claims]
        raise ValueError(f"GGUF of architecture {arch!r} is claimed by families {names}")
    if claims:
        return claims[0].config_from_gguf(metadata, tensor_names, dtype, read_tensor)
    families = _load().by_gguf_architecture
    if arch not in families:
        raise ValueError(
            f"unsupported GGUF general.architecture {arch!r}; "
            f"supported: {supported_gguf_architectures()}"
        )
    return families[arch].config_from_gguf(metadata, tensor_names, dtype, read_tensor)


# --------------------------------------------------------------------------- params pytree


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Flat name -> shape of every parameter of `cfg`'s model (layers stacked on L)."""
    return family_of(cfg.model_type).param_shapes(cfg)


def param_axes(cfg: ModelConfig) -> Mapping[str, tuple[str | None, ...]]:
    """Flat name -> logical axes (sharding.py's names) of every parameter of the family."""
    return family_of(cfg.model_type).param_axes


def param_layers(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    """The layers holding flat parameter `name` ("layers.*", fused ones included), in its
    stacked order."""
    return family_of(cfg.model_type).param_layers(cfg, fusion.PART_OF.get(name, name))


def params_from_flat(flat: Mapping[str, Any], cfg: ModelConfig) -> Params:
    """The params pytree from flat names (the checkpoint's), with q/k/v and gate/up fused
    (fusion.py) and layer-stacked arrays split per layer."""
    flat = fusion.fuse(flat, cfg)
    params: Params = {k: v for k, v in flat.items() if not k.startswith(LAYER_PREFIX)}
    layers: list[LayerParams] = [{} for _ in range(cfg.num_hidden_layers)]
    for name, value in flat.items():
        if name.startswith(LAYER_PREFIX):
            for j, i in enumerate(param_layers(cfg, name)):
                layers[i][name.removeprefix(LAYER_PREFIX)] = _layer(value, j)
    params["layers"] = tuple(layers)
    return params


def stack_layers(params: Params, stacked: bool) -> Params:
    """`params` with its quantized layer matrices held as `stacked` says. Stacked: each name
    that every layer holds as a quantized matrix [O, I] (one format, shape and dtype) moves
    out of the layer dicts into params["stacked_layers"][name], its arrays stacked on a
    leading L axis. Not: each layer holds its own. A step's forward then takes one array
    where it took one a layer, and dispatching it costs JAX and PjRt work per argument:
    ~1.7 us an array once a decode step has flushed the caches (SmolLM2 int4: 424 arrays
    with each layer's own, 76 stacked). Matrices already stacked stay as they are."""
    held = params.get(STACKED, {})
    if not stacked or not all(quant.is_quantized(m) for m in held.values()):
        params = unstack(params)  # (a map over the params may have dequantized some)
    if not stacked:
        return params
    layers = params["layers"]
    if not layers:
        return params
    first = layers[0]

    def kind(w: Any) -> Any:  # format, dtype and split, and each array's shape
        return jax.tree.structure(w), [a.shape for a in jax.tree.leaves(w)]

    def stackable(name: str) -> bool:
        w = first[name]
        if not quant.is_quantized(w) or len(w.shape) != 2:
            return False
        return all(name in layer and kind(layer[name]) == kind(w) for layer in layers)

    names = [name for name in first if stackable(name)]
    if not names:
        return params
    params = dict(params)
    params[STACKED] = {
        **params.get(STACKED, {}),
        **{n: jax.tree.map(_stack, *(layer[n] for layer in layers)) for n in names},
    }
    params["layers"] = tuple({k: v for k, v in layer.items() if k not in names} for layer in layers)
    return params


def unstack(params: Params) -> Params:
    """`params` with every layer holding its own matrices (undoes `stack_layers`)."""
    if STACKED not in params:
        return params
    params = dict(params)
    stacked = params.pop(STACKED)
    params["layers"] = tuple(
        {**layer, **{n: _layer(m, i) for n, m in stacked.items()}}
        for i, layer in enumerate(params["layers"])
    )
    return params


def layer_params(params: Params) -> tuple[LayerParams, ...]:
    """Each layer's params as the model's loop reads them: its dict, with a view (quant.py)
    of each matrix held stacked (`stack_layers`)."""
    stacked = params.get(STACKED)
    if not stacked:
        return params["layers"]
    return tuple(
        {**layer, **{n: dataclasses.replace(m, layer=i) for n, m in stacked.items()}}
        for i, layer in enumerate(params["layers"])
    )


def _layer(value: Any, i: int) -> Any:
    """Layer i of a stacked array, or of each array of a quantized matrix (quant.py)."""
    return jax.tree.map(lambda a: a[i], value)


def params_to_flat(params: Params, cfg: ModelConfig) -> dict[str, Any]:
    """Inverse of params_from_flat: the checkpoint's flat names, each layer parameter stacked
    over the layers holding it and fused ones split into their parts."""
    params = unstack(params)
    flat = {k: v for k, v in params.items() if k != "layers"}
    layers = params["layers"]
    names = dict.fromkeys(name for layer in layers for name in layer)
    for name in names:
        parts = [layer[name] for layer in layers if name in layer]
        flat[LAYER_PREFIX + name] = jax.tree.map(_stack, *parts)
    return fusion.unfuse(flat, cfg)


def _stack(*arrays: Any) -> Any:
    return (np if isinstance(arrays[0], np.ndarray) else jnp).stack(arrays)


def flat_name(path: tuple) -> str:
    """Flat name of a params leaf from its pytree path: "embed", "layers.wq" (any layer, or
    stacked)."""
    keys = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]
    return ".".join(["layers" if k == STACKED else k for k in keys])


def expert_name(layer_name: str) -> tuple[str, int | None]:
    """A per-layer HF name with its expert index written as "*", and the index (None for a
    name of no expert or of all of them, "*")."""
    match = HF_EXPERT.fullmatch(layer_name)
    if match is None:
        return layer_name, None
    index = match.group(2)
    return f"{match.group(1)}.*.{match.group(3)}", None if index == "*" else int(index)


def params_dtype(params: Params) -> str:
    return str(params["embed"].dtype)


def init_params(cfg: ModelConfig, seed: int = 0, dtype: str = "float32") -> Params:
    """Random weights (normal, std 0.02; norms around 1) for tests and benchmarks."""
    rng = np.random.default_rng(seed)
    flat = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith("norm"):
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            value = 0.02 * rng.standard_normal(shape)
        flat[name] = jnp.asarray(value, dtype=dtype)
    return params_from_flat(flat, cfg)


# --------------------------------------------------------------------------- compute


def forward(
    params: Params,
    cfg: ModelConfig,
    kv: KVCache,
    inputs: StepInputs,
    backend: str = "reference",
) -> tuple[jax.Array, KVCache]:
    """One ragged step of `cfg`'s family: final hidden states f32[T, D] and the updated kv
    [L, 2, K, num_pages, page_size, H]; `backend` is the attention backend's name."""
    return family_of(cfg.model_type).forward(params, cfg, kv, inputs, backend)


def attention_specs(cfg: ModelConfig) -> tuple[AttentionSpec, ...]:
    """Each layer's static attention description (scale, sliding window, soft-cap), for the
    attention backend to check when the engine is built."""
    from ksana_jax.models.layers import attention_specs as specs  # layers imports the kernels

    return specs(cfg)


def logits(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Vocabulary logits f32[R, V] of final hidden states f32[R, D]."""
    return family_of(cfg.model_type).logits(params, cfg, hidden)


def logits_or_argmax(
    params: Params, cfg: ModelConfig, hidden: jax.Array, argmax_if: jax.Array
) -> tuple[jax.Array, jax.Array | None]:
    """`logits` and, where the family's logits are its LM head's product (Family.lm_head)
    and the CPU kernel takes it, each row's first largest logit i32[R] from the same call:
    where `argmax_if` (bool[]) holds, the logits are then undefined (never written;
    layers.lm_head). Otherwise (logits, None)."""
    from ksana_jax.models.layers import lm_head  # layers imports the kernels

    family = family_of(cfg.model_type)
    if family.lm_head is None:
        return family.logits(params, cfg, hidden), None
    return lm_head(hidden, family.lm_head(params), argmax_if)

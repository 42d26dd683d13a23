"""Frozen model configuration, built from a Hugging Face `config.json` or GGUF metadata.

In: a parsed `config.json` dict (transformers 4.x or 5.x layout) or a GGUF key/value dict.
Out: a hashable `ModelConfig` that is the static argument of every jitted function, so two
configs that compare equal share compiled code. No I/O happens here; readers live in
`checkpoint.py` and `checkpoints_tools/`.

`ModelConfig` is one flat record for every model family: the fields all decoders share, then
per-family ones whose defaults describe a plain Llama (no window, no soft-cap, SiLU GLU).
Per-layer choices are tuples (`layer_types`), so the config stays hashable and each layer's
attention (window, soft-cap, scale, rope) is a static function of it. Which fields a family
reads, and which values it refuses, is the family's business: `from_hf_dict` and
`from_gguf_metadata` hand the dict to the family registered for its `model_type` /
`general.architecture` (ksana_jax/models). Helpers here read the fields every family shares.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Literal, get_args

from ksana_jax.spec_decode import SpeculativeConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
DENSE_MLP, MOE_MLP = "dense", "moe"  # per-layer feed-forward kinds (ModelConfig.mlp_types)
MLP_TYPES = (DENSE_MLP, MOE_MLP)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling; `rope_type` is one of SUPPORTED_ROPE_TYPES minus "default"."""

    rope_type: str
    factor: float
    # llama3 only: the wavelength band that is smoothly interpolated between scaled and not.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of one decoder. Hashable: a static jit argument."""

    model_type: str
    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # F
    num_hidden_layers: int  # L
    num_attention_heads: int  # N
    num_key_value_heads: int  # K
    head_dim: int  # H
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    dtype: str = "float32"  # the checkpoint's dtype ("auto" resolves to it)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Per-family fields; the defaults are a plain Llama.
    hidden_act: str = "silu"  # of the gated MLP: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    qk_norm: bool = False  # RMSNorm over each query / key head before rotary (Qwen3, Gemma 3)
    layer_types: tuple[str, ...] = ()  # per layer, from LAYER_TYPES; () = all full attention
    sliding_window: int | None = None  # W: a sliding layer's query at p sees keys > p - W
    query_pre_attn_scalar: float | None = None  # scores scaled by this ** -0.5; None = H
    attn_logit_softcapping: float | None = None  # scores = cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    rope_local_theta: float | None = None  # rope base of sliding layers, unscaled (Gemma 3)
    rope_freq_factors: tuple[float, ...] | None = None  # H/2 divisors of inv_freq (GGUF)
    # Mixture of experts (models/moe.py): per layer, DENSE_MLP or MOE_MLP; () = all dense.
    mlp_types: tuple[str, ...] = ()
    num_experts: int = 0  # E, routed experts of an MoE layer
    num_experts_per_tok: int = 0  # top-k experts each token is routed to
    moe_intermediate_size: int = 0  # F of one expert
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    # Placement, not a property of the checkpoint (never in config.json): experts split over
    # the tensor-parallel devices (EngineConfig.enable_expert_parallel) instead of each
    # expert's F. Static, so the compiled step knows which collective the MoE layer runs.
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        from ksana_jax.models import registry  # the families import this module

        registry.family_of(self.model_type)  # raises naming the supported ones
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; supported: {SUPPORTED_DTYPES}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(
                f"unsupported hidden_act {self.hidden_act!r}; supported: {HIDDEN_ACTS}"
            )
        self._check_layers()
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(
                f"rope_freq_factors has {len(self.rope_freq_factors)} entries, expected "
                f"head_dim / 2 = {self.head_dim // 2}"
            )

    def _check_layers(self) -> None:
        layer_types = tuple(self.layer_types) or (FULL_ATTENTION,) * self.num_hidden_layers
        object.__setattr__(self, "layer_types", layer_types)
        if len(layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(layer_types)} entries, expected num_hidden_layers "
                f"({self.num_hidden_layers})"
            )
        unknown = sorted(set(layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"unsupported layer_types {unknown}; supported: {LAYER_TYPES}")
        mlp_types = tuple(self.mlp_types) or (DENSE_MLP,) * self.num_hidden_layers
        object.__setattr__(self, "mlp_types", mlp_types)
        if len(mlp_types) != self.num_hidden_layers or set(mlp_types) - set(MLP_TYPES):
            raise ValueError(
                f"mlp_types must be {self.num_hidden_layers} values from {MLP_TYPES}, "
                f"got {mlp_types}"
            )
        if MOE_MLP in mlp_types:
            e, k, f = self.num_experts, self.num_experts_per_tok, self.moe_intermediate_size
            if not (e >= 1 and 1 <= k <= e and f >= 1):
                raise ValueError(
                    f"MoE layers need num_experts >= 1 (got {e}), 1 <= num_experts_per_tok <= "
                    f"num_experts (got {k}) and moe_intermediate_size >= 1 (got {f})"
                )
        window = self.sliding_window
        if SLIDING_ATTENTION in layer_types and (not isinstance(window, int) or window < 1):
            raise ValueError(f"sliding layers need a positive sliding_window, got {window!r}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def sm_scale(self) -> float:
        """The factor on q . k before softmax (Gemma: query_pre_attn_scalar ** -0.5)."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_ids(self, mlp_type: str) -> tuple[int, ...]:
        """Indices of the layers whose feed-forward is `mlp_type` (DENSE_MLP or MOE_MLP)."""
        return tuple(i for i, t in enumerate(self.mlp_types) if t == mlp_type)

    def layer_window(self, layer_index: int) -> int | None:
        """Layer `layer_index`'s sliding window W, or None for full attention."""
        sliding = self.layer_types[layer_index] == SLIDING_ATTENTION
        return self.sliding_window if sliding else None

    def layer_rope(self, layer_index: int) -> tuple[float, RopeScaling | None]:
        """(base, scaling) of layer `layer_index`'s rotary embedding."""
        if self.rope_local_theta is not None and self.layer_window(layer_index) is not None:
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    # ------------------------------------------------------------------ readers and writer

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Builds the config from a transformers `config.json` dict (4.x or 5.x layout), through
        the family registered for its `model_type`."""
        from ksana_jax.models import registry

        return registry.config_from_hf(hf)

    @classmethod
    def from_gguf_metadata(
        cls,
        metadata: Mapping[str, Any],
        tensor_names: set[str],
        dtype: str = "float32",
        read_tensor: Callable[[str], Any] | None = None,
    ) -> ModelConfig:
        """Builds the config from GGUF key/values (llama.cpp names) and the file's tensor names,
        through the family registered for its `general.architecture`; `read_tensor(name)`
        gives a tensor's values where the config needs them (see registry.config_from_gguf)."""
        from ksana_jax.models import registry

        return registry.config_from_gguf(metadata, tensor_names, dtype, read_tensor)

    def to_hf_dict(self) -> dict[str, Any]:
        """The config as a transformers 4.x-style `config.json` dict (read back by from_hf_dict:
        every family reads `layer_types` and the other per-family fields under these names)."""
        from ksana_jax.models import registry

        out: dict[str, Any] = {
            "architectures": [registry.family_of(self.model_type).architecture(self.model_type)],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.qkv_bias and self.o_bias,
            "torch_dtype": self.dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids)
            if len(self.eos_token_ids) != 1
            else self.eos_token_ids[0],
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "use_sliding_window": SLIDING_ATTENTION in self.layer_types,
            "query_pre_attn_scalar": self.query_pre_attn_scalar,
            "attn_logit_softcapping": self.attn_logit_softcapping,
            "final_logit_softcapping": self.final_logit_softcapping,
        }
        if self.rope_scaling is not None:
            out["rope_scaling"] = dataclasses.asdict(self.rope_scaling)
        optional = {
            "rope_local_base_freq": self.rope_local_theta,
            "rope_freq_factors": None
            if self.rope_freq_factors is None
            else list(self.rope_freq_factors),
        }
        if MOE_MLP in self.mlp_types:
            optional |= {
                "mlp_types": list(self.mlp_types),
                "num_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size,
                "norm_topk_prob": self.norm_topk_prob,
            }
        return out | {k: v for k, v in optional.items() if v is not None}


# ---------------------------------------------------------------------- shared field readers


def hf_common_fields(hf: Mapping[str, Any], default_rms_norm_eps: float = 1e-6) -> dict[str, Any]:
    """The ModelConfig fields every family reads the same way from a transformers config."""
    num_heads = hf_int(hf, "num_attention_heads")
    hidden = hf_int(hf, "hidden_size")
    rope_theta, rope_scaling = rope_from_hf(hf)
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return dict(
        model_type=hf["model_type"],
        vocab_size=hf_int(hf, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=hf_int(hf, "intermediate_size"),
        num_hidden_layers=hf_int(hf, "num_hidden_layers"),
        num_attention_heads=num_heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", default_rms_norm_eps)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dtype=dtype_from_hf(hf),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=tuple(int(e) for e in eos_ids),
    )


def hf_int(hf: Mapping[str, Any], name: str) -> int:
    if name not in hf:
        raise ValueError(f"config.json is missing required field {name!r}")
    return int(hf[name])


def require_value(hf: Mapping[str, Any], name: str, allowed: tuple, default: Any) -> None:
    value = hf.get(name, default)
    if value not in allowed:
        raise ValueError(f"unsupported {name}={value!r}; supported: {allowed}")


def dtype_from_hf(hf: Mapping[str, Any]) -> str:
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    dtype = str(dtype).removeprefix("torch.")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {SUPPORTED_DTYPES}")
    return dtype


def rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """Reads rope from 4.x (`rope_theta` + `rope_scaling`) or 5.x (`rope_parameters`)."""
    return rope_from_parameters(
        hf.get("rope_scaling") or hf.get("rope_parameters") or {},
        hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta"),
    )


def rope_from_parameters(
    scaling: Mapping[str, Any], theta: float | None, default_theta: float = 10000.0
) -> tuple[float, RopeScaling | None]:
    """(base, scaling) from one rope parameter dict (`rope_type`, `factor`, ...)."""
    theta = float(theta or scaling.get("rope_theta") or default_theta)
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return theta, None
    if "factor" not in scaling:
        raise ValueError(f"rope scaling {rope_type!r} needs a 'factor'")
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(scaling["factor"]))
    return theta, RopeScaling(
        "llama3",
        float(scaling["factor"]),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
    )


def gguf_common_fields(
    metadata: Mapping[str, Any], tensor_names: set[str], dtype: str
) -> dict[str, Any]:
    """The ModelConfig fields every family reads the same way from GGUF metadata (keys
    `{arch}.*` as llama.cpp writes them); `model_type` is the architecture."""
    arch = metadata["general.architecture"]

    def key(name: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata is missing {arch}.{name}")
        return value

    rope_type = metadata.get(f"{arch}.rope.scaling.type", "none")
    rope_scaling = None
    if rope_type == "linear":
        rope_scaling = RopeScaling("linear", float(key("rope.scaling.factor")))
    elif rope_type not in ("none", None):
        raise ValueError(
            f"unsupported GGUF {arch}.rope.scaling.type {rope_type!r}; supported: none, linear"
        )
    num_heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab = metadata.get(f"{arch}.vocab_size", len(tokens) if tokens is not None else None)
    if vocab is None:
        raise ValueError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer tokens")
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    return dict(
        model_type=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=int(metadata.get(f"{arch}.attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        dtype=dtype,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


AttentionBackendName = Literal["reference", "cpu", "xla", "pallas_tpu", "pallas_gpu"]
# The one list of backend names (pallas_kernels.BACKENDS holds their objects); "auto" picks one.
ATTENTION_BACKENDS = ("auto", *get_args(AttentionBackendName))
ENGINE_DTYPES = ("auto", "float32", "bfloat16")
# Quantized KV (vLLM's names): int8, or fp8 = fp8_e4m3 = float8_e4m3fn, with a float32 scale
# per token and KV head beside the pages (kv_cache.py).
KV_CACHE_QUANTIZED = {"int8": "int8", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}
KV_CACHE_DTYPES = (*ENGINE_DTYPES, "float16", *KV_CACHE_QUANTIZED)
# Weight quantization formats (ksana_jax/quant.py): the one list.
Quantization = Literal["int8", "int4"]
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)


def _geometric(low: int, high: int, factor: int) -> tuple[int, ...]:
    """low, low*factor, ... below high, then high itself."""
    values = []
    v = low
    while v < high:
        values.append(v)
        v *= factor
    return (*values, high)


def _field(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A config field with its one-line help (the CLI turns each field into a flag)."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The engine's single configuration object (vLLM's names where vLLM has one).

    Shapes of the compiled step come only from three bucket lists: tokens per step (T),
    sequences per step (S) and context tokens per sequence (P * page_size). Each step is
    padded up to the smallest bucket of each kind that fits, and warm-up compiles every
    combination, so serving never compiles. Empty bucket lists are derived from the limits.
    """

    dtype: str = _field("auto", "parameter dtype; auto = the checkpoint's", ENGINE_DTYPES)
    kv_cache_dtype: str = _field(
        "auto",
        "KV cache dtype; auto = the parameter dtype, but float16 for bfloat16 params on CPU; "
        "int8 / fp8 (= fp8_e4m3): quantized, a float32 scale per token and KV head",
        KV_CACHE_DTYPES,
    )
    quantization: str | None = _field(
        None,
        "weight quantization of a float model at load time: int8 (per output channel) or "
        "int4 (asymmetric groups of 32); a quantized checkpoint is kept as converted",
        QUANTIZATIONS,
    )
    max_model_len: int = _field(2048, "longest request: prompt + output tokens")
    page_size: int = _field(16, "tokens per KV page")
    num_pages: int | None = _field(
        None, "KV pages including the padding sink; unset = from kv_cache_memory_gib"
    )
    kv_cache_memory_gib: float | None = _field(
        None,
        "KV budget per device in GiB; unset = enough for max_num_seqs full-length sequences, "
        "<= 2 GiB per device",
    )
    max_num_seqs: int = _field(32, "most sequences (rows) in one step")
    max_num_batched_tokens: int = _field(
        256, "most tokens in one step (decode tokens + prefill chunks)"
    )
    token_buckets: tuple[int, ...] = _field((), "tokens-per-step shapes; unset = derived")
    seq_buckets: tuple[int, ...] = _field((), "sequences-per-step shapes; unset = derived")
    context_buckets: tuple[int, ...] = _field(
        (), "context shapes, multiples of page_size; unset = derived"
    )
    max_logprobs: int = _field(20, "largest top-N logprobs a request may ask for")
    max_num_scored_tokens: int | None = _field(
        None,
        "most prompt positions per step whose logprobs are computed (prompt_logprobs; a "
        "fixed shape: such prefills are chunked to fit); unset = min(256, "
        "max_num_batched_tokens)",
    )
    attention_backend: str = _field(
        "auto",
        "attention kernels; auto = Pallas on TPU/GPU, cpu (C++ kernel) on CPU",
        ATTENTION_BACKENDS,
    )
    enable_prefix_caching: bool = _field(
        True, "share the K/V pages of common prompt prefixes across requests"
    )
    tensor_parallel_size: int = _field(
        1,
        "devices the model is split over: attention by heads, MLP and vocabulary by "
        "columns/rows (see docs/deploy.md)",
    )
    enable_expert_parallel: bool = _field(
        False,
        "MoE models: split the experts over the tensor-parallel devices (each holds "
        "num_experts / tp whole experts; attention stays split by heads) instead of "
        "splitting every expert's intermediate dim",
    )
    seed: int = _field(0, "draws the seeds of requests that give none")
    async_scheduling: bool = _field(
        True,
        "prepare and dispatch the next step before fetching this one's tokens (same outputs; "
        "the host's work per step overlaps the device's; --no-async-scheduling turns it off)",
    )
    speculative_config: dict[str, Any] | None = _field(  # noqa: RUF009 (a default of None)
        None,
        'speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}, or a draft model with the same '
        'vocabulary: {"model": PATH, "num_speculative_tokens": 4} (see docs/speculative.md)',
    )
    compilation_cache_dir: str | None = _field(
        None, "JAX persistent compilation cache directory (serve: ~/.cache/ksana-jax/jax)"
    )

    def __post_init__(self) -> None:
        if self.dtype not in ENGINE_DTYPES:
            raise ValueError(f"dtype must be one of {ENGINE_DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        for name in (
            "max_model_len",
            "page_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_logprobs",
            "tensor_parallel_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("enable_prefix_caching", "async_scheduling", "enable_expert_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.speculative_config is not None:
            self.speculative  # validates it  # noqa: B018
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the sink), got {self.num_pages}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})"
            )
        scored = self.max_num_scored_tokens
        if scored is None:
            object.__setattr__(self, "max_num_scored_tokens", min(256, self.max_num_batched_tokens))
        elif not 1 <= scored <= self.max_num_batched_tokens:
            raise ValueError(
                f"max_num_scored_tokens must be in [1, max_num_batched_tokens="
                f"{self.max_num_batched_tokens}], got {scored}"
            )
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")
        max_context = -(-self.max_model_len // self.page_size) * self.page_size
        derived = {
            "token_buckets": _geometric(
                min(16, self.max_num_batched_tokens), self.max_num_batched_tokens, 4
            ),
            "seq_buckets": _geometric(min(8, self.max_num_seqs), self.max_num_seqs, 4),
            "context_buckets": _geometric(min(128, max_context), max_context, 4),
        }
        for name, default in derived.items():
            buckets = tuple(int(b) for b in (getattr(self, name) or default))
            object.__setattr__(self, name, buckets)
            if list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
                raise ValueError(f"{name} must be strictly increasing positive ints: {buckets}")
        limits = {
            "token_buckets": self.max_num_batched_tokens,
            "seq_buckets": self.max_num_seqs,
            "context_buckets": max_context,
        }
        for name, limit in limits.items():
            if getattr(self, name)[-1] != limit:
                raise ValueError(f"the last of {name} {getattr(self, name)} must equal {limit}")
        if any(b % self.page_size for b in self.context_buckets):
            raise ValueError(
                f"context_buckets {self.context_buckets} must be multiples of "
                f"page_size {self.page_size}"
            )

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """speculative_config, parsed and validated (None: no speculation)."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.from_dict(self.speculative_config)

    @property
    def num_speculative_tokens(self) -> int:
        """k, the proposals a row may verify in one step (0 without speculation)."""
        spec = self.speculative
        return 0 if spec is None else spec.num_speculative_tokens

    @property
    def max_pages_per_seq(self) -> int:
        return self.context_buckets[-1] // self.page_size

    def bucket_shapes(self) -> list[tuple[int, int, int]]:
        """Every (T, S, context) step shape a step can be padded to, which warm-up compiles.

        A row has at least one token, so S buckets whose fewest rows (one more than the
        bucket below) exceed T tokens are unreachable; S may still exceed T: 9-16 decode
        rows with buckets S = (8, 32), T = (16, ...) pad to (16, 32).
        """
        below = (0, *self.seq_buckets[:-1])
        fewest_rows = {s: b + 1 for s, b in zip(self.seq_buckets, below, strict=True)}
        return [
            (t, s, c)
            for t in self.token_buckets
            for s in self.seq_buckets
            for c in self.context_buckets
            if fewest_rows[s] <= t
        ]

"""`ksana_jax.load(path)`: a model ready for notebooks, checks and single-request generation.

Accepts a converted checkpoint directory, a Hugging Face checkpoint directory or a GGUF file
(the last two are converted in memory through checkpoints_tools, nothing is written).
`Model.logits` runs the paged, jitted forward over a fresh KV array, the same path serving
uses, so it is what tests compare against Hugging Face transformers.

A model lives on the devices of its `ShardingPlan` (sharding.py): `load(path,
tensor_parallel_size=4)` restores each parameter straight into its shards, and one device is
the 1 x 1 x 1 mesh of the same code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ksana_jax import checkpoint, quant, sharding
from ksana_jax.config import ModelConfig
from ksana_jax.demo import resolve_model
from ksana_jax.kv_cache import KVCacheSpec, allocate_kv, resolve_kv_dtype
from ksana_jax.models import registry
from ksana_jax.pallas_kernels import linear_cpu
from ksana_jax.step import logits_step
from ksana_jax.step_inputs import SequenceChunk, build_step_inputs
from ksana_jax.tokenizer import Tokenizer

DTYPES = ("auto", "float32", "bfloat16")


def bucket(n: int, minimum: int = 16) -> int:
    """The smallest power of two >= max(n, minimum): bounds the number of compiled shapes."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())


@dataclasses.dataclass
class Model:
    """A loaded model: config, device params (sharded as `plan` says), tokenizer and
    generation defaults."""

    config: ModelConfig
    params: registry.Params
    tokenizer: Tokenizer
    generation_config: dict[str, Any]
    plan: sharding.ShardingPlan
    # The weight quantization (quant.py) asked for at convert or load time; None = float.
    quantization: str | None = None
    # The KV cache dtype of `logits` and `generate` (EngineConfig.kv_cache_dtype's choices).
    kv_cache_dtype: str = "auto"

    @property
    def dtype(self) -> str:
        return registry.params_dtype(self.params)

    @property
    def kv_dtype(self) -> str:
        """The KV dtype this model's single-sequence paths use (see resolve_kv_dtype)."""
        return resolve_kv_dtype(self.kv_cache_dtype, self.dtype, jax.default_backend())

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids from the config, generation config and tokenizer."""
        ids = list(self.config.eos_token_ids)
        eos = self.generation_config.get("eos_token_id")
        ids += eos if isinstance(eos, list) else [] if eos is None else [eos]
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return tuple(dict.fromkeys(int(i) for i in ids))

    def with_dtype(self, dtype: str) -> Model:
        """This model with its parameters cast to `dtype` ("auto" keeps them)."""
        if dtype in ("auto", self.dtype):
            return self
        params = self.plan.shard_params(quant.cast(self.params, dtype))
        return dataclasses.replace(
            self, params=params, config=dataclasses.replace(self.config, dtype=dtype)
        )

    def with_quantization(self, quantization: str | None) -> Model:
        """This model with its matrices quantized (quant.py) on the host, then placed as
        before; None, or the model's own quantization, keeps it. A model quantized one way
        is not requantized another (convert the float source instead)."""
        if quantization is None or quantization == self.quantization:
            return self
        quant.check_model(self.config)
        if self.quantization is not None:
            raise ValueError(
                f"the model is already quantized as {self.quantization}, not {quantization}; "
                "load or convert its float source with the quantization you want"
            )
        params = quant.quantize_params(sharding.fetch(self.params), quantization)
        params = self.plan.shard_params(params)
        return dataclasses.replace(self, params=params, quantization=quantization)

    def with_tensor_parallel(
        self, tensor_parallel_size: int, enable_expert_parallel: bool = False
    ) -> Model:
        """This model split over `tensor_parallel_size` devices (moved shard by shard); an MoE
        model's experts split whole with `enable_expert_parallel` (sharding.py)."""
        config = with_expert_parallel(self.config, enable_expert_parallel)
        if tensor_parallel_size == self.plan.tensor_parallel_size and config == self.config:
            return self
        plan = _make_plan(config, tensor_parallel_size)
        params = plan.shard_params(self.params)
        return dataclasses.replace(self, config=config, params=params, plan=plan)

    def logits(self, token_ids: Sequence[int], page_size: int = 16) -> np.ndarray:
        """Logits f32[T, V] at every position of `token_ids`, via one paged prefill."""
        n = len(token_ids)
        if n == 0:
            raise ValueError("token_ids must not be empty")
        num_tokens = bucket(n, page_size)
        pages_per_seq = num_tokens // page_size
        spec = KVCacheSpec.for_model(
            self.config,
            pages_per_seq + 1,
            page_size,
            self.kv_dtype,
        )
        inputs = build_step_inputs(
            [SequenceChunk(token_ids, 0, range(1, pages_per_seq + 1))],
            page_size,
            num_tokens,
            1,
            pages_per_seq,
        )
        inputs, indices = self.plan.put_replicated((inputs, np.arange(num_tokens, dtype=np.int32)))
        with self.plan.activate():
            kv = allocate_kv(spec, self.plan.kv_sharding(spec.shape))
            out, _ = logits_step(self.params, self.config, kv, inputs, indices)
        return sharding.fetch(out)[:n]


def _make_plan(config: ModelConfig, tensor_parallel_size: int) -> sharding.ShardingPlan:
    """The model's plan: on one device whose CPU kernel indexes them, its quantized layer
    matrices are held stacked (ShardingPlan.stack_layers)."""
    stack = linear_cpu.indexes_layers()
    return sharding.make_plan(config, tensor_parallel_size, stack_layers=stack)


def with_expert_parallel(config: ModelConfig, enable: bool) -> ModelConfig:
    """`config` placed with its experts split whole over the devices (an MoE model only: for a
    dense model the option changes nothing)."""
    return dataclasses.replace(config, expert_parallel=enable and config.num_experts > 0)


def load(
    path: str | Path,
    dtype: str = "auto",
    tensor_parallel_size: int = 1,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
    enable_expert_parallel: bool = False,
) -> Model:
    """Loads a checkpoint directory, an HF directory or a GGUF file.

    Args:
      path: a directory written by `ksana-jax convert`, an HF checkpoint directory, a .gguf
        file, or `demo` (the bundled SmolLM2-135M-Instruct, see demo.py).
      dtype: parameter dtype; "auto" keeps the checkpoint's (float32 for GGUF).
      tensor_parallel_size: devices to split the model over; a checkpoint directory is
        restored straight into the shards (no device ever holds a whole copy).
      quantization: "int8" | "int4" quantizes every matrix (linear layers, embedding, LM
        head) on the host before it is placed (quant.py); None keeps the checkpoint's.
      kv_cache_dtype: the KV dtype `Model.logits` and `generate` run through ("auto", a
        float dtype, or quantized "int8" / "fp8"; see kv_cache.py).
      enable_expert_parallel: an MoE model's experts split whole over the devices, each
        restored straight onto its device (else every expert's F is split).
    """
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {DTYPES}")
    if quantization is not None:
        quant.check_format(quantization)
    resolve_kv_dtype(kv_cache_dtype, "float32", jax.default_backend())  # a bad name: ValueError
    path = Path(resolve_model(str(path)))  # `demo`: the bundled model
    if checkpoint.is_checkpoint_dir(path):
        config = checkpoint.validate(path)  # names a missing or damaged file before any read
        config = with_expert_parallel(config, enable_expert_parallel)
        target = config.dtype if dtype == "auto" else dtype
        plan = _make_plan(config, tensor_parallel_size)
        shapes = registry.param_shapes(config)
        params = checkpoint.load_params(
            path, config, target, lambda name: plan.param_sharding(name, shapes[name])
        )
        params = plan.shard_params(params)  # per layer, or stacked for the CPU kernel
        stored = (checkpoint.read_quantization(path) or {}).get("quantization")
        tokenizer = checkpoint.read_tokenizer(path)
        generation = checkpoint.read_generation_config(path)
    else:
        # In-memory conversion; checkpoints_tools sits above the engine, so import it late.
        from checkpoints_tools import read_source

        source = read_source(path, None if dtype == "auto" else dtype, quantization)
        stored = source.quantization
        config = with_expert_parallel(source.config, enable_expert_parallel)
        tokenizer = Tokenizer.from_files(source.tokenizer_files)
        plan = _make_plan(config, tensor_parallel_size)
        params = plan.shard_params(source.params)
        generation = source.generation_config or {}
    if dtype != "auto":
        config = dataclasses.replace(config, dtype=dtype)
    model = Model(config, params, tokenizer, generation, plan, stored, kv_cache_dtype)
    return model.with_quantization(quantization)

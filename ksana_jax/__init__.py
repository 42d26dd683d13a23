"""ksana-jax: LLM inference and serving on JAX/XLA.

Public API: `LLM` and `SamplingParams` (offline generation with continuous batching;
`StructuredOutputsParams` constrains an output),
`EngineConfig`, `load` (checkpoint directory, HF directory or GGUF -> Model), `ModelConfig`,
`Tokenizer`, and `generate` (single request, no scheduler).
"""

from ksana_jax.config import EngineConfig, ModelConfig
from ksana_jax.generate import generate
from ksana_jax.llm import LLM
from ksana_jax.model import Model, load
from ksana_jax.outputs import CompletionOutput, RequestOutput
from ksana_jax.sampling_params import SamplingParams, StructuredOutputsParams
from ksana_jax.tokenizer import Tokenizer

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "Model",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "Tokenizer",
    "generate",
    "load",
]

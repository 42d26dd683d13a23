"""ksana-jax: LLM inference and serving on JAX/XLA.

Public API: `LLM` and `SamplingParams` (offline generation with continuous batching;
`StructuredOutputsParams` constrains an output),
`EngineConfig`, `load` (checkpoint directory, HF directory or GGUF -> Model), `ModelConfig`,
`Tokenizer`, and `generate` (single request, no scheduler).

Importing it sets glibc's malloc to keep freed blocks before the JAX CPU runtime starts
(host_memory.py: XLA:CPU's per-step temporaries otherwise page-fault in every step);
`KSANA_JAX_KEEP_FREED_MEMORY=0` turns that off. Where JAX computes on the CPU it also asks
XLA:CPU to order programs for one thread (cpu_schedule.py: the C++ kernels' own pool then has
the other cores); `KSANA_JAX_SEQUENTIAL_CPU_SCHEDULE=0` turns that off.
"""

# First, before anything starts the JAX CPU runtime: host_memory sets malloc up on import,
# cpu_schedule XLA_FLAGS (read when JAX starts its CPU backend).
from ksana_jax import cpu_schedule, host_memory  # noqa: F401
from ksana_jax.config import EngineConfig, ModelConfig
from ksana_jax.generate import generate
from ksana_jax.llm import LLM
from ksana_jax.model import Model, load
from ksana_jax.outputs import CompletionOutput, RequestOutput
from ksana_jax.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from ksana_jax.tokenizer import Tokenizer

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "Model",
    "ModelConfig",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
    "Tokenizer",
    "generate",
    "load",
]

"""ksana-jax: LLM inference and serving on JAX/XLA.

Public API: `load` (checkpoint directory, HF directory or GGUF -> Model), `ModelConfig`,
`Tokenizer`, `generate` (single request).
"""

from ksana_jax.config import ModelConfig
from ksana_jax.generate import generate
from ksana_jax.model import Model, load
from ksana_jax.tokenizer import Tokenizer

__all__ = ["Model", "ModelConfig", "Tokenizer", "generate", "load"]

"""Checkpoint conversion: Hugging Face safetensors directories and GGUF files -> orbax."""

from checkpoints_tools.convert import convert, read_source, write_checkpoint
from checkpoints_tools.source import ConversionError, Source

__all__ = ["ConversionError", "Source", "convert", "read_source", "write_checkpoint"]

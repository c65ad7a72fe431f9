"""The Llama family and its safetensors loader."""

from tinypaged.model.llama import AttentionMetadata, LlamaForCausalLM
from tinypaged.model.loader import load_model

__all__ = ["AttentionMetadata", "LlamaForCausalLM", "load_model"]

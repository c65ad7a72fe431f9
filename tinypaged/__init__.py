"""tinypaged: a small, fast LLM serving engine built on PagedAttention."""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "RequestOutputKind", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy, so that `import tinypaged.core` (pure Python) does not pull in torch.
    if name == "LLM":
        from tinypaged.llm import LLM

        return LLM
    if name in ("SamplingParams", "RequestOutputKind"):
        from tinypaged import sampling_params

        return getattr(sampling_params, name)
    if name in ("CompletionOutput", "RequestOutput"):
        from tinypaged import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'tinypaged' has no attribute {name!r}")

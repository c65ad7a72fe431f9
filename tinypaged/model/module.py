"""The engine's modules' base: torch's `nn.Module` called straight through to `forward`.

`nn.Module.__call__` runs the hooks machinery around `forward` (global and per-module hooks, tracing state):
about 1.5 us a call on the CPU, and a decode step of the default model makes some 270 module calls. Without it
the quantized default model decoded 2-15% faster in three alternated pairs (benchmarks/HISTORY.md). The engine
registers no hooks, so its modules skip it. Everything else of `nn.Module` (parameters, buffers, `state_dict`,
`.to`, submodules) is unchanged.
"""

from __future__ import annotations

from typing import Any

from torch import nn


class Module(nn.Module):
    """An `nn.Module` whose call is its `forward`, with no hooks run."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

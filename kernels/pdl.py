"""Programmatic dependent launch (PDL), on Hopper GPUs and later.

A decode step is hundreds of short kernels in a row; between two of them the GPU idles while the next one is
launched and its programs start. Launched with PDL, a kernel may start while the one before it in the stream
is still finishing. Each kernel here that takes `USE_PDL` first waits for the kernel before it to complete
(`griddepcontrol.wait`, which also makes that kernel's writes visible), and only then reads or writes memory;
it then lets the next kernel launch. So only the launch and the start of the programs overlap the previous
kernel's tail. The wait comes before any early return: a kernel that completed without waiting would let the
kernel after it run ahead of the one before it.

`TINYPAGED_PDL=0` turns it off (for side-by-side measurements).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@functools.cache
def _supported(device_index: int) -> bool:
    return (
        os.environ.get("TINYPAGED_PDL", "1") != "0" and torch.cuda.get_device_capability(device_index)[0] >= 9
    )


def pdl_options(t: torch.Tensor) -> dict[str, bool]:
    """The launch options for a kernel that takes `USE_PDL`, on t's device."""
    on = t.is_cuda and _supported(
        t.device.index if t.device.index is not None else torch.cuda.current_device()
    )
    return {"USE_PDL": on, "launch_pdl": on}


@triton.jit
def pdl_start(USE_PDL: tl.constexpr):
    """Wait for the previous kernel, then let the next one launch (a no-op without PDL)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

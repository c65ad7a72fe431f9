"""E4M3 values with float32 scales: the quantize and dequantize that every FP8 op shares, the linear layers'
(`fp8.py`) and the KV cache's (`tinypaged/ops.py`). Torch alone, below both: fp8.py dispatches through ops.py,
and ops.py's KV-cache references quantize as fp8.py does.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite E4M3 value


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x / scale` (in float32, scale broadcast against x) saturated to +-448 and rounded to E4M3."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 values times `scale` (broadcast against them), in float32: exact.

    On the CPU, torch's cast from float8 is scalar code (about 20 ns a value on a 2-core AVX2 machine); here
    the E4M3 bits are moved into a float16's instead (sign, then exponent and mantissa shifted into place: the
    exponent bias is 15 rather than 7, so the float16 holds the value over 2^8, subnormals included), which the
    CPU converts with vector instructions, 6x faster. The two NaN codes, which `quantize` never writes, read as
    +-480 there."""
    if q.device.type != "cpu":
        return q.float() * scale
    b = q.view(torch.uint8).to(torch.int16)
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return bits.view(torch.float16).float() * (scale.float() * 2.0**8)

"""Triton kernels of tinypaged, installed as `tinypaged.kernels`; `tinypaged.ops` is the facade over them."""

from .activation import silu_and_mul
from .attention import paged_attention
from .bitmask import apply_token_bitmask
from .cache import copy_blocks, write_kv
from .fp8 import quantize_per_token as quantize_fp8
from .fp8 import silu_and_mul_fp8
from .gemv import MAX_ROWS as gemv_max_rows
from .gemv import gemv
from .norm import rms_norm, rms_norm_fp8
from .rotary import rotary_embedding, rotary_write_kv
from .sampling import sample

__all__ = [
    "apply_token_bitmask",
    "copy_blocks",
    "gemv",
    "gemv_max_rows",
    "paged_attention",
    "quantize_fp8",
    "rms_norm",
    "rms_norm_fp8",
    "rotary_embedding",
    "rotary_write_kv",
    "sample",
    "silu_and_mul",
    "silu_and_mul_fp8",
    "write_kv",
]

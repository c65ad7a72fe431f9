"""Triton kernels of tinypaged, installed as `tinypaged.kernels`; `tinypaged.ops` is the facade over them."""

from .activation import silu_and_mul
from .attention import paged_attention
from .bitmask import apply_token_bitmask
from .cache import copy_blocks, write_kv
from .gemv import MAX_ROWS as gemv_max_rows
from .gemv import gemv
from .norm import rms_norm
from .rotary import rotary_embedding, rotary_write_kv
from .sampling import sample

__all__ = [
    "apply_token_bitmask",
    "copy_blocks",
    "gemv",
    "gemv_max_rows",
    "paged_attention",
    "rms_norm",
    "rotary_embedding",
    "rotary_write_kv",
    "sample",
    "silu_and_mul",
    "write_kv",
]

"""Token bitmask (structured outputs; semantics: `ops.ref_apply_token_bitmask`): the tokens a row's grammar does
not allow get -inf, in place. One program per (row, block of the vocabulary); the bitmask is read once (a word
serves 32 lanes) and only the disallowed logits are written, so a JSON grammar's row costs about one write of
its logits, a free-text state's almost nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit
def _apply_bitmask_kernel(logits_ptr, stride, bitmask_ptr, mask_stride, rows_ptr, vocab, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    row = tl.load(rows_ptr + r).to(tl.int64)
    words = tl.load(bitmask_ptr + r * mask_stride + cols // 32, mask=inside, other=0)
    allowed = (words >> (cols % 32)) & 1
    neg_inf = tl.full((BLOCK,), float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride + cols, neg_inf, mask=inside & (allowed == 0))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """`logits[rows[i], j] = -inf` wherever bit j of `bitmask[i]` is 0 (see `ops.ref_apply_token_bitmask`)."""
    n = rows.numel()
    if n == 0:
        return
    assert logits.stride(1) == 1 and bitmask.is_contiguous() and bitmask.dtype == torch.int32
    vocab = min(logits.shape[1], bitmask.shape[1] * 32)
    grid = (n, triton.cdiv(vocab, _BLOCK))
    _apply_bitmask_kernel[grid](
        logits, logits.stride(0), bitmask, bitmask.stride(0), rows, vocab, BLOCK=_BLOCK
    )

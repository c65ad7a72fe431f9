"""Weight-only INT4 / INT8 layers on the CPU through torch's packed kernels, and the embedding and LM head of a
GGUF model kept in a byte a weight.

torch ships CPU kernels for weight-only matmuls (ATen, vectorized for AVX2 and AVX-512):
`_weight_int4pack_mm_for_cpu` takes 4-bit codes packed by `_convert_weight_to_int4pack_for_cpu` with a
`[K / group, N, 2]` tensor of (scale, zero) per group (groups of 32, 64, 128 or 256) and computes with the weight
`(q - 8) * scale + zero`; `_weight_int8pack_mm` takes int8 codes `[N, K]` with one scale per output row. Both are
fast only with bf16 activations (their float32 and float16 paths are scalar loops, 20 to 50 times slower on
AVX-512; benchmarks/HISTORY.md), and both want the scales in the activations' dtype. So a layer packed here runs
in bf16: its input rows are rounded to bf16, the kernel dequantizes each group in float32 from bf16 scale and
zero and accumulates in float32, and the output, rounded to bf16, comes back in the input's dtype. torch has no
grouped INT8 kernel: a grouped 8-bit layer runs the INT4 one, each code split in two nibbles (`split_int8`).

The layout's weight `(code - zero) * scale (+ min)` maps onto torch's exactly except for that rounding: scale
`scale`, zero `(8 - zero) * scale (+ min)`, computed in float32 and rounded once to bf16 (GGUF's Q4_1 `d * q + m`
is the zero point 0: zero `8 * d + m`). The rounding of the scale (GGUF's float16 `d` keeps 11 bits, bf16 8)
moves a weight by at most 2^-9 of its group's range: the activation precision's own tolerance.

The embedding of a GGUF model is read from the file dequantized (float32); `Int8Embedding` finds the Q8_0 codes
back (`d = amax / 127` per group of 32, exact because Q8_0 stores its largest code as +-127) and keeps them only
where every `code * d` equals the float32 weight bit for bit, so a lookup gives the file's values exactly. The
tied LM head runs those same codes through the INT4 kernel, each code split in two nibbles (`head_weight`), with
the bf16 rounding of its scales as the linear layers have. An int8 head with one scale per vocabulary row
(`_weight_int8pack_mm`, the same bytes and speed) rounds every weight again, coarsely (the row's largest weight
sets the step): greedy tokens on the default model then left its f32 conversion's on 3 of 3 prompts.

The head's bf16 logits are the largest of the kernel's roundings for greedy decoding (benchmarks/
cpu_lowbit_rounding.py: alone, they cost 12 of 41 prompts their f32 tokens; a logit of 20 moves by up to 0.06,
more than the gap between the first two tokens of many steps). So `Int8Embedding.logits` takes each row's
`HEAD_EXACT_TOP` largest bf16 logits as candidates and recomputes those exactly in float32, from the file's
weights and the float32 hidden row: a few thousand multiply-adds a row against the head's 28 million. The rest
keep the kernel's values: for the float32 argmax to fall outside the candidates, 16 other logits would have to
sit within the roundings' reach of it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

INT4_GROUPS = (32, 64, 128, 256)  # the groups _weight_int4pack_mm_for_cpu takes
EMBED_GROUP = 32  # Q8_0's block
HEAD_EXACT_TOP = 16  # logits a row recomputed exactly in float32 by the int8 head (the module's docstring)


class CpuPacked(NamedTuple):
    """A weight packed for torch's CPU kernels: `codes` (INT4: torch's int4pack bytes; INT8: int8 `[N, K]`),
    `scales` in bf16 (INT4: `[K / group, N, 2]` scale and zero; INT8: `[N]`), the kernel's bits and the group.
    `doubled`: an 8-bit weight split in two nibbles, an INT4 weight `[N, 2K]` over the input row repeated
    (`split_int8`); `padded`: its groups of 16 each padded to 32, over the input with 16 zeros after each 16."""

    codes: torch.Tensor
    scales: torch.Tensor
    bits: int
    group: int
    doubled: bool = False
    padded: bool = False


def packable(bits: int, group: int, n: int, k: int, zeros: bool, mins: bool) -> bool:
    """Whether a layer of this scheme and shape `[N, K]` runs on torch's CPU kernels (else the reference)."""
    if group == k and bits == 8 and not zeros and not mins:
        return True  # INT8, one symmetric scale per row
    if group == 16 and bits == 8:  # Q6_K: split in nibbles, each group padded to 32 (`split_int8`)
        return k % 16 == 0 and n % 16 == 0
    return group in INT4_GROUPS and k % group == 0 and n % 16 == 0  # the int4 packing's tiles of 16 rows


def pack(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    mins: torch.Tensor | None,
    bits: int,
    group: int,
) -> CpuPacked | None:
    """Pack unsigned codes `[N, K]` with the layout's float32 `scales`, `zeros` and `mins` `[K / group, N]`; None
    where the kernels cannot take them (an 8-bit code whose distance to its zero point is past a byte's)."""
    if bits == 8 and group == codes.shape[1] and zeros is None and mins is None:
        signed = (codes.to(torch.int32) - 128).to(torch.int8).contiguous()
        return CpuPacked(signed, scales[0].to(torch.bfloat16).contiguous(), 8, group)
    if bits == 8:
        zero = 0 if mins is not None else 128
        if zeros is not None:
            zero = zeros.t().to(torch.int32).repeat_interleave(group, dim=1)
        q = codes.to(torch.int32) - zero
        if q.numel() and (int(q.min()) < -128 or int(q.max()) > 127):
            return None
        return split_int8(q, scales.float(), mins, group)
    s = scales.float()
    zero = (8.0 - (zeros.float() if zeros is not None else (0.0 if mins is not None else 8.0))) * s
    if mins is not None:
        zero = zero + mins.float()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    return CpuPacked(packed, torch.stack([s, zero], -1).to(torch.bfloat16).contiguous(), 4, group)


def packed_linear(x: torch.Tensor, w: CpuPacked, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W.T (+ bias)` for rows x `[M, K]` through torch's kernel, in bf16 (the module's docstring), returned
    in x's dtype."""
    xb = x.to(torch.bfloat16)
    if w.padded:
        xb = pad_rows(xb)
    if w.doubled:
        xb = torch.cat([xb, xb], -1)
    if w.bits == 4:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, w.codes, w.group, w.scales)
    else:
        y = torch.ops.aten._weight_int8pack_mm(xb, w.codes, w.scales)
    y = y.to(x.dtype)
    return y if bias is None else y + bias.to(x.dtype)


def pad_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows `[M, K]` with 16 zeros after each 16 values, `[M, 2K]` (a padded weight's input, `split_int8`)."""
    g = x.view(x.shape[0], -1, 16)
    return torch.cat([g, torch.zeros_like(g)], -1).view(x.shape[0], -1)


class Int8Embedding(NamedTuple):
    """A token embedding `[V, K]` as signed int8 codes and float16 scales `[V, K / 32]` (the weight is
    `code * scale`, exactly the float32 rows it was made from), and its LM head: the same codes split in two
    nibbles, run by the INT4 kernel (`head_weight`)."""

    codes: torch.Tensor
    scales: torch.Tensor
    head: CpuPacked

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 rows of `ids`, exactly the weights they were made from."""
        rows = self.codes[ids].float().view(*ids.shape, -1, EMBED_GROUP)
        return (rows * self.scales[ids].float()[..., None]).flatten(-2)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden @ W.T` `[M, V]`, in hidden's dtype: the INT4 kernel over `[hidden, hidden]` (`head_weight`),
        then each row's `HEAD_EXACT_TOP` largest logits recomputed in float32 from the exact weights (the
        module's docstring)."""
        y = packed_linear(hidden, self.head)
        top = min(HEAD_EXACT_TOP, y.shape[-1])
        if top and y.numel():
            ids = y.topk(top, dim=-1).indices  # [M, top]
            exact = (self.lookup(ids) @ hidden.float()[:, :, None]).squeeze(-1)
            y.scatter_(-1, ids, exact.to(y.dtype))
        return y


def split_int8(q: torch.Tensor, d: torch.Tensor, mins: torch.Tensor | None, group: int) -> CpuPacked:
    """Signed codes `q` `[N, K]` in [-128, 127] with a scale `d` (and a min) per group `[K / group, N]` as one INT4
    weight `[N, 2K]` over the input row repeated: a code is `16 * hi + lo` (hi = q >> 4 in [-8, 7], lo = q & 15),
    so `d * q (+ m) = (hi + 8 - 8) * 16d + (lo - 8) * d + 8d (+ m)`: the first K columns hold `hi + 8` with scale
    `16d` and zero 0, the next K hold `lo` with scale `d` and zero `8d (+ m)`. The weight is exact but for the
    bf16 rounding of `16d`, `d` and `8d (+ m)`, as a 4-bit layer's (the module's docstring); it reads a byte a
    weight with one kernel call. torch has no grouped INT8 kernel: so run GGUF's Q8_0, Q5_0, Q5_1, Q5_K and Q6_K,
    `quantization="int8"` and grouped 8-bit GPTQ, and the LM head of a GGUF model (`head_weight`). Groups of 16
    (Q6_K's; the kernel takes 32 and up) are padded to 32 (`padded`): two bytes a weight, a layer ~10x faster
    than the reference, which dequantizes the whole weight every call."""
    hi, lo = (q >> 4) + 8, q & 15
    padded = group == 16  # Q6_K's: the kernel takes 32 and up; each group's 16 codes then 16 of 8, whose
    if padded:  # weight (8 - 8) * scale + zero meets a zero input, so adds exactly nothing
        n, k = q.shape
        hi, lo = (
            torch.cat([c.view(n, k // 16, 16), torch.full((n, k // 16, 16), 8)], -1).view(n, 2 * k)
            for c in (hi, lo)
        )
    two = torch.cat([hi, lo], 1)
    s = torch.cat([16 * d, d], 0)
    z = torch.cat([torch.zeros_like(d), 8 * d + (mins.float() if mins is not None else 0.0)], 0)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(two.to(torch.int32).contiguous(), 1)
    scales = torch.stack([s, z], -1).to(torch.bfloat16).contiguous()
    return CpuPacked(packed, scales, 4, 32 if padded else group, True, padded)


def head_weight(codes: torch.Tensor, scales: torch.Tensor) -> CpuPacked:
    """Signed int8 codes `[N, K]` with a scale `d` per group of 32 as one INT4 weight (`split_int8`): it reads
    the int8 codes' bytes, a fifth of the float32 head's, with one kernel call."""
    return split_int8(codes.to(torch.int32), scales.float().t(), None, EMBED_GROUP)


def int8_embedding(weight: torch.Tensor) -> Int8Embedding | None:
    """The embedding `[V, K]` (float32) as Q8_0 codes found back, or None where any weight is not exactly
    `code * d` with `d = amax / 127` a float16 over its group of 32 (a weight that was not Q8_0 in its
    file), or whose rows the INT4 kernel cannot take (a multiple of 16)."""
    v, k = weight.shape
    if weight.dtype != torch.float32 or k % EMBED_GROUP or v % 16:
        return None
    g = weight.view(v, k // EMBED_GROUP, EMBED_GROUP)
    d = (g.abs().amax(-1) / 127.0).to(torch.float16)
    safe = torch.where(d > 0, d.float(), torch.ones_like(d, dtype=torch.float32))
    codes = torch.round(g / safe[..., None]).clamp(-127, 127)
    if not torch.equal(codes * d.float()[..., None], g):
        return None
    codes = codes.to(torch.int8).view(v, k)
    return Int8Embedding(codes, d.contiguous(), head_weight(codes, d))

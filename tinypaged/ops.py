"""One facade per op: Triton kernels for CUDA tensors, torch reference implementations otherwise.

The KV cache of a model is one tensor `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`;
a layer's slice `kv_layer = kv_cache[i]` is `[2, num_blocks, block_size, num_kv_heads, head_dim]` (keys, values).
A slot is `block_id * block_size + offset`; token N of a sequence lives in slot
`block_table[N // block_size] * block_size + N % block_size`. A cache in float8_e4m3fn (`kv_cache_dtype="fp8"`)
holds `fp8(x / scale)` with one float32 scale per layer for keys (`k_scale`) and one for values (`v_scale`):
the ops that write it quantize (`model/quant/e4m3.py`'s `quantize`), those that read it dequantize (`stored *
scale`, in float32); the scales are ignored for a cache in any other dtype. Block moves copy its bytes.

Setting TRITON_INTERPRET=1 (before import) routes CPU tensors through the Triton kernels too, so that the
kernels can be tested on a machine without a GPU. Setting TINYPAGED_TORCH_OPS=1 (or entering
`torch_reference_ops()`) does the opposite: every tensor goes through the torch references (CUDA ones, and CPU
ones under the interpreter), e.g. to check the kernels' numerics end to end on a GPU (the model runner then runs
every step eagerly) or under the interpreter.

One job, in about 715 lines: the op set, each op once as its torch reference (the specification the kernels are
tested against) and once as the facade's dispatch between that reference and its kernel; the model, the runner
and the kernel tests all reach ops through this one module, so an op's definition and its dispatch are never
two places apart. The references keep what every layer of a step would derive again (`AttentionMetadata.memo`)
beside them. The kernels themselves are in kernels/, one a file.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F

from tinypaged import cpu_linear

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_TORCH_OPS = os.environ.get("TINYPAGED_TORCH_OPS") == "1"
# Steps of this many rows go through the Triton GEMV: on the H200 it beats cuBLAS at one row (batch-1 decode)
# and loses to it at two and four on most of the 8B layers (benchmarks/kernel_speed.py --sections gemv).
_GEMV_ROWS = 1
# Steps of up to this many rows (bf16 or fp16) go through the Triton skinny matmul (`kernels/fp8_gemm.py`,
# unscaled): a verification step's 5-16 rows, small decode batches (benchmarks/skinny_matmul.py).
# TINYPAGED_SKINNY_ROWS=0 sends them to cuBLASLt (side-by-side measurements).
_SKINNY_ROWS = int(os.environ.get("TINYPAGED_SKINNY_ROWS", "16"))
# The CPU's float32 matmul at a few rows against a large weight (`_sliced_on_cpu`): input rows in this range go
# slice by slice of this many output rows.
_CPU_SLICED_ROWS = (4, 12)
_CPU_SLICE = 512


def uses_triton(x: torch.Tensor) -> bool:
    """Whether the Triton kernel (rather than the torch reference) handles this tensor."""
    return not _TORCH_OPS and (x.is_cuda or _INTERPRET)


@contextlib.contextmanager
def torch_reference_ops() -> Iterator[None]:
    """While active, every tensor goes through the torch references (as with TINYPAGED_TORCH_OPS=1)."""
    global _TORCH_OPS
    before, _TORCH_OPS = _TORCH_OPS, True
    try:
        yield
    finally:
        _TORCH_OPS = before


# ---------------------------------------------------------------------------------------------------------
# Torch references: the definition of each op. The Triton kernels are tested against these.
# ---------------------------------------------------------------------------------------------------------


def ref_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim in fp32; with `residual`, normalises x + residual and also returns the sum."""
    if residual is not None:
        x = x + residual
        residual = x
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        out = F.rms_norm(x, x.shape[-1:], weight, eps)  # torch's fused op: the same sums, one call
        return out if residual is None else (out, residual)
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = (out * weight.float()).to(x.dtype)
    return out if residual is None else (out, residual)


def _cos_sin(
    positions: torch.Tensor, cos_sin_cache: torch.Tensor, memo: dict | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions' cos and signed sin `[T, 1, D]` (cos twice; -sin then sin), looked up once a step per cache
    (`memo`): a rotation is then `x * cos + swap_halves(x) * sin`."""
    key = ("rope", id(cos_sin_cache))
    got = memo.get(key) if memo is not None else None
    if got is None:
        cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
        got = torch.cat((cos, cos), -1)[:, None, :], torch.cat((-sin, sin), -1)[:, None, :]
        if memo is not None:
            memo[key] = got
    return got


def ref_rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    memo: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding of q `[T, Hq, D]` and k `[T, Hkv, D]`; cos_sin_cache is `[max_pos, D]` fp32
    holding cos in its first half and sin in its second: halves (x1, x2) become (x1 cos - x2 sin, x2 cos + x1 sin).
    `memo` (a step's, `AttentionMetadata.memo`) keeps what every layer of the step would otherwise derive again
    from the same positions, slots and block tables."""
    cos, sin = _cos_sin(positions, cos_sin_cache, memo)
    half = cos.shape[-1] // 2

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * cos + xf.roll(half, -1) * sin).to(x.dtype)

    both = _heads_together(q, k)
    if both is not None:  # one rotation of both, split again (views)
        qk = rotate(both)
        return qk[:, : q.shape[1]], qk[:, q.shape[1] :]
    return rotate(q), rotate(k)


def _heads_together(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q `[T, Hq, D]` and k `[T, Hkv, D]` as one view `[T, Hq + Hkv, D]` where k's heads follow q's in memory
    (as slices of the fused qkv projection's rows), else None. A single token's row stride means nothing, and
    views of its slices carry different ones (q's `Hq * D`, k's `Hkv * D`): a decode step of one sequence is
    joined too."""
    t, hq, d = q.shape
    if k.dtype != q.dtype or k.shape[0] != t or k.shape[2] != d or q.stride()[1:] != k.stride()[1:]:
        return None
    if t > 1 and q.stride(0) != k.stride(0):
        return None
    if q.stride(2) != 1 or q.stride(1) != d or k.data_ptr() != q.data_ptr() + hq * d * q.element_size():
        return None
    return q.as_strided((t, hq + k.shape[1], d), q.stride(), q.storage_offset())


def _is_fp8(cache: torch.Tensor) -> bool:
    """Whether a KV cache (or a layer of it) holds FP8 values, with scales."""
    return cache.dtype == torch.float8_e4m3fn


def _as_stored(x: torch.Tensor, cache: torch.Tensor, scale: float) -> torch.Tensor:
    """x as a cache of `cache`'s dtype stores it: cast, or quantized with `scale` (FP8, seen as its bytes:
    torch's CPU indexing ops do not take float8)."""
    if not _is_fp8(cache):
        return x.to(cache.dtype)
    from tinypaged.model.quant.e4m3 import quantize

    # A tensor scale on x's device: a CUDA division by a host scalar multiplies by its reciprocal instead.
    return quantize(x, torch.tensor(scale, dtype=torch.float32, device=x.device)).view(torch.uint8)


def _bytes(cache: torch.Tensor) -> torch.Tensor:
    """An FP8 cache as its bytes (the same memory), any other as it is."""
    return cache.view(torch.uint8) if _is_fp8(cache) else cache


def ref_write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    memo: dict | None = None,
) -> None:
    """Write key/value `[T, Hkv, D]` into the cache at `slot_mapping` `[T]`; negative slots are skipped. An FP8
    cache stores `fp8(key / k_scale)` and `fp8(value / v_scale)`. `memo`: see `ref_rotary_embedding`."""
    got = memo.get("write") if memo is not None else None
    if got is None:
        keep = slot_mapping >= 0
        every = bool(keep.all())  # then no row is skipped: no masked copies of the keys and values
        got = (None, slot_mapping.long()) if every else (keep, slot_mapping[keep].long())
        if memo is not None:
            memo["write"] = got
    keep, slots = got
    if keep is not None:
        key, value = key[keep], value[keep]
    flat = _bytes(kv_layer).flatten(1, 2)  # [2, num_blocks * block_size, Hkv, D], a view
    # index_copy_/index_select copy whole rows: several times faster on the CPU than advanced indexing.
    flat[0].index_copy_(0, slots, _as_stored(key, kv_layer, k_scale))
    flat[1].index_copy_(0, slots, _as_stored(value, kv_layer, v_scale))


def ref_rotary_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    memo: dict | None = None,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """q and k rotated (`ref_rotary_embedding`), the rotated k and v written at `slot_mapping` (`ref_write_kv`);
    returns the rotated q. `qk_norm` (q's norm weight, k's, eps): each head of q and k RMS-normalised first
    (`ref_rms_norm` of its `[D]` rows: Qwen3's and Gemma 3's q/k norms)."""
    if qk_norm is not None:
        q_w, k_w, eps = qk_norm
        q = ref_rms_norm(q.reshape(-1, q.shape[-1]), q_w, eps).view(q.shape)
        k = ref_rms_norm(k.reshape(-1, k.shape[-1]), k_w, eps).view(k.shape)
    q, k = ref_rotary_embedding(positions, q, k, cos_sin_cache, memo)
    ref_write_kv(k, v, kv_layer, slot_mapping, k_scale, v_scale, memo)
    return q


def _context_slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """The cache rows `[B, length]` of positions [0, length) of the sequences whose block tables are given."""
    pos = torch.arange(length, device=block_table.device)
    slots = block_table[:, pos // block_size].long() * block_size + pos % block_size
    # Padding entries of a block table (past a sequence's length, masked by the caller) may be negative.
    return slots.clamp_(min=0)


def _gather(
    kv_layer: torch.Tensor, slots: torch.Tensor, k_scale: float, v_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `[*slots.shape, Hkv, D]` of the cache rows `slots` (an FP8 cache's dequantized)."""
    flat = _bytes(kv_layer).flatten(1, 2)
    idx = slots.flatten()
    shape = (*slots.shape, *flat.shape[2:])
    k, v = flat[0].index_select(0, idx).view(shape), flat[1].index_select(0, idx).view(shape)
    if not _is_fp8(kv_layer):
        return k, v
    from tinypaged.model.quant.e4m3 import dequantize

    fp8 = kv_layer.dtype
    return dequantize(k.view(fp8), torch.tensor(k_scale)), dequantize(v.view(fp8), torch.tensor(v_scale))


def gather_context(
    kv_layer: torch.Tensor,
    block_table: torch.Tensor,
    length: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, ...]:
    """Keys and values of positions [0, length) of the sequences whose block tables are given: `[B, L, Hkv, D]`
    (an FP8 cache's dequantized with its scales, in float32)."""
    return _gather(kv_layer, _context_slots(block_table, length, kv_layer.shape[2]), k_scale, v_scale)


class _AttnPart(NamedTuple):
    """One attention call of `ref_paged_attention`: the single-token queries at `rows`, or (rows None) one
    sequence's `count` new tokens from `start`; `whole` when it takes every query of the batch, in order; the
    cache rows of the context `[B, L]`; the mask (`[B, 1, 1, L]` for single-token queries, None where it masks
    nothing; `[count, L]` for a sequence's new tokens)."""

    rows: torch.Tensor | None
    start: int
    count: int
    whole: bool
    slots: torch.Tensor
    mask: torch.Tensor | None


def _attention_plan(
    block_size: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    window: int | None,
) -> list[_AttnPart]:
    """The calls of `ref_paged_attention` for a batch: one for all its single-token queries (a padded context and a
    length mask), one per sequence with several new tokens (a causal mask). The same for every layer of a step."""
    parts = []
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    lens = seq_lens.tolist()
    starts = query_start_loc.tolist()
    dev = block_tables.device
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    if decode:
        idx = torch.tensor(decode, device=dev)
        max_len = max(lens[i] for i in decode)
        kpos = torch.arange(max_len, device=dev)[None, :]
        mask = kpos < seq_lens[idx][:, None]
        if window is not None:
            mask &= kpos >= seq_lens[idx][:, None] - window
        whole = len(decode) == len(q_lens)
        slots = _context_slots(block_tables[idx], max_len, block_size)
        rows = query_start_loc[idx].long()
        # No mask where it masks nothing (one sequence, no window): the same sums, without the mask's pass.
        mask4 = None if bool(mask.all()) else mask[:, None, None, :]
        parts.append(_AttnPart(rows, 0, len(decode), whole, slots, mask4))
    for i, n in enumerate(q_lens):
        if n <= 1:
            continue
        length = lens[i]
        qpos = torch.arange(length - n, length, device=dev)
        kpos = torch.arange(length, device=dev)[None, :]
        mask = kpos <= qpos[:, None]
        if window is not None:
            mask &= kpos > qpos[:, None] - window
        slots = _context_slots(block_tables[i : i + 1], length, block_size)
        parts.append(_AttnPart(None, starts[i], n, len(q_lens) == 1, slots, mask))
    return parts


def ref_paged_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int | None = None,
    memo: dict | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens of a ragged batch over their sequences' paged KV cache.

    q: `[T, Hq, D]`, the new tokens of B sequences back to back; `query_start_loc` `[B + 1]` delimits them.
    `seq_lens` `[B]`: each sequence's length including its new tokens (whose K/V are already written), so the
    j-th new token of sequence i sits at position `seq_lens[i] - q_len_i + j` and sees positions up to it.
    `block_tables` `[B, max_blocks]` (int32, padded). Returns `[T, Hq, D]`. An FP8 cache is read dequantized
    (`gather_context`). With a `window`, the token at position p sees only positions (p - window, p]: the block
    table's entries below a sequence's first visible position are never used (their blocks may have been freed).
    The calls it makes (`_attention_plan`) are derived once a step when `memo` is given (`ref_rotary_embedding`).
    """
    key = ("attn", window)
    parts = memo.get(key) if memo is not None else None
    if parts is None:
        parts = _attention_plan(kv_layer.shape[2], block_tables, seq_lens, query_start_loc, window)
        if memo is not None:
            memo[key] = parts
    out = None
    for part in parts:
        whole = part.whole and q.shape[0] == part.count  # no padding tokens past the sequences' own
        k, v = _gather(kv_layer, part.slots, k_scale, v_scale)
        if part.rows is not None:  # single-token queries, [B, Hq, 1, D]
            qs = (q if whole else q[part.rows])[:, :, None, :]
        else:  # one sequence's new tokens, [1, Hq, n, D]
            qs = q[part.start : part.start + part.count].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(
            qs.float(),
            k.transpose(1, 2).float(),
            v.transpose(1, 2).float(),
            attn_mask=part.mask,
            scale=scale,
            enable_gqa=True,
        )
        o = (o[:, :, 0, :] if part.rows is not None else o[0].transpose(0, 1)).to(q.dtype)
        if whole:  # contiguous: SDPA's CUDA kernels leave one sequence's rows strided, and callers view them
            return o.contiguous()
        if out is None:
            out = torch.empty_like(q)
        if part.rows is not None:
            out[part.rows] = o
        else:
            out[part.start : part.start + part.count] = o
    return out if out is not None else torch.empty_like(q)


def ref_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU of a fused gate/up projection `[..., 2 * I]` (gate then up): `silu(gate) * up`, in x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def ref_gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Gemma's gated MLP activation of a fused gate/up projection: `gelu_tanh(gate) * up`, in x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def ref_copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy whole blocks `src -> dst` (rows of `block_mapping` `[N, 2]`) in every layer, keys and values."""
    src, dst = block_mapping[:, 0].long(), block_mapping[:, 1].long()
    cache = _bytes(kv_cache)
    cache[:, :, dst] = cache[:, :, src]


def ref_apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Structured outputs' mask, in place: `logits[rows[i], j] = -inf` wherever bit j of `bitmask[i]` is 0
    (bitmask: int32 `[N, ceil(vocab / 32)]`, bit j of word w allows token 32 w + j; rows: `[N]` indices into
    `logits` `[R, vocab]`). Columns past the bitmask's 32 x words are left as they are."""
    vocab = min(logits.shape[1], bitmask.shape[1] * 32)
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab].bool()
    idx = rows.long()
    logits[idx, :vocab] = logits[idx, :vocab].masked_fill(~allowed, float("-inf"))


# Sampling: a row's draw is a pure function of its logits, its parameters and its 64-bit key (no RNG state), so a
# seeded request repeats whatever else is in the batch. The kernel and this reference run the same algorithm.
SAMPLE_MAX_ROUNDS = (
    256  # top-p rejection rounds before the best candidate is taken (never reached in practice)
)
_M32 = 0xFFFFFFFF
_GOLD32 = 0x9E3779B9


class SampleParams(NamedTuple):
    """Per-row sampling parameters, `[N]` tensors on the logits' device."""

    temperature: torch.Tensor  # float32; 0: not sampled (the caller takes the argmax)
    top_k: torch.Tensor  # int; 0, or at least the vocabulary: off
    top_p: torch.Tensor  # float32; 1: off
    min_p: torch.Tensor  # float32; 0: off
    keys: torch.Tensor  # int64 >= 0: the row's random key (the draw is a function of it)


def _h32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def sample_uniform(keys: torch.Tensor, rnd: int) -> torch.Tensor:
    """U(0, 1) per row key for rejection round `rnd` (float32, 24 bits, never 0 or 1)."""
    lo, hi = keys & _M32, (keys >> 32) & _M32
    h = _h32(lo ^ _h32((hi + rnd * _GOLD32) & _M32))
    return ((h >> 8).to(torch.float32) + 0.5) * 2.0**-24


def ref_sample(logits: torch.Tensor, params: SampleParams) -> torch.Tensor:
    """One token per row of `logits` `[N, V]`, drawn from softmax(logits / temperature) restricted by top-k,
    then top-p over the renormalised top-k (ties at a threshold kept), and min-p; rows with temperature 0 are
    not sampled (their entry is 0: the caller takes the argmax).

    Sort-free: an inverse-CDF draw (one uniform from the row's key) among the tokens that top-k and min-p keep
    (top-k's threshold found by bisection in the kernel, by a sort here); top-p is then checked with one pass,
    the mass of the tokens more likely than the pick. A pick outside the nucleus is rejected and the draw
    repeated among the tokens more likely than it, with a new uniform: rejection sampling, exact, and one
    round with probability >= top_p.
    """
    n, vocab = logits.shape
    temperature, top_k, top_p, min_p, keys = params
    out = torch.zeros(n, dtype=torch.int64, device=logits.device)
    rows = (temperature > 0).nonzero()[:, 0]
    if rows.numel() == 0:
        return out
    z = logits[rows].float() * (1.0 / temperature[rows].float())[:, None]  # as the kernel: times 1 / t
    m = z.amax(dim=-1, keepdim=True)
    e = torch.where(z == float("-inf"), 0.0, torch.exp(z - m))
    k = top_k[rows].long()
    inf = torch.full_like(m[:, 0], float("-inf"))
    k_on = (k > 0) & (k < vocab)
    tau_k = inf
    if bool(k_on.any()):
        top = z.topk(int(k[k_on].max()), dim=-1).values
        tau_k = torch.where(k_on, top.gather(1, (k.clamp(1, top.shape[-1]) - 1)[:, None])[:, 0], inf)
    mp = min_p[rows].float()
    floor = torch.maximum(torch.where(mp > 0, m[:, 0] + torch.log(mp.clamp(min=1e-30)), inf), tau_k)
    mass_k = (e * (z >= tau_k[:, None])).sum(dim=-1)
    p = top_p[rows].float()
    key = keys[rows]
    best = torch.zeros(len(rows), dtype=torch.int64, device=z.device)
    pivot = inf.clone()
    act = torch.arange(len(rows), device=z.device)  # rows still drawing
    for rnd in range(SAMPLE_MAX_ROUNDS):
        za, ea = z[act], e[act]
        w = torch.where((za >= floor[act, None]) & (za > pivot[act, None]), ea, 0.0)
        cdf = w.cumsum(dim=-1)
        count = (cdf < (sample_uniform(key[act], rnd) * cdf[:, -1])[:, None]).sum(dim=-1)
        if bool((count >= vocab).any()):  # past the end only by rounding: the last candidate
            cols = torch.arange(vocab, device=z.device)
            count = torch.where(count < vocab, count, torch.where(w > 0, cols, 0).amax(dim=-1))
        found = cdf[:, -1] > 0
        best[act] = torch.where(found, count, best[act])
        check = (found & (p[act] < 1.0)).nonzero()[:, 0]
        if check.numel() == 0 or rnd == SAMPLE_MAX_ROUNDS - 1:
            break
        z_pick = za[check].gather(1, count[check, None])
        above = (ea[check] * (za[check] > z_pick)).sum(dim=-1)
        reject = above >= p[act[check]] * mass_k[act[check]]  # the pick is outside the nucleus
        if not bool(reject.any()):
            break
        act = act[check[reject]]
        pivot[act] = z_pick[reject, 0]
    out[rows] = best
    return out


# ---------------------------------------------------------------------------------------------------------
# The facade the model and runner call.
# ---------------------------------------------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm, optionally fused with the residual add (see `ref_rms_norm`)."""
    if uses_triton(x):
        from tinypaged.kernels import rms_norm as kernel

        return kernel(x, weight, eps, residual)
    return ref_rms_norm(x, weight, eps, residual)


def prefer_cublaslt() -> None:
    """Route torch's CUDA matmuls through cuBLASLt rather than cuBLAS (a process-wide setting of torch's): on the
    H200 W1 ran 0.3-1.0% faster in each of seven alternated pairs (BENCHMARKS.md, "cuBLASLt for the matmuls").
    TINYPAGED_BLAS=cublas keeps torch's default. Called by the model runner before it captures any graph."""
    if os.environ.get("TINYPAGED_BLAS", "cublaslt") == "cublaslt":
        torch.backends.cuda.preferred_blas_library("cublaslt")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight^T + bias` for x `[T, K]`: a one-row step (batch-1 decode: a matrix-vector product, bound by
    the weight's bytes) through the Triton GEMV, a step of a few bf16 or fp16 rows through the Triton skinny
    matmul, a few float32 rows on the CPU as this machine's BLAS runs them fastest (`cpu_linear`), any other
    through torch's matmul (cuBLASLt on a GPU, see `prefer_cublaslt`)."""
    rows = x.shape[0]
    if 0 < rows <= _GEMV_ROWS and uses_triton(x):
        from tinypaged.kernels import gemv

        return gemv(x, weight, bias)
    if (
        0 < rows <= _SKINNY_ROWS
        and x.is_cuda  # not under the interpreter, whose dots take bf16 as raw bits
        and uses_triton(x)
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and x.stride(1) == 1
        and weight.stride(1) == 1
    ):
        from tinypaged.kernels.fp8_gemm import skinny_matmul

        return skinny_matmul(x, weight, bias)
    if x.device.type == "cpu" and (y := cpu_linear.small_rows(x, weight, bias)) is not None:
        return y  # a few float32 rows, the way this machine's BLAS runs them fastest
    if _CPU_SLICED_ROWS[0] <= rows <= _CPU_SLICED_ROWS[1] and _sliced_on_cpu(x, weight, bias):
        out = x.new_empty(rows, weight.shape[0])
        for w, o in zip(weight.split(_CPU_SLICE), out.split(_CPU_SLICE, dim=1), strict=True):
            torch.matmul(x, w.t(), out=o)
        return out
    return F.linear(x, weight, bias)


def _sliced_on_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `linear` takes a large row-major float32 weight (the LM head) on the CPU slice by slice of
    `_CPU_SLICE` output rows: at 4-12 input rows torch's matmul repacks the whole weight first, and a slice's
    repacking stays in cache (the 49,152 x 576 head: 5.4 against 7.5 ms at 5 rows, 6.5 against 11.9 at 8; 1-3
    and 16 rows run faster whole; benchmarks/NOTES.md, "The CPU's matmuls at a few rows")."""
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and bias is None
        and weight.shape[0] >= _CPU_SLICE * 8
        and weight.is_contiguous()
        and x.is_contiguous()
    )


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding of q and k (see `ref_rotary_embedding`)."""
    if uses_triton(q):
        from tinypaged.kernels import rotary_embedding as kernel

        return kernel(positions, q, k, cos_sin_cache)
    return ref_rotary_embedding(positions, q, k, cos_sin_cache)


def rotary_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    memo: dict | None = None,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Rotary embedding of q (returned) and k, with the rotated keys and the values written into their slots
    (`ref_rotary_embedding`, then `ref_write_kv`): the attention reads the new keys from the cache. `memo`: the
    step's (`AttentionMetadata.memo`), for the torch reference. `qk_norm`: (q's norm weight, k's, eps), each
    head of q and k RMS-normalised first (on the GPU in the same launch: no norm launches, no round trip)."""
    args = (positions, q, k, v, cos_sin_cache, kv_layer, slot_mapping, k_scale, v_scale)
    if uses_triton(q):
        from tinypaged.kernels import rotary_write_kv as kernel

        return kernel(*args, qk_norm=qk_norm)
    return ref_rotary_write_kv(*args, memo=memo, qk_norm=qk_norm)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write new keys and values into their slots (see `ref_write_kv`)."""
    if uses_triton(key):
        from tinypaged.kernels import write_kv as kernel

        return kernel(key, value, kv_layer, slot_mapping, k_scale, v_scale)
    return ref_write_kv(key, value, kv_layer, slot_mapping, k_scale, v_scale)


def paged_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    seq_order: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int | None = None,
    short_query_len: int = 1,
    memo: dict | None = None,
) -> torch.Tensor:
    """Causal attention over the paged KV cache for a ragged batch (see `ref_paged_attention`), within a
    sliding `window` where the layer has one. `memo`: the step's (`AttentionMetadata.memo`), for the reference.
    `short_query_len`: the kernel's decode launch (the context split over programs) takes sequences with up to
    this many new tokens (speculative verification); the result is the same.

    `max_query_len` (the longest run of new tokens) and `max_seq_len` (an upper bound of `seq_lens`) are
    host-side hints that keep the kernel launch free of device-to-host syncs (and fix its split-KV choice
    under CUDA graphs). `seq_order` (the sequences longest first) only schedules the kernel's programs.
    `k_scale` and `v_scale`: an FP8 cache's scales (fixed once loaded, so a captured graph keeps them).
    """
    if uses_triton(q):
        from tinypaged.kernels import paged_attention as kernel

        return kernel(
            q,
            kv_layer,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            seq_order=seq_order,
            k_scale=k_scale,
            v_scale=v_scale,
            window=window,
            short_query_len=short_query_len,
        )
    args = (q, kv_layer, block_tables, seq_lens, query_start_loc, scale, k_scale, v_scale, window)
    return ref_paged_attention(*args, memo=memo)


def copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy-on-write: copy many (src, dst) blocks across all layers at once (see `ref_copy_blocks`)."""
    if block_mapping.numel() == 0:
        return
    if uses_triton(kv_cache):
        from tinypaged.kernels import copy_blocks as kernel

        return kernel(kv_cache, block_mapping)
    return ref_copy_blocks(kv_cache, block_mapping)


def swap_blocks(
    src_cache: torch.Tensor, dst_cache: torch.Tensor, block_mapping: list[tuple[int, int]]
) -> None:
    """Copy blocks between the GPU cache and the (pinned) CPU swap cache: rows (src block, dst block)."""
    if not block_mapping:
        return
    src = torch.tensor([s for s, _ in block_mapping], device=src_cache.device)
    dst = torch.tensor([d for _, d in block_mapping], device=dst_cache.device)
    # One gather on the source device, one transfer, one scatter on the destination device. A copy to the host
    # waits for the device: the host scatters it at once, and a non-blocking copy (into pinned memory) may still
    # be on its way then. Towards the device the scatter is queued behind the copy on the same stream.
    to_host = dst_cache.device.type == "cpu"
    _bytes(dst_cache)[:, :, dst] = _bytes(src_cache)[:, :, src].to(dst_cache.device, non_blocking=not to_host)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation of a fused gate/up projection `[T, 2 * I]` (see `ref_silu_and_mul`)."""
    if uses_triton(x):
        from tinypaged.kernels import silu_and_mul as kernel

        return kernel(x)
    return ref_silu_and_mul(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GELU-tanh gated activation of a fused gate/up projection `[T, 2 * I]` (see `ref_gelu_tanh_and_mul`)."""
    if uses_triton(x):
        from tinypaged.kernels import silu_and_mul as kernel

        return kernel(x, gelu=True)
    return ref_gelu_tanh_and_mul(x)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Set the logits of the tokens each row's grammar forbids to -inf, in place (see `ref_apply_token_bitmask`)."""
    if uses_triton(logits):
        from tinypaged.kernels import apply_token_bitmask as kernel

        return kernel(logits, bitmask, rows)
    return ref_apply_token_bitmask(logits, bitmask, rows)


def sample(logits: torch.Tensor, params: SampleParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p sampling without sorting, one token per row (see `ref_sample`)."""
    if uses_triton(logits):
        from tinypaged.kernels import sample as kernel

        return kernel(logits, params, SAMPLE_MAX_ROUNDS)
    return ref_sample(logits, params)

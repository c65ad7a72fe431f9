"""Tile configs and split-KV choice of the paged attention kernels (kernels/attention.py, kernels/attention_fp8.py),
per device and shape, and their decode grid's (sequence, split) of a program."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class AttnConfig:
    """Tile shape and launch parameters of one mode of the attention kernel."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    maxnreg: int | None = None  # a register cap, to keep a whole number of programs resident per SM


# Decode programs resident per SM with the default decode tile (capped at 128 registers x 128 threads; 39 KB
# of shared memory): the split choice counts waves of this many programs.
_DECODE_PROGRAMS_PER_SM = 4


@functools.cache
def num_sms(device: torch.device) -> int:
    """The device's multiprocessor count (read once a device)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_configs(q: torch.Tensor, num_queries_per_kv: int) -> tuple[AttnConfig, AttnConfig]:
    """(decode, prefill) tile configs for this device and shape; tiny tiles under the interpreter."""
    return _default_configs(q.is_cuda, num_queries_per_kv, q.shape[-1], q.element_size())


@functools.cache
def _default_configs(
    is_cuda: bool, g: int, head_dim: int, elem_bytes: int = 2
) -> tuple[AttnConfig, AttnConfig]:
    rows = max(16, triton.next_power_of_2(g))
    if not is_cuda:  # TRITON_INTERPRET: small tiles, so that tiny test shapes span several of them
        return AttnConfig(rows, 16), AttnConfig(max(32, rows), 16)
    # Chosen by the sweeps of benchmarks/kernel_speed.py on the H200 (benchmarks/NOTES.md). The decode tile's two
    # stages (three before) were chosen in the engine: W1 runs at the H200's power cap, where they were faster in
    # the decode steps' graphs and in W1 (runs 45-48), with the same arithmetic (the same tokens).
    # Gemma 3's head_dim of 256 is not measured yet (benchmarks/kernel_speed.py's sweeps on the H200 should choose):
    # its tiles keep the fp32 accumulator small (prefill: 64 x 256 in 8 warps, 64 registers a thread; decode:
    # 16 x 256 in 4, 32) and take half the keys a step, so that the shared memory holds as many programs.
    decode = AttnConfig(rows, 64 if head_dim <= 128 else 32, num_warps=4, num_stages=2, maxnreg=128)
    if head_dim <= 64:
        prefill = AttnConfig(max(128, rows), 64, num_warps=4, num_stages=4)
    elif head_dim > 128:
        prefill = AttnConfig(max(64, rows), 32, num_warps=8, num_stages=2)
    elif elem_bytes > 2:
        # fp32 tiles are twice the bytes: the half-precision tile needs 263 KB of shared memory
        prefill = AttnConfig(max(128, rows), 32, num_warps=8, num_stages=2)
    else:
        prefill = AttnConfig(max(256, rows), 64, num_warps=8, num_stages=3)
    return decode, prefill


def choose_num_splits(
    q: torch.Tensor, num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int
) -> int:
    """KV splits for decode: none once the programs fill the GPU, else the most that still run in one wave (two at
    least), each split at least 4 tiles."""
    if not q.is_cuda:
        return 1
    slots = _DECODE_PROGRAMS_PER_SM * num_sms(q.device)
    return splits_for_programs(num_seqs * num_kv_heads, slots, max(1, min(64, max_seq_len // (4 * block_n))))


def splits_for_programs(programs: int, slots: int, max_splits: int) -> int:
    """`choose_num_splits` for `programs` decode programs (sequences x KV heads) on `slots` program slots."""
    # With a wave or more of programs, taking the sequences longest first (kernels/attention.py) balances the
    # ragged contexts of real batches better than splits do: on W1-like contexts at 128-256 sequences one split
    # beat every split count by 8-30% (BENCHMARKS.md). Fewer programs than slots leave SMs idle: split them up
    # to one whole wave (a second, nearly empty wave would double the tail), and at least in two: just under a
    # wave, two splits ran 7% faster on ragged contexts (64 x 810: 3.33 against 3.11 TB/s).
    if programs >= slots:
        return 1
    return max(1, min(max_splits, max(2, slots // programs)))


def launch_options(q: torch.Tensor, cfg: AttnConfig) -> dict[str, int]:
    """Extra `kernel[grid](...)` options of a config (the register cap, on a GPU only)."""
    return {"maxnreg": cfg.maxnreg} if q.is_cuda and cfg.maxnreg else {}


@triton.jit
def decode_program(seq_order_ptr, num_splits, SPLIT_KV: tl.constexpr, ORDERED: tl.constexpr):
    """A decode program's (sequence, split). Axis 1 is (sequence, split), the split fastest: a sequence's splits
    start together, and in the longest-first order (`seq_order`) the longest sequences' splits all start first."""
    rank = tl.program_id(1)
    split = 0
    if SPLIT_KV:
        split = rank % num_splits
        rank = rank // num_splits
    if ORDERED:
        seq = tl.load(seq_order_ptr + rank)
    else:
        seq = rank
    return seq, split

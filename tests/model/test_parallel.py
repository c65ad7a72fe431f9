"""Which all-reduces tensor parallelism sends through symmetric memory (the kernels themselves need GPUs:
benchmarks/allreduce.py checks them against NCCL)."""

import torch

from tinypaged.model.parallel import SYMM_MEM_MAX_BYTES, SYMM_MEM_MIN_BYTES, SymmMemAllReduce, TPGroup


def test_symmetric_memory_takes_the_decode_steps_sizes_only():
    fast = SymmMemAllReduce(torch.empty(SYMM_MEM_MAX_BYTES // 2, dtype=torch.bfloat16), "unused")
    hidden = 4096

    def fits(rows: int, dtype: torch.dtype = torch.bfloat16) -> bool:
        return fast.fits(torch.empty(rows, hidden, dtype=dtype))

    low, high = SYMM_MEM_MIN_BYTES // (2 * hidden), SYMM_MEM_MAX_BYTES // (2 * hidden)  # 64 and 1024 rows
    assert not fits(1) and not fits(low - 1)  # small: NCCL is as fast
    assert fits(low) and fits(256) and fits(high)  # W1's decode steps
    assert not fits(high + 1) and not fits(2048)  # a step's prefill tokens: NCCL
    assert not fits(256, torch.float32)  # the buffer holds bf16
    assert not fast.fits(torch.empty(256, 2 * hidden, dtype=torch.bfloat16)[:, :hidden])  # not contiguous
    assert not fast.fits(torch.empty(257 * 4096 + 3, dtype=torch.bfloat16))  # not 16-byte aligned in size


def test_a_group_without_symmetric_memory_reduces_nothing_alone():
    x = torch.ones(4, 8)
    assert TPGroup().all_reduce(x) is x and x.sum().item() == 32

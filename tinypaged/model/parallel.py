"""Megatron-style tensor parallelism, as the model sees it: which share of each weight this rank holds, and the
three collectives that put the shares back together (torch.distributed: NCCL on CUDA, gloo on the CPU).

Attention is split by heads (QKV by rows, O by columns), the MLP by its inner columns (gate/up by rows, down by
columns); O and down each leave a partial sum on every rank, which one all-reduce adds. The embedding table and
the LM head are split by vocabulary rows (padded to a multiple of the ranks): a rank embeds the ids in its range
(zeros elsewhere, added by an all-reduce) and computes the logits of its range (gathered along the vocabulary).
KV heads are split like the query heads when there are at least as many as ranks, else each rank keeps the one
KV head its query heads read (replicated on num_ranks / num_kv_heads ranks).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# The all-reduces of a decode step are batch x hidden x 2 bytes: 8 KiB at batch 1, 2 MiB at 256. Between these
# sizes they go through symmetric memory (SymmMemAllReduce), NCCL does the rest. In CUDA graphs on two H200s
# (benchmarks/allreduce.py, BENCHMARKS.md) NCCL takes 7-10 us up to 512 KiB, where symmetric memory is no faster;
# at 2 MiB it takes 27 us against 17, at 8 MiB 46 against 41.
SYMM_MEM_MIN_BYTES = 512 << 10
SYMM_MEM_MAX_BYTES = 8 << 20


class SymmMemAllReduce:
    """Small bf16 all-reduces over a symmetric-memory buffer (torch.distributed._symmetric_memory) on one node's
    GPUs, with no NCCL call (multicast is not used): the rank's tensor is copied into its buffer, torch's two-shot
    kernel has each rank sum its share of every peer's buffer over NVLink and gather the others' sums back, and
    the result is copied out. CUDA graphs capture it like any other kernel. `create` returns None where the
    platform does not support it."""

    def __init__(self, buffer: torch.Tensor, group_name: str) -> None:
        self.buffer = buffer
        self.group_name = group_name

    @classmethod
    def create(
        cls, group: Any, device: torch.device, max_bytes: int = SYMM_MEM_MAX_BYTES
    ) -> SymmMemAllReduce | None:
        fast, error = None, ""
        try:
            import torch.distributed._symmetric_memory as symm_mem

            buffer = symm_mem.empty(max_bytes // 2, dtype=torch.bfloat16, device=device)
            symm_mem.rendezvous(buffer, group.group_name)
            fast = cls(buffer, group.group_name)
        except Exception as e:  # noqa: BLE001 - the ranks agree below
            error = str(e)
        # Every rank uses it or none does (a rank alone in a symmetric-memory collective would wait forever).
        ok = torch.tensor([fast is not None], dtype=torch.int32, device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        if not ok.item():
            logger.warning(
                "symmetric-memory all-reduce unavailable (%s); NCCL does every all-reduce", error or "a peer"
            )
            return None
        try:
            probe = torch.ones(8, dtype=torch.bfloat16, device=device)
            fast.all_reduce(probe)  # every rank runs it: the group's first collective after the rendezvous
            if probe.float().sum().item() != 8 * dist.get_world_size(group):
                raise RuntimeError(f"the probe summed to {probe.float().sum().item()}")
        except Exception as e:
            raise RuntimeError(f"the symmetric-memory all-reduce failed its first call: {e}") from e
        return fast

    def fits(self, x: torch.Tensor) -> bool:
        """Whether x goes through symmetric memory: bf16, contiguous, aligned, and from SYMM_MEM_MIN_BYTES to the
        buffer's size."""
        nbytes = x.numel() * x.element_size()
        return (
            x.dtype == torch.bfloat16
            and nbytes >= SYMM_MEM_MIN_BYTES
            and x.is_contiguous()
            and nbytes % 16 == 0
            and x.numel() <= self.buffer.numel()
        )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x."""
        flat = x.view(-1)
        buf = self.buffer[: flat.numel()]
        buf.copy_(flat)
        torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", self.group_name)
        flat.copy_(buf)
        return x


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in the tensor-parallel group and the collectives over the group's devices (a single
    rank, the default, has nothing to split and its collectives do nothing)."""

    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed ProcessGroup over the ranks' devices (None for one rank)
    # Small all-reduces through symmetric memory (CUDA, one node), NCCL for the rest; None: NCCL (or gloo) for all.
    fast: SymmMemAllReduce | None = field(default=None, compare=False, repr=False)

    # ---- shares ---------------------------------------------------------------------------------------------

    def split(self, n: int) -> tuple[int, int]:
        """This rank's [start, end) of n items split evenly (n a multiple of the group's size)."""
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """This rank's [start, end) of the KV heads: an even split, or the one head its query heads read when
        the ranks outnumber the KV heads."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads)
        head = self.rank * num_kv_heads // self.size
        return head, head + 1

    def vocab(self, vocab_size: int) -> tuple[int, int, int]:
        """This rank's vocabulary rows: (start, end, rows held), rows held being the padded share
        ceil(vocab / size) (the last rank's padding rows are zeros and their logits are cut off)."""
        per = -(-vocab_size // self.size)
        start = min(vocab_size, self.rank * per)
        return start, min(vocab_size, start + per), per

    # ---- collectives ----------------------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; returns x."""
        if self.size > 1:
            if self.fast is not None and self.fast.fits(x):
                return self.fast.all_reduce(x)
            dist.all_reduce(x, group=self.group)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `[N, C]` side by side: `[N, size * C]`, rank 0's columns first (on every rank)."""
        if self.size == 1:
            return x
        parts = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather(list(parts.unbind(0)), x.contiguous(), group=self.group)
        return parts.permute(1, 0, 2).reshape(x.shape[0], -1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, in place; returns x."""
        if self.size > 1:
            dist.broadcast(x, src=dist.get_global_rank(self.group, 0), group=self.group)
        return x

    def min_int(self, n: int, device: torch.device) -> int:
        """The smallest of every rank's n."""
        if self.size == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

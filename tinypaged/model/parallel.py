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

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in the tensor-parallel group and the collectives over the group's devices (a single
    rank, the default, has nothing to split and its collectives do nothing)."""

    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed ProcessGroup over the ranks' devices (None for one rank)

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

"""Plain data at the scheduler's boundary: its configuration and what one step hands the model runner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import msgspec

PreemptionMode = Literal["recompute", "swap"]


@dataclass(frozen=True)
class SchedulerConfig:
    """Batch limits and the preemption policy (vLLM's names and meanings)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    preemption_mode: PreemptionMode | None = None  # None: swap groups of several sequences, else recompute
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.preemption_mode not in ("recompute", "swap", None):
            raise ValueError(
                f"preemption_mode must be 'recompute', 'swap' or None, got {self.preemption_mode!r}"
            )


class ScheduledSeq(msgspec.Struct, frozen=True):
    """One sequence's work in a step: compute num_new_tokens tokens starting at num_computed_tokens. A frozen
    msgspec Struct: a step builds one per sequence on the host's path, and a tensor-parallel worker unpickles
    them every step; a frozen dataclass costs ~10x more to build (object.__setattr__ field by field) and to
    unpickle."""

    seq_id: int
    request_id: str
    num_computed_tokens: int  # position of the first new token
    num_new_tokens: int
    # The new tokens to compute, as far as the host knows them: under async scheduling a decode's input token
    # may still be pending on the device (then this is empty and the runner reads the last step's sample).
    token_ids: tuple[int, ...]
    block_table: tuple[int, ...]  # covers positions [0, num_computed_tokens + num_new_tokens)
    do_sample: bool  # this chunk reaches the sequence's last token: sample the next one
    # Speculative decoding: the last num_spec_tokens of token_ids are proposed tokens that follow the sequence's
    # last token; every one of the chunk's last num_spec_tokens + 1 positions is sampled (verified).
    num_spec_tokens: int = 0


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """Everything the model runner needs for one step, in the order it must be done."""

    scheduled: tuple[ScheduledSeq, ...]
    blocks_to_swap_out: tuple[tuple[int, int], ...]  # (gpu block, cpu block)
    blocks_to_swap_in: tuple[tuple[int, int], ...]  # (cpu block, gpu block)
    blocks_to_copy: tuple[tuple[int, int], ...]  # (src gpu block, dst gpu block)
    preempted: tuple[str, ...]  # request ids preempted in this step
    ignored: tuple[tuple[str, str], ...]  # (request id, reason): finished by the scheduler, can never fit
    num_batched_tokens: int

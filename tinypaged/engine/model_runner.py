"""The model runner: owns the model and the KV caches, turns a SchedulerOutput into one forward pass."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tinypaged import ops
from tinypaged.config import EngineConfig
from tinypaged.core.scheduler import SchedulerOutput
from tinypaged.model import AttentionMetadata, load_model

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
GiB = 1 << 30


def resolve_device(name: str) -> torch.device:
    """'auto' is CUDA when there is a GPU, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    """'auto': float32 on the CPU (exact, and fast there); the checkpoint's half type on a GPU."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return torch.bfloat16 if checkpoint_dtype not in ("float16",) else torch.float16


@dataclass(frozen=True)
class ModelInput:
    """The batch tensors of one step, built from the scheduler's plain data."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [S] indices into the T new tokens whose logits are sampled


class ModelRunner:
    """Loads the weights, allocates the paged KV cache (and its CPU swap space), runs forward passes."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mcfg = config.model
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, mcfg.torch_dtype, self.device)
        self.model = load_model(mcfg, self.dtype, self.device, config.max_model_len)
        self.block_size = config.cache.block_size
        shape = (mcfg.num_layers, 2, self.block_size, mcfg.num_kv_heads, mcfg.head_dim)
        self.block_bytes = torch.Size(shape).numel() * torch.tensor([], dtype=self.dtype).element_size()
        self.num_gpu_blocks = config.cache.num_gpu_blocks_override or self._blocks_that_fit()
        self.num_cpu_blocks = int(config.cache.swap_space * GiB // self.block_bytes)
        self.kv_cache = self._allocate(self.num_gpu_blocks, self.device)
        # torch.empty leaves host pages untouched until a block is swapped out, so unused swap space costs nothing.
        self.swap_cache = self._allocate(self.num_cpu_blocks, torch.device("cpu"), pin=self.device.type == "cuda")
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB), swap: %d blocks",
            self.num_gpu_blocks,
            self.block_size,
            self.num_gpu_blocks * self.block_bytes / GiB,
            self.num_cpu_blocks,
        )

    def _allocate(self, num_blocks: int, device: torch.device, pin: bool = False) -> torch.Tensor:
        m = self.config.model
        shape = (m.num_layers, 2, num_blocks, self.block_size, m.num_kv_heads, m.head_dim)
        return torch.empty(shape, dtype=self.dtype, device=device, pin_memory=pin)

    def _blocks_that_fit(self) -> int:
        """How many KV blocks the memory budget holds after the weights (and activations, on a GPU)."""
        if self.device.type == "cpu":
            return max(1, int(self.config.cache.cpu_kv_cache_space * GiB // self.block_bytes))
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        # Activations of the largest step: a few hidden-sized buffers per batched token plus the logits.
        m = self.config.model
        tokens = self.config.max_num_batched_tokens
        activations = tokens * (8 * m.hidden_size + 4 * m.intermediate_size) * 4 + tokens * m.vocab_size * 4
        budget = total * self.config.cache.gpu_memory_utilization - used - activations
        if budget < self.block_bytes:
            raise MemoryError("no GPU memory left for the KV cache; raise --gpu-memory-utilization")
        return int(budget // self.block_bytes)

    def prepare(self, out: SchedulerOutput) -> ModelInput:
        """Flatten the scheduled sequences into batch tensors: one host list per tensor, one copy each."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        samples: list[int] = []
        width = max((len(s.block_table) for s in out.scheduled), default=1)
        tables: list[list[int]] = []
        for s in out.scheduled:
            first, n = s.num_computed_tokens, s.num_new_tokens
            ids.extend(s.token_ids)
            positions.extend(range(first, first + n))
            table = s.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(first, first + n))
            seq_lens.append(first + n)
            starts.append(starts[-1] + n)
            tables.append(list(table) + [0] * (width - len(table)))
            if s.do_sample:
                samples.append(starts[-1] - 1)

        def tensor(data: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)

        meta = AttentionMetadata(
            slot_mapping=tensor(slots, torch.int64),
            block_tables=tensor(tables, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            query_start_loc=tensor(starts, torch.int32),
        )
        return ModelInput(
            tensor(ids, torch.int64), tensor(positions, torch.int64), meta, tensor(samples, torch.int64)
        )

    def move_blocks(self, out: SchedulerOutput) -> None:
        """Swap out, swap in, then copy-on-write: in that order, so a block swapped out is read before reuse."""
        ops.swap_blocks(self.kv_cache, self.swap_cache, list(out.blocks_to_swap_out))
        ops.swap_blocks(self.swap_cache, self.kv_cache, list(out.blocks_to_swap_in))
        if out.blocks_to_copy:
            mapping = torch.tensor(out.blocks_to_copy, dtype=torch.int64, device=self.device)
            ops.copy_blocks(self.kv_cache, mapping)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> torch.Tensor | None:
        """Perform the step's block moves and forward pass; the logits `[S, vocab]` of the sampled rows."""
        self.move_blocks(out)
        if not out.scheduled:
            return None
        inp = self.prepare(out)
        hidden = self.model(inp.input_ids, inp.positions, self.kv_cache, inp.meta)
        return self.model.compute_logits(hidden[inp.sample_rows])

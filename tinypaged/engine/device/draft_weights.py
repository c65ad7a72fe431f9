"""A draft model (speculative decoding) beside the target: loaded by the model runner before the target's KV
cache is sized, so that the draft's weights, its KV pool and its swap pool come out of the same budget as the
target's (`gpu_memory_utilization` on a GPU, `cpu_kv_cache_space` on the CPU, `swap_space` on the host).

The draft's pool holds as many tokens as the target's, as vLLM's draft does, unless `disable_by_batch_size`
bounds how many sequences can speculate: then it holds that many at max_model_len and the rest of the budget
stays the target's (`split_kv_budget`). The proposer that runs it is speculative/draft_model.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinypaged.config import EngineConfig, ModelConfig
from tinypaged.core.kv_cache_manager import cdiv
from tinypaged.model import load_model


@dataclass
class DraftWeights:
    """A draft model loaded beside the target, with what its KV pool costs: bytes a block, and the most blocks
    the sequences that may speculate can use (None: as many as the target's pool)."""

    model: torch.nn.Module
    config: ModelConfig
    weights_bytes: int
    block_bytes: int
    max_blocks: int | None

    def pool_blocks(self, target_blocks: int) -> int:
        """The draft's GPU pool beside a target pool of `target_blocks`."""
        return target_blocks if self.max_blocks is None else min(self.max_blocks, target_blocks)


def load_draft(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> DraftWeights:
    """Load config.speculative's draft (its own directory, or the target's, quantized as it asks)."""
    spec = config.speculative
    assert spec is not None and config.max_model_len is not None
    mcfg = ModelConfig.from_dir(spec.model) if spec.model is not None else config.model_config
    model = load_model(mcfg, dtype, device, config.max_model_len, None, spec.quantization, cpu_kernels=True)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    block = config.block_size * mcfg.num_layers * 2 * mcfg.num_kv_heads * mcfg.head_dim * dtype.itemsize
    max_blocks = None
    if spec.disable_by_batch_size is not None:  # no more sequences than that speculate at once
        seqs = min(config.max_num_seqs, spec.disable_by_batch_size)
        max_blocks = seqs * (cdiv(config.max_model_len, config.block_size) + 1)
    return DraftWeights(model, mcfg, weights, block, max_blocks)


def split_kv_budget(budget: int, block_bytes: int, draft: DraftWeights | None) -> int:
    """The target's blocks in `budget` bytes when the draft's pool (`draft.pool_blocks` of them) shares it:
    equal pools while the draft's cap does not bind, else the draft's capped pool and the rest the target's."""
    if draft is None:
        return max(0, budget // block_bytes)
    joint = max(0, budget // (block_bytes + draft.block_bytes))
    if draft.max_blocks is None or joint <= draft.max_blocks:
        return joint
    return max(0, (budget - draft.max_blocks * draft.block_bytes) // block_bytes)

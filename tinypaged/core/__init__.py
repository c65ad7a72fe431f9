"""Pure CPU logic, no tensors: sequences, the block pool, the KV cache manager and the scheduler."""

from tinypaged.core.block_pool import BlockPool
from tinypaged.core.kv_cache_manager import KVCacheManager
from tinypaged.core.schedule_types import PreemptionMode, ScheduledSeq, SchedulerConfig, SchedulerOutput
from tinypaged.core.scheduler import Scheduler
from tinypaged.core.sequence import Sequence, SequenceGroup, SequenceStatus

__all__ = [
    "BlockPool",
    "KVCacheManager",
    "PreemptionMode",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "Sequence",
    "SequenceGroup",
    "SequenceStatus",
]

"""Host-side engine: sequences, paged-KV block allocation with prefix caching, continuous batching."""

from mtpjax.engine.block_manager import Block, BlockManager, NoFreeBlocksError
from mtpjax.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from mtpjax.engine.sequence import Sequence, SequenceStatus

__all__ = [
    "Block",
    "BlockManager",
    "NoFreeBlocksError",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerOutput",
    "Sequence",
    "SequenceStatus",
]

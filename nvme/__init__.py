"""NVMe backing tier: copy-on-write slab files and the I/O engines that move their bytes."""

from .aio import AioEngine, BatchError
from .buffers import (
    ALIGNMENT,
    IDLE_READ_BUFFER_BYTES,
    RecycledBuffers,
    StagingPool,
    aligned_empty,
    is_aligned,
)
from .engines import (
    ENGINES,
    HANDOFF_MIN_BYTES,
    FileHandle,
    KvikioEngine,
    PosixEngine,
    cuda_and_kvikio,
    make_engine,
)
from .slabs import SlabMedium, fsync_dir, holds_data, orphan_slabs

__all__ = [
    "AioEngine",
    "BatchError",
    "ALIGNMENT",
    "ENGINES",
    "FileHandle",
    "HANDOFF_MIN_BYTES",
    "IDLE_READ_BUFFER_BYTES",
    "KvikioEngine",
    "PosixEngine",
    "RecycledBuffers",
    "SlabMedium",
    "StagingPool",
    "aligned_empty",
    "cuda_and_kvikio",
    "fsync_dir",
    "is_aligned",
    "holds_data",
    "make_engine",
    "orphan_slabs",
]

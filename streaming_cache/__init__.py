"""A content-addressed, streaming dataset cache for diffusion-model training.

The engine never imports ComfyUI. Public API:

* :class:`CacheWriter` - add entries to a cache and commit them atomically.
* :func:`open_cache` - open a cache for reading (index only); entries materialize on demand.
* :class:`DatasetHandle` - a lazy, picklable, cheap-to-copy selection of a cache's rows.
* :func:`build` - the content-addressed incremental builder (encode only what is new or changed).
* :func:`clean` - preview or remove entries no manifest references, and compact the shards.
* :class:`BatchLoader` - bucketed, seeded, resumable batches with background prefetch, pinned memory and a
  dedicated CUDA copy stream.
"""

from .errors import (
    CacheError,
    CacheFormatError,
    CacheLockedError,
    DamagedEntryError,
    StaleCacheError,
    UnsafeSkeletonError,
    UnsupportedValueError,
)
from .builder import BuildReport, Encoder, Failure, Item, Part, build, entry_key
from .clean import CleanReport, clean, preview
from .dataset import DatasetHandle, Row
from .format import FORMAT_VERSION
from .loader import BatchLoader, LoaderError
from .sampler import BucketSampler
from .reader import CacheReader, LazyEntry, TensorInfo, VerifyReport, open_cache
from .writer import CacheWriter

__version__ = "0.1.0"

__all__ = [
    "FORMAT_VERSION",
    "BatchLoader",
    "BucketSampler",
    "BuildReport",
    "CleanReport",
    "DatasetHandle",
    "Encoder",
    "Failure",
    "Item",
    "Part",
    "Row",
    "build",
    "clean",
    "entry_key",
    "preview",
    "CacheError",
    "CacheFormatError",
    "CacheLockedError",
    "CacheReader",
    "CacheWriter",
    "DamagedEntryError",
    "LazyEntry",
    "LoaderError",
    "StaleCacheError",
    "TensorInfo",
    "UnsafeSkeletonError",
    "UnsupportedValueError",
    "VerifyReport",
    "open_cache",
]

"""A content-addressed, streaming dataset cache for diffusion-model training.

The engine never imports ComfyUI. Public API:

* :class:`CacheWriter` - add entries to a cache and commit them atomically.
* :func:`open_cache` - open a cache for reading (index only); entries materialize on demand.
* :class:`DatasetHandle` - a lazy, picklable, cheap-to-copy selection of a cache's rows.
* :func:`build` - the content-addressed incremental builder (encode only what is new or changed).
* :func:`clean` - preview or remove entries no manifest references, and compact the shards.
* :class:`BatchLoader` - bucketed, seeded, resumable batches with background prefetch, pinned memory and a
  dedicated CUDA copy stream.

Layers, each importing only the ones before it: ``errors`` < ``layout`` (the files of a cache dir) < ``format``
(bytes) < ``skeleton`` (the allow-list decoder) < ``lock`` < ``manifest`` < ``writer`` / ``reader`` <
``dataset`` (the handle) < ``builder`` / ``clean`` / ``sampler`` / ``loader`` < ``cli``; then ``train/`` (the
ComfyUI-free trainer parts) and ``devtools/`` (benchmarks, crash harness, fuzzer, demo), which nothing imports.

Importing it checks the running PyTorch against the supported range (``environment.TORCH_OLDEST``): an older one
is refused with an ImportError that says what to do, before any part of the pack (ComfyUI's nodes included, which
import the engine first) could fail on a missing function mid-run.
"""

from . import environment
from .builder import BuildReport, Encoder, Item, Part, build, entry_key
from .clean import CleanReport, clean, preview
from .dataset import DatasetHandle, Row
from .errors import (
    CacheError,
    CacheFormatError,
    CacheLockedError,
    DamagedEntryError,
    StaleCacheError,
    UnsafeSkeletonError,
    UnsupportedValueError,
)
from .format import FORMAT_VERSION
from .loader import BatchLoader, LoaderError
from .manifest import Failure, Manifest
from .reader import CacheReader, LazyEntry, TensorInfo, VerifyReport, open_cache
from .sampler import BucketSampler
from .writer import CacheWriter

environment.check_torch()


def _reader_dataset(self: CacheReader, manifest: str | None = None, *, repeats: bool = True) -> DatasetHandle:
    """``reader.dataset(manifest)``: a handle on all entries or on a manifest's rows, using this reader.
    Same as :meth:`DatasetHandle.from_reader`; the reader module itself knows nothing of handles."""
    return DatasetHandle.from_reader(self, manifest, repeats=repeats)


CacheReader.dataset = _reader_dataset  # type: ignore[attr-defined]

__version__ = "0.5.0"

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
    "Manifest",
    "StaleCacheError",
    "TensorInfo",
    "UnsafeSkeletonError",
    "UnsupportedValueError",
    "VerifyReport",
    "open_cache",
]

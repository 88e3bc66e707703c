"""Exception types of the cache engine.

Every error raised for bad input or a damaged cache is a :class:`CacheError`, and its message says what was
wrong, which file or entry it concerns and what the user can do about it.
"""

from __future__ import annotations


class CacheError(Exception):
    """Base class of every error the engine raises on purpose."""


class CacheFormatError(CacheError):
    """A file of the cache is damaged, truncated, hostile or of an unknown format version."""


class UnsafeSkeletonError(CacheFormatError):
    """An entry's skeleton asks the unpickler for something outside the allow-list; nothing was executed."""


class DamagedEntryError(CacheFormatError):
    """One entry cannot be materialized; the rest of the cache is still readable."""


class UnsupportedValueError(CacheError, TypeError):
    """A value given to :meth:`CacheWriter.put` holds an object the cache cannot store."""


class CacheLockedError(CacheError):
    """Another process is writing to the cache."""


class StaleCacheError(CacheError):
    """The cache was rewritten (for example compacted) after this reader or dataset handle was made."""


class LoraFormatError(CacheError, ValueError):
    """A LoRA file cannot be read or written in the key format asked for (a key no reader knows, a module the
    model does not have, an adapter the format cannot hold)."""

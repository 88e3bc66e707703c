"""Skeletons: an entry's structure (dicts, lists, scalars, strings) with its tensors replaced by references.

This module is the security boundary of the cache. A skeleton is written with pickle (protocol 4, tensors as
persistent ids) and read back by an allow-list unpickler that can build plain containers, scalars, strings,
bytes and a few torch value types, and nothing else: reading a hostile skeleton never runs code. Before
unpickling, the opcode stream is checked (only opcodes a skeleton can contain, no memo index beyond the memo),
and values that the allow-list could not read back are refused when they are written (``collect_leaves``).
``FORMAT.md`` section 5 specifies the format.
"""

from __future__ import annotations

import collections
import io
import pickle
import pickletools
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .errors import CacheError, CacheFormatError, UnsafeSkeletonError, UnsupportedValueError
from .format import SAFETENSORS_NAME, TORCH_DTYPE

_SCALAR_TYPES = (type(None), bool, int, float, complex, str, bytes)
_TORCH_GLOBALS: dict[str, Any] = {"Size": torch.Size, "device": torch.device}
_TORCH_GLOBALS.update({attr: dt for attr, dt in ((str(dt).removeprefix("torch."), dt) for dt in TORCH_DTYPE.values())})
for _name in ("float", "double", "half", "long", "int", "short", "cfloat"):
    # Aliases (torch.float32 pickles as torch.float32, but be liberal in what is read back).
    if isinstance(getattr(torch, _name, None), torch.dtype):
        _TORCH_GLOBALS[_name] = getattr(torch, _name)
_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {("torch", k): v for k, v in _TORCH_GLOBALS.items()}
_ALLOWED_GLOBALS.update(
    {
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        ("builtins", "complex"): complex,
        ("builtins", "bytearray"): lambda *args: _bytearray(*args),
        ("collections", "OrderedDict"): collections.OrderedDict,
    }
)


def _bytearray(*args: Any) -> bytearray:
    """``bytearray`` as pickles call it (from bytes); ``bytearray(2**40)`` in a hostile skeleton would allocate."""
    if len(args) > 1 or (args and not isinstance(args[0], (bytes, bytearray))):
        raise CacheFormatError("skeleton calls bytearray with arguments a pickle never uses")
    return bytearray(*args)


# Every opcode a protocol-4 skeleton of the allow-listed types can contain (plus a few harmless stack ops).
# Anything else, e.g. BUILD, INST, OBJ, EXT*, NEWOBJ*, or protocol-0 text opcodes, is refused before unpickling.
_SKELETON_OPCODES = frozenset({
    "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP", "EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE",
    "EMPTY_SET", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "LIST", "DICT", "SETITEM", "SETITEMS", "APPEND",
    "APPENDS", "ADDITEMS", "FROZENSET", "BININT", "BININT1", "BININT2", "LONG1", "LONG4", "BINFLOAT", "NONE",
    "NEWTRUE", "NEWFALSE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "SHORT_BINBYTES", "BINBYTES",
    "BINBYTES8", "MEMOIZE", "BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET", "BINPERSID", "STACK_GLOBAL",
    "GLOBAL", "REDUCE",
})
_checked_skeletons: dict[bytes, None] = {}


def check_skeleton_opcodes(data: bytes, where: str) -> None:
    """Refuse a skeleton with an opcode outside :data:`_SKELETON_OPCODES` or a memo index beyond the memo.

    The C unpickler grows its memo table to any index a PUT names: a 5-byte ``LONG_BINPUT 1200912225`` makes
    it allocate and zero gigabytes. Checked once per distinct skeleton (skeletons repeat across entries).
    """
    if data in _checked_skeletons:
        return
    memo = 0
    try:
        for op, arg, pos in pickletools.genops(data):
            name = op.name
            if name not in _SKELETON_OPCODES:
                raise CacheFormatError(f"{where}: skeleton holds pickle opcode {name} at byte {pos}, which "
                                       "skeletons never contain; it was not loaded. Rebuild the entry")
            if name == "MEMOIZE":
                memo += 1
            elif name in ("BINPUT", "LONG_BINPUT"):
                if arg > memo:
                    raise CacheFormatError(f"{where}: skeleton stores memo slot {arg} with only {memo} in use "
                                           f"(byte {pos}); it was not loaded. Rebuild the entry")
                memo = max(memo, arg + 1)
            elif name in ("BINGET", "LONG_BINGET") and arg >= memo:
                raise CacheFormatError(f"{where}: skeleton reads memo slot {arg} of {memo} (byte {pos}); "
                                       "rebuild the entry")
    except CacheFormatError:
        raise
    except Exception as exc:  # truncated or malformed opcode stream
        raise CacheFormatError(f"{where}: skeleton is damaged ({type(exc).__name__}: {exc}); "
                               "rebuild the entry or run verify") from exc
    if len(_checked_skeletons) > 4096:
        _checked_skeletons.clear()
    _checked_skeletons[bytes(data)] = None


def _describe(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}" if t.__module__ != "builtins" else t.__qualname__


def collect_leaves(value: Any, where: str = "value") -> list[torch.Tensor | np.ndarray]:
    """Walk ``value`` and return its tensors and arrays, each once, in first-seen order.

    Raises :class:`UnsupportedValueError` naming the path of the first object the skeleton allow-list could
    not read back, so a bad value fails when it is written, not when it is read.
    """
    leaves: list[torch.Tensor | np.ndarray] = []
    seen: set[int] = set()
    active: set[int] = set()

    def walk(obj: Any, path: str, depth: int) -> None:
        if isinstance(obj, (torch.Tensor, np.ndarray)):
            if id(obj) not in seen:
                if isinstance(obj, torch.Tensor):
                    check_tensor(obj, path)
                elif obj.dtype.hasobject or obj.dtype.byteorder == ">":
                    raise UnsupportedValueError(f"{path}: numpy array of dtype {obj.dtype} cannot be cached; "
                                                "use a numeric little-endian array")
                seen.add(id(obj))
                leaves.append(obj)
            return
        kind = type(obj)
        if kind in _SCALAR_TYPES or kind is bytearray or isinstance(obj, (torch.dtype, torch.device)):
            return
        if depth > 100:
            raise UnsupportedValueError(f"{path}: value is nested more than 100 levels deep")
        if kind in (list, tuple, set, frozenset, torch.Size, dict, collections.OrderedDict):
            if id(obj) in active:
                raise UnsupportedValueError(f"{path}: the value contains itself (a reference cycle); "
                                            "a cache entry must be a tree of containers")
            active.add(id(obj))
            if kind in (dict, collections.OrderedDict):
                for k, v in obj.items():
                    if not (type(k) in _SCALAR_TYPES or type(k) is tuple):
                        raise UnsupportedValueError(
                            f"{path}: dict key {k!r} of type {_describe(k)} cannot be cached; "
                            "use str, int, float, bool, None, bytes or tuple keys")
                    walk(k, f"{path}[key {k!r}]", depth + 1)
                    walk(v, f"{path}[{k!r}]", depth + 1)
            else:
                for i, item in enumerate(obj):
                    walk(item, f"{path}[{i}]", depth + 1)
            active.discard(id(obj))
            return
        raise UnsupportedValueError(
            f"{path}: object of type {_describe(obj)} cannot be cached. A cache entry may hold dicts, lists, "
            "tuples, sets, str/int/float/bool/None/bytes, torch dtypes/devices/sizes, torch tensors and "
            "numpy arrays; drop this field or convert it before caching"
        )

    walk(value, where, 0)
    return leaves


def check_tensor(t: torch.Tensor, path: str) -> None:
    """Refuse tensors whose bytes the shard format cannot hold, with the path and a remedy."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise UnsupportedValueError(f"{path}: tensor subclass {_describe(t)} cannot be cached; "
                                    "convert it to a plain tensor first (e.g. t.as_subclass(torch.Tensor))")
    if t.layout != torch.strided:
        raise UnsupportedValueError(f"{path}: {t.layout} tensors cannot be cached; call .to_dense() first")
    if t.is_quantized or t.is_meta:
        raise UnsupportedValueError(f"{path}: quantized or meta tensors cannot be cached")
    if t.dtype not in SAFETENSORS_NAME:
        raise UnsupportedValueError(f"{path}: dtype {t.dtype} is not storable; supported: "
                                    f"{', '.join(sorted(str(d) for d in SAFETENSORS_NAME))}")


class _SkeletonPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, slots: dict[int, Any]):
        super().__init__(file, protocol=4)
        self._slots = slots

    def persistent_id(self, obj: Any) -> Any:
        slot = self._slots.get(id(obj))
        if slot is None:
            return None
        return slot


def encode_skeleton(value: Any, leaves: Sequence[torch.Tensor | np.ndarray]) -> bytes:
    """Pickle ``value`` with each leaf replaced by a persistent id: ``i`` for a tensor, ``("np", i)`` for an array."""
    slots = {id(leaf): (("np", i) if isinstance(leaf, np.ndarray) else i) for i, leaf in enumerate(leaves)}
    buf = io.BytesIO()
    _SkeletonPickler(buf, slots).dump(value)
    return buf.getvalue()


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, load_leaf: Callable[[int, bool], Any], n_leaves: int, where: str):
        super().__init__(io.BytesIO(data))
        self._load_leaf = load_leaf
        self._n_leaves = n_leaves
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        obj = _ALLOWED_GLOBALS.get((module, name))
        if obj is None:
            raise UnsafeSkeletonError(
                f"{self._where}: the skeleton asks for {module}.{name}, which is not on the allow-list; it was "
                "not loaded and nothing was executed. The cache file may be hostile or written by an "
                "incompatible program: rebuild the entry or delete the cache"
            )
        return obj

    def persistent_load(self, pid: Any) -> Any:
        if type(pid) is int:
            is_numpy, i = False, pid
        elif type(pid) is tuple and len(pid) == 2 and pid[0] == "np" and type(pid[1]) is int:
            is_numpy, i = True, pid[1]
        else:
            raise CacheFormatError(f"{self._where}: skeleton holds an invalid tensor reference {pid!r}")
        if not 0 <= i < self._n_leaves:
            raise CacheFormatError(f"{self._where}: skeleton refers to tensor {i}, but the entry has "
                                   f"{self._n_leaves}")
        return self._load_leaf(i, is_numpy)


def decode_skeleton(data: bytes, n_leaves: int, load_leaf: Callable[[int, bool], Any], where: str) -> Any:
    """Unpickle a skeleton with the allow-list; ``load_leaf(i, is_numpy)`` supplies the tensors.

    Any failure is raised as :class:`CacheFormatError` (or its :class:`UnsafeSkeletonError`) naming ``where``.
    """
    check_skeleton_opcodes(data, where)
    try:
        return _AllowListUnpickler(data, load_leaf, n_leaves, where).load()
    except CacheError:  # raised on purpose (by the allow-list or by load_leaf): already says what happened
        raise
    except RecursionError as exc:
        raise CacheFormatError(f"{where}: skeleton is nested too deeply to read") from exc
    except Exception as exc:
        raise CacheFormatError(f"{where}: skeleton is damaged ({type(exc).__name__}: {exc}); "
                               "rebuild the entry or run verify") from exc

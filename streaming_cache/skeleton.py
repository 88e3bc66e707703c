"""Skeletons: an entry's structure (dicts, lists, scalars, strings) with its tensors replaced by references.

This module is the security boundary of the cache. A skeleton is written with pickle (protocol 4, tensors as
persistent ids) and read back by an allow-list unpickler that can build plain containers, scalars, strings,
bytes and a few torch value types, and nothing else: reading a hostile skeleton never runs code. Before
unpickling, the opcode stream is checked (only opcodes a skeleton can contain, no memo index beyond the memo),
and values that the allow-list could not read back are refused when they are written (``collect_leaves``).
``docs/FORMAT.md`` section 5 specifies the format.
"""

from __future__ import annotations

import collections
import io
import pickle
import pickletools
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from .errors import CacheFormatError, UnsafeSkeletonError, UnsupportedValueError
from .format import SAFETENSORS_NAME, TORCH_DTYPE

_SCALAR_TYPES = (type(None), bool, int, float, complex, str, bytes)
_TORCH_VALUES: dict[str, Any] = {attr: dt for attr, dt in ((str(dt).removeprefix("torch."), dt)
                                                          for dt in TORCH_DTYPE.values())}
for _name in ("float", "double", "half", "long", "int", "short", "cfloat"):
    # Aliases (torch.float32 pickles as torch.float32, but be liberal in what is read back).
    if isinstance(getattr(torch, _name, None), torch.dtype):
        _TORCH_VALUES[_name] = getattr(torch, _name)
_SIZE, _DEVICE, _SET, _FROZENSET, _COMPLEX, _BYTEARRAY, _ORDERED = (object() for _ in range(7))
# What a skeleton may name. Values are returned as they are; the constructors (the markers) may only be called
# by REDUCE with the arguments a pickle of that type has, checked in ``_Decoder._reduce``.
_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {("torch", k): v for k, v in _TORCH_VALUES.items()}
_CONSTRUCTORS = {("torch", "Size"): _SIZE, ("torch", "device"): _DEVICE, ("builtins", "set"): _SET,
                 ("builtins", "frozenset"): _FROZENSET, ("builtins", "complex"): _COMPLEX,
                 ("builtins", "bytearray"): _BYTEARRAY, ("collections", "OrderedDict"): _ORDERED}
_ALLOWED_GLOBALS.update(_CONSTRUCTORS)
_CONSTRUCTOR_NAMES = {id(marker): f"{module}.{name}" for (module, name), marker in _CONSTRUCTORS.items()}

MAX_SKELETON_BYTES = 256 * 1024
"""Largest skeleton written or read. Real ComfyUI values (LATENT, CONDITIONING with its options) take well
under 4 KiB: tensors are stored in shards, only the structure and scalars are here."""
MAX_DEPTH = 64
"""Deepest nesting of containers. ComfyUI values are under 10 levels deep."""
MAX_NODES = 100_000
"""Most containers and elements a value may expand to, counting a shared sub-structure once per reference
(what code walking the value, such as collating a batch, visits)."""
MAX_DIMS = 64


def _describe(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}" if t.__module__ != "builtins" else t.__qualname__


def collect_leaves(value: Any, where: str = "value") -> list[torch.Tensor | np.ndarray]:
    """Walk ``value`` and return its tensors and arrays, each once, in first-seen order.

    Raises :class:`UnsupportedValueError` naming the path of the first object the cache could not give back
    exactly as it was given (so a bad value fails when it is written, not when it is read): types outside the
    allow-list, reference cycles, tensors as dict keys or set members, and values beyond the limits above.
    """
    leaves: list[torch.Tensor | np.ndarray] = []
    seen: set[int] = set()
    active: set[int] = set()
    nodes = [0]

    def walk(obj: Any, path: str, depth: int, hashable: bool) -> None:
        nodes[0] += 1
        if nodes[0] > MAX_NODES:
            raise UnsupportedValueError(f"{path}: the value has more than {MAX_NODES} containers and elements; "
                                        "store large numeric data as a tensor or numpy array")
        if isinstance(obj, (torch.Tensor, np.ndarray)):
            if hashable:
                raise UnsupportedValueError(f"{path}: tensors and arrays cannot be dict keys or set members")
            if id(obj) not in seen:
                if isinstance(obj, torch.Tensor):
                    check_tensor(obj, path)
                else:
                    check_array(obj, path)
                seen.add(id(obj))
                leaves.append(obj)
            return
        kind = type(obj)
        if kind in _SCALAR_TYPES or kind is bytearray or isinstance(obj, (torch.dtype, torch.device)):
            return
        if depth >= MAX_DEPTH:
            raise UnsupportedValueError(f"{path}: value is nested more than {MAX_DEPTH} levels deep")
        if kind in (list, tuple, set, frozenset, torch.Size, dict, collections.OrderedDict):
            if kind is torch.Size and len(obj) > MAX_DIMS:
                raise UnsupportedValueError(f"{path}: a torch.Size of {len(obj)} dimensions (at most {MAX_DIMS})")
            if id(obj) in active:
                raise UnsupportedValueError(f"{path}: the value contains itself (a reference cycle); "
                                            "a cache entry must be a tree of containers")
            active.add(id(obj))
            if kind in (dict, collections.OrderedDict):
                for k, v in obj.items():
                    if not (type(k) in _SCALAR_TYPES or type(k) in (tuple, frozenset)):
                        raise UnsupportedValueError(
                            f"{path}: dict key {k!r} of type {_describe(k)} cannot be cached; "
                            "use str, int, float, bool, None, bytes or tuple keys")
                    walk(k, f"{path}[key {k!r}]", depth + 1, True)
                    walk(v, f"{path}[{k!r}]", depth + 1, hashable)
            else:
                inner = hashable or kind in (set, frozenset)
                for i, item in enumerate(obj):
                    walk(item, f"{path}[{i}]", depth + 1, inner)
            active.discard(id(obj))
            return
        raise UnsupportedValueError(
            f"{path}: object of type {_describe(obj)} cannot be cached. A cache entry may hold dicts, lists, "
            "tuples, sets, str/int/float/bool/None/bytes, torch dtypes/devices/sizes, torch tensors and "
            "numpy arrays; drop this field or convert it before caching"
        )

    walk(value, where, 0, False)
    return leaves


def check_tensor(t: torch.Tensor, path: str) -> None:
    """Refuse tensors whose bytes the shard format cannot hold, with the path and a remedy."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise UnsupportedValueError(f"{path}: tensor subclass {_describe(t)} cannot be cached; "
                                    "convert it to a plain tensor first (e.g. t.as_subclass(torch.Tensor))")
    if t.is_nested:
        raise UnsupportedValueError(f"{path}: nested (ragged) tensors cannot be cached; store each part as its "
                                    "own tensor in a list")
    if t.layout != torch.strided:
        raise UnsupportedValueError(f"{path}: {t.layout} tensors cannot be cached; call .to_dense() first")
    if t.is_quantized or t.is_meta:
        raise UnsupportedValueError(f"{path}: quantized or meta tensors cannot be cached")
    if t.dtype not in SAFETENSORS_NAME:
        raise UnsupportedValueError(f"{path}: dtype {t.dtype} is not storable; supported: "
                                    f"{', '.join(sorted(str(d) for d in SAFETENSORS_NAME))}")
    if t.dim() > MAX_DIMS:
        raise UnsupportedValueError(f"{path}: a tensor of {t.dim()} dimensions (at most {MAX_DIMS})")


def check_array(a: np.ndarray, path: str) -> None:
    """Refuse numpy arrays the cache could not give back exactly: subclasses (masked arrays lose their mask,
    ``np.matrix`` its type), object, big-endian and non-numeric dtypes, dtypes the shard format cannot hold."""
    if type(a) is not np.ndarray:
        raise UnsupportedValueError(f"{path}: numpy {_describe(a)} cannot be cached exactly (a masked array would "
                                    "lose its mask, a matrix its type); store plain arrays, e.g. data and mask "
                                    "as two arrays")
    if a.dtype.hasobject or a.dtype.byteorder == ">" or a.dtype.fields is not None or a.dtype.kind not in "biufc":
        raise UnsupportedValueError(f"{path}: numpy array of dtype {a.dtype} cannot be cached; use a numeric "
                                    "little-endian array")
    try:
        dtype = torch.from_numpy(np.empty(0, dtype=a.dtype)).dtype
    except TypeError:
        dtype = None
    if dtype not in SAFETENSORS_NAME:
        raise UnsupportedValueError(f"{path}: numpy dtype {a.dtype} is not storable; supported: "
                                    f"{', '.join(sorted(str(d).removeprefix('torch.') for d in SAFETENSORS_NAME))}")
    if a.ndim > MAX_DIMS:
        raise UnsupportedValueError(f"{path}: an array of {a.ndim} dimensions (at most {MAX_DIMS})")


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


class _Leaf:
    """Where a tensor (or numpy array) goes in a decoded skeleton: the entry's ``index``-th leaf."""

    __slots__ = ("index", "numpy")

    def __init__(self, index: int, numpy: bool):
        self.index, self.numpy = index, numpy


_MUTABLE = (list, dict, collections.OrderedDict, set, bytearray)
_HASHABLE_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def _op(code: bytes) -> int:
    return code[0]


def _bounded(n: int) -> str:
    """An integer for an error message: as digits when short, else its size (a hostile integer can have more
    digits than Python converts to text)."""
    return str(n) if n.bit_length() <= 64 else f"a {n.bit_length()}-bit number"


class _Decoder:
    """A single pass over a protocol-4 pickle that can build the allow-listed values and nothing else.

    Unlike ``pickle.Unpickler`` it never calls a method of a decoded object (SETITEM only on dicts, APPEND only
    on lists, ADDITEMS only on sets), calls the allow-listed constructors only with the arguments a pickle of
    that type has, keeps its memo in a dict (an index never allocates), bounds the nesting of anything that gets
    hashed before hashing it, and then checks that the value stays within the limits: depth, containers and
    elements counted per reference (so shared sub-structures cannot expand exponentially), no cycles.
    """

    def __init__(self, data: bytes, n_leaves: int, where: str):
        self.data, self.n_leaves, self.where = data, n_leaves, where
        self.depth: dict[int, int] = {}  # nesting of immutable containers (tuples, frozensets) when built
        self.keep: list[Any] = []  # everything built stays alive, so ids in ``depth`` stay unique
        self.leaves: dict[tuple[int, bool], _Leaf] = {}

    def fail(self, why: str, pos: int) -> CacheFormatError:
        return CacheFormatError(f"{self.where}: skeleton {why} (byte {pos}); it was not loaded. Rebuild the entry "
                                "or run verify")

    def run(self) -> Any:
        data, where = self.data, self.where
        if len(data) > MAX_SKELETON_BYTES:
            raise CacheFormatError(f"{where}: skeleton of {len(data)} bytes exceeds the limit of "
                                   f"{MAX_SKELETON_BYTES}; it was not loaded. Rebuild the entry")
        stack: list[Any] = []
        marks: list[int] = []
        memo: dict[int, Any] = {}
        pos, end = 0, len(data)

        def take(n: int) -> bytes:
            nonlocal pos
            if n < 0 or pos + n > end:
                raise self.fail("is truncated", pos)
            chunk = data[pos:pos + n]
            pos += n
            return chunk

        def pop_mark() -> list[Any]:
            if not marks:
                raise self.fail("pops a mark it never set", pos)
            at = marks.pop()
            items = stack[at:]
            del stack[at:]
            return items

        def top(kind: type | tuple[type, ...], what: str) -> Any:
            if not stack or type(stack[-1]) not in (kind if isinstance(kind, tuple) else (kind,)):
                found = "missing" if not stack else "tensor" if type(stack[-1]) is _Leaf else type(stack[-1]).__name__
                raise self.fail(f"applies {what} to a {found} value", pos)
            return stack[-1]

        while True:
            if pos >= end:
                raise self.fail("ends before its STOP opcode", pos)
            op = data[pos]
            pos += 1
            if op == _op(pickle.PROTO):
                if take(1)[0] > 4:
                    raise self.fail("uses a pickle protocol above 4", pos)
            elif op == _op(pickle.FRAME):
                size = int.from_bytes(take(8), "little")
                if size > end - pos:
                    raise self.fail(f"declares a frame of {_bounded(size)} bytes, longer than what follows", pos)
            elif op == _op(pickle.STOP):
                if len(stack) != 1 or marks:
                    raise self.fail("ends with an unbalanced stack", pos)
                root = stack[0]
                self.check_value(root)
                return root
            elif op == _op(pickle.MARK):
                marks.append(len(stack))
            elif op == _op(pickle.POP):
                if not stack:
                    raise self.fail("pops an empty stack", pos)
                stack.pop()
            elif op == _op(pickle.POP_MARK):
                pop_mark()
            elif op == _op(pickle.DUP):
                if not stack:
                    raise self.fail("duplicates an empty stack", pos)
                stack.append(stack[-1])
            elif op in (_op(pickle.EMPTY_DICT), _op(pickle.EMPTY_LIST), _op(pickle.EMPTY_SET)):
                new: Any = {_op(pickle.EMPTY_DICT): dict, _op(pickle.EMPTY_LIST): list}.get(op, set)()
                self.keep.append(new)
                stack.append(new)
            elif op == _op(pickle.EMPTY_TUPLE):
                stack.append(())
            elif op in (_op(pickle.TUPLE), _op(pickle.TUPLE1), _op(pickle.TUPLE2), _op(pickle.TUPLE3)):
                n = {_op(pickle.TUPLE1): 1, _op(pickle.TUPLE2): 2, _op(pickle.TUPLE3): 3}.get(op)
                if n is None:
                    items = pop_mark()
                else:
                    if len(stack) < n:
                        raise self.fail("builds a tuple from a short stack", pos)
                    items = stack[-n:]
                    del stack[-n:]
                stack.append(self.immutable(tuple(items), pos))
            elif op == _op(pickle.LIST):
                new = pop_mark()
                self.keep.append(new)
                stack.append(new)
            elif op == _op(pickle.DICT):
                items = pop_mark()
                if len(items) % 2:
                    raise self.fail("builds a dict from an odd number of items", pos)
                new = {}
                for k, v in zip(items[::2], items[1::2]):
                    new[self.key(k, pos)] = v
                self.keep.append(new)
                stack.append(new)
            elif op == _op(pickle.SETITEM):
                if len(stack) < 3:
                    raise self.fail("sets an item from a short stack", pos)
                v = stack.pop()
                k = stack.pop()
                top((dict, collections.OrderedDict), "SETITEM")[self.key(k, pos)] = v
            elif op == _op(pickle.SETITEMS):
                items = pop_mark()
                if len(items) % 2:
                    raise self.fail("sets an odd number of items", pos)
                target = top((dict, collections.OrderedDict), "SETITEMS")
                for k, v in zip(items[::2], items[1::2]):
                    target[self.key(k, pos)] = v
            elif op == _op(pickle.APPEND):
                if len(stack) < 2:
                    raise self.fail("appends from a short stack", pos)
                v = stack.pop()
                top(list, "APPEND").append(v)
            elif op == _op(pickle.APPENDS):
                items = pop_mark()
                top(list, "APPENDS").extend(items)
            elif op == _op(pickle.ADDITEMS):
                items = pop_mark()
                target = top(set, "ADDITEMS")
                for item in items:
                    target.add(self.key(item, pos))
            elif op == _op(pickle.FROZENSET):
                stack.append(self.immutable(frozenset(self.key(x, pos) for x in pop_mark()), pos))
            elif op == _op(pickle.BININT):
                stack.append(int.from_bytes(take(4), "little", signed=True))
            elif op == _op(pickle.BININT1):
                stack.append(take(1)[0])
            elif op == _op(pickle.BININT2):
                stack.append(int.from_bytes(take(2), "little"))
            elif op == _op(pickle.LONG1):
                stack.append(int.from_bytes(take(take(1)[0]), "little", signed=True))
            elif op == _op(pickle.LONG4):
                stack.append(int.from_bytes(take(int.from_bytes(take(4), "little", signed=True)), "little",
                                            signed=True))
            elif op == _op(pickle.BINFLOAT):
                stack.append(struct.unpack(">d", take(8))[0])
            elif op == _op(pickle.NONE):
                stack.append(None)
            elif op == _op(pickle.NEWTRUE):
                stack.append(True)
            elif op == _op(pickle.NEWFALSE):
                stack.append(False)
            elif op in _STRINGS:
                size_bytes, is_text = _STRINGS[op]
                raw = take(int.from_bytes(take(size_bytes), "little"))
                if is_text:
                    try:
                        stack.append(raw.decode("utf-8", "surrogatepass"))
                    except UnicodeDecodeError:
                        raise self.fail("holds a string that is not UTF-8", pos) from None
                else:
                    stack.append(raw)
            elif op == _op(pickle.MEMOIZE):
                if not stack:
                    raise self.fail("memoizes an empty stack", pos)
                memo[len(memo)] = stack[-1]
            elif op in (_op(pickle.BINPUT), _op(pickle.LONG_BINPUT)):
                index = int.from_bytes(take(1 if op == _op(pickle.BINPUT) else 4), "little")
                if index > len(memo) or not stack:
                    raise self.fail(f"stores memo slot {index} with only {len(memo)} in use", pos)
                memo[index] = stack[-1]
            elif op in (_op(pickle.BINGET), _op(pickle.LONG_BINGET)):
                index = int.from_bytes(take(1 if op == _op(pickle.BINGET) else 4), "little")
                if index not in memo:
                    raise self.fail(f"reads memo slot {index} of {len(memo)}", pos)
                stack.append(memo[index])
            elif op == _op(pickle.BINPERSID):
                if not stack:
                    raise self.fail("references a tensor from an empty stack", pos)
                stack.append(self.leaf(stack.pop(), pos))
            elif op == _op(pickle.GLOBAL):
                module = self.line(data, pos)
                pos += len(module) + 1
                name = self.line(data, pos)
                pos += len(name) + 1
                stack.append(self.find_global(module.decode("utf-8", "replace"), name.decode("utf-8", "replace")))
            elif op == _op(pickle.STACK_GLOBAL):
                if len(stack) < 2 or type(stack[-1]) is not str or type(stack[-2]) is not str:
                    raise self.fail("names a global with something other than two strings", pos)
                name, module = stack.pop(), stack.pop()
                stack.append(self.find_global(module, name))
            elif op == _op(pickle.REDUCE):
                if len(stack) < 2:
                    raise self.fail("calls from a short stack", pos)
                args = stack.pop()
                func = stack.pop()
                stack.append(self.reduce(func, args, pos))
            else:
                info = pickletools.code2op.get(chr(op))  # type: ignore[attr-defined]  # not in the stubs
                opname = info.name if info is not None else f"0x{op:02x}"
                raise self.fail(f"holds pickle opcode {opname}, which skeletons never contain", pos - 1)

    def line(self, data: bytes, pos: int) -> bytes:
        nl = data.find(b"\n", pos, pos + 256)
        if nl < 0:
            raise self.fail("names a global without a line end", pos)
        return data[pos:nl]

    def find_global(self, module: str, name: str) -> Any:
        obj = _ALLOWED_GLOBALS.get((module, name))
        if obj is None:
            raise UnsafeSkeletonError(
                f"{self.where}: the skeleton asks for {module}.{name}, which is not on the allow-list; it was not "
                "loaded and nothing was executed. The cache file may be hostile or written by an incompatible "
                "program: rebuild the entry or delete the cache")
        return obj

    def leaf(self, pid: Any, pos: int) -> _Leaf:
        if type(pid) is int:
            key = (pid, False)
        elif type(pid) is tuple and len(pid) == 2 and pid[0] == "np" and type(pid[1]) is int:
            key = (pid[1], True)
        else:
            raise self.fail(f"holds an invalid tensor reference (a {type(pid).__name__})", pos)
        if not 0 <= key[0] < self.n_leaves:
            raise self.fail(f"refers to tensor {_bounded(key[0])}, but the entry has {self.n_leaves}", pos)
        found = self.leaves.get(key)
        if found is None:
            found = self.leaves[key] = _Leaf(*key)
        return found

    def key(self, obj: Any, pos: int) -> Any:
        """``obj`` if it may be hashed safely (a dict key or set member): scalars, and tuples and frozensets
        whose nesting was bounded when they were built."""
        kind = type(obj)
        if kind in (tuple, frozenset) or isinstance(obj, _HASHABLE_SCALARS):
            return obj
        raise self.fail(f"uses a {kind.__name__} as a dict key or set member", pos)

    def immutable(self, obj: tuple | frozenset, pos: int) -> Any:
        """Record the nesting of a new tuple or frozenset (its items are final), refusing one too deep to hash."""
        depth = 1 + max((self.depth.get(id(x), 0) for x in obj), default=0)
        if depth > MAX_DEPTH:
            raise self.fail(f"nests tuples more than {MAX_DEPTH} levels deep", pos)
        if obj:
            self.keep.append(obj)
            self.depth[id(obj)] = depth
        return obj

    def reduce(self, func: Any, args: Any, pos: int) -> Any:
        """The allow-listed constructors, with exactly the arguments a pickle of their type has."""
        if type(args) is not tuple:
            raise self.fail("calls a constructor without an argument tuple", pos)
        sequence = len(args) == 1 and type(args[0]) in (list, tuple)
        if func is _SIZE and sequence and len(args[0]) <= MAX_DIMS and \
                all(type(d) is int and 0 <= d < 2**63 for d in args[0]):
            return torch.Size(args[0])
        if func is _DEVICE and 1 <= len(args) <= 2 and type(args[0]) is str and len(args[0]) < 64 and \
                (len(args) == 1 or type(args[1]) is int):
            try:
                return torch.device(*args)
            except (RuntimeError, ValueError) as exc:
                raise self.fail(f"names an invalid device ({exc})", pos) from None
        if func in (_SET, _FROZENSET) and (not args or sequence):
            items = [self.key(x, pos) for x in (args[0] if args else ())]
            return set(items) if func is _SET else self.immutable(frozenset(items), pos)
        if func is _COMPLEX and 1 <= len(args) <= 2 and all(type(x) in (int, float) for x in args):
            try:
                return complex(*args)
            except OverflowError:
                raise self.fail("holds a complex number out of range", pos) from None
        if func is _BYTEARRAY and (not args or (len(args) == 1 and type(args[0]) is bytes)):
            return bytearray(*args)
        if func is _ORDERED and (not args or (sequence and all(type(p) in (list, tuple) and len(p) == 2
                                                               for p in args[0]))):
            out = collections.OrderedDict((self.key(k, pos), v) for k, v in (args[0] if args else ()))
            self.keep.append(out)
            return out
        name = _CONSTRUCTOR_NAMES.get(id(func)) or _describe(func)
        raise self.fail(f"calls {name} with arguments a pickle of it never has", pos)

    def check_value(self, root: Any) -> None:
        """Depth, size counted per reference, and no cycles, in one pass over the distinct containers."""
        done: dict[int, tuple[int, int]] = {}  # id -> (depth, expanded size)
        active: set[int] = set()
        work: list[tuple[Any, bool]] = [(root, False)]
        while work:
            obj, expanded = work.pop()
            key = id(obj)
            if not expanded:
                if key in done or not _is_container(obj):
                    continue
                if key in active:
                    raise self.fail("contains itself (a reference cycle)", len(self.data))
                active.add(key)
                work.append((obj, True))
                work.extend((child, False) for child in _children(obj))
                continue
            depth, size = 1, 1
            for child in _children(obj):
                d, n = done.get(id(child), (0, 1)) if _is_container(child) else (0, 1)
                depth, size = max(depth, d + 1), size + n
            if depth > MAX_DEPTH:
                raise self.fail(f"is nested more than {MAX_DEPTH} levels deep", len(self.data))
            if size > MAX_NODES:
                raise self.fail(f"expands to more than {MAX_NODES} containers and elements", len(self.data))
            active.discard(key)
            done[key] = (depth, size)


_STRINGS: dict[int, tuple[int, bool]] = {
    _op(pickle.SHORT_BINUNICODE): (1, True), _op(pickle.BINUNICODE): (4, True), _op(pickle.BINUNICODE8): (8, True),
    _op(pickle.SHORT_BINBYTES): (1, False), _op(pickle.BINBYTES): (4, False), _op(pickle.BINBYTES8): (8, False),
}


def _is_container(obj: Any) -> bool:
    return type(obj) in (list, tuple, dict, collections.OrderedDict, set, frozenset)


def _children(obj: Any) -> Iterator[Any]:
    if type(obj) in (dict, collections.OrderedDict):
        for k, v in obj.items():
            yield k
            yield v
    else:
        yield from obj


Builder = Callable[[Callable[[int, bool], Any], dict], Any]


def _compile(root: Any) -> Builder:
    """A function that builds a fresh value from a decoded skeleton: new mutable containers (callers may change
    them), tensors from ``load``, immutable parts shared. A sub-structure the skeleton shares is built once per
    value and shared again. Compiled once per distinct skeleton, so building costs about what unpickling did."""
    refs: dict[int, int] = {}
    work = [root]
    while work:  # how often each container is referenced
        obj = work.pop()
        if _is_container(obj) or type(obj) is bytearray:
            refs[id(obj)] = refs.get(id(obj), 0) + 1
            if refs[id(obj)] == 1 and type(obj) is not bytearray:
                work.extend(_children(obj))
    compiled: dict[int, tuple[bool, Any]] = {}

    def constant(value: Any) -> tuple[bool, Any]:
        return (False, value)

    def part(node: Any) -> tuple[bool, Any]:
        """(dynamic, builder or constant value) for ``node``."""
        kind = type(node)
        if kind is _Leaf:
            index, numpy = node.index, node.numpy
            return (True, lambda load, memo: load(index, numpy))
        if kind not in _MUTABLE and kind is not tuple:
            return constant(node)
        done = compiled.get(id(node))
        if done is not None:
            return done
        if kind is list:
            parts = [part(x) for x in node]
            fn: Builder = lambda load, memo: [b(load, memo) if dyn else b for dyn, b in parts]
        elif kind is dict:
            items = [(k, *part(v)) for k, v in node.items()]
            fn = lambda load, memo: {k: b(load, memo) if dyn else b for k, dyn, b in items}
        elif kind is collections.OrderedDict:
            items = [(k, *part(v)) for k, v in node.items()]
            fn = lambda load, memo: kind((k, b(load, memo) if dyn else b) for k, dyn, b in items)
        elif kind is tuple:
            parts = [part(x) for x in node]
            if not any(dyn for dyn, _ in parts):
                return constant(node)
            fn = lambda load, memo: tuple([b(load, memo) if dyn else b for dyn, b in parts])
        else:  # set, bytearray: hold no tensors
            fn = lambda load, memo: kind(node)
        if refs.get(id(node), 0) > 1:
            key, inner = id(node), fn

            def fn(load: Any, memo: dict) -> Any:
                out = memo.get(key)
                if out is None:
                    out = memo[key] = inner(load, memo)
                return out
        compiled[id(node)] = (True, fn)
        return compiled[id(node)]

    dyn, b = part(root)
    return b if dyn else (lambda load, memo: root)


class _Templates:
    """Decoded skeletons by their bytes (skeletons repeat across entries: one decode serves them all), and the
    errors of those that failed; bounded by the bytes of the skeletons held, least recently used dropped."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.bytes = max_bytes, 0
        self.items: collections.OrderedDict[tuple[bytes, int], tuple[Any, str | None]] = collections.OrderedDict()
        self.lock = threading.Lock()

    def get(self, data: bytes, n_leaves: int, where: str) -> Any:
        key = (data, n_leaves)
        with self.lock:
            hit = self.items.get(key)
            if hit is not None:
                self.items.move_to_end(key)
        if hit is None:
            try:
                hit = (_compile(_Decoder(data, n_leaves, where).run()), None)
            except UnsafeSkeletonError:
                raise
            except CacheFormatError as exc:
                hit = (None, str(exc).removeprefix(where + ": "))
            with self.lock:
                if key not in self.items:
                    self.items[key] = hit
                    self.bytes += len(data)
                    while self.bytes > self.max_bytes and len(self.items) > 1:
                        (old, _), _ = self.items.popitem(last=False)
                        self.bytes -= len(old)
        template, error = hit
        if error is not None:
            raise CacheFormatError(f"{where}: {error}")
        return template


_templates = _Templates(32 * 1024 * 1024)


def decode_skeleton(data: bytes, n_leaves: int, load_leaf: Callable[[int, bool], Any], where: str) -> Any:
    """The value a skeleton describes; ``load_leaf(i, is_numpy)`` supplies the tensors.

    Any problem is raised as :class:`CacheFormatError` (or its :class:`UnsafeSkeletonError`) naming ``where``.
    Decoding happens once per distinct skeleton; each call then builds a fresh value from it.
    """
    return compile_skeleton(data, n_leaves, where)(load_leaf, {})


def compile_skeleton(data: bytes, n_leaves: int, where: str) -> Builder:
    """The function that builds the value a skeleton describes: ``build(load_leaf, {})`` is
    :func:`decode_skeleton` without looking the skeleton up again, for a caller that reads many entries of one
    skeleton and keeps the builder. Problems are raised as :func:`decode_skeleton` raises them."""
    return _templates.get(data, n_leaves, where)

"""Gradient checkpointing whose recomputation makes the same choices as the forward pass.

A checkpointed block runs twice: in the forward pass, and again in the backward pass to rebuild the activations
it did not keep. PyTorch checks that the second run saves tensors of the same shapes and dtypes as the first
(non-reentrant checkpointing raises "Recomputed values for the following tensors have different metadata than
during the forward pass" otherwise). Model code that decides how to compute from the state of the machine breaks
that: ComfyUI's sub-quadratic and split attention pick their chunk sizes from the free memory read at the call,
and memory is not the same in the backward pass as in the forward pass (ComfyUI issue 15845).

:class:`Replay` makes such readings part of the block's inputs: during the forward pass the functions it wraps
(``get_free_memory``) are called and their results recorded, one tape per block call; the recomputation is given
the same results in the same order instead of reading the machine again. The tapes live as long as the
checkpoint's saved state (they are released with it), and a thread that runs no checkpointed block sees the
plain functions.

:func:`settle_attention_dispatch` removes the other known cause on CUDA: PyTorch picks its attention kernel
order lazily, at the first attention call of the process, and that first call may then run another kernel (cuDNN
instead of flash attention on Hopper) than every later call in the same context, so the first block's
recomputation of the first training in a process ran a kernel that saves other tensors.

:func:`checkpoint_module` keeps model code that updates tensors in place after saving them correct by layering its
own saved-tensor hooks over the checkpoint's, which needs PyTorch's reader of the hooks in force
(``torch._C._autograd._top_saved_tensors_default_hooks``, PyTorch 2.8 and newer). On an older PyTorch a block
that does so is found by one probing run and is not recomputed (:func:`checkpoint_module` says what it costs).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.utils.checkpoint

from .. import environment
from ..fallbacks import Fallbacks
from .forwards import replaced_forwards
from .inplace import InPlaceUpdate, InputUpdatedLater

T = TypeVar("T")
Path = tuple[Any, ...]  # where a tensor is among a block's arguments: its position or keyword, then list indices
Origin = tuple[torch.Tensor, int, torch.Tensor]  # an input's copy, the copy's version when made, the input
log = logging.getLogger(__name__)

HOOK_READER = "_top_saved_tensors_default_hooks"  # in torch._C._autograd
HOOK_READER_SINCE = "2.8"  # the first PyTorch release that has it
IN_PLACE_RECOMPUTATION = "recomputation of blocks that update tensors in place"  # a feature for Fallbacks
LEARNT_COPIES = "learnt copies of recomputed blocks' inputs"  # a feature for Fallbacks


class _Tape:
    """The results of the wrapped functions in one forward run of a block, replayed in order."""

    __slots__ = ("values", "position", "updated", "copies", "versions", "origins")

    def __init__(self) -> None:
        self.values: list[Any] = []
        self.position = 0
        self.updated: frozenset[int] = frozenset()  # saves (by order) the block then updated in place
        self.copies: frozenset[Path] | None = None  # inputs the recomputation copies (:class:`_OwnInputs`); None: all
        self.versions: dict[Path, int] = {}  # the versions of the inputs the forward run did not copy, at its start
        self.origins: dict[int, Origin] = {}  # during the recomputation, the copies of its inputs (by storage)


class Replay:
    """Functions whose results a checkpointed block's recomputation takes from its forward pass.

    ``targets`` are ``(owner, attribute)`` pairs: a module or object and the name of a function on it, looked up
    at each call by the code that uses it (``comfy.model_management.get_free_memory``). :meth:`installed` wraps
    them for the duration of a training run; :meth:`checkpoint` is ``torch.utils.checkpoint.checkpoint`` with the
    recording and replaying contexts. A recomputation that asks more often than its forward pass did (it never
    should) reads the machine for the extra calls. ``preserve_rng_state``: as for ``checkpoint`` (off where the
    step is recorded as a CUDA graph, which cannot read the CUDA random state; the models' blocks draw nothing
    random while training). ``fallbacks``: the run's record, where blocks that are not recomputed for want of
    PyTorch's hook reader are noted (:attr:`notice` says the same)."""

    def __init__(self, targets: list[tuple[Any, str]], preserve_rng_state: bool = True,
                 fallbacks: Fallbacks | None = None):
        self.targets = targets
        self.preserve_rng_state = preserve_rng_state
        self.fallbacks = fallbacks if fallbacks is not None else Fallbacks()  # which logs what it is told
        self._local = threading.local()
        self.replayed = 0  # results given to recomputations (for tests and diagnostics)
        self.kept: list[str] = []  # class names of the blocks that run without recomputation (see notice)
        self.copy_all = False  # every input of every block copied at every call, for the rest of the run

    def copy_everything(self, block: str) -> None:
        """Switch the learnt copies off for the rest of the run (:class:`InputUpdatedLater`): from now on every
        checkpointed block runs on copies of every input it might update, as with
        ``$STREAMING_CACHE_RECOMPUTE_COPIES=all``; noted in :attr:`fallbacks` (and logged) once."""
        self.copy_all = True
        reason = (f"a recomputed block ({block}) updated an input at a later call that its first call left alone; "
                  "every input of a recomputed block is copied from now on, and the micro-step runs again")
        self.fallbacks.note(LEARNT_COPIES, reason)

    def keep(self, block: torch.nn.Module) -> None:
        """Note that ``block`` updates tensors in place after saving them and, for want of PyTorch's hook reader,
        runs without recomputation; the first one of a run is noted in :attr:`fallbacks` (and logged) once."""
        self.kept.append(type(block).__name__)
        if len(self.kept) > 1:
            return
        reason = (f"PyTorch {torch.__version__} has no torch._C._autograd.{HOOK_READER} (PyTorch "
                  f"{HOOK_READER_SINCE} and newer), without which a block that updates a tensor in place between its "
                  "saves would be recomputed from other values than its forward pass saw: such blocks "
                  f"({type(block).__name__}) keep their activations instead (more GPU memory, the same LoRA); update "
                  f"PyTorch to {HOOK_READER_SINCE} or newer to recompute them")
        self.fallbacks.note(IN_PLACE_RECOMPUTATION, reason)

    @property
    def notice(self) -> str | None:
        """One line for the run's summary where some blocks run without recomputation for want of PyTorch's hook
        reader (:meth:`keep`), else None."""
        if not self.kept:
            return None
        names = ", ".join(sorted(set(self.kept)))
        return (f"{len(self.kept)} checkpointed block(s) ({names}) update tensors in place and ran without "
                f"recomputation, keeping their activations: PyTorch {torch.__version__} cannot recompute them "
                f"correctly (PyTorch {HOOK_READER_SINCE} and newer can)")

    def _state(self) -> list[tuple[str, _Tape]]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def current(self) -> tuple[str, _Tape] | None:
        """(``"record"`` or ``"replay"``, the tape) of the checkpointed block this thread runs now, or None."""
        stack = self._state()
        return stack[-1] if stack else None

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            stack = self._state()
            if not stack:
                return original(*args, **kwargs)
            mode, tape = stack[-1]
            if mode == "replay" and tape.position < len(tape.values):
                value = tape.values[tape.position]
                tape.position += 1
                self.replayed += 1
                return value
            value = original(*args, **kwargs)
            if mode == "record":
                tape.values.append(value)
            return value

        wrapped.__wrapped__ = original  # type: ignore[attr-defined]
        return wrapped

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """The targets wrapped while the block runs, restored afterwards (also on errors)."""
        saved = [(owner, name, getattr(owner, name)) for owner, name in self.targets]
        for owner, name, original in saved:
            setattr(owner, name, self._wrap(original))
        try:
            yield
        finally:
            for owner, name, original in saved:
                setattr(owner, name, original)

    @contextlib.contextmanager
    def _active(self, mode: str, tape: _Tape) -> Iterator[None]:
        stack = self._state()
        if mode == "replay":
            tape.position = 0
        stack.append((mode, tape))
        try:
            yield
        finally:
            stack.pop()

    def contexts(self) -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
        """The ``context_fn`` of ``torch.utils.checkpoint.checkpoint``: the forward run records, the recomputation
        replays, both on one tape made for this block call."""
        tape = _Tape()
        return self._active("record", tape), self._active("replay", tape)

    def checkpoint(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``function(*args, **kwargs)`` under non-reentrant gradient checkpointing, its recomputation replaying
        the forward pass's readings."""
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=self.contexts,
                                                 preserve_rng_state=self.preserve_rng_state, **kwargs)


def _updatable(t: Any) -> bool:
    """Whether ``t`` is a tensor a block might update in place and then save or return: one autograd tracks, or any
    floating-point tensor. An input autograd does not track (the first block's, when the layers before it train
    nothing) becomes tracked by the block's own in-place update with a tracked operand, so a recomputation run on
    it would save other tensors than the forward pass did."""
    return isinstance(t, torch.Tensor) and (t.requires_grad or t.is_floating_point())


def _placed(value: Any, path: Path, place: Callable[[Path, torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with each tensor in it a block might update (:func:`_updatable`; also in lists and tuples) replaced
    by ``place(its path, it)``."""
    if isinstance(value, torch.Tensor):
        return place(path, value) if _updatable(value) else value
    if isinstance(value, (list, tuple)):
        return type(value)(_placed(v, (*path, i), place) for i, v in enumerate(value))
    return value


def _storages(value: Any, found: set[int]) -> set[int]:
    """``found`` with the storages (by address) of the tensors in ``value`` (a block's result: also in lists, tuples
    and dict values); a storage at address 0 (meta tensors, empty ones) holds no values and is left out."""
    if isinstance(value, torch.Tensor):
        address = value.untyped_storage().data_ptr()
        if address:
            found.add(address)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _storages(v, found)
    elif isinstance(value, dict):
        for v in value.values():
            _storages(v, found)
    return found


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _each(args: tuple, kwargs: dict, place: Callable[[Path, torch.Tensor], torch.Tensor]) -> tuple[tuple, dict]:
    """A block's arguments with each tensor in them it might update replaced by ``place(its path, it)``."""
    return _placed(args, (), place), {k: _placed(v, (k,), place) for k, v in kwargs.items()}


def _copy(path: Path, t: torch.Tensor) -> torch.Tensor:
    return t.clone()


UNSTABLE_MESSAGE = ("a recomputed block ({name}) updated or returned an input in place at this call that it left alone "
                    "at its first call, and was not given a copy of it: its recomputation would run on other values "
                    f"than its forward run did. Start ComfyUI with {environment.RECOMPUTE_COPIES_ENV}=all "
                    "(every input of a recomputed block copied) and queue the run again: it resumes from its last save")
CHANGED_MESSAGE = ("an input of a recomputed block ({name}) was updated in place between its forward run and its "
                   "recomputation, which would run on other values than its forward run did")


class _OwnInputs:
    """Which inputs of one checkpointed block it runs on copies of its own (:func:`checkpoint_module`).

    A recomputation runs on the block's inputs as they are at the backward pass. A block that updates an input in
    place (ComfyUI's Flux: ``img += ...``), or returns it for later code to update, must run on a copy of it, or
    its recomputation would start from other values than its forward run did. At the first call with gradients on
    for a given layout of arguments, every input the block might update (:func:`_updatable`) is copied, and the
    copies it then updated in place or returned (read from their version counters and storages) are noted: later
    calls copy those only, and hand the others to the block as they are (a tracked one as an alias of itself: a
    view, which launches nothing and keeps autograd's graph, and so the order in which gradients are summed, as it
    was with a copy). A recomputation copies the inputs its forward run copied, and runs on the others themselves,
    which the forward run left alone: a copy can be laid out otherwise than its original (a slice's copy is
    contiguous), and PyTorch picks its kernels, and with them the order in which a block's tensors are saved, by
    layout (``F.linear`` on a slice of LTX-2's caption), so a recomputation on the original of a copy the forward
    run used would save other tensors than the forward run did.

    The copies are learnt by default; ``$STREAMING_CACHE_RECOMPUTE_COPIES=all`` copies every input at every call
    (:func:`environment.recompute_copies_all`). A later call that updates or returns an input it left alone at its
    first call raises :class:`InputUpdatedLater` (the caller's tensor has changed, and the recomputation would be
    silently wrong) after switching the learnt copies off for the run, and the training loop runs that micro-step
    again; a recomputation whose input something updated in place after the forward run fails loudly (a copy made
    then would not undo it either). Inference tensors are always copied (autograd cannot save them). Without
    gradients, or outside a checkpoint's runs, every input the block might update is copied.

    On ComfyUI's Flux this halves the copies: its blocks update ``img`` and ``txt`` (``x``) and leave ``vec`` and
    ``pe`` alone."""

    def __init__(self, name: str, replay: Replay | None = None) -> None:
        self.name, self.replay = name, replay
        self.needed: dict[tuple[Path, ...], frozenset[Path]] = {}  # by layout: the inputs a first call updated

    def placed(self, args: tuple, kwargs: dict, mode: str, tape: _Tape | None) -> tuple[tuple, dict, Callable]:
        """``args`` and ``kwargs`` with the inputs the block runs on copies of copied, and the function to call with
        the block's result (after a forward run it notes on ``tape`` what the recomputation copies)."""
        if mode == "replay" and tape is not None and tape.copies is not None:
            copies, before = tape.copies, tape.versions

            def again(path: Path, t: torch.Tensor) -> torch.Tensor:
                if path in before and t._version != before[path]:
                    raise RuntimeError(CHANGED_MESSAGE.format(name=self.name))
                if t.is_inference():  # autograd cannot save an inference tensor
                    return t.clone()
                if path in copies:
                    copy = t.clone()
                    if _storage(copy):  # not on meta (the memory estimate), where every address is 0
                        tape.origins[_storage(copy)] = (copy, copy._version, t)
                    return copy
                return t

            return (*_each(args, kwargs, again), _nothing)
        if mode != "record" or tape is None or (self.replay is not None and self.replay.copy_all) or \
                environment.recompute_copies_all():
            return (*_each(args, kwargs, _copy), _nothing)
        layout: list[Path] = []

        def note(path: Path, t: torch.Tensor) -> torch.Tensor:
            layout.append(path)
            return t

        _each(args, kwargs, note)
        key = tuple(layout)
        needed = self.needed.get(key)  # None: the first call with this layout, which copies every such input
        made: dict[Path, tuple[torch.Tensor, int]] = {}
        kept: dict[Path, torch.Tensor] = {}
        versions: dict[Path, int] = {}

        def first(path: Path, t: torch.Tensor) -> torch.Tensor:
            if t.is_inference():
                return t.clone()
            versions[path] = t._version
            if needed is None or path in needed:
                copy = t.clone()
                made[path] = (copy, copy._version)
                return copy
            kept[path] = t
            return t[...] if t.requires_grad else t  # an alias: no copy, the graph's shape kept

        args, kwargs = _each(args, kwargs, first)

        def settle(out: Any) -> None:
            returned = _storages(out, set())
            updated = frozenset(path for path, (copy, version) in made.items()
                                if copy._version != version or _storage(copy) in returned)
            if needed is None:
                self.needed[key] = updated
            elif any(t._version != versions[path] or _storage(t) in returned for path, t in kept.items()):
                self.needed[key] = frozenset(layout)  # every input copied from now on; this call cannot be recomputed
                if self.replay is not None:
                    self.replay.copy_everything(self.name)
                raise InputUpdatedLater(UNSTABLE_MESSAGE.format(name=self.name))
            tape.copies, tape.versions = frozenset(made), versions

        return args, kwargs, settle


def _nothing(out: Any) -> None:
    return None


def _tracked(values: Iterable[Any]) -> list[torch.Tensor]:
    """The tensors among ``values`` (one level into lists and tuples) a block might update (:func:`_updatable`)."""
    return [t for v in values for t in (v if isinstance(v, (list, tuple)) else (v,)) if _updatable(t)]


INPLACE_MESSAGE = ("one of the variables needed for gradient computation has been modified by an inplace operation "
                   "after a block that is not recomputed saved it")


class _SavedInputs:
    """Saved-tensor hooks for a block that is not recomputed and may update its inputs in place: a tensor in the
    storage of one of the block's inputs is saved as a private copy of its value at that moment (one copy per
    value). Other tensors are saved as they are and their versions checked when the backward pass reads them, as
    autograd checks them without hooks (hooks turn that check off), so any other in-place update still fails
    loudly. ``copy``: saves (by their order in the block's run) copied too, wherever they are: those a probing run
    of the block saw it update (:func:`checkpoint_module`); a run that saves in another order fails loudly."""

    def __init__(self, inputs: list[torch.Tensor], copy: frozenset[int] = frozenset()):
        self.storages = {t.untyped_storage().data_ptr() for t in inputs}
        self.copy = copy
        self.count = 0
        self.copies: dict[tuple, torch.Tensor] = {}

    def pack(self, t: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        index, self.count = self.count, self.count + 1
        if index not in self.copy and t.untyped_storage().data_ptr() not in self.storages:
            return t.detach(), t._version
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t._version)
        if key not in self.copies:
            self.copies[key] = t.detach().clone()
        return self.copies[key], None

    @staticmethod
    def unpack(packed: tuple[torch.Tensor, int | None]) -> torch.Tensor:
        value, version = packed
        if version is not None and value._version != version:
            raise InPlaceUpdate(INPLACE_MESSAGE)
        return value

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def has_hook_reader() -> bool:
    """Whether this PyTorch tells which saved-tensor hooks are in force (``torch._C._autograd.`` + ``HOOK_READER``,
    PyTorch 2.8 and newer), which :func:`checkpoint_module` needs to recompute blocks that update tensors in place
    after saving them. Read at each call (a test removes it)."""
    return getattr(torch._C._autograd, HOOK_READER, None) is not None


def _top_hooks() -> tuple[Callable, Callable] | None:
    """The saved-tensor hooks in force (a checkpoint's), where this PyTorch tells."""
    top = getattr(torch._C._autograd, HOOK_READER, None)
    return top(False) if top is not None else None


class _SaveWatch:
    """Hooks over a checkpoint's own, for one run of a block: in the forward pass they note which of the tensors
    the block saves it then updates in place (by their order, which the recomputation repeats: the checkpoint
    pairs saves by it); in the recomputation they save a copy of those instead, taken before the update. To read
    the versions at the end of the block, the forward pass holds what the block saved until then (often views made
    inside an operation), as its recomputation in the backward pass holds it anyway.

    ``origins``: the recomputation's copies of its inputs (:class:`_OwnInputs`). A save of such a copy (or a view
    of it) that the block has not updated yet holds the input's own values, which the block leaves alone: the
    same view of the input is saved instead of another copy (ComfyUI's Flux: ``img`` as its first norm saves it,
    before ``img += ...``), where the copy has the input's layout. Copies are told by their storage's address, so
    on the ``meta`` device (the memory estimate), where every address is 0, every such save is a copy."""

    def __init__(self, inner: tuple[Callable, Callable], copy: frozenset[int] = frozenset(),
                 origins: dict[int, Origin] | None = None):
        self.inner, self.copy = inner, copy
        self.origins = origins or {}
        self.seen: list[tuple[torch.Tensor, int]] = []
        self.count = 0

    def _original(self, t: torch.Tensor) -> torch.Tensor | None:
        """The view of a block's input that holds the values of ``t``, where ``t`` is (a view of) the recomputation's
        copy of that input, not updated since it was made; else None."""
        address = _storage(t)
        found = self.origins.get(address) if address else None  # 0: meta tensors, empty ones
        if found is None:
            return None
        copy, version, original = found
        if t._version != version or t.dtype != copy.dtype or copy.stride() != original.stride() or \
                copy.shape != original.shape:
            return None
        offset = original.storage_offset() + t.storage_offset() - copy.storage_offset()
        return original.detach().as_strided(t.shape, t.stride(), offset)

    def pack(self, t: torch.Tensor) -> Any:
        index, self.count = self.count, self.count + 1
        if index in self.copy:
            original = self._original(t) if self.origins else None
            t = original if original is not None else t.detach().clone()
        elif not self.copy:
            self.seen.append((t.detach(), t._version))
        return self.inner[0](t)

    def unpack(self, packed: Any) -> torch.Tensor:
        return self.inner[1](packed)

    def updated(self) -> frozenset[int]:
        found = frozenset(i for i, (t, version) in enumerate(self.seen) if t._version != version)
        self.seen.clear()
        return found

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def _copied(value: Any) -> Any:
    """``value`` with each tensor in it (also in lists and tuples) replaced by a copy (linked to it in autograd)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    return value


Finding = tuple[frozenset[int], frozenset[int]]  # a probe's: saves updated before the last save, and by the end


class _Probe:
    """Saved-tensor hooks of a probing run (:func:`_probe`): they note each tensor the block saves and its version,
    and which saves were updated in place before the block saved its last tensor. Nothing is kept for a backward
    pass (the run's graph is never differentiated); the saves are held to the end of the run to read their
    versions, as a recomputation holds them."""

    def __init__(self) -> None:
        self.seen: list[tuple[torch.Tensor, int]] = []
        self.early: set[int] = set()

    def pack(self, t: torch.Tensor) -> None:
        self.early.update(i for i, (s, version) in enumerate(self.seen)
                          if i not in self.early and s._version != version)
        self.seen.append((t.detach(), t._version))
        return None

    @staticmethod
    def unpack(packed: None) -> torch.Tensor:
        raise RuntimeError("the graph of a probing run is never differentiated")

    def finding(self) -> Finding | None:
        """(saves updated before the last save, saves updated by the end of the run), by their order; None where
        the run saved nothing."""
        if not self.seen:
            return None
        late = frozenset(i for i, (s, version) in enumerate(self.seen) if s._version != version)
        self.seen.clear()
        return frozenset(self.early), late

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def _probe(function: Callable[..., Any], args: tuple, kwargs: dict, replay: Replay) -> Finding | None:
    """Which of the tensors one run of ``function(*args, **kwargs)`` saves for the backward pass it updates in place
    (:meth:`_Probe.finding`), from a run on copies of the arguments whose result is thrown away; None where it
    saved nothing (gradients off or nothing trained), which tells nothing. The random state is restored after it
    (with ``replay.preserve_rng_state``) and its machine readings go to a tape of their own, so the calls that
    count draw and read what they would without it."""
    probe = _Probe()
    values = [t for v in [*args, *kwargs.values()] for t in (v if isinstance(v, (list, tuple)) else (v,))]
    devices = sorted({t.device.index for t in values if isinstance(t, torch.Tensor) and t.is_cuda})
    copies, kw_copies = _copied(args), {k: _copied(v) for k, v in kwargs.items()}
    with torch.random.fork_rng(devices=devices, enabled=replay.preserve_rng_state), \
            replay._active("record", _Tape()), probe.hooks():
        function(*copies, **kw_copies)
    return probe.finding()


def checkpoint_module(module: torch.nn.Module, replay: Replay) -> None:
    """Make ``module`` recompute its activations in the backward pass, through ``replay``. The original forward
    is kept as ``module.org_forward`` and restored by :func:`uncheckpoint_module` (the convention ComfyUI's own
    ``nodes_train.patch`` / ``unpatch`` use, so either undoes either).

    Some models update tensors in place after saving them, among them a block's input (ComfyUI's Flux:
    ``img += ...`` after a norm saved ``img``, and the next block gets the same tensor). A recomputation runs on
    the block's inputs as they are at the backward pass, and PyTorch checks neither the tensors inside a
    checkpoint's arguments nor what a recomputation saves: such a block would be recomputed from the values later
    blocks left in its input, and its own updates would overwrite what it saved before them, giving gradients of
    other activations than the forward pass computed, silently. Here the block runs on its own copy of each input
    it updates in place or returns (:class:`_OwnInputs`: at its first call, of every input it might update,
    :func:`_updatable`, also one autograd does not track, which the block's own update would make tracked; made
    inside the checkpoint, so not kept between the passes), and its recomputation saves a
    copy of each tensor its forward pass was seen to update after saving it (:class:`_SaveWatch`): the memory
    of one block's backward pass, only for such tensors.

    That watch sits over the checkpoint's own hooks, which only PyTorch 2.8 and newer can read
    (:func:`has_hook_reader`). On an older PyTorch the first call of each block with gradients on (in a run: one
    ``checkpoint_module``) is probed instead (:func:`_probe`): the block runs once outside the checkpoint, on
    copies of its inputs, under hooks that note which of its saved tensors it updates, and that result is thrown
    away. A recomputation stops at the block's last save (the checkpoint's early stop, set for these blocks), so
    updates after it change nothing the recomputation saved, and such blocks (Flux's single blocks: ``x += ...``
    last) are recomputed. A block that updates a saved tensor before its last save (Flux's double blocks) runs
    without recomputation from then on: it keeps its activations from the forward pass to the backward pass, with
    copies of its inputs where autograd saves them and of every save the probe saw it update
    (:class:`_SavedInputs`), as ``checkpoint_share`` keeps the blocks it leaves out; :meth:`Replay.keep` says so
    once (fallbacks and log, and :attr:`Replay.notice`). Blocks that update nothing in place are recomputed as
    before. The gradients are the forward pass's either way, and the random state and machine readings of the
    other calls are as without the probe. Cost on such a PyTorch: one extra forward run of each checkpointed block
    once a run (a call that saved nothing is probed again at the next), holding one block's activations and a copy
    of its inputs meanwhile (what its recomputation holds in the backward pass); and for each kept block the
    activations of not checkpointing it (plus those copies) instead of its recomputation, which it saves: on Flux
    dev, the memory of its 19 double blocks without gradient checkpointing."""
    original = module.forward
    finding: list[Finding | None] = [None]  # the probe's, on a PyTorch without the hook reader
    own = _OwnInputs(type(module).__name__, replay)

    def run(args: tuple, kwargs: dict) -> Any:
        mode, tape = replay.current() or ("", None)
        args, kwargs, settle = own.placed(args, kwargs, mode, tape)
        if tape is None:
            return original(*args, **kwargs)
        inner = _top_hooks()
        origins, tape.origins = tape.origins, {}  # the recomputation's copies: not kept beyond it
        if inner is None or (mode == "replay" and not tape.updated):
            out = original(*args, **kwargs)
        else:
            watch = _SaveWatch(inner, tape.updated, origins) if mode == "replay" else _SaveWatch(inner)
            with watch.hooks():
                out = original(*args, **kwargs)
            if mode == "record":
                tape.updated = watch.updated()
        settle(out)
        return out

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not has_hook_reader() and torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
            if finding[0] is None:
                finding[0] = _probe(original, args, kwargs, replay)
                if finding[0] is not None and finding[0][0]:
                    replay.keep(module)
            early, updated = finding[0] or (frozenset(), frozenset())
            if early:
                with _SavedInputs(_tracked([*args, *kwargs.values()]), updated).hooks():
                    return original(*args, **kwargs)
            if updated:
                with torch.utils.checkpoint.set_checkpoint_early_stop(True):
                    return replay.checkpoint(run, args, kwargs)
        return replay.checkpoint(run, args, kwargs)

    setattr(module, "org_forward", original)  # noqa: B010  (assigning a method attribute, which mypy refuses)
    setattr(module, "forward", forward)  # noqa: B010


def uncheckpoint_module(module: torch.nn.Module) -> None:
    """Undo :func:`checkpoint_module` (or ComfyUI's ``patch``). A module whose forward was its class's gets no
    instance attribute back: later code (the fused layers, compilation) tells a replaced forward by one."""
    if hasattr(module, "org_forward"):
        original = module.__dict__["org_forward"]
        if getattr(original, "__self__", None) is module and \
                getattr(original, "__func__", None) is type(module).forward:
            module.__dict__.pop("forward", None)
        else:
            setattr(module, "forward", original)  # noqa: B010
        del module.org_forward


def spread(blocks: Sequence[T], share: float) -> list[T]:
    """The blocks to recompute when only ``share`` of them (0 to 1) are: ``share * len(blocks)`` of them (rounded),
    spread evenly over the model, first block included (as an interval of every n-th block does, for any share).

    A block that is not recomputed keeps its activations from the forward pass to the backward pass and saves
    its recomputation, about a third of its work in a training step; recomputing fewer blocks is the trade of
    memory for speed between full gradient checkpointing (share 1) and none (share 0). Which blocks are chosen
    does not change what is learned."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"the share of blocks to recompute must be between 0 and 1, got {share!r}")
    count = int(share * len(blocks) + 0.5)
    return [blocks[(i * len(blocks)) // count] for i in range(count)] if count else []


def _keeping_inputs(module: torch.nn.Module) -> Callable[..., Any]:
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        inputs = _tracked([*args, *kwargs.values()]) if torch.is_grad_enabled() else []
        if not inputs:
            return original(*args, **kwargs)
        with _SavedInputs(inputs).hooks():
            return original(*args, **kwargs)

    return forward


@contextlib.contextmanager
def inputs_kept(blocks: Iterable[torch.nn.Module]) -> Iterator[int]:
    """``blocks`` (ones that are not recomputed) save a copy of their inputs wherever autograd saves them for the
    backward pass, as their value was then; yields how many blocks were changed.

    Some models update their residual stream in place inside a block (ComfyUI's Flux: ``img += ...`` after a norm
    saved ``img``), which autograd refuses at the backward pass ("modified by an inplace operation") unless the
    block is recomputed, since recomputation saves nothing in the forward pass. With the copy such a block trains
    without recomputation, at the memory of the out-of-place update its code avoided: one copy of an input per
    value it had when saved. Only tensors in the storage of a block's inputs are copied, and an in-place update of
    any other saved tensor still fails (:class:`_SavedInputs`); blocks that already have a forward of their own
    (checkpointed, compiled) are left as they are."""
    with replaced_forwards(blocks, _keeping_inputs) as count:
        yield count


_settled: set[int] = set()


def _settling_query(device: torch.device) -> torch.Tensor:
    """The query, key and value of the settling attention call: 8 tokens of 64 channels in bf16 on ``device``
    (the one place it makes a tensor on the GPU, so a test on the CPU can stand in for it)."""
    return torch.zeros(1, 1, 8, 64, device=device, dtype=torch.bfloat16)


def settle_attention_dispatch(device: torch.device) -> bool:
    """Make PyTorch fix its attention kernel order on ``device`` now, before anything is checkpointed: one tiny
    ``scaled_dot_product_attention`` call. Its first call in a process decides the order (on Hopper and newer
    with a recent cuDNN it puts cuDNN attention first, overriding the priority a caller set in a context), so
    a training whose first block ran that first call saw one kernel in the forward pass and another in the
    recomputation. Returns whether a call was made (once per CUDA device and process; nothing elsewhere). On AMD
    GPUs (PyTorch's ROCm build, "cuda" devices too) the call is made as well: one attention call of the kind
    training makes anyway."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _settled:
        return False
    with torch.no_grad():
        q = _settling_query(torch.device("cuda", index))
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    _settled.add(index)
    return True

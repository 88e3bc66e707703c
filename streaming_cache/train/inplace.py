"""An in-place update of a tensor autograd saved for the backward pass, as an error a caller can recognise.

Some models update activations in place after an operation saved them (ComfyUI's Flux: ``img += ...`` after a
norm saved ``img``). Autograd refuses that at the backward pass ("modified by an inplace operation"); the trainer
then trains the model another way (``recompute.inputs_kept``, or recomputation). Where the pack's own saved-tensor
hooks find such an update they raise :class:`InPlaceUpdate`; autograd's own check raises a plain RuntimeError,
recognised by :func:`is_inplace_update`. Retrying another way is safe only before the first optimizer step, which the
caller checks (the trained tensors' versions): a message alone never restarts a run.
"""

from __future__ import annotations

AUTOGRAD_MESSAGE = "modified by an inplace operation"


class InPlaceUpdate(RuntimeError):
    """A tensor saved for the backward pass was updated in place before the backward pass read it."""


class InputUpdatedLater(RuntimeError):
    """A recomputed block updated or returned, at a later call, an input its first call left alone, and so was not
    given a copy of: this call cannot be recomputed (``recompute._OwnInputs``). The run's ``recompute.Replay`` has
    switched the learnt copies off before this is raised, so the micro-step runs right when it runs again from inputs
    the block did not change: the training loop does that (``loop._Run.micro_loss``), and the graphs' recording
    lets it through to it (``graphs.GraphedForward``)."""


def is_inplace_update(exc: BaseException) -> bool:
    """Whether ``exc`` says a saved tensor was updated in place: the pack's own :class:`InPlaceUpdate`, or autograd's
    RuntimeError saying so."""
    if isinstance(exc, InPlaceUpdate):
        return True
    return type(exc) is RuntimeError and AUTOGRAD_MESSAGE in str(exc)

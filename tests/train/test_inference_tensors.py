"""Tensors made in inference mode never reach what autograd records (streaming_cache/train/inference.py): the two
kinds a model runtime leaves behind (inference tensors, and parameters moved outside inference mode, which lost
their version counter while claiming to be ordinary) are found, replaced by ordinary copies with the same values,
and a training step then runs; without the replacement the same step fails."""

from __future__ import annotations

import pytest
import torch

from streaming_cache.train.inference import thaw, usable_in_autograd


def _built_in_inference_mode() -> torch.nn.Module:
    with torch.inference_mode():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 2))
        model.register_buffer("shift", torch.full((2,), 0.5))
    return model


def _step(model: torch.nn.Module) -> torch.Tensor:
    x = torch.randn(3, 6, dtype=next(model.parameters()).dtype, requires_grad=True)
    (model(x) + model.shift).square().sum().backward()
    return x.grad


def test_inference_tensors_are_found_and_replaced_with_the_same_values():
    model = _built_in_inference_mode()
    assert not any(usable_in_autograd(p) for p in model.parameters())
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
        _step(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert thaw(model) == 7  # six parameters and the buffer
    assert all(usable_in_autograd(t) for t in model.state_dict().values())
    assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert _step(model) is not None


def test_parameters_moved_outside_inference_mode_lose_their_version_counter_and_are_replaced():
    """What loading a model onto a GPU does to the weights of a model a node built: ``is_inference()`` is False,
    yet autograd cannot use them."""
    model = _built_in_inference_mode()
    model.to(torch.float64)  # outside inference mode: the parameters get new data in place
    weight = model[0].weight
    assert not weight.is_inference() and not usable_in_autograd(weight)
    with pytest.raises(RuntimeError, match="do not track version counter"):
        _step(model)
    values = weight.clone()
    assert thaw(model) == 6, "the parameters (the buffer was replaced by .to() itself)"
    assert usable_in_autograd(model[0].weight) and model[0].weight.dtype == torch.float64
    assert torch.equal(model[0].weight, values)
    assert _step(model) is not None


def test_keep_leaves_the_tensors_the_caller_names():
    model = _built_in_inference_mode()
    kept = model[2].weight
    assert thaw(model, keep=lambda t: t is kept) == 6
    assert model[2].weight is kept and not usable_in_autograd(model[2].weight)


def test_ordinary_tensors_are_left_alone():
    model = torch.nn.Linear(3, 3)
    weight = model.weight
    assert thaw(model) == 0 and model.weight is weight

"""Tensors made in inference mode never reach what autograd records (streaming_cache/train/inference.py): the two
kinds a model runtime leaves behind (inference tensors, and parameters moved outside inference mode, which lost
their version counter while claiming to be ordinary) are found, replaced by ordinary copies with the same values,
and a training step then runs; without the replacement the same step fails."""

from __future__ import annotations

import collections

import pytest
import torch

from streaming_cache.train.inference import ordinary, thaw, usable_in_autograd

pytestmark = pytest.mark.oldest_torch


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


Pair = collections.namedtuple("Pair", "tensor extra")


def test_what_a_step_hands_the_model_is_made_ordinary_wherever_it_sits():
    """A conditioning as ComfyUI holds it (a list of [tensor, {options}]), made in inference mode as a loader node
    makes it, with a family's extra column, a named tuple and a non-tensor option: fed unchanged to a layer being
    trained (fp32: no cast copies it), it fails; after ``ordinary`` the same values train."""
    with torch.inference_mode():
        cross = torch.randn(1, 3, 6)
        cond = [[cross, {"pooled_output": torch.randn(1, 6), "tags": [torch.ones(3)], "pair": Pair(torch.zeros(2), 1),
                         "width": 64}]]
    plain = torch.randn(2)
    layer = torch.nn.Linear(6, 4)
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
        layer(cross).sum().backward()
    made = ordinary(cond)
    tensors = [made[0][0], made[0][1]["pooled_output"], made[0][1]["tags"][0], made[0][1]["pair"].tensor]
    assert all(usable_in_autograd(t) for t in tensors)
    assert isinstance(made[0][1]["pair"], Pair) and made[0][1]["pair"].extra == 1 and made[0][1]["width"] == 64
    assert torch.equal(made[0][0], cross) and torch.equal(made[0][1]["pooled_output"], cond[0][1]["pooled_output"])
    layer(made[0][0]).sum().backward()
    assert layer.weight.grad is not None and torch.isfinite(layer.weight.grad).all()
    same = [plain, {"a": plain}]
    assert ordinary(same) is same and ordinary(plain) is plain  # nothing to replace: nothing copied


def test_ordinary_inside_inference_mode_still_gives_tensors_autograd_can_use():
    with torch.inference_mode():
        made = ordinary(torch.ones(3))
    assert usable_in_autograd(made)

"""DoRA's weight (``streaming_cache.train.dora``): what ComfyUI's ``weight_decompose`` computes from a file with a
magnitude per input column; that it loads so in ComfyUI is checked in ``tests/comfy/test_lora_files_in_comfyui.py``."""

from __future__ import annotations

import pytest
import torch

from streaming_cache.train import dora


@pytest.mark.parametrize("shape", [(6, 5), (6, 3, 3, 3)])
def test_a_new_dora_layer_starts_as_the_base_weight_and_its_columns_take_the_magnitude(shape):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=g)
    magnitude = dora.initial_magnitude(weight)
    assert magnitude.shape == (1, shape[1], *[1] * (len(shape) - 2))
    assert torch.allclose(dora.decomposed(weight, magnitude, 0.0), weight, atol=1e-6)
    update = 0.3 * torch.randn(shape, generator=g)
    out = dora.decomposed(weight + update, 2 * magnitude, 0.0)
    columns = out.transpose(0, 1).reshape(shape[1], -1)
    assert torch.allclose(columns.norm(dim=1), 2 * magnitude.flatten(), rtol=1e-5), "each column's norm is set"
    direction = (weight + update).transpose(0, 1).reshape(shape[1], -1)
    assert torch.allclose(torch.nn.functional.cosine_similarity(columns, direction, dim=1), torch.ones(shape[1]))


def test_a_magnitude_per_output_row_is_refused_naming_the_layer():
    dora.check_magnitude(torch.ones(1, 5), (6, 5), "attn1.to_q")
    with pytest.raises(ValueError, match=r"attn1.to_q has shape \(6, 1\), not \(1, 5\).*wd_on_out"):
        dora.check_magnitude(torch.ones(6, 1), (6, 5), "attn1.to_q")

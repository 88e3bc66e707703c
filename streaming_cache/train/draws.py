"""The random draws of a training step, one generator per sample.

Each sample of a global batch draws its noise, its noise level and its caption choice from a generator seeded by
(seed, micro-step, the sample's index in the global batch) and nothing else. So a sample draws the same whichever
process trains it and however many processes share the batch (N processes with batch size B draw what one
process with batch size N x B draws), and a resumed run draws what the uninterrupted run would have drawn.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .timesteps import offset_noise, sample_t

PERTURBATION_STREAM = 1
"""The stream of a sample's input perturbation (:func:`perturbation`); 0 is the stream of its other draws."""


def sample_seed(seed: int, micro: int, index: int, stream: int = 0) -> int:
    """A 63-bit seed for sample ``index`` of micro-step ``micro`` (well mixed: neighbouring samples and steps
    get unrelated streams); ``stream`` > 0: another stream of the same sample, unrelated to stream 0."""
    entropy = [int(seed), int(micro) + 1, int(index)] + ([int(stream)] if stream else [])
    words = np.random.SeedSequence(entropy).generate_state(2, np.uint32)
    return (int(words[0]) << 31 | int(words[1]) >> 1) & ((1 << 63) - 1)


@dataclass(frozen=True)
class Draws:
    """The draws of one process's slice of a micro-step's global batch: local sample ``i`` is sample
    ``first + i`` of the global batch. ``micro`` None marks draws that are not a training step (the validation
    loss): the noise is still drawn per sample, but no per-sample training choice (caption dropout) is made.
    ``caption_dropout``: the rate of the dataset these samples come from, when it has one of its own."""

    seed: int
    micro: int | None
    first: int = 0
    caption_dropout: float | None = None  # the samples' dataset's own rate (a mix); None: the training's

    def index(self, i: int) -> int:
        """The global index of local sample ``i``."""
        return self.first + i

    def generator(self, i: int, stream: int = 0) -> torch.Generator:
        """The CPU generator of local sample ``i`` (a fresh one each call, at the start of its ``stream``)."""
        micro = -1 if self.micro is None else self.micro
        return torch.Generator().manual_seed(sample_seed(self.seed, micro, self.first + i, stream))

    def randn(self, shape: tuple[int, ...], count: int) -> tuple[torch.Tensor, list[torch.Generator]]:
        """Standard normal noise ``[count, *shape]``, each row from its sample's generator, and the generators
        (positioned after the noise) for the sample's further draws."""
        generators = [self.generator(i) for i in range(count)]
        noise = torch.stack([torch.randn(shape, generator=g) for g in generators]) if count else \
            torch.zeros((0, *shape))
        return noise, generators


def noise_and_levels(draws: Draws, shape: tuple[int, ...], count: int, *, sampling: str, scale: float = 1.0,
                     shift: float = 1.0, offset: float = 0.0, t: float | None = None,
                     t_range: tuple[float, float] = (0.0, 1.0)) -> tuple[torch.Tensor, torch.Tensor]:
    """The noise ``[count, *shape]`` and noise levels ``t`` ``[count]`` of ``count`` samples, each drawn from its
    sample's generator in this order: its noise, its level (:func:`~.timesteps.sample_t` with ``sampling``,
    ``scale``, ``shift`` and ``t_range``, unless the fixed level ``t`` is given), its noise offset (``offset`` >
    0). ``shape`` is one sample's latent rows ``[rows, C, ...]``: one row for most models, a clip's frames where they
    are the model's batch (SVD); a sample's rows share its level, and the offset is drawn per row and channel."""
    noise, generators = draws.randn(shape, count)
    if t is None:
        levels = torch.cat([sample_t(sampling, 1, g, scale=scale, shift=shift, t_range=t_range)
                            for g in generators]) if count else torch.zeros(0)
    else:
        levels = torch.full((count,), float(t))
    if offset > 0 and count:
        noise = torch.stack([offset_noise(noise[i], offset, g) for i, g in enumerate(generators)])
    return noise, levels


def perturbation(draws: Draws, shape: tuple[int, ...], count: int) -> torch.Tensor:
    """Standard normal ``[count, *shape]``: the input perturbation of each of ``count`` samples (Ning et al. 2023,
    sd-scripts' ``--ip_noise_gamma``), each row from a stream of its sample's own (:data:`PERTURBATION_STREAM`),
    so a run that perturbs draws its noise and levels as one that does not."""
    if not count:
        return torch.zeros((0, *shape))
    return torch.stack([torch.randn(shape, generator=draws.generator(i, PERTURBATION_STREAM)) for i in range(count)])

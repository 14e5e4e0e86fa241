"""Few-step flow-matching arithmetic shared by the chunk loop and training.

Wan's flow matching: `x_t = (1 - sigma) * x0 + sigma * noise` and the model predicts the velocity
`v = noise - x0`, so `x0 = x_t - sigma * v`. A denoising step value `d` in (0, 1000] (Self-Forcing's
[1000, 750, 500, 250]) is warped by the scheduler's shift: `s = d / 1000`,
`sigma = shift * s / (1 + (shift - 1) * s)`, and the model sees `timestep = 1000 * sigma`.
"""

from __future__ import annotations

import torch


def sigma_for_step(step: float, shift: float) -> float:
    """Noise level of denoising step value `step` (1000 = pure noise, 0 = clean) under `shift`."""
    if not 0 <= step <= 1000:
        raise ValueError(f"denoising step values must lie in [0, 1000], got {step}.")
    s = step / 1000.0
    return shift * s / (1 + (shift - 1) * s)


def sigmas_from_uniform(u: torch.Tensor, shift: float) -> torch.Tensor:
    """Warp uniform samples `u` in [0, 1] to training noise levels, as `sigma_for_step` does."""
    return shift * u / (1 + (shift - 1) * u)


def predict_clean(noisy: torch.Tensor, velocity: torch.Tensor, sigma: float | torch.Tensor) -> torch.Tensor:
    """`x0` implied by the model's velocity at noise level `sigma`."""
    return noisy - sigma * velocity


def add_noise(clean: torch.Tensor, noise: torch.Tensor, sigma: float | torch.Tensor) -> torch.Tensor:
    """`x_t` at noise level `sigma`."""
    return (1 - sigma) * clean + sigma * noise

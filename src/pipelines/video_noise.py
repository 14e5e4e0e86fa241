"""How an input video's chunk is noised before it is denoised (video-to-video): the three mixes, in one place.

- `"sigma"` (diffusers' `WanVideoToVideoPipeline`; the default): the step list is cut where `strength` says (the last
  `int(N * strength)` steps run) and the chunk is noised to that first step's sigma,
  `x = sigma * noise + (1 - sigma) * input`.
- `"strength"` (StreamDiffusionV2's `noise_scale`, chenfengxu714/StreamDiffusionV2
  `streamv2v/inference_wo_batch.py:273-274`): `x = s * noise + (1 - s) * input` with `s = strength`, and every step
  of the list runs; the model is told the list's first timestep whatever `s` is (700 for its v2v list).
- `"motion"` (its `compute_noise_scale_and_step`, `streamv2v/inference.py:51-57`, called per chunk at
  `inference_wo_batch.py:303-305`): the first chunk as `"strength"`; each later chunk measures the input's motion,
  `m = clamp(max_f sqrt(mean (frame_f - frame_{f-1})^2) / 0.2, 0, 1)` over its pixel frames (in [-1, 1]), each
  against the frame before it (the first against the previous chunk's last), then mixes at
  `s = 0.9 * (strength - 0.1 * m) + 0.1 * s_previous` and feeds `int(1000 * s) - 100` as its first timestep (the
  later steps as listed). A still input keeps `s` near `strength`; motion lowers it (less noise, more of the input).

`s` is kept as a Python float and the arithmetic is upstream's, so the first timestep (an `int` of a float) is the
one upstream computes. The state (`s` and the last pixel frame) is saved with the stream for resume.
"""

from __future__ import annotations

import torch

from .request.steps import StepMapping, StepPlan

FULL_MOTION_RMS = 0.2  # an RMS difference between consecutive pixel frames that counts as full motion
MOTION_WEIGHT = 0.1  # how far full motion lowers the noise scale
SCALE_MEMORY = 0.1  # the share of the previous chunk's scale kept (an exponential moving average)
STEP_BELOW_SCALE = 100  # the first timestep sits this far below 1000 * scale


def chunk_motion(frames: torch.Tensor, previous: torch.Tensor) -> float:
    """Upstream's motion measure of `frames` `(batch, 3, f, H, W)` following `previous` `(batch, 3, 1, H, W)`:
    the largest per-frame RMS difference from the frame before, over `FULL_MOTION_RMS`, clamped to [0, 1]."""
    before = torch.cat([previous, frames[:, :, :-1]], dim=2)
    squared = (frames - before) ** 2
    return float((torch.sqrt(squared.mean(dim=(0, 1, 3, 4))).max() / FULL_MOTION_RMS).clamp(0, 1))


class VideoNoiseMix:
    """One stream's noise mix of its input chunks (see the module docstring); `observe` each chunk's pixel frames
    as they are read, then ask `plan_and_level` for its steps and mix level."""

    def __init__(self, mix: str, strength: float) -> None:
        self.mix, self.strength = mix, strength
        self.scale = strength  # upstream's `noise_scale`: the last chunk's mix level
        self._previous_frame: torch.Tensor | None = None  # the last pixel frame read (motion only)
        self._motion: float | None = None  # the motion of the chunk read last, not yet used

    def observe(self, frames: torch.Tensor) -> None:
        """The chunk's pixel frames `(batch, 3, f, H, W)` in [-1, 1], just read (motion is measured only for
        `"motion"`; the first chunk has none)."""
        if self.mix != "motion":
            return
        if self._previous_frame is not None:
            self._motion = chunk_motion(frames, self._previous_frame)
        self._previous_frame = frames[:, :, -1:].clone()

    def plan_and_level(self, plan: StepPlan, mapping: StepMapping) -> tuple[StepPlan, float | None]:
        """The chunk's steps and its mix level `s` (None: `"sigma"`, noised to its first step's sigma)."""
        if self.mix == "sigma":
            return plan, None
        if self.mix == "motion" and self._motion is not None:
            weighted = (self.strength - MOTION_WEIGHT * self._motion) * (1 - SCALE_MEMORY)
            self.scale = weighted + self.scale * SCALE_MEMORY
            first_step = int(1000 * self.scale) - STEP_BELOW_SCALE
            plan, self._motion = mapping.plan([first_step, *plan.steps[1:]]), None
        return plan, self.scale

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {"scale": torch.tensor(self.scale, dtype=torch.float64)}
        if self._previous_frame is not None:
            state["previous_frame"] = self._previous_frame
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if "scale" in state:
            self.scale = float(state["scale"])
        self._previous_frame = state.get("previous_frame")
        self._motion = None

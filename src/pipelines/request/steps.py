"""The few-step schedule of a chunk: which timestep the model is fed at each step, and which sigma the step uses.

The checkpoints' authors map their raw steps (e.g. 1000, 750, 500, 250) to sigmas in three different ways:
- "shift" (diffusers'; rolldiff's default): sigma = shift(t / 1000) with the scheduler's `shift`, and the model
  is fed sigma * 1000. Self-Forcing's, LongLive's and Krea Realtime's warped steps (`warp_denoising_step: true`:
  the entry `1000 - t` of their 1000-entry table) land on exactly these values; a last step of 0 is fed t = 0 with
  the table's last sigma, shift(1 / 1000) (0.00498 at shift 5: Krea's `v2v.py`);
- "table": sigma = the nearest entry (by timestep value) of that table, `shift(linspace(1, 0, 1001)[:-1])`, and
  the model is fed the raw step (Self-Forcing's `warp_denoising_step: false`; LongSANA's `LongLiveFlowEuler`);
- "linear": sigma = t / 1000 and the model is fed t (no table at all).
`integer_timesteps` truncates what the model is fed (LongSANA), and explicit `sigmas` replace the mapping. A
step may be 0 (Krea's last step): the model sees t = 0 and the step uses that step's sigma (the table's last
entry, not 0), so the chunk still moves.

A `StepPlan` is computed once per request; every stream then drives its own
`FlowMatchEulerDiscreteScheduler` copy with the plan's sigmas as given (`shift` 1: no second warp) and feeds
the plan's timesteps to the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...checks import check_choice, check_flag, check_number, is_number

SIGMA_MAPPINGS = ("shift", "table", "linear")
TABLE_SIZE = 1000


def shift_sigmas(sigmas: np.ndarray, shift: float) -> np.ndarray:
    """The flow-matching timestep shift `s * x / (1 + (s - 1) * x)` (diffusers', Wan's, SANA's)."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def sigma_table(shift: float, size: int = TABLE_SIZE) -> np.ndarray:
    """`size` sigmas from 1 down to (not including) 0, shifted, in float32 as the research samplers keep them."""
    return shift_sigmas(np.linspace(1.0, 0.0, size + 1)[:-1], shift).astype(np.float32)


@dataclass(frozen=True)
class StepPlan:
    """Per denoising step: the timestep fed to the model and the sigma the scheduler step uses (None: diffusers'
    "shift" mapping done by the scheduler itself, bit for bit as before plans existed)."""

    steps: tuple[float, ...]  # the raw steps, as given
    timesteps: tuple[float, ...] | None = None
    sigmas: tuple[float, ...] | None = None

    def tail(self, count: int) -> StepPlan:
        """The last `count` steps (video-to-video starts part-way down the list)."""
        cut = len(self.steps) - count
        return StepPlan(
            self.steps[cut:],
            None if self.timesteps is None else self.timesteps[cut:],
            None if self.sigmas is None else self.sigmas[cut:],
        )


def check_steps(steps: Sequence, name: str = "denoising_steps") -> tuple[float, ...]:
    """A step list that starts from noise: strictly decreasing numbers in [0, 1000] whose first is above 0 (a
    list of only t = 0 would denoise nothing); only the last may be 0 (Krea's list ends there)."""
    steps = list(steps) if isinstance(steps, Sequence) and not isinstance(steps, str) else steps
    if (
        not isinstance(steps, list)
        or not steps
        or not all(is_number(s) and 0 <= s <= 1000 for s in steps)
        or steps[0] <= 0
        or any(a <= b for a, b in zip(steps, steps[1:]))
    ):
        raise ValueError(
            f"`{name}` must be strictly decreasing numbers in [0, 1000], the first above 0 (a chunk starts "
            f"from noise; only the last may be 0), e.g. [1000, 750, 500, 250]; got {steps!r}."
        )
    return tuple(float(s) for s in steps)


@dataclass(frozen=True)
class StepMapping:
    """How a request maps steps to sigmas (`plan_steps`' options, checked): kept on the request so a step chosen at
    run time (StreamDiffusionV2's motion-adaptive first step) is mapped as the planned ones are."""

    sigma_mapping: str = "shift"
    shift: float = 5.0
    integer_timesteps: bool = False

    def plan(self, steps: Sequence[float]) -> StepPlan:
        """The plan of `steps` taken as they come (in any order: a run-time first step may sit below the next one),
        each mapped alone. A step outside [0, 1000] is fed as it is, with the sigma of its nearest end (upstream's
        table lookup reads it so)."""
        timesteps, sigmas = [], []
        for step in steps:
            clamped = min(max(float(step), 0.0), 1000.0)
            lone = [1000.0, 0.0] if clamped == 0 else [clamped]  # a list of only 0 starts nothing: 0 comes last
            alone = plan_steps(lone, self.sigma_mapping, self.shift, self.integer_timesteps)
            timesteps.append(alone.timesteps[-1] if clamped == step else float(step))
            sigmas.append(alone.sigmas[-1])
        return StepPlan(tuple(float(t) for t in steps), tuple(timesteps), tuple(sigmas))


def plan_steps(
    steps: Sequence,
    sigma_mapping: str,
    shift: float,  # `timestep_shift` (the scheduler's own unless the call or recipe sets one)
    integer_timesteps: bool = False,
    sigmas: Sequence[float] | None = None,
    scheduler_shift: float | None = None,
    name: str = "denoising_steps",
) -> StepPlan:
    """Check the step options together and compute the plan (see the module docstring). `scheduler_shift`: the
    pipeline scheduler's own shift; with the default mapping at that shift the scheduler maps the steps itself."""
    check_choice("sigma_mapping", sigma_mapping, SIGMA_MAPPINGS)
    check_flag("integer_timesteps", integer_timesteps)
    shift = check_number("timestep_shift", shift, 0, above=True)
    explicit = sigmas is not None
    steps = check_steps(steps, name)
    plain = sigma_mapping == "shift" and not explicit and not integer_timesteps and steps[-1] > 0
    if plain and shift == scheduler_shift:
        return StepPlan(steps)  # the scheduler maps them itself, as it always has
    fed = tuple(float(int(t)) if integer_timesteps else t for t in steps)
    if explicit:
        sigmas = list(sigmas)
        if len(sigmas) != len(steps) or not all(is_number(s) and 0 < s <= 1 for s in sigmas):
            raise ValueError(
                f"`sigmas` must be {len(steps)} numbers in (0, 1], one per denoising step, got {sigmas!r}."
            )
        return StepPlan(steps, fed, tuple(float(s) for s in sigmas))
    if sigma_mapping == "linear":
        chosen = [max(t, 0.0) / 1000.0 for t in steps]
        if chosen[-1] == 0.0:
            raise ValueError("`sigma_mapping='linear'` maps a last step of 0 to sigma 0; use 'table' or `sigmas`.")
    elif sigma_mapping == "table":
        table = sigma_table(shift)
        chosen = [float(table[np.abs(table * 1000.0 - t).argmin()]) for t in steps]
    else:  # "shift": the warped sigma, fed as sigma * 1000; a last step of 0 takes the table's last entry
        last = float(sigma_table(shift)[-1])
        chosen = [float(np.float32(shift_sigmas(t / 1000.0, shift))) if t > 0 else last for t in steps]
        fed = tuple(float(int(s * 1000.0)) if integer_timesteps else float(np.float32(s * 1000.0)) for s in chosen)
        fed = tuple(t if step > 0 else 0.0 for t, step in zip(fed, steps))
    return StepPlan(steps, fed, tuple(chosen))

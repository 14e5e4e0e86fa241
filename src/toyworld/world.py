"""A synthetic world of one coloured shape bouncing on a dark background.

Videos are fully determined by a prompt "a {colour} {shape} moving {direction}" and a seed, so a tiny
video model can be trained on them and its long rollouts checked against exact ground truth
(see `metrics.py`). Rendering is vectorised over all frames at once with numpy.

Geometry, in pixels with x to the right and y down:
- the shape diameter is `10 * min(height, width) / 32` (10 px at 32x32, at least 3 px);
- the shape moves at a fixed `SPEED_PX_PER_FRAME` = 1 px/frame along the prompted axis only;
- its centre bounces (velocity reverses) so the shape always stays fully inside the frame;
- the random start leaves at least `MIN_FRAMES_BEFORE_BOUNCE` frames of motion in the prompted
  direction before the first bounce.
Edges are hard (no anti-aliasing), so every shape pixel has exactly the palette colour.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BACKGROUND_RGB = (16, 16, 16)
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 200, 60),
    "blue": (50, 80, 230),
    "yellow": (230, 210, 40),
}
SHAPES = ("circle", "square", "triangle")
# Unit velocity (dx, dy) in image coordinates: y grows downwards, so "up" is -y.
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}

SPEED_PX_PER_FRAME = 1.0
MIN_FRAMES_BEFORE_BOUNCE = 8
MIN_SIZE_PX = 16  # below this the shape has too little room to show a direction before bouncing


@dataclass(frozen=True)
class SceneSpec:
    """What one video shows; `prompt` round-trips through `parse_prompt`."""

    colour: str
    shape: str
    direction: str

    @property
    def prompt(self) -> str:
        return f"a {self.colour} {self.shape} moving {self.direction}"


def all_prompts() -> list[str]:
    """Every prompt of the vocabulary (4 colours x 3 shapes x 4 directions = 48), in a fixed order."""
    return [SceneSpec(c, s, d).prompt for c in COLOURS for s in SHAPES for d in DIRECTIONS]


def parse_prompt(prompt: str) -> SceneSpec:
    """Parse exactly "a {colour} {shape} moving {direction}" (surrounding whitespace ignored)."""
    words = prompt.strip().split(" ") if isinstance(prompt, str) else []
    ok = (
        len(words) == 5
        and words[0] == "a"
        and words[1] in COLOURS
        and words[2] in SHAPES
        and words[3] == "moving"
        and words[4] in DIRECTIONS
    )
    if not ok:
        raise ValueError(
            f"prompt must be 'a {{colour}} {{shape}} moving {{direction}}' with colour in {list(COLOURS)}, "
            f"shape in {list(SHAPES)}, direction in {list(DIRECTIONS)}; got {prompt!r}"
        )
    return SceneSpec(colour=words[1], shape=words[2], direction=words[4])


def shape_diameter(height: int, width: int) -> int:
    """Shape diameter in pixels: 10 px at 32x32, scaled with the smaller side."""
    return max(3, round(10 * min(height, width) / 32))


def shape_mask(shape: str, centres: np.ndarray, height: int, width: int) -> np.ndarray:
    """Boolean masks `(frames, height, width)` of `shape` centred at `centres` `(frames, 2)` as (x, y) px.

    A pixel belongs to the shape when its centre (j + 0.5, i + 0.5) lies inside the outline.
    """
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {list(SHAPES)}; got {shape!r}")
    radius = shape_diameter(height, width) / 2
    dx = np.arange(width, dtype=np.float32)[None, None, :] + 0.5 - centres[:, 0, None, None]  # (F, 1, W)
    dy = np.arange(height, dtype=np.float32)[None, :, None] + 0.5 - centres[:, 1, None, None]  # (F, H, 1)
    if shape == "circle":
        return dx**2 + dy**2 <= radius**2
    if shape == "square":
        return (np.abs(dx) <= radius) & (np.abs(dy) <= radius)
    # Isosceles triangle, apex up, base along the bottom of the bounding square.
    return (dy <= radius) & (np.abs(dx) <= (dy + radius) / 2)


def shape_area(shape: str, height: int = 32, width: int = 32) -> int:
    """Pixel count of an unclipped `shape` at this frame size (what `metrics.presence` compares to)."""
    centre = np.array([[width // 2, height // 2]], dtype=np.float32)
    return int(shape_mask(shape, centre, height, width).sum())


def centre_trajectory(
    direction: str, start: tuple[float, float], num_frames: int, height: int, width: int
) -> np.ndarray:
    """Shape centres `(num_frames, 2)` as (x, y) px: constant speed along one axis, reflected at the walls.

    Reflection is a triangle wave of period 2 * span, so bounces need no per-frame loop. The walls are
    the whole-pixel centres nearest the frame edges.
    """
    radius = shape_diameter(height, width) / 2
    velocity = np.array(DIRECTIONS[direction], dtype=np.float64) * SPEED_PX_PER_FRAME
    # Walls on whole pixels, so whole-pixel starts never repeat a position at a bounce (odd diameters).
    low = np.full(2, np.ceil(radius))
    span = np.floor(np.array([width, height]) - radius) - low  # room the centre has on each axis
    time = np.arange(num_frames, dtype=np.float64)[:, None]  # (F, 1)
    phase = np.mod(np.asarray(start, dtype=np.float64) - low + velocity * time, 2 * span)  # (F, 2)
    return (low + np.where(phase <= span, phase, 2 * span - phase)).astype(np.float32)


def random_start(direction: str, rng: np.random.Generator, height: int, width: int) -> tuple[float, float]:
    """A whole-pixel centre fully inside the frame, with `MIN_FRAMES_BEFORE_BOUNCE` frames of room ahead."""
    radius = shape_diameter(height, width) / 2
    velocity = DIRECTIONS[direction]
    clearance = MIN_FRAMES_BEFORE_BOUNCE * SPEED_PX_PER_FRAME
    start = []
    for axis, size in enumerate((width, height)):
        low, high = radius, size - radius
        if velocity[axis] > 0:
            high -= clearance
        elif velocity[axis] < 0:
            low += clearance
        start.append(float(rng.integers(int(np.ceil(low)), int(np.floor(high)) + 1)))
    return start[0], start[1]


def _check_size(name: str, value: int) -> None:
    if not isinstance(value, (int, np.integer)) or value < MIN_SIZE_PX:
        raise ValueError(f"{name} must be an int >= {MIN_SIZE_PX}; got {value!r}")


def render_video(
    spec_or_prompt: SceneSpec | str,
    num_frames: int,
    height: int = 32,
    width: int = 32,
    seed: int = 0,
    start: tuple[float, float] | None = None,
) -> np.ndarray:
    """Render a video, uint8 `(num_frames, height, width, 3)`.

    `seed` picks the start position; `start` = (x, y) centre in px overrides it and must keep the
    shape inside the frame. The same arguments always give the same pixels.
    """
    spec = parse_prompt(spec_or_prompt) if isinstance(spec_or_prompt, str) else spec_or_prompt
    if not isinstance(num_frames, (int, np.integer)) or num_frames < 1:
        raise ValueError(f"num_frames must be an int >= 1; got {num_frames!r}")
    _check_size("height", height)
    _check_size("width", width)
    radius = shape_diameter(height, width) / 2
    if start is None:
        start = random_start(spec.direction, np.random.default_rng(seed), height, width)
    elif not (radius <= start[0] <= width - radius and radius <= start[1] <= height - radius):
        raise ValueError(
            f"start must be an (x, y) centre in [{radius}, {width - radius}] x [{radius}, {height - radius}] "
            f"so the shape is inside the frame; got {start!r}"
        )
    centres = centre_trajectory(spec.direction, start, num_frames, height, width)
    mask = shape_mask(spec.shape, centres, height, width)  # (F, H, W)
    video = np.empty((num_frames, height, width, 3), dtype=np.uint8)
    video[:] = BACKGROUND_RGB
    video[mask] = COLOURS[spec.colour]
    return video


def sample_batch(
    batch_size: int,
    num_frames: int,
    rng: np.random.Generator | int = 0,
    height: int = 32,
    width: int = 32,
) -> tuple[np.ndarray, list[str]]:
    """Random training videos uint8 `(batch_size, num_frames, height, width, 3)` and their prompts.

    `rng` is a numpy Generator (advanced in place, for a stream of batches) or an int seed.
    """
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1; got {batch_size!r}")
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    prompts_all = all_prompts()
    prompts = [prompts_all[i] for i in rng.integers(len(prompts_all), size=batch_size)]
    seeds = rng.integers(2**31, size=batch_size)
    videos = np.stack([render_video(p, num_frames, height, width, int(s)) for p, s in zip(prompts, seeds)])
    return videos, prompts

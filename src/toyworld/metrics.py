"""Per-video metrics that check a (generated) video against its toy-world prompt.

Generators blur edges, so a pixel is compared with the blends between the background and each palette
colour (a segment in RGB), not only with the pure colours: it takes the colour of its nearest segment,
and counts as foreground only when it lies at least half-way from the background to that colour.
The shape is the largest 4-connected blob of foreground pixels of the prompted colour; its centroid
gives the motion. Metrics, all floats:

| metric                    | unit         | meaning                                                                   |
|---------------------------|--------------|---------------------------------------------------------------------------|
| presence                  | fraction     | frames whose shape blob has 30%..250% of the true shape area              |
| colour_accuracy           | fraction     | foreground pixels (all frames) that are the prompted colour               |
| direction_accuracy        | fraction     | frame-to-frame steps that move >= 0.25 px, mostly along the prompted axis |
| initial_direction_correct | 0 or 1       | mean step over the first 6 frames has the prompted sign (window at 0)     |
| mean_speed                | px/frame     | mean centroid step length (ground truth: 1.0)                             |
| smoothness                | px/frame^2   | mean change of velocity between steps; lower is smoother                  |
| stray_pixels              | fraction     | pixels that are foreground but not in the shape blob                      |

Steps only count between frames that both show the shape (missing frames lower `direction_accuracy`);
`mean_speed` and `smoothness` are NaN when too few frames show it, and `summarise` ignores NaN.
"""

from __future__ import annotations

import numpy as np

from .world import BACKGROUND_RGB, COLOURS, DIRECTIONS, parse_prompt, shape_area

BACKGROUND = np.array(BACKGROUND_RGB, dtype=np.float32)
COLOUR_OFFSETS = np.array(list(COLOURS.values()), dtype=np.float32) - BACKGROUND  # (4, 3): background -> colour
COLOUR_INDEX = {name: i + 1 for i, name in enumerate(COLOURS)}  # label 0 is background
FOREGROUND_BLEND = 0.5  # a pixel at least this far from background towards its colour is foreground
COLOUR_TOLERANCE = 90.0  # max RGB distance from the prompted blend segment; rejects e.g. white or magenta
PRESENCE_AREA_RANGE = (0.3, 2.5)  # blob area / true area counted as "shape present"
MIN_STEP_PX = 0.25  # smaller centroid steps count as "not moving"
INITIAL_FRAMES = 6
# Metric name -> unit, in the order tables list them.
METRIC_UNITS = {
    "presence": "fraction",
    "colour_accuracy": "fraction",
    "direction_accuracy": "fraction",
    "initial_direction_correct": "0 or 1",
    "mean_speed": "px/frame",
    "smoothness": "px/frame^2",
    "stray_pixels": "fraction",
}


def palette_labels(frames: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Colour label `(F, H, W)` (0 = background, else 1 + index in `COLOURS`) and the RGB distance to it.

    `frames` is `(F, H, W, 3)` in 0..255. The distance is to the nearest background->colour segment.
    """
    offsets = frames.astype(np.float32) - BACKGROUND  # (F, H, W, 3)
    lengths = (COLOUR_OFFSETS**2).sum(-1)  # (4,)
    projections = offsets @ COLOUR_OFFSETS.T  # (F, H, W, 4)
    blend = np.clip(projections / lengths, 0.0, 1.0)
    # |o - b d|^2 expanded, to avoid a (F, H, W, 4, 3) residual tensor.
    squared = (offsets**2).sum(-1, keepdims=True) - 2 * blend * projections + blend**2 * lengths
    distances = np.sqrt(np.maximum(squared, 0.0))  # (F, H, W, 4)
    nearest = distances.argmin(-1)  # (F, H, W)
    nearest_blend = np.take_along_axis(blend, nearest[..., None], -1)[..., 0]
    labels = np.where(nearest_blend >= FOREGROUND_BLEND, nearest + 1, 0)
    return labels, np.take_along_axis(distances, nearest[..., None], -1)[..., 0]


def largest_component(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Largest 4-connected blob of each frame of `mask` `(F, H, W)`, and its area `(F,)` in pixels.

    Min-label propagation with pointer jumping, vectorised over frames (scipy is not a dependency).
    """
    frames, height, width = mask.shape
    background = height * width  # label larger than any pixel index, never wins a minimum
    labels = np.where(mask, np.arange(background).reshape(1, height, width), background)
    while True:
        padded = np.pad(labels, ((0, 0), (1, 1), (1, 1)), constant_values=background)
        neighbours = np.minimum.reduce(
            [labels, padded[:, :-2, 1:-1], padded[:, 2:, 1:-1], padded[:, 1:-1, :-2], padded[:, 1:-1, 2:]]
        )
        # Pointer jump: take the label of the pixel my label names (same blob, smaller or equal label).
        flat = np.concatenate([neighbours.reshape(frames, -1), np.full((frames, 1), background)], axis=1)
        jumped = np.take_along_axis(flat, neighbours.reshape(frames, -1), axis=1).reshape(labels.shape)
        updated = np.where(mask, jumped, background)
        if np.array_equal(updated, labels):
            break
        labels = updated
    keys = np.arange(frames)[:, None] * (background + 1) + labels.reshape(frames, -1)  # (F, H*W)
    counts = np.bincount(keys.ravel(), minlength=frames * (background + 1)).reshape(frames, background + 1)
    counts[:, background] = 0
    best = counts.argmax(1)  # (F,)
    areas = counts[np.arange(frames), best]
    blob = (labels == best[:, None, None]) & mask & (areas > 0)[:, None, None]
    return blob, areas


def _check_frames(frames: np.ndarray) -> np.ndarray:
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must have shape (frames, height, width, 3); got {frames.shape}")
    return frames


def evaluate_video(frames: np.ndarray, prompt: str, window: tuple[int, int] | None = None) -> dict[str, float]:
    """Metrics of one video uint8 `(F, H, W, 3)` for `prompt`, over frames `window` = [start, stop).

    `initial_direction_correct` is only reported when the window starts at frame 0, because later
    windows begin after an unknown number of bounces.
    """
    frames = _check_frames(frames)
    start, stop = (0, len(frames)) if window is None else window
    if not 0 <= start < stop <= len(frames):
        raise ValueError(f"window must satisfy 0 <= start < stop <= {len(frames)} (video length); got {window!r}")
    spec = parse_prompt(prompt)
    frames = frames[start:stop]
    num_frames, height, width, _ = frames.shape

    # 1. Colour: palette label per pixel.
    labels, distance = palette_labels(frames)
    foreground = labels != 0
    prompted = (labels == COLOUR_INDEX[spec.colour]) & (distance <= COLOUR_TOLERANCE)
    colour_accuracy = float(prompted.sum() / max(int(foreground.sum()), 1))

    # 2. Shape: the largest prompted-colour blob, present when its area is plausible.
    blob, areas = largest_component(prompted)
    true_area = shape_area(spec.shape, height, width)
    low, high = PRESENCE_AREA_RANGE
    present = (areas >= low * true_area) & (areas <= high * true_area)  # (F,)
    stray = (foreground & ~blob).reshape(num_frames, -1).mean(1)  # (F,)

    # 3. Motion of the blob centroid, (x, y) px; steps only between frames that both show the shape.
    ys, xs = np.arange(height), np.arange(width)
    safe_areas = np.maximum(areas, 1)
    centroids = np.stack(
        [(blob.sum(1) * xs).sum(1) / safe_areas, (blob.sum(2) * ys).sum(1) / safe_areas], axis=1
    )  # (F, 2)
    steps = np.diff(centroids, axis=0)  # (F-1, 2)
    step_valid = present[1:] & present[:-1]
    axis = int(DIRECTIONS[spec.direction][0] == 0)  # 0 = x, 1 = y
    along, across = np.abs(steps[:, axis]), np.abs(steps[:, 1 - axis])
    on_axis = step_valid & (along >= MIN_STEP_PX) & (along > across)
    accelerations = np.diff(steps, axis=0)  # (F-2, 2)
    accel_valid = step_valid[1:] & step_valid[:-1]

    metrics = {
        "presence": float(present.mean()),
        "colour_accuracy": colour_accuracy,
        "direction_accuracy": float(on_axis.mean()) if len(on_axis) else float("nan"),
        "mean_speed": _masked_mean(np.linalg.norm(steps, axis=1), step_valid),
        "smoothness": _masked_mean(np.linalg.norm(accelerations, axis=1), accel_valid),
        "stray_pixels": float(stray.mean()),
    }
    if start == 0:
        sign = DIRECTIONS[spec.direction][axis]
        first = slice(0, INITIAL_FRAMES - 1)
        first_steps = steps[first, axis][step_valid[first]]
        mean_step = float(first_steps.mean()) if len(first_steps) else 0.0
        metrics["initial_direction_correct"] = float(mean_step * sign >= MIN_STEP_PX)
    return metrics


def _masked_mean(values: np.ndarray, valid: np.ndarray) -> float:
    return float(values[valid].mean()) if valid.any() else float("nan")


def summarise(results: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each metric over videos, ignoring NaN and videos that lack the metric."""
    if not results:
        raise ValueError("results must be a non-empty list of metric dicts; got []")
    names = list(dict.fromkeys(name for result in results for name in result))
    summary = {}
    for name in names:
        values = np.array([r[name] for r in results if name in r], dtype=np.float64)
        summary[name] = float(np.nanmean(values)) if np.isfinite(values).any() else float("nan")
    return summary

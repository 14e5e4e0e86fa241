"""Per-frame shape tracks of toy-world videos, for scoring image-to-video and video-to-video against an input.

`toyworld.metrics` scores a video against its prompt: it only looks for the prompted colour. Conditioned
generation is scored against an input instead (the start image's trajectory, or the input video's), and a
re-prompted output may keep the input's colour or shape or take the prompt's, so the track here is
colour-agnostic:

- the shape is the largest 4-connected blob of foreground pixels of any palette colour (the same palette
  segments, foreground blend and colour tolerance as `toyworld.metrics`); a frame `found` it when the blob
  holds 30%..250% of some shape's true area;
- its colour is the blob's most common palette label;
- its shape is the template (every shape at the whole-pixel centres within 1 px of the blob's bounding-box
  centre, where every toy-world shape is centred) with the highest intersection-over-union with the blob.
  On rendered frames this is exact (tested); on a blurry generated frame it is the closest outline;
- its centre (x, y) px is the blob's centroid less that shape's centroid offset (a triangle's centroid lies
  1.7 px below its centre at 32x32), so a circle re-drawn as a triangle on the same path is still on it.
  On rendered frames it is the renderer's centre exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np

from ..toyworld.metrics import COLOUR_TOLERANCE, PRESENCE_AREA_RANGE, largest_component, palette_labels
from ..toyworld.world import COLOURS, SHAPES, shape_area, shape_mask

COLOUR_NAMES = tuple(COLOURS)
ON_TRACK_PX = 3.0  # a centroid within this distance of the reference follows it (the shape is 10 px wide)
CENTRE_SEARCH_PX = 1  # template centres tried around the bounding-box centre, each way


@dataclass(frozen=True)
class ShapeTrack:
    """The shape in every frame of one video; entries of frames that did not find it are meaningless."""

    found: np.ndarray  # (F,) bool
    centres: np.ndarray  # (F, 2) float, (x, y) px
    colours: np.ndarray  # (F,) int, index into COLOUR_NAMES
    shapes: np.ndarray  # (F,) int, index into SHAPES


@cache
def _templates(height: int, width: int) -> np.ndarray:
    """Every shape at every whole-pixel centre: bool `(len(SHAPES), height + 1, width + 1, height, width)`."""
    ys, xs = np.meshgrid(np.arange(height + 1), np.arange(width + 1), indexing="ij")
    centres = np.stack([xs.ravel(), ys.ravel()], axis=1).astype(np.float32)  # (C, 2) as (x, y)
    masks = [shape_mask(shape, centres, height, width) for shape in SHAPES]  # each (C, H, W)
    return np.stack(masks).reshape(len(SHAPES), height + 1, width + 1, height, width)


@cache
def _centroid_offsets(height: int, width: int) -> np.ndarray:
    """Each shape's pixel centroid minus its centre, `(len(SHAPES), 2)` as (x, y) px."""
    centre = np.array([[width // 2, height // 2]], dtype=np.float32)
    offsets = []
    for shape in SHAPES:
        ys, xs = np.nonzero(shape_mask(shape, centre, height, width)[0])
        offsets.append([xs.mean() + 0.5 - centre[0, 0], ys.mean() + 0.5 - centre[0, 1]])
    return np.array(offsets)


def classify_shapes(blobs: np.ndarray) -> np.ndarray:
    """Index into SHAPES of the best-matching outline of each blob `(F, H, W)` bool; 0 for empty blobs."""
    frames, height, width = blobs.shape
    templates = _templates(height, width)
    rows, cols = blobs.any(2), blobs.any(1)  # (F, H), (F, W)
    # Bounding-box centre in px: pixels top..bottom span [top, bottom + 1).
    centre_y = (rows.argmax(1) + height - rows[:, ::-1].argmax(1)) / 2  # (F,)
    centre_x = (cols.argmax(1) + width - cols[:, ::-1].argmax(1)) / 2
    offsets = np.arange(-CENTRE_SEARCH_PX, CENTRE_SEARCH_PX + 1)
    cy = np.clip(np.round(centre_y)[:, None] + offsets, 0, height).astype(int)  # (F, K)
    cx = np.clip(np.round(centre_x)[:, None] + offsets, 0, width).astype(int)
    candidates = templates[:, cy[:, :, None], cx[:, None, :]]  # (S, F, K, K, H, W)
    blob = blobs[None, :, None, None]
    intersection = (candidates & blob).sum((-1, -2))
    union = (candidates | blob).sum((-1, -2))
    iou = (intersection / np.maximum(union, 1)).reshape(len(SHAPES), frames, -1).max(-1)  # (S, F)
    return iou.argmax(0)


def track_shape(frames: np.ndarray) -> ShapeTrack:
    """The colour-agnostic shape track of a video uint8 `(F, H, W, 3)`."""
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must have shape (frames, height, width, 3); got {frames.shape}")
    num_frames, height, width, _ = frames.shape
    labels, distance = palette_labels(frames)
    foreground = (labels != 0) & (distance <= COLOUR_TOLERANCE)
    blob, areas = largest_component(foreground)
    areas_by_shape = [shape_area(shape, height, width) for shape in SHAPES]
    low, high = PRESENCE_AREA_RANGE
    found = (areas >= low * min(areas_by_shape)) & (areas <= high * max(areas_by_shape))
    safe = np.maximum(areas, 1)
    xs, ys = np.arange(width), np.arange(height)
    centroids = np.stack([(blob.sum(1) * (xs + 0.5)).sum(1) / safe, (blob.sum(2) * (ys + 0.5)).sum(1) / safe], 1)
    shapes = classify_shapes(blob)
    blob_labels = np.where(blob, labels, 0).reshape(num_frames, -1)
    counts = np.stack([(blob_labels == i + 1).sum(1) for i in range(len(COLOUR_NAMES))], axis=1)  # (F, colours)
    return ShapeTrack(found, centroids - _centroid_offsets(height, width)[shapes], counts.argmax(1), shapes)


def distances(track: ShapeTrack, reference: ShapeTrack) -> np.ndarray:
    """Per-frame distance of the centres in px `(F,)` to a reference track; NaN where either misses the shape."""
    both = track.found & reference.found
    return np.where(both, np.linalg.norm(track.centres - reference.centres, axis=1), np.nan)


def follow_metrics(track: ShapeTrack, reference: ShapeTrack) -> dict[str, float]:
    """How closely `track` follows `reference` over their frames: `found`, mean `distance_px`, `on_track`.

    `on_track` counts frames that miss the shape as off track, so a model that loses the shape scores low.
    """
    per_frame = distances(track, reference)
    valid = ~np.isnan(per_frame)
    return {
        "found": float(track.found.mean()),
        "distance_px": float(per_frame[valid].mean()) if valid.any() else float("nan"),
        "on_track": float((valid & (np.nan_to_num(per_frame, nan=np.inf) <= ON_TRACK_PX)).mean()),
    }


def attribute_rate(track: ShapeTrack, colour: str | None = None, shape: str | None = None) -> float:
    """Fraction of frames that find the shape with this colour (and/or this shape)."""
    hits = track.found.copy()
    if colour is not None:
        hits &= track.colours == COLOUR_NAMES.index(colour)
    if shape is not None:
        hits &= track.shapes == SHAPES.index(shape)
    return float(hits.mean())


def window(track: ShapeTrack, start: int, stop: int) -> ShapeTrack:
    """Frames [start, stop) of a track."""
    return ShapeTrack(*(getattr(track, name)[start:stop] for name in ("found", "centres", "colours", "shapes")))

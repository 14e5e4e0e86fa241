"""Subtitles drawn into frames: Infinity-RoPE's story subtitles (`utils/interactive.py` `add_subtitles`), white
text with a black outline, centred 20 pixels above the bottom, in DejaVu Sans Bold at `max(24, height // 20)`
pixels when the system has it (Pillow's own font otherwise). Frames under 96 pixels high (the tiny models') get a
quarter of their height and a margin of a tenth, so the text stays inside them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path

import numpy as np
import PIL.Image
import PIL.ImageDraw
import PIL.ImageFont

DEJAVU_BOLD = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans-Bold.ttf")
BOTTOM_MARGIN = 20  # pixels between the text and the frame's bottom edge
OUTLINE = 2  # pixels of black around each letter


@cache
def _font(size: int) -> PIL.ImageFont.ImageFont | PIL.ImageFont.FreeTypeFont:
    if DEJAVU_BOLD.is_file():
        return PIL.ImageFont.truetype(str(DEJAVU_BOLD), size)
    return PIL.ImageFont.load_default(size)


def draw_subtitle(frame: np.ndarray, text: str) -> np.ndarray:
    """`frame` (height, width, 3) uint8 with `text` drawn in; a new array."""
    height, width = frame.shape[:2]
    picture = PIL.Image.fromarray(frame)
    draw = PIL.ImageDraw.Draw(picture)
    font = _font(min(max(24, height // 20), max(6, height // 4)))
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    x, y = (width - (right - left)) // 2 - left, height - bottom - min(BOTTOM_MARGIN, height // 10)
    draw.text((x, y), text, font=font, fill=(255, 255, 255), stroke_width=OUTLINE, stroke_fill=(0, 0, 0))
    return np.asarray(picture)


def subtitle_overlay(spans: Sequence[tuple[int, int, str]]) -> Callable[[np.ndarray, int], np.ndarray] | None:
    """What `write_video(..., overlay=)` takes: `(frames, first_frame) -> frames` drawing each span's text on the
    frames `[start, end)` it covers (video frame numbers); None when there is nothing to draw. Its `fingerprint`
    (the spans) goes into a resumable run's state, so a resume with other subtitles is refused."""
    if not spans:
        return None

    def overlay(frames: np.ndarray, first_frame: int) -> np.ndarray:
        frames = frames.copy()
        for index in range(len(frames)):
            texts = [text for start, end, text in spans if start <= first_frame + index < end]
            if texts:
                frames[index] = draw_subtitle(frames[index], texts[0])
        return frames

    overlay.fingerprint = [list(span) for span in spans]
    return overlay

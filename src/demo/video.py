"""The video as the page shows it while it grows, and the finished video: one mp4 segment per chunk, in a folder of
its own, and one picture per chunk for the live preview.

The live preview is an image updated in place (`preview`: the chunk's frames as an animated GIF that plays once),
so the page's player is never re-created while the video grows. Streaming (`gr.Video(streaming=True)`), the page
also gets each new segment and plays them one after another. Without it, the page gets the finished video once, at
the end: the segments joined by stream copy (no re-encoding, `video_writer.concat_mp4`). Each chunk is encoded
alone, so equal chunks give byte-equal segments.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from types import TracebackType

import numpy as np
import PIL.Image

from ..pipelines.io.video_writer import StreamingVideoWriter, concat_mp4

PREVIEW_SIDE = 256  # the preview's longer side in pixels: tiny frames are enlarged (nearest pixel) to be seen


class VideoSoFar:
    """`add` each chunk's frames, `preview` them; `finished` joins the video; leaving the `with` block deletes it
    all (the page has its own copies by then)."""

    def __init__(self, fps: int, streaming: bool) -> None:
        self.fps = fps
        self.streaming = streaming
        self.folder = Path(tempfile.mkdtemp(prefix="rolldiff-demo-"))
        self._segments: list[Path] = []

    @property
    def segments(self) -> list[Path]:
        return list(self._segments)

    def add(self, frames: np.ndarray) -> Path:
        """Encode `frames` `(frames, height, width, 3)` uint8 as the next segment and return it."""
        segment = self.folder / f"segment-{len(self._segments):05d}.mp4"
        with StreamingVideoWriter(segment, fps=self.fps) as writer:
            writer.write(frames)
        self._segments.append(segment)
        return segment

    def preview(self, frames: np.ndarray) -> Path:
        """The chunk's frames as an animated GIF at the video's fps that plays once and stays on its last frame."""
        path = self.folder / f"preview-{len(self._segments):05d}.gif"
        height, width = frames.shape[1:3]
        scale = max(1, PREVIEW_SIDE // max(height, width))
        pictures = [
            PIL.Image.fromarray(frame).resize((width * scale, height * scale), PIL.Image.Resampling.NEAREST)
            for frame in frames
        ]
        duration = max(20, round(1000 / self.fps))  # browsers play GIF delays below 20 ms slower
        pictures[0].save(path, save_all=True, append_images=pictures[1:], duration=duration, disposal=1)
        return path

    def finished(self) -> Path | None:
        """The whole video so far as one mp4 (the segments joined, no re-encoding); None before any chunk."""
        if not self._segments:
            return None
        joined = self.folder / "video.mp4"
        concat_mp4(self._segments, joined)
        return joined

    def __enter__(self) -> VideoSoFar:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

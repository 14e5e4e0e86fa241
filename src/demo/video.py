"""The video as the page shows it while it grows: one mp4 segment per chunk, in a folder of its own.

Streaming (`gr.Video(streaming=True)`), the page gets each new segment and plays them one after another. Without
it, the page gets the whole video so far after every chunk: the segments joined by stream copy (no re-encoding,
`video_writer.concat_mp4`). Each chunk is encoded alone, so equal chunks give byte-equal segments.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from types import TracebackType

import numpy as np

from ..pipelines.io.video_writer import StreamingVideoWriter, concat_mp4


class VideoSoFar:
    """`add` each chunk's frames; `shown` once the page has the file; leave the `with` block to delete it all."""

    def __init__(self, fps: int, streaming: bool) -> None:
        self.fps = fps
        self.streaming = streaming
        self.folder = Path(tempfile.mkdtemp(prefix="rolldiff-demo-"))
        self._segments: list[Path] = []

    def add(self, frames: np.ndarray) -> Path:
        """Encode `frames` `(frames, height, width, 3)` uint8 as the next segment; the file the page gets now."""
        index = len(self._segments)
        segment = self.folder / f"segment-{index:05d}.mp4"
        with StreamingVideoWriter(segment, fps=self.fps) as writer:
            writer.write(frames)
        self._segments.append(segment)
        if self.streaming:
            return segment
        joined = self.folder / f"video-{index:05d}.mp4"
        concat_mp4(self._segments, joined)
        return joined

    def shown(self, path: Path) -> None:
        """Gradio copied `path` into its cache before asking for the next chunk: a joined video can go now."""
        if not self.streaming:
            path.unlink()

    def __enter__(self) -> VideoSoFar:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

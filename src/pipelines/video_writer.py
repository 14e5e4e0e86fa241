"""Write a video to an mp4 file as its frames arrive, in constant memory.

A thin context manager over `imageio_ffmpeg.write_frames`: every `write` pipes its frames straight to an ffmpeg
process (H.264, yuv420p) and keeps none of them; leaving the `with` block, normally or by an exception,
finishes the file so the frames written so far form a valid, playable mp4.
"""

import math
import numbers
import os
from collections.abc import Generator
from fractions import Fraction
from pathlib import Path
from types import TracebackType

import imageio_ffmpeg
import numpy as np


class StreamingVideoWriter:
    """Streaming mp4 writer: `write` chunks of uint8 RGB frames, `close` (or leave the `with` block) to finish.

    Frames are encoded at their own size: no resizing and no padding (ffmpeg's `macro_block_size` alignment is
    turned off). yuv420p, the pixel format every player reads, needs an even width and height, so odd sizes are
    refused with an error instead of being silently rescaled. The ffmpeg process starts at the first `write`,
    which fixes the frame size; a writer closed before any frame leaves no file.

    Args:
        path: the `.mp4` file to create (overwritten if it exists); its folder must exist.
        fps: frames per second, > 0 (a `Fraction` such as `Fraction(30000, 1001)` is kept exact).
        quality: 1 (smallest file) to 10 (best), imageio's scale; with libx264 it sets `crf = int((1 - q/10) * 51)`.
        codec: the ffmpeg video encoder.

    Example:
        with StreamingVideoWriter("out.mp4", fps=16) as writer:
            for chunk in chunks:  # (frames, height, width, 3) uint8
                writer.write(chunk)
    """

    def __init__(
        self, path: str | os.PathLike, fps: float | Fraction, quality: float = 5.0, codec: str = "libx264"
    ) -> None:
        path = Path(path)
        if path.suffix.lower() != ".mp4":
            raise ValueError(f"`path` must end in .mp4, got {str(path)!r}.")
        if not path.parent.is_dir():
            raise ValueError(f"`path`'s folder {str(path.parent)!r} does not exist.")
        if isinstance(fps, bool) or not isinstance(fps, numbers.Real) or not (math.isfinite(fps) and fps > 0):
            raise ValueError(f"`fps` must be a finite number > 0, got {fps!r}.")
        if isinstance(quality, bool) or not isinstance(quality, numbers.Real) or not 1 <= quality <= 10:
            raise ValueError(f"`quality` must be between 1 and 10, got {quality!r}.")
        self.path = path
        self.fps = fps if isinstance(fps, Fraction) else float(fps)
        self.quality = float(quality)
        self.codec = codec
        self.frames_written = 0
        self.frame_size: tuple[int, int] | None = None  # (height, width), fixed by the first write
        self._encoder: Generator[None, np.ndarray | None, None] | None = None
        self._closed = False

    def write(self, frames: np.ndarray) -> None:
        """Encode `frames` now and keep none of them.

        Args:
            frames: `(frames, height, width, 3)` uint8 RGB. Height and width must be even and the same for every
                call. Validated in full before any of its frames is written.
        """
        if self._closed:
            raise RuntimeError(f"StreamingVideoWriter for {str(self.path)!r} is closed; open a new one to write.")
        if not isinstance(frames, np.ndarray):
            raise ValueError(f"`frames` must be a numpy array, got {type(frames).__name__}.")
        if frames.dtype != np.uint8:
            raise ValueError(f"`frames` must have dtype uint8 (values 0-255), got {frames.dtype}.")
        if frames.ndim != 4 or frames.shape[-1] != 3:
            raise ValueError(f"`frames` must have shape (frames, height, width, 3), got {frames.shape}.")
        height, width = frames.shape[1:3]
        if height == 0 or width == 0 or height % 2 or width % 2:
            raise ValueError(f"`frames` height and width must be even and > 0 (yuv420p), got {height}x{width}.")
        if self.frame_size is not None and (height, width) != self.frame_size:
            raise ValueError(
                f"`frames` must keep the video's size (height, width) = {self.frame_size}, got {(height, width)}."
            )

        if self._encoder is None:
            self._open(height, width)
        for frame in frames:
            self._encoder.send(np.ascontiguousarray(frame))  # (height, width, 3), copied only if strided
            self.frames_written += 1

    def _open(self, height: int, width: int) -> None:
        """Start ffmpeg for frames of `height` x `width`."""
        self._encoder = imageio_ffmpeg.write_frames(
            str(self.path),
            size=(width, height),
            fps=self.fps,
            quality=self.quality,
            codec=self.codec,
            pix_fmt_in="rgb24",
            pix_fmt_out="yuv420p",
            macro_block_size=1,  # no rescaling; yuv420p's even-size rule is checked in `write`
        )
        self._encoder.send(None)  # run the generator up to its first `yield`
        self.frame_size = (height, width)

    def close(self) -> None:
        """Finish the file: ffmpeg flushes its buffered frames and writes the mp4 index. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._encoder is not None:
            self._encoder.close()  # closes ffmpeg's stdin and waits for it to exit
            self._encoder = None

    def __enter__(self) -> "StreamingVideoWriter":
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # Finish the file on errors too, so the frames written before the error stay a playable video.
        self.close()

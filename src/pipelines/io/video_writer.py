"""Write a video to an mp4 file as its frames arrive, in constant memory, without ever losing an earlier file.

A thin context manager over `imageio_ffmpeg.write_frames`: every `write` pipes its frames straight to an ffmpeg
process (H.264, yuv420p) and keeps none of them. The frames go to a hidden temporary file beside the target
(`.video.mp4.<random>.tmp.mp4`), which is renamed onto the target only when the `with` block ends normally, so an
hour-long run that fails or is interrupted (Ctrl-C) never replaces a finished video. On failure the frames done
are finished into a playable mp4 under a distinct name, `video.partial.mp4` (`partial_path_for`), and the
exception carries a note that names it. `continue_from` prepends an earlier partial file by stream copy (no
re-encoding), which is how a resumed generation ends as one file.
"""

import os
import re
import secrets
import subprocess
import tempfile
from collections.abc import Generator
from fractions import Fraction
from pathlib import Path
from types import TracebackType

import imageio_ffmpeg
import numpy as np

from ...checks import check_int, check_number


def partial_path_for(path: str | os.PathLike) -> Path:
    """Where the frames of a failed or interrupted run to `path` are kept: `video.mp4` -> `video.partial.mp4`."""
    path = Path(path)
    return path.with_name(f"{path.stem}.partial{path.suffix}")


def check_quality(quality: float) -> float:
    """imageio's encoder quality: a number from 1 (smallest file) to 10 (lossless with libx264)."""
    return check_number("quality", quality, 1, 10, hint="1: smallest file, 10: lossless")


def check_output_path(path: str | os.PathLike, name: str = "path") -> Path:
    """Refuse an output `path` that cannot be written, before any work: not .mp4, a folder, a missing or
    read-only folder. `name` is the argument named in the message (`--out` for the command)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"`{name}` {str(path)!r} is a folder; give a file name such as {str(path / 'video.mp4')!r}.")
    if path.suffix.lower() != ".mp4":
        raise ValueError(f"`{name}` must end in .mp4, got {str(path)!r}.")
    if not path.parent.is_dir():
        raise ValueError(f"`{name}`'s folder {str(path.parent)!r} does not exist.")
    try:  # a real write, not os.access: root passes that check and still cannot write under /proc
        probe = _temp_path_for(path)
        probe.open("xb").close()
        probe.unlink()
    except OSError as error:
        raise ValueError(f"`{name}`'s folder {str(path.parent)!r} is not writable: {error.strerror}.") from None
    return path


def _temp_path_for(path: Path) -> Path:
    """A fresh hidden file name beside `path`; creating it (mode "xb") fails rather than reuse one."""
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp.mp4")


def count_frames(path: str | os.PathLike) -> int:
    """Frames in an mp4, counted from its packets by stream copy (fast: nothing is decoded)."""
    command = [imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-stats", "-i", str(path), "-map", "0:v:0"]
    result = subprocess.run(command + ["-c", "copy", "-f", "null", "-"], capture_output=True, text=True)
    counts = re.findall(r"frame=\s*(\d+)", result.stderr)
    if result.returncode != 0 or not counts:
        raise ValueError(f"{str(path)!r} is not a readable video: {result.stderr.strip()[-300:]}")
    return int(counts[-1])


def _causal_encoding(codec: str) -> list[str]:
    """Encoder options under which every frame depends only on earlier ones. No B-frames: parts join by stream
    copy with clean timestamps (`concat_mp4`). For x264 also no lookahead and no macroblock tree, which otherwise
    tune a frame's quantisers to the frames after it: the first n frames of a video are then bit for bit those
    of any longer video with the same start, so a resumed video keeps the interrupted run's frames exactly."""
    params = ["-bf", "0"]
    if codec == "libx264":
        params += ["-x264-params", "rc-lookahead=0:mbtree=0"]
    return params


def _first_frames(path: Path, num_frames: int, out: Path) -> None:
    """The first `num_frames` frames of `path` into `out` by stream copy; exact because the writer makes no
    B-frames (every frame depends only on earlier ones)."""
    command = [imageio_ffmpeg.get_ffmpeg_exe(), "-y", "-v", "error", "-i", str(path), "-map", "0:v:0"]
    command += ["-frames:v", str(num_frames), "-c", "copy", str(out)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ffmpeg could not cut {str(path)!r} to {num_frames} frames: {result.stderr.strip()}")


def concat_mp4(parts: list[Path], out: Path) -> None:
    """Join mp4 files of the same size, fps and codec into `out` by stream copy (no re-encoding, no quality loss)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", dir=out.parent, delete=False) as listing:
        for part in parts:  # the concat demuxer's quoting: single quotes, a quote written as '\''
            listing.write("file '" + str(Path(part).resolve()).replace("'", "'\\''") + "'\n")
    try:
        command = [imageio_ffmpeg.get_ffmpeg_exe(), "-y", "-v", "error", "-f", "concat", "-safe", "0"]
        command += ["-i", listing.name, "-c", "copy", "-movflags", "+faststart", str(out)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"ffmpeg could not join {[str(p) for p in parts]}: {result.stderr.strip()}")
    finally:
        os.unlink(listing.name)


def frames_to_uint8(frames) -> np.ndarray:
    """Frames in [0, 1] (a float array of any shape, e.g. a pipeline's `output_type="np"` frames) as uint8 0-255,
    rounded to nearest and clipped: what `StreamingVideoWriter.write` takes."""
    return (np.asarray(frames) * 255.0).round().clip(0, 255).astype(np.uint8)


class StreamingVideoWriter:
    """Streaming mp4 writer: `write` chunks of uint8 RGB frames, `close` (or leave the `with` block) to finish.

    Frames are encoded at their own size: no resizing and no padding (ffmpeg's `macro_block_size` alignment is
    turned off). yuv420p, the pixel format every player reads, needs an even width and height, so odd sizes are
    refused with an error instead of being silently rescaled. The ffmpeg process starts at the first `write`,
    which fixes the frame size; a writer closed before any frame leaves no file and leaves `path` as it was.

    Args:
        path: the `.mp4` file to create. An existing file is replaced only when the writer closes normally.
        fps: frames per second, > 0 (a `Fraction` such as `Fraction(30000, 1001)` is kept exact).
        quality: 1 (smallest file) to 10 (best), imageio's scale; with libx264 it sets `crf = int((1 - q/10) * 51)`,
            so 10 is lossless (after yuv420p's chroma subsampling).
        codec: the ffmpeg video encoder.
        continue_from: an mp4 written earlier by this writer with the same fps and size (a resumed run's
            partial file); the result is its frames followed by the new ones.
        continue_frames: keep only the first `continue_frames` frames of `continue_from` (the frames a resume
            state vouches for; a run killed after writing a chunk but before saving its state wrote more).

    After a failure, `partial_path` is the playable file holding every frame written (None when there was none).

    Example:
        with StreamingVideoWriter("out.mp4", fps=16) as writer:
            for chunk in chunks:  # (frames, height, width, 3) uint8
                writer.write(chunk)
    """

    def __init__(
        self,
        path: str | os.PathLike,
        fps: float | Fraction,
        quality: float = 5.0,
        codec: str = "libx264",
        continue_from: str | os.PathLike | None = None,
        continue_frames: int | None = None,
    ) -> None:
        path = check_output_path(path)
        if continue_from is not None and not Path(continue_from).is_file():
            raise ValueError(f"`continue_from` {str(continue_from)!r} is not a file.")
        if continue_frames is not None:
            if continue_from is None:
                raise ValueError("`continue_frames` comes with `continue_from` (the file whose frames it counts).")
            check_int("continue_frames", continue_frames, 0)
        if not isinstance(fps, Fraction):
            check_number("fps", fps, 0, above=True)
        check_quality(quality)
        self.path = path
        self.continue_from = None if continue_from is None else Path(continue_from)
        if continue_from is not None and continue_frames is None:
            continue_frames = count_frames(continue_from)
        self.continue_frames = continue_frames
        self.partial_path: Path | None = None
        # Created now (so an unwritable folder fails before any work) and hidden; ffmpeg overwrites it.
        self.temp_path = _temp_path_for(path)
        self.temp_path.open("xb").close()  # not mkstemp: its 0600 mode would carry over to the finished video
        self.fps = fps if isinstance(fps, Fraction) else float(fps)
        self.quality = float(quality)
        self.codec = codec
        self.frames_written = 0
        self.frame_size: tuple[int, int] | None = None  # (height, width), fixed by the first write
        self._encoder: Generator[None, np.ndarray | None, None] | None = None
        self._closed = False

    @property
    def total_frames(self) -> int:
        """Frames of the finished file: those kept from `continue_from` and those written."""
        return (self.continue_frames or 0) + self.frames_written

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
            str(self.temp_path),
            size=(width, height),
            fps=self.fps,
            quality=self.quality,
            codec=self.codec,
            pix_fmt_in="rgb24",
            pix_fmt_out="yuv420p",
            macro_block_size=1,  # no rescaling; yuv420p's even-size rule is checked in `write`
            output_params=_causal_encoding(self.codec),
        )
        self._encoder.send(None)  # run the generator up to its first `yield`
        self.frame_size = (height, width)

    def close(self) -> None:
        """Finish the file and move it onto `path` (ffmpeg flushes and writes the mp4 index). Safe to call twice."""
        self._finish(succeeded=True)

    def abort(self) -> Path | None:
        """Finish the frames written so far as `partial_path` and leave `path` untouched; returns `partial_path`."""
        self._finish(succeeded=False)
        return self.partial_path

    def _finish(self, succeeded: bool) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._encoder is not None:
                self._encoder.close()  # closes ffmpeg's stdin and waits for it to exit
                self._encoder = None
            kept = self.continue_from is not None and self.continue_frames != 0
            if self.frames_written == 0 and not kept:
                return
            target = self.path if succeeded else partial_path_for(self.path)
            if self.continue_from is not None:
                joined = self.temp_path.with_name(self.temp_path.name.replace(".tmp.mp4", ".joined.tmp.mp4"))
                first = self.continue_from
                cut = self.temp_path.with_name(self.temp_path.name.replace(".tmp.mp4", ".cut.tmp.mp4"))
                try:
                    if self.continue_frames is not None:
                        _first_frames(self.continue_from, self.continue_frames, cut)
                        first = cut
                    parts = ([first] if kept else []) + ([self.temp_path] if self.frames_written else [])
                    concat_mp4(parts, joined)
                    os.replace(joined, self.temp_path)
                finally:
                    joined.unlink(missing_ok=True)
                    cut.unlink(missing_ok=True)
            os.replace(self.temp_path, target)
            if not succeeded:
                self.partial_path = target
        finally:
            self.temp_path.unlink(missing_ok=True)

    def __enter__(self) -> "StreamingVideoWriter":
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc_value is None:
            self.close()
            return
        # Failed or interrupted: the frames done become a playable partial file; `path` keeps what it held.
        partial = self.abort()
        if partial is not None:
            exc_value.add_note(
                f"The frames made before this error are kept in {str(partial)!r}; {str(self.path)!r} was not touched."
            )

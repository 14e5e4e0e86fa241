"""Read what an image- or video-to-video generation is conditioned on: a start image, or an input video streamed
frame by frame (a file, an array, or any iterator of frames, a webcam included), as `[-1, 1]` pixel tensors ready
for `StreamingWanEncoder`.

Every picture takes one path: validated, made an 8-bit RGB PIL image (lossless for uint8 input; a float input in
[0, 1] is rounded to 8 bits, the precision of every video file and PIL image), then resized to (height, width) by
diffusers' `VideoProcessor.preprocess` (Lanczos). Its `resize_mode` is "default" here, as in diffusers'
`WanImageToVideoPipeline` and `WanVideoToVideoPipeline`: the picture is stretched to the size and the aspect
ratio may change; "crop" keeps the aspect ratio and centre-crops the excess, "fill" keeps it and pads.
A video is never held whole in memory: a file is decoded by ffmpeg through a pipe (imageio-ffmpeg), one frame at
a time as chunks are asked for.
"""

import itertools
import os
from collections.abc import Iterable, Iterator, Sized
from pathlib import Path
from types import TracebackType

import imageio_ffmpeg
import numpy as np
import PIL.Image
import torch
from diffusers.video_processor import VideoProcessor
from einops import rearrange, repeat

from ...checks import check_int
from .video_writer import count_frames

Picture = PIL.Image.Image | np.ndarray | torch.Tensor | str | os.PathLike
RESIZE_MODES = ("default", "crop", "fill")

# vae_scale_factor=1: the processor would otherwise round (height, width) down to its multiples without a word;
# the pipeline checks the sizes against its VAE instead.
_PROCESSOR = VideoProcessor(vae_scale_factor=1)
_END = object()  # what `next(frames, _END)` returns when a source is exhausted


def _check_output_args(batch_size: int, height: int, width: int, resize_mode: str) -> None:
    check_int("batch_size", batch_size)
    check_int("height", height)
    check_int("width", width)
    if resize_mode not in RESIZE_MODES:
        raise ValueError(f"`resize_mode` must be one of {RESIZE_MODES}, got {resize_mode!r}.")


def _check_pixel_values(pixels: np.ndarray, name: str) -> None:
    """uint8 (0-255) or float in [0, 1], finite: what diffusers' image processor takes."""
    if pixels.dtype == np.uint8:
        return
    if not np.issubdtype(pixels.dtype, np.floating):
        raise ValueError(f"{name} has dtype {pixels.dtype}; allowed: uint8 (0-255) or float (0-1).")
    if not np.isfinite(pixels).all():
        raise ValueError(f"{name} holds NaN or infinite values.")
    low, high = (float(pixels.min()), float(pixels.max())) if pixels.size else (0.0, 0.0)
    if low < 0.0 or high > 1.0:
        raise ValueError(
            f"{name} is float with values in [{low:.3g}, {high:.3g}]; float pixels must be in [0, 1] "
            "(divide 0-255 values by 255, or map [-1, 1] with (x + 1) / 2)."
        )


def _to_numpy(pixels: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(pixels, torch.Tensor):
        pixels = pixels.detach().cpu()
        return (pixels.float() if pixels.is_floating_point() else pixels).numpy()  # numpy has no bfloat16
    return pixels


def _to_pil(picture: Picture, name: str, values_checked: bool = False) -> PIL.Image.Image:
    """One RGB 8-bit picture from a PIL image or an `(H, W, 3)` array/tensor, validated; `name` is how errors call
    it ("`image`", "frame 12 of `video`"). `values_checked`: a frame of an array whose values were checked whole
    (`_check_video_array`), not scanned again."""
    if isinstance(picture, PIL.Image.Image):
        return picture if picture.mode == "RGB" else picture.convert("RGB")
    if isinstance(picture, (str, os.PathLike)):  # a picture file, as `video=` takes a video file
        if not os.path.isfile(picture):
            raise ValueError(f"{name} {str(picture)!r} is not a file.")
        try:
            return read_image(picture)
        except ValueError as exc:
            raise ValueError(f"{name} {str(picture)!r} cannot be read as a picture: {exc}") from None
    if not isinstance(picture, (np.ndarray, torch.Tensor)):
        raise ValueError(
            f"{name} must be a PIL image, a picture file's path, a numpy array or a torch tensor, got "
            f"{type(picture).__name__}."
        )
    pixels = _to_numpy(picture)
    if pixels.ndim != 3 or pixels.shape[-1] != 3:
        raise ValueError(f"{name} must have shape (height, width, 3) (RGB), got {tuple(pixels.shape)}.")
    if pixels.shape[0] == 0 or pixels.shape[1] == 0:
        raise ValueError(f"{name} is empty: shape {tuple(pixels.shape)}.")
    if not values_checked:
        _check_pixel_values(pixels, name)
    if pixels.dtype != np.uint8:
        pixels = np.round(pixels * 255.0).astype(np.uint8)
    return PIL.Image.fromarray(np.ascontiguousarray(pixels))


def _preprocess(pictures: list[PIL.Image.Image], height: int, width: int, resize_mode: str) -> torch.Tensor:
    """`(n, 3, height, width)` float32 in [-1, 1]."""
    return _PROCESSOR.preprocess(pictures, height=height, width=width, resize_mode=resize_mode)


def _channels_last(image: torch.Tensor, name: str, batch_sizes: tuple[int, ...]) -> torch.Tensor:
    """An image tensor in diffusers' layout, `(3, H, W)` or `(n, 3, H, W)` with n in `batch_sizes`, as
    `(n, H, W, 3)`."""
    if image.ndim == 3:
        image = image.unsqueeze(0)
    if image.ndim != 4 or image.shape[1] != 3 or image.shape[0] not in batch_sizes:
        leading = " or ".join(f"({n}, 3, height, width)" for n in batch_sizes)
        raise ValueError(
            f"{name} tensor must have shape (3, height, width) or {leading} (RGB, channels first), "
            f"got {tuple(image.shape)}."
        )
    return rearrange(image, "n c h w -> n h w c")


def _image_list(image: Picture | list[Picture], batch_size: int) -> list[tuple[Picture, str]]:
    """The start image(s), each PIL or `(H, W, 3)`, with their names for errors."""
    if isinstance(image, (list, tuple)):
        if len(image) not in (1, batch_size):
            raise ValueError(
                f"`image` is a list of {len(image)} images for a batch of {batch_size}; give one per batch element "
                "or a single image for all."
            )
        names = [f"`image[{i}]`" for i in range(len(image))]
        return [
            (_channels_last(picture, name, (1,))[0] if isinstance(picture, torch.Tensor) else picture, name)
            for picture, name in zip(image, names)
        ]
    if isinstance(image, torch.Tensor):
        pictures = _channels_last(image, "`image`", tuple(sorted({1, batch_size})))
        names = ["`image`"] if len(pictures) == 1 else [f"`image[{i}]`" for i in range(len(pictures))]
        return list(zip(pictures, names))
    return [(image, "`image`")]


def read_image(path: str | os.PathLike) -> PIL.Image.Image:
    """The picture in the file at `path` as an RGB PIL image, read whole now (a broken file fails here, before any
    work); a ValueError with PIL's reason when it cannot be read (missing, not a picture, truncated)."""
    try:
        with PIL.Image.open(path) as picture:
            return picture.convert("RGB")
    except (OSError, SyntaxError, ValueError) as exc:  # PIL's UnidentifiedImageError is an OSError
        raise ValueError(str(exc)) from exc


def load_start_image(
    image: Picture | list[Picture], batch_size: int, height: int, width: int, resize_mode: str = "default"
) -> torch.Tensor:
    """The start frame of an image-to-video generation as a one-frame video.

    Args:
        image: a PIL image; the path of a picture file (read now); an `(height, width, 3)` numpy array, uint8
            (0-255) or float (0-1); a `(3, height, width)` or `(1, 3, height, width)` tensor, uint8 or float in
            [0, 1] (diffusers' layout; also `(batch_size, 3, height, width)`, one per batch element); or a list of
            `batch_size` of these, one per batch element. A single image (or a list of one) is used for every batch
            element.
        batch_size: the generation's batch size.
        height, width: the output size in pixels; the image is resized to it (see the module docstring).
        resize_mode: "default" (stretch, diffusers' Wan image-to-video), "crop" or "fill".

    Returns:
        `(batch_size, 3, 1, height, width)` float32 in [-1, 1] on the CPU.
    """
    _check_output_args(batch_size, height, width, resize_mode)
    if image is None or (isinstance(image, (list, tuple)) and not image):
        raise ValueError("`image` must be a picture (PIL image, array or tensor) or a list of them, got nothing.")
    pictures = [_to_pil(picture, name) for picture, name in _image_list(image, batch_size)]
    images = _preprocess(pictures, height, width, resize_mode)  # (1 or batch_size, 3, height, width)
    return repeat(images, "n c h w -> (n b) c 1 h w", b=batch_size // len(pictures))


def _open_file(path: Path) -> tuple[Iterator[np.ndarray], Iterator[bytes], dict]:
    """ffmpeg decoding `path` through a pipe: its frames as `(height, width, 3)` uint8 arrays, one at a time, the
    reader to close (it stops ffmpeg) and the file's metadata."""
    if not path.is_file():
        raise ValueError(f"`video` {str(path)!r} is not a file.")
    reader = imageio_ffmpeg.read_frames(str(path), pix_fmt="rgb24")
    try:
        meta = next(reader)  # starts ffmpeg and reads the header: an unreadable file fails here
    except (OSError, RuntimeError, StopIteration) as error:
        reader.close()
        raise ValueError(f"`video` {str(path)!r} is not a readable video: {str(error).splitlines()[0]}") from None
    width, height = meta["size"]
    frames = (np.frombuffer(data, dtype=np.uint8).reshape(height, width, 3) for data in reader)
    return frames, reader, meta


def _check_video_array(video: np.ndarray | torch.Tensor) -> np.ndarray:
    """A whole `(frames, height, width, 3)` array, validated before any work."""
    pixels = _to_numpy(video)
    if pixels.ndim != 4 or pixels.shape[-1] != 3:
        raise ValueError(
            f"`video` array must have shape (frames, height, width, 3) (RGB, channels last), got {tuple(pixels.shape)}."
        )
    if 0 in pixels.shape[1:3]:
        raise ValueError(f"`video` frames are empty: shape {tuple(pixels.shape)}.")
    _check_pixel_values(pixels, "`video`")
    return pixels


def num_frames_available(video: str | os.PathLike | np.ndarray | torch.Tensor | Iterable) -> int | None:
    """Frames `video` holds, where that is knowable without reading it: an array's first dim, a file's frame
    count (ffmpeg counts its packets: nothing is decoded), a list's length; None for an iterator (a webcam)."""
    if isinstance(video, (str, os.PathLike)):
        if not Path(video).is_file():
            raise ValueError(f"`video` {str(video)!r} is not a file.")
        return count_frames(video)
    if isinstance(video, (np.ndarray, torch.Tensor)):
        return int(video.shape[0]) if video.ndim == 4 else None
    return len(video) if isinstance(video, Sized) else None


class VideoInput:
    """An input video read chunk by chunk as `[-1, 1]` frames of one size, in constant memory.

    `video` is a file path (decoded lazily by ffmpeg), a `(frames, height, width, 3)` numpy array or tensor
    (uint8 0-255, or float in [0, 1]), or any iterable of frames, endless ones included (a generator of
    `(height, width, 3)` arrays, tensors or PIL images, e.g. a webcam's). What can be checked before any work is:
    the path, an array as a whole; an iterator's frames are checked as they arrive, and a frame whose size,
    channels, dtype or values are wrong raises an error naming its index. Frames are resized to
    (height, width) like `load_start_image` and repeated over the batch.

    Closing (`close()`, or leaving the `with` block) stops ffmpeg for a file and closes an iterator that has a
    `close()` (a generator's `finally` runs: the webcam is released).

    Example:
        with VideoInput("input.mp4", height=480, width=832) as video:
            chunk = video.next_chunk(9)  # (1, 3, 9, 480, 832), then 12 at a time
    """

    def __init__(
        self,
        video: str | os.PathLike | np.ndarray | torch.Tensor | Iterable,
        height: int,
        width: int,
        batch_size: int = 1,
        resize_mode: str = "default",
    ) -> None:
        _check_output_args(batch_size, height, width, resize_mode)
        self.height, self.width, self.batch_size, self.resize_mode = height, width, batch_size, resize_mode
        self.fps: float | None = None  # a file's frame rate (None if unknown or not a file)
        self._source = None  # what `close()` closes
        self._values_checked = False  # an array's values are checked whole here, not again frame by frame
        if isinstance(video, (str, os.PathLike)):
            self._frames, self._source, meta = _open_file(Path(video))
            self.fps = float(meta["fps"]) or None
        elif isinstance(video, (np.ndarray, torch.Tensor)):
            self._frames = iter(_check_video_array(video))
            self._values_checked = True
        elif isinstance(video, Iterable):
            self._frames = iter(video)
            self._source = video
        else:
            raise ValueError(
                "`video` must be a file path, a (frames, height, width, 3) array or tensor, or an iterable of "
                f"frames, got {type(video).__name__}."
            )
        self.frames_read = 0  # frames taken from the input so far (returned or skipped): the position
        self._frame_size: tuple[int, int] | None = None  # (height, width) of the input's frames, from the first
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("This VideoInput is closed; open a new one to read the video again.")

    def _next_picture(self) -> PIL.Image.Image | None:
        """The next input frame as an RGB PIL image, validated; None at the end."""
        frame = next(self._frames, _END)
        if frame is _END:
            return None
        name = f"frame {self.frames_read} of `video`"
        picture = _to_pil(frame, name, self._values_checked)
        size = (picture.height, picture.width)
        if self._frame_size is not None and size != self._frame_size:
            raise ValueError(
                f"{name} is {size[0]}x{size[1]} (height x width), but the frames before it are "
                f"{self._frame_size[0]}x{self._frame_size[1]}; every frame of a video must have the same size."
            )
        self._frame_size = size
        self.frames_read += 1
        return picture

    def next_chunk(self, num_frames: int) -> torch.Tensor | None:
        """The next `num_frames` frames, `(batch_size, 3, n, height, width)` float32 in [-1, 1] on the CPU.

        `n == num_frames` unless the input ends first (then `n` is what was left; the caller decides whether a
        short chunk is usable); None once the input has ended.
        """
        self._check_open()
        check_int("num_frames", num_frames)
        pictures = []
        while len(pictures) < num_frames and (picture := self._next_picture()) is not None:
            pictures.append(picture)
        if not pictures:
            return None
        frames = _preprocess(pictures, self.height, self.width, self.resize_mode)  # (n, 3, height, width)
        return repeat(frames, "f c h w -> b c f h w", b=self.batch_size)

    def skip(self, num_frames: int) -> None:
        """Read past `num_frames` frames without decoding them into tensors (to resume part-way through a video).

        Raises:
            ValueError: the input ended before `num_frames` frames (`frames_read` is then at its end).
        """
        self._check_open()
        check_int("num_frames", num_frames, 0)
        skipped = sum(1 for _ in itertools.islice(self._frames, num_frames))
        self.frames_read += skipped
        if skipped < num_frames:
            raise ValueError(
                f"`video` ended after {self.frames_read} frames; cannot skip {num_frames} frames from frame "
                f"{self.frames_read - skipped}."
            )

    def close(self) -> None:
        """Stop reading: ffmpeg exits, an iterator with `close()` is closed. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        close = getattr(self._source, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> "VideoInput":
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

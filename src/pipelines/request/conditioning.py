"""Image-to-video and streamed video-to-video: what a `ChunkStream` is conditioned on besides the text.

- `image=` (a start frame): the image, repeated to fill the first chunk's pixel frames (Krea Realtime's
  `setup_start_frame` does this with 9 frames for a 3-latent-frame chunk), is encoded by the stream's own causal
  VAE encoder and becomes the first chunk, clean: it is committed by the usual context pass and decoded like any
  chunk, so frame 0 of the output is the image (up to the VAE round trip) and generation continues from it with
  the usual cache.
- `video=` with `strength` in (0, 1]: each chunk of input frames (1 + t(c-1) for the first chunk, then t*c, for
  VAE temporal factor t and c latent frames a chunk) is encoded chunk by chunk (`StreamingWanEncoder`, its own
  feature cache), noised to the step list's point `strength` with that chunk's own noise (drawn exactly as for
  text-to-video), and denoised from there, as diffusers' `WanVideoToVideoPipeline` does for a whole clip: of N
  steps the last `int(N * strength)` run (at least one). At `strength=1.0` the result is text-to-video with the same
  noise. Memory stays constant in the input's length; the output ends with the input (at its last whole chunk) or
  at `num_frames`, whichever comes first.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from einops import repeat

from ...checks import check_number
from ...choices import DEFAULT_STRENGTH
from ..codecs.streaming_encode import StreamingWanEncoder
from ..io.video_input import VideoInput, load_start_image, num_frames_available

if TYPE_CHECKING:
    from ..video_noise import VideoNoiseMix


def check_strength(strength: Any) -> float:
    return check_number("strength", strength, 0, 1, above=True, hint="1: ignore the input's content")


def resolve_strength(strength: Any) -> float:
    """A call's `strength` (None: diffusers' default), checked."""
    return check_strength(DEFAULT_STRENGTH if strength is None else strength)


def strength_steps(num_steps: int, strength: float) -> int:
    """How many steps a video-to-video chunk runs: the last `int(num_steps * strength)` (at least one), as
    diffusers' `WanVideoToVideoPipeline` cuts its list."""
    return max(1, min(num_steps, int(num_steps * strength)))


def _describe(video: Any) -> str:
    """What identifies an input video in a resume fingerprint."""
    if isinstance(video, (str, os.PathLike)):
        path = os.fspath(video)
        return f"file:{os.path.abspath(path)}:{os.path.getsize(path) if os.path.isfile(path) else -1}"
    if isinstance(video, torch.Tensor):  # summed in float64 without a float64 copy of the whole input
        return f"array:{tuple(video.shape)}:{float(video.sum(dtype=torch.float64))!r}"
    if isinstance(video, np.ndarray):
        return f"array:{tuple(video.shape)}:{float(video.sum(dtype=np.float64))!r}"
    return f"iterator:{type(video).__name__}"


@dataclass(frozen=True)
class Conditioning:
    """A validated start image or input video (one of them), with what identifies it for resume."""

    image: torch.Tensor | None = None  # (batch, 3, 1, height, width) in [-1, 1]
    video: VideoInput | None = None
    strength: float = 1.0
    description: dict = field(default_factory=dict)

    def fingerprint(self) -> dict:
        """What identifies the input in a resume fingerprint (not its pixels, nor an open reader)."""
        return self.description


def build_conditioning(
    image: Any, video: Any, strength: Any, batch_size: int, height: int, width: int, first_chunk_pixels: int
) -> Conditioning | None:
    """Check `image` / `video` / `strength` together before any work; None for plain text-to-video."""
    if image is not None and video is not None:
        raise ValueError("Give either `image` (image-to-video) or `video` (video-to-video), not both.")
    if video is None:
        if strength is not None:
            raise ValueError("`strength` applies to `video=` (video-to-video) only; pass a `video` or drop it.")
        if image is None:
            return None
        pixels = load_start_image(image, batch_size, height, width)
        return Conditioning(image=pixels, description={"image": float(pixels.double().sum())})
    strength = resolve_strength(strength)
    available = num_frames_available(video)
    if available is not None and available < first_chunk_pixels:
        raise ValueError(
            f"`video` has {available} frames; one chunk needs {first_chunk_pixels}. Give a longer video, or fewer "
            "`chunk_frames`."
        )
    return Conditioning(
        video=VideoInput(video, height, width, batch_size),
        strength=strength,
        description={"video": _describe(video), "strength": strength},
    )


class ConditioningInput:
    """The per-stream side of a `Conditioning`: its own encoder, the input's position and, for a video, how its
    chunks are noised (`noise_mix`, a `rolldiff.pipelines.video_noise.VideoNoiseMix`, which sees each chunk's
    pixels as they are read)."""

    def __init__(
        self, conditioning: Conditioning, encoder: StreamingWanEncoder, noise_mix: VideoNoiseMix | None = None
    ) -> None:
        self.conditioning = conditioning
        self.encoder = encoder
        self.noise_mix = noise_mix

    @property
    def is_video(self) -> bool:
        return self.conditioning.video is not None

    def latents(self, chunk_index: int, latent_frames: int) -> torch.Tensor | None:
        """Chunk `chunk_index`'s clean latents from the input `(batch, channels, latent_frames, h, w)`.

        None when this chunk has no input (image-to-video after the first chunk) or the input video has ended
        (fewer frames left than a chunk needs).
        """
        pixels = self.encoder.num_pixel_frames(latent_frames)
        if not self.is_video:
            if chunk_index > 0:
                return None
            frames = repeat(self.conditioning.image[:, :, 0], "b c h w -> b c f h w", f=pixels)
            return self.encoder.encode(frames)
        frames = self.conditioning.video.next_chunk(pixels)
        if frames is None or frames.shape[2] < pixels:
            return None
        if self.noise_mix is not None:
            self.noise_mix.observe(frames)
        return self.encoder.encode(frames)

    def close(self) -> None:
        if self.conditioning.video is not None:
            self.conditioning.video.close()

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {f"encoder.{k}": v for k, v in self.encoder.state_dict().items()}
        frames_read = self.conditioning.video.frames_read if self.is_video else 0
        state["frames_read"] = torch.tensor([frames_read], dtype=torch.int64)
        if self.noise_mix is not None:
            state.update({f"noise_mix.{k}": v for k, v in self.noise_mix.state_dict().items()})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.encoder.load_state_dict({k[8:]: v for k, v in state.items() if k.startswith("encoder.")})
        if self.noise_mix is not None:
            self.noise_mix.load_state_dict({k[10:]: v for k, v in state.items() if k.startswith("noise_mix.")})
        if self.is_video:
            self.conditioning.video.skip(int(state["frames_read"][0]))

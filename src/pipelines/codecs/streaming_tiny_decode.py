"""Causal, chunk-by-chunk decoding (and encoding) with `TinyVideoAutoencoder` (TAEHV), with memory of its own.

Each temporal layer of TAEHV carries a frame or two from one chunk to the next (see the model file), so a stream
owns a dict of those carries: the concatenated chunks equal one `decode` (or `encode`) of the whole clip, while
memory stays that of one chunk (one frame per memory block, at that block's resolution). The model holds no
per-stream state: one `TinyVideoAutoencoder` serves any number of streams.

`StreamingTinyDecoder` has `StreamingWanDecoder`'s interface, so the pipeline can swap one for the other, with one
difference: it takes the transformer's latents as they are (TAEHV works in the diffusion model's normalised
space), not `denormalize_wan_latents(...)` of them. Decoder and encoder keep their state as tensors for resume
(`state_dict` / `load_state_dict`).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import torch
from torch import Tensor

from ...models.tiny_autoencoder import Memory, TinyVideoAutoencoder, check_frames, check_latents

_MEMORY_PREFIX = "memory."


def _placement(autoencoder: TinyVideoAutoencoder, onload: bool = False) -> tuple[torch.device, torch.dtype]:
    """Device and dtype to run on. `onload`: first let an offload hook move the model onto its device, as
    diffusers' `apply_forward_hook` does before `vae.decode`."""
    hook = getattr(autoencoder, "_hf_hook", None)
    if onload and hook is not None and hasattr(hook, "pre_forward"):
        hook.pre_forward(autoencoder)
    weight = next(autoencoder.parameters())
    return weight.device, weight.dtype


def _counter(value: int) -> Tensor:
    return torch.tensor(value, dtype=torch.int64)


class _Stream:
    """What both directions share: the carries, a frame counter, the (batch, height, width) of the stream."""

    _counter_name: str  # the state dict key of the frame counter

    def __init__(self, autoencoder: TinyVideoAutoencoder) -> None:
        self.autoencoder = autoencoder
        self.reset()

    row_state_prefix = _MEMORY_PREFIX  # the `state_dict` entries that hold one row per video (`decode_stacked`)

    @property
    def position_key(self) -> str:
        """The `state_dict` key of the frame counter."""
        return self._counter_name

    def reset(self) -> None:
        """Start a new video: drop the carries and forget the previous video's shape."""
        self._memory: Memory = {}
        self._frames_seen = 0
        self._video_shape: tuple[int, int, int] | None = None  # (batch, height, width) of the inputs

    def _check_video_shape(self, tensor: Tensor, name: str) -> tuple[int, int, int]:
        """The (batch, height, width) of `tensor`, refused if it differs from the current video's."""
        video_shape = (tensor.shape[0], tensor.shape[3], tensor.shape[4])
        if self._video_shape is not None and video_shape != self._video_shape:
            raise ValueError(
                f"`{name}` (batch, height, width) must stay {self._video_shape} within one video, got {video_shape}; "
                "call reset() to start a new video."
            )
        return video_shape

    def _advance(self, memory: Memory, frames: int, video_shape: tuple[int, int, int]) -> None:
        """Commit a finished chunk. Until then the layers wrote into a copy of the carries (they replace entries,
        never write into them), so a chunk that raises leaves the stream as it was."""
        self._memory = memory
        self._frames_seen += frames
        self._video_shape = video_shape

    def state_dict(self) -> dict[str, Tensor]:
        """The stream's state as tensors: the carries (`memory.<layer index>`), the frame counter and, once known,
        `video_shape` (batch, height, width), all counters int64. The carries are replaced, never written into, by
        later calls, so the returned tensors stay valid."""
        state = {f"{_MEMORY_PREFIX}{name}": carry for name, carry in self._memory.items()}
        state[self._counter_name] = _counter(self._frames_seen)
        if self._video_shape is not None:
            state["video_shape"] = torch.tensor(self._video_shape, dtype=torch.int64)
        return state

    def load_state_dict(self, state_dict: Mapping[str, Tensor]) -> None:
        """Resume a stream from `state_dict()`; carries are moved to the model's device and dtype."""
        allowed = {self._counter_name, "video_shape"}
        unknown = sorted(key for key in state_dict if key not in allowed and not key.startswith(_MEMORY_PREFIX))
        if unknown or self._counter_name not in state_dict:
            raise ValueError(
                f"Not a {type(self).__name__} state: unexpected keys {unknown}, counter "
                f"{self._counter_name!r} {'present' if self._counter_name in state_dict else 'missing'}."
            )
        device, dtype = _placement(self.autoencoder)
        self._memory = {
            key.removeprefix(_MEMORY_PREFIX): value.to(device=device, dtype=dtype)
            for key, value in state_dict.items()
            if key.startswith(_MEMORY_PREFIX)
        }
        self._frames_seen = int(state_dict[self._counter_name])
        video_shape = state_dict.get("video_shape")
        self._video_shape = tuple(int(size) for size in video_shape) if video_shape is not None else None


class StreamingTinyDecoder(_Stream):
    """Decode a video's latents a chunk at a time with `TinyVideoAutoencoder`, its carries kept between chunks.

    One instance streams one video at a time; call `reset()` before the next. Runs under `torch.no_grad()`.

    Args:
        autoencoder: the `TinyVideoAutoencoder` to decode with (any dtype, any device).
    """

    _counter_name = "latent_frames_decoded"

    def __init__(self, autoencoder: TinyVideoAutoencoder) -> None:
        # The first latent frame decodes to 1 pixel frame; every later one to `temporal_upsample` frames.
        self.temporal_upsample = autoencoder.temporal_upscale
        super().__init__(autoencoder)

    @property
    def latent_frames_decoded(self) -> int:
        """Latent frames of the current video decoded so far."""
        return self._frames_seen

    def num_pixel_frames(self, latent_frames: int) -> int:
        """Pixel frames the next `decode` of `latent_frames` latent frames will return."""
        first = 1 if self._frames_seen == 0 and latent_frames > 0 else 0
        return first + (latent_frames - first) * self.temporal_upsample

    def stack_key(self, latents: Tensor) -> Hashable | None:
        """What must be equal for decoders to decode their next chunks in one call (`decode_stacked`): the model,
        whether at the video's first frame (its warm-up frames are dropped), the chunk's shape, and each carry's
        name, shape, dtype and device. None: `latents` is not a one-row chunk this decoder would take (it decodes
        alone, and its own `decode` says what is wrong)."""
        channels = self.autoencoder.config.latent_channels
        if latents.ndim != 5 or latents.shape[0] != 1 or latents.shape[1] != channels:
            return None
        if self._video_shape not in (None, (1, *latents.shape[3:])):
            return None
        carries = tuple(sorted((name, tuple(c.shape), c.dtype, c.device) for name, c in self._memory.items()))
        first = self._frames_seen == 0
        return (id(self.autoencoder), first, tuple(latents.shape), latents.dtype, latents.device, carries)

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Decode the next chunk of the current video.

        Args:
            latents: `(batch, latent_channels, latent_frames, height, width)` as the transformer produces them
                (the diffusion model's normalised space: no `denormalize_wan_latents`). Cast to the model's dtype
                and device. Batch and spatial size must stay the same for every chunk of one video.

        Returns:
            `(batch, 3, pixel_frames, height * s, width * s)` in [-1, 1], in the model's dtype, with
            `pixel_frames = num_pixel_frames(latent_frames)` and `s = autoencoder.spatial_upscale`.
        """
        check_latents(latents, self.autoencoder.config.latent_channels)
        video_shape = self._check_video_shape(latents, "latents")
        device, dtype = _placement(self.autoencoder, onload=True)
        memory = dict(self._memory)
        pixels = self.autoencoder.decode_frames(latents.to(device=device, dtype=dtype), memory)
        if self._frames_seen == 0:
            pixels = pixels[:, :, self.temporal_upsample - 1 :]  # the video's warm-up frames
        self._advance(memory, latents.shape[2], video_shape)
        return pixels


class StreamingTinyEncoder(_Stream):
    """Encode a video a chunk of frames at a time with `TinyVideoAutoencoder`, its carries kept between chunks.

    `encode` returns the latent frames each chunk completes (every `temporal_downscale` frames complete one);
    `flush()` ends the video the way `TinyVideoAutoencoder.encode` pads a clip, repeating the last frame up to a
    multiple of `temporal_downscale`, and returns the rest. The chunks' latents, then `flush()`'s, concatenated
    along frames equal one `encode` of the whole clip. Runs under `torch.no_grad()`.

    Args:
        autoencoder: the `TinyVideoAutoencoder` to encode with (any dtype, any device).
    """

    _counter_name = "frames_encoded"

    def reset(self) -> None:
        """Start a new video: drop the carries and the last frame, forget the previous video's shape."""
        super().reset()
        self._last_frame: Tensor | None = None  # (batch, 3, 1, H, W): what `flush` repeats

    @property
    def frames_encoded(self) -> int:
        """Pixel frames of the current video fed in so far (flush padding included)."""
        return self._frames_seen

    def num_latent_frames(self, frames: int) -> int:
        """Latent frames the next `encode` of `frames` pixel frames will return."""
        downscale = self.autoencoder.temporal_downscale
        return (self._frames_seen + frames) // downscale - self._frames_seen // downscale

    @torch.no_grad()
    def encode(self, frames: Tensor) -> Tensor:
        """Encode the next chunk of frames of the current video.

        Args:
            frames: `(batch, 3, frames, H, W)` in [-1, 1], H and W multiples of `autoencoder.spatial_downscale`.
                Cast to the model's dtype and device. Batch and size must stay the same within one video.

        Returns:
            `(batch, latent_channels, num_latent_frames(frames), H / s, W / s)`, `s = spatial_downscale`, in the
            diffusion model's latent space; possibly 0 frames.
        """
        check_frames(frames, self.autoencoder.spatial_downscale)
        video_shape = self._check_video_shape(frames, "frames")
        device, dtype = _placement(self.autoencoder, onload=True)
        return self._encode(frames.to(device=device, dtype=dtype), video_shape)

    @torch.no_grad()
    def flush(self) -> Tensor:
        """End the video: pad it with its last frame to a multiple of `temporal_downscale` frames, encode that.

        Returns:
            The latent frame the padding completes, or 0 latent frames when the video needed no padding.

        Raises:
            ValueError: nothing was encoded yet.
        """
        if self._last_frame is None:
            raise ValueError("flush() needs at least one encode() call on the current video first.")
        padding = -self._frames_seen % self.autoencoder.temporal_downscale
        return self._encode(self._last_frame.expand(-1, -1, padding, -1, -1), self._video_shape)

    def _encode(self, frames: Tensor, video_shape: tuple[int, int, int]) -> Tensor:
        memory = dict(self._memory)
        latents = self.autoencoder.encode_frames(frames, memory)
        if frames.shape[2] > 0:
            self._last_frame = frames[:, :, -1:].clone()
        self._advance(memory, frames.shape[2], video_shape)
        return latents

    def state_dict(self) -> dict[str, Tensor]:
        """`_Stream.state_dict()` plus `last_frame` `(batch, 3, 1, H, W)`, the frame `flush` repeats."""
        state = super().state_dict()
        if self._last_frame is not None:
            state["last_frame"] = self._last_frame
        return state

    def load_state_dict(self, state_dict: Mapping[str, Tensor]) -> None:
        """Resume an encoding stream from `state_dict()`."""
        state = dict(state_dict)
        last_frame = state.pop("last_frame", None)
        super().load_state_dict(state)
        if last_frame is not None:
            device, dtype = _placement(self.autoencoder)
            self._last_frame = last_frame.to(device=device, dtype=dtype)

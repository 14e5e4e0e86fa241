"""Causal, chunk-by-chunk encoding of pixel frames into Wan VAE latents (the input side of image- and
video-to-video).

`AutoencoderKLWan.encode` runs its causal 3D encoder over one pixel frame, then over groups of 4 frames, with a
feature cache (the last frames every causal conv saw) that it clears at every call, so encoding a long or live
video chunk by chunk with it leaves seams. `StreamingWanEncoder` runs the same per-group loop as
`AutoencoderKLWan._encode` with a feature cache of its own that lives across calls:

    pixel frames   f0 | f1 f2 f3 f4 | f5 f6 f7 f8 | ...     (groups of `temporal_downsample` frames; 4 for Wan 2.1)
    latent frames  z0 | z1          | z2          | ...

Every group goes through the encoder as it would inside one `vae.encode` of the whole clip (diffusers groups by
4 whatever the VAE's temporal downsampling; ours by that downsampling, the same for Wan 2.1 and 2.2), so the
concatenated chunks equal that one call to fp32 rounding: the encoder's outputs match bit for bit when the groups
match, and the 1x1x1 `quant_conv`, applied per chunk, rounds a shorter chunk differently (measured <= 5e-7 on
tiny random VAEs). Memory is that of one chunk.
The cache is the encoder's own, never the VAE's `_enc_feat_map`: several streams may share one VAE.
"""

import torch
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import patchify
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

from ...checks import check_int
from .feature_cache import WanFeatureCacheStream, checked_latent_stats


def normalize_wan_latents(
    latents: torch.Tensor, vae: AutoencoderKLWan, stats: tuple[torch.Tensor, torch.Tensor] | None = None
) -> torch.Tensor:
    """Map latents from the space `vae.encode` returns to the diffusion model's normalised space.

    Applies `(latents - latents_mean) / latents_std` with the per-channel statistics in `vae.config`, as diffusers'
    `WanImageToVideoPipeline.prepare_latents` does; the inverse of `denormalize_wan_latents`.

    Args:
        latents: `(batch, z_dim, latent_frames, height, width)`, the posterior's mean or a sample of it.
        vae: the `AutoencoderKLWan` whose `config.latents_mean` / `config.latents_std` apply.
        stats: `wan_latent_stats(vae, ...)` made ahead, in `latents`' dtype and device (else made here).

    Returns:
        `(batch, z_dim, latent_frames, height, width)` in `latents`' dtype and device.
    """
    mean, std = checked_latent_stats(latents, vae, stats)
    return (latents - mean) / std


class StreamingWanEncoder(WanFeatureCacheStream):
    """Encode a Wan video's pixel frames a chunk at a time, with the VAE's causal feature cache kept between chunks.

    Frame rule, with `t = temporal_downsample` (4 for Wan 2.1 and 2.2): the first chunk of a video holds `1 + t*k`
    pixel frames (k >= 0) and becomes `1 + k` latent frames; every later chunk holds `t*k` frames (k >= 1) and
    becomes `k` latent frames. So 3-latent-frame chunks take 9 pixel frames, then 12 (Krea Realtime's webcam sizes).

    Latents are the posterior's mean by default (deterministic: the same frames always give the same latents, the
    mode diffusers' Wan image-to-video pipeline uses); `encode(..., sample=True, generator=...)` draws from the
    posterior instead, chunk by chunk. One instance streams one video at a time; `reset()` starts the next.
    `state_dict()` / `load_state_dict()` save and restore the position and the feature cache (resume).

    Spatial tiling (`vae.use_tiling`) and slicing are not applied: each chunk is encoded whole, in one batch.
    Runs under `torch.no_grad()`. A chunk is a transaction: if encoding fails part-way, the encoder is left as it
    was before the call.

    Args:
        vae: the `AutoencoderKLWan` to encode with (any dtype, any device, offload hooks honoured).
        normalize: map the latents to the diffusion model's normalised space (`normalize_wan_latents`); False
            returns them as the VAE encodes them (StreamDiffusionV2's `stream_encode(..., is_scale=False)`).
    """

    position_key = "latent_frames_encoded"

    def __init__(self, vae: AutoencoderKLWan, normalize: bool = True) -> None:
        self.normalize = normalize
        # The first pixel frame encodes to 1 latent frame; every later group of `temporal_downsample` to one.
        self.temporal_downsample = 2 ** sum(vae.config.temperal_downsample)
        patch_size = vae.config.patch_size or 1
        # Computed from the layers, not `config.scale_factor_spatial`, which tiny configs leave at its default 8.
        self.spatial_downsample = 2 ** len(vae.config.temperal_downsample) * patch_size
        self.in_channels = vae.config.in_channels // patch_size**2  # RGB: 3
        super().__init__(vae, vae.encoder, vae.quant_conv)

    @property
    def latent_frames_encoded(self) -> int:
        """Latent frames of the current video encoded so far."""
        return self._position

    def num_latent_frames(self, pixel_frames: int) -> int:
        """Latent frames the next `encode` of `pixel_frames` pixel frames will return; raises if the count breaks
        the frame rule."""
        self._check_pixel_frames(pixel_frames)
        first = 1 if self._position == 0 else 0
        return first + (pixel_frames - first) // self.temporal_downsample

    def num_pixel_frames(self, latent_frames: int) -> int:
        """Pixel frames the next `encode` needs to return `latent_frames` latent frames (9, then 12, for 3)."""
        check_int("latent_frames", latent_frames, 1)
        first = 1 if self._position == 0 else 0
        return first + (latent_frames - first) * self.temporal_downsample

    def _check_pixel_frames(self, pixel_frames: int) -> None:
        check_int("pixel_frames", pixel_frames, None)
        t = self.temporal_downsample
        if self._position == 0:
            offset, smallest = 1, 1
            rule = f"the first chunk of a video takes 1 + {t}*k pixel frames (k >= 0)"
        else:
            offset, smallest = 0, t
            rule = f"after the first chunk, a chunk takes {t}*k pixel frames (k >= 1)"
        if pixel_frames >= smallest and (pixel_frames - offset) % t == 0:
            return
        below = offset + t * ((pixel_frames - offset) // t)
        nearest = [count for count in (below, below + t) if count >= smallest]
        raise ValueError(
            f"`frames` holds {pixel_frames} pixel frames, but {rule}, the VAE's temporal downsampling being {t}; "
            f"nearest valid counts: {' or '.join(map(str, nearest))}."
        )

    def _check_frames(self, frames: torch.Tensor) -> tuple[int, int, int]:
        """Validate a chunk before any work; returns its (batch, height, width)."""
        c, s = self.in_channels, self.spatial_downsample
        if not isinstance(frames, torch.Tensor) or frames.ndim != 5:
            shape = tuple(frames.shape) if isinstance(frames, torch.Tensor) else type(frames).__name__
            raise ValueError(f"`frames` must be a 5-D tensor (batch, {c}, frames, height, width), got {shape}.")
        if frames.shape[1] != c:
            raise ValueError(f"`frames` must have {c} channels (RGB) on dim 1, got shape {tuple(frames.shape)}.")
        if not frames.is_floating_point():
            raise ValueError(f"`frames` must be a float tensor with values in [-1, 1], got dtype {frames.dtype}.")
        batch, _, pixel_frames, height, width = frames.shape
        if batch == 0 or height == 0 or width == 0 or height % s or width % s:
            raise ValueError(
                f"`frames` batch must be >= 1 and height and width multiples of the VAE's spatial downsampling {s}, "
                f"got shape {tuple(frames.shape)}."
            )
        video_shape = (batch, height, width)
        self._check_video_shape("frames", video_shape)
        self._check_pixel_frames(pixel_frames)
        return video_shape

    @torch.no_grad()
    def encode(
        self, frames: torch.Tensor, sample: bool = False, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Encode the next chunk of the current video.

        Args:
            frames: `(batch, 3, pixel_frames, height, width)` in [-1, 1] (what `load_start_image` and
                `VideoInput.next_chunk` return), `pixel_frames` by the frame rule (see the class), height and width
                multiples of `spatial_downsample`. Cast to the VAE's dtype and device. Batch and spatial size must
                stay the same for every chunk of one video.
            sample: draw the latents from the posterior instead of taking its mean.
            generator: the random generator for `sample=True` (on the VAE's device).

        Returns:
            `(batch, z_dim, latent_frames, height / s, width / s)` in the diffusion model's normalised space
            (`normalize_wan_latents` applied, unless built with `normalize=False`), in the VAE's dtype, with `latent_frames = num_latent_frames(...)`
            and `s = spatial_downsample`.
        """
        if generator is not None and not sample:
            raise ValueError("`generator` is only used with `sample=True` (the default takes the posterior's mean).")
        video_shape = self._check_frames(frames)

        weight = self._onload()
        x = frames.to(device=weight.device, dtype=weight.dtype)
        if self.vae.config.patch_size is not None:
            x = patchify(x, patch_size=self.vae.config.patch_size)  # (batch, 3 * patch**2, F, H / patch, W / patch)

        # A shallow copy: the convs replace cache entries and never write into them, so until the swap below the
        # committed cache is untouched, whatever fails part-way.
        cache = list(self._feat_cache)
        groups = self._groups(x.shape[2])
        outputs = []
        for start, stop in groups:
            conv_idx = [0]  # the encoder walks its convs in order, advancing this index into our cache
            outputs.append(self.vae.encoder(x[:, :, start:stop], feat_cache=cache, feat_idx=conv_idx))
        # quant_conv is 1x1x1 (no temporal context): applied per chunk it is exact up to fp32 rounding.
        moments = self.vae.quant_conv(torch.cat(outputs, dim=2))  # (batch, 2 * z_dim, latent_frames, h, w)

        posterior = DiagonalGaussianDistribution(moments)
        raw = posterior.sample(generator) if sample else posterior.mode()
        latents = normalize_wan_latents(raw, self.vae, self._latent_stats(raw)) if self.normalize else raw
        self._feat_cache = cache
        self._position += len(groups)
        self._video_shape = video_shape
        return latents

    def _groups(self, pixel_frames: int) -> list[tuple[int, int]]:
        """(start, stop) of each encoder call in a chunk: the video's first frame alone, then `t` frames at a time."""
        first = 1 if self._position == 0 else 0
        t = self.temporal_downsample
        return [(0, 1)] * first + [(start, start + t) for start in range(first, pixel_frames, t)]

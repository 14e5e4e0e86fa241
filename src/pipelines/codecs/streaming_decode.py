"""Causal, chunk-by-chunk decoding of Wan VAE latents.

`AutoencoderKLWan.decode` already decodes one latent frame at a time through causal 3D convolutions that carry
a feature cache (the last two frames each conv saw), but it clears that cache at every call, so decoding a long
video chunk by chunk with it leaves seams. `StreamingWanDecoder` runs the same per-frame loop as
`AutoencoderKLWan._decode` with a feature cache of its own that lives across calls: the concatenated chunks
equal one `vae.decode` of the whole latent sequence, while memory stays that of one chunk.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from diffusers import AutoencoderKLWan
from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

from .feature_cache import WanFeatureCacheStream, checked_latent_stats, wan_latent_stats

__all__ = ["StreamingWanDecoder", "denormalize_wan_latents", "wan_latent_stats"]


def denormalize_wan_latents(
    latents: torch.Tensor, vae: AutoencoderKLWan, stats: tuple[torch.Tensor, torch.Tensor] | None = None
) -> torch.Tensor:
    """Map latents from the diffusion model's normalised space to the space `vae.decode` expects.

    Applies `latents * latents_std + latents_mean` with the per-channel statistics in `vae.config`, exactly as
    diffusers' `WanPipeline` does before it calls `vae.decode`.

    Args:
        latents: `(batch, z_dim, latent_frames, height, width)`, as the transformer produces them.
        vae: the `AutoencoderKLWan` whose `config.latents_mean` / `config.latents_std` apply.
        stats: `wan_latent_stats(vae, ...)` made ahead, in `latents`' dtype and device (else made here).

    Returns:
        `(batch, z_dim, latent_frames, height, width)` in `latents`' dtype and device.
    """
    mean, std = checked_latent_stats(latents, vae, stats)
    return latents * std + mean


class StreamingWanDecoder(WanFeatureCacheStream):
    """Decode a Wan video's latents a chunk at a time, with the VAE's causal feature cache kept between chunks.

    The decoder holds its own feature cache, so the VAE's cache (`vae._feat_map`) and other users of `vae.decode`
    are left alone. One instance streams one video at a time; call `reset()` before the next video.

    Spatial tiling (`vae.use_tiling`) is not applied: each chunk is decoded whole in space, like `vae.decode`
    without tiling. Runs under `torch.no_grad()`.

    The decoder is causal in time, so handing it several latent frames in one call gives what one call per frame
    gives (up to float reordering), provided a video's first latent frame goes alone: its call takes the
    first-chunk path (diffusers' "Rep" markers, Wan 2.2's first-chunk trim). Fewer, larger calls are faster on a
    CPU (the embedded model, 3-frame chunks: 42 -> 33 ms a chunk alone, 99 -> 48 ms for 4 chunks stacked by
    `decode_stacked`); one frame per call keeps the decode's peak memory at one latent frame's, as `vae.decode`.

    Args:
        vae: the `AutoencoderKLWan` to decode with (any dtype, any device, offload hooks honoured).
        denormalize: `decode` takes the diffusion model's latents and applies `denormalize_wan_latents` itself
            (what a pipeline's stream passes); by default it takes the VAE's own latent space.
        frames_per_call: latent frames per call of the VAE's decoder (a video's first frame always alone). None:
            a whole chunk when the VAE runs on a CPU, one frame elsewhere (GPU speed and memory not measured yet).
    """

    position_key = "latent_frames_decoded"
    row_state_prefix = "feat_cache."  # the `state_dict` entries that hold one row per video (`decode_stacked`)

    def __init__(self, vae: AutoencoderKLWan, denormalize: bool = False, frames_per_call: int | None = None) -> None:
        if frames_per_call is not None and (type(frames_per_call) is not int or frames_per_call < 1):
            raise ValueError(f"`frames_per_call` must be None or an int >= 1, got {frames_per_call!r}.")
        self.denormalize = denormalize
        self.frames_per_call = frames_per_call
        # The first latent frame decodes to 1 pixel frame; every later one to `temporal_upsample` frames.
        self.temporal_upsample = 2 ** sum(vae.config.temperal_downsample)
        super().__init__(vae, vae.decoder, vae.post_quant_conv)

    @property
    def latent_frames_decoded(self) -> int:
        """Latent frames of the current video decoded so far."""
        return self._position

    def num_pixel_frames(self, latent_frames: int) -> int:
        """Pixel frames the next `decode` of `latent_frames` latent frames will return."""
        first = 1 if self._position == 0 and latent_frames > 0 else 0
        return first + (latent_frames - first) * self.temporal_upsample

    def stack_key(self, latents: torch.Tensor) -> Hashable | None:
        """What must be equal for decoders to decode their next chunks in one call (`decode_stacked`): the VAE and
        settings, whether at the video's first frame (another path, `first_chunk`), the chunk's shape, and per causal
        conv the cache's kind (empty, "Rep", or a tensor's shape, dtype, device). None: `latents` is not a one-row chunk
        this decoder would take (it decodes alone, and its own `decode` says what is wrong). The stacking itself
        goes through `state_dict` / `load_state_dict` (`rolldiff.pipelines.codecs.stacked_decode`)."""
        if latents.ndim != 5 or latents.shape[0] != 1 or latents.shape[1] != self.vae.config.z_dim:
            return None
        if self._video_shape not in (None, (1, *latents.shape[3:])):
            return None
        slots = tuple(
            entry if entry is None or isinstance(entry, str) else (tuple(entry.shape), entry.dtype, entry.device)
            for entry in self._feat_cache
        )
        first = self._position == 0
        settings = (id(self.vae), self.denormalize, self.frames_per_call)
        return (*settings, first, tuple(latents.shape), latents.dtype, latents.device, slots)

    def _calls(self, latent_frames: int, device: torch.device) -> list[tuple[int, int]]:
        """The `(start, stop)` latent frames of each decoder call for the next chunk: a video's first frame alone,
        then `frames_per_call` at a time (None: the rest at once on a CPU, one at a time elsewhere)."""
        per_call = self.frames_per_call or (latent_frames if device.type == "cpu" else 1)
        start = 1 if self._position == 0 else 0
        bounds = [0, *range(start, latent_frames, per_call), latent_frames]
        return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode the next chunk of the current video.

        Args:
            latents: `(batch, z_dim, latent_frames, height, width)` in the space `vae.decode` takes (use
                `denormalize_wan_latents` on the diffusion model's output first). Cast to the VAE's dtype and
                device. Batch and spatial size must stay the same for every chunk of one video.

        Returns:
            `(batch, 3, pixel_frames, height * s, width * s)` in [-1, 1], in the VAE's dtype, with
            `pixel_frames = num_pixel_frames(latent_frames)` and `s` the VAE's spatial compression ratio.
        """
        z_dim = self.vae.config.z_dim
        if latents.ndim != 5:
            raise ValueError(
                f"`latents` must be 5-D (batch, {z_dim}, latent_frames, height, width), got shape {tuple(latents.shape)}."
            )
        if latents.shape[1] != z_dim:
            raise ValueError(f"`latents` must have {z_dim} channels (vae.config.z_dim), got {latents.shape[1]}.")
        if latents.shape[2] == 0:
            raise ValueError("`latents` must hold at least one latent frame, got 0.")
        video_shape = (latents.shape[0], latents.shape[3], latents.shape[4])
        self._check_video_shape("latents", video_shape)

        weight = self._onload()  # its dtype is the VAE's (`vae.dtype` walks every module: ~1 ms a chunk)
        if self.denormalize:
            latents = latents.to(weight.dtype)
            latents = denormalize_wan_latents(latents, self.vae, self._latent_stats(latents))
        latents = latents.to(device=weight.device, dtype=weight.dtype)

        # Mirrors AutoencoderKLWan._decode's loop, `_calls` latent frames per decoder call. post_quant_conv
        # is 1x1x1 (no temporal context), so applying it per chunk is exact.
        x = self.vae.post_quant_conv(latents)
        frames = []
        for start, stop in self._calls(x.shape[2], weight.device):
            conv_idx = [0]  # the decoder walks its convs in order, advancing this index into our cache
            frames.append(
                self.vae.decoder(
                    x[:, :, start:stop],
                    feat_cache=self._feat_cache,
                    feat_idx=conv_idx,
                    first_chunk=self._position == 0,
                )
            )
            self._position += stop - start
        self._video_shape = video_shape
        out = torch.cat(frames, dim=2)  # (batch, 3 * patch**2, pixel_frames, H / patch, W / patch)

        if self.vae.config.patch_size is not None:
            out = unpatchify(out, patch_size=self.vae.config.patch_size)  # (batch, 3, pixel_frames, H, W)
        return torch.clamp(out, min=-1.0, max=1.0)

"""`TinyVideoAutoencoder`: the TAEHV architecture (madebyollin/taehv), which loads TAEHV's published checkpoints.

TAEHV is a small frame-by-frame 2D convolution network with three kinds of temporal layers, so it decodes (and
encodes) causally with a few frames of memory per layer:

    memory block   out[t] = relu(convs(cat(x[t], x[t - 1])) + skip(x[t]))   carries x[last] (zeros before frame 0)
    temporal pool  out[t] = conv1x1(cat(x[s t], ..., x[s t + s - 1]))       carries the < s frames not yet pooled
    temporal grow  out[s t + j] = channel group j of conv1x1(x[t])          carries nothing

Every layer acts on a whole chunk of frames at once (frames folded into the batch for the 2D convolutions) and
hands its carry to the next chunk, so a video decoded chunk by chunk equals the video decoded in one call, and
a chunk's memory is the carries only (one frame per memory block), never the chunk's history.

The modules sit in two `nn.Sequential`s at the indices upstream uses, so the state dict keys are the published
ones (`decoder.22.bias` is the last convolution). Frames: the decoder grows each latent frame into
`temporal_upscale` frames and drops the first `temporal_upscale - 1` of the video, so latent frame 0 gives 1 frame
and every later one `temporal_upscale` (4 for taew2_1), as the Wan VAE does. The encoder pools
`temporal_downscale` frames into one latent; `encode` pads a clip to a multiple of that by repeating its last
frame (upstream's rule), so 1 + 4k frames give k + 1 latents, again as the Wan VAE does.

Latents are those the diffusion model works in: TAEHV applies no mean/std (taew2_1 decodes the Wan transformer's
output as it is; upstream's diffusers wrapper sets `latents_mean` 0 and `latents_std` 1). Pixels are diffusers'
`(batch, 3, frames, height, width)` in [-1, 1]; upstream's [0, 1] is mapped at the boundary.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.models.autoencoders.autoencoder_tiny import AutoencoderTinyOutput
from diffusers.models.autoencoders.vae import DecoderOutput
from einops import rearrange
from torch import Tensor, nn

from ..caching.base import check_positive
from .weights import (
    KEYS_IN_ERRORS,
    TORCH_SUFFIXES,
    StrictWeightsMixin,
    WeightsMismatchError,
    preview_keys,
    read_checkpoint_file,
    resolve_dtype,
    weight_mismatches,
)

# Per-layer carries between chunks, keyed by the layer's index in its `nn.Sequential` (see `CausalSequential`).
Memory = dict[str, Tensor]

# Indices of the layers whose weights reveal the variant (the upstream layout, see `_build_encoder/_decoder`).
_ENCODER_POOLS = (2, 7, 12)
_DECODER_GROWS = (7, 13, 19)
_DECODER_STAGE_CONVS = (1, 8, 14, 20)
_LAST_DECODER_CONV = 22


# ----------------------------------------------------------------------------------------------------- layers
def _conv3x3(in_channels: int, out_channels: int, stride: int = 1, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=bias)


def _per_frame(layer: Callable[[Tensor], Tensor], frames: Tensor) -> Tensor:
    """Apply a 2D layer to every frame of `frames` `(batch, frames, channels, height, width)`."""
    out = layer(rearrange(frames, "b t c h w -> (b t) c h w"))
    return rearrange(out, "(b t) c h w -> b t c h w", b=frames.shape[0])


class TanhClamp(nn.Module):
    """Soft clamp of the latents to (-3, 3) before decoding: `3 tanh(x / 3)`."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x / 3) * 3


class MemoryBlock(nn.Module):
    """Residual block whose first convolution also sees the previous frame's input (zeros before the first).

    Keys: `conv.{0,2,4}` (3x3 convolutions; the first takes `2 * in_channels`) and `skip` (1x1, only when the
    width changes).
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            _conv3x3(in_channels * 2, out_channels),
            nn.ReLU(),
            _conv3x3(out_channels, out_channels),
            nn.ReLU(),
            _conv3x3(out_channels, out_channels),
        )
        self.skip = (
            nn.Conv2d(in_channels, out_channels, 1, bias=False) if in_channels != out_channels else nn.Identity()
        )
        self.act = nn.ReLU()

    def forward(self, frames: Tensor, previous: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """`frames` `(batch, frames, channels, h, w)`; `previous` `(batch, 1, channels, h, w)`: the last frame
        of the previous chunk, or None at the start of a video. Returns the output and the next carry."""
        num_frames = frames.shape[1]
        if num_frames == 0:
            return frames, previous
        if previous is None:
            previous = torch.zeros_like(frames[:, :1])
        past = torch.cat([previous, frames[:, :-1]], dim=1)  # (batch, frames, channels, h, w), shifted by one
        x = rearrange(frames, "b t c h w -> (b t) c h w")
        out = self.act(self.conv(torch.cat([x, rearrange(past, "b t c h w -> (b t) c h w")], dim=1)) + self.skip(x))
        # A copy, not a view: a view would keep the whole chunk's activations alive until the next chunk.
        return rearrange(out, "(b t) c h w -> b t c h w", t=num_frames), frames[:, -1:].clone()


class TemporalPool(nn.Module):
    """Merge each `stride` consecutive frames into one (a 1x1 convolution over their stacked channels).

    Frames that do not fill a group yet are carried to the next chunk. Key: `conv.weight`
    `(channels, stride * channels, 1, 1)`.
    """

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(channels * stride, channels, 1, bias=False)

    def forward(self, frames: Tensor, pending: Tensor | None) -> tuple[Tensor, Tensor]:
        """`frames` `(batch, frames, channels, h, w)`; `pending` `(batch, < stride, channels, h, w)` or None.
        Returns `(batch, (pending + frames) // stride, channels, h, w)` and the frames left over."""
        if pending is not None:
            frames = torch.cat([pending, frames], dim=1)
        usable = frames.shape[1] // self.stride * self.stride
        groups = rearrange(frames[:, :usable], "b (t s) c h w -> (b t) (s c) h w", s=self.stride)
        out = rearrange(self.conv(groups), "(b t) c h w -> b t c h w", b=frames.shape[0])
        return out, frames[:, usable:].clone()


class TemporalGrow(nn.Module):
    """Turn each frame into `stride` frames (a 1x1 convolution to `stride` channel groups, one per new frame).

    Key: `conv.weight` `(stride * channels, channels, 1, 1)`.
    """

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(channels, channels * stride, 1, bias=False)

    def forward(self, frames: Tensor, carry: None = None) -> tuple[Tensor, None]:
        """`(batch, frames, channels, h, w)` -> `(batch, frames * stride, channels, h, w)`; no carry."""
        grown = self.conv(rearrange(frames, "b t c h w -> (b t) c h w"))
        return rearrange(grown, "(b t) (s c) h w -> b (t s) c h w", b=frames.shape[0], s=self.stride), None


_TEMPORAL_LAYERS = (MemoryBlock, TemporalPool, TemporalGrow)


class CausalSequential(nn.Sequential):
    """An `nn.Sequential` run over a chunk of frames, each temporal layer reading and updating its carry.

    Children keep `nn.Sequential`'s names ("0", "1", ...), which are both the state dict prefixes and the keys
    of the `memory` dict.
    """

    def forward(self, frames: Tensor, memory: Memory) -> Tensor:
        """`frames` `(batch, frames, channels, h, w)`; `memory` is updated in place (new tensors, never written
        into). Returns `(batch, frames', channels', h', w')`."""
        for name, layer in self.named_children():
            if isinstance(layer, _TEMPORAL_LAYERS):
                frames, carry = layer(frames, memory.get(name))
                if carry is not None:
                    memory[name] = carry
            else:
                frames = _per_frame(layer, frames)
        return frames


# ------------------------------------------------------------------------------------------------ the model
def _check_flags(name: str, value: Sequence[bool], stages: str) -> tuple[bool, bool, bool]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 3:
        hint = " (upstream's two-value form (a, b) means (False, a, b))" if name == "decoder_time_upscale" else ""
        raise ValueError(f"`{name}` must be 3 booleans, one per {stages}, got {value!r}{hint}.")
    if not all(isinstance(flag, bool) for flag in value):
        raise ValueError(f"`{name}` must hold booleans only, got {value!r}.")
    return tuple(value)


def _build_encoder(image_channels: int, width: int, latent_channels: int, time_downscale: tuple[bool, ...]):
    layers: list[nn.Module] = [_conv3x3(image_channels, width), nn.ReLU()]
    for pool in time_downscale:  # three stages: pool in time, halve in space, three memory blocks
        layers += [TemporalPool(width, 2 if pool else 1), _conv3x3(width, width, stride=2, bias=False)]
        layers += [MemoryBlock(width, width) for _ in range(3)]
    layers.append(_conv3x3(width, latent_channels))
    return CausalSequential(*layers)


def _build_decoder(
    latent_channels: int,
    widths: tuple[int, int, int, int],
    time_upscale: tuple[bool, ...],
    space_upscale: tuple[bool, ...],
    image_channels: int,
):
    layers: list[nn.Module] = [TanhClamp(), _conv3x3(latent_channels, widths[0]), nn.ReLU()]
    for stage, (grow, upsample) in enumerate(zip(time_upscale, space_upscale)):
        width = widths[stage]  # three stages: memory blocks, double in space and time, narrow
        layers += [MemoryBlock(width, width) for _ in range(3)]
        layers += [nn.Upsample(scale_factor=2) if upsample else nn.Identity(), TemporalGrow(width, 2 if grow else 1)]
        layers.append(_conv3x3(width, widths[stage + 1], bias=False))
    layers += [nn.ReLU(), _conv3x3(widths[3], image_channels)]
    return CausalSequential(*layers)


class TinyVideoAutoencoder(StrictWeightsMixin, ModelMixin, ConfigMixin):
    """TAEHV: a tiny causal video autoencoder for the latent spaces of Wan, HunyuanVideo and others.

    The defaults are `taew2_1` (Wan 2.1's latent space, also Wan 2.2 14B's): 16 latent channels, patch 1, 4x
    in time, 8x in space. Load a published checkpoint with `from_single_file`; its keys are this model's keys.
    `save_pretrained` / `from_pretrained` round-trip the config, and `from_pretrained` refuses weights that do not
    fit it (`StrictWeightsMixin`).

    Args:
        latent_channels: channels of the latent space (16 for Wan 2.1, 48 for Wan 2.2 5B).
        patch_size: pixel (un)shuffle factor at the image side (2 for taew2_2 / taehv1_5).
        encoder_time_downscale: per encoder stage, whether it halves the frame rate.
        decoder_time_upscale: per decoder stage, whether it doubles the frame rate (all False: a cheaper preview,
            one frame per latent frame).
        decoder_space_upscale: per decoder stage, whether it doubles height and width (False: a smaller preview).
        encoder_channels: width of every encoder layer (64 in upstream's architecture).
        decoder_channels: widths of the decoder's stages (256, 128, 64, 64 in upstream's base decoder).
    """

    _supports_gradient_checkpointing = False
    image_channels = 3

    @register_to_config
    def __init__(
        self,
        latent_channels: int = 16,
        patch_size: int = 1,
        encoder_time_downscale: Sequence[bool] = (True, True, False),
        decoder_time_upscale: Sequence[bool] = (False, True, True),
        decoder_space_upscale: Sequence[bool] = (True, True, True),
        encoder_channels: int = 64,
        decoder_channels: Sequence[int] = (256, 128, 64, 64),
    ) -> None:
        super().__init__()
        for name, value in (
            ("latent_channels", latent_channels),
            ("patch_size", patch_size),
            ("encoder_channels", encoder_channels),
        ):
            check_positive(name, value)
        if isinstance(decoder_channels, (str, bytes)) or len(decoder_channels) != 4:
            raise ValueError(f"`decoder_channels` must be 4 positive ints, got {decoder_channels!r}.")
        for width in decoder_channels:
            check_positive("decoder_channels", width)
        time_down = _check_flags("encoder_time_downscale", encoder_time_downscale, "encoder stage")
        time_up = _check_flags("decoder_time_upscale", decoder_time_upscale, "decoder stage")
        space_up = _check_flags("decoder_space_upscale", decoder_space_upscale, "decoder stage")

        pixel_channels = self.image_channels * patch_size**2  # after pixel_unshuffle
        self.encoder = _build_encoder(pixel_channels, encoder_channels, latent_channels, time_down)
        self.decoder = _build_decoder(latent_channels, tuple(decoder_channels), time_up, space_up, pixel_channels)

    # ---------------------------------------------------------------------------------------- frame counts
    @property
    def temporal_downscale(self) -> int:
        """Pixel frames pooled into one latent frame by the encoder."""
        return 2 ** sum(self.config.encoder_time_downscale)

    @property
    def temporal_upscale(self) -> int:
        """Pixel frames each latent frame decodes to (the first latent frame of a video: 1)."""
        return 2 ** sum(self.config.decoder_time_upscale)

    @property
    def spatial_downscale(self) -> int:
        """Pixels per latent pixel along height and width, encoding (three stride-2 stages times the patch)."""
        return 8 * self.config.patch_size

    @property
    def spatial_upscale(self) -> int:
        """Pixels per latent pixel along height and width, decoding."""
        return 2 ** sum(self.config.decoder_space_upscale) * self.config.patch_size

    # ------------------------------------------------------------------------------------- chunk primitives
    def decode_frames(self, latents: Tensor, memory: Memory) -> Tensor:
        """Decode a chunk of latents with the decoder's carries in `memory` (updated), trimming nothing.

        Args:
            latents: `(batch, latent_channels, latent_frames, h, w)` in the model's dtype and device.
            memory: the decoder's carries from the previous chunk (empty at the start of a video).

        Returns:
            `(batch, 3, latent_frames * temporal_upscale, h * spatial_upscale, w * spatial_upscale)` in [-1, 1].
            At the start of a video the first `temporal_upscale - 1` frames are warm-up frames to drop.
        """
        frames = self.decoder(rearrange(latents, "b c t h w -> b t c h w"), memory)
        if self.config.patch_size > 1:
            frames = _per_frame(partial(F.pixel_shuffle, upscale_factor=self.config.patch_size), frames)
        pixels = frames.clamp(0, 1) * 2 - 1  # upstream's [0, 1] -> diffusers' [-1, 1]
        return rearrange(pixels, "b t c h w -> b c t h w")

    def encode_frames(self, frames: Tensor, memory: Memory) -> Tensor:
        """Encode a chunk of frames with the encoder's carries in `memory` (updated), padding nothing.

        Args:
            frames: `(batch, 3, frames, H, W)` in [-1, 1], H and W multiples of `spatial_downscale`.
            memory: the encoder's carries from the previous chunk (empty at the start of a video).

        Returns:
            `(batch, latent_channels, k, H / spatial_downscale, W / spatial_downscale)`: the latent frames this
            chunk completes (k may be 0; frames that do not complete a latent frame wait in `memory`).
        """
        x = rearrange((frames + 1) / 2, "b c t h w -> b t c h w")  # upstream reads [0, 1]
        if self.config.patch_size > 1:
            x = _per_frame(partial(F.pixel_unshuffle, downscale_factor=self.config.patch_size), x)
        return rearrange(self.encoder(x, memory), "b t c h w -> b c t h w")

    # ---------------------------------------------------------------------------------------- whole clips
    def decode(self, latents: Tensor, return_dict: bool = True) -> DecoderOutput | tuple[Tensor]:
        """Decode a whole clip (for a video that arrives in chunks, use `StreamingTinyDecoder`).

        Args:
            latents: `(batch, latent_channels, latent_frames, h, w)` in the diffusion model's latent space (no
                `latents_mean` / `latents_std` to apply). Cast to the model's dtype and device.

        Returns:
            `DecoderOutput(sample=...)` (or a tuple) with `sample` `(batch, 3, pixel_frames, H, W)` in [-1, 1],
            `pixel_frames = 1 + (latent_frames - 1) * temporal_upscale`.
        """
        check_latents(latents, self.config.latent_channels)
        weight = self.decoder[1].weight
        pixels = self.decode_frames(latents.to(device=weight.device, dtype=weight.dtype), {})
        pixels = pixels[:, :, self.temporal_upscale - 1 :]  # the warm-up frames (upstream's frames_to_trim)
        return DecoderOutput(sample=pixels) if return_dict else (pixels,)

    def encode(self, frames: Tensor, return_dict: bool = True) -> AutoencoderTinyOutput | tuple[Tensor]:
        """Encode a whole clip, padded to a multiple of `temporal_downscale` frames by repeating its last frame.

        Args:
            frames: `(batch, 3, frames, H, W)` in [-1, 1], H and W multiples of `spatial_downscale`. Cast to the
                model's dtype and device.

        Returns:
            `AutoencoderTinyOutput(latents=...)` (or a tuple) with `latents`
            `(batch, latent_channels, ceil(frames / temporal_downscale), H / s, W / s)` in the diffusion model's
            latent space, `s = spatial_downscale`.
        """
        check_frames(frames, self.spatial_downscale)
        weight = self.encoder[0].weight
        frames = frames.to(device=weight.device, dtype=weight.dtype)
        padding = -frames.shape[2] % self.temporal_downscale
        frames = torch.cat([frames, frames[:, :, -1:].expand(-1, -1, padding, -1, -1)], dim=2)
        latents = self.encode_frames(frames, {})
        return AutoencoderTinyOutput(latents=latents) if return_dict else (latents,)

    # ------------------------------------------------------------------------------------------ checkpoints
    @classmethod
    def from_single_file(
        cls,
        path: str | os.PathLike,
        *,
        dtype: torch.dtype | None = None,
        decoder_time_upscale: Sequence[bool] | None = None,
        decoder_space_upscale: Sequence[bool] | None = None,
        torch_dtype: torch.dtype | None = None,
    ) -> TinyVideoAutoencoder:
        """Load a published TAEHV checkpoint (`taew2_1.pth`, `taew2_1.safetensors`, ...), strictly.

        The variant (latent channels, patch size, time scaling, widths) is read from the weights' shapes.
        `.safetensors` files are read with safetensors; `.pth`/`.pt`/`.bin`/`.ckpt` with
        `torch.load(weights_only=True)`, which never runs code stored in the pickle.

        Args:
            path: the checkpoint file.
            dtype: dtype to cast the model to (default: float32, whatever the file stores); `torch_dtype`, its old
                name, is taken too (with a FutureWarning), as diffusers does.
            decoder_time_upscale / decoder_space_upscale: override for a cheaper preview; a stage whose time
                upscaling is turned off keeps its last frame's weights (upstream's `patch_tgrow_layers` rule).
                Space upscaling leaves no trace in the weights and defaults to (True, True, True).

        Raises:
            ValueError: the file is not a TAEHV state dict. `WeightsMismatchError` (a `ValueError`): its keys or
                shapes do not fit (the missing, unexpected and mismatched keys are named).
        """
        dtype = resolve_dtype(dtype, torch_dtype)
        state_dict = read_checkpoint(path)
        config = infer_tiny_autoencoder_config(state_dict)
        if decoder_time_upscale is not None:
            config["decoder_time_upscale"] = tuple(decoder_time_upscale)
        if decoder_space_upscale is not None:
            config["decoder_space_upscale"] = tuple(decoder_space_upscale)
        model = cls(**config)
        state_dict = _drop_disabled_time_upscale(state_dict, model)
        check_state_dict_fits(model, state_dict, source=str(path))
        model.load_state_dict(state_dict, strict=True)
        return model.to(dtype) if dtype is not None else model


# ----------------------------------------------------------------------------------------- input checks
def check_latents(latents: Tensor, latent_channels: int) -> None:
    """Refuse latents that are not `(batch, latent_channels, latent_frames >= 1, h, w)`."""
    if latents.ndim != 5:
        raise ValueError(
            f"`latents` must be 5-D (batch, {latent_channels}, latent_frames, height, width), "
            f"got shape {tuple(latents.shape)}."
        )
    if latents.shape[1] != latent_channels:
        raise ValueError(
            f"`latents` must have {latent_channels} channels (config.latent_channels), got {latents.shape[1]} "
            f"(shape {tuple(latents.shape)}; the layout is (batch, channels, frames, height, width))."
        )
    if latents.shape[2] == 0:
        raise ValueError("`latents` must hold at least one latent frame, got 0.")


def check_frames(frames: Tensor, spatial_downscale: int) -> None:
    """Refuse frames that are not `(batch, 3, frames >= 1, H, W)` with H, W multiples of `spatial_downscale`."""
    if frames.ndim != 5 or frames.shape[1] != TinyVideoAutoencoder.image_channels:
        raise ValueError(f"`frames` must have shape (batch, 3, frames, height, width), got {tuple(frames.shape)}.")
    if frames.shape[2] == 0:
        raise ValueError("`frames` must hold at least one frame, got 0.")
    height, width = frames.shape[3:]
    if height % spatial_downscale or width % spatial_downscale:
        raise ValueError(
            f"`frames` height and width must be multiples of {spatial_downscale}, got {height}x{width}; "
            f"crop or pad to {height // spatial_downscale * spatial_downscale}x"
            f"{width // spatial_downscale * spatial_downscale} or "
            f"{math.ceil(height / spatial_downscale) * spatial_downscale}x"
            f"{math.ceil(width / spatial_downscale) * spatial_downscale}."
        )


# ---------------------------------------------------------------------------------------- checkpoint files
def read_checkpoint(path: str | os.PathLike) -> dict[str, Tensor]:
    """A flat state dict of tensors from `.safetensors` or a torch pickle (`read_checkpoint_file`)."""
    checkpoint = read_checkpoint_file(path, torch_suffixes=(*TORCH_SUFFIXES, ".ckpt"))
    if not all(isinstance(value, Tensor) for value in checkpoint.values()):
        raise ValueError(f"{str(path)!r} does not hold a flat state dict of tensors.")
    return dict(checkpoint)


def infer_tiny_autoencoder_config(state_dict: Mapping[str, Tensor]) -> dict:
    """Read `TinyVideoAutoencoder` init arguments from the shapes of a TAEHV state dict.

    Everything but `decoder_space_upscale` (nearest upsampling has no weights) leaves a trace: the latent channels
    in the decoder's first convolution, the patch size in its last, the time flags in the pool/grow convolutions.
    """
    if f"decoder.{_LAST_DECODER_CONV}.bias" not in state_dict:
        raise ValueError(
            f"Not a TAEHV state dict: it has no `decoder.{_LAST_DECODER_CONV}.bias` "
            f"(keys start {sorted(state_dict)[:4]})."
        )
    if "decoder.1.weight" not in state_dict:
        raise ValueError(
            "This TAEHV state dict has no `decoder.1.weight`: it is a decoder variant that is not supported "
            "(the `_super` checkpoints); use the base checkpoint (e.g. taew2_1, taew2_2, taehv1_5)."
        )
    try:
        encoder_width = state_dict["encoder.0.weight"].shape[0]
        widths = tuple(state_dict[f"decoder.{index}.weight"].shape[0] for index in _DECODER_STAGE_CONVS)
        output_channels = state_dict[f"decoder.{_LAST_DECODER_CONV}.bias"].shape[0]
        encoder_time = tuple(
            state_dict[f"encoder.{index}.conv.weight"].shape[1] == 2 * encoder_width for index in _ENCODER_POOLS
        )
        decoder_time = tuple(
            state_dict[f"decoder.{index}.conv.weight"].shape[0] == 2 * width
            for index, width in zip(_DECODER_GROWS, widths)
        )
    except KeyError as error:
        raise ValueError(f"TAEHV state dict without key {error}: the file is incomplete or not a TAEHV.") from None
    patch_size = math.isqrt(output_channels // TinyVideoAutoencoder.image_channels)
    if patch_size**2 * TinyVideoAutoencoder.image_channels != output_channels:
        raise ValueError(f"`decoder.{_LAST_DECODER_CONV}` has {output_channels} outputs, not 3 * patch_size**2.")
    return {
        "latent_channels": state_dict["decoder.1.weight"].shape[1],
        "patch_size": patch_size,
        "encoder_time_downscale": encoder_time,
        "decoder_time_upscale": decoder_time,
        "encoder_channels": encoder_width,
        "decoder_channels": widths,
    }


def _drop_disabled_time_upscale(state_dict: dict[str, Tensor], model: TinyVideoAutoencoder) -> dict[str, Tensor]:
    """Keep only the last frame's output channels of a grow convolution the model does not grow with."""
    expected = model.state_dict()
    fitted = dict(state_dict)
    for index in _DECODER_GROWS:
        key = f"decoder.{index}.conv.weight"
        rows = expected[key].shape[0]
        if key in fitted and fitted[key].shape[0] > rows:
            fitted[key] = fitted[key][-rows:]
    return fitted


def check_state_dict_fits(model: nn.Module, state_dict: Mapping[str, Tensor], source: str) -> None:
    """Raise one error naming every missing, unexpected and mis-shaped key of `state_dict` for `model`."""
    expected = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    found = {key: tuple(value.shape) for key, value in state_dict.items()}
    missing, unexpected, mismatched = weight_mismatches(expected, found, expected_as="model")
    problems = [
        f"{label} ({len(keys)}): {preview_keys(keys)}"
        for label, keys in (("missing", missing), ("unexpected", unexpected))
        if keys
    ]
    if mismatched:
        problems.append(f"mismatched ({len(mismatched)}): {', '.join(mismatched[:KEYS_IN_ERRORS])}")
    if problems:
        raise WeightsMismatchError(
            f"{source} does not fit TinyVideoAutoencoder({dict(model.config)}): " + "; ".join(problems) + "."
        )

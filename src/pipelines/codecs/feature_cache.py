"""A Wan VAE causal feature cache (the streaming encoder's and decoder's memory) as tensors only, and back.

`AutoencoderKLWan`'s causal convs keep, per conv, the last frames they saw (a tensor), nothing yet (None), or
diffusers' "Rep" marker (a first chunk's placeholder). The streaming encoder and decoder save theirs for resume
the same way: `feat_cache_kinds` (int8, one per conv: 0 empty, 1 tensor, 2 "Rep"), `feat_cache.{i}` for every
tensor slot, `video_shape` (int64 `(batch, height, width)`, empty before the first chunk) and the owner's
position counter under `position_key` (int64 scalar).
"""

from __future__ import annotations

import torch

_EMPTY, _TENSOR, _REP = 0, 1, 2
REP_MARKER = "Rep"


def wan_latent_stats(vae, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """`(mean, std)` of `vae.config`, each `(1, z_dim, 1, 1, 1)` in `dtype` on `device` (a host-to-device copy:
    a streaming encoder or decoder makes them once, not every chunk)."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean, dtype=dtype, device=device).view(shape)
    return mean, torch.tensor(vae.config.latents_std, dtype=dtype, device=device).view(shape)


def checked_latent_stats(latents: torch.Tensor, vae, stats=None) -> tuple[torch.Tensor, torch.Tensor]:
    """`stats` (else `wan_latent_stats` in `latents`' dtype and device) for latents that must be
    `(batch, z_dim, latent_frames, height, width)`: what `normalize_wan_latents` and `denormalize_wan_latents` share."""
    z_dim = vae.config.z_dim
    if latents.ndim != 5 or latents.shape[1] != z_dim:
        raise ValueError(
            f"`latents` must have shape (batch, {z_dim}, latent_frames, height, width), got {tuple(latents.shape)}."
        )
    return stats if stats is not None else wan_latent_stats(vae, latents.dtype, latents.device)


def feature_cache_state(
    cache: list, video_shape: tuple[int, int, int] | None, position_key: str, position: int
) -> dict[str, torch.Tensor]:
    """The cache and position as tensors (the live tensors, not copies: the convs replace entries, never write
    into them, so a saved dict stays valid as the video goes on)."""
    kinds = [_EMPTY if entry is None else _REP if isinstance(entry, str) else _TENSOR for entry in cache]
    state = {
        position_key: torch.tensor(position, dtype=torch.int64),
        "video_shape": torch.tensor(video_shape or (), dtype=torch.int64),
        "feat_cache_kinds": torch.tensor(kinds, dtype=torch.int8),
    }
    state.update({f"feat_cache.{i}": entry for i, entry in enumerate(cache) if isinstance(entry, torch.Tensor)})
    return state


def load_feature_cache(
    state: dict[str, torch.Tensor], num_convs: int, position_key: str, owner: str
) -> tuple[list, tuple[int, int, int] | None, int]:
    """`(cache, video_shape, position)` from `feature_cache_state`'s dict, checked whole before anything is used."""
    kinds = state.get("feat_cache_kinds")
    if not isinstance(kinds, torch.Tensor) or kinds.shape != (num_convs,):
        found = tuple(kinds.shape) if isinstance(kinds, torch.Tensor) else None
        raise ValueError(
            f"`state_dict` must come from {owner}.state_dict() for a VAE with the same layout: feat_cache_kinds of "
            f"shape ({num_convs},), one per causal conv, got {found}."
        )
    kinds = kinds.tolist()
    expected = {position_key, "video_shape", "feat_cache_kinds"}
    expected |= {f"feat_cache.{i}" for i, kind in enumerate(kinds) if kind == _TENSOR}
    if set(state) != expected or not set(kinds) <= {_EMPTY, _TENSOR, _REP}:
        raise ValueError(
            f"`state_dict` keys or feat_cache_kinds do not match: missing {sorted(expected - set(state))}, "
            f"unexpected {sorted(set(state) - expected)}, kinds {sorted(set(kinds))} (allowed 0, 1, 2)."
        )
    video_shape = tuple(state["video_shape"].tolist())
    if len(video_shape) not in (0, 3):
        raise ValueError(f"`state_dict['video_shape']` must be empty or (batch, height, width), got {video_shape}.")
    cache = [
        state[f"feat_cache.{i}"] if kind == _TENSOR else REP_MARKER if kind == _REP else None
        for i, kind in enumerate(kinds)
    ]
    return cache, video_shape or None, int(state[position_key])


class WanFeatureCacheStream:
    """What the streaming Wan encoder and decoder share: one causal cache slot per `WanCausalConv3d` of `module`
    (the VAE's encoder or decoder), the video's (batch, height, width) fixed at its first chunk, a position counter
    saved under `position_key`, and the `state_dict` / `load_state_dict` round trip of all three; also the
    latents' per-channel statistics, made once. `anchor` is the 1x1x1 conv next to `module` (`quant_conv` /
    `post_quant_conv`) whose weight says where and in which dtype a chunk runs."""

    position_key: str  # "latent_frames_encoded" or "latent_frames_decoded"

    def __init__(self, vae, module: torch.nn.Module, anchor: torch.nn.Module) -> None:
        from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

        self.vae = vae
        self._anchor = anchor
        self._num_cached_convs = sum(isinstance(conv, WanCausalConv3d) for conv in module.modules())
        self._stats: tuple[torch.Tensor, torch.Tensor] | None = None  # the latents' mean and std, made once
        self.reset()

    def reset(self) -> None:
        """Start a new video: drop the cached features and forget the previous video's shape."""
        self._feat_cache: list[torch.Tensor | str | None] = [None] * self._num_cached_convs
        self._position = 0
        self._video_shape: tuple[int, int, int] | None = None  # (batch, height, width) of the current video

    def _check_video_shape(self, name: str, video_shape: tuple[int, int, int]) -> None:
        if self._video_shape is not None and video_shape != self._video_shape:
            raise ValueError(
                f"`{name}` (batch, height, width) must stay {self._video_shape} within one video, got {video_shape}; "
                "call reset() to start a new video."
            )

    def _onload(self) -> torch.Tensor:
        """Same as `apply_forward_hook` on `vae.encode` / `vae.decode`: lets model offloading move the VAE onto its
        device before a chunk; then moves the cached features there too (entries restored by `load_state_dict`,
        or left behind by an offload move; moved, not changed: a failed chunk still leaves the cache as it was).
        Returns the anchor conv's weight, whose device and dtype the chunk runs in."""
        hook = getattr(self.vae, "_hf_hook", None)
        if hook is not None and hasattr(hook, "pre_forward"):
            hook.pre_forward(self.vae)
        weight = self._anchor.weight
        self._feat_cache = [e.to(weight.device) if isinstance(e, torch.Tensor) else e for e in self._feat_cache]
        return weight

    def _latent_stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`wan_latent_stats` in `like`'s dtype and device, made at the first chunk (again only if those change)."""
        if self._stats is None or self._stats[0].device != like.device or self._stats[0].dtype != like.dtype:
            self._stats = wan_latent_stats(self.vae, like.dtype, like.device)
        return self._stats

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The position and the feature cache, tensors only (for `safetensors`): see `feature_cache_state`."""
        return feature_cache_state(self._feat_cache, self._video_shape, self.position_key, self._position)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Continue a video from `state_dict()`'s result (same VAE layout), checked whole before anything changes;
        cached tensors move to the VAE's device at the next chunk."""
        self._feat_cache, self._video_shape, self._position = load_feature_cache(
            state_dict, self._num_cached_convs, self.position_key, type(self).__name__
        )

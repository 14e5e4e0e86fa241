"""Tokens of a patchified latent frame: the one conversion every video family's cache geometry starts from."""

from __future__ import annotations


def tokens_per_latent_frame(patch_size: tuple[int, int, int], latent_height: int, latent_width: int) -> int:
    """Tokens of one `latent_height x latent_width` latent frame under a `(p_t, p_h, p_w)` patch."""
    _, p_h, p_w = patch_size
    if latent_height % p_h or latent_width % p_w:
        raise ValueError(
            f"Latent size {latent_height}x{latent_width} must be divisible by the patch size {p_h}x{p_w}."
        )
    return (latent_height // p_h) * (latent_width // p_w)

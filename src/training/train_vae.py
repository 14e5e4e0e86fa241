"""Train the tiny `AutoencoderKLWan` on random toy-world clips, then set its latent statistics.

Loss: MSE of the reconstruction from a posterior sample (the sampling noise makes the decoder tolerant of
the slightly-off latents a diffusion model produces), with shape pixels weighted up so the small shape's
hard edges and colour are not drowned by the background, plus a small KL term that keeps the latent
space smooth. Afterwards `latents_mean` / `latents_std` are measured on encoded clips and written to the
config, so `(z - mean) / std` is ~unit variance per channel (what the transformer is trained on and what
`denormalize_wan_latents` inverts).
"""

from __future__ import annotations

import time

import numpy as np
import torch
from diffusers import AutoencoderKLWan

from ..toyworld import evaluate_video, render_video, sample_batch, summarise
from ..toyworld.world import all_prompts
from .tiny_components import TinyConfig

CLIP_FRAMES = 5  # Wan's encoder takes 1 + 4k frames; 5 lets the causal temporal convs see past frames
# Longer clips teach the encoder and decoder the steady state of their causal caches: trained on 5-frame
# clips only, reconstructions of green and blue shapes drifted away after ~8 frames. The decoder's causal
# receptive field is 36 frames; `__main__.VAE_PHASES` ends with 41-frame clips.
SHAPE_PIXEL_WEIGHT = 10.0
KL_WEIGHT = 1e-4


def videos_to_tensor(videos: np.ndarray) -> torch.Tensor:
    """uint8 `(batch, frames, height, width, 3)` -> float `(batch, 3, frames, height, width)` in [-1, 1]."""
    return torch.from_numpy(videos).permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0


def tensor_to_videos(pixels: torch.Tensor) -> np.ndarray:
    """float `(batch, 3, frames, height, width)` in [-1, 1] -> uint8 `(batch, frames, height, width, 3)`."""
    pixels = ((pixels.clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8)
    return pixels.permute(0, 2, 3, 4, 1).cpu().numpy()


def reconstruction_loss(vae: AutoencoderKLWan, pixels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    posterior = vae.encode(pixels).latent_dist
    latents = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
    recon = vae.decode(latents).sample
    background = pixels[:, :, :1, :1, :1].new_tensor(-1.0 + 2 * 16 / 255)
    weight = 1.0 + (SHAPE_PIXEL_WEIGHT - 1.0) * ((pixels - background).abs().amax(1, keepdim=True) > 0.05).float()
    mse = (weight * (recon - pixels) ** 2).mean()
    kl = 0.5 * (posterior.mean**2 + posterior.var - 1.0 - posterior.logvar).mean()
    return mse + KL_WEIGHT * kl


def train_vae(  # noqa: PLR0913 (hyperparameters as keywords, one per CLI flag)
    vae: AutoencoderKLWan,
    config: TinyConfig,
    seconds: float,
    batch_size: int = 8,
    lr: float = 1e-3,
    seed: int = 0,
    log=print,
    max_steps: int | None = None,
    clip_frames: int = CLIP_FRAMES,
    decoder_only: bool = False,
) -> list[float]:
    """Train for `seconds` of wall time (or `max_steps`) on clips of `clip_frames`; returns every loss.

    `decoder_only` keeps the encoder (so the latent space and its statistics) fixed.
    """
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    modules = [vae.post_quant_conv, vae.decoder] if decoder_only else [vae]
    parameters = [p for module in modules for p in module.parameters()]
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)
    vae.train()
    vae.encoder.requires_grad_(not decoder_only)
    vae.quant_conv.requires_grad_(not decoder_only)
    losses: list[float] = []
    began = time.perf_counter()
    step = 0
    while time.perf_counter() - began < seconds and (max_steps is None or step < max_steps):
        videos, _ = sample_batch(batch_size, clip_frames, rng, config.height, config.width)
        loss = reconstruction_loss(vae, videos_to_tensor(videos), generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        losses.append(loss.item())
        step += 1
        if step % 25 == 0:
            log(f"vae step {step:5d}  loss {np.mean(losses[-25:]):.5f}  ({time.perf_counter() - began:.0f} s)")
    vae.eval()
    vae.requires_grad_(True)
    return losses


@torch.no_grad()
def encode_videos(vae: AutoencoderKLWan, videos: np.ndarray) -> torch.Tensor:
    """Posterior means `(batch, z_dim, frames, h, w)` of uint8 videos `(batch, frames, H, W, 3)` (1 + 4k frames)."""
    return vae.encode(videos_to_tensor(videos)).latent_dist.mean


@torch.no_grad()
def set_latent_statistics(vae: AutoencoderKLWan, config: TinyConfig, num_videos: int = 48, seed: int = 1) -> None:
    """Per-channel mean/std of encoded toy-world clips, registered in the VAE config."""
    videos, _ = sample_batch(num_videos, 33, seed, config.height, config.width)
    latents = encode_videos(vae, videos)  # (B, z, F, h, w)
    mean = latents.mean(dim=(0, 2, 3, 4))
    std = latents.std(dim=(0, 2, 3, 4))
    vae.register_to_config(latents_mean=mean.tolist(), latents_std=std.tolist())


@torch.no_grad()
def evaluate_reconstructions(
    vae: AutoencoderKLWan, config: TinyConfig, num_frames: int = 81, first_frame: int = 40
) -> dict[str, float]:
    """Toy-world metrics of VAE round trips of one video per prompt, from `first_frame` on (past the decoder's
    36-frame causal receptive field, so the steady state of long videos is what gets scored)."""
    results = []
    for index, prompt in enumerate(all_prompts()):
        video = render_video(prompt, num_frames, config.height, config.width, seed=index)
        latents = encode_videos(vae, video[None])
        recon = tensor_to_videos(vae.decode(latents).sample)[0]
        results.append(evaluate_video(recon, prompt, (first_frame, num_frames)))
    return summarise(results)

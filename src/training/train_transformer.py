"""Teacher-forcing training of the tiny `KreaRealtimeTransformer3DModel` on encoded toy-world videos.

One training sample is a clip of `clip_frames` latent frames laid out as `[clean frames; noisy frames]`
(`teacher_forcing_frame_mask`): clean frames play the cache (timestep 0, block-causal among themselves),
each noisy chunk sees the clean sink + window before it and itself, with its own noise level. The loss is
the MSE of the implied clean sample `x0_hat = x_t - sigma * v` on the noisy half only.

Clips always start with the video's first `sink_frames` frames (the sink at generation time); the rest
comes either right after them or from a later segment of the same video. In relative position mode a chunk
late in a long video sees "sink, gap, recent window", and the gap clips show exactly that. The first
chunk after a gap has no recent context (it could not know where the shape is), so its loss is masked.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..models.krea_realtime import ChunkLayout, KreaRealtimeTransformer3DModel, teacher_forcing_frame_mask
from ..pipelines.flow_matching import add_noise, predict_clean, sigma_for_step, sigmas_from_uniform
from ..pipelines.request.text_encoding import encode_prompts
from ..toyworld.world import all_prompts, render_video
from .tiny_components import TinyConfig
from .train_vae import encode_videos


@dataclass
class LatentVideos:
    """Normalised latents of whole toy-world videos and the text embedding of each video's prompt."""

    latents: torch.Tensor  # (videos, z_dim, frames, h, w), (z - latents_mean) / latents_std
    prompt_ids: torch.Tensor  # (videos,) index into `prompt_embeds`
    prompt_embeds: torch.Tensor  # (prompts, max_sequence_length, text_dim)


def render_seed(prompt_index: int, video_seed: int) -> int:
    """The `render_video` seed of video `video_seed` of prompt `all_prompts()[prompt_index]` in a latent data set.

    Training uses video seeds `range(--videos-per-prompt)`; evaluations pick render seeds outside this map.
    """
    return 1000 * video_seed + prompt_index


def held_start(video: np.ndarray, held_frames: int) -> np.ndarray:
    """`video` as image-to-video begins it: frame 0 held for `held_frames` frames, then frames 1, 2, ... (same length).

    The pipeline's default `image_mode="chunk"` repeats the start image over the first chunk and generates the
    motion after it; these clips teach the model that a still first chunk is a start, not a scene at rest.
    """
    if held_frames <= 1:
        return video
    held = np.repeat(video[:1], held_frames, axis=0)
    return np.concatenate([held, video[1 : len(video) - held_frames + 1]])


@torch.no_grad()
def build_latent_videos(  # noqa: PLR0913 (data-set options as keywords)
    vae,
    tokenizer,
    text_encoder,
    config: TinyConfig,
    seeds: range,
    num_frames: int = 97,
    batch_size: int = 16,
    held_start_frames: int = 0,
) -> LatentVideos:
    """Encode one video of `num_frames` (1 + 4k) frames per (prompt, seed); seeds of held-out sets must differ.

    `held_start_frames` > 1 renders each video as image-to-video starts it (`held_start`), encoded as one clip
    through the VAE, as the pipeline's stream encodes the start chunk and decodes the rest after it.
    """
    prompts = all_prompts()
    specs = [(p, s) for s in seeds for p in range(len(prompts))]
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    latents = []
    for start in range(0, len(specs), batch_size):
        batch = specs[start : start + batch_size]
        videos = np.stack(
            [
                held_start(
                    render_video(prompts[p], num_frames, config.height, config.width, render_seed(p, s)),
                    held_start_frames,
                )
                for p, s in batch
            ]
        )
        latents.append((encode_videos(vae, videos) - mean) / std)
    embeds = encode_prompts(tokenizer, text_encoder, prompts, config.max_sequence_length)
    return LatentVideos(torch.cat(latents), torch.tensor([p for p, _ in specs]), embeds)


def sample_clips(
    data: LatentVideos,
    batch_size: int,
    clip_frames: int,
    layout: ChunkLayout,
    rng: np.random.Generator,
    gap_prob: float = 0.6,
    first_chunk_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clean clips `(batch, z_dim, clip_frames, h, w)`, text `(batch, seq, text_dim)`, chunk loss weights `(batch, chunks)`.

    Each clip is the video's first `sink_frames` frames, then `clip_frames - sink_frames` consecutive frames
    starting right after them or, with probability `gap_prob`, after a random gap. The video's first chunk
    (no context: only the prompt says where the shape goes) weighs `first_chunk_weight`.
    """
    num_videos, video_frames = data.latents.shape[0], data.latents.shape[2]
    sink, rest = layout.sink_frames, clip_frames - layout.sink_frames
    videos = rng.integers(num_videos, size=batch_size)
    gaps = np.where(rng.random(batch_size) < gap_prob, rng.integers(1, video_frames - clip_frames + 1, batch_size), 0)
    clips = []
    for video, gap in zip(videos, gaps):
        frames = [*range(sink), *range(sink + gap, sink + gap + rest)]
        clips.append(data.latents[video, :, frames])
    num_chunks = clip_frames // layout.chunk_frames
    loss_mask = torch.ones(batch_size, num_chunks)
    video_start = (gaps == 0) | (sink >= layout.chunk_frames)  # chunk 0 holds the video's first frames
    loss_mask[torch.from_numpy(video_start), 0] = first_chunk_weight
    # After a gap the first chunk past the sink sees no recent frame: nothing tells it where the shape is.
    if sink // layout.chunk_frames < num_chunks:  # (a clip of the sink alone has no chunk after it)
        loss_mask[torch.from_numpy(gaps > 0), sink // layout.chunk_frames] = 0.0
    return torch.stack(clips), data.prompt_embeds[data.prompt_ids[videos]], loss_mask


def sample_chunk_sigmas(
    batch_size: int, num_chunks: int, config: TinyConfig, generator: torch.Generator, step_prob: float = 0.75
) -> torch.Tensor:
    """`(batch, chunks)` noise levels: mostly the generation's warped step values, else warped uniform draws."""
    steps = torch.tensor([sigma_for_step(d, config.shift) for d in config.denoising_steps])
    picked = steps[torch.randint(len(steps), (batch_size, num_chunks), generator=generator)]
    uniform = sigmas_from_uniform(torch.rand(batch_size, num_chunks, generator=generator), config.shift)
    use_steps = torch.rand(batch_size, num_chunks, generator=generator) < step_prob
    return torch.where(use_steps, picked, uniform.clamp(min=0.02))


def teacher_forcing_inputs(
    clean: torch.Tensor, noise: torch.Tensor, chunk_sigmas: torch.Tensor, layout: ChunkLayout
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Model inputs for `[clean; noisy]` teacher forcing.

    Args:
        clean: `(batch, z_dim, F, h, w)` clean latents (the cache).
        noise: like `clean`.
        chunk_sigmas: `(batch, F // chunk_frames)` noise level of every noisy chunk.

    Returns:
        hidden_states `(batch, z_dim, 2F, h, w)`, timestep `(batch, 2F)` (0 on the clean half, 1000 * sigma on
        the noisy half), per-frame sigmas of the noisy half `(batch, 1, F, 1, 1)`, frame_indices `(2F,)` and
        frame_mask `(2F, 2F)`.
    """
    num_frames = clean.shape[2]
    frame_sigmas = chunk_sigmas.repeat_interleave(layout.chunk_frames, dim=1)  # (B, F)
    sigma_5d = frame_sigmas[:, None, :, None, None]
    noisy = add_noise(clean, noise, sigma_5d)
    hidden_states = torch.cat([clean, noisy], dim=2)
    timestep = torch.cat([torch.zeros_like(frame_sigmas), 1000.0 * frame_sigmas], dim=1)
    frame_indices, frame_mask = teacher_forcing_frame_mask(num_frames, layout)
    return hidden_states, timestep, sigma_5d, frame_indices, frame_mask


def clean_prediction(
    model: KreaRealtimeTransformer3DModel,
    clean: torch.Tensor,
    text: torch.Tensor,
    chunk_sigmas: torch.Tensor,
    noise: torch.Tensor,
    layout: ChunkLayout,
    context: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`x0_hat` of the noisy half `(batch, z_dim, F, h, w)` and the per-frame sigmas used.

    The noisy half is made from `clean`; the clean half (the cache) is `context` when given.
    """
    hidden_states, timestep, sigma_5d, frame_indices, frame_mask = teacher_forcing_inputs(
        clean, noise, chunk_sigmas, layout
    )
    if context is not None:
        hidden_states = torch.cat([context, hidden_states[:, :, clean.shape[2] :]], dim=2)
    velocity = model(
        hidden_states, timestep, text, layout=layout, frame_indices=frame_indices, frame_mask=frame_mask
    ).sample
    num_frames = clean.shape[2]
    return predict_clean(hidden_states[:, :, num_frames:], velocity[:, :, num_frames:], sigma_5d), sigma_5d


def teacher_forcing_loss(
    model, clean, text, chunk_sigmas, noise, layout: ChunkLayout, loss_mask: torch.Tensor | None = None, context=None
) -> torch.Tensor:
    """Masked mean over noisy chunks of the per-chunk MSE of `x0_hat` (`context` replaces the clean half)."""
    x0_hat, _ = clean_prediction(model, clean, text, chunk_sigmas, noise, layout, context)
    per_frame = (x0_hat - clean).pow(2).mean(dim=(1, 3, 4))  # (B, F)
    per_chunk = per_frame.unflatten(1, (-1, layout.chunk_frames)).mean(-1)  # (B, chunks)
    if loss_mask is None:
        return per_chunk.mean()
    return (per_chunk * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)


@torch.no_grad()
def context_check(
    model, data: LatentVideos, config: TinyConfig, clip_frames: int, num_clips: int = 32, seed: int = 123
) -> dict[str, float]:
    """x0 error of the last chunk at full noise, with the real context vs another video's context vs zeros.

    A model that uses its cache must predict the last chunk (where the shape is) far better with the real
    context. Errors are MSE in normalised latent units, on held-out clips (half of them with a gap after the sink).
    """
    layout = config.layout()
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    clean, text, _ = sample_clips(data, num_clips, clip_frames, layout, rng, gap_prob=0.5)
    noise = torch.randn(clean.shape, generator=generator)
    num_chunks = clip_frames // layout.chunk_frames
    results = {}
    last = slice(clip_frames - layout.chunk_frames, clip_frames)
    swapped = clean.roll(1, dims=0)  # another video's frames as context
    for sigma in (sigma_for_step(config.denoising_steps[0], config.shift), sigma_for_step(500, config.shift)):
        sigmas = torch.full((num_clips, num_chunks), sigma)
        for name, context in (("real", clean), ("other video", swapped), ("zeros", torch.zeros_like(clean))):
            was_training = model.training
            model.eval()
            x0_hat, _ = clean_prediction(model, clean, text, sigmas, noise, layout, context)
            model.train(was_training)
            error = (x0_hat[:, :, last] - clean[:, :, last]).pow(2).mean().item()
            results[f"sigma {sigma:.3f} context {name}"] = error
    return results


def train_transformer(  # noqa: PLR0913 (hyperparameters as keywords, one per CLI flag)
    model: KreaRealtimeTransformer3DModel,
    data: LatentVideos,
    config: TinyConfig,
    seconds: float,
    max_steps: int | None = None,
    batch_size: int = 8,
    clip_frames: int = 18,
    lr: float = 3e-4,
    warmup_steps: int = 200,
    seed: int = 0,
    log=print,
    log_every: int = 50,
    on_step=None,
    on_interval=None,
    interval_seconds: float = 600.0,
    context_noise: float = 0.05,
    gap_prob: float = 0.6,
    first_chunk_weight: float = 1.0,
    first_chunk_batches: float = 0.0,
    start_image_data: LatentVideos | None = None,
    start_image_batches: float = 0.0,
) -> list[float]:
    """AdamW, warmup then cosine decay to 10% over the run, for `seconds` of wall time or `max_steps`.

    Half the clips get Gaussian noise of std up to `context_noise` on their clean (context) frames, still
    at timestep 0: at generation time the cache holds the model's own, slightly imperfect, predictions.
    `on_step(model)` runs after every optimizer step (EMA); `on_interval(step)` every `interval_seconds`
    (checkpointing, context checks). `gap_prob` and `first_chunk_weight`: see `sample_clips`. A share
    `first_chunk_batches` of the steps trains on the videos' first chunks alone (no context: the prompt is all
    that says where the shape goes); these batches are a fraction of a clip's cost. A share `start_image_batches`
    samples its clips from `start_image_data` (videos built with `held_start_frames`: image-to-video's start) with
    no loss on the first chunk, which the pipeline never denoises. Returns the loss of every step.
    """
    if start_image_batches and start_image_data is None:
        raise ValueError("start_image_batches needs start_image_data (videos built with held_start_frames)")
    layout = config.layout()
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    model.train()
    losses: list[float] = []
    began = last_interval = time.perf_counter()
    step = 0

    def progress() -> float:
        by_time = (time.perf_counter() - began) / seconds
        return min(1.0, max(by_time, step / max_steps if max_steps else 0.0))

    while time.perf_counter() - began < seconds and (max_steps is None or step < max_steps):
        if start_image_batches and rng.random() < start_image_batches:
            clean, text, loss_mask = sample_clips(
                start_image_data, batch_size, clip_frames, layout, rng, gap_prob, first_chunk_weight=0.0
            )
        elif first_chunk_batches and rng.random() < first_chunk_batches:
            first_frames = max(layout.chunk_frames, layout.sink_frames)  # the first chunk (with a sink: the sink)
            clean, text, loss_mask = sample_clips(data, batch_size, first_frames, layout, rng, gap_prob=0.0)
        else:
            clean, text, loss_mask = sample_clips(
                data, batch_size, clip_frames, layout, rng, gap_prob, first_chunk_weight
            )
        sigmas = sample_chunk_sigmas(batch_size, loss_mask.shape[1], config, generator)
        noise = torch.randn(clean.shape, generator=generator)
        context_std = (
            context_noise
            * torch.rand(batch_size, generator=generator)
            * (torch.rand(batch_size, generator=generator) < 0.5)
        )
        context = clean + context_std.view(-1, 1, 1, 1, 1) * torch.randn(clean.shape, generator=generator)
        loss = teacher_forcing_loss(model, clean, text, sigmas, noise, layout, loss_mask, context=context)
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup_steps) * (0.55 + 0.45 * math.cos(math.pi * progress()))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        step += 1
        if on_step is not None:
            on_step(model)
        if step % log_every == 0:
            elapsed = time.perf_counter() - began
            log(f"step {step:6d}  loss {np.mean(losses[-log_every:]):.5f}  {step / elapsed:.2f} steps/s")
        if on_interval is not None and time.perf_counter() - last_interval > interval_seconds:
            model.eval()
            on_interval(step)
            model.train()
            last_interval = time.perf_counter()
    model.eval()
    return losses

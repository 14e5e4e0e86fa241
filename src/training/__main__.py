"""Train the tiny toy-world pipeline and save it as a diffusers pipeline folder.

    python examples/train_tiny.py --out src/assets/tiny-bouncing-shapes --minutes 60

Stages: (1) tokenizer and frozen random text encoder, (2) VAE (or `--vae-from` a trained one), (3) encode
toy-world videos to normalised latents, (4) teacher-forcing training of the transformer, checkpointing the
whole pipeline folder and printing a context check every `--checkpoint-minutes`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from diffusers import AutoencoderKLWan
from transformers import UMT5EncoderModel

from ..models.krea_realtime import KreaRealtimeTransformer3DModel
from .command_line import parse_training_arguments, training_arguments
from .tiny_components import (
    TinyConfig,
    build_scheduler,
    build_text_encoder,
    build_tokenizer,
    build_transformer,
    build_vae,
)
from .train_transformer import LatentVideos, build_latent_videos, context_check, train_transformer
from .train_vae import evaluate_reconstructions, set_latent_statistics, train_vae

HELD_OUT_SEEDS = range(100, 101)
# The VAE schedule of the shipped model: short clips at a high lr, then longer clips so the causal caches
# of encoder and decoder reach their steady state (what 1000-frame streaming decodes run in); the last
# phase tunes only the decoder, so the latent space the transformer learns is fixed before it.
VAE_PHASES = (
    dict(max_steps=500, batch_size=6, lr=1.5e-3, clip_frames=5),
    dict(max_steps=700, batch_size=6, lr=1e-3, clip_frames=5),
    dict(max_steps=300, batch_size=3, lr=5e-4, clip_frames=13),
    # Decoder only (latents unchanged), 41-frame clips: past its 36-frame causal receptive field. Batches of 4
    # matter: batches of 1-2 swung the decoder between colours (red decoded as blue, or blue as red).
    dict(max_steps=120, batch_size=4, lr=1e-4, clip_frames=41, decoder_only=True),
)  # training videos use seeds 0 .. --videos-per-prompt - 1


class EMA:
    """Exponential moving average of a model's weights, with the usual warm-up of the decay."""

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        self.decay = decay
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.updates = 0

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        self.updates += 1
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        for key, value in model.state_dict().items():
            if value.dtype.is_floating_point:
                self.shadow[key].lerp_(value, 1 - decay)

    def copy_to(self, model: torch.nn.Module) -> None:
        model.load_state_dict(self.shadow)


def save_pipeline(out: Path, tokenizer, text_encoder, transformer, vae, scheduler, config: TinyConfig) -> None:
    """Save all components as a diffusers pipeline folder (the lead's pipeline writes `model_index.json`)."""
    try:
        from ..pipelines.families.pipeline_krea_realtime import KreaRealtimeVideoPipeline
    except ImportError:
        KreaRealtimeVideoPipeline = None
    out.mkdir(parents=True, exist_ok=True)
    if KreaRealtimeVideoPipeline is not None:
        pipeline = KreaRealtimeVideoPipeline(
            tokenizer=tokenizer,
            text_encoder=text_encoder,
            transformer=transformer,
            vae=vae,
            scheduler=scheduler,
            chunk_frames=config.chunk_frames,
            sink_frames=config.sink_frames,
            window_frames=config.window_frames,
            position_mode=config.position_mode,
            denoising_steps=list(config.denoising_steps),
            max_sequence_length=config.max_sequence_length,
            height=config.height,
            width=config.width,
        )
        pipeline.save_pretrained(out, safe_serialization=True)
        return
    for name, component in (("transformer", transformer), ("vae", vae), ("text_encoder", text_encoder)):
        component.save_pretrained(out / name, safe_serialization=True)
    tokenizer.save_pretrained(out / "tokenizer")
    scheduler.save_pretrained(out / "scheduler")


def start_image_videos(vae, tokenizer, text_encoder, config, args, log) -> LatentVideos | None:
    """The training videos as image-to-video starts them (`held_start`), when `--start-image-batches` asks."""
    if not args.start_image_batches:
        return None
    data = build_latent_videos(
        vae, tokenizer, text_encoder, config, range(args.videos_per_prompt), held_start_frames=config.chunk_frames
    )
    log(f"start-image videos (frame 0 held {config.chunk_frames} frames): {tuple(data.latents.shape)}")
    return data


def argument_parser() -> argparse.ArgumentParser:
    """The Krea-like run's flags: the shared ones (`training_arguments`) with its defaults."""
    return training_arguments(
        __doc__.split("\n")[0],
        clip_frames=12,
        vae_from=None,
        vae_from_help="load a trained VAE instead of training one",
        init_from_help="fine-tune this pipeline folder: its transformer, text encoder and VAE (unless --vae-from) are "
        "loaded",
        start_image_help="share of steps on clips that start as image-to-video does (frame 0 held over the first "
        "chunk, then the motion): without them a start image's video stays still for its first chunks",
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_training_arguments(argument_parser(), argv)
    torch.set_num_threads(args.threads)
    config = TinyConfig()
    began = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - began:7.0f} s] {message}", flush=True)

    log(f"config {config}")
    # 1. Text
    tokenizer = build_tokenizer()
    text_encoder = build_text_encoder(config, len(tokenizer), seed=args.seed)
    if args.init_from is not None:
        text_encoder.load_state_dict(UMT5EncoderModel.from_pretrained(args.init_from / "text_encoder").state_dict())
        args.vae_from = args.vae_from or args.init_from / "vae"
    # 2. VAE
    if args.vae_from is not None:
        vae = AutoencoderKLWan.from_pretrained(args.vae_from).eval()
        log(f"loaded VAE from {args.vae_from}")
    else:
        vae = build_vae(config, seed=args.seed)
        for phase, phase_args in enumerate(VAE_PHASES):
            log(f"VAE phase {phase}: {phase_args}")
            train_vae(vae, config, seconds=float("inf"), seed=args.seed + phase, log=log, **phase_args)
        set_latent_statistics(vae, config)
    vae.requires_grad_(False)
    log(f"VAE latents_mean {vae.config.latents_mean} latents_std {vae.config.latents_std}")
    log(f"VAE reconstructions {json.dumps(evaluate_reconstructions(vae, config))}")
    # 3. Latent videos
    train_data = build_latent_videos(vae, tokenizer, text_encoder, config, range(args.videos_per_prompt))
    held_out = build_latent_videos(vae, tokenizer, text_encoder, config, HELD_OUT_SEEDS)
    log(f"latent videos: train {tuple(train_data.latents.shape)}, held out {tuple(held_out.latents.shape)}")
    start_image_data = start_image_videos(vae, tokenizer, text_encoder, config, args, log)
    # 4. Transformer
    transformer = build_transformer(config, seed=args.seed)
    if args.init_from is not None:
        trained = KreaRealtimeTransformer3DModel.from_pretrained(args.init_from / "transformer")
        transformer.load_state_dict(trained.state_dict())
        log(f"transformer initialised from {args.init_from}")
    log(f"transformer parameters {sum(p.numel() for p in transformer.parameters()) / 1e6:.2f} M")
    ema = EMA(transformer, decay=0.999)
    scheduler = build_scheduler(config)
    ema_model = build_transformer(config, seed=args.seed)

    def checkpoint(step: int) -> None:
        ema.copy_to(ema_model)
        for name, model in (("raw", transformer), ("ema", ema_model)):
            checks = context_check(model, held_out, config, args.clip_frames)
            log(f"context check ({name}) at step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in checks.items()))
        save_pipeline(args.out, tokenizer, text_encoder, ema_model.eval(), vae, scheduler, config)
        log(f"saved pipeline (EMA weights) to {args.out} at step {step}")

    losses = train_transformer(
        transformer,
        train_data,
        config,
        seconds=args.minutes * 60,
        max_steps=args.steps,
        batch_size=args.batch_size,
        clip_frames=args.clip_frames,
        lr=args.lr,
        seed=args.seed,
        log=log,
        on_step=ema.update,
        on_interval=checkpoint,
        interval_seconds=args.checkpoint_minutes * 60,
        start_image_data=start_image_data,
        start_image_batches=args.start_image_batches,
    )
    log(f"trained {len(losses)} steps, final loss (mean of last 100) {sum(losses[-100:]) / len(losses[-100:]):.5f}")
    checkpoint(len(losses))


if __name__ == "__main__":
    main()

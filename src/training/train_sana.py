"""Train the tiny SANA-like toy-world pipeline (`tiny-bouncing-shapes-sana`) and save it as a pipeline folder.

The shipped model, in three runs (the first stopped by hand at its 44-minute checkpoint, step 2482):

    python examples/train_tiny_sana.py --out stage1 --minutes 95 --threads 2 --first-chunk-weight 2
    python examples/train_tiny_sana.py --out stage2 --init-from stage1 --minutes 70 --threads 2 --lr 3e-4 \\
        --first-chunk-weight 2 --first-chunk-batches 0.5
    python examples/train_tiny_sana.py --package stage2 --out src/assets/tiny-bouncing-shapes-sana
    python examples/train_tiny_sana.py --out ft --init-from src/assets/tiny-bouncing-shapes-sana --minutes 40 \\
        --lr 2e-4 --first-chunk-weight 2 --first-chunk-batches 0.4 --start-image-batches 0.4

    (the last run, the image-to-video fine-tune, 5234 steps on one thread; its `ft/transformer` weights replaced the
    shipped ones)

Only the transformer is trained: the VAE is the Krea-like default's (`--vae-from`), the Gemma-style text
encoder is random and frozen. The data pipeline, teacher-forcing loss, noise-level sampling, context check,
EMA and optimiser loop are the Krea-like default's (`rolldiff.training.train_transformer`), reached through
`TeacherForcingAdapter`, which gives `LongSanaTransformer3DModel` the call signature those helpers use.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from diffusers import AutoencoderKLWan
from transformers import Gemma2Model

from ..models.long_sana import LongSanaTransformer3DModel
from .__main__ import EMA, HELD_OUT_SEEDS, start_image_videos
from .command_line import parse_training_arguments, training_arguments
from .sana_components import (
    SanaTinyConfig,
    build_gemma_text_encoder,
    build_gemma_tokenizer,
    build_sana_scheduler,
    build_sana_transformer,
)
from .train_transformer import build_latent_videos, context_check, train_transformer

DEFAULT_VAE = Path(__file__).resolve().parent.parent / "assets" / "tiny-bouncing-shapes" / "vae"


class TeacherForcingAdapter(torch.nn.Module):
    """`model(hidden_states, timestep, text, layout=...)` (the Krea-like training call) -> LongSANA's reference.

    The `[clean; noisy]` block-causal structure is LongSANA's own (`teacher_forcing=True`); the Wan-style
    `frame_indices`/`frame_mask` the shared helpers pass are not needed and are ignored. Text embeddings
    are zero past each prompt's end (`encode_prompts`), which gives the cross-attention mask the pipeline
    passes from its tokenizer.
    """

    def __init__(self, transformer: LongSanaTransformer3DModel) -> None:
        super().__init__()
        self.transformer = transformer

    def forward(self, hidden_states, timestep, encoder_hidden_states, layout, frame_indices=None, frame_mask=None):
        text_mask = encoder_hidden_states.abs().amax(dim=-1) > 0  # (B, text_tokens)
        return self.transformer(
            hidden_states,
            encoder_hidden_states,
            timestep,
            encoder_attention_mask=text_mask,
            layout=layout,
            teacher_forcing=True,
        )


def save_sana_components(out: Path, tokenizer, text_encoder, transformer, vae, scheduler) -> None:
    """Save every component in its pipeline sub-folder (`LongSanaVideoPipeline.from_components` adds the rest).

    Checkpoints write only components: a long run never imports code that may change while it trains.
    """
    out.mkdir(parents=True, exist_ok=True)
    for name, component in (("transformer", transformer), ("vae", vae), ("text_encoder", text_encoder)):
        component.save_pretrained(out / name, safe_serialization=True)
    tokenizer.save_pretrained(out / "tokenizer")
    scheduler.save_pretrained(out / "scheduler")


def package_sana_pipeline(components: Path, out: Path, config: SanaTinyConfig | None = None) -> None:
    """Assemble saved components into a `LongSanaVideoPipeline` folder with the generation settings of `config`.

    Settings: chunk 3, a window of 4 chunks (the chunk and the 3 before it, what training clips show),
    positions re-based past the RoPE table (`relative`: unbounded length), the trained denoising steps.
    """
    from transformers import PreTrainedTokenizerFast

    from ..pipelines.families.pipeline_long_sana import LongSanaVideoPipeline

    config = config or SanaTinyConfig()
    pipeline = LongSanaVideoPipeline(
        tokenizer=PreTrainedTokenizerFast.from_pretrained(components / "tokenizer"),
        text_encoder=Gemma2Model.from_pretrained(components / "text_encoder").eval(),
        transformer=LongSanaTransformer3DModel.from_pretrained(components / "transformer").eval(),
        vae=AutoencoderKLWan.from_pretrained(components / "vae").eval(),
        scheduler=build_sana_scheduler(config),
        chunk_frames=config.chunk_frames,
        sink_frames=0,
        window_frames=None if config.context_chunks is None else config.chunk_frames * (config.context_chunks + 1),
        position_mode="relative",
        denoising_steps=list(config.denoising_steps),
        max_sequence_length=config.max_sequence_length,
        height=config.height,
        width=config.width,
    )
    pipeline.save_pretrained(out, safe_serialization=True)


def argument_parser() -> argparse.ArgumentParser:
    """The SANA-like run's flags: the shared ones with its defaults, then its loss weighting and `--package`."""
    parser = training_arguments(
        __doc__.split("\n")[0],
        clip_frames=15,
        vae_from=DEFAULT_VAE,
        vae_from_help="the trained VAE to share",
        init_from_help="start from this folder's transformer (a checkpoint or pipeline)",
        start_image_help="share of steps on clips that start as image-to-video does (frame 0 held over the first "
        "chunk)",
    )
    parser.add_argument(
        "--gap-prob", type=float, default=0.6, help="share of clips that start mid-video rather than at frame 0"
    )
    parser.add_argument(
        "--first-chunk-weight",
        type=float,
        default=1.0,
        help="loss weight of a video's first chunk: with no sink it is the only place the prompt alone sets the "
        "motion, and later chunks copy that motion from their context (the shipped model: 2)",
    )
    parser.add_argument(
        "--first-chunk-batches",
        type=float,
        default=0.0,
        help="share of steps that train on the videos' first chunks alone: without them the model learned colour "
        "and shape from the prompt but took its motion only from context, ignoring the direction word",
    )
    parser.add_argument("--package", type=Path, default=None, help="only assemble this components folder into --out")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_training_arguments(
        argument_parser(), argv, shares=("gap_prob", "first_chunk_batches", "start_image_batches")
    )
    torch.set_num_threads(args.threads)
    config = SanaTinyConfig()
    if args.package is not None:
        package_sana_pipeline(args.package, args.out, config)
        return
    began = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - began:7.0f} s] {message}", flush=True)

    log(f"config {config}")
    tokenizer = build_gemma_tokenizer()
    text_encoder = build_gemma_text_encoder(config, len(tokenizer), seed=args.seed)
    if args.init_from is not None and (args.init_from / "text_encoder").is_dir():
        text_encoder.load_state_dict(Gemma2Model.from_pretrained(args.init_from / "text_encoder").state_dict())
    vae = AutoencoderKLWan.from_pretrained(args.vae_from).eval()
    vae.requires_grad_(False)
    log(f"loaded VAE from {args.vae_from}")
    train_data = build_latent_videos(vae, tokenizer, text_encoder, config, range(args.videos_per_prompt))
    held_out = build_latent_videos(vae, tokenizer, text_encoder, config, HELD_OUT_SEEDS)
    log(f"latent videos: train {tuple(train_data.latents.shape)}, held out {tuple(held_out.latents.shape)}")
    start_image_data = start_image_videos(vae, tokenizer, text_encoder, config, args, log)
    transformer = build_sana_transformer(config, seed=args.seed)
    if args.init_from is not None:
        trained = LongSanaTransformer3DModel.from_pretrained(args.init_from / "transformer")
        transformer.load_state_dict(trained.state_dict())
        log(f"transformer initialised from {args.init_from}")
    log(f"transformer parameters {sum(p.numel() for p in transformer.parameters()) / 1e6:.2f} M")
    ema = EMA(transformer, decay=0.999)
    ema_model = build_sana_transformer(config, seed=args.seed)
    scheduler = build_sana_scheduler(config)

    def checkpoint(step: int) -> None:
        ema.copy_to(ema_model)
        for name, model in (("raw", transformer), ("ema", ema_model)):
            checks = context_check(TeacherForcingAdapter(model), held_out, config, args.clip_frames)
            log(f"context check ({name}) at step {step}: " + json.dumps({k: round(v, 4) for k, v in checks.items()}))
        save_sana_components(args.out, tokenizer, text_encoder, ema_model.eval(), vae, scheduler)
        log(f"saved components (EMA weights) to {args.out} at step {step}")

    losses = train_transformer(
        TeacherForcingAdapter(transformer),
        train_data,
        config,
        seconds=args.minutes * 60,
        max_steps=args.steps,
        batch_size=args.batch_size,
        clip_frames=args.clip_frames,
        lr=args.lr,
        seed=args.seed,
        log=log,
        on_step=lambda _: ema.update(transformer),
        on_interval=checkpoint,
        interval_seconds=args.checkpoint_minutes * 60,
        gap_prob=args.gap_prob,
        first_chunk_weight=args.first_chunk_weight,
        first_chunk_batches=args.first_chunk_batches,
        start_image_data=start_image_data,
        start_image_batches=args.start_image_batches,
    )
    log(f"trained {len(losses)} steps, final loss (mean of last 100) {sum(losses[-100:]) / len(losses[-100:]):.5f}")
    checkpoint(len(losses))


if __name__ == "__main__":
    main()

"""Does an embedded model read its prompt and its cache? Two held-out x0 checks of a pipeline folder.

    python -m rolldiff.training.prompt_check --pipeline src/assets/tiny-bouncing-shapes

- **direction swap:** the x0 error of a video's first chunk (no context: only the prompt says where the shape
  goes) at the noise of step 500, under the video's own prompt and under the same prompt with the opposite
  direction. A model that reads the direction word gets a much larger error under the swap.
- **context check** (`context_check`): the last chunk of a clip with its real context, another video's, or zeros.

Errors are MSE in normalised latent units on the held-out videos training never saw (`HELD_OUT_SEEDS`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..pipelines.flow_matching import sigma_for_step
from ..toyworld.world import all_prompts, parse_prompt
from .train_transformer import LatentVideos, build_latent_videos, clean_prediction, context_check

OPPOSITE = {"left": "right", "right": "left", "up": "down", "down": "up"}


def opposite_direction_ids(prompt_ids: torch.Tensor) -> torch.Tensor:
    """Each prompt index -> the index of the same colour and shape moving the opposite way."""
    prompts = all_prompts()
    index = {prompt: i for i, prompt in enumerate(prompts)}
    swapped = []
    for prompt_id in prompt_ids.tolist():
        spec = parse_prompt(prompts[prompt_id])
        swapped.append(index[f"a {spec.colour} {spec.shape} moving {OPPOSITE[spec.direction]}"])
    return torch.tensor(swapped)


@torch.no_grad()
def direction_swap_check(model, data: LatentVideos, config, num_clips: int = 96, seed: int = 123) -> dict[str, float]:
    """First-chunk x0 error at step 500's noise under the own prompt and the opposite direction's."""
    layout = config.layout()
    first_frames = max(layout.chunk_frames, layout.sink_frames)
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    videos = rng.integers(data.latents.shape[0], size=num_clips)
    clean = data.latents[videos, :, :first_frames]
    noise = torch.randn(clean.shape, generator=generator)
    sigmas = torch.full((num_clips, first_frames // layout.chunk_frames), sigma_for_step(500, config.shift))
    own = data.prompt_ids[videos]
    errors = {}
    for name, prompt_ids in (("own prompt", own), ("opposite direction", opposite_direction_ids(own))):
        x0_hat, _ = clean_prediction(model, clean, data.prompt_embeds[prompt_ids], sigmas, noise, layout)
        chunk = slice(first_frames - layout.chunk_frames, first_frames)  # the chunk being made (after any sink)
        errors[f"first chunk, {name}"] = (x0_hat[:, :, chunk] - clean[:, :, chunk]).pow(2).mean().item()
    return errors


def model_and_config(pipe):
    """The training call of a pipeline's transformer (`TeacherForcingAdapter` for LongSANA) and its tiny config."""
    from ..pipelines.families.pipeline_long_sana import LongSanaVideoPipeline
    from .sana_components import SanaTinyConfig
    from .tiny_components import TinyConfig
    from .train_sana import TeacherForcingAdapter

    if isinstance(pipe, LongSanaVideoPipeline):
        return TeacherForcingAdapter(pipe.transformer).eval(), SanaTinyConfig()
    return pipe.transformer.eval(), TinyConfig()


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pipeline", type=Path, default=Path("src/assets/tiny-bouncing-shapes"))
    parser.add_argument("--clip-frames", type=int, default=12, help="latent frames per context-check clip")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from ..defaults import load_pipeline
    from .__main__ import HELD_OUT_SEEDS

    pipe = load_pipeline(args.pipeline, device="cpu", dtype="float32")
    model, config = model_and_config(pipe)
    held_out = build_latent_videos(pipe.vae, pipe.tokenizer, pipe.text_encoder, config, HELD_OUT_SEEDS)
    results = {
        **direction_swap_check(model, held_out, config),
        **context_check(model, held_out, config, args.clip_frames),
    }
    print(json.dumps({k: round(v, 4) for k, v in results.items()}, indent=1))
    return results


if __name__ == "__main__":
    main()

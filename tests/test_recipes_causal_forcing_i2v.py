"""Causal Forcing image-to-video against the authors' code (tests/goldens/causal-forcing/, `i2v_*` scenarios).

Upstream (`inference.py --i2v`, thu-ml/Causal-Forcing@1fc7bbc, recorded by tools/record_causal_forcing_goldens.py)
encodes the start image with its `WanVAEWrapper` into `initial_latent`, writes that one latent frame to the output
and caches it in a t=0 pass (`pipeline/causal_inference.py:165-199`), then denoises one-frame blocks, the first of
them with `denoising_step_list_first_chunk` where the config has one (`:222-228`). Ours: `image=` under the frame-wise
recipes (`image_mode="frame"`), the same uint8 picture through our encoder (diffusers' `AutoencoderKLWan` on the same
tiny Wan 2.1 VAE weights), upstream's noise injected in upstream's order. Every chunk, the image's latent first,
must equal upstream's within 1e-4; the floor (upstream fp32 vs fp64) is printed.

Upstream has no chunk-wise image-to-video (`inference.py:151` asserts `num_frame_per_block == 1` for `--i2v`) and no
prompt switch (one prompt per video in `inference.py`, `causal_inference.py`, `demo.py`, `long_video/`), so neither
is tested against it here.
"""

from __future__ import annotations

import pytest
import torch
from recipe_goldens import Golden, chunk_errors, inject_noise, load_golden, load_transformer
from test_recipes_pipeline import TOLERANCE, krea_golden_pipeline

from rolldiff import KreaRealtimeVideoPipeline

SCENARIOS = ("i2v_framewise", "i2v_framewise_2step", "i2v_framewise_1step")


def _pipeline(golden: Golden) -> KreaRealtimeVideoPipeline:
    """The Krea pipeline on the golden's tiny transformer and tiny VAE (both in the authors' key layouts)."""
    return krea_golden_pipeline(golden, load_transformer("causal-forcing"), vae_recipe="causal-forcing")


@pytest.mark.parametrize("scenario", SCENARIOS)
@torch.no_grad()
def test_causal_forcing_image_to_video_matches_upstream(scenario, monkeypatch):
    """The frame-wise recipes (4-, 2- and 1-step) with a start image against `CausalInferencePipeline.inference(...,
    initial_latent=...)`: the image's latent as chunk 0, then 8 denoised frames (the first with the 4-step list)."""
    golden = load_golden("causal-forcing", scenario)
    assert golden.settings["image"]
    pipe = _pipeline(golden)
    first = golden.settings.get("first_timesteps")
    noise = inject_noise(golden, monkeypatch)
    stream = pipe.stream(
        num_frames=pipe.latent_to_frames(golden.settings["latent_frames"]), prompt_embeds=golden.text["a"],
        image=golden.tensor("image").numpy(), output_type="latent", recipe=golden.settings["recipe"],
    )  # fmt: skip
    request = stream.request
    assert request.geometry.first_chunk_frames == 1 and request.geometry.chunk_frames == 1
    assert request.num_chunks == golden.settings["num_chunks"]
    assert list(request.step_plan.timesteps) == pytest.approx(golden.settings["timesteps"], abs=1e-3)
    if first is not None:  # the first DENOISED chunk (chunk 1, after the image's) runs the first-chunk list
        assert request.step_plan_for(1) is request.first_step_plan
        assert list(request.first_step_plan.timesteps) == pytest.approx(first, abs=1e-3)
    made = list(stream)
    errors = chunk_errors(golden, made)
    print(
        f"\ncausal-forcing/{scenario} through the pipeline: image latent {errors[0]:.1e}, max {max(errors):.2e}, "
        f"floor {golden.floor:.1e}"
    )
    assert noise.noise.exhausted
    assert max(errors) <= TOLERANCE, errors

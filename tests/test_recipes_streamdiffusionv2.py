"""StreamDiffusionV2's goldens (tools/record_streamdiffusionv2_goldens.py): what they hold, and the parts of our
side already proven against them.

The goldens are the authors' own single-GPU drivers (chenfengxu714/StreamDiffusionV2 c5a0f20,
`streamv2v/inference_wo_batch.py` and the stream batch of `streamv2v/inference.py`) on the tiny random Wan, with every
noise draw, the input video, what the authors' VAE encoded and each block's clean latents. Proven here: the tiny
weights load through our converter, and our streaming encoder (diffusers' `AutoencoderKLWan`, Wan 2.1 VAE weights
through diffusers' converter, no latent normalisation, as the authors' `stream_encode` has none) gives the latents
upstream fed its model, block by block. The `recipe="streamdiffusionv2"` replay of the clean latents waits for the
loop options listed in `MISSING` (see the recorder's docstring for the upstream lines).
"""

from __future__ import annotations

import pytest
import torch
from recipe_goldens import load_golden, load_meta, load_transformer, load_vae

from rolldiff.pipelines.codecs.streaming_encode import StreamingWanEncoder

RECIPE = "streamdiffusionv2"
TOLERANCE = 1e-4


def test_golden_weights_load_through_our_converter():
    model = load_transformer(RECIPE)  # strict: every upstream key has a home, none is left over
    assert model.config.num_layers == load_meta(RECIPE)["upstream_model_config"]["num_layers"]


@pytest.mark.parametrize("scenario", ["v2v", "stream_batch"])
@torch.no_grad()
def test_our_streaming_encoder_gives_the_latents_upstream_encoded(scenario):
    """Block 0 is 1 + 4 pixel frames (2 latent frames), every later block 4 (1 latent frame), each encoded with the
    feature cache of the blocks before, as the authors' `WanVAE_.stream_encode` (vae.py:546-583) does."""
    golden = load_golden(RECIPE, scenario)
    encoder = StreamingWanEncoder(load_vae(RECIPE).double())
    video = golden.tensor("video").double()
    encoded = sorted((k for k in golden._tensors if k.startswith("encoded.")), key=lambda k: int(k.split(".")[1]))
    assert len(encoded) == 9  # the 37 input frames: 5, then 8 x 4
    start, errors = 0, []
    for index, name in enumerate(encoded):
        frames = 5 if index == 0 else 4
        ours = encoder.encode(video[:, :, start : start + frames])
        start += frames
        expected = golden.tensor(name).double()
        assert ours.shape == expected.shape, (index, ours.shape, expected.shape)
        errors.append(float((ours - expected).abs().max()))
    print(f"\n{scenario}: encoder max |ours - upstream| {max(errors):.1e} over {len(errors)} blocks")
    assert max(errors) <= TOLERANCE, errors


def test_the_v2v_golden_refreshes_the_adaptive_sink():
    """The scenario the adaptive sink needs: some block rewrites a sink frame. Upstream queues a refresh by putting a
    sink frame's end index in front of its eviction queue (causal_model.py:284-299) and consumes it with the chunk's
    last step once the cache is full (`:302-322`): a sink entry leaving the queue's front is a refresh."""
    meta = load_meta(RECIPE)
    tokens, sink = meta["tokens_per_frame"], meta["settings"]["config"]["num_sink_tokens"]
    kv_frames = meta["settings"]["config"]["num_kv_cache"]
    queues = meta["scenarios"]["v2v"]["evict_queues"]  # per chunk after block 0: per transformer block
    refreshes = []
    for index in range(1, len(queues)):  # queues[i]: after chunk i + 1, whose one frame is frame i + 2
        full = index + 2 >= kv_frames  # block 0 holds frames 0 and 1
        for layer, (before, after) in enumerate(zip(queues[index - 1], queues[index])):
            if full and before and before[0] <= sink * tokens and before[0] not in after[: len(after) - 2]:
                refreshes.append((index + 1, layer, before[0] // tokens - 1))
    print(f"\nv2v sink refreshes (chunk, transformer block, sink frame): {refreshes}")
    assert refreshes, queues
    assert meta["scenarios"]["v2v"]["queues_match_fp64"]  # the refresh decisions are not rounding noise


@pytest.mark.parametrize("scenario", ["plain", "v2v", "stream_batch"])
def test_goldens_hold_every_draw_and_a_small_floor(scenario):
    golden = load_golden(RECIPE, scenario)
    draws = [k for k in golden._tensors if k.startswith("draw.")]
    assert len(draws) == len(golden.settings["draw_shapes"])
    assert len(golden.clean) == 9  # block 0 (two latent frames), then 8 blocks of one
    assert golden.floor < 1e-5

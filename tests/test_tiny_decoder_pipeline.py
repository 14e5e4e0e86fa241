"""The pipelines decode through a tiny autoencoder (TAEHV architecture) when one is loaded."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from family_cases import FAMILIES
from safetensors.torch import save_file

from rolldiff.cli import main
from rolldiff.models import TinyVideoAutoencoder
from rolldiff.pipelines.io.resume import RunState, load_state, save_state

PROMPT = "a red circle moving left"
NARROW = dict(encoder_channels=8, decoder_channels=(16, 16, 8, 8))  # small widths: the architecture, tiny


def _tiny(latent_channels: int, space=(True, True, False)) -> TinyVideoAutoencoder:
    torch.manual_seed(0)
    return TinyVideoAutoencoder(
        latent_channels=latent_channels,
        decoder_time_upscale=(False, False, False),
        decoder_space_upscale=space,
        **NARROW,
    ).eval()


@pytest.fixture(scope="module", params=FAMILIES, ids=lambda case: case.name)
def pipe(request):
    pipe = request.param.make_pipeline()
    yield pipe
    pipe.load_tiny_autoencoder(None)


def _seed() -> torch.Generator:
    return torch.Generator().manual_seed(0)


@torch.no_grad()
def test_streams_decode_through_the_tiny_autoencoder_as_one_whole_clip_decode(pipe):
    full_vae = np.concatenate(list(pipe.stream(PROMPT, 10, generator=_seed())), axis=1)
    tiny = pipe.load_tiny_autoencoder(_tiny(pipe.transformer.config.out_channels))
    latents = torch.cat(list(pipe.stream(PROMPT, 10, generator=_seed(), output_type="latent")), dim=2)
    frames = np.concatenate(list(pipe.stream(PROMPT, 10, generator=_seed())), axis=1)
    np.testing.assert_allclose(frames, pipe.postprocess(tiny.decode(latents).sample, "np"), atol=1e-5)
    np.testing.assert_array_equal(pipe(PROMPT, num_frames=10, generator=_seed()).frames, frames)
    assert frames.shape == full_vae.shape and np.abs(frames - full_vae).max() > 1e-3
    pipe.load_tiny_autoencoder(None)
    np.testing.assert_array_equal(np.concatenate(list(pipe.stream(PROMPT, 10, generator=_seed())), axis=1), full_vae)


@torch.no_grad()
def test_a_tiny_decoder_stream_resumes_exactly(pipe, tmp_path):
    pipe.load_tiny_autoencoder(_tiny(pipe.transformer.config.out_channels))
    whole = list(pipe.stream(PROMPT, 10, generator=_seed()))
    stream = pipe.stream(PROMPT, 10, generator=_seed())
    first = [next(stream), next(stream)]
    save_state(tmp_path / "s.safetensors", RunState({}, 0, stream.state_dict()))
    resumed = pipe.stream(PROMPT, 10, generator=_seed())
    resumed.load_state_dict(load_state(tmp_path / "s.safetensors").stream)
    for made, expected in zip([*first, *resumed], whole, strict=True):
        np.testing.assert_array_equal(made, expected)
    pipe.load_tiny_autoencoder(None)


def test_a_tiny_autoencoder_for_other_latents_is_refused(pipe):
    with pytest.raises(ValueError, match="latent channels"):
        pipe.load_tiny_autoencoder(_tiny(pipe.transformer.config.out_channels + 1))


def test_generate_tiny_vae_flag(tmp_path, capsys):
    """The embedded default (8 latent channels, 4x spatial, one latent per frame) with a matching tiny decoder."""
    path = tmp_path / "tiny.safetensors"
    save_file(_tiny(8).state_dict(), str(path))
    out = tmp_path / "video.mp4"
    base = ["generate", "--prompt", PROMPT, "--seconds", "0.5", "--out", str(out)]
    assert main([*base, "--tiny-vae", str(path)]) == 0 and out.exists()
    assert main([*base, "--tiny-vae", str(tmp_path / "missing.pth")]) == 2
    assert "--tiny-vae" in capsys.readouterr().err

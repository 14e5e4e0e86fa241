"""StreamingWanDecoder: decoding chunk by chunk equals one `AutoencoderKLWan.decode` of the whole video."""

import pytest
import torch
from diffusers import AutoencoderKLWan
from tiny_components import seeded_wan_vae

from rolldiff.pipelines.codecs.streaming_decode import StreamingWanDecoder, denormalize_wan_latents

Z_DIM = 4
LATENT_FRAMES = 8
LATENT_SIZE = 4  # latent height and width

# Tiny random VAEs: the real Wan 2.1 layout (4x in time), one without temporal upsampling, and the Wan 2.2
# layout (patchified output, residual up blocks with their first_chunk shortcut).
VAE_CONFIGS = {
    "temporal_4x": dict(dim_mult=[1, 2, 2, 2], temperal_downsample=[False, True, True]),
    "no_temporal": dict(dim_mult=[1, 2, 2], temperal_downsample=[False, False]),
    "patchified_residual": dict(
        dim_mult=[1, 2, 2, 2],
        temperal_downsample=[False, True, True],
        patch_size=2,
        is_residual=True,
        in_channels=12,
        out_channels=12,
        decoder_base_dim=16,
    ),
}


def make_vae(name: str) -> AutoencoderKLWan:
    return seeded_wan_vae(Z_DIM, **VAE_CONFIGS[name])


def random_latents(seed: int, frames: int = LATENT_FRAMES) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, Z_DIM, frames, LATENT_SIZE, LATENT_SIZE, generator=generator)


def stream(decoder: StreamingWanDecoder, latents: torch.Tensor, chunk_frames: int) -> torch.Tensor:
    chunks = [decoder.decode(chunk) for chunk in latents.split(chunk_frames, dim=2)]
    return torch.cat(chunks, dim=2)


def one_shot(vae: AutoencoderKLWan, latents: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return vae.decode(latents).sample


@pytest.mark.parametrize("frames_per_call", [None, 1, 2])  # None on a CPU: a whole chunk per decoder call
@pytest.mark.parametrize("chunk_frames", [1, 2, 3, [3, 1, 4]])
@pytest.mark.parametrize("vae_name", list(VAE_CONFIGS))
def test_streamed_chunks_equal_one_shot_decode(vae_name, chunk_frames, frames_per_call):
    vae = make_vae(vae_name)
    latents = random_latents(seed=1)

    streamed = stream(StreamingWanDecoder(vae, frames_per_call=frames_per_call), latents, chunk_frames)

    torch.testing.assert_close(streamed, one_shot(vae, latents), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("frames_per_call", "calls"),
    [(None, [2, 1, 1]), (1, [3, 3, 3]), (2, [2, 2, 2])],  # the video's first latent frame always alone
)
def test_decoder_calls_per_chunk(frames_per_call, calls):
    vae = make_vae("temporal_4x")
    made = []
    handle = vae.decoder.register_forward_hook(lambda module, args, output: made.append(args[0].shape[2]))
    decoder = StreamingWanDecoder(vae, frames_per_call=frames_per_call)
    per_chunk = []
    for chunk in random_latents(seed=2, frames=9).split(3, dim=2):
        before = len(made)
        decoder.decode(chunk)
        per_chunk.append(len(made) - before)
    handle.remove()
    assert per_chunk == calls
    assert sum(made) == 9


@pytest.mark.parametrize("frames_per_call", [0, -1, 1.5, True])
def test_frames_per_call_must_be_a_positive_int(frames_per_call):
    with pytest.raises(ValueError, match="`frames_per_call` must be None or an int >= 1"):
        StreamingWanDecoder(make_vae("no_temporal"), frames_per_call=frames_per_call)


@pytest.mark.parametrize("vae_name", ["temporal_4x", "no_temporal"])
def test_chunk_pixel_frames_follow_temporal_upsampling(vae_name):
    vae = make_vae(vae_name)
    decoder = StreamingWanDecoder(vae)
    upsample = 2 ** sum(VAE_CONFIGS[vae_name]["temperal_downsample"])
    pixels = LATENT_SIZE * 2 ** (len(VAE_CONFIGS[vae_name]["dim_mult"]) - 1)

    first = decoder.decode(random_latents(seed=1, frames=3))
    second = decoder.decode(random_latents(seed=2, frames=2))

    assert first.shape == (1, 3, 1 + 2 * upsample, pixels, pixels)
    assert second.shape[2] == 2 * upsample == decoder.num_pixel_frames(2)
    assert decoder.latent_frames_decoded == 5


def test_reset_streams_the_next_video_as_if_fresh():
    vae = make_vae("temporal_4x")
    video_a, video_b = random_latents(seed=1), random_latents(seed=2)
    decoder = StreamingWanDecoder(vae)

    stream(decoder, video_a, chunk_frames=3)
    decoder.reset()
    second_video = stream(decoder, video_b, chunk_frames=3)

    torch.testing.assert_close(second_video, stream(StreamingWanDecoder(vae), video_b, 3), atol=0, rtol=0)
    torch.testing.assert_close(second_video, one_shot(vae, video_b), atol=1e-5, rtol=0)


def test_vae_decode_between_chunks_disturbs_neither():
    vae = make_vae("temporal_4x")
    video_a, video_b = random_latents(seed=1), random_latents(seed=2)
    expected_b = one_shot(vae, video_b)
    decoder = StreamingWanDecoder(vae)

    first_half = decoder.decode(video_a[:, :, :4])
    decoded_b = one_shot(vae, video_b)  # the VAE's own cache is used and cleared mid-stream
    second_half = decoder.decode(video_a[:, :, 4:])

    torch.testing.assert_close(decoded_b, expected_b, atol=0, rtol=0)
    streamed_a = torch.cat([first_half, second_half], dim=2)
    torch.testing.assert_close(streamed_a, one_shot(vae, video_a), atol=1e-5, rtol=0)


def test_latents_are_cast_to_the_vae_dtype():
    vae = make_vae("no_temporal").to(torch.float64)
    latents = random_latents(seed=1)

    streamed = stream(StreamingWanDecoder(vae), latents, chunk_frames=2)

    assert streamed.dtype == torch.float64
    torch.testing.assert_close(streamed, one_shot(vae, latents.double()), atol=1e-10, rtol=0)


def test_denormalize_matches_wan_pipeline():
    vae = make_vae("no_temporal")
    latents = random_latents(seed=1)
    # WanPipeline: latents / (1 / std) + mean
    mean = torch.tensor(vae.config.latents_mean).view(1, Z_DIM, 1, 1, 1)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, Z_DIM, 1, 1, 1)

    torch.testing.assert_close(denormalize_wan_latents(latents, vae), latents / inverse_std + mean)


def test_wrong_rank_is_refused():
    decoder = StreamingWanDecoder(make_vae("no_temporal"))
    with pytest.raises(ValueError, match="`latents` must be 5-D"):
        decoder.decode(torch.randn(Z_DIM, 2, LATENT_SIZE, LATENT_SIZE))


def test_wrong_channel_count_is_refused():
    decoder = StreamingWanDecoder(make_vae("no_temporal"))
    with pytest.raises(ValueError, match=f"`latents` must have {Z_DIM} channels"):
        decoder.decode(torch.randn(1, Z_DIM + 1, 2, LATENT_SIZE, LATENT_SIZE))


def test_size_change_within_a_video_is_refused():
    decoder = StreamingWanDecoder(make_vae("no_temporal"))
    decoder.decode(random_latents(seed=1, frames=1))
    with pytest.raises(ValueError, match="call reset"):
        decoder.decode(torch.randn(1, Z_DIM, 1, LATENT_SIZE * 2, LATENT_SIZE))

"""StreamingWanEncoder: encoding chunk by chunk equals one `AutoencoderKLWan.encode` of the whole clip."""

import pytest
import torch
from accelerate.hooks import ModelHook, add_hook_to_module
from diffusers import AutoencoderKLWan
from einops import rearrange
from safetensors.torch import load_file, save_file
from tiny_components import seeded_wan_vae

from rolldiff.defaults import default_model_path
from rolldiff.pipelines.codecs.streaming_decode import StreamingWanDecoder, denormalize_wan_latents
from rolldiff.pipelines.codecs.streaming_encode import StreamingWanEncoder, normalize_wan_latents
from rolldiff.toyworld.world import render_video

Z_DIM = 4
PIXEL_FRAMES = 17  # 1 + 4*4: a clip every VAE below (and diffusers' groups of 4) encodes without a remainder
SIZE = 16  # pixel height and width

# Tiny random VAEs: the real Wan 2.1 temporal layout (4x), 2x and 1x in time (tests/tiny_components.py's and the
# embedded default's), and the Wan 2.2 layout (patchified input, residual down blocks with their average shortcut).
VAE_CONFIGS = {
    "temporal_4x": dict(dim_mult=[1, 2, 2], temperal_downsample=[True, True]),
    "temporal_2x": dict(dim_mult=[1, 2, 2], temperal_downsample=[False, True]),
    "no_temporal": dict(dim_mult=[1, 2, 2], temperal_downsample=[False, False]),
    "patchified_residual": dict(
        dim_mult=[1, 2, 2],
        temperal_downsample=[True, True],
        patch_size=2,
        is_residual=True,
        in_channels=12,
        out_channels=12,
        decoder_base_dim=16,
    ),
}
# fp32 rounding: the per-chunk quant_conv rounds differently from the whole clip's (measured <= 5e-7).
# float32 reordering between the chunked and whole-clip convolutions: up to 2.8e-6 seen on some CPUs (the
# embedded VAE's latents, |x| up to ~3); a streaming bug shows as 1e-2 or more.
TOLERANCE = dict(atol=5e-6, rtol=0)


def make_vae(name: str = "temporal_4x") -> AutoencoderKLWan:
    return seeded_wan_vae(Z_DIM, **VAE_CONFIGS[name])


def random_video(seed: int, frames: int = PIXEL_FRAMES, batch: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(batch, 3, frames, SIZE, SIZE, generator=generator) * 2 - 1  # [-1, 1]


def one_shot(vae: AutoencoderKLWan, video: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return normalize_wan_latents(vae.encode(video).latent_dist.mode(), vae)


def chunk_sizes(encoder: StreamingWanEncoder, latent_chunks: tuple[int, int], total_pixel_frames: int) -> list[int]:
    """Pixel frames per chunk: a first chunk of `latent_chunks[0]` latent frames, then `latent_chunks[1]` each."""
    t = encoder.temporal_downsample
    sizes = [1 + t * (latent_chunks[0] - 1)]
    while sum(sizes) < total_pixel_frames:
        sizes.append(min(t * latent_chunks[1], total_pixel_frames - sum(sizes)))
    return sizes


def stream(encoder: StreamingWanEncoder, video: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    return torch.cat([encoder.encode(chunk) for chunk in video.split(sizes, dim=2)], dim=2)


@pytest.mark.parametrize("latent_chunks", [(1, 1), (2, 2), (3, 1), (1, 3)])
@pytest.mark.parametrize("vae_name", list(VAE_CONFIGS))
def test_streamed_chunks_equal_one_shot_encode(vae_name, latent_chunks):
    vae = make_vae(vae_name)
    video = random_video(seed=1)
    encoder = StreamingWanEncoder(vae)
    sizes = chunk_sizes(encoder, latent_chunks, PIXEL_FRAMES)
    assert len(sizes) >= 3

    streamed = stream(encoder, video, sizes)

    torch.testing.assert_close(streamed, one_shot(vae, video), **TOLERANCE)


@pytest.mark.parametrize("latent_chunks", [(1, 1), (2, 3)])
def test_embedded_default_vae_streams_like_one_shot_encode(latent_chunks):
    vae = AutoencoderKLWan.from_pretrained(default_model_path() / "vae").eval()  # the trained tiny VAE, 1x in time
    video = torch.rand(1, 3, 9, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    encoder = StreamingWanEncoder(vae)

    streamed = stream(encoder, video, chunk_sizes(encoder, latent_chunks, 9))

    torch.testing.assert_close(streamed, one_shot(vae, video), **TOLERANCE)


def test_embedded_default_latents_are_in_the_diffusion_models_space_and_decode_back():
    """On the toy world the trained VAE's normalised latents are ~N(0, 1) per channel (what the transformer was
    trained on; the unnormalised ones have std up to ~3), and decoding them gives the clip back."""
    vae = AutoencoderKLWan.from_pretrained(default_model_path() / "vae").eval()
    frames = torch.from_numpy(render_video("a red circle moving left", num_frames=9))  # (F, H, W, 3) uint8
    video = rearrange(frames, "f h w c -> 1 c f h w").float() / 127.5 - 1

    latents = StreamingWanEncoder(vae).encode(video)
    decoded = StreamingWanDecoder(vae).decode(denormalize_wan_latents(latents, vae))

    per_channel = latents.transpose(0, 1).flatten(1)  # (z_dim, values)
    assert per_channel.mean(dim=1).abs().max() < 0.5
    assert ((per_channel.std(dim=1) > 0.7) & (per_channel.std(dim=1) < 1.3)).all()
    assert (decoded - video).abs().mean() < 0.05


def test_batch_of_two_streams_like_each_video_alone():
    vae = make_vae()
    video = random_video(seed=1, batch=2)
    sizes = [5, 8, 4]

    together = stream(StreamingWanEncoder(vae), video, sizes)

    for i in range(2):
        alone = stream(StreamingWanEncoder(vae), video[i : i + 1], sizes)
        torch.testing.assert_close(together[i : i + 1], alone, **TOLERANCE)


def test_chunk_latent_frames_follow_the_frame_rule():
    encoder = StreamingWanEncoder(make_vae("temporal_4x"))
    video = random_video(seed=1, frames=21)

    assert (encoder.num_pixel_frames(3), encoder.num_latent_frames(9)) == (9, 3)
    first = encoder.encode(video[:, :, :9])
    assert (encoder.num_pixel_frames(3), encoder.num_latent_frames(12)) == (12, 3)
    second = encoder.encode(video[:, :, 9:])

    assert first.shape == (1, Z_DIM, 3, SIZE // 4, SIZE // 4)
    assert second.shape == (1, Z_DIM, 3, SIZE // 4, SIZE // 4)
    assert encoder.latent_frames_encoded == 6


@pytest.mark.parametrize(
    ("first_frames", "frames", "message"),
    [
        (None, 8, r"first chunk of a video takes 1 \+ 4\*k .* nearest valid counts: 5 or 9"),
        (None, 0, r"first chunk .* nearest valid counts: 1\."),
        (5, 6, r"after the first chunk, a chunk takes 4\*k .* nearest valid counts: 4 or 8"),
        (5, 1, r"4\*k pixel frames \(k >= 1\).* nearest valid counts: 4\."),
    ],
)
def test_frame_counts_off_the_rule_are_refused_with_the_rule_and_nearest_counts(first_frames, frames, message):
    encoder = StreamingWanEncoder(make_vae("temporal_4x"))
    if first_frames is not None:
        encoder.encode(random_video(seed=1, frames=first_frames))

    with pytest.raises(ValueError, match=message):
        encoder.encode(random_video(seed=2, frames=frames))
    with pytest.raises(ValueError, match=message):
        encoder.num_latent_frames(frames)


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        (torch.zeros(3, 5, SIZE, SIZE), "must be a 5-D tensor"),
        (torch.zeros(1, 4, 5, SIZE, SIZE), "must have 3 channels"),
        (torch.zeros(1, 3, 5, SIZE, SIZE, dtype=torch.uint8), "must be a float tensor"),
        (torch.zeros(1, 3, 5, SIZE, SIZE + 2), "multiples of the VAE's spatial downsampling 4"),
        (torch.zeros(1, 3, 4, SIZE, SIZE), "first chunk of a video takes"),
    ],
)
def test_bad_frames_are_refused_before_any_work(frames, message):
    encoder = StreamingWanEncoder(make_vae())

    with pytest.raises(ValueError, match=message):
        encoder.encode(frames)
    assert encoder.latent_frames_encoded == 0
    assert encoder.encode(random_video(seed=1, frames=1)).shape[2] == 1  # still at the start of a video


def test_a_chunk_of_another_size_is_refused_until_reset():
    encoder = StreamingWanEncoder(make_vae())
    encoder.encode(random_video(seed=1, frames=5))

    with pytest.raises(ValueError, match=r"must stay \(1, 16, 16\) within one video, got \(2, 16, 16\)"):
        encoder.encode(random_video(seed=2, frames=4, batch=2))
    encoder.reset()
    assert encoder.encode(random_video(seed=2, frames=5, batch=2)).shape == (2, Z_DIM, 2, 4, 4)


def test_saved_and_reloaded_encoder_continues_identically(tmp_path):
    vae = make_vae()
    video = random_video(seed=1)
    uninterrupted = stream(StreamingWanEncoder(vae), video, [5, 4, 4, 4])

    first = StreamingWanEncoder(vae)
    head = stream(first, video[:, :, :9], [5, 4])
    save_file(first.state_dict(), tmp_path / "encoder.safetensors")  # tensors only: safetensors takes it
    resumed = StreamingWanEncoder(vae)
    resumed.load_state_dict(load_file(tmp_path / "encoder.safetensors"))
    tail = stream(resumed, video[:, :, 9:], [4, 4])

    assert resumed.latent_frames_encoded == 5
    torch.testing.assert_close(torch.cat([head, tail], dim=2), uninterrupted, atol=0, rtol=0)


def test_a_saved_state_stays_valid_while_the_encoder_goes_on():
    vae = make_vae()
    video = random_video(seed=1)
    encoder = StreamingWanEncoder(vae)
    encoder.encode(video[:, :, :5])
    state = encoder.state_dict()
    expected = encoder.encode(video[:, :, 5:9])
    encoder.encode(video[:, :, 9:13])  # goes on past the saved point

    encoder.load_state_dict(state)

    torch.testing.assert_close(encoder.encode(video[:, :, 5:9]), expected, atol=0, rtol=0)


def test_state_of_a_fresh_encoder_round_trips_to_the_start_of_a_video():
    vae = make_vae()
    encoder = StreamingWanEncoder(vae)
    encoder.encode(random_video(seed=2, frames=5))

    encoder.load_state_dict(StreamingWanEncoder(vae).state_dict())

    assert encoder.latent_frames_encoded == 0
    torch.testing.assert_close(encoder.encode(random_video(seed=1)), one_shot(vae, random_video(seed=1)), **TOLERANCE)


def test_state_of_another_vae_layout_is_refused():
    state = StreamingWanEncoder(make_vae("temporal_4x")).state_dict()
    other = StreamingWanEncoder(AutoencoderKLWan(base_dim=8, z_dim=Z_DIM, num_res_blocks=2, dim_mult=[1, 2, 2]))

    with pytest.raises(ValueError, match=r"feat_cache_kinds of shape \(\d+,\), one per causal conv"):
        other.load_state_dict(state)
    broken = {**StreamingWanEncoder(make_vae("temporal_4x")).state_dict(), "feat_cache.0": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"unexpected \['feat_cache.0'\]"):
        StreamingWanEncoder(make_vae("temporal_4x")).load_state_dict(broken)


def test_interleaved_encoders_on_one_vae_each_give_their_solo_result():
    vae = make_vae()
    videos = [random_video(seed=1), random_video(seed=2)]
    sizes = [5, 4, 8]
    solo = [stream(StreamingWanEncoder(vae), video, sizes) for video in videos]

    encoders = [StreamingWanEncoder(vae), StreamingWanEncoder(vae)]
    outputs: list[list[torch.Tensor]] = [[], []]
    for chunks in zip(*(video.split(sizes, dim=2) for video in videos)):
        for encoder, chunk, out in zip(encoders, chunks, outputs):
            out.append(encoder.encode(chunk))
            one_shot(vae, random_video(seed=3, frames=5))  # the VAE's own encode in between, too

    for out, expected in zip(outputs, solo):
        torch.testing.assert_close(torch.cat(out, dim=2), expected, atol=0, rtol=0)


class FailOnCall:
    """Forward hook that raises on the n-th call of the module it is registered on."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def __call__(self, module, args, output):
        self.calls += 1
        if self.calls == self.n:
            raise RuntimeError("simulated failure")


def test_a_chunk_that_fails_part_way_leaves_the_encoder_as_it_was():
    vae = make_vae()
    video = random_video(seed=1)
    expected = stream(StreamingWanEncoder(vae), video, [5, 12])
    encoder = StreamingWanEncoder(vae)
    head = encoder.encode(video[:, :, :5])

    handle = vae.encoder.register_forward_hook(FailOnCall(2))  # the second of the chunk's three groups
    with pytest.raises(RuntimeError, match="simulated failure"):
        encoder.encode(video[:, :, 5:])
    handle.remove()
    tail = encoder.encode(video[:, :, 5:])  # the retry

    assert encoder.latent_frames_encoded == 5
    torch.testing.assert_close(torch.cat([head, tail], dim=2), expected, atol=0, rtol=0)


def test_posterior_sample_with_a_generator_is_diffusers_sample():
    vae = make_vae()
    frame = random_video(seed=1, frames=1)
    with torch.no_grad():
        posterior = vae.encode(frame).latent_dist
    expected = normalize_wan_latents(posterior.sample(torch.Generator().manual_seed(7)), vae)

    sampled = StreamingWanEncoder(vae).encode(frame, sample=True, generator=torch.Generator().manual_seed(7))

    torch.testing.assert_close(sampled, expected, **TOLERANCE)
    assert not torch.allclose(sampled, normalize_wan_latents(posterior.mode(), vae))


def test_generator_without_sample_is_refused():
    with pytest.raises(ValueError, match="only used with `sample=True`"):
        StreamingWanEncoder(make_vae()).encode(random_video(seed=1, frames=1), generator=torch.Generator())


class RecordingHook(ModelHook):
    def __init__(self) -> None:
        super().__init__()
        self.pre_forward_calls = 0

    def pre_forward(self, module, *args, **kwargs):
        self.pre_forward_calls += 1
        return args, kwargs


def test_offload_hook_is_called_before_each_chunk():
    vae = make_vae()
    hook = RecordingHook()
    add_hook_to_module(vae, hook)
    encoder = StreamingWanEncoder(vae)

    encoder.encode(random_video(seed=1, frames=5))
    encoder.encode(random_video(seed=2, frames=4))

    assert hook.pre_forward_calls == 2


def test_normalize_is_the_inverse_of_denormalize():
    vae = make_vae()
    latents = torch.randn(2, Z_DIM, 3, 4, 4, generator=torch.Generator().manual_seed(0))

    torch.testing.assert_close(normalize_wan_latents(denormalize_wan_latents(latents, vae), vae), latents)
    with pytest.raises(ValueError, match=r"must have shape \(batch, 4, latent_frames, height, width\)"):
        normalize_wan_latents(latents[:, :3], vae)


def test_rep_markers_round_trip_as_kind_two_and_unknown_kinds_are_refused():
    encoder = StreamingWanEncoder(make_vae())
    state = encoder.state_dict()
    state["feat_cache_kinds"][0] = 2  # diffusers' "Rep" marker

    encoder.load_state_dict(state)

    assert encoder.state_dict()["feat_cache_kinds"].tolist()[:2] == [2, 0]
    state["feat_cache_kinds"][0] = 5
    with pytest.raises(ValueError, match=r"kinds \[0, 5\] \(allowed 0, 1, 2\)"):
        encoder.load_state_dict(state)

"""TinyVideoAutoencoder (TAEHV): upstream's keys and outputs, chunked == whole, checkpoint loading, bad inputs.

Pinned to upstream (madebyollin/taehv @ 1f14a56) by two files that tools/record_taehv_golden.py wrote from
upstream's own module tree and forward pass: the taew2_1 key/shape list and a golden decode/encode on seeded random
weights (the same `seeded_state_dict` builds the weights on both sides). Upstream's pixels are [0, 1], ours
[-1, 1]; differences are compared in upstream's units, where its own fp32 floor (2e-6) is stated.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rolldiff import TinyVideoAutoencoder
from rolldiff.models.tiny_autoencoder import infer_tiny_autoencoder_config
from rolldiff.models.weights import WeightsMismatchError
from rolldiff.pipelines.codecs.streaming_tiny_decode import StreamingTinyDecoder, StreamingTinyEncoder

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from record_taehv_golden import load_key_shapes, seeded_frames, seeded_latents, seeded_state_dict  # noqa: E402

DATA = Path(__file__).parent / "data" / "taehv"
FLOOR = 5e-6  # chunked vs whole, fp32, in [0, 1] units: batching frames differently changes conv rounding
# (at most 1.9e-6 on one Intel machine, 2.8e-6 on an AMD EPYC: the CPU picks the convolution kernels)
GOLDEN_TOLERANCE = 1e-4

# Narrow variants (the published widths are 64 / 256-128-64-64) for the flags' code paths, fast on CPU.
VARIANTS = {
    "taew2_2-like": dict(latent_channels=48, patch_size=2, encoder_channels=8, decoder_channels=(16, 8, 8, 8)),
    "all-time": dict(
        encoder_time_downscale=(True, True, True),
        decoder_time_upscale=(True, True, True),
        encoder_channels=8,
        decoder_channels=(16, 8, 8, 8),
    ),
    "preview": dict(
        decoder_time_upscale=(False, False, False),
        decoder_space_upscale=(True, False, True),
        encoder_channels=8,
        decoder_channels=(16, 8, 8, 8),
    ),
}


def unit(pixels: torch.Tensor) -> torch.Tensor:
    """Our [-1, 1] pixels in upstream's [0, 1] units."""
    return (pixels + 1) / 2


def settings(model: TinyVideoAutoencoder) -> dict:
    """The model's init arguments, tuples as lists (as config.json stores them), without diffusers' `_` keys."""
    return {
        key: list(value) if isinstance(value, tuple) else value for key, value in model.config.items() if key[0] != "_"
    }


def seeded_model(**config) -> TinyVideoAutoencoder:
    model = TinyVideoAutoencoder(**config).eval()
    key_shapes = [(key, tuple(value.shape)) for key, value in model.state_dict().items()]
    model.load_state_dict(seeded_state_dict(key_shapes, seed=0))
    return model


@pytest.fixture(scope="module")
def taew2_1() -> TinyVideoAutoencoder:
    """The taew2_1 architecture with the golden's weights."""
    model = TinyVideoAutoencoder().eval()
    model.load_state_dict(seeded_state_dict(load_key_shapes(), seed=0), strict=True)
    return model


@pytest.fixture(scope="module")
def golden() -> dict[str, torch.Tensor]:
    return load_file(DATA / "golden.safetensors")


def stream_decode(decoder: StreamingTinyDecoder, latents: torch.Tensor, chunk_frames: int) -> torch.Tensor:
    return torch.cat([decoder.decode(chunk) for chunk in latents.split(chunk_frames, dim=2)], dim=2)


def whole_decode(model: TinyVideoAutoencoder, latents: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.decode(latents).sample


# ---------------------------------------------------------------------------------- upstream's keys and shapes
def test_default_config_has_upstream_taew2_1_keys_and_shapes():
    upstream = [[key, list(shape)] for key, shape in json.loads((DATA / "taew2_1_keys.json").read_text())]
    ours = [[key, list(value.shape)] for key, value in TinyVideoAutoencoder().state_dict().items()]

    assert ours == upstream
    assert len(ours) == 128
    parameters = sum(torch.Size(shape).numel() for _, shape in ours)
    assert round(parameters / 1e6, 1) == 11.3
    assert parameters == sum(p.numel() for p in TinyVideoAutoencoder().parameters())


def test_a_state_dict_with_exactly_upstream_keys_loads_strictly():
    model = TinyVideoAutoencoder()
    state_dict = seeded_state_dict(load_key_shapes(), seed=3)

    result = model.load_state_dict(state_dict, strict=True)

    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(model.decoder[22].bias, state_dict["decoder.22.bias"])


# -------------------------------------------------------------------------------------------------- golden
def test_decode_equals_upstream_golden(taew2_1, golden):
    latents = seeded_latents(tuple(golden["latent_shape"].tolist()), int(golden["latent_seed"]))  # (N, T, C, h, w)

    decoded = whole_decode(taew2_1, latents.transpose(1, 2))

    expected = golden["decoded"].transpose(1, 2)  # (N, C, T, H, W)
    assert decoded.shape == expected.shape == (2, 3, 13, 24, 32)
    torch.testing.assert_close(unit(decoded), expected, atol=GOLDEN_TOLERANCE, rtol=0)


def test_streamed_decode_equals_upstream_golden(taew2_1, golden):
    latents = seeded_latents(tuple(golden["latent_shape"].tolist()), int(golden["latent_seed"])).transpose(1, 2)

    streamed = stream_decode(StreamingTinyDecoder(taew2_1), latents, chunk_frames=1)

    torch.testing.assert_close(unit(streamed), golden["decoded"].transpose(1, 2), atol=GOLDEN_TOLERANCE, rtol=0)


def test_encode_equals_upstream_golden(taew2_1, golden):
    frames = seeded_frames(tuple(golden["frame_shape"].tolist()), int(golden["frame_seed"]))  # [0, 1], NTCHW

    with torch.no_grad():
        latents = taew2_1.encode(frames.transpose(1, 2) * 2 - 1).latents

    expected = golden["encoded"].transpose(1, 2)
    assert latents.shape == expected.shape == (2, 16, 4, 3, 4)  # 13 frames padded to 16
    torch.testing.assert_close(latents, expected, atol=GOLDEN_TOLERANCE, rtol=0)


# ------------------------------------------------------------------------------------- chunked == whole
@pytest.mark.parametrize("chunk_frames", [1, 2, 3])
def test_chunked_decode_equals_whole_clip_decode(taew2_1, chunk_frames):
    latents = seeded_latents((1, 16, 7, 3, 4), seed=5)  # 7, 4 and 3 chunks

    streamed = stream_decode(StreamingTinyDecoder(taew2_1), latents, chunk_frames)

    assert streamed.shape == (1, 3, 25, 24, 32)
    torch.testing.assert_close(unit(streamed), unit(whole_decode(taew2_1, latents)), atol=FLOOR, rtol=0)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunked_decode_equals_whole_clip_decode_for_every_variant(variant):
    model = seeded_model(**VARIANTS[variant])
    latents = seeded_latents((2, model.config.latent_channels, 5, 2, 3), seed=6)

    whole = whole_decode(model, latents)
    for chunk_frames in (1, 2):
        streamed = stream_decode(StreamingTinyDecoder(model), latents, chunk_frames)
        torch.testing.assert_close(unit(streamed), unit(whole), atol=FLOOR, rtol=0)


@pytest.mark.parametrize("chunk_frames", [1, 2, 3, 5])
def test_chunked_encode_then_flush_equals_whole_clip_encode(taew2_1, chunk_frames):
    frames = seeded_frames((1, 3, 13, 16, 24), seed=7) * 2 - 1
    with torch.no_grad():
        whole = taew2_1.encode(frames).latents
    encoder = StreamingTinyEncoder(taew2_1)

    chunks = [encoder.encode(chunk) for chunk in frames.split(chunk_frames, dim=2)] + [encoder.flush()]

    torch.testing.assert_close(torch.cat(chunks, dim=2), whole, atol=FLOOR, rtol=0)


@pytest.mark.parametrize("variant", ["taew2_2-like", "all-time"])
def test_chunked_encode_equals_whole_clip_encode_for_every_variant(variant):
    model = seeded_model(**VARIANTS[variant])
    frames = seeded_frames((2, 3, 11, 16, 16), seed=8) * 2 - 1
    with torch.no_grad():
        whole = model.encode(frames).latents
    encoder = StreamingTinyEncoder(model)

    chunks = [encoder.encode(chunk) for chunk in frames.split(3, dim=2)] + [encoder.flush()]

    torch.testing.assert_close(torch.cat(chunks, dim=2), whole, atol=FLOOR, rtol=0)


# ------------------------------------------------------------------------------------------ frame counts
def test_frame_counts_match_the_wan_vae(taew2_1):
    decoder = StreamingTinyDecoder(taew2_1)

    assert decoder.num_pixel_frames(3) == 1 + 2 * 4
    first = decoder.decode(seeded_latents((1, 16, 3, 2, 2), seed=1))
    assert decoder.num_pixel_frames(3) == 12 == decoder.num_pixel_frames(2) + 4
    second = decoder.decode(seeded_latents((1, 16, 3, 2, 2), seed=2))

    assert first.shape[2] == 9 and second.shape[2] == 12
    assert decoder.latent_frames_decoded == 6


def test_encode_pads_by_repeating_the_last_frame(taew2_1):
    frames = seeded_frames((1, 3, 9, 16, 16), seed=9) * 2 - 1  # 1 + 4k frames: k + 1 latents, as the Wan VAE
    padded = torch.cat([frames, frames[:, :, -1:].expand(-1, -1, 3, -1, -1)], dim=2)

    with torch.no_grad():
        latents, latents_of_padded = taew2_1.encode(frames).latents, taew2_1.encode(padded).latents

    assert latents.shape[2] == 3
    torch.testing.assert_close(latents, latents_of_padded, atol=0, rtol=0)


def test_streaming_encoder_counts_the_latents_each_chunk_completes(taew2_1):
    encoder = StreamingTinyEncoder(taew2_1)
    frames = seeded_frames((1, 3, 6, 16, 16), seed=10) * 2 - 1

    assert encoder.num_latent_frames(3) == 0
    assert encoder.encode(frames[:, :, :3]).shape[2] == 0
    assert encoder.num_latent_frames(3) == 1
    assert encoder.encode(frames[:, :, 3:]).shape == (1, 16, 1, 2, 2)
    assert encoder.flush().shape[2] == 1  # 6 frames -> padded to 8
    assert encoder.frames_encoded == 8
    assert encoder.flush().shape[2] == 0  # nothing left to pad


def test_disabled_time_upscale_gives_one_frame_per_latent_frame():
    model = seeded_model(**VARIANTS["preview"])
    decoder = StreamingTinyDecoder(model)

    pixels = decoder.decode(seeded_latents((1, 16, 3, 2, 2), seed=1))

    assert pixels.shape == (1, 3, 3, 8, 8) and decoder.num_pixel_frames(2) == 2  # space upscale 2 * 1 * 2


# ----------------------------------------------------------------------------------- stream state, reset
def test_decoder_resumes_from_its_state_dict(taew2_1):
    latents = seeded_latents((1, 16, 5, 2, 3), seed=11)
    continuous = stream_decode(StreamingTinyDecoder(taew2_1), latents, chunk_frames=1)
    first = StreamingTinyDecoder(taew2_1)
    head = stream_decode(first, latents[:, :, :2], chunk_frames=1)

    state = first.state_dict()
    resumed = StreamingTinyDecoder(taew2_1)
    resumed.load_state_dict({key: value.clone() for key, value in state.items()})
    tail = stream_decode(resumed, latents[:, :, 2:], chunk_frames=1)

    assert all(isinstance(value, torch.Tensor) for value in state.values())
    assert state["latent_frames_decoded"].dtype == torch.int64 and state["latent_frames_decoded"].ndim == 0
    assert state["video_shape"].tolist() == [1, 2, 3]
    assert len([key for key in state if key.startswith("memory.")]) == 9  # one carry per decoder memory block
    torch.testing.assert_close(torch.cat([head, tail], dim=2), continuous, atol=0, rtol=0)


def test_encoder_resumes_from_its_state_dict(taew2_1):
    frames = seeded_frames((1, 3, 7, 16, 16), seed=12) * 2 - 1
    encoder = StreamingTinyEncoder(taew2_1)
    continuous = torch.cat([encoder.encode(frames[:, :, :3]), encoder.encode(frames[:, :, 3:]), encoder.flush()], 2)
    first = StreamingTinyEncoder(taew2_1)
    head = first.encode(frames[:, :, :3])

    resumed = StreamingTinyEncoder(taew2_1)
    resumed.load_state_dict(first.state_dict())
    tail = torch.cat([resumed.encode(frames[:, :, 3:]), resumed.flush()], dim=2)

    assert first.state_dict()["frames_encoded"].item() == 3
    torch.testing.assert_close(torch.cat([head, tail], dim=2), continuous, atol=0, rtol=0)


def test_reset_streams_the_next_video_as_if_fresh(taew2_1):
    video_a, video_b = seeded_latents((1, 16, 3, 2, 2), seed=1), seeded_latents((1, 16, 3, 2, 2), seed=2)
    decoder = StreamingTinyDecoder(taew2_1)

    stream_decode(decoder, video_a, chunk_frames=2)
    decoder.reset()
    second = stream_decode(decoder, video_b, chunk_frames=2)

    assert decoder.state_dict()["latent_frames_decoded"].item() == 3
    torch.testing.assert_close(second, stream_decode(StreamingTinyDecoder(taew2_1), video_b, 2), atol=0, rtol=0)


def test_a_chunk_that_raises_leaves_the_stream_as_it_was(taew2_1):
    latents = seeded_latents((1, 16, 4, 2, 2), seed=13)
    decoder = StreamingTinyDecoder(taew2_1)
    head = decoder.decode(latents[:, :, :2])

    def fail(module, inputs, output):
        raise RuntimeError("out of memory (simulated)")

    hook = taew2_1.decoder[13].register_forward_hook(fail)  # after the first stage's carries are written
    with pytest.raises(RuntimeError, match="simulated"):
        decoder.decode(latents[:, :, 2:])
    hook.remove()
    tail = decoder.decode(latents[:, :, 2:])

    assert decoder.latent_frames_decoded == 4
    expected = stream_decode(StreamingTinyDecoder(taew2_1), latents, chunk_frames=2)
    torch.testing.assert_close(torch.cat([head, tail], dim=2), expected, atol=0, rtol=0)


def test_one_model_serves_two_interleaved_streams(taew2_1):
    video_a, video_b = seeded_latents((1, 16, 4, 2, 2), seed=1), seeded_latents((1, 16, 4, 2, 2), seed=2)
    decoder_a, decoder_b = StreamingTinyDecoder(taew2_1), StreamingTinyDecoder(taew2_1)

    chunks_a, chunks_b = [], []
    for chunk_a, chunk_b in zip(video_a.split(2, dim=2), video_b.split(2, dim=2)):
        chunks_a.append(decoder_a.decode(chunk_a))
        chunks_b.append(decoder_b.decode(chunk_b))

    torch.testing.assert_close(torch.cat(chunks_a, 2), stream_decode(StreamingTinyDecoder(taew2_1), video_a, 2))
    torch.testing.assert_close(torch.cat(chunks_b, 2), stream_decode(StreamingTinyDecoder(taew2_1), video_b, 2))


def test_latents_are_cast_to_the_model_dtype():
    model = seeded_model(**VARIANTS["all-time"]).to(torch.float64)
    latents = seeded_latents((1, 16, 3, 2, 2), seed=1)

    streamed = stream_decode(StreamingTinyDecoder(model), latents, chunk_frames=1)

    assert streamed.dtype == torch.float64
    torch.testing.assert_close(streamed, whole_decode(model, latents.double()), atol=1e-12, rtol=0)


# --------------------------------------------------------------------------------------- checkpoint files
@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_from_single_file_round_trips_a_taew2_1_checkpoint(tmp_path, suffix):
    state_dict = seeded_state_dict(load_key_shapes(), seed=4)
    path = tmp_path / f"taew2_1{suffix}"
    if suffix == ".pth":
        torch.save({key: value.half() for key, value in state_dict.items()}, path)  # published files are fp16
    else:
        save_file({key: value.half() for key, value in state_dict.items()}, str(path))

    model = TinyVideoAutoencoder.from_single_file(path)

    assert settings(model) == settings(TinyVideoAutoencoder())
    assert model.dtype == torch.float32
    for key, value in model.state_dict().items():
        assert torch.equal(value, state_dict[key].half().float()), key


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_from_single_file_infers_the_variant(tmp_path, variant):
    model = seeded_model(**VARIANTS[variant])
    save_file(model.state_dict(), str(tmp_path / "tae.safetensors"))

    loaded = TinyVideoAutoencoder.from_single_file(
        tmp_path / "tae.safetensors", decoder_space_upscale=model.config.decoder_space_upscale
    )

    assert settings(loaded) == settings(model)
    assert infer_tiny_autoencoder_config(model.state_dict())["patch_size"] == model.config.patch_size


def test_turning_time_upscale_off_keeps_the_last_frames_weights(tmp_path):
    model = seeded_model(**VARIANTS["all-time"])
    save_file(model.state_dict(), str(tmp_path / "tae.safetensors"))

    preview = TinyVideoAutoencoder.from_single_file(
        tmp_path / "tae.safetensors", decoder_time_upscale=(False, True, False), dtype=torch.float64
    )

    assert preview.dtype == torch.float64 and preview.temporal_upscale == 2
    grown = model.decoder[7].conv.weight  # (2 * 16, 16, 1, 1): two frames' channel groups
    assert torch.equal(preview.decoder[7].conv.weight, grown[16:].double())
    assert torch.equal(preview.decoder[13].conv.weight, model.decoder[13].conv.weight.double())


def test_save_pretrained_round_trips_config_and_weights(tmp_path):
    model = seeded_model(**VARIANTS["taew2_2-like"])
    model.save_pretrained(tmp_path / "tae")

    loaded = TinyVideoAutoencoder.from_pretrained(tmp_path / "tae")

    assert settings(loaded) == settings(model)
    latents = seeded_latents((1, 48, 2, 2, 2), seed=1)
    torch.testing.assert_close(whole_decode(loaded, latents), whole_decode(model, latents), atol=0, rtol=0)


# -------------------------------------------------------------------------------------------- bad inputs
def test_from_single_file_names_missing_and_unexpected_keys(tmp_path):
    state_dict = seeded_state_dict(load_key_shapes(), seed=0)
    del state_dict["encoder.4.conv.2.bias"]
    state_dict["decoder.23.weight"] = torch.zeros(1)
    save_file(state_dict, str(tmp_path / "broken.safetensors"))

    with pytest.raises(
        WeightsMismatchError, match=r"missing \(1\).*encoder\.4\.conv\.2\.bias.*unexpected.*decoder\.23"
    ):
        TinyVideoAutoencoder.from_single_file(tmp_path / "broken.safetensors")


def test_from_single_file_refuses_a_state_dict_that_is_not_taehv(tmp_path):
    save_file({"decoder.conv_in.weight": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match=r"Not a TAEHV state dict: it has no `decoder\.22\.bias`"):
        TinyVideoAutoencoder.from_single_file(tmp_path / "other.safetensors")


def test_from_single_file_refuses_pickled_objects(tmp_path):
    torch.save({"decoder.22.bias": torch.zeros(3), "config": Path("x")}, tmp_path / "unsafe.pth")
    with pytest.raises(ValueError, match="only weights_only loading is allowed"):
        TinyVideoAutoencoder.from_single_file(tmp_path / "unsafe.pth")


def test_from_single_file_refuses_an_unknown_suffix(tmp_path):
    with pytest.raises(ValueError, match=r"Unsupported checkpoint suffix '\.onnx'"):
        TinyVideoAutoencoder.from_single_file(tmp_path / "taew2_1.onnx")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (dict(decoder_time_upscale=(True, True)), r"`decoder_time_upscale` must be 3 booleans.*\(False, a, b\)"),
        (dict(encoder_time_downscale=(1, 1, 0)), "`encoder_time_downscale` must hold booleans only"),
        (dict(latent_channels=0), "`latent_channels` must be a positive int, got 0"),
        (dict(decoder_channels=(256, 128, 64)), "`decoder_channels` must be 4 positive ints"),
    ],
)
def test_bad_config_is_refused(config, message):
    with pytest.raises(ValueError, match=message):
        TinyVideoAutoencoder(**config)


def test_wrong_latent_channels_are_refused(taew2_1):
    with pytest.raises(ValueError, match=r"`latents` must have 16 channels \(config.latent_channels\), got 48"):
        StreamingTinyDecoder(taew2_1).decode(torch.zeros(1, 48, 1, 2, 2))


def test_wrong_rank_is_refused(taew2_1):
    with pytest.raises(ValueError, match="`latents` must be 5-D"):
        taew2_1.decode(torch.zeros(16, 1, 2, 2))


def test_size_change_within_a_video_is_refused(taew2_1):
    decoder = StreamingTinyDecoder(taew2_1)
    decoder.decode(torch.zeros(1, 16, 1, 2, 2))
    with pytest.raises(ValueError, match="call reset"):
        decoder.decode(torch.zeros(1, 16, 1, 4, 2))
    assert decoder.latent_frames_decoded == 1


def test_frames_of_a_size_the_encoder_cannot_halve_three_times_are_refused(taew2_1):
    with pytest.raises(ValueError, match=r"multiples of 8, got 20x16; crop or pad to 16x16 or 24x16"):
        taew2_1.encode(torch.zeros(1, 3, 4, 20, 16))


def test_flush_before_any_frame_is_refused(taew2_1):
    with pytest.raises(ValueError, match=r"flush\(\) needs at least one encode\(\)"):
        StreamingTinyEncoder(taew2_1).flush()


def test_a_foreign_state_is_refused(taew2_1):
    with pytest.raises(ValueError, match=r"unexpected keys \['feat_map'\]"):
        StreamingTinyDecoder(taew2_1).load_state_dict({"feat_map": torch.zeros(1)})

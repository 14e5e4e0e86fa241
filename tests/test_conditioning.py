"""Image-to-video and streamed video-to-video through the shared chunk loop, for every video family."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from family_cases import FAMILIES

from rolldiff.defaults import load_pipeline
from rolldiff.pipelines.io.resume import RunState, load_state, save_state, write_video
from rolldiff.pipelines.request import conditioning as conditioning_module
from rolldiff.recipes import get_recipe
from rolldiff.toyworld import render_video

PROMPT, OTHER = "a red circle moving left", "a blue square moving up"
CHUNKS = 4


@pytest.fixture(scope="module", params=FAMILIES, ids=lambda case: case.name)
def pipe(request):
    return request.param.make_pipeline()


def _seed(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _frames(pipe, chunks: int = CHUNKS) -> int:
    return pipe.latent_to_frames(chunks * pipe.config.chunk_frames)


def _input_video(pipe, frames: int, seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(frames, 16, 16, 3), dtype=np.uint8)


def _record_inputs(pipe, monkeypatch) -> list[torch.Tensor]:
    seen, original = [], pipe.transformer_step

    def recording(latents, timestep, embeds, cache, request):
        seen.append((latents.clone(), float(timestep[0])))
        return original(latents, timestep, embeds, cache, request)

    monkeypatch.setattr(pipe, "transformer_step", recording)
    return seen


# ----------------------------------------------------------------------------------------- image-to-video
@torch.no_grad()
def test_the_start_image_is_the_clean_first_chunk(pipe, monkeypatch):
    image = _input_video(pipe, 1)[0]
    seen = _record_inputs(pipe, monkeypatch)
    latents = list(pipe.stream(PROMPT, _frames(pipe), image=image, generator=_seed(), output_type="latent"))
    encoder = pipe.make_encoder()
    pixels = pipe.latent_to_frames(pipe.config.chunk_frames)
    image_pixels = torch.from_numpy(image).permute(2, 0, 1)[None, :, None].float() / 127.5 - 1.0
    expected = encoder.encode(image_pixels.expand(-1, -1, pixels, -1, -1))
    torch.testing.assert_close(latents[0], expected.to(latents[0].dtype), atol=1e-6, rtol=0)
    assert seen[0][1] == 0.0  # chunk 0 is only written (its context pass at t = 0), never denoised
    assert len(seen) == 1 + (CHUNKS - 1) * (len(pipe.config.denoising_steps) + 1)


@torch.no_grad()
def test_a_picture_files_path_is_the_picture(pipe, tmp_path):
    """`image="start.png"` (str or Path) is the video of the picture in that file, as `video="input.mp4"` is."""
    import PIL.Image

    image = _input_video(pipe, 1)[0]
    PIL.Image.fromarray(image).save(tmp_path / "start.png")  # PNG: lossless
    made = pipe(PROMPT, num_frames=_frames(pipe), image=image, generator=_seed()).frames
    for path in (str(tmp_path / "start.png"), tmp_path / "start.png"):
        np.testing.assert_array_equal(
            pipe(PROMPT, num_frames=_frames(pipe), image=path, generator=_seed()).frames, made
        )


@torch.no_grad()
def test_a_list_of_picture_files_is_the_video_they_hold(pipe, tmp_path):
    """`video=sorted(folder.glob("*.png"))`: each frame read from its file, the video of the frames themselves."""
    import PIL.Image

    frames = _input_video(pipe, _frames(pipe))
    for index, frame in enumerate(frames):
        PIL.Image.fromarray(frame).save(tmp_path / f"{index:03d}.png")
    made = pipe(PROMPT, num_frames=_frames(pipe), video=frames, generator=_seed()).frames
    from_files = pipe(PROMPT, num_frames=_frames(pipe), video=sorted(tmp_path.glob("*.png")), generator=_seed())
    np.testing.assert_array_equal(from_files.frames, made)


@torch.no_grad()
def test_image_to_video_continues_from_the_image_and_is_seeded(pipe):
    image = _input_video(pipe, 1)[0]
    first = pipe(PROMPT, num_frames=_frames(pipe), image=image, generator=_seed()).frames
    again = pipe(PROMPT, num_frames=_frames(pipe), image=image, generator=_seed()).frames
    other_image = pipe(PROMPT, num_frames=_frames(pipe), image=255 - image, generator=_seed()).frames
    np.testing.assert_array_equal(first, again)
    later = slice(_frames(pipe, 1), None)
    assert np.abs(first[:, later] - other_image[:, later]).max() > 1e-3  # the image conditions what follows


@torch.no_grad()
def test_the_embedded_default_starts_on_the_image():
    """With the trained VAE the round trip is close: frame 0 of the output is the start image."""
    pipe = load_pipeline("tiny-bouncing-shapes")
    pipe.set_progress_bar_config(disable=True)
    image = render_video("a green square moving right", num_frames=1, seed=5)[0]  # (32, 32, 3) uint8
    video = pipe(OTHER, num_frames=_frames(pipe, 2), image=image, generator=_seed()).frames[0]
    error = np.abs(video[0] - image / 255.0).mean()
    assert error < 0.05, error


# ----------------------------------------------------------------------------------------- video-to-video
@torch.no_grad()
def test_strength_one_is_text_to_video_with_the_same_noise(pipe):
    text_to_video = pipe(PROMPT, num_frames=_frames(pipe), generator=_seed()).frames
    video = _input_video(pipe, _frames(pipe))
    full = pipe(PROMPT, num_frames=_frames(pipe), video=video, strength=1.0, generator=_seed()).frames
    np.testing.assert_array_equal(full, text_to_video)


@torch.no_grad()
def test_each_input_chunk_is_noised_to_strength_and_denoised_from_there(pipe, monkeypatch):
    video = _input_video(pipe, _frames(pipe))
    seen = _record_inputs(pipe, monkeypatch)
    generator = _seed()
    list(pipe.stream(PROMPT, _frames(pipe), video=video, strength=0.5, generator=generator, output_type="latent"))
    steps = len(pipe.config.denoising_steps)
    kept = steps // 2  # int(4 * 0.5) steps run, then the context pass
    assert len(seen) == CHUNKS * (kept + 1)
    encoder, pixels = pipe.make_encoder(), pipe.latent_to_frames(pipe.config.chunk_frames)
    frames = torch.from_numpy(video[:pixels]).permute(3, 0, 1, 2)[None].float() / 127.5 - 1.0
    noise = torch.randn(seen[0][0].shape, generator=_seed())  # chunk 0's noise: the first draw, as text-to-video
    scheduler = pipe.scheduler.__class__.from_config(pipe.scheduler.config)
    scheduler.set_timesteps(sigmas=[s / 1000.0 for s in pipe.config.denoising_steps[steps - kept :]])
    sigma = scheduler.sigmas[0]
    expected = sigma * noise + (1 - sigma) * encoder.encode(frames).float()
    torch.testing.assert_close(seen[0][0].float(), expected, atol=1e-5, rtol=0)
    assert seen[0][1] == pytest.approx(float(scheduler.timesteps[0]))


@torch.no_grad()
def test_the_output_ends_with_the_input(pipe):
    short = _input_video(pipe, _frames(pipe, 2) + 1)  # two whole chunks and a frame: the frame is dropped
    chunks = list(pipe.stream(PROMPT, _frames(pipe), video=short, generator=_seed()))
    assert len(chunks) == 2
    endless = itertools.repeat(np.zeros((16, 16, 3), np.uint8))  # a webcam-like iterator that never ends
    assert len(list(pipe.stream(PROMPT, _frames(pipe), video=endless, generator=_seed()))) == CHUNKS


@torch.no_grad()
def test_video_to_video_with_a_prompt_switch_resumes_exactly(pipe, tmp_path):
    arguments = dict(
        num_frames=_frames(pipe),
        prompt_schedule=[(0, PROMPT), (_frames(pipe, 2), OTHER)],
        video=_input_video(pipe, _frames(pipe)),
        strength=0.75,
    )
    whole = list(pipe.stream(generator=_seed(), **arguments))
    stream = pipe.stream(generator=_seed(), **arguments)
    first = [next(stream)]
    save_state(tmp_path / "s.safetensors", RunState({}, 0, stream.state_dict()))
    resumed = pipe.stream(generator=_seed(9), **arguments)
    resumed.load_state_dict(load_state(tmp_path / "s.safetensors").stream)
    for made, expected in zip([*first, *resumed], whole, strict=True):
        np.testing.assert_array_equal(made, expected)


# ----------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"image": np.zeros((16, 16, 3), np.uint8), "video": np.zeros((9, 16, 16, 3), np.uint8)}, "either `image`"),
        ({"video": np.zeros((9, 16, 16, 3), np.uint8), "strength": 0.0}, "`strength`"),
        ({"video": np.zeros((9, 16, 16, 3), np.uint8), "strength": float("nan")}, "`strength`"),
        ({"video": np.zeros((9, 16, 16, 3), np.uint8), "strength": 1.5}, "`strength`"),
        ({"strength": 0.5}, "`strength` applies to `video=`"),
        ({"video": np.zeros((1, 16, 16, 3), np.uint8)}, "one chunk needs"),
        ({"video": "/no/such/video.mp4"}, "video.mp4"),
        ({"image": [np.zeros((16, 16, 3), np.uint8)] * 3}, "image"),
        ({"image": np.zeros((16, 16, 5), np.uint8)}, "image"),
        ({"image": "/no/such/start.png"}, r"`image` '/no/such/start.png' is not a file"),
        ({"image": __file__}, r"`image` '.*test_conditioning.py' cannot be read as a picture"),
        ({"image": 3}, r"`image` must be a PIL image, a picture file's path, a numpy array or a torch tensor"),
    ],
    ids=[
        "both",
        "strength-0",
        "strength-nan",
        "strength-1.5",
        "strength-alone",
        "too-short",
        "missing",
        "batch",
        "channels",
        "image-missing",
        "image-not-a-picture",
        "image-kind",
    ],
)
def test_bad_conditioning_is_refused_before_any_work(pipe, kwargs, message, monkeypatch):
    monkeypatch.setattr(pipe, "transformer_step", lambda *a, **k: pytest.fail("work was done"))
    with pytest.raises((ValueError, TypeError, FileNotFoundError), match=message):
        pipe.stream(PROMPT, _frames(pipe), generator=_seed(), **kwargs)


def test_an_input_video_is_opened_only_after_every_other_check(pipe, monkeypatch):
    """A call refused for another argument opens no input reader (for a file: no ffmpeg left running)."""
    opened = []
    original = conditioning_module.VideoInput
    monkeypatch.setattr(conditioning_module, "VideoInput", lambda *a, **k: opened.append(original(*a, **k)))
    with pytest.raises(ValueError, match="`context_noise`"):
        pipe.stream(PROMPT, _frames(pipe), video=_input_video(pipe, _frames(pipe)), context_noise=-1)
    assert opened == []


def test_write_video_closes_a_stream_it_refuses(pipe, tmp_path):
    """A refused `write_video` argument still closes the stream's input (an iterator's `finally` runs)."""
    released = []

    def frames():
        try:
            yield from _input_video(pipe, _frames(pipe))
        finally:
            released.append(True)

    source = frames()
    next(source)  # started: closing it runs its `finally`
    stream = pipe.stream(PROMPT, _frames(pipe), video=source, generator=_seed())
    with pytest.raises(ValueError, match="quality"):
        write_video(stream, tmp_path / "video.mp4", quality=99)
    assert released == [True]


def test_a_frame_that_changes_size_mid_stream_stops_with_a_clear_error(pipe):
    frames = [np.zeros((16, 16, 3), np.uint8)] * _frames(pipe, 1) + [np.zeros((8, 8, 3), np.uint8)] * 10
    stream = pipe.stream(PROMPT, _frames(pipe), video=iter(frames), generator=_seed())
    next(stream)
    with pytest.raises(ValueError, match="frame .* same size"):
        next(stream)


@torch.no_grad()
def test_image_mode_frame_commits_the_images_single_latent_frame_first(pipe, monkeypatch):
    """Self-Forcing / CausVid's convention: the start image is one latent frame of clean context, then whole chunks."""
    image = _input_video(pipe, 1)[0]
    seen = _record_inputs(pipe, monkeypatch)
    num_frames = pipe.latent_to_frames(1 + 2 * pipe.config.chunk_frames)
    stream = pipe.stream(PROMPT, num_frames, image=image, image_mode="frame", generator=_seed(), output_type="latent")
    chunks = list(stream)
    assert [chunk.shape[2] for chunk in chunks] == [1, pipe.config.chunk_frames, pipe.config.chunk_frames]
    pixels = torch.from_numpy(image).permute(2, 0, 1)[None, :, None].float() / 127.5 - 1.0
    torch.testing.assert_close(chunks[0], pipe.make_encoder().encode(pixels).to(chunks[0].dtype), atol=1e-6, rtol=0)
    assert seen[0][1] == 0.0 and seen[0][0].shape[2] == 1  # only written, at t = 0
    frames = np.concatenate(
        list(pipe.stream(PROMPT, num_frames, image=image, image_mode="frame", generator=_seed())), 1
    )
    assert frames.shape[1] == num_frames


@torch.no_grad()
def test_a_recipes_image_mode_applies_to_image_to_video_only(monkeypatch):
    """`self-forcing` sets image_mode="frame": one latent frame first with an image; text-to-video is unchanged."""
    pipe = FAMILIES[0].make_pipeline()
    image, chunk = _input_video(pipe, 1)[0], get_recipe("self-forcing").settings["chunk_frames"]
    num_frames = pipe.latent_to_frames(1 + 2 * chunk)
    chunks = list(pipe.stream(PROMPT, num_frames, image=image, recipe="self-forcing", output_type="latent"))
    assert [latents.shape[2] for latents in chunks] == [1, chunk, chunk]
    given = pipe.stream(
        PROMPT, pipe.latent_to_frames(2 * chunk), image=image, recipe="self-forcing", image_mode="chunk"
    )
    assert given.request.geometry.first_chunk_frames == chunk  # the call's choice wins
    text_only = pipe.stream(PROMPT, pipe.latent_to_frames(2 * chunk), recipe="self-forcing")
    assert text_only.request.geometry.first_chunk_frames == chunk
    below, above = pipe.valid_num_frames(num_frames - 1, chunk, first_frame_alone=True)
    assert (below, above) == (pipe.latent_to_frames(1 + chunk), num_frames)


def test_image_mode_frame_against_a_recipes_first_chunk_rule_names_both_ways_out():
    pipe = next(case for case in FAMILIES if case.name.startswith("sana")).make_pipeline()
    image = _input_video(pipe, 1)[0]
    with pytest.raises(ValueError, match="'remainder' \\(given or set by the recipe\\).*first_chunk='frame'"):
        pipe.stream(PROMPT, pipe.latent_to_frames(21), image=image, recipe="longsana", image_mode="frame")
    stream = pipe.stream(PROMPT, pipe.latent_to_frames(21), image=image, recipe="longsana", image_mode="frame",
                         first_chunk="frame")  # fmt: skip
    assert stream.request.geometry.first_chunk_frames == 1


def test_image_mode_is_checked(pipe):
    image = _input_video(pipe, 1)[0]
    with pytest.raises(ValueError, match="`image_mode` must be one of"):
        pipe.stream(PROMPT, _frames(pipe), image=image, image_mode="repeat")
    with pytest.raises(ValueError, match="`image_mode` applies to `image=`"):
        pipe.stream(PROMPT, _frames(pipe), image_mode="frame")
    with pytest.raises(ValueError, match="one frame and then whole chunks"):
        pipe.stream(PROMPT, _frames(pipe), image=image, image_mode="frame")  # whole chunks only: one frame short

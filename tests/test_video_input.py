"""load_start_image and VideoInput: every input form gives diffusers' preprocessing, chunk by chunk; bad input is
refused with an error that names it."""

import imageio
import numpy as np
import PIL.Image
import pytest
import torch
from diffusers.video_processor import VideoProcessor

from rolldiff.pipelines.io.video_input import VideoInput, load_start_image, num_frames_available

HEIGHT, WIDTH = 16, 16  # output size
SOURCE_HEIGHT, SOURCE_WIDTH = 24, 32  # input frames: another size and aspect, so resizing is exercised
WAN_PROCESSOR = VideoProcessor(vae_scale_factor=8)  # as WanImageToVideoPipeline builds it for Wan 2.1


def frames_uint8(num_frames: int, seed: int = 0, height: int = SOURCE_HEIGHT, width: int = SOURCE_WIDTH):
    """`(num_frames, height, width, 3)` uint8 random frames."""
    return np.random.default_rng(seed).integers(0, 256, (num_frames, height, width, 3), dtype=np.uint8)


def reference(frames: np.ndarray, resize_mode: str = "default") -> torch.Tensor:
    """diffusers' own preprocessing of uint8 frames: `(3, F, HEIGHT, WIDTH)` in [-1, 1]."""
    pictures = [PIL.Image.fromarray(frame) for frame in frames]
    out = WAN_PROCESSOR.preprocess(pictures, height=HEIGHT, width=WIDTH, resize_mode=resize_mode)  # (F, 3, H, W)
    return out.transpose(0, 1)


def write_mp4(path, frames: np.ndarray, fps: float = 8) -> np.ndarray:
    """Write `frames` with imageio and return the frames as decoded back (H.264 changes them a little)."""
    imageio.mimwrite(path, list(frames), fps=fps, macro_block_size=1)
    return np.stack(imageio.mimread(path))


# --- load_start_image ------------------------------------------------------------------------------------------


def test_pil_image_is_diffusers_wan_image_to_video_preprocessing_repeated_over_the_batch():
    frame = frames_uint8(1)[0]

    image = load_start_image(PIL.Image.fromarray(frame), batch_size=2, height=HEIGHT, width=WIDTH)

    assert image.shape == (2, 3, 1, HEIGHT, WIDTH) and image.dtype == torch.float32
    expected = reference(frame[None])
    torch.testing.assert_close(image[0], expected, atol=0, rtol=0)
    torch.testing.assert_close(image[1], expected, atol=0, rtol=0)


@pytest.mark.parametrize(
    "as_input",
    [
        lambda frame: frame,  # (H, W, 3) uint8 array
        lambda frame: frame.astype(np.float32) / 255,  # (H, W, 3) float array in [0, 1]
        lambda frame: torch.from_numpy(frame).permute(2, 0, 1),  # (3, H, W) uint8 tensor
        lambda frame: torch.from_numpy(frame).permute(2, 0, 1)[None].double() / 255,  # (1, 3, H, W) float tensor
        lambda frame: PIL.Image.fromarray(frame).convert("RGBA"),  # converted to RGB
    ],
    ids=["uint8-array", "float-array", "uint8-chw-tensor", "float-1chw-tensor", "rgba-pil"],
)
def test_every_image_form_gives_the_same_start_frame(as_input):
    frame = frames_uint8(1)[0]

    image = load_start_image(as_input(frame), batch_size=1, height=HEIGHT, width=WIDTH)

    torch.testing.assert_close(image[0], reference(frame[None]), atol=0, rtol=0)


def test_a_list_gives_one_start_frame_per_batch_element():
    frames = frames_uint8(2)

    image = load_start_image([frames[0], PIL.Image.fromarray(frames[1])], batch_size=2, height=HEIGHT, width=WIDTH)

    torch.testing.assert_close(image[0], reference(frames[:1]), atol=0, rtol=0)
    torch.testing.assert_close(image[1], reference(frames[1:]), atol=0, rtol=0)


def test_a_list_of_tensors_takes_the_tensor_layout():
    frames = frames_uint8(2)
    tensors = [torch.from_numpy(frame).permute(2, 0, 1) for frame in frames]  # (3, H, W) each

    image = load_start_image([tensors[0], tensors[1][None]], batch_size=2, height=HEIGHT, width=WIDTH)

    torch.testing.assert_close(image[1], reference(frames[1:]), atol=0, rtol=0)


def test_a_batch_tensor_gives_one_start_frame_per_batch_element():
    frames = frames_uint8(3)

    image = load_start_image(torch.from_numpy(frames).permute(0, 3, 1, 2), batch_size=3, height=HEIGHT, width=WIDTH)

    for i in range(3):
        torch.testing.assert_close(image[i], reference(frames[i : i + 1]), atol=0, rtol=0)


def test_crop_mode_keeps_the_aspect_ratio_and_centre_crops():
    frame = np.zeros((SOURCE_HEIGHT, SOURCE_WIDTH, 3), dtype=np.uint8)
    frame[:, :3] = 255  # a white band at the left edge: cropped away, stretched in by the default mode

    cropped = load_start_image(frame, batch_size=1, height=HEIGHT, width=WIDTH, resize_mode="crop")
    stretched = load_start_image(frame, batch_size=1, height=HEIGHT, width=WIDTH)

    torch.testing.assert_close(cropped[0], reference(frame[None], resize_mode="crop"), atol=0, rtol=0)
    assert cropped.max() < -0.9 and stretched.max() > 0.9


@pytest.mark.parametrize(
    ("image", "message"),
    [
        ([frames_uint8(1)[0]] * 3, r"list of 3 images for a batch of 2"),
        (
            np.zeros((8, 8, 4), dtype=np.uint8),
            r"`image` must have shape \(height, width, 3\) \(RGB\), got \(8, 8, 4\)",
        ),
        (torch.zeros(4, 8, 8), r"`image` tensor must have shape \(3, height, width\)"),
        ([torch.zeros(8, 8, 3)] * 2, r"`image\[0\]` tensor must have shape \(3, height, width\) or \(1, 3, height"),
        (torch.zeros(3, 3, 8, 8), r"\(1, 3, height, width\) or \(2, 3, height, width\)"),
        ("start.png", r"`image` 'start.png' is not a file"),  # a path is read as a picture file (when there is one)
        (7, r"`image` must be a PIL image, a picture file's path, a numpy array or a torch tensor, got int"),
        ([np.zeros((8, 8, 3), np.uint8), 7], r"`image\[1\]` must be a PIL image"),
        (np.full((8, 8, 3), 2.0, dtype=np.float32), r"float pixels must be in \[0, 1\]"),
        (np.full((8, 8, 3), np.nan, dtype=np.float32), r"`image` holds NaN or infinite values"),
        (np.zeros((8, 8, 3), dtype=np.int64), r"`image` has dtype int64; allowed: uint8 \(0-255\) or float"),
        (None, r"`image` must be a picture"),
    ],
)
def test_bad_images_are_refused_with_a_clear_error(image, message):
    with pytest.raises(ValueError, match=message):
        load_start_image(image, batch_size=2, height=HEIGHT, width=WIDTH)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (dict(batch_size=0), r"`batch_size` must be a positive int, got 0"),
        (dict(height=16.0), r"`height` must be a positive int, got 16.0"),
        (dict(resize_mode="pad"), r"`resize_mode` must be one of \('default', 'crop', 'fill'\), got 'pad'"),
    ],
)
def test_bad_sizes_and_modes_are_refused(arguments, message):
    with pytest.raises(ValueError, match=message):
        load_start_image(frames_uint8(1)[0], **{**dict(batch_size=1, height=HEIGHT, width=WIDTH), **arguments})


# --- VideoInput ------------------------------------------------------------------------------------------------


def read_all(video: VideoInput, chunk_frames: int) -> list[torch.Tensor]:
    chunks = []
    while (chunk := video.next_chunk(chunk_frames)) is not None:
        chunks.append(chunk)
    return chunks


def test_a_file_is_read_chunk_by_chunk_as_its_decoded_frames(tmp_path):
    path = tmp_path / "input.mp4"
    decoded = write_mp4(path, frames_uint8(11), fps=12)

    with VideoInput(path, height=HEIGHT, width=WIDTH) as video:
        assert video.fps == 12
        chunks = read_all(video, chunk_frames=4)
        assert video.frames_read == 11

    assert [chunk.shape for chunk in chunks] == [(1, 3, n, HEIGHT, WIDTH) for n in (4, 4, 3)]
    torch.testing.assert_close(torch.cat(chunks, dim=2)[0], reference(decoded), atol=0, rtol=0)


@pytest.mark.parametrize(
    "as_video",
    [
        lambda frames: frames,  # (F, H, W, 3) uint8 array
        lambda frames: torch.from_numpy(frames).float() / 255,  # float tensor in [0, 1]
        lambda frames: [PIL.Image.fromarray(frame) for frame in frames],  # a list of PIL images
        lambda frames: (torch.from_numpy(frame) for frame in frames),  # a generator of (H, W, 3) tensors
    ],
    ids=["uint8-array", "float-tensor", "pil-list", "tensor-generator"],
)
def test_every_video_form_gives_the_same_chunks_repeated_over_the_batch(as_video):
    frames = frames_uint8(7)

    chunks = read_all(VideoInput(as_video(frames), height=HEIGHT, width=WIDTH, batch_size=2), chunk_frames=5)

    assert [chunk.shape for chunk in chunks] == [(2, 3, 5, HEIGHT, WIDTH), (2, 3, 2, HEIGHT, WIDTH)]
    video = torch.cat(chunks, dim=2)
    torch.testing.assert_close(video[0], reference(frames), atol=0, rtol=0)
    torch.testing.assert_close(video[1], reference(frames), atol=0, rtol=0)


def test_video_frames_are_resized_like_the_start_image():
    frames = frames_uint8(3)

    chunk = VideoInput(frames, height=HEIGHT, width=WIDTH, resize_mode="crop").next_chunk(3)

    for i in range(3):
        start = load_start_image(frames[i], batch_size=1, height=HEIGHT, width=WIDTH, resize_mode="crop")
        torch.testing.assert_close(chunk[:, :, i : i + 1], start, atol=0, rtol=0)


class Webcam:
    """An endless frame source that counts the frames taken from it and whether it was released."""

    def __init__(self) -> None:
        self.frames_taken = 0
        self.released = False

    def frames(self):
        try:
            while True:
                self.frames_taken += 1
                yield frames_uint8(1, seed=self.frames_taken)[0]
        finally:
            self.released = True


def test_an_endless_generator_is_read_only_as_far_as_asked_and_released_on_close():
    webcam = Webcam()

    with VideoInput(webcam.frames(), height=HEIGHT, width=WIDTH) as video:
        first = video.next_chunk(9)
        second = video.next_chunk(12)
        assert (webcam.frames_taken, video.frames_read) == (21, 21)

    assert first.shape[2] == 9 and second.shape[2] == 12
    assert webcam.released
    torch.testing.assert_close(second[0, :, :1], reference(frames_uint8(1, seed=10)), atol=0, rtol=0)


def test_skip_resumes_part_way_through(tmp_path):
    path = tmp_path / "input.mp4"
    decoded = write_mp4(path, frames_uint8(10))

    with VideoInput(path, height=HEIGHT, width=WIDTH) as video:
        video.skip(6)
        assert video.frames_read == 6
        chunk = video.next_chunk(4)

    torch.testing.assert_close(chunk[0], reference(decoded[6:]), atol=0, rtol=0)


def test_skip_past_the_end_says_where_the_video_ended():
    video = VideoInput(frames_uint8(5), height=HEIGHT, width=WIDTH)
    video.next_chunk(2)

    with pytest.raises(ValueError, match=r"`video` ended after 5 frames; cannot skip 4 frames from frame 2"):
        video.skip(4)
    assert video.next_chunk(1) is None


def test_a_closed_input_refuses_to_read():
    video = VideoInput(frames_uint8(5), height=HEIGHT, width=WIDTH)
    video.close()
    video.close()  # twice is fine

    with pytest.raises(RuntimeError, match="closed"):
        video.next_chunk(1)


def test_frames_available_where_knowable(tmp_path):
    path = tmp_path / "input.mp4"
    write_mp4(path, frames_uint8(6))

    assert num_frames_available(path) == 6
    assert num_frames_available(str(path)) == 6
    assert num_frames_available(frames_uint8(4)) == 4
    assert num_frames_available(torch.zeros(3, 8, 8, 3)) == 3
    assert num_frames_available([np.zeros((8, 8, 3), np.uint8)] * 2) == 2
    assert num_frames_available(Webcam().frames()) is None


def test_a_missing_or_unreadable_file_is_refused_at_once_naming_the_path(tmp_path):
    missing = tmp_path / "missing.mp4"
    broken = tmp_path / "broken.mp4"
    broken.write_text("not a video")

    with pytest.raises(ValueError, match=r"`video` '.*missing.mp4' is not a file"):
        VideoInput(missing, height=HEIGHT, width=WIDTH)
    with pytest.raises(ValueError, match=r"`video` '.*broken.mp4' is not a readable video"):
        VideoInput(broken, height=HEIGHT, width=WIDTH)
    with pytest.raises(ValueError, match=r"'.*missing.mp4' is not a file"):
        num_frames_available(missing)


@pytest.mark.parametrize(
    ("video", "message"),
    [
        (np.zeros((4, 8, 8), dtype=np.uint8), r"`video` array must have shape \(frames, height, width, 3\)"),
        (np.zeros((4, 8, 8, 3), dtype=np.int32), r"`video` has dtype int32; allowed: uint8"),
        (np.full((4, 8, 8, 3), np.inf, dtype=np.float32), r"`video` holds NaN or infinite values"),
        (torch.full((4, 8, 8, 3), 255.0), r"`video` is float with values in \[255, 255\]; float pixels must be in"),
        (12, r"`video` must be a file path, a \(frames, height, width, 3\) array or tensor, or an iterable"),
    ],
)
def test_bad_arrays_are_refused_before_any_frame_is_read(video, message):
    with pytest.raises(ValueError, match=message):
        VideoInput(video, height=HEIGHT, width=WIDTH)


def bad_frame_at(index: int, bad_frame) -> list:
    frames = list(frames_uint8(6, height=8, width=8))
    frames[index] = bad_frame
    return frames


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        (
            bad_frame_at(4, np.zeros((8, 10, 3), np.uint8)),
            r"frame 4 of `video` is 8x10 .* the frames before it are 8x8",
        ),
        (bad_frame_at(3, np.zeros((8, 8, 4), np.uint8)), r"frame 3 of `video` must have shape \(height, width, 3\)"),
        (bad_frame_at(5, np.full((8, 8, 3), np.nan, np.float32)), r"frame 5 of `video` holds NaN or infinite values"),
        (bad_frame_at(2, np.zeros((8, 8, 3), np.int16)), r"frame 2 of `video` has dtype int16"),
        (bad_frame_at(1, "frame.png"), r"frame 1 of `video` 'frame.png' is not a file"),
        (bad_frame_at(1, 7), r"frame 1 of `video` must be a PIL image, a picture file's path, a numpy array or a"),
    ],
)
def test_a_bad_frame_mid_stream_is_refused_naming_its_index(frames, message):
    video = VideoInput(iter(frames), height=HEIGHT, width=WIDTH)

    with pytest.raises(ValueError, match=message):
        read_all(video, chunk_frames=2)


def test_bad_chunk_sizes_are_refused():
    video = VideoInput(frames_uint8(3), height=HEIGHT, width=WIDTH)

    with pytest.raises(ValueError, match=r"`num_frames` must be a positive int, got 0"):
        video.next_chunk(0)
    with pytest.raises(ValueError, match=r"`num_frames` must be an int >= 0, got -1"):
        video.skip(-1)


def test_read_image_gives_rgb_and_refuses_a_file_that_is_not_a_picture(tmp_path):
    from rolldiff.pipelines.io.video_input import read_image

    PIL.Image.new("L", (4, 3), 128).save(tmp_path / "gray.png")
    picture = read_image(tmp_path / "gray.png")
    assert picture.mode == "RGB" and picture.size == (4, 3)
    (tmp_path / "notes.png").write_text("not a picture")
    with pytest.raises(ValueError, match="cannot identify image file"):
        read_image(tmp_path / "notes.png")
    with pytest.raises(ValueError, match="No such file"):
        read_image(tmp_path / "missing.png")


def test_an_arrays_values_are_checked_once_whole_not_again_per_frame(monkeypatch):
    from rolldiff.pipelines.io import video_input

    real, calls = video_input._check_pixel_values, []
    monkeypatch.setattr(
        video_input, "_check_pixel_values", lambda pixels, name: calls.append(name) or real(pixels, name)
    )
    frames = np.random.default_rng(0).random((4, HEIGHT, WIDTH, 3), dtype=np.float32)
    assert VideoInput(frames, height=HEIGHT, width=WIDTH).next_chunk(4).shape[2] == 4
    assert calls == ["`video`"]

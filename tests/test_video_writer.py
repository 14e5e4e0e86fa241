"""StreamingVideoWriter: chunks in, one playable mp4 out, even when the writing loop fails."""

import imageio.v3 as iio
import numpy as np
import pytest

from rolldiff.pipelines.io.video_writer import StreamingVideoWriter

SIZE = 32
# One flat colour per write call, far enough apart to survive H.264.
COLOURS = [(220, 30, 30), (30, 220, 30), (30, 30, 220), (220, 220, 30)]


def solid_frames(colour: tuple[int, int, int], frames: int) -> np.ndarray:
    """`(frames, SIZE, SIZE, 3)` uint8 of one colour."""
    return np.broadcast_to(np.array(colour, dtype=np.uint8), (frames, SIZE, SIZE, 3))


def read_video(path) -> np.ndarray:
    """`(frames, height, width, 3)` uint8."""
    return iio.imread(path, plugin="FFMPEG", index=None)


def test_chunks_read_back_with_count_size_and_colours(tmp_path):
    path = tmp_path / "video.mp4"
    with StreamingVideoWriter(path, fps=16) as writer:
        for colour in COLOURS:
            writer.write(solid_frames(colour, frames=10))
    assert writer.frames_written == 40

    video = read_video(path)

    assert video.shape == (40, SIZE, SIZE, 3)
    for index, colour in enumerate(COLOURS):
        mean_colour = video[10 * index : 10 * index + 10].reshape(-1, 3).mean(axis=0)
        np.testing.assert_allclose(mean_colour, colour, atol=12)


def test_a_video_starts_bit_for_bit_like_any_longer_one(tmp_path):
    """Encoding is causal (no B-frames, no x264 lookahead): what an interrupted run wrote is exactly the start of
    the uninterrupted video, which is what lets `--resume` keep those frames."""
    rng = np.random.default_rng(0)
    start = rng.integers(0, 256, (1, SIZE, SIZE, 3)).astype(np.float32)
    frames = np.clip(start + np.cumsum(rng.normal(0, 20, (12, SIZE, SIZE, 3)), axis=0), 0, 255).astype(np.uint8)
    videos = {}
    for length in (4, 12):
        with StreamingVideoWriter(tmp_path / f"{length}.mp4", fps=8) as writer:
            writer.write(frames[:length])
        videos[length] = read_video(tmp_path / f"{length}.mp4")
    np.testing.assert_array_equal(videos[4], videos[12][:4])


def test_exception_inside_with_leaves_the_written_frames_playable(tmp_path):
    path = tmp_path / "video.mp4"
    with pytest.raises(RuntimeError, match="generation failed"):
        with StreamingVideoWriter(path, fps=16) as writer:
            writer.write(solid_frames(COLOURS[0], frames=7))
            writer.write(solid_frames(COLOURS[1], frames=5))
            raise RuntimeError("generation failed")

    assert not path.exists() and writer.partial_path == tmp_path / "video.partial.mp4"
    video = read_video(writer.partial_path)

    assert video.shape == (12, SIZE, SIZE, 3)
    np.testing.assert_allclose(video[-1].reshape(-1, 3).mean(axis=0), COLOURS[1], atol=12)


def test_rejected_chunk_writes_nothing(tmp_path):
    path = tmp_path / "video.mp4"
    with StreamingVideoWriter(path, fps=16) as writer:
        writer.write(solid_frames(COLOURS[0], frames=3))
        with pytest.raises(ValueError, match="dtype uint8"):
            writer.write(np.zeros((4, SIZE, SIZE, 3), dtype=np.float32))
        with pytest.raises(ValueError, match="must keep the video's size"):
            writer.write(np.zeros((4, SIZE, 2 * SIZE, 3), dtype=np.uint8))
        assert writer.frames_written == 3

    assert read_video(path).shape[0] == 3


@pytest.mark.parametrize(
    "frames, message",
    [
        (np.zeros((2, SIZE, SIZE, 3), dtype=np.float32), "dtype uint8"),
        (np.zeros((2, SIZE, SIZE, 3), dtype=np.int64), "dtype uint8"),
        (np.zeros((SIZE, SIZE, 3), dtype=np.uint8), r"shape \(frames, height, width, 3\)"),
        (np.zeros((2, SIZE, SIZE, 4), dtype=np.uint8), r"shape \(frames, height, width, 3\)"),
        (np.zeros((2, 3, SIZE, SIZE), dtype=np.uint8), r"shape \(frames, height, width, 3\)"),
        (np.zeros((2, SIZE + 1, SIZE, 3), dtype=np.uint8), "must be even"),
        ([[0]], "numpy array"),
    ],
)
def test_bad_frames_are_refused_before_any_file_is_written(tmp_path, frames, message):
    path = tmp_path / "video.mp4"
    with StreamingVideoWriter(path, fps=16) as writer:
        with pytest.raises(ValueError, match=message):
            writer.write(frames)
    assert not path.exists()


@pytest.mark.parametrize("fps", [0, -8, float("nan"), float("inf"), "16", True])
def test_bad_fps_is_refused(tmp_path, fps):
    with pytest.raises(ValueError, match="`fps` must be"):
        StreamingVideoWriter(tmp_path / "video.mp4", fps=fps)


def test_non_mp4_suffix_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"`path` must end in \.mp4"):
        StreamingVideoWriter(tmp_path / "video.avi", fps=16)


def test_missing_folder_is_refused(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        StreamingVideoWriter(tmp_path / "missing" / "video.mp4", fps=16)


def test_write_after_close_is_refused(tmp_path):
    writer = StreamingVideoWriter(tmp_path / "video.mp4", fps=16)
    writer.write(solid_frames(COLOURS[0], frames=2))
    writer.close()
    writer.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        writer.write(solid_frames(COLOURS[0], frames=2))


def test_frames_to_uint8_rounds_and_clips_to_0_255():
    from rolldiff.pipelines.io.video_writer import frames_to_uint8

    frames = np.array([[-0.5, 0.0, 0.5 / 255, 0.499, 1.0, 1.5]], dtype=np.float32)
    out = frames_to_uint8(frames)
    assert out.dtype == np.uint8 and out.tolist() == [[0, 0, 0, 127, 255, 255]]

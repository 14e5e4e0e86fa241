"""Atomic outputs: a failed or interrupted run never touches an existing video and keeps its frames as a partial.

The writer writes to a hidden temporary file beside the target and renames it on success; on an exception or
Ctrl-C it finishes the frames done into `video.partial.mp4` and names that file in a note on the exception.
"""

import os
import stat

import imageio.v3 as iio
import numpy as np
import pytest

from rolldiff.pipelines.io.video_writer import StreamingVideoWriter, check_output_path, count_frames, partial_path_for

SIZE = 16
RED, GREEN, BLUE = (220, 30, 30), (30, 220, 30), (30, 30, 220)


def solid(colour, frames: int) -> np.ndarray:
    """`(frames, SIZE, SIZE, 3)` uint8 of one colour."""
    return np.broadcast_to(np.array(colour, dtype=np.uint8), (frames, SIZE, SIZE, 3))


def read(path) -> np.ndarray:
    return iio.imread(path, plugin="FFMPEG", index=None)  # (frames, height, width, 3) uint8


def finished_video(path, colour=BLUE, frames: int = 9) -> bytes:
    with StreamingVideoWriter(path, fps=8) as writer:
        writer.write(solid(colour, frames))
    return path.read_bytes()


def only_files(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("error", [RuntimeError("generation failed"), KeyboardInterrupt()])
def test_failed_run_keeps_the_existing_video_and_a_playable_partial(tmp_path, error):
    path = tmp_path / "video.mp4"
    before = finished_video(path)
    with pytest.raises(type(error)) as raised:
        with StreamingVideoWriter(path, fps=8) as writer:
            writer.write(solid(RED, 5))
            writer.write(solid(GREEN, 3))
            raise error

    assert path.read_bytes() == before  # the finished video is untouched, byte for byte
    partial = tmp_path / "video.partial.mp4"
    assert writer.partial_path == partial == partial_path_for(path)
    video = read(partial)
    assert video.shape == (8, SIZE, SIZE, 3)
    np.testing.assert_allclose(video[-1].reshape(-1, 3).mean(0), GREEN, atol=12)
    assert any(str(partial) in note for note in raised.value.__notes__)
    assert only_files(tmp_path) == ["video.mp4", "video.partial.mp4"]  # no temporary file left behind


def test_failure_before_any_frame_leaves_no_partial_and_the_old_file(tmp_path):
    path = tmp_path / "video.mp4"
    before = finished_video(path)
    with pytest.raises(ValueError, match="boom"):
        with StreamingVideoWriter(path, fps=8) as writer:
            raise ValueError("boom")
    assert writer.partial_path is None
    assert path.read_bytes() == before and only_files(tmp_path) == ["video.mp4"]


def test_success_replaces_the_old_video_and_leaves_only_it(tmp_path):
    path = tmp_path / "video.mp4"
    finished_video(path, BLUE, 9)
    with StreamingVideoWriter(path, fps=8) as writer:
        assert writer.temp_path.parent == tmp_path and writer.temp_path.name.startswith(".video.mp4.")
        writer.write(solid(RED, 4))
        assert read(path).shape[0] == 9  # the old video stays readable while the new one is written
    assert read(path).shape[0] == 4
    assert only_files(tmp_path) == ["video.mp4"]


def test_finished_video_has_the_usual_file_mode(tmp_path):
    umask = os.umask(0o022)
    os.umask(umask)
    path = tmp_path / "video.mp4"
    finished_video(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask


def test_continue_from_prepends_the_partial_without_reencoding(tmp_path):
    first = tmp_path / "first.mp4"
    finished_video(first, RED, 6)
    path = tmp_path / "video.mp4"
    with StreamingVideoWriter(path, fps=8, continue_from=first) as writer:
        writer.write(solid(GREEN, 4))
    video = read(path)
    assert video.shape == (10, SIZE, SIZE, 3)
    np.testing.assert_array_equal(video[:6], read(first))  # stream copy: the first frames decode identically
    np.testing.assert_allclose(video[6:].reshape(-1, 3).mean(0), GREEN, atol=12)


def test_continue_from_that_fails_again_keeps_everything_in_the_partial(tmp_path):
    path = tmp_path / "video.mp4"
    partial = partial_path_for(path)
    finished_video(partial, RED, 6)
    with pytest.raises(KeyboardInterrupt):
        with StreamingVideoWriter(path, fps=8, continue_from=partial) as writer:
            writer.write(solid(GREEN, 2))
            raise KeyboardInterrupt
    assert not path.exists() and read(partial).shape[0] == 8


@pytest.mark.parametrize(
    "name, message",
    [
        ("sub", "is a folder"),
        ("missing/video.mp4", "does not exist"),
        ("video.avi", "must end in .mp4"),
    ],
)
def test_unwritable_targets_are_refused_before_any_frame(tmp_path, name, message):
    (tmp_path / "sub").mkdir()
    with pytest.raises(ValueError, match=message):
        check_output_path(tmp_path / name, "--out")
    with pytest.raises(ValueError, match=message):
        StreamingVideoWriter(tmp_path / name, fps=8)


def test_unwritable_folder_is_refused(tmp_path):
    target = "/proc/video.mp4" if os.geteuid() == 0 else str(tmp_path / "locked" / "video.mp4")
    if os.geteuid() != 0:  # root may write into a read-only folder, but not under /proc
        (tmp_path / "locked").mkdir(mode=0o500)
    with pytest.raises(ValueError, match="is not writable"):
        check_output_path(target, "--out")


def test_continue_frames_keeps_only_the_frames_vouched_for(tmp_path):
    first = tmp_path / "first.mp4"
    with StreamingVideoWriter(first, fps=8) as writer:
        writer.write(solid(RED, 4))
        writer.write(solid(BLUE, 3))  # frames a killed run wrote after its last saved state
    path = tmp_path / "video.mp4"
    with StreamingVideoWriter(path, fps=8, continue_from=first, continue_frames=4) as writer:
        assert writer.total_frames == 4
        writer.write(solid(GREEN, 2))
        assert writer.total_frames == 6
    video = read(path)
    assert video.shape[0] == 6 and count_frames(path) == 6
    np.testing.assert_array_equal(video[:4], read(first)[:4])
    np.testing.assert_allclose(video[4:].reshape(-1, 3).mean(0), GREEN, atol=12)

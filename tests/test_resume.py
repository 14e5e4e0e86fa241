"""Resumable long runs: a generation stopped part-way continues from its last saved chunk, and the resumed video
equals an uninterrupted one frame for frame.

"Frame for frame" is checked on the frames the pipeline hands the writer (uint8, exact) and on the files: the
resumed file has the same frame count, its frames before the cut decode bit for bit like the uninterrupted
file's (causal encoding, joined by stream copy), and with lossless encoding every frame does (lossy: the frames
after the cut start a new key frame and differ by H.264's rounding). The tiny pipeline uses classifier-free guidance (two caches) and a prompt switch (the
active prompt and the re-cache latents are state too).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from safetensors import safe_open
from tiny_components import tiny_pipeline

from rolldiff.cli import main
from rolldiff.pipelines.io.resume import ResumeError, load_state, state_path_for
from rolldiff.pipelines.io.subtitles import subtitle_overlay
from rolldiff.pipelines.io.video_writer import StreamingVideoWriter, partial_path_for

RED, BLUE = "a red circle moving left", "a blue square moving up"
STEPS = 4  # the tiny pipeline's denoising steps per chunk (its config default)
# 5 chunks of 2; lossless encoding, so whole files compare exactly (the lossy prefix: test_video_writer)
RUN = dict(num_frames=10, height=16, width=16, guidance_scale=2.0, prompt_schedule=[(4, BLUE)], quality=10)


@pytest.fixture(scope="module")
def pipe():
    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture
def written(monkeypatch) -> list[np.ndarray]:
    """Every chunk of frames handed to a writer, as written (uint8)."""
    chunks: list[np.ndarray] = []
    real_write = StreamingVideoWriter.write

    def record(self, frames):
        chunks.append(frames.copy())
        real_write(self, frames)

    monkeypatch.setattr(StreamingVideoWriter, "write", record)
    return chunks


def _generate(pipe, path, **extra) -> int:
    return pipe.generate_to_file(path, RED, fps=8, generator=torch.Generator().manual_seed(3), **RUN, **extra)


def _interrupt_at_step(step: int):
    """A callback that stops the run like Ctrl-C at the `step`-th denoising step (counted over the whole run)."""
    calls = {"n": 0}

    def callback(pipe, index, timestep, tensors):
        calls["n"] += 1
        if calls["n"] == step:
            raise KeyboardInterrupt
        return tensors

    return callback


def _read(path) -> np.ndarray:
    return iio.imread(path, plugin="FFMPEG", index=None)  # (frames, height, width, 3) uint8


@pytest.fixture(scope="module")
def uninterrupted(pipe, tmp_path_factory):
    """The reference: the same run in one go, its written frames and its file."""
    folder = tmp_path_factory.mktemp("reference")
    frames: list[np.ndarray] = []
    real_write = StreamingVideoWriter.write
    StreamingVideoWriter.write = lambda self, f: (frames.append(f.copy()), real_write(self, f))[1]
    try:
        assert _generate(pipe, folder / "full.mp4") == 10
    finally:
        StreamingVideoWriter.write = real_write
    return np.concatenate(frames), _read(folder / "full.mp4")


@pytest.mark.parametrize("stop_in_chunk", [1, 3])  # before and after the prompt switch (chunk 2 starts at frame 4)
def test_interrupted_then_resumed_equals_uninterrupted(pipe, uninterrupted, written, tmp_path, stop_in_chunk):
    full_frames, full_file = uninterrupted
    path = tmp_path / "video.mp4"
    with pytest.raises(KeyboardInterrupt):
        _generate(pipe, path, state_every_s=0, callback_on_step_end=_interrupt_at_step(stop_in_chunk * STEPS + 2))
    assert not path.exists()
    saved = load_state(state_path_for(path))
    assert saved.next_chunk == stop_in_chunk and saved.frames_written == 2 * stop_in_chunk
    first_run = np.concatenate(written)
    written.clear()

    assert _generate(pipe, path, state_every_s=0, resume=True) == 10
    second_run = np.concatenate(written)
    assert second_run.shape[0] == 10 - saved.frames_written  # only the missing chunks were made
    np.testing.assert_array_equal(np.concatenate([first_run[: saved.frames_written], second_run]), full_frames)

    video = _read(path)
    assert video.shape == full_file.shape
    np.testing.assert_array_equal(video, full_file)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["video.mp4"]  # state and partial removed


def test_a_state_saved_before_the_last_written_chunk_cuts_the_partial(pipe, uninterrupted, written, tmp_path):
    """Killed after writing a chunk but before its state was saved: the resume keeps only the frames vouched for."""
    path = tmp_path / "video.mp4"
    with pytest.raises(KeyboardInterrupt):  # states are saved only at the first boundary (huge interval)
        _generate(pipe, path, state_every_s=3600, callback_on_step_end=_interrupt_at_step(3 * STEPS + 1))
    assert load_state(state_path_for(path)).frames_written == 2
    assert _read(partial_path_for(path)).shape[0] == 6  # 3 chunks were written
    written.clear()
    assert _generate(pipe, path, state_every_s=0, resume=True) == 10
    np.testing.assert_array_equal(np.concatenate(written), uninterrupted[0][2:])


def test_state_file_is_safetensors_with_json_metadata(pipe, tmp_path):
    path = tmp_path / "video.mp4"
    with pytest.raises(KeyboardInterrupt):
        _generate(pipe, path, state_every_s=0, callback_on_step_end=_interrupt_at_step(2 * STEPS + 1))
    with safe_open(str(state_path_for(path)), framework="pt") as file:
        header = json.loads(file.metadata()["rolldiff_state"])
        names = list(file.keys())
    assert header["format"] == "rolldiff-resume-3" and load_state(state_path_for(path)).next_chunk == 2
    extras = header["extras"]  # every layer's host counters, as JSON (the layers' get_extra_state)
    assert any(key.startswith("cache.0.") and key.endswith("_extra_state") for key in extras)
    assert any(name.startswith("cache.0.layers.0.") for name in names)  # conditional branch
    assert any(name.startswith("cache.1.layers.0.") for name in names)  # guidance branch
    assert any(name.startswith("decoder.feat_cache.") for name in names)
    assert "generator.0" in names and "recent" in names and "position" in names
    assert not any("cross" in name for name in names)  # text K/V are recomputed from the embeddings, not saved


def test_a_state_file_of_the_old_format_is_refused_with_a_clear_message(pipe, tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "video.mp4"
    save_file(
        {"x": torch.zeros(1)},
        str(state_path_for(path)),
        metadata={"rolldiff_state": json.dumps({"format": "rolldiff-resume-1"})},
    )
    with pytest.raises(ResumeError, match="older rolldiff .*start over"):
        load_state(state_path_for(path))


@pytest.mark.parametrize(
    "change, named",
    [
        ({"guidance_scale": 3.0}, "guidance_scale"),
        ({"prompt_schedule": [(6, BLUE)]}, "schedule"),
        ({"quality": 5}, "quality"),
        # each of these continued silently before the fingerprint was derived from the request's fields
        ({"context_noise": 100.0}, "context_noise"),
        ({"prompt_blend_chunks": 2}, "prompt_blend_chunks"),
        ({"sigma_mapping": "table"}, "step_plan"),
        ({"timestep_shift": 3.0}, "step_plan"),
        ({"recache": "longlive"}, "recache_mode"),
        ({"recompute_first_frame": "reencode"}, "recompute_first_frame"),
        ({"denoising_steps": [1000, 500, 250, 100]}, "denoising_steps|steps"),
    ],
)
def test_resume_with_other_arguments_is_refused_before_work(pipe, tmp_path, change, named):
    path = tmp_path / "video.mp4"
    with pytest.raises(KeyboardInterrupt):
        _generate(pipe, path, state_every_s=0, callback_on_step_end=_interrupt_at_step(STEPS + 1))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ResumeError, match=named):
        pipe.generate_to_file(path, RED, fps=8, generator=torch.Generator().manual_seed(3), resume=True,
                              **{**RUN, **change})  # fmt: skip
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_resume_without_the_partial_is_refused(pipe, tmp_path):
    path = tmp_path / "video.mp4"
    with pytest.raises(KeyboardInterrupt):
        _generate(pipe, path, state_every_s=0, callback_on_step_end=_interrupt_at_step(STEPS + 1))
    partial_path_for(path).unlink()
    with pytest.raises(ResumeError, match="partial"):
        _generate(pipe, path, resume=True)


def test_resume_without_a_state_starts_over_with_a_warning(pipe, uninterrupted, tmp_path):
    path = tmp_path / "video.mp4"
    with StreamingVideoWriter(partial_path_for(path), fps=8) as writer:
        writer.write(np.zeros((2, 16, 16, 3), dtype=np.uint8))
    with pytest.warns(UserWarning, match="no saved state"):
        assert _generate(pipe, path, resume=True) == 10
    assert _read(path).shape == uninterrupted[1].shape


def test_the_command_resumes_a_killed_run(tmp_path, pipe):
    """`rolldiff generate` in a child process, killed (SIGTERM, as `kill` sends) once it has saved a state,
    then `--resume`: the killed run's frames kept bit for bit, the rest made from its state, and the whole equal to
    an uninterrupted run of the command. That run is in this process, the killed one was not: MKL may round a
    matrix product differently with its buffers' alignment, so equal means to one or two levels of 255 here (the
    in-process tests above are exact); lossless encoding keeps H.264 out of the comparison."""
    model = tmp_path / "model"
    pipe.save_pretrained(model)
    out = tmp_path / "video.mp4"
    argv = ["generate", "--model", str(model), "--out", str(out), "--height", "16", "--width", "16", "--fps", "8",
            "--seed", "3", "--seconds", "1.25", "--prompt", RED, "--state-every", "0", "--quality", "10"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-m", "rolldiff", *argv], env=env, stderr=subprocess.PIPE, text=True)
    state = state_path_for(out)
    deadline = time.monotonic() + 120
    while not state.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    child.send_signal(signal.SIGTERM)
    err = child.communicate(timeout=60)[1]
    if child.returncode == 0:  # the whole run finished before the signal arrived: nothing to resume
        pytest.fail(f"the child finished before it could be killed; make the run longer\n{err}")
    assert child.returncode == 130, err
    assert "--resume" in err and not out.exists()
    saved = load_state(state)
    kept = _read(partial_path_for(out))[: saved.frames_written]

    assert main([*argv, "--resume"]) == 0
    reference = tmp_path / "reference.mp4"
    assert main([*argv[:4], str(reference), *argv[5:]]) == 0
    video, expected = _read(out), _read(reference)
    assert video.shape == expected.shape == (10, 16, 16, 3)
    assert 0 < saved.frames_written < len(video)
    np.testing.assert_array_equal(video[: saved.frames_written], kept)
    assert np.abs(video.astype(int) - expected.astype(int)).max() <= 2


@pytest.mark.parametrize("options", [{"kv_quantization": "int8"}, {"kv_offload": True}], ids=["int8", "offload"])
def test_quantized_and_offloaded_caches_resume_exactly(pipe, written, tmp_path, options):
    """The state captures every layer kind's buffers and counters (scales, host copies), not just K and V."""
    _generate(pipe, tmp_path / "full.mp4", **options)
    full = np.concatenate(written)
    written.clear()
    path = tmp_path / "video.mp4"
    with pytest.raises(KeyboardInterrupt):
        _generate(pipe, path, state_every_s=0, callback_on_step_end=_interrupt_at_step(3 * STEPS + 2), **options)
    first = np.concatenate(written)[:6]  # chunks 0-2, the frames the state vouches for
    written.clear()
    _generate(pipe, path, state_every_s=0, resume=True, **options)
    np.testing.assert_array_equal(np.concatenate([first, *written]), full)


def test_every_request_field_is_fingerprinted_or_excluded_with_a_reason(pipe):
    """A field added to `VideoRequest` (or to a family's cache options) later is fingerprinted unless someone
    names it in `NOT_FINGERPRINTED`: the fingerprint is derived from the dataclass fields, not listed by hand."""
    import dataclasses

    from rolldiff.pipelines.io.resume import run_fingerprint
    from rolldiff.pipelines.request import VideoRequest
    from rolldiff.pipelines.request.fingerprint import NOT_FINGERPRINTED

    stream = pipe.stream(RED, num_frames=10, height=16, width=16)
    fingerprint = run_fingerprint(stream, fps=8)["request"]
    names = {f.name for f in dataclasses.fields(VideoRequest)}
    assert set(fingerprint) | set(NOT_FINGERPRINTED) == names
    assert set(fingerprint) & set(NOT_FINGERPRINTED) == set()
    assert all(reason.strip() for reason in NOT_FINGERPRINTED.values())
    options = {f.name for f in dataclasses.fields(stream.request.options)}
    assert set(fingerprint["options"]) == options
    assert {"steps", "timesteps", "sigmas"} <= set(fingerprint["step_plan"])


def test_on_chunk_sees_every_chunk_in_the_file_and_an_exception_there_stops_the_run_resumably(
    pipe, uninterrupted, tmp_path
):
    path, seen = tmp_path / "video.mp4", []

    def stop_after_two_chunks(frames_written: int) -> None:  # a host's Cancel button, pressed during chunk 2
        seen.append(frames_written)
        if len(seen) == 2:
            raise InterruptedError("cancelled")

    with pytest.raises(InterruptedError):
        _generate(pipe, path, state_every_s=0, on_chunk=stop_after_two_chunks)
    assert seen == [2, 4] and not path.exists()
    assert load_state(state_path_for(path)).frames_written == 4  # saved before on_chunk ran
    assert len(_read(partial_path_for(path))) == 4

    seen.clear()
    assert _generate(pipe, path, state_every_s=0, resume=True, on_chunk=seen.append) == 10
    assert seen == [6, 8, 10]  # the frames in the file, counting those kept from the first run
    np.testing.assert_array_equal(_read(path), uninterrupted[1])


def test_a_run_with_subtitles_resumes_drawing_them_on_and_other_subtitles_are_refused(pipe, tmp_path):
    """`overlay=` (a story's subtitles) draws on each chunk by its video frame numbers, so a resumed run draws on
    from where the first stopped and equals one uninterrupted run; a resume with other subtitles is refused."""
    spans = [(0, 5, "Red"), (5, 10, "Blue")]
    whole, path = tmp_path / "whole.mp4", tmp_path / "video.mp4"
    _generate(pipe, whole, overlay=subtitle_overlay(spans))
    with pytest.raises(KeyboardInterrupt):
        _generate(pipe, path, state_every_s=0, overlay=subtitle_overlay(spans),
                  callback_on_step_end=_interrupt_at_step(3 * STEPS + 1))  # fmt: skip
    with pytest.raises(ResumeError, match="overlay"):
        _generate(pipe, path, resume=True, overlay=subtitle_overlay([(0, 10, "Other")]))
    assert _generate(pipe, path, resume=True, overlay=subtitle_overlay(spans)) == 10
    np.testing.assert_array_equal(_read(path), _read(whole))
    plain = tmp_path / "plain.mp4"
    _generate(pipe, plain)
    assert not np.array_equal(_read(plain), _read(whole))  # the subtitles are drawn

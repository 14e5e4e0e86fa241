"""`rolldiff generate --image` / `--video --strength` with the embedded default model, resume included."""

from __future__ import annotations

import imageio.v3 as iio
import numpy as np
import PIL.Image
import pytest

from rolldiff.cli import main
from rolldiff.pipelines.io.video_writer import StreamingVideoWriter
from rolldiff.toyworld import render_video

BASE = ["generate", "--prompt", "a blue square moving up", "--seconds", "1", "--fps", "12"]


def _read(path) -> np.ndarray:
    return iio.imread(path, plugin="FFMPEG", index=None)


def _interrupt_after_two_writes_then_resume(arguments: list[str], out, monkeypatch) -> None:
    """Run `arguments` into `out`, stopped by Ctrl-C after its second write, then `--resume` it to the end."""
    real_write, writes = StreamingVideoWriter.write, []

    def write_then_fail(self, frames):
        real_write(self, frames)
        writes.append(len(frames))
        if len(writes) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(StreamingVideoWriter, "write", write_then_fail)
    assert main([*arguments, "--out", str(out)]) == 130
    monkeypatch.setattr(StreamingVideoWriter, "write", real_write)
    assert main([*arguments, "--out", str(out), "--resume"]) == 0


def test_image_to_video_starts_on_the_image(tmp_path):
    image = render_video("a red circle moving left", num_frames=1, seed=2)[0]
    PIL.Image.fromarray(image).save(tmp_path / "start.png")
    out = tmp_path / "video.mp4"
    assert main([*BASE, "--image", str(tmp_path / "start.png"), "--out", str(out), "--quality", "10"]) == 0
    first = _read(out)[0].astype(float)
    assert np.abs(first - image).mean() < 0.05 * 255  # the VAE round trip of the start image


@pytest.mark.parametrize(("flags", "frames"), [(["--image-mode", "frame"], 13), (["--recipe", "self-forcing"], 13)])
def test_image_mode_frame_starts_on_the_image_with_one_frame_then_whole_chunks(tmp_path, flags, frames):
    """12 frames at 12 fps: one latent frame and whole chunks of 3 make it 13 (the recipe's convention is "frame")."""
    image = render_video("a red circle moving left", num_frames=1, seed=2)[0]
    PIL.Image.fromarray(image).save(tmp_path / "start.png")
    out = tmp_path / "video.mp4"
    assert main([*BASE, "--image", str(tmp_path / "start.png"), *flags, "--out", str(out), "--quality", "10"]) == 0
    video = _read(out)
    assert video.shape[0] == frames
    assert np.abs(video[0].astype(float) - image).mean() < 0.05 * 255


def test_video_to_video_follows_the_input_and_resumes(tmp_path, monkeypatch):
    source = tmp_path / "input.mp4"
    iio.imwrite(source, render_video("a red circle moving left", num_frames=12, seed=1), fps=12, codec="libx264")
    arguments = [*BASE, "--video", str(source), "--strength", "0.5", "--state-every", "0"]
    whole = tmp_path / "whole.mp4"
    assert main([*arguments, "--out", str(whole)]) == 0
    assert _read(whole).shape[0] == 12  # one second of input: the output ends with it
    out = tmp_path / "video.mp4"
    _interrupt_after_two_writes_then_resume(arguments, out, monkeypatch)
    assert _read(out).shape == _read(whole).shape


@pytest.mark.parametrize("mode", ["chunk", "frame"])
def test_image_to_video_resumes_to_the_uninterrupted_video(tmp_path, monkeypatch, mode):
    PIL.Image.fromarray(render_video("a red circle moving left", num_frames=1, seed=2)[0]).save(tmp_path / "start.png")
    arguments = [*BASE, "--image", str(tmp_path / "start.png"), "--image-mode", mode, "--state-every", "0"]
    arguments += ["--quality", "10"]
    whole, out = tmp_path / "whole.mp4", tmp_path / "video.mp4"
    assert main([*arguments, "--out", str(whole)]) == 0
    _interrupt_after_two_writes_then_resume(arguments, out, monkeypatch)
    resumed, uninterrupted = _read(out).astype(float), _read(whole).astype(float)
    assert resumed.shape == uninterrupted.shape
    assert np.abs(resumed - uninterrupted).max() <= 2  # the same frames, through the mp4 codec


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--image", "missing.png"], "--image"),
        (["--video", "missing.mp4"], "--video"),
        (["--strength", "0.5"], "strength"),
        (["--image-mode", "frame"], "--image-mode (`image_mode`) applies to"),
        (["--image-mode", "tile"], "--image-mode"),
        (["--video-noise-mix", "strength"], "--video-noise-mix (`video_noise_mix`) applies to"),
    ],
)
def test_bad_conditioning_flags_exit_2_with_the_flag_named(tmp_path, capsys, extra, message):
    assert main([*BASE, *extra, "--out", str(tmp_path / "video.mp4")]) == 2
    assert message in capsys.readouterr().err


def test_generate_takes_a_recipe_and_refuses_one_of_another_pipeline(tmp_path, capsys):
    out = tmp_path / "video.mp4"
    assert main([*BASE, "--recipe", "longlive", "--out", str(out)]) == 0
    assert _read(out).shape[0] > 0
    assert main([*BASE, "--recipe", "longsana", "--out", str(out)]) == 2  # the embedded model is Krea-like
    assert "--recipe (`recipe`) must be one of" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--fp8"], "--fp8"),
        (["--cuda-graphs"], "--cuda-graphs"),
        (["--attention-backend", "warp9"], "--attention-backend"),
    ],
)
def test_gpu_flags_on_a_cpu_are_refused_naming_the_flag(tmp_path, capsys, flags, message):
    assert main([*BASE, *flags, "--device", "cpu", "--out", str(tmp_path / "video.mp4")]) == 2
    assert message in capsys.readouterr().err


def test_overlap_decode_and_the_fastest_backend_run_on_a_cpu(tmp_path):
    out = tmp_path / "video.mp4"
    assert main([*BASE, "--overlap-decode", "--attention-backend", "fastest", "--out", str(out)]) == 0
    assert _read(out).shape[0] > 0


def test_video_to_video_builds_its_stream_once(tmp_path, monkeypatch):
    """The checked stream is the one written: the input video is opened and the prompt checked once."""
    from rolldiff.pipelines.families.chunked_video import ChunkedVideoPipeline

    source = tmp_path / "input.mp4"
    iio.imwrite(source, render_video("a red circle moving left", num_frames=12, seed=1), fps=12, codec="libx264")
    real_stream, built = ChunkedVideoPipeline.stream, []

    def counted(self, *args, **kwargs):
        built.append(kwargs.get("video"))
        return real_stream(self, *args, **kwargs)

    monkeypatch.setattr(ChunkedVideoPipeline, "stream", counted)
    assert main([*BASE, "--video", str(source), "--strength", "0.5", "--out", str(tmp_path / "video.mp4")]) == 0
    assert built == [str(source)]
    mixes = []
    monkeypatch.setattr(
        ChunkedVideoPipeline,
        "stream",
        lambda self, *a, **k: mixes.append(k.get("video_noise_mix")) or real_stream(self, *a, **k),
    )
    arguments = ["--video", str(source), "--video-noise-mix", "strength", "--out", str(tmp_path / "mixed.mp4")]
    assert main([*BASE, *arguments]) == 0
    assert mixes == ["strength"]


def test_the_recipe_a_pipeline_folder_names_sets_the_length_of_an_image_to_video(tmp_path):
    """A folder whose model_index.json names "self-forcing" (image_mode "frame"): with --image, one latent frame
    and whole chunks of 3 (13 frames for 12), as the stream resolves it, not the whole chunks of 12."""
    import json
    import shutil

    from rolldiff.defaults import default_model_path

    folder = tmp_path / "self-forcing-model"
    shutil.copytree(default_model_path(), folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "recipe": "self-forcing"}))
    image = render_video("a red circle moving left", num_frames=1, seed=2)[0]
    PIL.Image.fromarray(image).save(tmp_path / "start.png")
    out = tmp_path / "video.mp4"
    arguments = [*BASE, "--model", str(folder), "--image", str(tmp_path / "start.png"), "--out", str(out)]
    assert main(arguments) == 0
    assert _read(out).shape[0] == 13

"""The `rolldiff` command, run in-process with `main([...])` against a tiny random pipeline saved to a folder.

The tiny pipeline makes 2 frames per chunk (no temporal VAE compression) and runs at 16x16.
"""

import importlib.util
import json
import shutil
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from tiny_components import tiny_pipeline

import rolldiff
import rolldiff.defaults
from rolldiff import KreaRealtimeVideoPipeline
from rolldiff.cli import main
from rolldiff.defaults import native_size
from rolldiff.pipelines.io.resume import write_video
from rolldiff.pipelines.io.subtitles import subtitle_overlay
from rolldiff.pipelines.io.video_writer import StreamingVideoWriter
from rolldiff.story import parse_story

RED, BLUE = "a red circle moving left", "a blue square moving up"
SIZE = ["--height", "16", "--width", "16"]


def _read(path) -> np.ndarray:
    return iio.imread(path, plugin="FFMPEG", index=None)  # (frames, height, width, 3) uint8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-pipeline")
    tiny_pipeline().save_pretrained(folder)
    return folder


def _generate(model_dir, out, *extra) -> int:
    return main(["generate", "--model", str(model_dir), "--out", str(out), "--fps", "8", *SIZE, *extra])


def test_saved_tiny_pipeline_loads_back(model_dir):
    pipe = KreaRealtimeVideoPipeline.from_pretrained(model_dir)
    assert pipe.config.chunk_frames == 2 and pipe.transformer.config.num_layers == 2


def test_generate_streams_the_rounded_up_video_and_reports_path_and_speed(model_dir, tmp_path, capsys):
    out = tmp_path / "video.mp4"
    assert _generate(model_dir, out, "--prompt", RED, "--seconds", "0.6") == 0  # 4.8 frames -> 6 (3 chunks)
    stdout = capsys.readouterr().out
    assert _read(out).shape == (6, 16, 16, 3)
    assert "Generating 6 frames" in stdout
    assert f"Wrote 6 frames to {out.resolve()}" in stdout
    assert "frames per second" in stdout


def test_prompt_at_gives_the_pipelines_prompt_schedule(model_dir, tmp_path):
    out = tmp_path / "switch.mp4"
    assert _generate(model_dir, out, "--prompt-at", f"0:{RED}", "--prompt-at", f"2:{BLUE}", "--seconds", "0.5") == 0

    expected = tmp_path / "expected.mp4"
    pipe = KreaRealtimeVideoPipeline.from_pretrained(model_dir)
    generator = torch.Generator().manual_seed(0)
    pipe.generate_to_file(expected, None, fps=8, num_frames=4, height=16, width=16, generator=generator,
                          prompt_schedule=[(0, RED), (2, BLUE)])  # fmt: skip
    np.testing.assert_array_equal(_read(out), _read(expected))


def test_cut_at_gives_the_pipelines_scene_cuts(model_dir, tmp_path):
    """`--cut-at FRAME:TEXT` is a `prompt_schedule` switch named in `scene_cuts`; the same switch by `--prompt-at`
    makes another video."""
    relative = ["--position-mode", "relative", "--seconds", "1", "--prompt", RED]
    cut, switch = tmp_path / "cut.mp4", tmp_path / "switch.mp4"
    assert _generate(model_dir, cut, *relative, "--cut-at", f"4:{BLUE}") == 0
    assert _generate(model_dir, switch, *relative, "--prompt-at", f"4:{BLUE}") == 0
    expected = tmp_path / "expected.mp4"
    pipe = KreaRealtimeVideoPipeline.from_pretrained(model_dir)
    pipe.generate_to_file(expected, RED, fps=8, num_frames=8, height=16, width=16, position_mode="relative",
                          generator=torch.Generator().manual_seed(0), prompt_schedule=[(4, BLUE)], scene_cuts=[4])  # fmt: skip
    np.testing.assert_array_equal(_read(cut), _read(expected))
    assert np.array_equal(_read(cut)[:4], _read(switch)[:4]) and not np.array_equal(_read(cut), _read(switch))


def test_story_writes_the_librarys_scenes_cuts_and_subtitles(model_dir, tmp_path, capsys):
    """`--story` is `parse_story(...).arguments(...)` for the stream, its length the story's, its subtitles drawn on
    their scenes' frames; the same story without subtitles is the plain library video."""
    story = f"{RED}[0.5s#] | {BLUE}[0.5s] ; Red | Blue"
    out, plain = tmp_path / "story.mp4", tmp_path / "plain.mp4"
    assert _generate(model_dir, out, "--position-mode", "relative", "--story", story, "--quality", "10") == 0
    assert "Generating 8 frames" in capsys.readouterr().out  # 1 s at 8 fps: the story's length
    assert _generate(model_dir, plain, "--position-mode", "relative", "--story", story.split(";")[0]) == 0

    pipe = KreaRealtimeVideoPipeline.from_pretrained(model_dir)
    parsed = parse_story(story)
    call = parsed.arguments(pipe, 8, height=16, width=16, position_mode="relative")
    assert call["prompt_schedule"] == [(0, RED), (4, BLUE)] and call["scene_cuts"] == [4]
    expected, expected_plain = tmp_path / "expected.mp4", tmp_path / "expected_plain.mp4"
    stream = pipe.stream(generator=torch.Generator().manual_seed(0), **call)
    write_video(stream, expected, 8, quality=10, overlay=subtitle_overlay(parsed.subtitle_spans(8)))
    np.testing.assert_array_equal(_read(out), _read(expected))
    pipe.generate_to_file(expected_plain, fps=8, generator=torch.Generator().manual_seed(0), **call)
    np.testing.assert_array_equal(_read(plain), _read(expected_plain))
    assert not np.array_equal(_read(out), _read(plain))  # the subtitles are in the frames


def test_default_model_is_used_without_model_argument(model_dir, tmp_path, monkeypatch, capsys):
    default = shutil.copytree(model_dir, tmp_path / "default")
    index = json.loads((default / "model_index.json").read_text())
    (default / "model_index.json").write_text(json.dumps({**index, "height": 16, "width": 16}))
    monkeypatch.setattr(rolldiff.defaults, "default_model_path", lambda: default)
    out = tmp_path / "default.mp4"
    assert main(["generate", "--prompt", RED, "--seconds", "0.25", "--out", str(out)]) == 0  # 16 fps: 4 frames
    assert _read(out).shape == (4, 16, 16, 3)  # the default's native size, from its model_index.json
    assert "16x16" in capsys.readouterr().out


def test_native_size_comes_from_the_pipeline_config_else_480x832(model_dir, tmp_path):
    assert native_size(KreaRealtimeVideoPipeline.from_pretrained(model_dir)) == (480, 832)  # nothing stored
    sized = shutil.copytree(model_dir, tmp_path / "sized")
    index = json.loads((sized / "model_index.json").read_text())
    (sized / "model_index.json").write_text(json.dumps({**index, "height": 16, "width": 32}))
    assert native_size(KreaRealtimeVideoPipeline.from_pretrained(sized)) == (16, 32)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", RED, "--dtype", "float8"], "invalid choice: 'float8'"),
        (["--prompt", RED, "--prompt-at", "four:a cat"], "expected FRAME:TEXT"),
        (["--prompt", RED, "--prompt-at", "8"], "expected FRAME:TEXT"),
        (["--prompt", RED, "--prompt-at", "100:a cat"], "frame 100 is out of range"),
        (["--prompt", RED, "--height", "20"], "--height (`height`) must be a positive multiple of 8"),
        (["--prompt", RED, "--seconds", "-1"], "--seconds: expected a finite float > 0"),
        (["--prompt", RED, "--steps", "1000,fast"], "expected comma-separated integers"),
        (["--prompt", RED, "--steps", "250,500"], "strictly decreasing"),
        (["--prompt", RED, "--position-mode", "sideways"], "--position-mode (`position_mode`) must be one of"),
        (["--prompt", RED, "--context-policy", "clean"], "--context-policy (`context_policy`) must be one of"),
        (["--seconds", "1"], "Either --prompt (`prompt`) or --prompt-at (`prompt_schedule`) is required"),
        (["--prompt", RED, "--out", "video.gif"], "--out (`path`) must end in .mp4"),
        (["--prompt", RED, "--quality", "11"], "--quality: expected a number from 1 to 10, got '11'"),
        (["--prompt", RED, "--quality", "best"], "--quality: expected a number from 1 to 10"),
        (
            ["--story", f"{RED}[1s]", "--prompt", RED],
            "--story (`story`) holds the prompts, their switches and cuts; drop --prompt (`prompt`).",
        ),
        (["--story", f"{RED}[1s]", "--cut-at", f"2:{BLUE}"], "drop --cut-at (`scene_cuts`)."),
        (["--story", f"{RED}[2 sec]"], "--story (`story`) scene 1: '[2 sec]' is not its length"),
        (["--story", f"{RED}[1s] | {BLUE}"], "--story (`prompt_schedule`) frame 16 is out of range"),  # past --seconds
    ],
)
def test_bad_arguments_exit_2_with_one_line_on_stderr(model_dir, tmp_path, capsys, args, message):
    argv = ["generate", "--model", str(model_dir), "--out", str(tmp_path / "v.mp4"), "--seconds", "0.25", *SIZE, *args]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert message in captured.err, captured.err
    assert captured.err.startswith("rolldiff: error:") and captured.err.count("\n") == 1
    assert "Traceback" not in captured.err + captured.out
    assert not (tmp_path / "v.mp4").exists()


@pytest.mark.parametrize("model", ["/no/such/pipeline", "not a hub id!", ".", "rolldiff-test/no-such-pipeline"])
def test_missing_model_exits_2(tmp_path, capsys, monkeypatch, model):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # no network in tests: the Hub id fails fast
    assert main(["generate", "--model", model, "--prompt", RED, "--out", str(tmp_path / "v.mp4")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rolldiff: error: --model") and err.count("\n") == 1


def test_missing_embedded_default_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(rolldiff.defaults, "default_model_path", lambda: tmp_path / "absent")
    assert main(["generate", "--prompt", RED, "--out", str(tmp_path / "v.mp4")]) == 2
    assert "embedded default model is missing" in capsys.readouterr().err


def test_demo_command_serves_on_localhost_by_default(model_dir, monkeypatch):
    import gradio as gr

    launched = {}
    monkeypatch.setattr(rolldiff.defaults, "default_model_path", lambda: model_dir)
    monkeypatch.setattr(gr.Blocks, "launch", lambda self, **kwargs: launched.update(kwargs))
    assert main(["demo", "--port", "7861"]) == 0
    assert launched == {"server_name": "127.0.0.1", "server_port": 7861}


def test_demo_command_with_a_missing_model_exits_2(capsys):
    assert main(["demo", "--model", "/no/such/pipeline"]) == 2
    assert capsys.readouterr().err.startswith("rolldiff: error: --model")


def test_help_exits_0(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--help"])
    assert exit_info.value.code == 0 and "--prompt-at FRAME:TEXT" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["generate", "serve", "convert"])
def test_help_names_each_recipe_whole(command, capsys):
    """`--recipe NAME` in the usage line, and the names in its help, none broken at a hyphen across two lines."""
    from rolldiff.recipes import list_recipes

    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    words = out.replace(",", " ").replace(":", " ").split()
    assert "[--recipe NAME]" in " ".join(out.split()) and "{causal-forcing," not in out
    assert [name for name in list_recipes() if name not in words] == []


def test_every_example_in_the_help_is_a_command_line_the_parser_takes(capsys):
    """The examples `--help` ends with (generate, serve, convert) use flags that exist, with values they take."""
    import shlex

    from rolldiff.cli import build_parser

    parser, examples = build_parser(), []
    for command in ("generate", "serve", "convert"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        help_text = capsys.readouterr().out
        # a comment follows " # " (a story marks its cuts with "#" inside its text)
        examples += [line.partition(" # ")[0] for line in help_text.splitlines() if line.startswith("  rolldiff ")]
    assert len(examples) == 13, examples
    for line in examples:
        args = parser.parse_args(shlex.split(line)[1:])
        assert callable(args.run), line


def test_long_video_example_parses_help(capsys):
    path = Path(__file__).parents[1] / "examples" / "long_video.py"
    spec = importlib.util.spec_from_file_location("long_video", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    for argv in ([], ["--help"]):
        with pytest.raises(SystemExit) as exit_info:
            example.main(argv)
        assert exit_info.value.code == 0 and "--minutes" in capsys.readouterr().out


def test_version_and_usage_without_arguments(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"rolldiff {rolldiff.__version__}"
    assert main([]) == 2
    out = capsys.readouterr().out
    assert out.startswith("usage: rolldiff") and "generate" in out and "demo" in out


# Run in a fresh interpreter (this one has imported torch long ago): what answering each command line imported.
_IMPORTED_BY = """
import sys
from rolldiff.cli import main
argv = sys.argv[1:]
try:
    code = main(argv)
except SystemExit as exit:
    code = exit.code
print(code, sorted({name.split(".")[0] for name in sys.modules} & {"torch", "diffusers", "transformers", "numpy"}))
"""


@pytest.mark.parametrize(
    "argv, code",
    [
        (["--version"], 0),
        ([], 2),
        (["generate", "--help"], 0),
        (["serve", "--help"], 0),
        (["demo", "--help"], 0),
        (["convert", "--help"], 0),
        (["generate", "--seconds", "x"], 2),
        (["generate", "--dtype", "float64"], 2),
        (["serve", "--workers", "0"], 2),
        (["genrate"], 2),
        (["generate", "--offload", "blocks", "--cuda-graphs"], 2),
        (["generate", "--lora", "style.safetensors"], 2),
        (["generate", "--pipeline-parallel", "2", "--fp8-storage"], 2),
        (["serve", "--fp8"], 2),  # not an abbreviation of --fp8-storage: a flag of generate's only
        (["serve", "--host", "0.0.0.0"], 2),
        (["serve", "--state-every", "2"], 2),
    ],
)
def test_help_version_and_a_mistyped_flag_answer_without_loading_torch(argv, code):
    """The parser imports nothing heavy (torch, diffusers: 5 s on a laptop): a command's run imports them, once the
    flags alone (a combination, a missing LoRA file) allow a run."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _IMPORTED_BY, *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == f"{code} []", (done.stdout, done.stderr[-500:])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--sec", "3"], "unrecognized argument --sec: did you mean --seconds?"),  # not abbreviated
        (["generate", "--kv-offlaod"], "unrecognized argument --kv-offlaod: did you mean --kv-offload?"),
        (["generate", "--kv", "int8"], "did you mean --kv-offload or --kv-quantization?"),
        (["serve", "--fp8"], "unrecognized argument --fp8: did you mean --fp8-storage?"),  # generate's only
        (["generate", "--offlod=model"], "unrecognized argument --offlod: did you mean --offload?"),
        (["generate", "--zzz"], "unrecognized arguments: --zzz"),
    ],
)
def test_a_mistyped_or_shortened_flag_is_refused_naming_the_flag_meant(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("rolldiff: error: ") and message in err and err.count("\n") == 1, err


def test_import_rolldiff_loads_its_classes_when_first_used():
    """`import rolldiff` is light (PEP 562); each public name, and the subpackages `import rolldiff` gave before,
    resolve on first use to the class its module defines."""
    import subprocess
    import sys

    code = """
import sys, rolldiff
before = "torch" in sys.modules
names = [name for name in rolldiff.__all__ if getattr(rolldiff, name).__name__ == name]
print(before, len(names) == len(rolldiff.__all__), set(rolldiff.__all__) <= set(dir(rolldiff)))
print(rolldiff.caching.RollingKVCache is rolldiff.RollingKVCache, hasattr(rolldiff, "NoSuchName"))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "True", "True", "True", "False"], done.stdout


def test_interrupted_run_keeps_the_old_video_and_the_frames_made(model_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "v.mp4"
    assert _generate(model_dir, out, "--prompt", RED, "--seconds", "0.25") == 0  # 2 frames: the finished video
    before = out.read_bytes()
    real_write = StreamingVideoWriter.write

    def write_then_interrupt(self, frames):
        real_write(self, frames)
        if self.frames_written >= 4:  # Ctrl-C after the second chunk's frames
            raise KeyboardInterrupt

    monkeypatch.setattr(StreamingVideoWriter, "write", write_then_interrupt)
    assert _generate(model_dir, out, "--prompt", BLUE, "--seconds", "1") == 130
    err = capsys.readouterr().err
    partial = tmp_path / "v.partial.mp4"
    assert f"the 4 frames made are kept in {partial}" in err and "was not touched" in err
    assert out.read_bytes() == before
    assert _read(partial).shape == (4, 16, 16, 3)
    assert "--resume to continue from frame 2" in err  # the state saved after the first chunk
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.mp4", "v.partial.mp4", "v.resume.safetensors"]


def test_unknown_words_are_reported_one_line_each(model_dir, tmp_path, capsys):
    assert (
        _generate(model_dir, tmp_path / "v.mp4", "--prompt", "a red circle moving left quickly", "--seconds", "0.25")
        == 0
    )
    err = capsys.readouterr().err
    assert "rolldiff: warning: `prompt` 'a red circle moving left quickly'" in err and "'quickly'" in err


def test_a_misspelled_model_name_lists_the_embedded_models(monkeypatch):
    """Not a folder and not found as a Hub id: the error names the embedded models the user probably meant."""
    from diffusers import DiffusionPipeline

    from rolldiff.defaults import ModelNotFoundError, pipeline_class

    def offline(*args, **kwargs):
        raise OSError("not on the Hub")  # what load_config raises for an unknown id (no network in tests)

    monkeypatch.setattr(DiffusionPipeline, "load_config", offline)
    with pytest.raises(
        ModelNotFoundError, match=r"embedded model \(tiny-bouncing-shapes, tiny-bouncing-shapes-sana\)"
    ):
        pipeline_class("tiny-bouncing-shapes-sanaa")


def test_a_window_longer_than_the_video_runs_under_a_6_gb_address_space(tmp_path):
    """Measured on the old main: `--window-frames 100000` asked for 921 MB at 32x32 and died with a traceback
    under this limit. The cache is now sized to what the video can fill."""
    import resource
    import subprocess
    import sys

    def limit_address_space():
        resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))

    out = tmp_path / "video.mp4"
    command = [sys.executable, "-m", "rolldiff", "generate", "--prompt", "a red circle moving left"]
    command += ["--seconds", "1", "--window-frames", "100000", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, preexec_fn=limit_address_space)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and out.exists()


def test_context_policy_flag_reaches_the_stream(model_dir, tmp_path):
    """`--context-policy last_step --denoising pipelined` is that call's video (the leaving chunk's writes
    committed, no clean pass)."""
    out = tmp_path / "last_step.mp4"
    flags = ["--context-policy", "last_step", "--denoising", "pipelined", "--window-frames", "all"]
    assert _generate(model_dir, out, "--prompt", RED, *flags, "--seconds", "1") == 0
    rolling = tmp_path / "rolling.mp4"
    assert _generate(model_dir, rolling, "--prompt", RED, *flags[2:], "--seconds", "1") == 0
    assert not np.array_equal(_read(out), _read(rolling))  # the flag changed the video
    pipe = KreaRealtimeVideoPipeline.from_pretrained(model_dir)
    expected = tmp_path / "expected.mp4"
    pipe.generate_to_file(expected, RED, fps=8, num_frames=len(_read(out)), height=16, width=16,
                          generator=torch.Generator().manual_seed(0), context_policy="last_step",
                          denoising="pipelined", window_frames="all")  # fmt: skip
    np.testing.assert_array_equal(_read(out), _read(expected))

"""The bad-input table: every entry point refuses a bad argument with an error that names it, before any work.

Each row is one bad input a new user could type. For each we assert the error type, that the message names the
argument, that it is raised before work (the command-line checks before the model loads; the pipeline before
its text encoder, transformer or VAE runs; the loader before any weight is read into a model), and that files
already on disk are untouched.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from checkpoint_layouts import wan_to_original
from diffusers import AutoencoderKLWan
from serve_helpers import free_port
from tiny_components import tiny_pipeline, tiny_transformer

import rolldiff.cli.loading
from rolldiff import KreaRealtimeTransformer3DModel, KreaRealtimeVideoPipeline
from rolldiff.cli import main
from rolldiff.defaults import ModelNotFoundError, load_pipeline
from rolldiff.models.wan_conversion import (
    convert_original_wan_state_dict,
    infer_wan_config,
    load_original_wan_checkpoint,
)
from rolldiff.models.weights import StrictWeightsMixin, WeightsMismatchError, check_weights_match_config
from rolldiff.pipelines.io.video_writer import StreamingVideoWriter
from rolldiff.pipelines.request.text_encoding import PromptWarning, check_max_sequence_length

RED = "a red circle moving left"
SIZE = ["--height", "16", "--width", "16"]


# ---------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-pipeline")
    tiny_pipeline().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def pipe() -> KreaRealtimeVideoPipeline:
    return tiny_pipeline()


@pytest.fixture
def work_counter(pipe):
    """Counts forward calls of the text encoder, transformer and VAE: "before work" means all stay 0."""
    calls = {"text_encoder": 0, "transformer": 0, "vae": 0}
    handles = []
    for name in calls:
        module = getattr(pipe, name)

        def count(*_, name=name):
            calls[name] += 1

        handles.append(module.register_forward_pre_hook(count))
        if name == "vae":  # decoding goes through the decoder, not the VAE's forward
            handles.append(module.decoder.register_forward_pre_hook(count))
    yield calls
    for handle in handles:
        handle.remove()


@pytest.fixture
def existing_video(tmp_path) -> Path:
    """A finished video that no failed call may touch."""
    path = tmp_path / "existing.mp4"
    with StreamingVideoWriter(path, fps=8) as writer:
        writer.write(np.zeros((2, 16, 16, 3), dtype=np.uint8))
    return path


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


# ---------------------------------------------------------------------------------------- the command line
# (argv after `generate --model M --out OUT --seconds 0.25 --height 16 --width 16`, the argument named)
CLI_BEFORE_LOAD = {
    "seconds-inf": (["--prompt", RED, "--seconds", "inf"], "--seconds"),
    "seconds-nan": (["--prompt", RED, "--seconds", "nan"], "--seconds"),
    "seconds-1e9": (["--prompt", RED, "--seconds", "1e9"], "--seconds"),
    "seconds-negative": (["--prompt", RED, "--seconds", "-1"], "--seconds"),
    "seconds-zero": (["--prompt", RED, "--seconds", "0"], "--seconds"),
    "seconds-text": (["--prompt", RED, "--seconds", "ten"], "--seconds"),
    "fps-zero": (["--prompt", RED, "--fps", "0"], "--fps"),
    "fps-huge": (["--prompt", RED, "--fps", "100000"], "--fps"),
    "fps-fraction": (["--prompt", RED, "--fps", "2.5"], "--fps"),
    "seed-negative": (["--prompt", RED, "--seed", "-1"], "--seed"),
    "seed-too-big": (["--prompt", RED, "--seed", str(2**64)], "--seed"),
    "device-meta": (["--prompt", RED, "--device", "meta"], "--device"),
    "device-unknown": (["--prompt", RED, "--device", "gpu0"], "--device"),
    "device-missing-gpu": (["--prompt", RED, "--device", "cuda:99"], "--device"),
    "dtype-float8": (["--prompt", RED, "--dtype", "float8"], "--dtype"),
    "prompt-at-word-frame": (["--prompt", RED, "--prompt-at", "four:a cat"], "--prompt-at"),
    "prompt-at-no-text": (["--prompt", RED, "--prompt-at", "8"], "--prompt-at"),
    "no-prompt": (["--seconds", "1"], "--prompt"),
    "height-negative": (["--prompt", RED, "--height", "-16"], "--height"),
    "chunk-frames-zero": (["--prompt", RED, "--chunk-frames", "0"], "--chunk-frames"),
    "steps-words": (["--prompt", RED, "--steps", "1000,fast"], "--steps"),
    "window-frames-zero": (["--prompt", RED, "--window-frames", "0"], "--window-frames"),
}


def _cli(model_dir, out, extra) -> list[str]:
    return ["generate", "--model", str(model_dir), "--out", str(out), "--seconds", "0.25", *SIZE, *extra]


def _assert_one_line(captured, names: str) -> None:
    assert captured.err.startswith("rolldiff: error:") and captured.err.count("\n") == 1, captured.err
    assert names in captured.err, captured.err
    assert "Traceback" not in captured.err + captured.out


@pytest.fixture
def no_model_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(rolldiff.cli.loading, "load_pipeline", refuse)


@pytest.mark.parametrize("argv, names", CLI_BEFORE_LOAD.values(), ids=CLI_BEFORE_LOAD.keys())
def test_cli_refuses_before_the_model_loads(model_dir, existing_video, no_model_loading, capsys, argv, names):
    before = _files(existing_video.parent)
    assert main(_cli(model_dir, existing_video, argv)) == 2
    _assert_one_line(capsys.readouterr(), names)
    assert _files(existing_video.parent) == before


CLI_OUT = {
    "out-folder": (lambda tmp: tmp, "is a folder"),
    "out-missing-folder": (lambda tmp: tmp / "missing" / "v.mp4", "does not exist"),
    "out-unwritable": (lambda tmp: Path("/proc/v.mp4"), "is not writable"),
    "out-gif": (lambda tmp: tmp / "v.gif", "must end in .mp4"),
}


@pytest.mark.parametrize("make_out, message", CLI_OUT.values(), ids=CLI_OUT.keys())
def test_cli_refuses_an_unwritable_out_before_the_model_loads(
    model_dir, tmp_path, no_model_loading, capsys, make_out, message
):
    before = _files(tmp_path)
    assert main(_cli(model_dir, make_out(tmp_path), ["--prompt", RED])) == 2
    captured = capsys.readouterr()
    _assert_one_line(captured, "--out")
    assert message in captured.err
    assert _files(tmp_path) == before


CLI_DEMO = {
    "port-70000": (["--port", "70000"], "--port"),
    "port-zero": (["--port", "0"], "--port"),
    "port-text": (["--port", "http"], "--port"),
    "host-999": (["--host", "999.1.1.1"], "--host"),
    "host-junk": (["--host", "not a host!"], "--host"),
    "max-concurrency-zero": (["--max-concurrency", "0"], "--max-concurrency"),
}


@pytest.mark.parametrize("argv, names", CLI_DEMO.values(), ids=CLI_DEMO.keys())
def test_demo_command_refuses_before_the_model_loads(monkeypatch, capsys, argv, names):
    monkeypatch.setattr("rolldiff.demo.build_demo", lambda *a, **k: pytest.fail("the demo was built"), raising=False)
    assert main(["demo", *argv]) == 2
    _assert_one_line(capsys.readouterr(), names)


@pytest.mark.parametrize(
    "argv, absent, said, install",
    [
        (["demo"], {"gradio"}, "the demo needs Gradio, which is not installed", "pip install 'rolldiff[demo]'"),
        (["serve"], {"uvicorn"}, "serving needs uvicorn, which is not installed", "pip install 'rolldiff[serve]'"),
        (["serve"], {"fastapi", "websockets"}, "serving needs fastapi, websockets, which are not installed",
         "pip install 'rolldiff[serve]'"),
        (["serve", "--ray", "--device", "cpu"], {"ray"}, "--ray needs Ray Serve, which is not installed",
         'pip install "rolldiff[ray]"'),
    ],
    ids=["demo", "serve-one", "serve-two", "ray"],
)  # fmt: skip
def test_a_command_without_its_extra_names_what_is_missing_and_how_to_install_it(
    monkeypatch, capsys, argv, absent, said, install
):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in absent else real_find_spec(name, *a)
    )
    assert main([*argv, "--port", str(free_port())]) == 2
    captured = capsys.readouterr()
    _assert_one_line(captured, said)
    assert install in captured.err


def test_demo_command_on_a_busy_port_is_refused_before_the_model_loads(monkeypatch, capsys):
    import socket

    monkeypatch.setattr("rolldiff.demo.build_demo", lambda *a, **k: pytest.fail("the demo was built"), raising=False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["demo", "--port", str(port)]) == 2
    _assert_one_line(capsys.readouterr(), "--port")


CLI_AFTER_LOAD = {
    "height-not-multiple": (["--prompt", RED, "--height", "20"], "height"),
    "steps-increasing": (["--prompt", RED, "--steps", "250,500"], "denoising_steps"),
    "position-mode": (["--prompt", RED, "--position-mode", "sideways"], "position_mode"),
    "past-the-rope-table": (  # 20 s at 16 fps, 320 latent frames, where the tiny table has 64
        ["--prompt", RED, "--seconds", "20", "--position-mode", "absolute"],
        "--seconds (`num_frames`) is 320 latent frames, more than the RoPE table's 64 positions with --position-mode",
    ),
    "height-past-the-rope-table": (  # the tiny table has 64 rows: 512 pixels at 4 x 2 pixels a position
        ["--prompt", RED, "--height", "1200"],
        "--height (`height`)=1200 is 150 patch positions, more than the RoPE table's 64: make it at most 512 pixels.",
    ),
    "prompt-at-past-end": (["--prompt", RED, "--prompt-at", "100:a blue square moving up"], "prompt_schedule"),
    # Both flags build one schedule: its refusal names the flag that gave the frame, never the other one.
    "cut-at-past-end": (["--prompt", RED, "--cut-at", "100:a blue square"], "--cut-at (`prompt_schedule`) frame 100"),
    "cut-at-past-end-beside-a-switch": (
        ["--prompt", RED, "--seconds", "1", "--prompt-at", "4:a blue square", "--cut-at", "100:a red circle"],
        "--cut-at (`prompt_schedule`) frame 100",
    ),
    "prompt-at-past-end-beside-a-cut": (
        ["--prompt", RED, "--seconds", "1", "--prompt-at", "100:a blue square", "--cut-at", "4:a red circle"],
        "--prompt-at (`prompt_schedule`) frame 100",
    ),
    "cut-at-absolute-positions": (  # the tiny model's positions are absolute: keys stored after RoPE cannot be cut
        ["--prompt", RED, "--cut-at", "2:a blue square moving up", "--position-mode", "absolute"],
        "--cut-at (`scene_cuts`) places a cut chunk",
    ),
    "missing-model": (["--prompt", RED, "--model", "/no/such/pipeline"], "--model"),
    "prompt-no-known-word": (["--prompt", "un cercle rouge"], "prompt"),
    "state-every-negative": (["--prompt", RED, "--state-every", "-1"], "--state-every"),
}


@pytest.mark.parametrize("argv, names", CLI_AFTER_LOAD.values(), ids=CLI_AFTER_LOAD.keys())
def test_cli_refuses_before_generating(model_dir, existing_video, capsys, argv, names):
    before = _files(existing_video.parent)
    assert main(_cli(model_dir, existing_video, argv)) == 2
    _assert_one_line(capsys.readouterr(), names)
    assert _files(existing_video.parent) == before


# ---------------------------------------------------------------------------------------- the loader
def _saved_transformer(folder: Path, **config_changes) -> Path:
    """A 4-layer tiny transformer saved to `folder`, then its config.json edited as a wrong download would be."""
    tiny_transformer(num_layers=4).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **config_changes}))
    return folder


LOADER_FOLDERS = {
    "config-2-layers-weights-4": ({"num_layers": 2}, "blocks.2."),
    "config-6-layers-weights-4": ({"num_layers": 6}, "blocks.4."),
    "config-other-ffn-width": ({"ffn_dim": 48}, "ffn.net.0.proj.weight"),
}


@pytest.mark.parametrize("changes, named_key", LOADER_FOLDERS.values(), ids=LOADER_FOLDERS.keys())
def test_loader_refuses_weights_that_do_not_match_the_config(tmp_path, changes, named_key):
    folder = _saved_transformer(tmp_path / "transformer", **changes)
    before = _files(folder)
    with pytest.raises(WeightsMismatchError, match="do not match its config.json") as raised:
        check_weights_match_config(KreaRealtimeTransformer3DModel, folder)
    assert named_key in str(raised.value)
    assert _files(folder) == before


def test_pipeline_loader_refuses_a_transformer_that_does_not_match_its_config(model_dir, tmp_path):
    folder = shutil.copytree(model_dir, tmp_path / "pipeline")
    _saved_transformer(folder / "transformer", num_layers=2)
    with pytest.raises(ValueError, match=r"blocks\.2\."):
        load_pipeline(folder, device="cpu", dtype="float32")


@pytest.mark.parametrize("source", ["./no-such-pipeline", "models/wan/no-such-pipeline", "~/no-such-pipeline"])
def test_from_pretrained_on_a_missing_folder_says_no_such_folder_not_a_repo_id_rule(source):
    """diffusers takes any string that is not a folder for a Hub id ("Repo id must be in the form ...")."""
    with pytest.raises(FileNotFoundError, match=rf"from_pretrained: no such folder '{re.escape(source)}'"):
        KreaRealtimeVideoPipeline.from_pretrained(source)


def test_from_pretrained_on_a_checkpoint_file_points_to_from_original(tmp_path):
    checkpoint = tmp_path / "self_forcing_dmd.pt"
    checkpoint.write_bytes(b"not read")
    with pytest.raises(
        FileNotFoundError, match=r"is a file; it takes a pipeline folder .*\.from_original\(checkpoint"
    ):
        KreaRealtimeVideoPipeline.from_pretrained(checkpoint)
    assert checkpoint.read_bytes() == b"not read"


def test_strict_mixin_makes_the_model_loader_refuse_too(tmp_path):
    StrictTransformer = KreaRealtimeTransformer3DModel  # the mixin is among its bases
    assert issubclass(StrictTransformer, StrictWeightsMixin)

    folder = _saved_transformer(tmp_path / "transformer", num_layers=2)
    with pytest.raises(WeightsMismatchError, match=r"no place for \(in blocks \[2, 3\]\)"):
        StrictTransformer.from_pretrained(tmp_path, subfolder="transformer")
    json.loads((folder / "config.json").read_text())  # the folder is left as it was
    good = tmp_path / "good"
    tiny_transformer().save_pretrained(good)
    assert StrictTransformer.from_pretrained(good).config.num_layers == 2


def test_matching_weights_pass_the_check(model_dir):
    check_weights_match_config(KreaRealtimeTransformer3DModel, model_dir / "transformer")
    check_weights_match_config(AutoencoderKLWan, model_dir / "vae")


def _original_state_dict() -> dict[str, torch.Tensor]:
    """A tiny original-format (Self-Forcing-style) Wan state dict."""
    return wan_to_original(tiny_transformer().state_dict())


def _pickled_object(tmp_path) -> Path:
    path = tmp_path / "ckpt.pt"
    torch.save({"generator": _original_state_dict(), "config": Path("train.yaml")}, path)
    return path


LOADER_CALLS: dict[str, tuple[Callable, str]] = {
    "convert-not-a-mapping": (lambda tmp: convert_original_wan_state_dict([1, 2]), "state_dict"),
    "convert-not-wan": (lambda tmp: convert_original_wan_state_dict({"w": torch.zeros(1)}), "patch_embedding.weight"),
    "convert-non-tensor": (
        lambda tmp: convert_original_wan_state_dict({**_original_state_dict(), "step": 3}),
        "'step'",
    ),
    "convert-unknown-key": (
        lambda tmp: convert_original_wan_state_dict(
            {**_original_state_dict(), "blocks.0.extra.weight": torch.zeros(1)}
        ),
        "blocks.0.extra.weight",
    ),
    "convert-lora": (
        lambda tmp: convert_original_wan_state_dict(
            {**_original_state_dict(), "blocks.0.self_attn.q.lora_A.weight": torch.zeros(1)}
        ),
        "lora_A",
    ),
    "convert-ema-only-use-ema-false": (
        lambda tmp: convert_original_wan_state_dict({"generator_ema": _original_state_dict()}, use_ema=False),
        "use_ema",
    ),
    "load-unknown-suffix": (lambda tmp: load_original_wan_checkpoint(tmp / "weights.ckpt"), "suffix"),
    "load-missing-file": (lambda tmp: load_original_wan_checkpoint(tmp / "missing.safetensors"), "`path`"),
    "convert-use-ema-text": (
        lambda tmp: convert_original_wan_state_dict(_original_state_dict(), use_ema="yes"),
        "`use_ema`",
    ),
    "infer-head-dim-zero": (
        lambda tmp: infer_wan_config(_original_state_dict(), attention_head_dim=0),
        "`attention_head_dim`",
    ),
    "load-pickled-objects": (lambda tmp: load_original_wan_checkpoint(_pickled_object(tmp)), "ckpt.pt"),
    "infer-head-dim": (
        lambda tmp: infer_wan_config(_original_state_dict(), attention_head_dim=7),
        "attention_head_dim",
    ),
    "load-pipeline-not-a-folder-of-a-pipeline": (
        lambda tmp: load_pipeline(tmp, device="cpu", dtype="float32"),
        "--model",
    ),
}


@pytest.mark.parametrize("call, names", LOADER_CALLS.values(), ids=LOADER_CALLS.keys())
def test_loader_refuses_bad_checkpoints_by_name(tmp_path, call, names):
    with pytest.raises(ValueError) as raised:
        call(tmp_path)
    assert names in str(raised.value)


def test_loader_errors_are_value_errors_with_a_named_subclass_for_missing_models(tmp_path):
    with pytest.raises(ModelNotFoundError):
        load_pipeline(tmp_path, device="cpu", dtype="float32")


# ---------------------------------------------------------------------------------------- writer and prompt text
WRITER_CALLS = {
    "fps-nan": (lambda tmp: StreamingVideoWriter(tmp / "v.mp4", fps=math.nan), "fps"),
    "fps-inf": (lambda tmp: StreamingVideoWriter(tmp / "v.mp4", fps=math.inf), "fps"),
    "quality-11": (lambda tmp: StreamingVideoWriter(tmp / "v.mp4", fps=8, quality=11), "quality"),
    "path-folder": (lambda tmp: StreamingVideoWriter(tmp, fps=8), "path"),
    "continue-from-missing": (
        lambda tmp: StreamingVideoWriter(tmp / "v.mp4", fps=8, continue_from=tmp / "none.mp4"),
        "continue_from",
    ),
    "max-sequence-length-huge": (lambda tmp: check_max_sequence_length(10**6), "max_sequence_length"),
    "max-sequence-length-zero": (lambda tmp: check_max_sequence_length(0), "max_sequence_length"),
    "max-sequence-length-text": (lambda tmp: check_max_sequence_length("8"), "max_sequence_length"),
}


@pytest.mark.parametrize("call, names", WRITER_CALLS.values(), ids=WRITER_CALLS.keys())
def test_writer_and_text_settings_are_refused_by_name(existing_video, call, names):
    before = _files(existing_video.parent)
    with pytest.raises(ValueError) as raised:
        call(existing_video.parent)
    assert f"`{names}`" in str(raised.value)
    assert _files(existing_video.parent) == before


# ---------------------------------------------------------------------------------------- the Python API
@dataclass(frozen=True)
class ApiCase:
    """`pipe.stream(**kwargs)` (or `generate_to_file` when `to_file`) must raise `error` naming `names`."""

    kwargs: dict
    names: str
    error: type[Exception] = ValueError
    to_file: bool = False


BASE = dict(prompt=RED, num_frames=4, height=16, width=16)
API_CASES = {
    "num-frames-unreachable": ApiCase({"num_frames": 5}, "num_frames"),
    "num-frames-zero": ApiCase({"num_frames": 0}, "num_frames"),
    "num-frames-bool": ApiCase({"num_frames": True}, "num_frames"),
    "num-frames-text": ApiCase({"num_frames": "4"}, "num_frames"),
    "height-not-multiple": ApiCase({"height": 20}, "height"),
    "width-zero": ApiCase({"width": 0}, "width"),
    "output-type-gif": ApiCase({"output_type": "gif"}, "output_type"),
    "steps-empty": ApiCase({"denoising_steps": []}, "denoising_steps"),
    "steps-above-1000": ApiCase({"denoising_steps": [2000, 500]}, "denoising_steps"),
    "guidance-below-1": ApiCase({"guidance_scale": 0.5}, "guidance_scale"),
    "attention-bias-zero": ApiCase({"attention_bias": 0.0}, "attention_bias"),
    "position-mode": ApiCase({"position_mode": "sideways"}, "position_mode"),
    "prompt-empty": ApiCase({"prompt": ""}, "prompt"),
    "prompt-number": ApiCase({"prompt": 5}, "prompt"),
    "prompt-missing": ApiCase({"prompt": None}, "prompt"),
    "schedule-empty": ApiCase({"prompt_schedule": []}, "prompt_schedule"),
    "schedule-unordered": ApiCase(
        {"prompt": None, "prompt_schedule": [(0, RED), (2, RED), (1, RED)]}, "prompt_schedule"
    ),
    "schedule-past-end": ApiCase({"prompt_schedule": [(9, RED)]}, "prompt_schedule"),
    "schedule-not-pairs": ApiCase({"prompt_schedule": [RED]}, "prompt_schedule"),
    "negative-prompt-count": ApiCase(
        {"prompt": [RED, RED], "guidance_scale": 2.0, "negative_prompt": ["", "", ""]}, "negative_prompt"
    ),
    "latents-shape": ApiCase({"latents": torch.zeros(1, 4, 2, 2, 2)}, "latents"),
    "callback-inputs": ApiCase(
        {"callback_on_step_end": lambda *a: {}, "callback_on_step_end_tensor_inputs": ["noise"]},
        "callback_on_step_end_tensor_inputs",
    ),
    "guidance-nan": ApiCase({"guidance_scale": float("nan")}, "guidance_scale"),
    "guidance-inf": ApiCase({"guidance_scale": float("inf")}, "guidance_scale"),
    "guidance-text": ApiCase({"guidance_scale": "2"}, "guidance_scale"),
    "attention-bias-nan": ApiCase({"attention_bias": float("nan")}, "attention_bias"),
    "steps-nan": ApiCase({"denoising_steps": [float("nan"), 500]}, "denoising_steps"),
    "to-file-fps-nan": ApiCase({"fps": float("nan")}, "fps", to_file=True),
    "latents-nan": ApiCase({"latents": torch.full((1, 4, 4, 2, 2), float("nan"))}, "latents"),
    "latents-list": ApiCase({"latents": [[0.0]]}, "latents"),
    "generator-int": ApiCase({"generator": 42}, "generator", TypeError),
    "generators-3-for-batch-2": ApiCase(
        {"prompt": [RED, RED], "generator": [torch.Generator() for _ in range(3)]}, "generator"
    ),
    "max-sequence-length-1e6": ApiCase({"max_sequence_length": 10**6}, "max_sequence_length"),
    "max-sequence-length-zero": ApiCase({"max_sequence_length": 0}, "max_sequence_length"),
    "max-sequence-length-text": ApiCase({"max_sequence_length": "8"}, "max_sequence_length"),
    "schedule-frame-text": ApiCase({"prompt_schedule": [("2", RED)]}, "prompt_schedule"),
    "schedule-frame-float": ApiCase({"prompt_schedule": [(2.0, RED)]}, "prompt_schedule"),
    "schedule-after-last-chunk-start": ApiCase({"prompt_schedule": [(3, RED)]}, "prompt_schedule"),
    "prompt-no-known-word": ApiCase({"prompt": "un cercle rouge"}, "prompt"),
    "prompt-non-ascii": ApiCase({"prompt": "一个红色的圆向左移动"}, "prompt"),
    "prompt-punctuation-only": ApiCase({"prompt": "!!!"}, "prompt"),
    "schedule-prompt-no-known-word": ApiCase({"prompt_schedule": [(2, "zebra")]}, "prompt_schedule"),
    "unknown-cache-option": ApiCase({"window_size": 3}, "window_size", TypeError),
    "to-file-state-every-negative": ApiCase({"state_every_s": -1}, "state_every_s", to_file=True),
    "to-file-quality-zero": ApiCase({"quality": 0}, "quality", to_file=True),
    "to-file-quality-text": ApiCase({"quality": "high"}, "quality", to_file=True),
    "to-file-batch-of-two": ApiCase({"prompt": [RED, RED]}, "prompt", to_file=True),
    "to-file-output-type": ApiCase({"output_type": "pt"}, "output_type", to_file=True),
    "to-file-folder": ApiCase({"path": "."}, "path", to_file=True),
    "to-file-gif": ApiCase({"path": "v.gif"}, "path", to_file=True),
}


@pytest.mark.parametrize("case", API_CASES.values(), ids=API_CASES.keys())
def test_pipeline_refuses_before_any_work(pipe, work_counter, existing_video, monkeypatch, case):
    monkeypatch.chdir(existing_video.parent)
    before = _files(existing_video.parent)
    kwargs = {**BASE, **case.kwargs}
    with pytest.raises(case.error) as raised:
        if case.to_file:
            path = kwargs.pop("path", str(existing_video))
            pipe.generate_to_file(path, **{"fps": 8, **kwargs})
        else:
            next(iter(pipe.stream(**kwargs)))
    assert re.search(f"[`'\"]{case.names}[`'\"]", str(raised.value)), str(raised.value)  # named, quoted
    assert work_counter == {"text_encoder": 0, "transformer": 0, "vae": 0}
    assert _files(existing_video.parent) == before


# ---------------------------------------------------------------------------------------- found during the run
def _to_file_failing_in_chunk(pipe, path: Path, chunk: int, callback_result) -> BaseException:
    """Run `generate_to_file` (3 chunks of 2 frames) with a callback that returns `callback_result(tensors)`
    from the last step of `chunk` on; returns the error raised."""
    steps = len(pipe.config.denoising_steps)

    def callback(pipe_, step, timestep, tensors):
        return callback_result(tensors) if step >= (chunk + 1) * steps - 1 else tensors

    with pytest.raises(Exception) as raised:
        pipe.generate_to_file(path, RED, fps=8, num_frames=6, height=16, width=16, callback_on_step_end=callback)
    return raised.value


@pytest.mark.parametrize(
    "result, error, message",
    [
        (lambda tensors: [tensors["latents"]], TypeError, "`callback_on_step_end` must return a dict"),
        (lambda tensors: {"latents": tensors["latents"][:, :1]}, ValueError, "`callback_on_step_end` returned"),
        (lambda tensors: {"latents": tensors["latents"] * float("nan")}, FloatingPointError, "Chunk 1 produced NaN"),
    ],
    ids=["callback-returns-list", "callback-returns-wrong-shape", "nan-in-chunk-1"],
)
def test_errors_found_during_the_run_keep_the_old_file_and_the_frames_done(
    pipe, existing_video, result, error, message
):
    before = existing_video.read_bytes()
    raised = _to_file_failing_in_chunk(pipe, existing_video, 1, result)
    assert isinstance(raised, error) and message in str(raised), repr(raised)
    partial = existing_video.with_name("existing.partial.mp4")
    assert existing_video.read_bytes() == before
    assert iio.imread(partial, plugin="FFMPEG", index=None).shape[0] == 2  # chunk 0's frames
    assert any(str(partial) in note for note in raised.__notes__)


# ---------------------------------------------------------------------------------------- prompts read in part
def test_unknown_words_and_truncation_are_warned_about_by_name(pipe, work_counter):
    with pytest.warns(PromptWarning) as caught:
        pipe.stream("a red circle moving left quickly and very smoothly", num_frames=4, height=16, width=16)
    messages = [str(w.message) for w in caught]
    assert any("'quickly'" in m and "'smoothly'" in m for m in messages), messages
    assert any("only the first 8 (`max_sequence_length`)" in m and "'smoothly'" in m for m in messages), messages
    assert work_counter == {"text_encoder": 0, "transformer": 0, "vae": 0}


def test_numpy_integer_schedule_frames_are_accepted(pipe):
    plain = pipe.stream(RED, 6, 16, 16, prompt_schedule=[(2, "a blue square moving up")])
    numpy = pipe.stream(RED, 6, 16, 16, prompt_schedule=[(np.int64(2), "a blue square moving up")])
    assert next(iter(numpy)).shape == next(iter(plain)).shape


def test_embedded_tokenizer_reads_case_and_punctuation_and_keeps_the_known_prompts():
    from transformers import AutoTokenizer

    from rolldiff.defaults import default_model_path
    from rolldiff.training.tiny_components import COLOURS, DIRECTIONS, SHAPES, toy_vocabulary

    tokenizer = AutoTokenizer.from_pretrained(default_model_path() / "tokenizer")
    vocabulary = tokenizer.get_vocab()
    assert set(toy_vocabulary()) <= set(vocabulary)
    for colour in COLOURS:  # every training prompt tokenizes exactly as word lookups + </s>, as before
        for shape in SHAPES:
            for direction in DIRECTIONS:
                prompt = f"a {colour} {shape} moving {direction}"
                expected = [vocabulary[word] for word in prompt.split()] + [tokenizer.eos_token_id]
                assert tokenizer(prompt).input_ids == expected
    plain = tokenizer("a red circle moving left").input_ids
    assert tokenizer("A Red Circle, Moving LEFT.").input_ids == plain
    assert tokenizer("  a réd circle moving left!  ").input_ids == plain

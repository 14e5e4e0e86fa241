"""`rolldiff generate --compile`: the transformer runs compiled (fullgraph) and writes the same video."""

from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from tiny_components import tiny_pipeline

from rolldiff.cli import main

ARGS = ["--height", "16", "--width", "16", "--fps", "8", "--seconds", "1", "--prompt", "a red circle moving left"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-pipeline")
    tiny_pipeline().save_pretrained(folder)
    return folder


def test_compiled_generation_writes_the_same_video(model_dir, tmp_path):
    plain, compiled = tmp_path / "plain.mp4", tmp_path / "compiled.mp4"
    assert main(["generate", "--model", str(model_dir), "--out", str(plain), *ARGS]) == 0
    torch._dynamo.reset()
    try:
        code = main(["generate", "--model", str(model_dir), "--out", str(compiled), "--compile", "eager", *ARGS])
    finally:
        torch._dynamo.reset()
    assert code == 0
    np.testing.assert_array_equal(iio.imread(compiled, plugin="FFMPEG", index=None), iio.imread(plain, index=None))


def test_unknown_compile_backend_is_a_usage_error(model_dir, tmp_path, capsys):
    try:
        code = main(
            ["generate", "--model", str(model_dir), "--out", str(tmp_path / "v.mp4"), "--compile", "nope", *ARGS]
        )
    except SystemExit as exit_info:  # argparse's own exit
        code = exit_info.code
    assert code == 2 and not (tmp_path / "v.mp4").exists()
    assert "--compile" in capsys.readouterr().err


def test_quantized_and_offloaded_kv_flags_generate(model_dir, tmp_path):
    out = tmp_path / "int8.mp4"
    args = ["generate", "--model", str(model_dir), "--out", str(out), "--kv-quantization", "int8", "--kv-offload"]
    assert main([*args, *ARGS]) == 0
    assert iio.imread(out, plugin="FFMPEG", index=None).shape[0] == 8


def test_the_adaptive_sink_recipe_compiles_pipelined_and_is_refused_sequentially(
    model_dir, tmp_path, monkeypatch, capsys
):
    """`--recipe streamdiffusionv2 --denoising pipelined --compile`: the in-flight forwards run the compiled graphs
    (counted), the video is the eager one; sequentially every write decides on the host: a usage error."""
    from torch._dynamo.testing import CompileCounter

    import rolldiff.cli.loading as cli  # where the command compiles the step

    counter, steps = CompileCounter(), []

    def counted(transformer, backend):
        steps.append(cli.compile_cached_step.__wrapped__(transformer, backend=counter))
        return steps[-1]

    counted.__wrapped__ = cli.compile_cached_step
    recipe = ["--recipe", "streamdiffusionv2", *ARGS, "--seconds", "2"]  # the later --seconds wins
    plain, compiled = tmp_path / "plain.mp4", tmp_path / "compiled.mp4"
    assert main(["generate", "--model", str(model_dir), "--out", str(plain), "--denoising", "pipelined", *recipe]) == 0
    monkeypatch.setattr(cli, "compile_cached_step", counted)
    torch._dynamo.reset()
    try:
        pipelined = ["--denoising", "pipelined", "--compile", "eager", *recipe]
        assert main(["generate", "--model", str(model_dir), "--out", str(compiled), *pipelined]) == 0
        graphs = counter.frame_count
        sequential = main(
            ["generate", "--model", str(model_dir), "--out", str(tmp_path / "s.mp4"), "--compile", "eager", *recipe]
        )
    finally:
        torch._dynamo.reset()
    assert graphs == 5 and steps[0].eager_calls == 0  # windows of 2 to 5 frames, then 1; no context pass
    np.testing.assert_array_equal(iio.imread(compiled, plugin="FFMPEG", index=None), iio.imread(plain, index=None))
    assert sequential == 2 and not (tmp_path / "s.mp4").exists()
    assert "compiled only under denoising='pipelined'" in capsys.readouterr().err

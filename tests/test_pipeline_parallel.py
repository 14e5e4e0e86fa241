"""Pipeline parallelism for one stream (`devices=`): real worker processes over gloo on 127.0.0.1.

Specification: a stream split into 2 or 3 stages makes the video one process makes with the same seed, to
`ATOL` (measured: bit-identical on CPU), sequential and pipelined, across a prompt switch; each stage holds its own
blocks' weights and cache layers only; the gathered state is the one-process stream's; nothing is left running;
bad `devices` are refused before any process starts, naming the argument. Models: the embedded tiny Krea-like model
(4 blocks) and random weights of 3 blocks, so with 3 stages every stage holds one block and a stage that is wrong
cannot hide.
"""

from __future__ import annotations

import multiprocessing
import subprocess
import sys

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from parallel_helpers import no_children_left, random_three_block_pipe, seeded

from rolldiff.defaults import load_pipeline
from rolldiff.pipelines.parallel import split_blocks
from rolldiff.pipelines.parallel.launch import parallel_stream
from rolldiff.pipelines.request import VideoCall, build_request

ATOL = 1e-5  # float tolerance of the equality (same process count per op; measured max difference: 0.0)
SIZE = dict(height=16, width=16)
SWITCH = [(0, "a red circle moving left"), (4, "a blue square moving up")]


@pytest.fixture(scope="module")
def random_pipe():
    """Random weights, 3 blocks (one per stage at 3 stages)."""
    return random_three_block_pipe()


@pytest.fixture(scope="module")
def embedded_pipe():
    pipe = load_pipeline(None, device="cpu", dtype="float32")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_blocks_split_into_contiguous_stages_the_first_taking_the_extra_ones():
    assert split_blocks(5, 2) == [range(0, 3), range(3, 5)]
    assert split_blocks(3, 3) == [range(0, 1), range(1, 2), range(2, 3)]
    assert split_blocks(4, 1) == [range(0, 4)]


def test_two_stages_of_the_embedded_model_make_the_one_process_video_across_a_prompt_switch(embedded_pipe):
    call = dict(prompt_schedule=SWITCH, num_frames=embedded_pipe.latent_to_frames(4 * 3), output_type="np")
    alone = embedded_pipe(generator=seeded(), **call).frames
    split = embedded_pipe(generator=seeded(), devices=["cpu", "cpu"], **call).frames
    assert split.shape == alone.shape
    np.testing.assert_allclose(split, alone, atol=ATOL, rtol=0)
    assert len(embedded_pipe.transformer.blocks) == 4  # the caller's pipeline keeps every block
    no_children_left()


@pytest.mark.parametrize("stages, denoising", [(3, "pipelined"), (3, "sequential")])
def test_a_split_stream_makes_the_one_process_latents_with_switch_prompt(random_pipe, stages, denoising):
    """`switch_prompt` mid-video reaches every stage at the same chunk boundary; the re-cache runs on all."""
    call = dict(prompt="a red circle moving left", num_frames=7, output_type="latent", denoising=denoising, **SIZE)

    def run(**extra):
        stream = random_pipe.stream(generator=seeded(), **call, **extra)
        chunks = [next(stream), next(stream)]
        stream.switch_prompt("a blue square moving up")
        chunks += list(stream)
        return torch.cat(chunks, dim=2)

    alone = run()
    split = run(devices=["cpu"] * stages)
    torch.testing.assert_close(split, alone, atol=ATOL, rtol=0)
    no_children_left()


def test_a_scene_cut_by_switch_prompt_reaches_every_stage(random_pipe):
    """`switch_prompt(..., scene_cut=True)`: every stage places the cut chunk, as one process does (and the cut
    changes the video)."""
    call = dict(
        prompt="a red circle moving left", num_frames=7, output_type="latent", position_mode="relative", **SIZE
    )

    def run(scene_cut: bool = True, **extra):
        stream = random_pipe.stream(generator=seeded(), **call, **extra)
        chunks = [next(stream), next(stream)]
        stream.switch_prompt("a blue square moving up", scene_cut=scene_cut)
        chunks += list(stream)
        return torch.cat(chunks, dim=2)

    alone = run()
    assert not torch.allclose(alone, run(scene_cut=False))
    torch.testing.assert_close(run(devices=["cpu", "cpu"]), alone, atol=ATOL, rtol=0)
    no_children_left()


def test_each_stage_holds_its_blocks_weights_and_cache_layers_and_the_gathered_state_is_one_processs(random_pipe):
    call = VideoCall(
        prompt="a red circle", num_frames=6, output_type="latent", generator=seeded(), devices=["cpu", "cpu"], **SIZE
    )
    request = build_request(random_pipe, call)
    stream = parallel_stream(random_pipe, call, request)
    one = random_pipe.stream(generator=seeded(), prompt="a red circle", num_frames=6, output_type="latent", **SIZE)
    try:
        next(stream)
        next(one)
        stage = stream.pipeline.transformer
        assert len(stage.blocks) == 2 and len(stream.caches[0]) == 2  # blocks 0-1 of 3, and their layers only
        assert stage.blocks[0].ffn.net[0].proj.weight is random_pipe.transformer.blocks[0].ffn.net[0].proj.weight
        gathered, expected = stream.state_dict(), one.state_dict()
        assert sorted(k for k in gathered if k.startswith("cache.")) == sorted(
            k for k in expected if k.startswith("cache.")
        )
        for key in expected:
            if key.startswith("cache.") and isinstance(expected[key], torch.Tensor):
                torch.testing.assert_close(gathered[key].cpu(), expected[key], atol=ATOL, rtol=0, msg=key)
    finally:
        stream.close()
        one.close()
    no_children_left()


def test_closing_a_stream_before_its_end_stops_every_stage(random_pipe):
    stream = random_pipe.stream(
        prompt="a red circle", num_frames=8, output_type="latent", devices=["cpu", "cpu"], **SIZE
    )
    next(stream)
    stream.close()
    no_children_left()


@pytest.mark.parametrize(
    "devices, named",
    [
        ([], "non-empty list"),
        ("cpu", "non-empty list"),
        (["cpu"] * 4, "at most 3 devices"),
        (["cpu", "meta"], "one type"),
        (["cuda:7", "cuda:8"], "do not exist|pipeline runs"),
        (["cpu", "abc"], "not a device"),
    ],
)
def test_bad_devices_are_refused_before_any_process_starts(random_pipe, devices, named):
    with pytest.raises(ValueError, match=rf"`devices.*({named})"):
        random_pipe.stream(prompt="a red circle", num_frames=6, devices=devices, **SIZE)
    assert multiprocessing.active_children() == []


def test_devices_with_a_step_callback_is_refused_naming_both(random_pipe):
    with pytest.raises(ValueError, match="`devices` with `callback_on_step_end`"):
        random_pipe.stream(
            prompt="a red circle", num_frames=6, devices=["cpu", "cpu"], callback_on_step_end=lambda *a: {}, **SIZE
        )


def test_devices_on_a_longsana_pipeline_is_refused_naming_devices():
    pipe = load_pipeline("tiny-bouncing-shapes-sana", device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="`devices`: pipeline parallelism splits the Krea-like"):
        pipe.stream(prompt="a red circle", devices=["cpu", "cpu"])


def test_the_command_with_pipeline_parallel_2_writes_the_same_video(tmp_path):
    """A real `rolldiff generate --pipeline-parallel 2` subprocess, against the same command without the flag."""
    videos = {}
    for name, extra in (("split", ["--pipeline-parallel", "2"]), ("alone", [])):
        out = tmp_path / f"{name}.mp4"
        command = [sys.executable, "-m", "rolldiff", "generate", "--prompt", "a red circle moving left"]
        command += ["--seconds", "1", "--device", "cpu", "--out", str(out), *extra]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        videos[name] = iio.imread(out, plugin="FFMPEG", index=None)
    np.testing.assert_array_equal(videos["split"], videos["alone"])


def test_the_command_refuses_pipeline_parallel_with_compile(tmp_path, capsys):
    from rolldiff.cli import main

    code = main(["generate", "--prompt", "a red circle", "--pipeline-parallel", "2", "--compile", "--out",
                 str(tmp_path / "v.mp4")])  # fmt: skip
    assert code == 2
    assert "--pipeline-parallel runs the model as loaded, without --compile" in capsys.readouterr().err


SCRIPT = """
import sys
import numpy as np
import torch
from rolldiff import KreaRealtimeVideoPipeline
from rolldiff.defaults import load_pipeline

print("the script ran", flush=True)


class ScriptPipeline(KreaRealtimeVideoPipeline):  # a class of the script's own: workers need the script for it
    pass


def main():
    pipe = load_pipeline(None, device="cpu", dtype="float32")
    if sys.argv[1] == "own-class":
        pipe.__class__ = ScriptPipeline
    pipe.set_progress_bar_config(disable=True)
    call = dict(prompt="a red circle moving left", num_frames=pipe.latent_to_frames(9), output_type="np")
    alone = pipe(generator=torch.Generator().manual_seed(0), **call).frames
    split = pipe(generator=torch.Generator().manual_seed(0), devices=["cpu", "cpu"], **call).frames
    print("max difference", float(np.abs(split - alone).max()))

"""


def _run_script(tmp_path, body: str, kind: str) -> subprocess.CompletedProcess:
    script = tmp_path / "split_stream.py"
    script.write_text(SCRIPT + body)
    return subprocess.run([sys.executable, str(script), kind], capture_output=True, text=True, timeout=180)


def test_a_script_without_a_main_guard_splits_its_stream_and_is_not_run_again_by_the_workers(tmp_path):
    done = _run_script(tmp_path, "main()\n", "library-class")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("the script ran") == 1  # the worker did not run it
    assert float(done.stdout.split("max difference ")[1]) <= ATOL


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_a_script_whose_pipeline_class_is_its_own_needs_the_main_guard_and_is_told_so(tmp_path, guarded):
    body = 'if __name__ == "__main__":\n    main()\n' if guarded else "main()\n"
    done = _run_script(tmp_path, body, "own-class")
    if guarded:
        assert done.returncode == 0, done.stderr[-2000:]
        assert float(done.stdout.split("max difference ")[1]) <= ATOL
    else:
        assert done.returncode != 0
        assert "so each worker runs that script again: start the stream under `if __name__" in done.stderr

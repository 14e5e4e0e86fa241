"""`examples/batch_generate.py` under `accelerate launch` with 2 CPU processes: prompts split between them, one
video per prompt equal to a single-process run of the same prompt and seed, finished videos skipped on a rerun."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from tiny_components import tiny_pipeline

EXAMPLE = Path(__file__).parents[1] / "examples" / "batch_generate.py"
PROMPTS = ["a red circle moving left", "a blue square moving up", "a green triangle moving right"]


def _read(path) -> np.ndarray:
    return iio.imread(path, plugin="FFMPEG", index=None)  # (frames, height, width, 3) uint8


@pytest.mark.skipif(shutil.which("accelerate") is None, reason="the accelerate command is not installed")
def test_two_processes_split_the_prompts_and_skip_finished_videos(tmp_path):
    model = tmp_path / "model"
    pipe = tiny_pipeline()
    pipe.save_pretrained(model)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# one prompt per line\n" + "\n\n".join(PROMPTS) + "\n")
    out = tmp_path / "videos"
    out.mkdir()
    # Video 1 already finished (by a single-process run with the seed the batch gives it): it must be skipped.
    references = []
    for index, prompt in enumerate(PROMPTS):
        reference = tmp_path / f"reference{index}.mp4"
        pipe.generate_to_file(reference, prompt, fps=8, num_frames=4, height=16, width=16,
                              generator=torch.Generator().manual_seed(5 + index))  # fmt: skip
        references.append(_read(reference))
    shutil.copy(tmp_path / "reference1.mp4", out / "0001.mp4")
    finished = (out / "0001.mp4").read_bytes()

    command = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", str(EXAMPLE), "--prompts", str(prompts),
               "--out-dir", str(out), "--model", str(model), "--seconds", "0.5", "--fps", "8", "--height", "16",
               "--width", "16", "--seed", "5"]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]

    assert "[process 0] " + str(out / "0000.mp4") in result.stdout  # prompts 0, 1 -> process 0; prompt 2 -> 1
    assert "[process 1] " + str(out / "0002.mp4") in result.stdout
    assert f"{out / '0001.mp4'} exists, skipped" in result.stdout
    assert (out / "0001.mp4").read_bytes() == finished
    assert sorted(p.name for p in out.iterdir()) == ["0000.mp4", "0001.mp4", "0002.mp4"]
    for index in (0, 2):  # other processes: equal up to MKL's alignment-dependent rounding, then H.264's
        difference = np.abs(_read(out / f"{index:04d}.mp4").astype(int) - references[index].astype(int))
        assert difference.mean() < 1, difference.mean()
    assert np.abs(references[0].astype(int) - references[2].astype(int)).mean() > 10  # the bound tells videos apart

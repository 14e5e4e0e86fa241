"""`denoising="stream_batch"` split over stages with its rows in flight (`rolldiff.pipelines.parallel.inflight_batch`).

Specification: a stream batch split into 2 or 3 stages makes the one-process `stream_batch` video with the same seed
(latents and decoded frames) to `ATOL`, through the fill rows, the steady state and the drain, adaptive sink on; the
only difference allowed is the float reordering of one batched forward against per-row forwards (measured on CPU:
3.6e-7 on the latents of random weights). Rank 0 really launches later rows before earlier ones come back (a serial
chain would show one row in flight and no overlapped launch). What a split stream batch cannot serve is refused,
naming the argument: a saved state once rows are in flight, a prompt switch (as in one process). Real gloo
processes on 127.0.0.1; random weights of 3 blocks (one block per stage at 3 stages) and the embedded model.
"""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
import torch
from parallel_helpers import no_children_left, random_three_block_pipe, seeded

from rolldiff.defaults import load_pipeline

ATOL = 1e-5  # batched forward (one process) against per-row forwards (split); measured max difference 3.6e-7
STEPS = 4  # the recipe's 1000/750/500/250: S = 4 rows
BATCH = dict(recipe="streamdiffusionv2", denoising="stream_batch", output_type="latent", height=16, width=16)
PROMPT = "a red circle moving left"
NUM_FRAMES = 10  # 9 chunks: chunk 0 alone, then fill (chunk 1 leaves at forward 4), steady state, drain


@pytest.fixture(scope="module")
def random_pipe():
    """Random weights, 3 blocks (one per stage at 3 stages)."""
    return random_three_block_pipe()


@pytest.fixture(scope="module")
def split_runs(random_pipe):
    """Per stage count: the split stream's chunks and every stage's counters read before its last chunk."""
    runs = {}
    for stages in (2, 3):
        stream = random_pipe.stream(
            prompt=PROMPT, generator=seeded(), num_frames=NUM_FRAMES, devices=["cpu"] * stages, **BATCH
        )
        chunks, stats = [], None
        for chunk in stream:
            chunks.append(chunk)
            if stream.next_chunk == stream.num_chunks - 1:
                stats = stream.stage_stats()
        runs[stages] = chunks, stats
    no_children_left()
    return runs


@pytest.mark.parametrize("stages", [2, 3])
def test_a_split_stream_batch_makes_the_one_process_latents(random_pipe, split_runs, stages):
    alone = list(random_pipe.stream(prompt=PROMPT, generator=seeded(), num_frames=NUM_FRAMES, **BATCH))
    split, _ = split_runs[stages]
    assert len(split) == len(alone) == 9
    torch.testing.assert_close(torch.cat(split, dim=2), torch.cat(alone, dim=2), atol=ATOL, rtol=0)


@pytest.mark.parametrize("stages", [2, 3])
def test_rank_0_launches_later_rows_before_earlier_ones_come_back(split_runs, stages):
    """Before launching (f, r) a rank has completed only up to (f-1, r-1): S rows are in flight, plus the new one;
    every launch after the first few overlaps. A serial chain would hold one row and overlap none."""
    _, stats = split_runs[stages]
    assert len(stats) == stages
    for stage in stats:
        assert stage["in_flight_peak"] == STEPS + 1, stats
        assert stage["overlapped"] >= stage["forwards"] - STEPS - 2, stats  # all but chunk 0's steps and the first row
        assert stage["forwards"] == stats[0]["forwards"]  # every stage runs every row


def test_two_stages_of_the_embedded_model_make_the_one_process_frames():
    pipe = load_pipeline(None, device="cpu", dtype="float32")
    pipe.set_progress_bar_config(disable=True)
    call = dict(
        prompt="a red circle moving left", num_frames=pipe.latent_to_frames(8), recipe="streamdiffusionv2",
        denoising="stream_batch", output_type="np",
    )  # fmt: skip
    alone = pipe(generator=seeded(), **call).frames
    split = pipe(generator=seeded(), devices=["cpu", "cpu"], **call).frames
    assert split.shape == alone.shape and split.shape[1] > 1
    np.testing.assert_allclose(split, alone, atol=ATOL, rtol=0)
    no_children_left()


def test_a_split_video_to_video_stream_batch_ends_with_its_input_as_one_process_does(random_pipe):
    """Every stage reads the input itself; it ends before `num_frames` (7 pixel frames for 9 chunks), the rows drain on
    every rank at once, and no rank waits for a stop."""
    video = np.random.default_rng(0).random((7, 16, 16, 3)).astype(np.float32)
    call = dict(prompt=PROMPT, num_frames=NUM_FRAMES, video=video, strength=0.7, **BATCH)
    alone = list(random_pipe.stream(generator=seeded(), **call))
    split = list(random_pipe.stream(generator=seeded(), devices=["cpu"] * 2, **call))
    assert len(split) == len(alone) == 6
    torch.testing.assert_close(torch.cat(split, dim=2), torch.cat(alone, dim=2), atol=ATOL, rtol=0)
    no_children_left()


def test_a_split_stream_batch_refuses_a_state_once_rows_are_in_flight_and_stops_cleanly(random_pipe):
    """After chunk 0 (denoised alone) the state is the one-process state; from the first batched chunk on the next
    forward's rows are in flight, so `state_dict()` is refused naming `devices`; closing then drains every rank."""
    stream = random_pipe.stream(prompt=PROMPT, generator=seeded(), num_frames=NUM_FRAMES, devices=["cpu"] * 2, **BATCH)
    try:
        next(stream)
        assert "position" in stream.state_dict()
        next(stream)
        assert stream.rows_in_flight == STEPS
        with pytest.raises(RuntimeError, match=r"`devices` with denoising='stream_batch'"):
            stream.state_dict()
        with pytest.raises(ValueError, match=r"`denoising='stream_batch'`.*denoising='sequential'"):
            stream.switch_prompt("a blue square")  # as in one process: no chunk boundary to land on
    finally:
        stream.close()
    assert stream.rows_in_flight == 0
    no_children_left()


def test_a_prompt_schedule_is_refused_before_any_process_starts(random_pipe):
    with pytest.raises(ValueError, match=r"`denoising='stream_batch'`.*`prompt_schedule`"):
        random_pipe.stream(
            prompt_schedule=[(0, "a red circle"), (4, "a blue square")], num_frames=NUM_FRAMES, devices=["cpu"] * 2,
            **BATCH,
        )  # fmt: skip
    assert multiprocessing.active_children() == []


def test_the_adaptive_sink_outside_the_stream_batch_is_still_refused_with_devices(random_pipe):
    with pytest.raises(ValueError, match=r"`devices` runs `adaptive_sink` under `denoising`='stream_batch' only"):
        random_pipe.stream(
            prompt="a red circle", num_frames=NUM_FRAMES, devices=["cpu"] * 2, recipe="streamdiffusionv2",
            height=16, width=16,
        )  # fmt: skip

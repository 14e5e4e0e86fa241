"""The Gradio demo, served headless and driven with `gradio_client`: streamed chunks, live prompt switch, isolation.

The tiny random pipeline makes 2 frames per chunk at 16x16; the demo runs at 4 fps so a second is 2 chunks.
Each chunk is encoded as its own mp4 segment, so equal chunks give byte-equal segments and the decoded videos of
two runs can be compared exactly.
"""

import socket
import threading
import time
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from gradio_client import Client
from tiny_components import tiny_pipeline

from rolldiff.demo import LivePrompt, build_demo, generate_frames, streaming_available

FPS = 4
RED, BLUE, GREEN = "a red circle moving left", "a blue square moving up", "a green triangle moving right"


def _read(path) -> np.ndarray:
    return iio.imread(path, plugin="FFMPEG", index=None)  # (frames, height, width, 3) uint8


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def pipe():
    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _serve(pipe, streaming: bool):
    demo = build_demo(pipeline=pipe, max_concurrency=2, height=16, width=16, fps=FPS, streaming=streaming)
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=_free_port(), quiet=True)
    return demo


@pytest.fixture(scope="module")
def server(pipe):
    demo = _serve(pipe, streaming=False)  # the whole mp4 so far after each chunk: comparable frame by frame
    yield demo
    demo.close()


def _client(server) -> Client:
    return Client(server.local_url, verbose=False)  # one client = one browser session


@pytest.fixture
def slow_chunks(pipe):
    """Slow the transformer down so a client can act between two chunks of one video."""
    handle = pipe.transformer.register_forward_pre_hook(lambda *args: time.sleep(0.05))
    yield
    handle.remove()


def _wait_for_first_chunk(job, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not job.outputs():
        assert not job.done() and time.monotonic() < deadline, "the generation sent no chunk"
        time.sleep(0.02)


def test_generate_yields_the_video_so_far_after_every_chunk(server):
    job = _client(server).submit(RED, 2, 0, api_name="/generate")  # 2 s at 4 fps: 8 frames, 4 chunks
    video, details = job.result()
    assert [len(_read(output[0])) for output in job.outputs()] == [2, 4, 6, 8]
    assert _read(video).shape == (8, 16, 16, 3)
    assert details["frames"] == "8 / 8" and details["prompt_schedule"] == [[0, RED]]


def test_switching_the_prompt_mid_run_changes_the_frames_after_the_switch(server, slow_chunks):
    client = _client(server)
    plain = _read(client.predict(RED, 3, 0, api_name="/generate")[0])
    job = client.submit(RED, 3, 0, api_name="/generate")  # 12 frames, 6 chunks
    _wait_for_first_chunk(job)
    assert client.predict(BLUE, api_name="/switch_prompt").startswith("Switching")
    video, details = job.result()

    (_, first), (switch_frame, second) = details["prompt_schedule"]
    assert (first, second) == (RED, BLUE) and 0 < switch_frame < 12
    switched = _read(video)
    np.testing.assert_array_equal(switched[:switch_frame], plain[:switch_frame])
    assert not np.array_equal(switched[switch_frame:], plain[switch_frame:])


def test_a_switch_only_steers_its_own_session(server, slow_chunks):
    job = _client(server).submit(RED, 2, 0, api_name="/generate")
    _wait_for_first_chunk(job)
    assert _client(server).predict(BLUE, api_name="/switch_prompt").startswith("Nothing is generating")
    assert job.result()[1]["prompt_schedule"] == [[0, RED]]


def test_concurrent_sessions_each_get_the_video_they_get_alone(server):
    requests = [(RED, 2, 1), (GREEN, 2, 2)]
    alone = [_read(_client(server).predict(*request, api_name="/generate")[0]) for request in requests]
    jobs = [_client(server).submit(*request, api_name="/generate") for request in requests]
    together = [_read(job.result()[0]) for job in jobs]
    assert not np.array_equal(alone[0], alone[1])
    for got, expected in zip(together, alone):
        np.testing.assert_array_equal(got, expected)


def test_live_switch_equals_the_pipelines_prompt_schedule_at_the_recorded_frame(pipe):
    live = LivePrompt(RED)
    chunks = []
    for frames in generate_frames(pipe, live, 8, 16, 16, seed=0, model_lock=threading.Lock()):
        chunks.append(frames)
        if len(chunks) == 1:
            live.switch(BLUE)
    assert live.applied == [(0, RED), (2, BLUE)]  # taken at the next chunk, which starts at frame 2

    expected = pipe.stream(None, 8, 16, 16, prompt_schedule=live.applied, generator=torch.Generator().manual_seed(0))
    expected = (np.concatenate([c[0] for c in expected]) * 255.0).round().clip(0, 255).astype(np.uint8)
    np.testing.assert_array_equal(np.concatenate(chunks), expected)


@pytest.mark.skipif(not streaming_available(), reason="Gradio's streaming video output needs ffmpeg and ffprobe")
def test_streaming_output_sends_one_hls_segment_per_chunk(pipe):
    demo = _serve(pipe, streaming=True)
    try:
        job = _client(demo).submit(RED, 2, 0, api_name="/generate")  # 4 chunks of 2 frames at 4 fps
        playlist = Path(job.result()[0]).read_text()
    finally:
        demo.close()
    assert len(job.outputs()) == 4
    assert playlist.count("#EXTINF:0.5") == 4 and playlist.rstrip().endswith("#EXT-X-ENDLIST")

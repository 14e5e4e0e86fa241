"""The demo's image-to-video and video-to-video: the webcam's frame queue, the session without a browser, and the
`/generate` API with an uploaded clip and a start image (`gradio_client`).

The tiny random pipeline makes 2 frames per chunk at 16x16 (its VAE has no time factor, so a chunk takes 2 input
frames); the demo runs at 4 fps, so a second is 2 chunks. Each expectation is the pipeline's own `stream(...)` with
the same arguments, compared exactly (through the same mp4 encoding where the demo's video file is compared).
"""

import socket
import threading
import time

import imageio.v3 as iio
import numpy as np
import PIL.Image
import pytest
import torch
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError
from tiny_components import tiny_pipeline

from rolldiff.demo import (
    DemoInputError,
    DemoSession,
    DemoSettings,
    FrameQueue,
    GenerateConfig,
    Generation,
    InputConfig,
    LivePrompt,
    ModelShelf,
    VideoSoFar,
    build_demo,
    generate_frames,
    push_webcam_frame,
    stop_webcam,
)
from rolldiff.pipelines.io.video_writer import StreamingVideoWriter

FPS = 4
RED = "a red circle moving left"


@pytest.fixture(scope="module")
def pipe():
    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _frames(count: int, height: int = 24, width: int = 32, seed: int = 3) -> list[np.ndarray]:
    """Webcam-like frames `(height, width, 3)` uint8, larger than the video: the pipeline resizes them."""
    pixels = np.random.default_rng(seed).integers(0, 256, size=(count, height, width, 3), dtype=np.uint8)
    return list(pixels)


def _as_uint8(chunks) -> np.ndarray:
    """The pipeline's np chunks `(1, frames, H, W, 3)` in [0, 1] as the demo rounds them: `(frames, H, W, 3)`."""
    return (np.concatenate([c[0] for c in chunks]) * 255.0).round().clip(0, 255).astype(np.uint8)


def _seed(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _push_from_a_thread(push, frames: list[np.ndarray], then=None) -> threading.Thread:
    """Push `frames` one by one from another thread (a few ms apart, as a browser sends them), then call `then`."""

    def run() -> None:
        for frame in frames:
            push(frame)
            time.sleep(0.002)
        if then is not None:
            then()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# ---------------------------------------------------------------------------------------- the frame queue
def test_frames_pushed_from_another_thread_are_read_in_order_until_close():
    frames = _frames(6)
    queue = FrameQueue()
    thread = _push_from_a_thread(queue.push, frames, then=queue.close)
    read = list(queue)  # blocks for each frame; ends after close() once the queued frames are read
    thread.join()
    assert len(read) == 6 and all(a is b for a, b in zip(read, frames))
    assert (queue.frames_pushed, queue.frames_read, queue.frames_dropped) == (6, 6, 0)
    assert not queue.push(frames[0]) and next(queue, None) is None  # an ended input stays ended


def test_a_source_that_goes_silent_ends_the_input():
    queue = FrameQueue(idle_seconds=0.05, first_frame_seconds=0.05)
    queue.push(_frames(1)[0])
    start = time.perf_counter()
    assert len(list(queue)) == 1  # the queued frame, then no frame for 0.05 s: the end
    assert time.perf_counter() - start < 5 and queue.closed and not queue.push(_frames(1)[0])
    assert list(FrameQueue(first_frame_seconds=0.05)) == []  # a camera that never starts


def test_a_reader_that_falls_behind_gets_the_newest_frames():
    frames = _frames(5)
    queue = FrameQueue(max_frames=3)
    for frame in frames:
        queue.push(frame)
    queue.close()
    assert [frame is kept for frame, kept in zip(frames[2:], queue)] == [True] * 3
    assert queue.frames_dropped == 2


@pytest.mark.parametrize(
    ("argument", "value"),
    [("max_frames", 0), ("max_frames", 2.5), ("idle_seconds", -1), ("first_frame_seconds", True)],
)
def test_a_bad_queue_setting_is_refused_naming_it(argument, value):
    with pytest.raises(ValueError, match=f"`{argument}` must be a"):
        FrameQueue(**{argument: value})


# ---------------------------------------------------------------------------------------- the session, no browser
def test_a_start_image_gives_the_pipelines_image_to_video(pipe):
    image = _frames(1)[0]
    chunks = generate_frames(pipe, LivePrompt(RED), 8, 16, 16, seed=0, inputs={"image": image})
    got = np.concatenate([chunk.frames for chunk in chunks])
    expected = _as_uint8(pipe.stream(RED, 8, 16, 16, image=image, generator=_seed()))
    np.testing.assert_array_equal(got, expected)
    plain = _as_uint8(pipe.stream(RED, 8, 16, 16, generator=_seed()))
    assert not np.array_equal(got, plain)  # the image led the video


def test_webcam_frames_from_another_thread_give_the_pipelines_video_to_video(pipe):
    frames = _frames(8)
    queue = FrameQueue()
    _push_from_a_thread(queue.push, frames, then=queue.close)
    chunks = generate_frames(pipe, LivePrompt(RED), 8, 16, 16, seed=0, inputs={"video": queue, "strength": 0.5})
    got = np.concatenate([chunk.frames for chunk in chunks])
    expected = _as_uint8(pipe.stream(RED, 8, 16, 16, video=np.stack(frames), strength=0.5, generator=_seed()))
    np.testing.assert_array_equal(got, expected)


def _webcam_generation(pipe, seconds: float = 2) -> Generation:
    config = GenerateConfig(prompt=RED, seconds=seconds, seed=0, inputs=InputConfig(webcam=True, strength=0.5))
    return Generation(ModelShelf({"tiny": pipe}), config, DemoSettings(height=16, width=16, fps=FPS))


def test_stopping_the_webcam_ends_the_video_after_the_frames_it_sent(pipe):
    frames = _frames(5)  # two whole chunks and one frame, then the webcam stops
    session = DemoSession()
    generation = _webcam_generation(pipe, seconds=5)  # 20 frames asked for
    assert not push_webcam_frame(frames[0], session)  # before Generate: nobody takes it
    with session.steering(generation):
        thread = _push_from_a_thread(
            lambda frame: push_webcam_frame(frame, session), frames, then=lambda: stop_webcam(session)
        )
        got = np.concatenate([chunk.frames for chunk in generation])
        thread.join()
    expected = _as_uint8(pipe.stream(RED, 8, 16, 16, video=np.stack(frames[:4]), strength=0.5, generator=_seed()))
    np.testing.assert_array_equal(got, expected)  # the output ends with the input, at its last whole chunk
    details = generation.details()
    assert details["frames"] == "4 / 20" and details["input"] == "webcam" and details["strength"] == 0.5
    assert details["webcam_frames"] == {"received": 5, "dropped": 0}
    assert not push_webcam_frame(frames[0], session)  # the generation is over: its input is closed


def test_a_webcam_that_stops_before_one_chunk_is_reported_by_name(pipe):
    session = DemoSession()
    generation = _webcam_generation(pipe)
    with session.steering(generation):
        push_webcam_frame(_frames(1)[0], session)  # one frame: a chunk takes two
        stop_webcam(session)
        with pytest.raises(DemoInputError, match=r"^Webcam: it sent 1 frame\(s\) before it stopped, too few"):
            list(generation)


# ---------------------------------------------------------------------------------------- the /generate API
@pytest.fixture(scope="module")
def server(pipe):
    demo = build_demo(pipeline=pipe, height=16, width=16, fps=FPS, streaming=False)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, quiet=True)
    yield demo
    demo.close()


def _read(path) -> np.ndarray:
    return iio.imread(path, plugin="FFMPEG", index=None)  # (frames, height, width, 3) uint8


def _as_shown(chunks) -> np.ndarray:
    """What the page shows for the pipeline's chunks: each chunk its own mp4 segment, joined (as the demo does)."""
    with VideoSoFar(FPS, streaming=False) as video:
        for chunk in chunks:
            video.add(_as_uint8([chunk]))
        return _read(video.finished())


def test_an_uploaded_clip_gives_the_pipelines_video_to_video_and_ends_with_it(server, pipe, tmp_path):
    clip = tmp_path / "clip.mp4"
    with StreamingVideoWriter(clip, fps=FPS) as writer:
        writer.write(np.stack(_frames(6)))  # 3 chunks of input; 2 s asked for would be 4
    job = Client(server.local_url, verbose=False).submit(
        RED, 2, 0, video=handle_file(str(clip)), strength=0.5, api_name="/generate"
    )
    video, *_, details = job.result()
    assert len(job.outputs()) == 5  # the plan, 3 chunks (the clip's), the finished video
    expected = _as_shown(pipe.stream(RED, 8, 16, 16, video=str(clip), strength=0.5, generator=_seed()))
    np.testing.assert_array_equal(_read(video), expected)
    assert details["input"] == "clip" and details["strength"] == 0.5 and details["frames"] == "6 / 8"


def test_an_uploaded_start_image_gives_the_pipelines_image_to_video(server, pipe, tmp_path):
    path = tmp_path / "start.png"
    PIL.Image.fromarray(_frames(1)[0]).save(path)
    video, *_, details = Client(server.local_url, verbose=False).predict(
        RED, 1, 0, image=handle_file(str(path)), api_name="/generate"
    )
    image = PIL.Image.open(path).convert("RGB")
    np.testing.assert_array_equal(_read(video), _as_shown(pipe.stream(RED, 4, 16, 16, image=image, generator=_seed())))
    assert details["input"] == "image" and "strength" not in details


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(image="png", video="mp4"), "Start image: give either Start image (image-to-video) or Input video"),
        (dict(video="mp4", webcam=True), "Input video and Webcam: give one of them, not both"),
        (dict(video="mp4", strength=0), "Strength: must be a number in (0, 1]"),
        (dict(video="one-frame"), "Input video: has 1 frames; one chunk needs 2"),  # the pipeline's check
        (dict(image={"path": "/etc/hostname"}), "'/etc/hostname' is not a file uploaded to this demo"),
    ],
)
def test_bad_inputs_are_refused_through_the_api_before_any_work(server, model_calls, tmp_path, fields, message):
    files = {"png": tmp_path / "start.png", "mp4": tmp_path / "clip.mp4", "one-frame": tmp_path / "short.mp4"}
    PIL.Image.fromarray(_frames(1)[0]).save(files["png"])
    for name, frames in (("mp4", 4), ("one-frame", 1)):
        with StreamingVideoWriter(files[name], fps=FPS) as writer:
            writer.write(np.stack(_frames(frames)))
    files = {name: handle_file(str(path)) for name, path in files.items()}
    arguments = {name: files.get(value, value) if isinstance(value, str) else value for name, value in fields.items()}
    with pytest.raises(AppError) as refused:
        Client(server.local_url, verbose=False).predict(RED, 1, 0, **arguments, api_name="/generate")
    assert message in str(refused.value)
    assert model_calls == []

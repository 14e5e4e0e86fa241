"""The demo in a real browser: headless Chromium opens the page, picks an example prompt, opens Advanced, clicks
Generate; a playing `<video>` and the two live plots appear; a bad Advanced field shows an error naming it; with
Chromium's fake camera as the webcam, video-to-video runs on its frames and stopping the webcam ends the video.

Chromium is Debian's `chromium` package, installed here when missing (`apt-get install -y chromium`); it is driven
with the `playwright` Python package pointed at that binary (no `playwright install`). Screenshots are saved to
`test-artifacts/` (demo.png, demo-streaming.png, demo-error.png, demo-webcam.png).
"""

import os
import shutil
import socket
import subprocess
import time
import warnings
from pathlib import Path

import pytest
from tiny_components import tiny_pipeline

from rolldiff.demo import EXAMPLE_PROMPTS, build_demo, session, streaming_available

sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the dev extra) to run it")

ARTIFACTS = Path(__file__).parents[1] / "test-artifacts"
CHROMIUM_FLAGS = [
    "--no-sandbox",  # CI runs as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Chromium's own test camera (a moving pattern) as the webcam, and camera access granted without asking.
FAKE_WEBCAM_FLAGS = ["--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream"]


def _install_chromium() -> str | None:
    """`/usr/bin/chromium`, installing Debian's package first if it is missing; `None` if that is impossible."""
    if shutil.which("chromium") is None and shutil.which("apt-get") is not None:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "chromium"]
        if subprocess.run(install, capture_output=True, env=env).returncode != 0:  # stale package lists?
            subprocess.run(["apt-get", "update"], capture_output=True, env=env)
            subprocess.run(install, capture_output=True, env=env)
    return shutil.which("chromium")


@pytest.fixture(scope="session")
def chromium() -> str:
    path = _install_chromium()
    if path is None:
        message = (
            "CHROMIUM IS MISSING AND `apt-get install -y chromium` FAILED: the browser test of the demo did NOT run"
        )
        warnings.warn(message, stacklevel=1)
        pytest.skip(message)
    return path


def _serve(streaming: bool):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    demo = build_demo(pipeline=tiny_pipeline(), height=16, width=16, fps=4, streaming=streaming)
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, quiet=True)
    return demo


@pytest.fixture(
    params=[
        pytest.param(False, id="mp4-so-far"),
        pytest.param(True, id="hls-stream", marks=pytest.mark.skipif(not streaming_available(), reason="no ffmpeg")),
    ]
)
def demo_url(request):
    demo = _serve(request.param)
    yield demo.local_url
    demo.close()


def _open_page(chromium: str, profile: Path, flags: list[str]):
    """A fresh headless Chromium (its own --user-data-dir) and one page in it, closed after the `with` block."""
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch_persistent_context(
            str(profile), executable_path=chromium, headless=True, args=flags, viewport={"width": 1200, "height": 900}
        )
        try:
            yield browser.new_page()
        finally:
            browser.close()


@pytest.fixture
def page(chromium, tmp_path):
    yield from _open_page(chromium, tmp_path / "profile", CHROMIUM_FLAGS)


@pytest.fixture
def webcam_page(chromium, tmp_path):
    yield from _open_page(chromium, tmp_path / "profile", CHROMIUM_FLAGS + FAKE_WEBCAM_FLAGS)


def test_clicking_generate_shows_the_video_and_the_live_plots(page, demo_url, request):
    page.goto(demo_url)
    page.click(f"#examples button:has-text('{EXAMPLE_PROMPTS[3]}')")  # an example prompt, one click away
    assert page.input_value("#prompt textarea") == EXAMPLE_PROMPTS[3]  # set at once, in the page
    page.click("#advanced button")  # open the Advanced section
    page.wait_for_selector("#chunk_frames textarea", state="visible")
    page.click("#generate")
    video = page.wait_for_selector("#video video[src]", timeout=60_000)
    assert video.get_attribute("src")
    page.wait_for_function("() => document.querySelector('#video video').readyState >= 2", timeout=30_000)
    for plot in ("#time-plot", "#memory-plot"):  # Vega draws each plot once it has a chunk
        page.wait_for_selector(f"{plot} canvas, {plot} svg.marks", timeout=30_000)
    chunks_shown = "+(document.querySelector('#summary').innerText.match(/chunk (\\d+) took/) || [0, 0])[1]"
    page.wait_for_function(f"() => {chunks_shown} >= 2", timeout=60_000)
    page.click("#switch")  # to the "Switch prompt to" text, at the next chunk
    page.get_by_text(f"Switching to “{EXAMPLE_PROMPTS[1]}” at the next chunk.").wait_for(timeout=30_000)
    page.wait_for_function(f"() => {chunks_shown} >= 4", timeout=60_000)  # a few points on each line
    assert "frames per second" in page.inner_text("#summary")
    ARTIFACTS.mkdir(exist_ok=True)
    name = "demo.png" if "mp4-so-far" in request.node.name else "demo-streaming.png"
    page.screenshot(path=str(ARTIFACTS / name), full_page=True)
    page.click("#stop")  # end the generation before the server goes
    page.wait_for_selector("#generate:not([disabled])", timeout=30_000)


def test_a_bad_advanced_field_shows_an_error_naming_it(page, demo_url, request):
    if "hls-stream" in request.node.name:
        pytest.skip("the error path does not depend on the video output; checked once")
    page.goto(demo_url)
    page.click("#advanced button")
    field = page.locator("#chunk_frames textarea")
    field.fill("0")
    field.press("Tab")  # leave the field, as a user does, so its value is committed before the click
    assert field.input_value() == "0"
    page.click("#generate")
    toast = page.get_by_text("Chunk frames: type a whole number from 1 up, got '0'.")
    try:
        toast.wait_for(timeout=90_000)  # a loaded 2-core CI machine can be slow to start the browser's request
    except Exception as error:
        raise AssertionError(f"no error shown; the page says: {page.inner_text('body')[:2000]!r}") from error
    assert toast.is_visible()
    page.wait_for_timeout(500)  # let the message finish sliding in before the screenshot
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "demo-error.png"))


@pytest.fixture
def webcam_queues(monkeypatch) -> list:
    """Every `FrameQueue` a generation opens for the webcam: what the browser's frames reached on the server. They
    wait 2 minutes for a frame, so only the webcam's stop (or the video's end) can end them within this test."""
    queues, original = [], session.FrameQueue

    def recorded(*args, **kwargs):
        queues.append(original(*args, **{"idle_seconds": 120.0, **kwargs}))
        return queues[-1]

    monkeypatch.setattr(session, "FrameQueue", recorded)
    return queues


def _wait_until(page, condition, timeout_ms: int) -> bool:
    for _ in range(timeout_ms // 100):
        if condition():
            return True
        page.wait_for_timeout(100)
    return condition()


def test_the_webcam_leads_a_video_to_video_run_and_stopping_it_ends_the_video(webcam_page, webcam_queues):
    demo = _serve(streaming=False)
    page = webcam_page
    chunks_shown = "+(document.querySelector('#summary').innerText.match(/chunk (\\d+) took/) || [0, 0])[1]"
    try:
        page.goto(demo.local_url)
        seconds = page.locator("#seconds input[type='number']")
        seconds.fill("15")  # 60 frames at 4 fps: the webcam's stop, not the length, must end this video
        seconds.press("Tab")
        page.click("#use-webcam input")  # the webcam is the input video: its view appears
        page.click("#webcam button:has-text('Click to Access Webcam')", timeout=30_000)
        page.click("#webcam button:has-text('Record')", timeout=30_000)  # frames start streaming to the server
        page.click("#generate")
        page.wait_for_selector("#video video[src]", timeout=60_000)  # generated from the camera's frames
        page.wait_for_function("() => document.querySelector('#video video').readyState >= 2", timeout=30_000)
        page.wait_for_function(f"() => {chunks_shown} >= 2", timeout=60_000)
        (queue,) = webcam_queues
        assert queue.frames_read >= 4 and not queue.closed  # 2 chunks of 2 frames so far, and the webcam still on
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "demo-webcam.png"), full_page=True)

        page.click("#webcam button:has-text('Stop')")  # the webcam stops: the input ends, and so does the video
        assert _wait_until(page, lambda: queue.closed, 10_000), "stopping the webcam did not end the input"
        assert queue.frames_pushed < 60 and not queue.push(object())  # ended early; later frames are refused
        # the chunks made from the frames already sent still reach the page (slowly on a loaded machine): wait
        # until the count has held for 2 s, then it must stay (the input ended, so the video did)
        shown, held_since = page.evaluate(f"() => {chunks_shown}"), time.monotonic()
        deadline = held_since + 30
        while time.monotonic() - held_since < 2 and time.monotonic() < deadline:
            page.wait_for_timeout(250)
            now = page.evaluate(f"() => {chunks_shown}")
            if now != shown:
                shown, held_since = now, time.monotonic()
        page.wait_for_timeout(1500)
        assert page.evaluate(f"() => {chunks_shown}") == shown  # no chunk after the end
        assert shown * 2 <= queue.frames_read  # every chunk shown was made from the camera's frames
    finally:
        demo.close()

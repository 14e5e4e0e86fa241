"""The demo in a real browser: headless Chromium opens the page, picks an example prompt, opens Advanced, clicks
Generate; a playing `<video>` and the two live plots appear; a bad Advanced field shows an error naming it; with
Chromium's fake camera as the webcam, video-to-video runs on its frames and stopping the webcam ends the video.

Chromium is Debian's `chromium` package, installed here when missing (`apt-get install -y chromium`); it is driven
with the `playwright` Python package pointed at that binary (no `playwright install`). Screenshots are saved to
`test-artifacts/` (demo.png, demo-streaming.png, demo-error.png, demo-webcam.png).
"""

import socket
import time
from pathlib import Path

import pytest
from browser_helpers import CHROMIUM_FLAGS, FAKE_WEBCAM_FLAGS, chromium_or_skip, open_page
from tiny_components import tiny_pipeline

from rolldiff.demo import EXAMPLE_PROMPTS, build_demo, session, streaming_available

pytest.importorskip("playwright.sync_api", reason="pip install playwright (the dev extra) to run it")

ARTIFACTS = Path(__file__).parents[1] / "test-artifacts"
# The chunk the status line last reported ("chunk 3 of 6 took ..."), counted from 1; 0 before any.
CHUNKS_SHOWN = "+(document.querySelector('#summary').innerText.match(/chunk (\\d+) of \\d+ took/) || [0, 0])[1]"


@pytest.fixture(scope="session")
def chromium() -> str:
    return chromium_or_skip("the demo")


def _serve(streaming: bool, pipe=None, **settings):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    pipe = pipe or tiny_pipeline()
    demo = build_demo(pipeline=pipe, height=16, width=16, fps=4, streaming=streaming, **settings)
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


@pytest.fixture
def page(chromium, tmp_path):
    yield from open_page(chromium, tmp_path / "profile", CHROMIUM_FLAGS)


@pytest.fixture
def webcam_page(chromium, tmp_path):
    yield from open_page(chromium, tmp_path / "profile", CHROMIUM_FLAGS + FAKE_WEBCAM_FLAGS)


def test_clicking_generate_shows_the_video_and_the_live_plots(page, demo_url, request):
    page.goto(demo_url)
    page.click(f"#examples button:has-text('{EXAMPLE_PROMPTS[3]}')")  # an example prompt, one click away
    assert page.input_value("#prompt textarea") == EXAMPLE_PROMPTS[3]  # set at once, in the page
    page.click("#advanced button")  # open the Advanced section
    page.wait_for_selector("#chunk_frames textarea", state="visible")
    # A video long enough to be running when Stop is clicked, however slow the machine's browser is to show the
    # chunks: 60 s (120 chunks) needs relative positions (the tiny model's RoPE table has 64 frames).
    page.click("#position_mode label:has-text('relative')")
    page.fill("#seconds input", "60")
    page.locator("#seconds input").press("Tab")
    page.click("#generate")
    page.wait_for_selector("#preview img[src]", timeout=60_000)  # the live preview shows the first chunk
    if "hls-stream" in request.node.name:  # streaming: the one player gets each chunk's segment
        page.wait_for_selector("#video video[src]", timeout=60_000)
        page.wait_for_function("() => document.querySelector('#video video').readyState >= 2", timeout=30_000)
    for plot in ("#time-plot", "#memory-plot"):  # Vega draws each plot once it has a chunk
        page.wait_for_selector(f"{plot} canvas, {plot} svg.marks", timeout=30_000)
    page.wait_for_function(f"() => {CHUNKS_SHOWN} >= 2", timeout=60_000)
    assert " of 120 took" in page.inner_text("#summary")  # the length and position mode typed were the run's
    page.click("#switch")  # to the "Switch prompt to" text, at the next chunk
    page.get_by_text(f"Switching to “{EXAMPLE_PROMPTS[1]}” at the next chunk.").wait_for(timeout=30_000)
    page.wait_for_function(f"() => {CHUNKS_SHOWN} >= 4", timeout=60_000)  # a few points on each line
    assert "frames per second" in page.inner_text("#summary")
    ARTIFACTS.mkdir(exist_ok=True)
    name = "demo.png" if "mp4-so-far" in request.node.name else "demo-streaming.png"
    page.screenshot(path=str(ARTIFACTS / name), full_page=True)
    page.click("#stop")  # the video ends after the chunk being made, and what was made is kept
    page.wait_for_selector("#generate:not([disabled])", timeout=30_000)
    if "mp4-so-far" in request.node.name:  # the finished video comes once, at the end, to play or download
        page.wait_for_selector("#video video[src]", timeout=30_000)
        assert "Stopped:" in page.inner_text("#summary")


def test_a_bad_advanced_field_shows_an_error_naming_it(page, demo_url, request):
    if "hls-stream" in request.node.name:
        pytest.skip("the error path does not depend on the video output; checked once")
    page.goto(demo_url)
    page.click("#advanced button")
    field = page.locator("#chunk_frames textarea")
    for _ in range(20):  # a page still starting up may reset the field once (its model's defaults): type again
        field.fill("0")
        field.press("Tab")  # leave the field, as a user does, so its value is committed before the click
        page.wait_for_timeout(100)
        if field.input_value() == "0":
            break
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
    chunks_shown = CHUNKS_SHOWN
    try:
        page.goto(demo.local_url)
        seconds = page.locator("#seconds input[type='number']")
        seconds.fill("15")  # 60 frames at 4 fps: the webcam's stop, not the length, must end this video
        seconds.press("Tab")
        page.click("#use-webcam input")  # the webcam is the input video: its view appears
        page.click("#webcam button:has-text('Click to Access Webcam')", timeout=30_000)
        page.click("#webcam button:has-text('Record')", timeout=30_000)  # frames start streaming to the server
        page.click("#generate")
        page.wait_for_selector("#preview img[src]", timeout=60_000)  # generated from the camera's frames
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
        page.wait_for_selector("#video video[src]", timeout=30_000)  # the finished video, to download
    finally:
        demo.close()


# ---------------------------------------------------------------------------------------- the points
@pytest.fixture
def slow_server():
    """The tiny pipeline slowed down (0.1 s per transformer call), so the page can be watched between chunks;
    at most 6 s long, so a length can be clamped."""
    pipe = tiny_pipeline()
    pipe.transformer.register_forward_pre_hook(lambda *args: time.sleep(0.1))
    demo = _serve(streaming=False, pipe=pipe, max_seconds=6)
    yield demo
    demo.close()


def _set_length(page, seconds: str) -> None:
    field = page.locator("#seconds input[type='number']")
    field.fill(seconds)
    field.press("Tab")


def _x_tick_labels(page, plot: str) -> list[str]:
    return page.evaluate(
        f"""() => [...document.querySelectorAll("{plot} g[aria-label^='X-axis'] .role-axis-label text")]
                .map((t) => t.textContent)"""
    )


def test_the_preview_grows_in_place_and_the_numbers_agree(page, slow_server):
    """Points 1-3: the live preview is one image updated in place (its box never collapses, the node is never
    re-created), the finished video comes at the end; the status line and the plots count chunks the same way,
    with whole-chunk ticks; the length run is said, and a clamped one too."""
    page.goto(slow_server.local_url)
    _set_length(page, "100000")
    page.click("#generate")
    plan = page.locator("#plan")
    plan.get_by_text("Length (seconds): 100000 is more than this demo makes; making the longest, 6 s.").wait_for(
        timeout=60_000
    )
    assert "6 s -> 24 frames, whole chunks of 2 latent frames (12 chunks) at 4 fps." in plan.inner_text()
    page.wait_for_selector("#preview img[src]", timeout=60_000)
    page.evaluate("() => { window.firstPreview = document.querySelector('#preview img'); }")
    samples = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not page.locator("#summary").get_by_text("Done:").is_visible():
        samples.append(
            page.evaluate(
                """() => [document.querySelector('#preview').getBoundingClientRect().height,
                          document.querySelector('#preview img') === window.firstPreview]"""
            )
        )
        page.wait_for_timeout(50)
    assert len(samples) >= 20, "the run ended too soon to watch the preview"
    heights = {round(height) for height, _ in samples}
    assert len(heights) == 1 and heights.pop() >= 200, f"the preview's box changed size: {samples}"
    assert all(same for _, same in samples), "the preview's image was re-created"
    page.get_by_text("Done: 24 frames in 12 chunks").wait_for(timeout=120_000)
    page.wait_for_selector("#video video[src]", timeout=30_000)  # the finished video, to play or download
    assert "chunk 12 of 12 took" in page.inner_text("#summary")
    for plot in ("#time-plot", "#memory-plot"):  # whole chunks, counted from 1 like the status line
        labels = _x_tick_labels(page, plot)
        assert labels and all(label.isdigit() and int(label) >= 1 for label in labels), labels
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "demo-page.png"), full_page=True)


def test_early_ticks_are_whole_chunks(page, slow_server):
    """Point 2: with one or two chunks plotted, the x axis still has whole-chunk ticks only (no 0.5, 1.5)."""
    page.goto(slow_server.local_url)
    _set_length(page, "1")
    page.click("#generate")
    page.wait_for_function(f"() => {CHUNKS_SHOWN} >= 1", timeout=60_000)
    page.wait_for_selector("#time-plot g[aria-label^='X-axis'] .role-axis-label text", timeout=30_000)
    labels = _x_tick_labels(page, "#time-plot")
    assert labels and all(label.isdigit() for label in labels), labels
    page.wait_for_selector("#generate:not([disabled])", timeout=60_000)


@pytest.mark.parametrize("seconds", ["0", "-5"])
def test_a_length_of_zero_or_less_is_refused_in_words(page, slow_server, seconds):
    """Point 3: 0 or -5 s is not quietly made 1 s: the page says what to type."""
    page.goto(slow_server.local_url)
    _set_length(page, seconds)
    page.click("#generate")
    page.get_by_text(f"Length (seconds): type a number above 0 and at most 6, got {seconds}").first.wait_for(
        timeout=60_000
    )


def test_the_switch_note_goes_when_the_run_ends(page, slow_server):
    """Point 4: "Switching to ..." is gone from the page once the run is over."""
    page.goto(slow_server.local_url)
    _set_length(page, "2")
    page.click("#generate")
    page.wait_for_function(f"() => {CHUNKS_SHOWN} >= 1", timeout=60_000)
    page.click("#switch")
    note = page.locator("#status").get_by_text("Switching to")
    note.wait_for(timeout=30_000)
    page.get_by_text("Done:").wait_for(timeout=60_000)
    note.wait_for(state="detached", timeout=10_000)


def test_a_recipe_picked_in_the_menu_shows_its_values_and_lets_cut_to_it_land(page, slow_server):
    """The Recipe menu (Advanced) lists the model's recipes; picking Infinity-RoPE's shows its sink and window as
    the fields' placeholders, the run says it, and *Cut to it* lands (the tiny model's own positions cannot cut)."""
    page.goto(slow_server.local_url)
    page.click("#advanced button")
    page.click("#recipe input")
    page.get_by_role("option", name="infinity-rope", exact=True).click()
    sink = page.locator("#sink_frames textarea")
    page.wait_for_function(
        "() => document.querySelector('#sink_frames textarea').placeholder === \"1 (the recipe's)\"", timeout=30_000
    )
    assert page.locator("#window_frames textarea").get_attribute("placeholder") == "5 (the recipe's)"
    assert sink.input_value() == ""  # a placeholder, not a value: the recipe's settings stay the recipe's
    _set_length(page, "6")
    page.click("#generate")
    page.locator("#plan").get_by_text("Recipe: infinity-rope").wait_for(timeout=60_000)
    page.wait_for_function(f"() => {CHUNKS_SHOWN} >= 1", timeout=60_000)
    page.click("#cut")
    page.locator("#status").get_by_text("Cutting to").wait_for(timeout=30_000)
    page.click("#stop")
    page.wait_for_selector("#generate:not([disabled])", timeout=60_000)


def test_a_refused_upload_leaves_a_note_that_the_run_is_text_to_video(page, slow_server, tmp_path):
    """Point 4: a `.txt` the uploader refuses is no start image, and the run says it is text-to-video."""
    notes = tmp_path / "notes.txt"
    notes.write_text("not a picture")
    page.goto(slow_server.local_url)
    page.locator("#start-image input[type='file']").set_input_files(str(notes))
    page.get_by_text("Invalid file type").first.wait_for(timeout=10_000)  # Gradio's own refusal
    _set_length(page, "1")
    page.click("#generate")
    page.locator("#plan").get_by_text(
        "Text-to-video: no start image or input video (a file the uploader refused is not used)."
    ).wait_for(timeout=60_000)
    page.wait_for_selector("#generate:not([disabled])", timeout=60_000)


def test_a_start_image_that_is_not_a_picture_is_named_without_the_servers_folder(page, slow_server, tmp_path):
    """Point 5: a text file named `.png` is refused by its own name; the server's upload folder is not shown."""
    fake = tmp_path / "not_an_image.png"
    fake.write_text("hello")
    page.goto(slow_server.local_url)
    page.locator("#start-image input[type='file']").set_input_files(str(fake))
    page.wait_for_timeout(1000)  # the upload reaches the server
    page.click("#generate")
    message = page.get_by_text("Start image: 'not_an_image.png' is not a picture PIL can read").first
    message.wait_for(timeout=60_000)
    text = message.inner_text()
    assert "/tmp" not in text and "gradio" not in text, text


def test_the_webcam_stops_recording_when_the_video_is_finished(webcam_page):
    """Point 4: once the generation is over, the webcam is stopped (its Record button is back)."""
    demo = _serve(streaming=False)
    page = webcam_page
    try:
        page.goto(demo.local_url)
        _set_length(page, "1")  # 4 frames at 4 fps: over in a moment
        page.click("#use-webcam input")
        page.click("#webcam button:has-text('Click to Access Webcam')", timeout=30_000)
        page.click("#webcam button:has-text('Record')", timeout=30_000)
        page.wait_for_selector("#webcam button:has-text('Stop')", timeout=30_000)  # recording
        page.click("#generate")
        page.get_by_text("Done:").wait_for(timeout=90_000)
        page.wait_for_selector("#webcam button:has-text('Record')", timeout=15_000)  # no longer recording
        assert page.locator("#webcam button:has-text('Stop')").count() == 0
    finally:
        demo.close()

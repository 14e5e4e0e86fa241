"""The demo in a real browser: headless Chromium opens the page, clicks Generate, and a playing `<video>` appears.

Chromium is Debian's `chromium` package, installed here when missing (`apt-get install -y chromium`); it is driven
with the `playwright` Python package pointed at that binary (no `playwright install`). A screenshot is saved to
`test-artifacts/demo.png`.
"""

import os
import shutil
import socket
import subprocess
import warnings
from pathlib import Path

import pytest
from tiny_components import tiny_pipeline

from rolldiff.demo import build_demo, streaming_available

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


@pytest.fixture(
    params=[
        pytest.param(False, id="mp4-so-far"),
        pytest.param(True, id="hls-stream", marks=pytest.mark.skipif(not streaming_available(), reason="no ffmpeg")),
    ]
)
def demo_url(request):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    demo = build_demo(pipeline=tiny_pipeline(), height=16, width=16, fps=4, streaming=request.param)
    demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", server_port=port, quiet=True)
    yield demo.local_url
    demo.close()


def test_clicking_generate_shows_the_video(chromium, demo_url, tmp_path, request):
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch_persistent_context(
            str(tmp_path / "profile"),  # a fresh --user-data-dir
            executable_path=chromium,
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1100, "height": 800},
        )
        try:
            page = browser.new_page()
            page.goto(demo_url)
            page.click("#generate")
            video = page.wait_for_selector("#video video[src]", timeout=60_000)
            assert video.get_attribute("src")
            page.wait_for_function("() => document.querySelector('#video video').readyState >= 2", timeout=30_000)
            ARTIFACTS.mkdir(exist_ok=True)
            name = "demo.png" if "mp4-so-far" in request.node.name else "demo-streaming.png"
            page.screenshot(path=str(ARTIFACTS / name))
            page.click("#stop")  # end the generation before the server goes
            page.wait_for_selector("#generate:not([disabled])", timeout=30_000)
        finally:
            browser.close()

"""Debian's Chromium, headless, driven by Playwright (no `playwright install`): shared by the browser tests of the
demo and of `rolldiff serve`. Chromium is installed when missing (`apt-get install -y chromium`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest

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


def install_chromium() -> str | None:
    """`/usr/bin/chromium`, installing Debian's package first if it is missing; `None` if that is impossible."""
    if shutil.which("chromium") is None and shutil.which("apt-get") is not None:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "chromium"]
        if subprocess.run(install, capture_output=True, env=env).returncode != 0:  # stale package lists?
            subprocess.run(["apt-get", "update"], capture_output=True, env=env)
            subprocess.run(install, capture_output=True, env=env)
    return shutil.which("chromium")


def chromium_or_skip(what: str) -> str:
    path = install_chromium()
    if path is None:
        message = (
            f"CHROMIUM IS MISSING AND `apt-get install -y chromium` FAILED: the browser test of {what} did NOT run"
        )
        warnings.warn(message, stacklevel=2)
        pytest.skip(message)
    return path


def open_page(chromium: str, profile: Path, flags: list[str], viewport: dict | None = None):
    """A fresh headless Chromium (its own --user-data-dir) and one page in it, closed after the `with` block."""
    from playwright import sync_api

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch_persistent_context(
            str(profile), executable_path=chromium, headless=True, args=flags,
            viewport=viewport or {"width": 1200, "height": 900},
        )  # fmt: skip
        try:
            yield browser.new_page()
        finally:
            browser.close()

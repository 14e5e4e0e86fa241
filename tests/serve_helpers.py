"""`rolldiff serve` as a real process for the tests: started on a free loopback port, waited for (bounded)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """One `rolldiff serve` subprocess; `url` is its WebSocket endpoint. One torch thread, as the tests' own
    process (conftest), so a session's frames can equal the library's bit for bit."""

    def __init__(self, *flags: str, port: int | None = None, env: dict | None = None) -> None:
        self.port = port or free_port()
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"rolldiff-serve-{self.port}.log"
        command = [sys.executable, "-m", "rolldiff", "serve", "--port", str(self.port), "--device", "cpu", *flags]
        self.process = subprocess.Popen(
            command,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        )
        self.wait_ready()

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/stream"

    def http(self, path: str) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as response:
            return json.loads(response.read())

    def wait_ready(self, seconds: float = 60.0) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"rolldiff serve exited {self.process.returncode}: {self.log.read_text()}")
            try:
                self.http("/healthz")
                return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"rolldiff serve did not answer in {seconds} s: {self.log.read_text()}")

    def sessions_within(self, count: int, seconds: float = 10.0) -> bool:
        """Whether `healthz` reports `count` sessions within `seconds`."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.http("/healthz")["sessions"] == count:
                return True
            time.sleep(0.1)
        return False

    def stop(self, sig: int = signal.SIGTERM, seconds: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout=10)

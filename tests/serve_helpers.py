"""`rolldiff serve` for the tests: a real process (`Server`) or the same app under uvicorn in a thread of the test
process (`InProcessServer`, sharing the test's pipeline), started on a free loopback port, waited for (bounded)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def until(condition, seconds: float = 15.0) -> bool:
    """Whether `condition()` holds within `seconds` (asked every 0.1 s)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def process_tree(pid: int) -> list[int]:
    """`pid` and every process under it, parents first (Linux `/proc`); [] once it is gone."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except FileNotFoundError:
        return []
    return [pid] + [grandchild for child in children for grandchild in process_tree(int(child))]


class _Endpoint:
    """What both servers answer: the WebSocket `url`, `http` GETs, the bounded waits."""

    port: int
    log: Path | None = None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/stream"

    def http(self, path: str) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as response:
            return json.loads(response.read())

    def _exited(self) -> str | None:
        """Why the server is gone (None while it runs)."""
        return None

    def wait_ready(self, seconds: float = 60.0) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            gone = self._exited()
            if gone is not None:
                raise RuntimeError(gone)
            try:
                self.http("/healthz")
                return
            except (OSError, http.client.HTTPException):  # not up yet, or another program holds the port for now
                time.sleep(0.2)
        raise TimeoutError(
            f"rolldiff serve did not answer in {seconds} s" + (f": {self.log.read_text()}" if self.log else "")
        )

    def sessions_within(self, count: int, seconds: float = 10.0) -> bool:
        """Whether `healthz` reports `count` sessions within `seconds`."""
        return until(lambda: self.http("/healthz")["sessions"] == count, seconds)


class InProcessServer(_Endpoint):
    """`create_app(pipe, ServeSettings(**settings))` under uvicorn in a daemon thread of this process: the server
    serves the very pipeline object the test runs `pipe.stream` on (same weights, same torch settings), and its
    scheduler's counters are at hand (`scheduler`)."""

    def __init__(self, pipe, **settings) -> None:
        import uvicorn

        from rolldiff.serving.app import ServeSettings, create_app
        from rolldiff.serving.server import uvicorn_config

        self.port = free_port()
        settings = ServeSettings(**settings)
        self.app = create_app(pipe, settings)
        config = uvicorn_config(self.app, settings, "127.0.0.1", self.port)
        self.server = uvicorn.Server(config)  # not the main thread: uvicorn installs no signal handlers
        self.thread = threading.Thread(target=self.server.run, name="rolldiff-test-serve", daemon=True)
        self.thread.start()
        self.wait_ready()

    def _exited(self) -> str | None:
        return None if self.thread.is_alive() else "the in-process server's thread ended"

    @property
    def scheduler(self):
        return self.app.state.get_hub().scheduler

    def stop(self, seconds: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=seconds)
        hub = getattr(self.app.state, "hub", None)
        if hub is not None:
            hub.scheduler.stop()


class Server(_Endpoint):
    """One `rolldiff serve` subprocess; `url` is its WebSocket endpoint. One torch thread, as the tests' own
    process (conftest), so a session's frames can equal the library's bit for bit. Every one started is in
    `Server.started`, so a test that fails before it stops its server does not leave it running (conftest)."""

    started: list[Server] = []

    def __init__(self, *flags: str, port: int | None = None, env: dict | None = None) -> None:
        # A free port can be taken between `free_port()` and the server's bind (a Ray cluster of another test worker
        # starting its gRPC servers): then the server refuses it, and a fresh port is tried (at most 3 in all).
        for attempt in range(1 if port is not None else 3):
            self._start(port or free_port(), flags, env)
            try:
                self.wait_ready()
                return
            except RuntimeError as exited:
                if port is not None or "already in use" not in str(exited) or attempt == 2:
                    raise

    def _start(self, port: int, flags: tuple[str, ...], env: dict | None) -> None:
        self.port = port
        self.log = Path(tempfile.gettempdir()) / f"rolldiff-serve-{self.port}.log"  # the run's folder (conftest)
        command = [sys.executable, "-m", "rolldiff", "serve", "--port", str(self.port), "--device", "cpu", *flags]
        self.process = subprocess.Popen(
            command,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        )
        Server.started.append(self)

    def _exited(self) -> str | None:
        if self.process.poll() is None:
            return None
        return f"rolldiff serve exited {self.process.returncode}: {self.log.read_text()}"

    def wait_ready(self, seconds: float = 60.0) -> None:
        """Answering, and announced: a `--workers` server answers once its first worker serves, and says
        `rolldiff serve: ...` once every worker does (a `--ray` one once every replica does)."""
        super().wait_ready(seconds)
        assert until(lambda: ANNOUNCED in self.log.read_text() or self._exited() is not None, seconds), self.log
        gone = self._exited()
        if gone is not None:
            raise RuntimeError(gone)

    def stop(self, sig: int = signal.SIGTERM, seconds: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(timeout=10)


class RayServer(Server):
    """`rolldiff serve --ray` as a subprocess (it starts its own local Ray cluster): ready once the command says every
    replica serves (the proxy answers as soon as the first does). `ray_address` is its cluster's."""

    def wait_ready(self, seconds: float = 180.0) -> None:
        super().wait_ready(seconds)
        self.ray_address = self.log.read_text().split("Ray at ", 1)[1].split(")", 1)[0]

    def kill_replica(self, replica: str) -> None:
        """`ray.kill` of one replica's actor (by its id in `/healthz`'s `replicas`), from a Ray driver of its own that
        joins the cluster (with the token the cluster made in ~/.ray), so the test process never imports Ray."""
        name = f"SERVE_REPLICA::rolldiff#rolldiff#{replica}"
        ray_driver(self.ray_address, f"ray.kill(ray.get_actor({name!r}, namespace='serve'), no_restart=True)")


RAY_TOKEN = {"RAY_AUTH_MODE": "token"}  # a process joining a cluster uses the token the cluster made in ~/.ray


def ray_driver(address: str, code: str) -> None:
    """`code` run by a Ray driver of its own joined to the cluster at `address` (`ray` and `serve` imported), so the
    test process never imports Ray."""
    joined = f"import ray; from ray import serve; ray.init(address={address!r}, logging_level='WARNING'); {code}"
    env = {**os.environ, **RAY_TOKEN}
    subprocess.run([sys.executable, "-c", joined], check=True, timeout=120, env=env, capture_output=True)


def refused_joining(address: str, *flags: str, env: dict | None = None) -> str:
    """A `rolldiff serve --ray --ray-address address --replicas 1` on a free port that must be refused (exit 2):
    its standard error. `env`: variables beside this process's."""
    command = [sys.executable, "-m", "rolldiff", "serve", "--ray", "--ray-address", address, "--replicas", "1"]
    command += ["--device", "cpu", "--port", str(free_port()), *flags]
    env = {**os.environ, **RAY_TOKEN, "OMP_NUM_THREADS": "1", **(env or {})}
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    return done.stderr


_REFERENCE = r"""
import json, sys
import numpy as np, torch
from rolldiff.defaults import load_pipeline
from rolldiff.pipelines.io.video_writer import frames_to_uint8
spec = json.loads(sys.argv[1])
pipe = load_pipeline(spec.get("model"), device="cpu", dtype="float32")
pipe.set_progress_bar_config(disable=True)
if spec.get("fp8_storage"):
    pipe.enable_fp8_storage()
call = {k: np.load(spec[k]) for k in ("image", "video") if spec.get(k)}
for name in ("strength", "recipe"):
    if spec.get(name) is not None:
        call[name] = spec[name]
stream = pipe.stream(spec["prompt"], spec["num_frames"], generator=torch.Generator().manual_seed(spec["seed"]), **call)
chunks = []
for index in range(stream.num_chunks):
    if spec.get("switch") and index == spec["switch"][0]:
        stream.switch_prompt(spec["switch"][1], scene_cut=len(spec["switch"]) > 2 and spec["switch"][2])
    frames = next(stream, None)
    if frames is None:
        break
    chunks.append(frames_to_uint8(frames[0]))
np.savez(spec["out"], *chunks)
"""


ANNOUNCED = "rolldiff serve: "  # the line the command prints once it serves (every worker, every replica)
RED = "a red circle moving left"  # the sessions' prompt
FRAMES = 24  # a session's length: 8 chunks of 3 on the embedded model


def library_references(folder: Path):
    """`reference(prompt, seed, num_frames, switch, **inputs)`: what `pipe.stream` gives for a session's arguments
    (a prompt switch at chunk `switch[0]`, a scene cut if `switch[2]`), as uint8 chunks, each made once (calls with inputs are made afresh)."""
    made: dict = {}

    def reference(prompt=RED, seed=3, num_frames=FRAMES, switch=None, **inputs) -> list:
        key = (prompt, seed, num_frames, switch, tuple(sorted(inputs)))
        if key not in made or inputs:
            made[key] = reference_chunks(
                folder, prompt=prompt, seed=seed, num_frames=num_frames, switch=switch, **inputs
            )
        return made[key]

    return reference


def killed_then_restored(server: Server, restart, after_kill=lambda: None) -> tuple[list, int, list]:
    """A seeded session (RED, seed 3, FRAMES) on `server` (run with `--state-every 1`): 3 chunks, paused, then the
    server killed (SIGKILL); `after_kill()`, and the session restored on `restart()` (a new server). Returns the
    chunks the client got before the kill, the chunk the restore started at, and the chunks after it."""
    from rolldiff.serving import connect, restore

    live = connect(server.url, prompt=RED, seed=3, num_frames=FRAMES)
    token = live.ready["token"]
    chunks = [next(live), next(live), next(live)]
    live.pause()
    time.sleep(1.0)  # what the server made ahead goes out (and its state is written) while the session is paused
    server.stop(signal.SIGKILL)
    after_kill()
    chunks += list(live)  # everything that reached the client before the kill
    live.close()
    again = restart()
    try:
        resumed = restore(again.url, token)
        return chunks, resumed.ready["next_chunk"], list(resumed)
    finally:
        again.stop()


def reference_chunks(folder: Path, **spec) -> list:
    """What `pipe.stream` gives for a session's arguments, made in a process of its own (as the server's is, one
    torch thread): uint8 chunks. A test process may carry process-wide settings earlier tests left behind."""
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("image", "video"):
        if spec.get(name) is not None:
            path = folder / f"{name}-{len(list(folder.iterdir()))}.npy"
            np.save(path, spec[name])
            spec[name] = str(path)
    out = folder / f"reference-{len(list(folder.iterdir()))}.npz"
    spec["out"] = str(out)
    subprocess.run(
        [sys.executable, "-c", _REFERENCE, json.dumps(spec)],
        check=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
    )
    with np.load(out) as saved:
        return [saved[f"arr_{i}"] for i in range(len(saved.files))]


def round_robin(clients: dict, limit: int) -> dict:
    """Every client's chunks, read one chunk from each in turn (every session stays ready, so the server can make
    their chunks together); at most `limit` passes."""
    made = {name: [] for name in clients}
    live = dict(clients)
    for _ in range(limit):
        if not live:
            break
        for name, client in list(live.items()):
            chunk = next(client, None)
            if chunk is None:
                del live[name]
            else:
                made[name].append(chunk)
    return made


def max_difference(got: list, want: list, min_chunks: int = 1) -> int:
    """Largest per-pixel difference (of 255) between two runs' chunks, which must pair up (`min_chunks` at least)."""
    assert len(got) == len(want) >= min_chunks, (len(got), len(want))
    assert all(a.shape == b.shape for a, b in zip(got, want))
    return max(int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max()) for a, b in zip(got, want))

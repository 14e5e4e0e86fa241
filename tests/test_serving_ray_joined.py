"""`rolldiff serve --ray --ray-address`: a server that joins a cluster someone else started with `ray start` (as on
several hosts), serves on it, and at SIGTERM leaves it as it found it: the cluster runs on, and a second server can
take the first one's place. A real `ray start --head` process, a real subprocess server, real WebSocket clients; every
wait bounded. Its own module, so the Ray fixture server of `test_serving_ray.py` is stopped before this cluster
starts (two clusters at once would share 2 cores)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from serve_helpers import (
    FRAMES,
    RAY_TOKEN,
    RED,
    RayServer,
    free_port,
    library_references,
    ray_driver,
    refused_joining,
    until,
)

from rolldiff.serving import connect

pytest.importorskip("ray", reason="the [ray] extra is not installed")

pytestmark = pytest.mark.usefixtures("one_ray_cluster_at_a_time")  # (conftest) under pytest-xdist too
RAY = str(Path(sys.executable).parent / "ray")


def _answers(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


@pytest.fixture
def head():
    """`ray start --head --block` on a free port with 2 CPUs, in a short temporary folder of its own (Unix socket paths
    are short), in a process group of its own; the process and its port. Killed after, the group at once."""
    port = free_port()
    temp = tempfile.mkdtemp(prefix="rh", dir="/tmp")
    command = [RAY, "start", "--head", "--block", "--port", str(port), "--num-cpus", "2", "--temp-dir", temp]
    command += ["--include-dashboard", "false", "--disable-usage-stats"]
    log = Path(temp) / "ray-start.log"
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert until(lambda: _answers(port) or process.poll() is not None, 90), log.read_text()
        assert process.poll() is None, log.read_text()
        yield process, port
    finally:
        # its GCS, raylet and workers at once: a SIGTERM takes Ray 33 s, and `ray stop` stops every cluster here
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        shutil.rmtree(temp, ignore_errors=True)


def test_a_server_joins_a_ray_start_cluster_serves_and_leaves_it_as_it_found_it(head, tmp_path):
    """Serve started by the command is stopped with it (its proxy would hold the port for the next server: a second
    server announced its own port and was not there); a Serve that ran before is kept, and one whose proxy listens
    elsewhere is refused by name instead of deploying behind a port nobody was told."""
    process, port = head
    address = f"127.0.0.1:{port}"
    first = RayServer("--ray", "--ray-address", address, "--replicas", "1", env=RAY_TOKEN)
    assert first.ray_address.endswith(f":{port}")  # the head node's own IP
    with connect(first.url, prompt=RED, seed=3, num_frames=FRAMES) as live:
        chunks = list(live)
    assert live.done["type"] == "done"
    expected = library_references(tmp_path)(seed=3)
    assert len(chunks) == len(expected) and all((g == w).all() for g, w in zip(chunks, expected))
    assert first.stop(signal.SIGTERM) == 0
    assert process.poll() is None and _answers(port)  # the cluster is not the command's to stop
    assert until(lambda: not _answers(first.port), 10)  # nor does its Serve hold the port on

    theirs = free_port()  # someone's Serve, started before ours: its proxy is the cluster's
    ray_driver(address, f"serve.start(http_options={{'port': {theirs}}})")
    refusal = refused_joining(address)
    assert f"HTTP proxy on 127.0.0.1:{theirs} (one per cluster); give --host 127.0.0.1 --port {theirs}" in refusal
    second = RayServer("--ray", "--ray-address", address, "--replicas", "1", port=theirs, env=RAY_TOKEN)
    try:
        assert second.http("/healthz")["replica_sessions"] == [0]
    finally:
        assert second.stop(signal.SIGTERM) == 0
    assert process.poll() is None and _answers(theirs)  # their Serve serves on

"""`rolldiff serve --workers 2`: two server processes behind one port, as users meet it. A real process tree on
127.0.0.1, real WebSocket clients; where a session lives is read from `/healthz`'s `worker_sessions`. Every loop
that waits is bounded in count and time."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from serve_helpers import (
    FRAMES,
    RED,
    Server,
    free_port,
    killed_then_restored,
    library_references,
    max_difference,
    process_tree,
    round_robin,
    until,
)

from rolldiff.cli import main
from rolldiff.serving import ProtocolError, connect, restore
from rolldiff.serving.workers import SWEEP_S


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sessions")


@pytest.fixture(scope="module")
def server(state_dir):
    server = Server("--workers", "2", "--state-dir", str(state_dir), "--max-sessions", "4")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return library_references(tmp_path_factory.mktemp("references"))


def _settled(server: Server) -> None:
    """No session left, and the workers' counts of open connections swept since the last request (`healthz` polls
    are connections too), so the next connections spread as the board says."""
    assert server.sessions_within(0, 15)
    time.sleep(4 * SWEEP_S)


def _health(server: Server) -> dict:
    """`/healthz`, before a new connection: the poll is a connection too, so wait until its worker has swept it."""
    health = server.http("/healthz")
    time.sleep(4 * SWEEP_S)
    return health


def _worker_pids(server: Server) -> list[int]:
    """The server's worker processes (those that run `spawn_main`, not multiprocessing's resource tracker)."""
    return [pid for pid in process_tree(server.process.pid)[1:] if b"spawn_main" in _command_line(pid)]


def _command_line(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:  # gone since it was listed
        return b""


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
    except FileNotFoundError:
        return True
    return state in "ZX"  # a zombie no one has reaped yet is dead too


# ---------------------------------------------------------------------------------------- sessions
def test_model_and_health_describe_every_worker(server):
    assert server.http("/v1/model")["workers"] == 2
    health = server.http("/healthz")
    assert health["worker_sessions"] == [0, 0] and health["sessions"] == 0 and health["max_sessions"] == 4


def test_a_lone_session_is_the_librarys_video_bit_for_bit(server, references):
    with connect(server.url, prompt=RED, seed=3, num_frames=FRAMES) as live:
        chunks = list(live)
    expected = references(seed=3)
    assert len(chunks) == len(expected) == 8 and all((g == w).all() for g, w in zip(chunks, expected))


def test_sessions_spread_evenly_over_the_workers_and_each_stays_within_2_of_255_of_its_solo_run(server, references):
    _settled(server)
    clients = {seed: connect(server.url, prompt=RED, seed=seed, num_frames=FRAMES) for seed in (3, 4, 5, 6)}
    try:
        assert server.http("/healthz")["worker_sessions"] == [2, 2]  # each worker batches its share
        made = round_robin(clients, limit=20)
    finally:
        for client in clients.values():
            client.close()
    for seed, chunks in made.items():
        assert max_difference(chunks, references(seed=seed), min_chunks=8) <= 2, seed
    health = server.http("/healthz")
    assert health["batched_rows"] > 0  # summed over the workers
    assert server.sessions_within(0, 15)


def test_max_sessions_counts_every_workers_sessions(server):
    _settled(server)
    clients = [connect(server.url, prompt=RED, num_frames=None) for _ in range(4)]
    try:
        for client in clients:
            client.pause()
        assert server.http("/healthz")["worker_sessions"] == [2, 2]
        with pytest.raises(ProtocolError) as refused:  # the fifth, whichever worker takes it
            connect(server.url, prompt=RED, num_frames=None)
        assert refused.value.code == "busy"
        clients.pop().close()
        assert server.sessions_within(3, 15)
        with connect(server.url, prompt=RED, num_frames=3) as again:  # room again
            assert len(list(again)) == 1
    finally:
        for client in clients:
            client.close()
    assert server.sessions_within(0, 15)


def test_a_session_suspended_in_one_worker_is_restored_in_the_other(server, references):
    _settled(server)
    holder = connect(server.url, prompt=RED, num_frames=None)  # keeps one worker busier, so the next goes elsewhere
    holder.pause()
    first = _health(server)["worker_sessions"].index(1)
    live = connect(server.url, prompt=RED, seed=3, num_frames=FRAMES)
    assert server.http("/healthz")["worker_sessions"] == [1, 1]
    chunks = [next(live), next(live)]
    live.pause()
    token = live.suspend()
    chunks += list(live)  # made before the cut
    assert until(lambda: server.http("/healthz")["worker_sessions"][1 - first] == 0)
    time.sleep(4 * SWEEP_S)  # the connection counts are swept every SWEEP_S
    other = connect(server.url, prompt=RED, num_frames=None)  # takes the suspending worker's free place
    other.pause()
    assert server.http("/healthz")["worker_sessions"] == [1, 1]
    holder.close()  # the first worker now has the fewest connections: the restore goes there
    assert until(lambda: server.http("/healthz")["worker_sessions"][first] == 0)
    time.sleep(4 * SWEEP_S)  # the connection counts are swept every SWEEP_S
    try:
        with restore(server.url, token) as resumed:
            sessions = server.http("/healthz")["worker_sessions"]
            assert sessions[first] == 1 and sessions[1 - first] == 1  # the restored session is in the first worker
            chunks += list(resumed)
    finally:
        other.close()
    expected = references(seed=3)
    assert len(chunks) == len(expected) and all((g == w).all() for g, w in zip(chunks, expected))


def test_a_worker_that_dies_is_replaced(server):
    victim = _worker_pids(server)[0]
    os.kill(victim, signal.SIGKILL)
    assert until(lambda: len(_worker_pids(server)) == 2 and victim not in _worker_pids(server), 60)
    assert until(lambda: "starting a new one" in server.log.read_text())
    for _ in range(2):  # one session on each worker, the new one included
        with connect(server.url, prompt=RED, num_frames=3) as live:
            assert len(list(live)) == 1
    assert server.http("/healthz")["sessions"] in (0, 1, 2)  # answered: the board survived the worker


# ---------------------------------------------------------------------------------------- restarts
def test_sigterm_suspends_the_sessions_of_every_worker_and_a_new_server_restores_them(tmp_path, references):
    server = Server("--workers", "2", "--state-dir", str(tmp_path))
    _settled(server)
    lives = {seed: connect(server.url, prompt=RED, seed=seed, num_frames=FRAMES) for seed in (3, 4)}
    assert server.http("/healthz")["worker_sessions"] == [1, 1]
    chunks = {seed: [next(live), next(live)] for seed, live in lives.items()}
    for live in lives.values():
        live.pause()
    assert server.stop(signal.SIGTERM) == 0
    tokens = {}
    for seed, live in lives.items():
        chunks[seed] += list(live)
        assert live.done["type"] == "suspended" and live.done["reason"] == "shutdown"
        tokens[seed] = live.done["token"]
    again = Server("--workers", "2", "--state-dir", str(tmp_path))
    try:
        for seed, token in tokens.items():
            chunks[seed] += list(restore(again.url, token))
    finally:
        again.stop()
    for seed, got in chunks.items():
        expected = references(seed=seed)
        assert len(got) == len(expected) and all((g == w).all() for g, w in zip(got, expected)), seed
    assert list(tmp_path.glob("*.resume.safetensors")) == []


def test_sigkill_of_the_server_takes_its_workers_along_and_state_every_keeps_the_session(tmp_path, references):
    server = Server("--workers", "2", "--state-dir", str(tmp_path), "--state-every", "1")
    workers = _worker_pids(server)
    assert len(workers) == 2

    def workers_gone() -> None:  # no orphan keeps serving (or holds the port)
        assert until(lambda: all(_gone(pid) for pid in workers), 10)

    def restart() -> Server:  # on the same port, at once
        return Server("--workers", "2", "--state-dir", str(tmp_path), port=server.port)

    chunks, start, rest = killed_then_restored(server, restart, workers_gone)
    expected = references(seed=3)
    assert start == len(chunks) < 8
    assert all((g == w).all() for g, w in zip(chunks + rest, expected)) and len(chunks + rest) == 8


# ---------------------------------------------------------------------------------------- refusals
def test_workers_on_a_gpu_are_refused_naming_the_flag(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["serve", "--workers", "2", "--device", "cuda", "--port", str(free_port())]) == 2
    error = capsys.readouterr().err
    assert "--workers 2" in error and "one server per device" in error


def test_more_workers_than_cores_are_refused_before_any_starts(capsys):
    cores = os.cpu_count() or 1
    assert main(["serve", "--workers", str(cores + 1), "--port", str(free_port())]) == 2
    assert f"--workers {cores + 1}: at most one per core, and this machine has {cores}" in capsys.readouterr().err


def test_workers_below_1_are_refused(capsys):
    assert main(["serve", "--workers", "0"]) == 2
    assert "argument --workers: expected a finite int > 0, got '0'" in capsys.readouterr().err


def test_a_worker_that_cannot_load_the_model_stops_the_server_with_its_reason(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    assert (
        main(["serve", "--workers", "2", "--device", "cpu", "--model", str(missing), "--port", str(free_port())]) == 2
    )
    error = capsys.readouterr().err
    assert error.startswith("rolldiff: error:") and "no-such-model" in error

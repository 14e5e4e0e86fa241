"""`rolldiff serve --ray`: the server as Ray Serve replicas, as users meet it. One real command (a real local Ray
cluster on this machine, two replicas) shared by the tests of this file, real WebSocket clients on 127.0.0.1; where a
session lives is read from `/healthz`'s `replica_sessions` and `replicas`. Every loop that waits is bounded in count
and time. The board's admission and the shared store are also checked in this process, without Ray."""

from __future__ import annotations

import signal
import time
from contextlib import ExitStack
from pathlib import Path

import pytest
from serve_helpers import (
    FRAMES,
    RED,
    RayServer,
    free_port,
    library_references,
    process_tree,
    refused_joining,
    until,
)

from rolldiff.serving import ProtocolError, connect, restore
from rolldiff.serving.board import FIELDS

pytest.importorskip("ray.serve", reason='pip install "rolldiff[ray]" (the dev extra) to run it')

from rolldiff.serving import ray_board  # noqa: E402 (Ray is an extra)

pytestmark = pytest.mark.usefixtures("one_ray_cluster_at_a_time")  # (conftest) under pytest-xdist too
ROUTED_S = 1.5  # Serve's proxy counts a replica's open requests when they end, a moment after its session did


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sessions")


@pytest.fixture(scope="module")
def server(state_dir):
    """Two replicas, sessions saved after every chunk under a `file://` URL (the fsspec store). RAY_ADDRESS names
    a head that is not there, as a stale `ray start` leaves it (or its /tmp/ray file): without `--ray-address` the
    command starts a cluster of its own all the same (`ray.init()` would join that one, and failed)."""
    saved = ("--state-dir", state_dir.as_uri(), "--state-every", "1")
    stale_head = {"RAY_ADDRESS": f"127.0.0.1:{free_port()}"}
    server = RayServer("--ray", "--replicas", "2", *saved, "--max-sessions", "3", env=stale_head)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return library_references(tmp_path_factory.mktemp("references"))


def _sessions(server: RayServer) -> list[int]:
    return server.http("/healthz")["replica_sessions"]


def _idle(server: RayServer) -> bool:
    """No session, and Serve's proxy has counted their requests' ends: it routes by those counts, and one it still
    counts sends the next session to the other replica (a CI run put two on one replica that way)."""
    if not server.sessions_within(0):
        return False
    time.sleep(ROUTED_S)
    return True


def _same(got: list, want: list) -> bool:
    return len(got) == len(want) and all((g == w).all() for g, w in zip(got, want))


# ---------------------------------------------------------------------------------------- sessions
def test_model_and_health_describe_every_replica(server):
    model = server.http("/v1/model")
    assert model["replicas"] == 2 and model["protocol"] == "rolldiff-stream/1"
    health = server.http("/healthz")
    assert health["replica_sessions"] == [0, 0] and len(set(health["replicas"])) == 2
    assert health["sessions"] == 0 and health["max_sessions"] == 3


def test_a_lone_session_is_the_librarys_video_bit_for_bit(server, references):
    with connect(server.url, prompt=RED, seed=3, num_frames=FRAMES) as live:
        chunks = list(live)
    assert len(chunks) == 8 and _same(chunks, references(seed=3))


def test_sessions_spread_over_both_replicas(server, references):
    assert _idle(server)
    lives = {seed: connect(server.url, prompt=RED, seed=seed, num_frames=FRAMES) for seed in (3, 4)}
    try:
        assert _sessions(server) == [1, 1]  # each alone on its replica: each is the library's video
        made = {seed: list(live) for seed, live in lives.items()}
    finally:
        for live in lives.values():
            live.close()
    for seed, chunks in made.items():
        assert _same(chunks, references(seed=seed)), seed


def test_max_sessions_counts_every_replicas_sessions(server):
    assert _idle(server)
    lives = [connect(server.url, prompt=RED, num_frames=None) for _ in range(3)]
    try:
        for live in lives:
            live.pause()
        assert sorted(_sessions(server)) == [1, 2]
        with pytest.raises(ProtocolError) as refused:  # the fourth, whichever replica takes it
            connect(server.url, prompt=RED, num_frames=None)
        assert refused.value.code == "busy"
        lives.pop().close()
        assert server.sessions_within(2)
        with connect(server.url, prompt=RED, num_frames=3) as again:  # room again
            assert len(list(again)) == 1
    finally:
        for live in lives:
            live.close()
    assert server.sessions_within(0)


def test_a_session_suspended_on_one_replica_restores_on_the_other(server, references):
    assert _idle(server)
    with ExitStack() as clients:  # closed however the test ends: the next tests start from no session
        holder = clients.enter_context(connect(server.url, prompt=RED, num_frames=None))  # its replica is busier
        holder.pause()  # (no `/healthz` before the next: Serve's proxy counts that request too, a moment longer)
        live = clients.enter_context(connect(server.url, prompt=RED, seed=3, num_frames=FRAMES))
        assert _sessions(server) == [1, 1]
        chunks = [next(live), next(live)]
        live.pause()
        token = live.suspend()
        chunks += list(live)  # made before the cut
        assert until(lambda: sum(_sessions(server)) == 1)
        first = _sessions(server).index(1)  # the holder's replica
        time.sleep(ROUTED_S)
        other = clients.enter_context(connect(server.url, prompt=RED, num_frames=None))  # takes the free place
        other.pause()
        assert _sessions(server) == [1, 1]
        holder.close()  # the first replica now has the fewest requests: the restore goes there
        assert until(lambda: _sessions(server)[first] == 0)
        resumed = _restored_on(server, first, token, chunks, clients)
        assert _sessions(server) == [1, 1]  # in the first replica, beside `other`'s
        chunks += list(resumed)
    assert _same(chunks, references(seed=3))


def _restored_on(server: RayServer, replica: int, token: str, chunks: list, clients: ExitStack, tries: int = 4):
    """The session of `token` restored on `replica` (the one with no session). Serve's router picks by request counts
    it refreshes a moment late, and a CI run once sent the restore to the busy replica: then the session is suspended
    again (its chunks kept in `chunks`) and restored again, at most `tries` times. Each restore must continue at the
    chunk the last one stopped at."""
    for _ in range(tries):
        time.sleep(ROUTED_S)
        resumed = clients.enter_context(restore(server.url, token))
        assert resumed.ready["next_chunk"] == len(chunks)
        if _sessions(server)[replica] == 1:
            return resumed
        resumed.pause()
        token = resumed.suspend()
        chunks += list(resumed)  # made before the cut
        assert until(lambda: _sessions(server)[replica] == 0 and sum(_sessions(server)) == 1)
    pytest.fail(f"Serve's router sent the restore to the busy replica {tries} times: {_sessions(server)}")


def test_the_page_plays_from_a_replica(server, tmp_path):
    pytest.importorskip("playwright.sync_api", reason="pip install playwright (the dev extra) to run it")
    from browser_helpers import CHROMIUM_FLAGS, chromium_or_skip, open_page

    chromium = chromium_or_skip("`rolldiff serve --ray`")
    for page in open_page(chromium, tmp_path / "profile", CHROMIUM_FLAGS):
        page.goto(f"http://127.0.0.1:{server.port}/")
        page.wait_for_function("() => document.querySelector('#model').innerText.includes('KreaRealtime')")
        page.click("#start")
        page.wait_for_function("() => +document.querySelector('#frames').innerText >= 6", timeout=60_000)
        page.click("#stop")
        page.wait_for_function("() => document.querySelector('#status').innerText.startsWith('done')", timeout=30_000)
    assert server.sessions_within(0)


def test_a_killed_replicas_session_restores_on_a_live_one(server, references):
    assert server.sessions_within(0)
    live = connect(server.url, prompt=RED, seed=3, num_frames=FRAMES)
    token = live.ready["token"]
    chunks = [next(live), next(live), next(live)]
    live.pause()
    time.sleep(1.0)  # what the replica made ahead goes out (and its state is written) while the session is paused
    health = server.http("/healthz")
    victim = health["replicas"][health["replica_sessions"].index(1)]
    server.kill_replica(victim)
    chunks += list(live)  # everything that reached the client before the kill
    live.close()
    assert until(lambda: victim not in server.http("/healthz")["replicas"], 15)  # its row counts no more
    with restore(server.url, token) as resumed:
        assert resumed.ready["next_chunk"] == len(chunks) < 8
        chunks += list(resumed)
    assert _same(chunks, references(seed=3))
    assert until(lambda: len(server.http("/healthz")["replicas"]) == 2, 90)  # Serve started a new replica


def test_a_second_server_joining_the_cluster_is_refused_and_the_first_serves_on(server, references):
    """One rolldiff server per cluster (Serve has one HTTP proxy per cluster): a second command that joins it is
    refused by name, and its exit deletes nothing of the first's (the application, the board)."""
    refusal = refused_joining(server.ray_address)
    assert f"--ray-address {server.ray_address}: a rolldiff server already serves on this cluster" in refusal
    assert len(server.http("/healthz")["replicas"]) == 2
    with connect(server.url, prompt=RED, seed=3, num_frames=FRAMES) as live:
        chunks = list(live)
    assert len(chunks) == 8 and _same(chunks, references(seed=3))


def test_sigterm_suspends_the_sessions_then_stops_serve_and_the_cluster(server):
    """Last: it stops the shared server."""
    assert server.sessions_within(0)
    live = connect(server.url, prompt=RED, seed=3, num_frames=None)
    next(live)
    live.pause()
    tree = process_tree(server.process.pid)
    assert len(tree) > 5  # the command, Ray's GCS and raylet, Serve's controller and proxy, the replicas, ...
    assert server.stop(signal.SIGTERM) == 0
    list(live)
    assert live.done["type"] == "suspended" and live.done["reason"] == "shutdown"
    assert until(lambda: all(not Path(f"/proc/{pid}").exists() or _zombie(pid) for pid in tree), 30)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "ZX"
    except FileNotFoundError:
        return True


# ---------------------------------------------------------------------------------------- the board, without Ray
def test_the_board_admits_against_every_live_replicas_total():
    board = ray_board.Board()
    assert [board.reserve("a", 3), board.reserve("b", 3), board.reserve("a", 3)] == [True, True, True]
    assert not board.reserve("b", 3)  # the fourth, on either replica
    board.add("a", "sessions", -1)  # a session of `a` ended
    assert board.reserve("b", 3)
    health = board.health()
    assert health["replica_sessions"] == [1, 2] and health["replicas"] == ["a", "b"] and health["sessions"] == 3


def test_a_random_walk_of_admissions_never_exceeds_the_limit():
    import random

    board, rng, held = ray_board.Board(), random.Random(0), {"a": 0, "b": 0, "c": 0}
    for replica in held:
        board.beat(replica)  # each joins
    for _ in range(2000):
        replica = rng.choice(list(held))
        if rng.random() < 0.5 and held[replica]:
            board.add(replica, "sessions", -1)
            held[replica] -= 1
        elif board.reserve(replica, 4):
            held[replica] += 1
        assert board.health()["replica_sessions"] == list(held.values()) and sum(held.values()) <= 4


def test_a_replica_not_heard_from_counts_no_more(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(ray_board.time, "monotonic", lambda: now[0])
    board = ray_board.Board()
    assert board.reserve("dead", 1)
    board.beat("live")
    now[0] += ray_board.STALE_S / 2
    board.beat("live")
    assert not board.reserve("live", 1)
    now[0] += ray_board.STALE_S / 2 + 0.1  # `dead` has not beaten since its session: it died with it
    assert board.reserve("live", 1)
    assert board.health()["replicas"] == ["live"] and board.undrained() == ["live"]
    board.stop()
    assert board.beat("live") is True
    board.drained("live")
    assert board.undrained() == []


def test_the_board_keeps_every_field_of_the_shared_memory_board():
    board = ray_board.Board()
    for field in FIELDS:
        board.set("a", field, 2)
    board.clear("a")
    assert all(board.column(field) == [0] for field in FIELDS)

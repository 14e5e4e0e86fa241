"""`ServerBoard`: the counts a `--workers` server's processes share. Admission against the total, the fewest-open
rule for taking a connection, and a dead worker's row cleared; checked here in one process, with real sockets (the
workers themselves are tested as processes in `test_serving_workers.py`)."""

from __future__ import annotations

import random
import socket

import pytest

from rolldiff.serving import board as board_module
from rolldiff.serving.board import FIELDS, TAKE_ALWAYS_S, TAKE_ANYWAY_S, ServerBoard


class Listener:
    """A listening loopback socket (non-blocking, as the workers' is) and `knock()`: one client connects."""

    def __init__(self) -> None:
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.socket.setblocking(False)
        self.clients: list[socket.socket] = []

    def knock(self) -> None:
        self.clients.append(socket.create_connection(self.socket.getsockname(), timeout=5))

    def close(self) -> None:
        for client in self.clients:
            client.close()
        self.socket.close()


@pytest.fixture
def listener():
    listener = Listener()
    yield listener
    listener.close()


def test_sessions_are_reserved_against_every_workers_total():
    board = ServerBoard(3)
    rows = [board.row(worker) for worker in range(3)]
    assert rows[0].reserve_session(4) and rows[1].reserve_session(4) and rows[1].reserve_session(4)
    assert rows[2].reserve_session(4)
    assert not any(row.reserve_session(4) for row in rows)  # 4 in all, wherever they are
    assert board.column("sessions") == [1, 2, 1] and board.total("sessions") == 4
    rows[1].add("sessions", -1)  # a session dropped
    assert rows[0].reserve_session(4) and board.column("sessions") == [2, 1, 1]


def test_a_random_walk_never_admits_more_than_the_limit():
    board, limit = ServerBoard(2), 3
    rows = [board.row(0), board.row(1)]
    walk = random.Random(0)
    held = [0, 0]
    for _ in range(300):
        worker = walk.randrange(2)
        if walk.random() < 0.6:
            admitted = rows[worker].reserve_session(limit)
            assert admitted == (sum(held) < limit)
            held[worker] += admitted
        elif held[worker]:
            rows[worker].add("sessions", -1)
            held[worker] -= 1
        assert board.column("sessions") == held


def test_a_connection_is_taken_by_the_worker_with_the_fewest_open(listener):
    board = ServerBoard(2)
    first, second = board.row(0), board.row(1)
    accepted = []
    listener.knock()
    accepted.append(first.accept_if_fewest(listener.socket))  # a tie: whoever comes first
    listener.knock()
    assert first.accept_if_fewest(listener.socket) is None  # 1 open against 0: the other's turn
    accepted.append(second.accept_if_fewest(listener.socket))
    listener.knock()
    accepted.append(first.accept_if_fewest(listener.socket, waited_s=TAKE_ALWAYS_S))  # left waiting: anyone takes it
    assert all(isinstance(connection, socket.socket) for connection in accepted)
    assert board.column("connections") == [2, 1] and board.total("accepted") == 3
    assert second.accept_if_fewest(listener.socket) is None  # nothing waiting: nothing taken, nothing counted
    assert board.column("connections") == [2, 1]
    for connection in accepted:
        connection.close()


def test_a_waiting_connection_is_taken_out_of_turn_only_from_a_worker_that_stopped_sweeping(listener, monkeypatch):
    """The fewest worker keeps its turn while it sweeps (a busy machine only slows it; CI placed two sessions in one
    worker of two where any worker took what waited 0.25 s); one whose sweeps stopped, stuck or dead, loses it."""
    now = [100.0]
    monkeypatch.setattr(board_module.time, "monotonic", lambda: now[0])
    board = ServerBoard(3)
    busy, fewest, other = board.row(0), board.row(1), board.row(2)
    busy.swept(2)
    fewest.swept(0)
    other.swept(1)
    listener.knock()
    now[0] += 1.0  # nobody swept since: all silent for 1 s
    for waited in (0.0, TAKE_ANYWAY_S / 2):
        assert busy.accept_if_fewest(listener.socket, waited_s=waited) is None  # not yet
    fewest.swept(0)  # alive again
    for waited in (TAKE_ANYWAY_S, TAKE_ALWAYS_S / 2):
        assert busy.accept_if_fewest(listener.socket, waited_s=waited) is None  # its turn, however long it takes
        assert other.accept_if_fewest(listener.socket, waited_s=waited) is None
    now[0] += TAKE_ANYWAY_S * 1.01  # silent since: stuck in a chunk
    assert busy.accept_if_fewest(listener.socket, waited_s=0.0) is None  # a new wait: its turn first
    other.swept(1)  # fewer than `busy` too, but sweeping: still not `busy`'s to take
    assert busy.accept_if_fewest(listener.socket, waited_s=TAKE_ANYWAY_S) is None
    taken = other.accept_if_fewest(listener.socket, waited_s=TAKE_ANYWAY_S)  # only the silent one has fewer
    assert isinstance(taken, socket.socket) and board.column("connections") == [2, 0, 2]
    taken.close()
    listener.knock()
    fewest.swept(0)
    assert isinstance(taken := busy.accept_if_fewest(listener.socket, waited_s=TAKE_ALWAYS_S), socket.socket)
    taken.close()  # after TAKE_ALWAYS_S anyone takes it, sweeping or not
    listener.knock()
    assert other.accept_if_fewest(listener.socket, waited_s=TAKE_ANYWAY_S) is None  # `fewest` swept just now
    board.clear(1)  # it died: no sweeps, so its empty row holds the connection back no more
    assert isinstance(taken := other.accept_if_fewest(listener.socket, waited_s=TAKE_ANYWAY_S), socket.socket)
    taken.close()


def test_a_dead_workers_row_is_cleared_and_rows_are_named():
    board = ServerBoard(2)
    row = board.row(1)
    for field in FIELDS:
        row.add(field, 5)
    row.clear()
    assert all(board.column(field) == [0, 0] for field in FIELDS)
    with pytest.raises(ValueError, match="`worker` is 0 to 1, got 2"):
        board.row(2)

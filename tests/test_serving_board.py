"""`ServerBoard`: the counts a `--workers` server's processes share. Admission against the total, the fewest-open
rule for taking a connection, and a dead worker's row cleared; checked here in one process, with real sockets (the
workers themselves are tested as processes in `test_serving_workers.py`)."""

from __future__ import annotations

import random
import socket

import pytest

from rolldiff.serving.board import FIELDS, ServerBoard


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
    accepted.append(first.accept_if_fewest(listener.socket, anyway=True))  # left waiting: anyone takes it
    assert all(isinstance(connection, socket.socket) for connection in accepted)
    assert board.column("connections") == [2, 1] and board.total("accepted") == 3
    assert second.accept_if_fewest(listener.socket) is None  # nothing waiting: nothing taken, nothing counted
    assert board.column("connections") == [2, 1]
    for connection in accepted:
        connection.close()


def test_a_dead_workers_row_is_cleared_and_rows_are_named():
    board = ServerBoard(2)
    row = board.row(1)
    for field in FIELDS:
        row.add(field, 5)
    row.clear()
    assert all(board.column(field) == [0, 0] for field in FIELDS)
    with pytest.raises(ValueError, match="`worker` is 0 to 1, got 2"):
        board.row(2)

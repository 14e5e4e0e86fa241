"""What the worker processes of one `rolldiff serve` count together, in shared memory: each worker's open
connections, sessions and batching counters, one row per worker. `/healthz` sums the rows, admission
(`--max-sessions`) reserves a session against the total under one lock, and the workers' acceptors take a new
connection in the worker with the fewest open (`rolldiff.serving.workers`). A one-process server has a board of
one row, so every count has one home whatever the number of workers.
"""

from __future__ import annotations

import multiprocessing
import socket
from typing import Any

FIELDS = ("connections", "accepted", "sessions", "batched_rows", "batched_decodes", "side_by_side_groups")
HEALTH_TOTALS = ("sessions", "batched_rows", "batched_decodes", "side_by_side_groups")  # what `/healthz` sums


class ServerBoard:
    """`workers` rows of `FIELDS`, shared by every process it is handed to when they start."""

    def __init__(self, workers: int = 1, context=None) -> None:
        context = context or multiprocessing.get_context("spawn")
        self.workers = workers
        self._lock = context.Lock()
        self._values = context.RawArray("q", workers * len(FIELDS))

    def row(self, worker: int) -> WorkerRow:
        if not 0 <= worker < self.workers:
            raise ValueError(f"`worker` is 0 to {self.workers - 1}, got {worker}")
        return WorkerRow(self, worker)

    def _at(self, worker: int, field: str) -> int:
        return worker * len(FIELDS) + FIELDS.index(field)

    def _column(self, field: str) -> list[int]:
        return [self._values[self._at(worker, field)] for worker in range(self.workers)]

    def total(self, field: str) -> int:
        with self._lock:
            return sum(self._column(field))

    def column(self, field: str) -> list[int]:
        with self._lock:
            return self._column(field)

    def health(self) -> dict[str, Any]:
        """The counts `/healthz` reports, read under one lock: each of `HEALTH_TOTALS` summed over the workers, and
        each worker's sessions."""
        with self._lock:
            totals = {field: sum(self._column(field)) for field in HEALTH_TOTALS}
            return {**totals, "worker_sessions": self._column("sessions")}

    def describe(self) -> dict[str, Any]:
        """What `/v1/model` says of the server's processes."""
        return {"workers": self.workers}

    def add(self, worker: int, field: str, amount: int = 1) -> None:
        with self._lock:
            self._values[self._at(worker, field)] += amount

    def set(self, worker: int, field: str, value: int) -> None:
        with self._lock:
            self._values[self._at(worker, field)] = value

    def clear(self, worker: int) -> None:
        """A worker that died: its connections and sessions died with it (a new one starts from nothing)."""
        with self._lock:
            for field in FIELDS:
                self._values[self._at(worker, field)] = 0

    def reserve_session(self, worker: int, limit: int) -> bool:
        """Count a new session in `worker`'s row if the server (all workers) has fewer than `limit`; the scheduler
        gives it back when the session is dropped (`add(worker, "sessions", -1)`)."""
        with self._lock:
            if sum(self._column("sessions")) >= limit:
                return False
            self._values[self._at(worker, "sessions")] += 1
            return True

    def accept_if_fewest(self, worker: int, listener: socket.socket, anyway: bool = False) -> socket.socket | None:
        """Accept the next pending connection for `worker` if it has the fewest open (ties: whoever comes first), or
        `anyway`; None when it is another worker's turn or another took it. Decided and counted under the lock, so
        two workers never both take "the fewest" slot."""
        with self._lock:
            counts = self._column("connections")
            if not anyway and counts[worker] > min(counts):
                return None
            try:
                connection, _ = listener.accept()
            except OSError:  # nothing waiting (another took it), or the client gave up in between
                return None
            self._values[self._at(worker, "connections")] += 1
            self._values[self._at(worker, "accepted")] += 1
            return connection


class WorkerRow:
    """One worker's row of the board: what that worker writes, and the decisions it makes against the others."""

    def __init__(self, board: ServerBoard, worker: int) -> None:
        self.board = board
        self.worker = worker

    def add(self, field: str, amount: int = 1) -> None:
        self.board.add(self.worker, field, amount)

    def set(self, field: str, value: int) -> None:
        self.board.set(self.worker, field, value)

    def clear(self) -> None:
        self.board.clear(self.worker)

    def reserve_session(self, limit: int) -> bool:
        return self.board.reserve_session(self.worker, limit)

    def accept_if_fewest(self, listener: socket.socket, anyway: bool = False) -> socket.socket | None:
        return self.board.accept_if_fewest(self.worker, listener, anyway)

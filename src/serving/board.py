"""What the worker processes of one `rolldiff serve` count together, in shared memory: each worker's open
connections, sessions and batching counters, one row per worker. `/healthz` sums the rows, admission
(`--max-sessions`) reserves a session against the total under one lock, and the workers' acceptors take a new
connection in the worker with the fewest open (`rolldiff.serving.workers`). A one-process server has a board of
one row, so every count has one home whatever the number of workers.
"""

from __future__ import annotations

import multiprocessing
import socket
import time
from typing import Any

FIELDS = ("connections", "accepted", "sessions", "batched_rows", "batched_decodes", "side_by_side_groups")
HEALTH_TOTALS = ("sessions", "batched_rows", "batched_decodes", "side_by_side_groups")  # what `/healthz` sums
# A connection the fewest left waiting this long is taken by another worker if each with fewer has not swept its count
# in as long (its event loop is stuck in a chunk, or it died) ...
TAKE_ANYWAY_S = 0.25
# ... and by any worker after this long whatever the board says (a worker that sweeps but never accepts)
TAKE_ALWAYS_S = 2.0


class ServerBoard:
    """`workers` rows of `FIELDS`, shared by every process it is handed to when they start."""

    def __init__(self, workers: int = 1, context=None) -> None:
        context = context or multiprocessing.get_context("spawn")
        self.workers = workers
        self._lock = context.Lock()
        self._values = context.RawArray("q", workers * len(FIELDS))
        self._swept_at = context.RawArray("d", workers)  # each worker's last sweep, `time.monotonic()` (system-wide)

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
            self._swept_at[worker] = 0.0

    def swept(self, worker: int, connections: int) -> None:
        """`worker` recounted its open connections: the count, and that its event loop is alive (`accept_if_fewest`)."""
        with self._lock:
            self._values[self._at(worker, "connections")] = connections
            self._swept_at[worker] = time.monotonic()

    def reserve_session(self, worker: int, limit: int) -> bool:
        """Count a new session in `worker`'s row if the server (all workers) has fewer than `limit`; the scheduler
        gives it back when the session is dropped (`add(worker, "sessions", -1)`)."""
        with self._lock:
            if sum(self._column("sessions")) >= limit:
                return False
            self._values[self._at(worker, "sessions")] += 1
            return True

    def accept_if_fewest(self, worker: int, listener: socket.socket, waited_s: float = 0.0) -> socket.socket | None:
        """Accept the next pending connection for `worker` if it has the fewest open (ties: whoever comes first); None
        when it is another worker's turn or another took it. A connection that has `waited_s` is taken out of turn
        only from a worker that is not sweeping (`TAKE_ANYWAY_S`; a busy machine slows a live one, which then takes
        it as its turn says), or after `TAKE_ALWAYS_S`. Decided and counted under the lock, so two workers never both
        take "the fewest" slot."""
        with self._lock:
            counts = self._column("connections")
            fewer = [other for other in range(self.workers) if counts[other] < counts[worker]]
            if fewer and waited_s < TAKE_ALWAYS_S:
                silent_since = time.monotonic() - TAKE_ANYWAY_S
                stuck = waited_s >= TAKE_ANYWAY_S and all(self._swept_at[other] < silent_since for other in fewer)
                if not stuck:
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

    def swept(self, connections: int) -> None:
        self.board.swept(self.worker, connections)

    def reserve_session(self, limit: int) -> bool:
        return self.board.reserve_session(self.worker, limit)

    def accept_if_fewest(self, listener: socket.socket, waited_s: float = 0.0) -> socket.socket | None:
        return self.board.accept_if_fewest(self.worker, listener, waited_s)

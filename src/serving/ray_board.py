"""The counts of a Ray Serve `rolldiff serve --ray`, kept in one named Ray actor: replicas may live on other hosts, so
the shared memory of `ServerBoard` cannot hold them. Same job, same interface: each replica writes its row (sessions,
batching counters), admission (`--max-sessions`) reserves a session against the total of every replica in one actor
call, `/healthz` reads every row in one call. The actor is touched once per admission, per session dropped and per
batched group's counters, never per denoising step; the counters are sent without waiting for an answer.

Rows are keyed by Serve's replica id. A replica beats every `BEAT_S` (a thread of its own, `ReplicaRow.beat_forever`);
a row not heard from in `STALE_S` is a dead replica's (a `ray.kill`, a lost host): it counts no more, so its
sessions, gone with it, stop taking admission places. Serve starts a new replica in its place, with a row of its own.
The beat's answer also carries the shutdown: the command sets `stop` and each replica suspends its sessions, then
says it has (`drained`), before Serve is shut down.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
from ray import cloudpickle

from .board import FIELDS, HEALTH_TOTALS

BOARD_NAME = "rolldiff-board"  # the actor's name in the `NAMESPACE` namespace, so every replica finds it
NAMESPACE = "rolldiff"
BEAT_S = 0.5  # how often a replica says it is alive
STALE_S = 5.0  # a replica not heard from in this long is dead; its row no longer counts
FORGET_S = 300.0  # and after this long it is dropped


class Board:
    """The actor's class (`ray.remote(Board)`): rows of `FIELDS` by replica id, in the order replicas joined. Its
    methods run one at a time, so each decision (a reservation against the total) is atomic."""

    def __init__(self) -> None:
        self._rows: dict[str, list[int]] = {}
        self._heard: dict[str, float] = {}
        self._stopping = False
        self._drained: set[str] = set()
        self._failure: str | None = None

    def _live(self) -> list[str]:
        now = time.monotonic()
        for replica in [r for r, heard in self._heard.items() if now - heard > FORGET_S]:
            del self._rows[replica], self._heard[replica]
        return [replica for replica, heard in self._heard.items() if now - heard <= STALE_S]

    def _row(self, replica: str) -> list[int]:
        self._heard[replica] = time.monotonic()  # whoever writes is alive
        return self._rows.setdefault(replica, [0] * len(FIELDS))

    def beat(self, replica: str) -> bool:
        """`replica` is alive (a new one joins); whether the server is stopping (then it suspends its sessions)."""
        self._row(replica)
        return self._stopping

    def add(self, replica: str, field: str, amount: int = 1) -> None:
        self._row(replica)[FIELDS.index(field)] += amount

    def set(self, replica: str, field: str, value: int) -> None:
        self._row(replica)[FIELDS.index(field)] = value

    def clear(self, replica: str) -> None:
        self._rows[replica] = [0] * len(FIELDS)

    def reserve(self, replica: str, limit: int) -> bool:
        """Count a new session in `replica`'s row if the live replicas have fewer than `limit` together."""
        row = self._row(replica)
        at = FIELDS.index("sessions")
        if sum(self._rows[r][at] for r in self._live()) >= limit:
            return False
        row[at] += 1
        return True

    def column(self, field: str) -> list[int]:
        return [self._rows[replica][FIELDS.index(field)] for replica in self._live()]

    def health(self) -> dict[str, Any]:
        """What `/healthz` reports: each of `HEALTH_TOTALS` summed over the live replicas, each one's sessions, and
        their ids (Serve's replica ids, in the same order)."""
        live = self._live()
        totals = {field: sum(self._rows[r][FIELDS.index(field)] for r in live) for field in HEALTH_TOTALS}
        return {**totals, "replica_sessions": self.column("sessions"), "replicas": live}

    def stop(self) -> None:
        self._stopping = True

    def drained(self, replica: str) -> None:
        self._drained.add(replica)

    def undrained(self) -> list[str]:
        """The live replicas that have not yet suspended their sessions since `stop`."""
        return [replica for replica in self._live() if replica not in self._drained]

    def fail(self, reason: str) -> None:
        """A replica could not start (its model would not load): the command stops, saying why."""
        self._failure = self._failure or reason

    def failure(self) -> str | None:
        return self._failure


def start_board() -> ray.actor.ActorHandle:
    """The board actor, named so replicas find it; it takes no CPU of the replicas' and dies with the command. Its
    class goes to Ray by value, so its process runs without importing rolldiff (torch and the models: 0.5 GB)."""
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return ray.remote(Board).options(name=BOARD_NAME, namespace=NAMESPACE, num_cpus=0).remote()


class RayBoard:
    """A replica's view of the whole board (what `ServerBoard` is to a worker): `/healthz` and `/v1/model` read it."""

    def __init__(self, actor: ray.actor.ActorHandle, replicas: int) -> None:
        self.actor = actor
        self.replicas = replicas

    def health(self) -> dict[str, Any]:
        return ray.get(self.actor.health.remote())

    def describe(self) -> dict[str, Any]:
        return {"workers": 1, "replicas": self.replicas}  # one process per replica

    def total(self, field: str) -> int:
        return sum(self.column(field))

    def column(self, field: str) -> list[int]:
        return ray.get(self.actor.column.remote(field))


class ReplicaRow:
    """One replica's row (the interface of `WorkerRow`): counters sent without waiting, admission answered."""

    def __init__(self, board: RayBoard, replica: str) -> None:
        self.board = board
        self.replica = replica

    def join(self) -> None:
        ray.get(self.board.actor.beat.remote(self.replica))

    def add(self, field: str, amount: int = 1) -> None:
        if amount:  # the scheduler adds its pass's counts, often 0: no call for those
            self.board.actor.add.remote(self.replica, field, amount)

    def set(self, field: str, value: int) -> None:
        self.board.actor.set.remote(self.replica, field, value)

    def clear(self) -> None:
        self.board.actor.clear.remote(self.replica)

    def reserve_session(self, limit: int) -> bool:
        return ray.get(self.board.actor.reserve.remote(self.replica, limit))

    def beat_forever(self, drain: Callable[[], None]) -> threading.Thread:
        """Beat every `BEAT_S` in a daemon thread; when the board says stop, `drain()` (suspend the sessions) once and
        say so. The thread ends when the board is gone (the command has ended)."""

        def run() -> None:
            drained = False
            while True:
                try:
                    stopping = ray.get(self.board.actor.beat.remote(self.replica), timeout=30)
                    if stopping and not drained:
                        drain()
                        drained = True
                        ray.get(self.board.actor.drained.remote(self.replica), timeout=30)
                except ray.exceptions.GetTimeoutError:  # a busy board: beat again
                    pass
                except ray.exceptions.RayActorError:  # the board is gone with the command
                    return
                time.sleep(BEAT_S)

        thread = threading.Thread(target=run, name="rolldiff-replica-beat", daemon=True)
        thread.start()
        return thread

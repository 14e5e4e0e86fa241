"""`rolldiff serve --workers N`: N server processes behind one socket, for a CPU with cores to spare.

Why processes: on a CPU a one-thread forward keeps one core busy, and two batched groups made side by side in threads
of one process share its GIL (measured on 2 cores, `benchmarks/cpu_threads.py`: two streams in two threads made
1.64x one stream, in two processes 2.02x). So each worker is a whole server (`create_app`: its own pipeline,
scheduler and sessions, its own event loop) on its own cores, and a session lives in one worker from `start` to
`done`: its controls, input frames and chunks never cross a process.

What they share: the listening socket, bound once by the parent, and a `ServerBoard` (shared memory). A worker takes
a new connection only while it has the fewest open (`WorkerRow.accept_if_fewest`; one the fewest left waiting is
taken by another only where the fewest stopped sweeping its count, stuck in a chunk or dead, or after
`board.TAKE_ALWAYS_S`), so sessions spread evenly, also on a busy machine, and each worker batches its share; admission
(`--max-sessions`) and `/healthz` count every worker's sessions. Suspended sessions go to the shared `--state-dir`,
so any worker restores any token.

The parent only supervises: it hands each SIGTERM / Ctrl-C on to the workers (at the first, each suspends its own
sessions, as a one-process server does; at a second they stop at once) and exits when they have; a worker that dies
is replaced. The workers die with the parent
(a SIGKILL of the parent takes them along, so the port is free for a restart at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn

from .app import ServeSettings, create_app
from .board import ServerBoard, WorkerRow
from .server import SuspendingServer, run_until_signalled, uvicorn_config

SWEEP_S = 0.05  # how often a worker recounts its open connections on the board (a few list checks)


@dataclass(frozen=True)
class WorkerSpec:
    """What each worker process is started with (pickled to it): how to load the pipeline and how to serve it."""

    load: Callable[[], object]  # a module-level function (or a partial of one): the pipeline, checked
    settings: ServeSettings
    host: str
    port: int
    threads: int  # torch threads per worker


class BalancedServer(SuspendingServer):
    """A worker's uvicorn server: it listens on no socket of its own; its acceptor takes connections from the
    shared listener when the board says it is this worker's turn, and hands each to uvicorn's HTTP protocol."""

    def __init__(
        self, config: uvicorn.Config, hub_of, listener: socket.socket, row: WorkerRow, serving: Callable[[], None]
    ) -> None:
        super().__init__(config, hub_of)
        self._listener = listener
        self._row = row
        self._serving = serving
        self._open: list[socket.socket] = []
        self._tasks: list[asyncio.Task] = []

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=[])  # no listening socket of uvicorn's: the acceptor below feeds it
        self._sweep()  # on the board as alive before its first turn
        self._tasks = [asyncio.create_task(self._accept()), asyncio.create_task(self._sweep_forever())]
        self._serving()

    async def shutdown(self, sockets=None) -> None:
        for task in self._tasks:
            task.cancel()
        await super().shutdown(sockets=sockets)

    def _protocol(self) -> asyncio.Protocol:
        """uvicorn's HTTP protocol for one connection, made as its own `startup` makes it for a listening socket."""
        return self.config.http_protocol_class(
            config=self.config, server_state=self.server_state, app_state=self.lifespan.state
        )

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        listener = self._listener
        listener.setblocking(False)
        waiting_since, accepted_then = None, None
        while True:
            await _readable(loop, listener)
            self._sweep()
            accepted = self._row.board.total("accepted")
            if waiting_since is None or accepted != accepted_then:  # a new wait (or the others took what waited)
                waiting_since, accepted_then = time.monotonic(), accepted
            connection = self._row.accept_if_fewest(listener, time.monotonic() - waiting_since)
            if connection is None:  # another worker's turn (or it took it first)
                await asyncio.sleep(0.002)
                continue
            waiting_since = None
            connection.setblocking(False)
            self._open.append(connection)
            try:
                await loop.connect_accepted_socket(self._protocol, connection)
            except OSError:  # the client was gone before it could be served: the next one
                connection.close()

    def _sweep(self) -> None:
        """Recount the open connections (a closed one's socket has fileno -1) and publish the count."""
        self._open = [connection for connection in self._open if connection.fileno() != -1]
        self._row.swept(len(self._open))

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            self._sweep()


async def _readable(loop: asyncio.AbstractEventLoop, listener: socket.socket) -> None:
    ready = loop.create_future()
    loop.add_reader(listener.fileno(), lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(listener.fileno())


# ---------------------------------------------------------------------------------------- in a worker
def _die_with_parent(parent: int) -> None:
    """Exit when the parent does (Linux: at once, by the kernel; elsewhere: within half a second)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    else:

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.5)
            os._exit(1)

        threading.Thread(target=watch, name="rolldiff-parent-watch", daemon=True).start()
    if os.getppid() != parent:  # the parent was gone before the above took effect
        os._exit(1)


def worker_main(
    spec: WorkerSpec, board: ServerBoard, worker: int, listener: socket.socket, reports, parent: int
) -> None:
    """One worker process: load the pipeline, then serve its share of the connections until SIGTERM."""
    _die_with_parent(parent)
    os.setpgid(0, 0)  # Ctrl-C in a terminal reaches the parent only; it forwards one SIGTERM
    import torch

    torch.set_num_threads(spec.threads)
    try:
        pipe = spec.load()
    except Exception as error:  # noqa: BLE001 (said to the parent, which stops the others and exits)
        reports.put(("error", worker, str(error)))
        return
    row = board.row(worker)
    app = create_app(pipe, spec.settings, row)
    config = uvicorn_config(app, spec.settings, spec.host, spec.port)

    def serving() -> None:  # the parent announces the server once every worker takes connections
        reports.put(("ready", worker, type(pipe).__name__))

    run_until_signalled(BalancedServer(config, app.state.get_hub, listener, row, serving))


# ---------------------------------------------------------------------------------------- the parent
class WorkerError(RuntimeError):
    """A worker could not start (its message is the reason: a bad model path, a refused default session)."""


class Supervisor:
    """The parent: binds the socket, starts the workers, forwards signals, replaces a worker that dies."""

    def __init__(self, spec: WorkerSpec, workers: int) -> None:
        self.spec = spec
        self.context = multiprocessing.get_context("spawn")  # torch's threads do not survive a fork
        self.board = ServerBoard(workers, self.context)
        self.reports = self.context.SimpleQueue()
        self.listener = _bind(spec.host, spec.port)
        self.processes: list = [None] * workers
        self.stopping = False

    def _start(self, worker: int) -> None:
        self.board.row(worker).clear()
        process = self.context.Process(
            target=worker_main,
            args=(self.spec, self.board, worker, self.listener, self.reports, os.getpid()),
            name=f"rolldiff-serve-worker-{worker}",
        )
        process.start()
        self.processes[worker] = process

    def start(self) -> str | None:
        """Start every worker and wait until each serves; the pipeline's class name, or None when a signal came
        first (the workers are stopped). Raises `WorkerError` (after stopping the others) when one cannot start."""
        for worker in range(len(self.processes)):
            self._start(worker)
        ready, name = set(), ""
        while len(ready) < len(self.processes):
            if self.stopping:  # SIGTERM / Ctrl-C while loading: nothing to suspend yet
                self.kill()
                return None
            if not self.reports.empty():
                kind, worker, text = self.reports.get()
                if kind == "error":
                    self.kill()
                    raise WorkerError(text)
                ready.add(worker)
                name = text
                continue
            gone = [p for p in self.processes if p.exitcode is not None]
            if gone:
                self.kill()
                raise WorkerError(f"worker {gone[0].name} exited ({gone[0].exitcode}) while loading")
            time.sleep(0.05)
        return name

    def forward(self, signum, frame) -> None:
        """SIGTERM / Ctrl-C: each worker suspends its sessions and exits; a second one stops them at once."""
        self.stopping = True
        for process in self.processes:
            if process is not None and process.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)

    def kill(self) -> None:
        for process in self.processes:
            if process is not None and process.exitcode is None:
                process.kill()
                process.join(timeout=10)

    def supervise(self) -> None:
        """Until the workers have exited after a signal; a worker that dies before then is replaced."""
        while True:
            live = [p for p in self.processes if p.exitcode is None]
            if not live:
                return
            multiprocessing.connection.wait([p.sentinel for p in live], timeout=1.0)
            while not self.reports.empty():
                kind, worker, text = self.reports.get()  # a replacement's "ready", or why it could not start
                if kind == "error":
                    raise WorkerError(f"worker {worker} could not be started again: {text}")
            for worker, process in enumerate(self.processes):
                if process.exitcode is not None and not self.stopping:
                    print(
                        f"rolldiff serve: worker {worker} exited ({process.exitcode}); starting a new one", flush=True
                    )
                    self._start(worker)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, port), family=family, backlog=2048)
    listener.setblocking(False)
    return listener


def serve_workers(spec: WorkerSpec, workers: int, announce: Callable[[str], None]) -> None:
    """Serve with `workers` processes until SIGTERM / Ctrl-C; `announce(pipeline class name)` once all serve."""
    supervisor = Supervisor(spec, workers)
    for caught in (signal.SIGTERM, signal.SIGINT):
        signal.signal(caught, supervisor.forward)
    try:
        pipeline = supervisor.start()
        if pipeline is None:
            return
        announce(pipeline)
        supervisor.supervise()
    finally:
        supervisor.kill()
        supervisor.listener.close()

"""`rolldiff serve --ray`: the server as a Ray Serve application, one replica per device (per GPU, or per CPU core),
for more devices than one process can use and for more hosts than one.

Each replica is a whole rolldiff server: its own pipeline, scheduler and batching, the app of `create_app`, behind
Serve's proxy at the same paths (`/v1/stream`, `/healthz`, `/v1/model`, `/`). Serve routes each new request to the
less busy of two replicas (an open WebSocket counts as a request for its whole life), and a WebSocket stays on the
replica it landed on, so a session's controls, input frames and chunks never cross a process, as with `--workers`.

What replicas share: the counts (admission against `--max-sessions`, `/healthz`) in one named actor
(`rolldiff.serving.ray_board`), and suspended sessions in `--state-dir`, a folder every replica sees or an fsspec URL
(`rolldiff.serving.store`), so a token suspended on one replica restores on any, also after its replica died (saved
with `--state-every`). A replica that dies is replaced by Serve.

The command is the Ray driver: it starts a local cluster (or joins `--ray-address`), deploys, and waits. At SIGTERM /
Ctrl-C every replica suspends its sessions (as a one-process server does), then Serve and the local cluster are shut
down and the command exits 0.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray
import torch
from fastapi import FastAPI
from ray import serve

from .app import ServeSettings, create_app
from .ray_board import BOARD_NAME, NAMESPACE, RayBoard, ReplicaRow, start_board

APP_NAME = "rolldiff"
HTTP_REQUESTS = 16  # requests a replica takes beside its sessions (`/healthz`, the page, a refused start)
DRAIN_S = 90.0  # the longest the command waits for the replicas to suspend their sessions
QUIET = {"log_level": "WARNING", "enable_access_log": False}  # Serve's logs: warnings and errors only


@dataclass(frozen=True)
class RaySpec:
    """How `rolldiff serve --ray` deploys: how each replica loads its pipeline (pickled to it), what it serves, where."""

    load: Callable[[], object]  # a module-level function (or a partial of one): the pipeline, checked
    settings: ServeSettings
    host: str
    port: int
    replicas: int
    threads: int  # torch threads per replica on a CPU
    cpus_per_replica: int
    gpus_per_replica: int  # 1 on CUDA: each replica sees its own GPU as `cuda`
    address: str | None = None  # an existing cluster to join; None: start a local one
    cluster_cpus: int = 1  # the local cluster's CPUs


class RayServeError(RuntimeError):
    """The application could not start (a replica's reason: a bad model, too few devices in the cluster)."""


@serve.deployment(name=APP_NAME)
@serve.ingress()
class Replica:
    """One replica: loads the pipeline at start; its app is `create_app`'s, with its row on the shared board."""

    def __init__(self, spec: RaySpec) -> None:
        self.spec = spec
        self.board = ray.get_actor(BOARD_NAME, namespace=NAMESPACE)
        if spec.gpus_per_replica == 0:
            torch.set_num_threads(spec.threads)
        try:
            self.pipe = spec.load()
        except Exception as error:  # noqa: BLE001 (said to the command, which stops and says why)
            ray.get(self.board.fail.remote(str(error)))
            raise

    def __serve_build_asgi_app__(self) -> FastAPI:
        replica = serve.get_replica_context().replica_id.unique_id
        row = ReplicaRow(RayBoard(self.board, self.spec.replicas), replica)
        row.join()
        app = create_app(self.pipe, self.spec.settings, row)
        row.beat_forever(lambda: suspend_sessions(app))
        return app


def suspend_sessions(app: FastAPI) -> None:
    """The shutdown of one replica's sessions: each suspended at its next chunk boundary, and told so."""
    hub = getattr(app.state, "hub", None)  # None: no request came, so no session either
    if hub is not None:
        hub.scheduler.suspend_all("shutdown")
        time.sleep(0.5)  # the `suspended` messages go out before Serve stops


def deployment(spec: RaySpec):
    """The application: `spec.replicas` replicas, each on its own device (one GPU, or its share of the cores)."""
    return Replica.options(
        num_replicas=spec.replicas,
        ray_actor_options={"num_cpus": spec.cpus_per_replica, "num_gpus": spec.gpus_per_replica},
        max_ongoing_requests=spec.settings.max_sessions + HTTP_REQUESTS,  # each could hold every session
        graceful_shutdown_timeout_s=5,
        logging_config=QUIET,
    ).bind(spec)


# ---------------------------------------------------------------------------------------- the command
def serve_ray(spec: RaySpec, announce: Callable[[str], None]) -> None:
    """Deploy and serve until SIGTERM / Ctrl-C; `announce(Ray's address)` once every replica serves."""
    stop = threading.Event()
    # Ray's processes inherit an ignored SIGINT: a Ctrl-C in a terminal reaches the whole process group, and the
    # cluster must outlive it until the replicas have suspended their sessions (then the command stops it)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    try:
        ray.init(
            # "local": a cluster of this command's own, even where `ray start` or RAY_ADDRESS names another (which
            # `ray.init()` would join, and whose Serve applications `serve.shutdown()` would then end)
            address=spec.address or "local",
            num_cpus=None if spec.address else spec.cluster_cpus,
            namespace=NAMESPACE,
            include_dashboard=False,
            logging_level=logging.WARNING,
        )
    except ConnectionError as error:
        if spec.address == "auto":  # Ray's own words name its `--address` flag, not ours
            raise RayServeError(
                "--ray-address auto: RAY_ADDRESS is not set and no `ray start` cluster runs on this machine; start one "
                "(`ray start --head`), give its HOST:PORT, or leave --ray-address out to start a cluster of its own"
            ) from None
        raise RayServeError(f"--ray-address {spec.address}: {error}") from None
    for caught in (signal.SIGTERM, signal.SIGINT):  # after Ray's own
        signal.signal(caught, lambda signum, frame: stop.set())
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    board, proxy = None, None
    try:
        if spec.address:
            proxy = _serve_proxy()
            _check_cluster(spec, proxy)
        board = start_board()
        serve.start(
            http_options={"host": spec.host, "port": spec.port},
            logging_config=QUIET,
        )
        if not _deploy(spec, board, stop):
            return
        announce(ray.get_runtime_context().gcs_address)
        while not stop.wait(0.5):
            pass
        _drain(board)
    finally:
        _shut_down(board, joined=spec.address is not None, keep_serve=proxy is not None)


def _check_cluster(spec: RaySpec, proxy: tuple[str, int] | None) -> None:
    """A joined cluster has no rolldiff server yet (Serve has one HTTP proxy per cluster), a Serve already there
    (its `proxy`) listens where this command was told to, and the devices asked for are there."""
    try:
        ray.get_actor(BOARD_NAME, namespace=NAMESPACE)
    except ValueError:  # no board: no rolldiff server on this cluster
        pass
    else:
        raise RayServeError(
            f"--ray-address {spec.address}: a rolldiff server already serves on this cluster (Ray Serve has one HTTP "
            "proxy per cluster); stop it first (SIGTERM), or give another cluster"
        )
    if proxy is not None and proxy != (spec.host, spec.port):  # `serve.start` would keep Serve's and only warn
        host, port = proxy
        raise RayServeError(
            f"--host {spec.host} --port {spec.port}: Ray Serve already runs on the cluster at {spec.address} with its "
            f"HTTP proxy on {host}:{port} (one per cluster); give --host {host} --port {port}, or stop that Serve "
            "(`serve shutdown`)"
        )
    kind = "GPU" if spec.gpus_per_replica else "CPU"
    need = spec.replicas * (spec.gpus_per_replica or spec.cpus_per_replica)
    has = int(ray.cluster_resources().get(kind, 0))
    if need > has:
        raise RayServeError(
            f"--replicas {spec.replicas} needs {need} {kind}s; the cluster at {spec.address} has {has}"
        )


def _serve_proxy() -> tuple[str, int] | None:
    """Where the Serve already running on the joined cluster has its HTTP proxy; None where no Serve runs there."""
    from ray.serve.context import _get_global_client  # Serve has no public call that reads its HTTP options

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return None
    return client.http_config.host, client.http_config.port


def _deploy(spec: RaySpec, board, stop: threading.Event) -> bool:
    """Run the application (in a thread: `serve.run` waits for every replica) while watching for a replica's failure
    and for a signal; whether it serves (False: a signal came first)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            serve.run(deployment(spec), name=APP_NAME, route_prefix="/")
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001 (raised again in the command's thread)
            outcome.append(error)

    threading.Thread(target=run, name="rolldiff-deploy", daemon=True).start()
    while not outcome:
        failure = ray.get(board.failure.remote())
        if failure is not None:
            raise RayServeError(failure)
        if stop.wait(0.2):
            return False
    if outcome[0] is not None:
        raise RayServeError(f"Ray Serve could not start the replicas: {outcome[0]}")
    return True


def _drain(board) -> None:
    """Every replica suspends its sessions (bounded by `DRAIN_S`)."""
    board.stop.remote()
    deadline = time.monotonic() + DRAIN_S
    time.sleep(0.1)
    while ray.get(board.undrained.remote()) and time.monotonic() < deadline:
        time.sleep(0.1)


def _shut_down(board, joined: bool, keep_serve: bool) -> None:
    """Serve and the local cluster down; in a joined cluster only what this command started: the application and the
    board, and Serve itself unless it ran before (`keep_serve`; left running, its proxy would hold this command's
    port for the next server). None of it where the board was not made (its name is the cluster's lock: a refused
    second server deletes nothing)."""
    try:
        if not joined:
            serve.shutdown()
        elif board is not None:
            if keep_serve:
                serve.delete(APP_NAME)
            else:
                serve.shutdown()
            ray.kill(board)
    finally:
        ray.shutdown()

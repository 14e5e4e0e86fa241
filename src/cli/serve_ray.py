"""`rolldiff serve --ray`: its flags' checks (the flags are `serve.py`'s), made before anything starts, and the
hand-over to `rolldiff.serving.ray_serve` (imported only when `--ray` is given: Ray is an extra,
`pip install "rolldiff[ray]"`)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
from collections.abc import Callable

import torch

from .errors import UsageError

RAY_MISSING = '--ray needs Ray Serve, which is not installed: pip install "rolldiff[ray]"'
REACH_S = 5.0  # how long `--ray-address` may take to answer (Ray itself retries for minutes)


def check_ray_arguments(args: argparse.Namespace, device: str) -> int:
    """The replicas `--ray` deploys; a flag that cannot go with it, or more replicas than devices, raise UsageError."""
    if not args.ray:
        given = [flag for flag, value in (("--replicas", args.replicas), ("--ray-address", args.ray_address)) if value]
        if given:
            verb = "go" if len(given) > 1 else "goes"
            raise UsageError(f"{' and '.join(given)} {verb} with --ray (Ray Serve replicas)")
        return 0
    if args.workers is not None:
        raise UsageError(
            f"--ray and --workers {args.workers} both serve from several processes: --ray deploys Ray Serve replicas "
            "(one per GPU or core, on one host or many), --workers runs processes on one CPU host; give one of them"
        )
    if importlib.util.find_spec("ray") is None:
        raise UsageError(RAY_MISSING)
    if args.ray_address is not None:
        check_reachable(args.ray_address)
    kind = torch.device(device)
    if kind.type == "cuda" and kind.index is not None:
        raise UsageError(f"--device {device}: under --ray each replica gets a GPU of its own; give --device cuda")
    if kind.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {device}: --ray deploys replicas on CPU cores or CUDA GPUs")
    unit, devices = ("GPU", torch.cuda.device_count()) if kind.type == "cuda" else ("core", os.cpu_count() or 1)
    replicas = args.replicas or devices
    if args.ray_address is None and replicas > devices:  # a joined cluster is counted once joined
        raise UsageError(
            f"--replicas {replicas}: 1 to {devices}, at most one per {unit}, and this machine has {devices}"
        )
    return replicas


def check_reachable(address: str) -> None:
    """A head that does not answer is refused in seconds, before the model loads, where `ray.init` would retry for
    minutes. "auto" (RAY_ADDRESS, or the cluster on this machine) is left to Ray."""
    if address == "auto":
        return
    host, colon, port = address.removeprefix("ray://").rpartition(":")
    if not colon or not host or not port.isdigit():
        raise UsageError(f"--ray-address {address!r}: give the head's HOST:PORT (its GCS address, e.g. 10.0.0.5:6379)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_S).close()
    except OSError as error:
        raise UsageError(
            f"--ray-address {address}: nothing answers there ({error.strerror or error}); start the head there with "
            f"`ray start --head --port {port}`, or leave --ray-address out to start a cluster on this machine"
        ) from None


def serve_with_ray(
    args: argparse.Namespace, load: Callable[[], object], settings, device: str, split: tuple[int, int], address: str
) -> int:
    """Deploy the replicas with Ray Serve and serve until SIGTERM / Ctrl-C. `load`: each replica's pipeline; `split`:
    torch threads per replica and replicas (`check_ray_arguments`)."""
    # a Ray call after the cluster is gone (the deploy thread of a failed start) must not start a new one
    os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
    from ..serving.ray_serve import RayServeError, RaySpec, serve_ray

    threads, replicas = split
    on_gpu = torch.device(device).type == "cuda"
    cores = os.cpu_count() or 1
    spec = RaySpec(
        load=load,
        settings=settings,
        host=args.host,
        port=args.port,
        replicas=replicas,
        threads=threads,
        cpus_per_replica=1 if on_gpu else max(1, cores // replicas),
        gpus_per_replica=1 if on_gpu else 0,
        address=args.ray_address,
        cluster_cpus=cores,
    )

    def announce(ray_address: str) -> None:
        print(f"rolldiff serve: {address} ({device}, {replicas} Ray Serve replicas, Ray at {ray_address})", flush=True)

    try:
        serve_ray(spec, announce)
    except RayServeError as exc:
        raise UsageError(str(exc)) from None
    return 0

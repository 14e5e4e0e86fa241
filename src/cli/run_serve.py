"""`rolldiff serve`: live generation sessions over WebSocket (`rolldiff-stream/1`, docs/serving.md), from one process,
from one process per CPU core (`--workers`) or from Ray Serve replicas (`--ray`, `serve_ray.py`). Every flag is
checked before the model loads, and the model before the port opens."""

from __future__ import annotations

import argparse
import importlib.util
import os

import torch

from ..choices import DEFAULT_MODEL_NAME
from ..defaults import default_device
from .arguments import check_address_flags
from .errors import UsageError
from .loading import load_from_flags
from .quiet import quiet_libraries
from .serve_ray import check_ray_arguments, serve_with_ray


def _check_serve_arguments(args: argparse.Namespace) -> None:
    """The rules that read the state folder or bind the port (those the flags alone decide were answered before torch
    loaded: `serve._check_flags_alone`)."""
    if args.state_dir is not None:
        from ..serving.store import open_state_folder

        try:
            open_state_folder(args.state_dir)
        except ValueError as exc:
            raise UsageError(str(exc).replace("`state_dir`", "--state-dir")) from None
    # a joined cluster's Serve listens on the cluster's nodes, not necessarily here (its port is checked once joined)
    check_address_flags(args, bind=not (args.ray and args.ray_address))


def _serving_threads(device: str, workers: int) -> tuple[int, int]:
    """Torch threads and default parallel groups for each server process. On a CPU each process gets its share of
    the cores, less one for the event loop and the frame encoding: torch on every core starves them (measured on 2
    cores: 26 fps with 2 threads, 46 with 1; docs/serving.md), and its groups of 4 or more run side by side on the
    rest (2 on 2 cores with one process). On a GPU, torch's threads as they are and one group at a time: a second
    group's forwards would only queue on the GPU's one stream."""
    if torch.device(device).type != "cpu":
        return torch.get_num_threads(), 1
    cores = max(1, (os.cpu_count() or 1) // workers)
    if "OMP_NUM_THREADS" in os.environ:
        threads = torch.get_num_threads()
    else:
        threads = max(1, cores - 1)
    return threads, max(1, cores // threads)


def load_served_pipeline(args: argparse.Namespace, device: str, settings):
    """The pipeline `rolldiff serve` serves, loaded as `rolldiff generate` loads it, and checked: a default no
    session could run (e.g. --compile with a recipe that decides on the host) is refused now, not once per session.
    Module-level, so each `--workers` process can load its own copy."""
    from ..serving.app import check_default_session

    with quiet_libraries():
        pipe = load_from_flags(args, device)
    try:
        check_default_session(pipe, settings)
    except ValueError as exc:
        recipe = f"--recipe {args.recipe}" if args.recipe else "the model's recipe"
        raise UsageError(f"a plain session with {recipe} would be refused: {exc}") from None
    return pipe


def run_serve(args: argparse.Namespace) -> int:
    missing = [name for name in ("fastapi", "uvicorn", "websockets") if importlib.util.find_spec(name) is None]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise UsageError(
            f"serving needs {', '.join(missing)}, which {verb} not installed: pip install 'rolldiff[serve]'"
        )
    _check_serve_arguments(args)
    from ..serving.app import ServeSettings

    device = args.device or default_device()
    replicas = check_ray_arguments(args, device)  # 0 without --ray
    args.workers = args.workers or 1
    if args.workers > 1 and torch.device(device).type != "cpu":
        raise UsageError(
            f"--workers {args.workers} runs server processes on a CPU's cores; on a GPU run one server per device "
            "(--device cuda:N), behind a proxy (docs/serving.md)"
        )
    cores = os.cpu_count() or 1
    if args.workers > cores:  # each worker is a whole process with its own model: more than cores only costs memory
        raise UsageError(f"--workers {args.workers}: at most one per core, and this machine has {cores}")
    threads, default_groups = _serving_threads(device, replicas or args.workers)
    settings = ServeSettings(
        model=str(args.model or DEFAULT_MODEL_NAME),
        recipe=args.recipe,
        max_sessions=args.max_sessions,
        max_batch=1 if args.compile else args.max_batch,  # a compiled step is one cache's graph
        parallel_groups=args.parallel_groups or default_groups,
        token=args.token or None,
        state_dir=None if args.state_dir is None else str(args.state_dir),
        idle_timeout=args.idle_timeout,
        max_frames=args.max_frames,
        state_every=args.state_every,
        fps=args.fps,
    )
    address = _served_at(args.host, args.port)
    if args.ray:
        from functools import partial

        load = partial(load_served_pipeline, args, device, settings)
        return serve_with_ray(args, load, settings, device, (threads, replicas), address)
    if args.workers > 1:
        return _serve_with_workers(args, device, settings, threads, address)
    from ..serving.server import serve

    torch.set_num_threads(threads)
    pipe = load_served_pipeline(args, device, settings)
    print(f"rolldiff serve: {address} ({type(pipe).__name__}, {device})", flush=True)
    serve(pipe, settings, args.host, args.port)
    return 0


def _served_at(host: str, port: int) -> str:
    """Where clients connect and where a person opens the page, as the command announces it (an IPv6 address in
    brackets, as URLs write it)."""
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return f"ws://{netloc}/v1/stream, the page http://{netloc}/"


def _serve_with_workers(args: argparse.Namespace, device: str, settings, threads: int, address: str) -> int:
    from functools import partial

    from ..serving.workers import WorkerError, WorkerSpec, serve_workers

    spec = WorkerSpec(partial(load_served_pipeline, args, device, settings), settings, args.host, args.port, threads)

    def announce(pipeline: str) -> None:
        print(f"rolldiff serve: {address} ({pipeline}, {device}, {args.workers} workers)", flush=True)

    try:
        serve_workers(spec, args.workers, announce)
    except WorkerError as exc:
        raise UsageError(str(exc)) from None
    return 0

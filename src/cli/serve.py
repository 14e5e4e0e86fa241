"""`rolldiff serve`: live generation sessions over WebSocket (`rolldiff-stream/1`, docs/serving.md), from one process,
from one process per CPU core (`--workers`) or from Ray Serve replicas (`--ray`, `serve_ray.py`). Every flag is
checked before the model loads, and the model before the port opens."""

from __future__ import annotations

import argparse
import importlib.util
import os

import torch

from ..defaults import default_device
from ..recipes import list_recipes
from .arguments import add_address_arguments, add_model_arguments, check_address_flags, positive
from .errors import UsageError
from .loading import add_compile_and_decoder_arguments, load_from_flags, quiet_libraries
from .serve_ray import add_ray_arguments, check_ray_arguments, serve_with_ray


def add_serve_command(commands) -> None:
    """The `serve` subcommand and its flags (`--ray`'s with them)."""
    serve = commands.add_parser(
        "serve",
        help="serve real-time sessions over WebSocket (rolldiff-stream/1)",
        description="Serve live generation sessions at ws://HOST:PORT/v1/stream (docs/serving.md).",
    )
    add_model_arguments(serve)
    serve.add_argument("--recipe", choices=list_recipes(), help="the recipe sessions use unless they name one")
    add_compile_and_decoder_arguments(serve)
    add_address_arguments(serve, port=8000)
    serve.add_argument("--max-sessions", type=positive(int), default=4, help="sessions at once (default 4)")
    serve.add_argument(
        "--max-batch",
        type=positive(int),
        default=8,
        metavar="N",
        help="sessions denoised together in one forward per step (default 8; 1: sessions take turns)",
    )
    serve.add_argument(
        "--parallel-groups",
        type=positive(int),
        metavar="N",
        help="batched groups of 4 or more sessions made at once (default: on a CPU, its cores over torch's threads; "
        "1 on a GPU)",
    )
    serve.add_argument(
        "--token", default=os.environ.get("ROLLDIFF_TOKEN"), help="clients must send it (default: $ROLLDIFF_TOKEN)"
    )
    serve.add_argument(
        "--insecure-no-token",
        action="store_true",
        help="allow binding an address other than loopback without a token (anyone who reaches it may use the GPU)",
    )
    serve.add_argument(
        "--state-dir",
        metavar="DIR_OR_URL",
        help="folder or fsspec URL (file:///..., s3://...) for suspended sessions (suspend/restore, restarts)",
    )
    serve.add_argument(
        "--idle-timeout", type=positive(float), default=300.0, help="end a session idle this many seconds (300)"
    )
    serve.add_argument(
        "--max-frames", type=positive(int), default=100_000, help="frames a session may make (default 100000)"
    )
    serve.add_argument(
        "--state-every",
        type=int,
        default=0,
        metavar="CHUNKS",
        help="save each session every N chunks (needs --state-dir)",
    )
    serve.add_argument("--fps", type=positive(int), default=16, help="frames per second clients play at (16)")
    serve.add_argument(
        "--workers",
        type=positive(int),
        metavar="N",
        help="server processes on a CPU's cores, each with its own copy of the model and its share of the sessions, "
        "behind the one port (default 1)",
    )
    add_ray_arguments(serve)
    serve.set_defaults(run=run_serve, fp8=False, attention_backend=None, cuda_graphs=False, kv_offload=None)


def _check_serve_arguments(args: argparse.Namespace) -> None:
    loopback = args.host in ("127.0.0.1", "localhost", "::1") or args.host.startswith("127.")
    if not loopback and not args.token and not args.insecure_no_token:
        raise UsageError(
            f"--host {args.host} lets other machines in; give --token (or ROLLDIFF_TOKEN), or --insecure-no-token to "
            "serve without one"
        )
    if (args.parallel_groups or 1) > 1 and (args.max_batch == 1 or args.compile):
        raise UsageError(
            "--parallel-groups makes batched groups side by side: it needs --max-batch above 1 and no --compile "
            "(a compiled step is one session's graph)"
        )
    if args.state_every < 0 or (args.state_every and args.state_dir is None):
        raise UsageError("--state-every: a number of chunks >= 0, with --state-dir to save into")
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
        model=str(args.model or "tiny-bouncing-shapes"),
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
    address = f"ws://{args.host}:{args.port}/v1/stream"
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

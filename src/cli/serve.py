"""`rolldiff serve`'s flags, `--ray`'s among them; the run is `run_serve.py`, imported when the command runs (so
`--help` and a mistyped flag answer without loading torch)."""

from __future__ import annotations

import argparse
import os

from .arguments import (
    add_address_arguments,
    add_compile_and_decoder_arguments,
    add_lora_arguments,
    add_memory_arguments,
    add_model_arguments,
    add_recipe_argument,
    check_lora_flags,
    check_memory_flags,
    positive,
)
from .errors import UsageError

EXAMPLES = """examples:
  rolldiff serve                                    # then open http://127.0.0.1:8000/ (the page)
  rolldiff serve --workers 2 --state-dir sessions   # a process per core; sessions survive a restart
  rolldiff serve --ray --replicas 2                 # Ray Serve replicas, one per GPU
the protocol, the page and the limits: docs/serving.md
"""


def add_serve_command(commands) -> None:
    """The `serve` subcommand and its flags (`--ray`'s with them)."""
    serve = commands.add_parser(
        "serve",
        help="serve real-time sessions over WebSocket (rolldiff-stream/1)",
        description="Serve live generation sessions at ws://HOST:PORT/v1/stream (docs/serving.md).",
        epilog=EXAMPLES,
    )
    add_model_arguments(serve)
    add_lora_arguments(serve)
    add_memory_arguments(serve)
    add_recipe_argument(serve, "the recipe sessions use unless they name one")
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
    serve.set_defaults(
        run=_run, check_flags=_check_flags_alone, fp8=False, attention_backend=None, cuda_graphs=False, kv_offload=None
    )


def add_ray_arguments(serve: argparse.ArgumentParser) -> None:
    """`--ray`, `--replicas`, `--ray-address`."""
    serve.add_argument(
        "--ray",
        action="store_true",
        help="serve with Ray Serve: one replica per GPU (or per CPU core), each a whole server, on one host or many",
    )
    serve.add_argument(
        "--replicas",
        type=positive(int),
        metavar="N",
        help="with --ray: replicas, at most one per GPU (per core on a CPU); default: one per device",
    )
    serve.add_argument(
        "--ray-address",
        metavar="ADDRESS",
        help="with --ray: join this Ray cluster (HOST:PORT; auto: RAY_ADDRESS, else the `ray start` one here) "
        "instead of starting one of its own",
    )


def _run(args: argparse.Namespace) -> int:
    from .run_serve import run_serve  # torch, the server and the pipelines load when the command runs

    return run_serve(args)


def _check_flags_alone(args: argparse.Namespace) -> None:
    """The rules the flags decide on their own (no library, no model, no file read). Raises `UsageError`."""
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
    check_lora_flags(args)
    check_memory_flags(args)
    if args.state_every < 0 or (args.state_every and args.state_dir is None):
        raise UsageError("--state-every: a number of chunks >= 0, with --state-dir to save into")

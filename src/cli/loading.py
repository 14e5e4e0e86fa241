"""The pipeline a command runs, loaded as the flags say: `--model`, `--device`, `--dtype`, `--tiny-vae`, then the
speed switches (`--fp8`, `--attention-backend`, `--cuda-graphs`, `--compile`); `rolldiff generate` and `rolldiff
serve` load the same way, with diffusers' and transformers' loading bars and chatter kept off stderr."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..defaults import default_dtype, load_pipeline
from ..pipelines.acceleration import compile_cached_step
from .arguments import compile_backend
from .errors import UsageError


def add_compile_and_decoder_arguments(parser) -> None:
    """`--compile` and `--tiny-vae`, offered by every command that loads with `load_from_flags` (which reads them)."""
    parser.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        type=compile_backend,
        metavar="BACKEND",
        help="torch.compile the transformer (fullgraph; default backend inductor): two graphs, no recompiles",
    )
    parser.add_argument(
        "--tiny-vae",
        type=Path,
        metavar="PATH",
        help="decode with a tiny autoencoder (TAEHV: taew2_1.pth / .safetensors) instead of the full VAE",
    )


def load_from_flags(args: argparse.Namespace, device: str):
    """The pipeline the flags describe, sped up as they ask, its own progress bar off (a command counts chunks)."""
    pipe = load_pipeline(args.model, device=device, dtype=args.dtype or default_dtype(device))
    pipe.set_progress_bar_config(disable=True)  # ours counts chunks of the whole video instead
    if args.tiny_vae is not None:
        try:
            pipe.load_tiny_autoencoder(args.tiny_vae)
        except (OSError, ValueError) as exc:
            raise UsageError(f"--tiny-vae: {exc}") from None
    _accelerate(pipe, args)
    return pipe


def _accelerate(pipe, args: argparse.Namespace) -> None:
    """--fp8, --attention-backend, --cuda-graphs / --compile, in that order (fp8 before compiling), through the
    pipeline's own switches; a refusal (no CUDA, no torchao, an unknown backend) is a usage error naming the flag."""
    flag = "--fp8"
    try:
        if args.fp8:
            pipe.enable_fp8()
        flag = "--attention-backend"
        if args.attention_backend:
            pipe.set_attention_backend(args.attention_backend)  # "fastest": the transformer's device's fastest
        flag = "--cuda-graphs"
        if args.cuda_graphs:
            if args.kv_offload:
                raise ValueError("CUDA graphs need the cache's buffers on the GPU; drop --kv-offload")
            pipe.enable_cuda_graphs()
        elif args.compile:  # one graph per window state (filling, full); compiled at the first chunks
            compile_cached_step(pipe.transformer, backend=args.compile)
    except (ValueError, RuntimeError, ImportError) as exc:
        raise UsageError(f"{flag}: {exc}") from None


@contextmanager
def quiet_libraries() -> Iterator[None]:
    """Keep stderr for our progress bar and errors: no per-component loading bars or library chatter."""
    import diffusers.utils.logging as diffusers_logging
    import transformers.utils.logging as transformers_logging

    saved = [
        (lib, lib.get_verbosity(), lib.is_progress_bar_enabled()) for lib in (diffusers_logging, transformers_logging)
    ]
    for lib, _, _ in saved:
        lib.set_verbosity_error()
        lib.disable_progress_bar()
    try:
        yield
    finally:  # `main` may run inside a bigger program (or a test session): leave it as it was
        for lib, verbosity, bars in saved:
            lib.set_verbosity(verbosity)
            if bars:
                lib.enable_progress_bar()

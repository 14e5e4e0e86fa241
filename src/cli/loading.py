"""The pipeline a command runs, loaded as the flags say: `--model`, `--device`, `--dtype`, `--lora`, `--fp8-storage`,
`--offload`, `--tiny-vae`, then the speed switches (`--fp8`, `--attention-backend`, `--cuda-graphs`, `--compile`);
`rolldiff generate` and `rolldiff serve` load the same way (`rolldiff demo` its weights). Imported by the commands'
runs only: it loads torch and the pipelines."""

from __future__ import annotations

import argparse

from ..defaults import default_dtype, load_pipeline
from ..pipelines.acceleration import compile_cached_step
from ..pipelines.lora import fuse_loras
from ..pipelines.memory import loading_device, place_weights
from .errors import UsageError


def load_from_flags(args: argparse.Namespace, device: str):
    """The pipeline the flags describe, sped up as they ask, its own progress bar off (a command counts chunks)."""
    pipe = load_weights(args, device)
    pipe.set_progress_bar_config(disable=True)  # ours counts chunks of the whole video instead
    if args.tiny_vae is not None:
        try:
            pipe.load_tiny_autoencoder(args.tiny_vae)
        except (OSError, ValueError) as exc:
            raise UsageError(f"--tiny-vae: {exc}") from None
    _accelerate(pipe, args)
    return pipe


def load_weights(args: argparse.Namespace, device: str):
    """The `--model` pipeline with the `--lora` LoRAs fused, its transformer stored as `--fp8-storage` says and placed on
    `device` as `--offload` says. Under either, the weights stay in CPU memory until then: a model that fits the GPU
    only offloaded or in float8 never lands there whole."""
    dtype = args.dtype or default_dtype(device)
    placement = dict(fp8_storage=args.fp8_storage, offload=args.offload)
    pipe = load_pipeline(args.model, device=loading_device(device, **placement), dtype=dtype)
    fuse_lora_flags(pipe, args)  # into the weights as loaded, before they are cast to float8
    place_weights(pipe, device, **placement)
    return pipe


def fuse_lora_flags(pipe, args: argparse.Namespace) -> None:
    """`--lora` / `--lora-scale` (checked by `check_lora_flags`): fused into `pipe`; a LoRA that does not fit is a usage
    error naming the file."""
    if not args.lora:
        return
    try:
        fuse_loras(pipe, args.lora, args.lora_scale or [1.0] * len(args.lora))
    except ValueError as exc:
        raise UsageError(f"--lora: {exc}") from None


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

"""Which blocks each stage of a split stream runs, and the checks of `devices=` (one home for both).

`pipe.stream(..., devices=[d0, d1, ...])` splits the transformer's blocks into `len(devices)` contiguous stages,
stage r on `devices[r]` in a process of its own (rank r); the main process is rank 0. The stages are as even as
the block count allows, the first ones taking the one block more (`split_blocks(5, 2)`: blocks 0-2, then 3-4).

Every refusal happens here, before any process starts or any weight moves, naming `devices`, the value and what is
allowed: an empty list, more stages than blocks, mixed device types, a device that does not exist, one GPU twice,
a first device other than the pipeline's, a family other than the Krea-like one, and the call options a split
stream cannot serve (each rank runs the same loop, so anything that runs on rank 0 only and changes the latents,
or that cannot be sent to another process, is refused).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ...models.krea_realtime import KreaRealtimeTransformer3DModel

DEVICE_TYPES = ("cpu", "cuda")  # gloo on CPU, NCCL on CUDA


def split_blocks(num_blocks: int, num_stages: int) -> list[range]:
    """Contiguous block ranges, one per stage, sizes differing by at most one (the first stages the larger)."""
    base, extra = divmod(num_blocks, num_stages)
    stages, start = [], 0
    for stage in range(num_stages):
        size = base + (stage < extra)
        stages.append(range(start, start + size))
        start += size
    return stages


def backend_for(devices: Sequence[str]) -> str:
    """torch.distributed's backend for these devices: gloo on CPU, NCCL on CUDA."""
    return "nccl" if devices[0].startswith("cuda") else "gloo"


def _parse(devices: Any) -> list[torch.device]:
    if isinstance(devices, (str, torch.device)) or not isinstance(devices, Sequence) or not devices:
        raise ValueError(
            f"`devices` must be a non-empty list of devices, one per pipeline stage (['cpu', 'cpu'] or "
            f"['cuda:0', 'cuda:1', ...]), got {devices!r}."
        )
    parsed = []
    for device in devices:
        try:
            parsed.append(torch.device(device))
        except (RuntimeError, TypeError):
            raise ValueError(f"`devices`: {device!r} is not a device ('cpu', 'cuda:0', ...).") from None
    return parsed


def _check_kinds(parsed: list[torch.device]) -> None:
    kinds = sorted({device.type for device in parsed})
    if len(kinds) > 1 or kinds[0] not in DEVICE_TYPES:
        raise ValueError(f"`devices` must all be of one type, 'cpu' (gloo) or 'cuda' (NCCL), got the types {kinds}.")
    if kinds[0] == "cuda":
        indices = [device.index for device in parsed]
        if None in indices:
            raise ValueError("`devices`: name each GPU with its index ('cuda:0', 'cuda:1', ...), not plain 'cuda'.")
        count = torch.cuda.device_count()
        missing = [f"cuda:{index}" for index in indices if index >= count]
        if missing:
            raise ValueError(f"`devices`: {missing} do not exist; this machine has {count} GPU(s).")
        if len(set(indices)) != len(indices):
            raise ValueError(f"`devices`: each stage needs a GPU of its own, got {[str(d) for d in parsed]}.")


def _check_call(call: Any) -> None:
    """The options a split stream cannot serve: each rank runs the same loop from the same arguments."""
    if call.callback_on_step_end is not None:
        raise ValueError(
            "`devices` with `callback_on_step_end`: the callback would run (and change latents) on the first stage "
            "only; drop one of them."
        )
    if call.adaptive_sink and call.denoising != "stream_batch":
        raise ValueError(
            "`devices` runs `adaptive_sink` under `denoising`='stream_batch' only (StreamDiffusionV2's loop, its rows "
            f"in flight through the stages); got `denoising`={call.denoising!r} with `adaptive_sink`=True."
        )
    video = call.video
    if video is not None and not isinstance(video, (str, os.PathLike, np.ndarray, torch.Tensor)):
        raise ValueError(
            "`devices` with `video`: every stage reads the input itself, so it must be a file path or an array, "
            f"not a {type(video).__name__} (an iterator is read once)."
        )


def check_devices(pipe: Any, call: Any) -> tuple[str, ...] | None:
    """`call.devices` checked against `pipe` and the call: one device string per stage, or None (one process)."""
    if call.devices is None:
        return None
    parsed = _parse(call.devices)
    _check_kinds(parsed)
    transformer = pipe.transformer
    if not isinstance(transformer, KreaRealtimeTransformer3DModel):
        raise ValueError(
            f"`devices`: pipeline parallelism splits the Krea-like transformer's blocks; {type(pipe).__name__} "
            f"({type(transformer).__name__}) runs on one device. Drop `devices`."
        )
    blocks = len(transformer.blocks)
    if len(parsed) > blocks:
        raise ValueError(
            f"`devices` names {len(parsed)} stages, but the transformer has {blocks} blocks: at most {blocks} devices."
        )
    here = torch.device(pipe.execution_device)
    first = parsed[0]
    if first.type != here.type or (first.type == "cuda" and first.index != (here.index or 0)):
        raise ValueError(
            f"`devices[0]`={str(first)!r} must be where the pipeline runs ({str(here)!r}): the first stage runs in "
            f"this process. Move it first (`pipe.to({str(first)!r})`) or list {str(here)!r} first."
        )
    _check_call(call)
    return tuple(str(device) for device in parsed)

"""Fitting a smaller GPU: where a video pipeline's weights wait between uses, and in what dtype the transformer keeps
them. Both are diffusers' own mechanisms, chosen for a chunk loop:

- `enable_offload(pipe, "text-encoder")`: the text encoder (UMT5-XXL: 5.7 B parameters, four times Wan-1.3B's
  transformer) waits in CPU memory and visits the GPU leaf by leaf when a prompt is encoded (diffusers' group
  offloading, leaf level, prefetched on a CUDA stream); the transformer and the VAE stay resident, so every chunk
  runs at full speed. What a real-time stream wants: prompts are encoded once per switch, chunks run all the time.
- `"model"`: diffusers' `enable_model_cpu_offload`: each component visits the GPU whole, in turn. The transformer
  moves in and out at every chunk (the VAE decodes between), so this is the slow mode; it needs the transformer to
  fit alone.
- `"blocks"`: the transformer's blocks wait in CPU memory too and visit the GPU one at a time (group offloading,
  block level, the next block prefetched on a CUDA stream), the text encoder leaf by leaf, the VAE resident: a
  14 B transformer in about 4 GB of GPU memory (`benchmarks/weights_memory.py`). Every step of every chunk moves
  all the transformer's weights over PCIe.
- `enable_fp8_storage(transformer)`: weights stored in float8 (e4m3) and cast to the compute dtype layer by layer
  at each call (diffusers' `enable_layerwise_casting`): half the weight memory of bfloat16 on any GPU (torchao's
  `--fp8` computes in float8 and needs sm 8.9+). The rounding of each weight to 3 mantissa bits changes the video
  slightly; norms, embeddings and the modulation tables stay in the compute dtype (diffusers' skip list).

None changes what is computed beyond that rounding: an offloaded pipeline makes the resident one's video (bit for
bit on the CPU, where the moves are no-ops; `benchmarks/gpu_checks.py` compares them on a GPU).
"""

from __future__ import annotations

import torch
from diffusers.hooks import apply_group_offloading
from diffusers.hooks.group_offloading import _is_group_offload_enabled

from ..choices import OFFLOAD_MODES
from ..models.placement import is_offloaded

FP8_STORAGE_DTYPE = torch.float8_e4m3fn  # 3 mantissa bits; e5m2 has 2, too coarse for weights


def enable_offload(pipe, mode: str, device: str | torch.device) -> None:
    """Place `pipe`'s components for `device` as `mode` (`OFFLOAD_MODES`) says, instead of `pipe.to(device)`.

    Raises:
        ValueError: an unknown `mode`, or a pipeline already offloaded (hooks cannot be stacked), before any move.
    """
    if mode not in OFFLOAD_MODES:
        raise ValueError(f"`mode` must be one of {', '.join(map(repr, OFFLOAD_MODES))}, got {mode!r}")
    components = {name: c for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)}
    if any(is_offloaded(component) for component in components.values()):
        raise ValueError(f"`mode`={mode!r}: the pipeline is offloaded already; load it again to offload it otherwise")
    device = torch.device(device)
    if mode == "model":
        pipe.enable_model_cpu_offload(device=device)
        return
    stream = device.type == "cuda"  # prefetch the next group on a side stream while this one computes
    resident = {"vae", "transformer"} if mode == "text-encoder" else {"vae"}
    for name, component in components.items():
        if name in resident:
            component.to(device)
        elif name == "transformer":
            component.enable_group_offload(
                device, offload_type="block_level", num_blocks_per_group=1, use_stream=stream
            )
        else:  # the text encoder: its layers sit below the top level (`encoder.block`), so leaf by leaf
            apply_group_offloading(component, device, offload_type="leaf_level", use_stream=stream)


def offload_mode(pipe) -> str | None:
    """The `OFFLOAD_MODES` entry `pipe` was placed with (`None`: resident), read back from its hooks."""
    transformer = pipe.transformer
    if getattr(transformer, "_hf_hook", None) is not None:
        return "model"
    if _is_group_offload_enabled(transformer):
        return "blocks"
    encoder = getattr(pipe, "text_encoder", None)
    return "text-encoder" if encoder is not None and _is_group_offload_enabled(encoder) else None


def enable_fp8_storage(transformer: torch.nn.Module) -> None:
    """Store `transformer`'s weights in float8 (e4m3), computed in its current dtype (diffusers' layerwise casting).

    Raises:
        ValueError: weights already in float8, or offloaded (store first, then offload), before any change.
    """
    if fp8_storage(transformer):
        raise ValueError("the transformer's weights are stored in float8 already")
    if is_offloaded(transformer):
        raise ValueError("store the transformer's weights in float8 before offloading it (enable_fp8_storage first)")
    transformer.enable_layerwise_casting(storage_dtype=FP8_STORAGE_DTYPE, compute_dtype=transformer.dtype)


def fp8_storage(transformer: torch.nn.Module) -> bool:
    """True when some of `transformer`'s weights are stored in float8 and cast up at each call."""
    return any(p.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for p in transformer.parameters())


def loading_device(device: str | torch.device, *, fp8_storage: bool = False, offload: str | None = None) -> str:
    """Where a pipeline's weights load: the CPU when `place_weights` will store them in float8 or offload them (a
    model that fits the GPU only so must never land there whole), else `device` itself."""
    return "cpu" if fp8_storage or offload else str(device)


def place_weights(pipe, device: str | torch.device, *, fp8_storage: bool = False, offload: str | None = None) -> None:
    """Put a pipeline loaded on `loading_device` (its LoRAs already fused) where it runs: the transformer stored in
    float8 if asked, then offloaded onto `device` in `offload` mode, or moved there whole."""
    if fp8_storage:
        pipe.enable_fp8_storage()
    if offload:
        pipe.enable_offload(offload, device)
    elif fp8_storage:
        pipe.to(device)

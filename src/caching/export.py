"""`torch.export` of a cached chunk: the cache travels as the exported program's mutable buffers.

Cache layers are `nn.Module`s with registered buffers, so a module that holds the cache as a
submodule (a chunk step: its denoising updates and its commit) exports with every cache tensor as a
BUFFER input that the program mutates in place. Running the exported program chunk after chunk
carries the cache exactly as eager does. What export cannot carry is host-side Python state: the
trace runs the chunk once on fake tensors and advances the layers' host counters, so `export_chunk`
puts them back, and `sync_host_counters` re-reads them from the device after exported chunks ran.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .base import CacheLayer

_HOST_TYPES = (bool, int, float, type(None))


def _cache_layers(module: nn.Module) -> list[CacheLayer]:
    return [sub for sub in module.modules() if isinstance(sub, CacheLayer)]


def export_chunk(
    module: nn.Module, args: tuple, kwargs: Mapping[str, Any] | None = None, **export_kwargs
) -> torch.export.ExportedProgram:
    """`torch.export.export(module, args, kwargs)` of a chunk step holding its cache (allocated ahead).

    The cache's buffers must exist (`early_initialization`) so the program mutates them rather than
    allocating; the layers' host-side state is restored after tracing.
    """
    layers = _cache_layers(module)
    if not layers:
        raise ValueError(
            "`module` holds no cache layer; register the RollingKVCache as a submodule of the chunk step."
        )
    missing = [type(layer).__name__ for layer in layers if hasattr(layer, "slot_positions") and layer.keys is None]
    if missing:
        raise RuntimeError(f"Allocate the cache before export (`early_initialization`); unallocated: {missing[:4]}.")
    for layer in layers:  # the trace must contain every step's slot arithmetic, not an eager shortcut
        if hasattr(layer, "forget_slot_arithmetic"):
            layer.forget_slot_arithmetic()
    saved = [{k: v for k, v in vars(layer).items() if isinstance(v, _HOST_TYPES)} for layer in layers]
    buffers = [dict(layer._buffers) for layer in layers]  # noqa: SLF001 (nn.Module's buffer table, restored below)
    try:
        return torch.export.export(module, args, dict(kwargs or {}), **export_kwargs)
    finally:
        for layer, state, held in zip(layers, saved, buffers):
            vars(layer).update(state)
            layer._buffers.update(held)  # noqa: SLF001


def sync_host_counters(module: nn.Module) -> None:
    """Re-read every sliding layer's host counter from its device counter (after running exported chunks)."""
    for layer in _cache_layers(module):
        if hasattr(layer, "sync_host_counters"):
            layer.sync_host_counters()  # `window_full` follows the count; the slot arithmetic is redone

"""Scratch memory shared by all layers of one cache.

Blocks run one after another, so the dequantized K/V that block i's attention reads, the staging of
a quantized chunk, and the device copies of offloaded layers are needed for one block at a time:
one buffer per role serves every layer of the cache, sized for the largest, and the container
counts it once. Buffers only grow (during warm-up / `early_initialization`), so the steady state
allocates nothing; each `view` is a reshaped prefix of its flat buffer.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def _buffer_name(role: str, dtype: torch.dtype, device: torch.device) -> str:
    device_name = str(device).replace(":", "_")
    return f"{role}__{str(dtype).removeprefix('torch.')}__{device_name}"


class CacheWorkspace(nn.Module):
    """Flat scratch buffers keyed by (role, dtype, device); non-persistent (never saved in a state dict)."""

    def __init__(self) -> None:
        super().__init__()
        self._side_streams: dict = {}  # CUDA device -> the stream offloaded layers prefetch on

    def side_stream(self, device: torch.device):
        """The CUDA stream that prefetches offloaded layers on `device` (one per cache and device)."""
        if device not in self._side_streams:
            self._side_streams[device] = torch.cuda.Stream(device)
        return self._side_streams[device]

    def reserve(self, role: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> str:
        """Make sure `view(role, shape, ...)` fits, growing the buffer only if it is too small; returns its name."""
        name = _buffer_name(role, dtype, torch.device(device))
        numel = math.prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel:
            pin = torch.device(device).type == "cpu" and torch.cuda.is_available()  # for async copies to the GPU
            fresh = torch.zeros(numel, dtype=dtype, device=device, pin_memory=pin)
            self.register_buffer(name, fresh, persistent=False)
        return name

    def view(self, role: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A `shape` view of the role's buffer (reserved beforehand)."""
        return self.view_named(_buffer_name(role, dtype, torch.device(device)), shape)

    def view_named(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """`view` by the name `reserve` returned (the attention step looks buffers up by a fixed string)."""
        return self._buffers[name][: math.prod(shape)].view(shape)

    def memory_bytes(self, device: torch.device | str | None = None) -> int:
        tensors = list(self._buffers.values())
        if device is not None:
            tensors = [t for t in tensors if t.device.type == torch.device(device).type]
        return sum(t.numel() * t.element_size() for t in tensors)

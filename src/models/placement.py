"""Where each block of a transformer runs, so its cache layers can live there too."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def execution_device(module: nn.Module) -> torch.device:
    """The device `module` computes on: accelerate's hook's `execution_device` (offloaded weights wait on the CPU
    or on "meta" and move there at each call), else the device of its first parameter."""
    device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    return torch.device(device) if device is not None else next(module.parameters()).device


def block_devices(blocks: Iterable[nn.Module]) -> list[torch.device]:
    """One device per block: a model loaded with a `device_map` may split its blocks across devices."""
    return [execution_device(block) for block in blocks]

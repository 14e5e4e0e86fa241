"""Where each block of a transformer runs, so its cache layers can live there too; and whether its weights wait
elsewhere between calls (offloaded), which decides what may be captured or compiled around it."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from diffusers.hooks.group_offloading import _get_group_onload_device, _is_group_offload_enabled
from torch import nn


def execution_device(module: nn.Module) -> torch.device:
    """The device `module` computes on: accelerate's hook's `execution_device` or diffusers' group offloading's onload
    device (offloaded weights wait on the CPU or on "meta" and move there at each call), else the device of its first
    parameter."""
    device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    if device is None and _is_group_offload_enabled(module):
        device = _get_group_onload_device(module)
    return torch.device(device) if device is not None else next(module.parameters()).device


def is_offloaded(module: nn.Module) -> bool:
    """True when hooks move `module`'s weights at each call (accelerate's model or sequential CPU offload, a
    `device_map` with offloading, diffusers' group offloading): its weights have no fixed address."""
    return loads_weights_per_call(module) or any(getattr(m, "_hf_hook", None) is not None for m in module.modules())


def loads_weights_per_call(module: nn.Module) -> bool:
    """True when hooks bring `module`'s weights to the GPU only inside its own forward (accelerate's model CPU offload,
    diffusers' group offloading): a submodule called directly, outside that forward, finds its weights away."""
    return getattr(module, "_hf_hook", None) is not None or _is_group_offload_enabled(module)


def block_devices(blocks: Iterable[nn.Module]) -> list[torch.device]:
    """One device per block: a model loaded with a `device_map` may split its blocks across devices."""
    return [execution_device(block) for block in blocks]

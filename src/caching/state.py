"""A cache's `state_dict()` as two files' worth: the tensors (safetensors) and the extra states (JSON).

`RollingKVCache.state_dict()` mixes tensors and the layers' `*._extra_state` dicts of host values.
`split_extra_state` separates them (tensors contiguous, so safetensors' `save_file` takes them as they
are) and `merge_extra_state` puts them back for `load_state_dict`:

    tensors, extras = split_extra_state(cache.state_dict())
    save_file(tensors, "cache.safetensors", metadata={"cache": json.dumps(extras)})
    ...
    cache.load_state_dict(merge_extra_state(load_file("cache.safetensors", device=device), extras))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .base import EXTRA_STATE_KEY


def split_extra_state(state_dict: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """`(tensors, extras)`: the tensors (detached, contiguous, no two sharing memory, as safetensors wants) and the
    `*._extra_state` values, by state-dict key."""
    tensors: dict[str, torch.Tensor] = {}
    extras: dict[str, Any] = {}
    storages: set[int] = set()
    for key, value in state_dict.items():
        if key == EXTRA_STATE_KEY or key.endswith(f".{EXTRA_STATE_KEY}"):
            extras[key] = value
        elif isinstance(value, torch.Tensor):
            value = value.detach().contiguous()
            storage = value.untyped_storage().data_ptr()
            if storage in storages:  # two layers hold one tensor (a tail): safetensors stores each once
                value = value.clone()
            storages.add(value.untyped_storage().data_ptr())
            tensors[key] = value
        else:
            raise TypeError(f"`state_dict[{key!r}]` is a {type(value).__name__}, neither a tensor nor an extra state.")
    return tensors, extras


def merge_extra_state(tensors: Mapping[str, torch.Tensor], extras: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of `split_extra_state`: one state dict for `load_state_dict`."""
    overlap = sorted(set(tensors) & set(extras))
    if overlap:
        raise ValueError(f"Keys in both `tensors` and `extras`: {overlap[:4]}.")
    return {**tensors, **extras}

"""`RollingKVCache`: the per-model container, mostly a list of layers.

`cache[i]` is block i's self-attention layer and `cache.cross[i]` its cross-attention layer (or
`None`). A family that needs more per block (SANA's temporal-convolution state) adds named slots:
`cache.slots["conv_state"][i]`. The container fans out `commit`, `rewind`, `reset` and
`early_initialization`, and reports lengths and memory. One generation stream holds one cache.
Container operations check every layer before changing any, so a refused call leaves all layers as
they were.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from .base import CacheLayer


def _layer_list(name: str, layers: Sequence[CacheLayer | None], expected: int, allow_none: bool) -> list:
    layers = list(layers)
    if len(layers) != expected:
        raise ValueError(f"`{name}` has {len(layers)} entries, expected one per block ({expected}).")
    for i, layer in enumerate(layers):
        if layer is None and allow_none:
            continue
        if not isinstance(layer, CacheLayer):
            allowed = "a CacheLayer or None" if allow_none else "a CacheLayer"
            raise TypeError(f"`{name}[{i}]` must be {allowed}, got {type(layer).__name__}.")
    return layers


class RollingKVCache:
    """Args:
    layers: one self-attention (or linear-attention / static) layer per block.
    cross_layers: one cross-attention layer per block, or `None` entries / `None` for a model without any.
    slots: more named per-block layers (`{"conv_state": [...]}`), each list one entry per block (or `None`).
    """

    def __init__(
        self,
        layers: Sequence[CacheLayer],
        cross_layers: Sequence[CacheLayer | None] | None = None,
        slots: Mapping[str, Sequence[CacheLayer | None]] | None = None,
    ):
        layers = list(layers)
        if not layers:
            raise ValueError("`layers` must hold at least one CacheLayer.")
        self.layers = _layer_list("layers", layers, len(layers), allow_none=False)
        cross_layers = [None] * len(layers) if cross_layers is None else cross_layers
        self.cross = _layer_list("cross_layers", cross_layers, len(layers), allow_none=True)
        self.slots: dict[str, list[CacheLayer | None]] = {}
        for name, slot_layers in (slots or {}).items():
            if not isinstance(name, str) or not name or name in ("layers", "cross"):
                raise ValueError(f"`slots` names must be non-empty strings other than 'layers'/'cross', got {name!r}.")
            self.slots[name] = _layer_list(f"slots[{name!r}]", slot_layers, len(layers), allow_none=True)

    def __getitem__(self, index: int) -> CacheLayer:
        return self.layers[index]

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[CacheLayer]:
        return iter(self.layers)

    def _slot_layers(self) -> list[CacheLayer]:
        return [layer for slot in self.slots.values() for layer in slot if layer is not None]

    def _all_layers(self) -> list[CacheLayer]:
        return self.layers + [layer for layer in self.cross if layer is not None] + self._slot_layers()

    def _stream_layers(self) -> list[CacheLayer]:
        """Layers that advance with the stream (committed chunk by chunk): self-attention and slots."""
        return self.layers + self._slot_layers()

    @property
    def has_pending(self) -> bool:
        return any(layer.pending_tokens > 0 for layer in self._stream_layers())

    def commit(self) -> None:
        """Make every layer's pending chunk permanent. All layers must hold one; checked before any changes."""
        missing = [i for i, layer in enumerate(self.layers) if layer.pending_tokens == 0]
        if missing:
            raise RuntimeError(
                f"RollingKVCache.commit() with nothing pending in layer(s) {missing[:8]}; "
                "run the model on a chunk (update every layer) before committing."
            )
        for layer in self._stream_layers():
            if layer.pending_tokens > 0:
                layer.commit()

    def rewind(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` committed tokens of every stream layer (a re-cache).

        Every layer is checked first (`check_rewind`); only then is any layer changed.
        """
        for layer in self._stream_layers():
            layer.check_rewind(num_tokens)
        for layer in self._stream_layers():
            layer.rewind(num_tokens)

    def reset(self) -> None:
        """Empty every layer, keeping the buffers (a new video with the same settings)."""
        for layer in self._all_layers():
            layer.reset()

    def reset_cross_attention(self) -> None:
        """Forget the conditioning K/V only (a prompt switch); self-attention context stays."""
        for layer in self.cross:
            if layer is not None:
                layer.reset()

    def early_initialization(
        self, batch_size: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        for layer in self._all_layers():
            layer.early_initialization(batch_size, num_heads, head_dim, dtype, device)

    def get_seq_length(self, layer: int | None = None) -> int:
        """Committed tokens held by block `layer`'s self-attention layer, or the maximum over layers."""
        if layer is not None:
            return self.layers[layer].get_seq_length()
        return max(cache_layer.get_seq_length() for cache_layer in self.layers)

    def memory_bytes(self) -> int:
        """Bytes held by all buffers of all layers."""
        return sum(layer.memory_bytes() for layer in self._all_layers())

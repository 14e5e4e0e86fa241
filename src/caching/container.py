"""`RollingKVCache`: the per-model container, mostly a list of layers.

`cache[i]` is block i's self-attention layer and `cache.cross[i]` its cross-attention layer (or
`None`). The container fans out `commit`, `reset` and `early_initialization`, and reports lengths and
memory. One generation stream holds one cache.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from .base import CacheLayer


class RollingKVCache:
    """Args:
    layers: one self-attention (or linear-attention / static) layer per block.
    cross_layers: one cross-attention layer per block, or `None` entries / `None` for a model without any.
    """

    def __init__(self, layers: Sequence[CacheLayer], cross_layers: Sequence[CacheLayer | None] | None = None):
        layers = list(layers)
        if not layers:
            raise ValueError("`layers` must hold at least one CacheLayer.")
        for i, layer in enumerate(layers):
            if not isinstance(layer, CacheLayer):
                raise TypeError(f"`layers[{i}]` must be a CacheLayer, got {type(layer).__name__}.")
        cross_layers = [None] * len(layers) if cross_layers is None else list(cross_layers)
        if len(cross_layers) != len(layers):
            raise ValueError(
                f"`cross_layers` has {len(cross_layers)} entries, expected one per layer ({len(layers)})."
            )
        self.layers = layers
        self.cross = cross_layers

    def __getitem__(self, index: int) -> CacheLayer:
        return self.layers[index]

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[CacheLayer]:
        return iter(self.layers)

    def _all_layers(self) -> list[CacheLayer]:
        return self.layers + [layer for layer in self.cross if layer is not None]

    @property
    def has_pending(self) -> bool:
        return any(layer.pending_tokens > 0 for layer in self.layers)

    def commit(self) -> None:
        """Make every layer's pending chunk permanent. All layers must hold one; checked before any changes."""
        missing = [i for i, layer in enumerate(self.layers) if layer.pending_tokens == 0]
        if missing:
            raise RuntimeError(
                f"RollingKVCache.commit() with nothing pending in layer(s) {missing[:8]}; "
                "run the model on a chunk (update every layer) before committing."
            )
        for layer in self.layers:
            layer.commit()

    def rewind(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` committed tokens of every self-attention layer (re-cache)."""
        for layer in self.layers:
            if not hasattr(layer, "rewind"):
                raise TypeError(f"{type(layer).__name__} cannot rewind.")
        for layer in self.layers:
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
        """Committed tokens held by `layer`, or the maximum over layers when `layer` is None."""
        if layer is not None:
            return self.layers[layer].get_seq_length()
        return max(cache_layer.get_seq_length() for cache_layer in self.layers)

    def memory_bytes(self) -> int:
        """Bytes held by all buffers of all layers."""
        return sum(layer.memory_bytes() for layer in self._all_layers())

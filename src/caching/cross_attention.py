"""Cross-attention cache: the conditioning's K/V, computed once and reused every step and chunk.

The layer remembers *which* conditioning tensor its K/V came from (object identity and in-place
version), so a prompt switch is detected by the layer itself instead of by a flag kept elsewhere.
`update` replaces, never appends.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .base import CacheLayer, check_key_value


class CrossAttentionLayer(CacheLayer):
    """K/V of the text (or other conditioning), `(batch, text_tokens, heads, head_dim)`.

    Not part of a saved state: the K/V are recomputed from the conditioning (non-persistent buffers, no extra
    state), and a container's `load_state_dict` leaves its cross-attention layers empty.
    """

    get_extra_state = nn.Module.get_extra_state  # torch saves extra state only for kinds that override these
    set_extra_state = nn.Module.set_extra_state

    def __init__(self) -> None:
        super().__init__()
        for name in ("keys", "values"):
            self.register_buffer(name, None, persistent=False)
        self.num_computations = 0  # how many times K/V were (re)computed: one per prompt
        self._source: weakref.ref | None = None
        self._source_version = -1
        self._filled = False

    @property
    def is_filled(self) -> bool:
        """True from an `update` until `reset()`: a host-side flag, so a compiled step reads K/V without a device check.

        Prompt changes are signalled explicitly: the pipeline calls `reset()` (or the container's
        `reset_cross_attention()`), and the next step recomputes.
        """
        return self._filled

    def is_cached_for(self, conditioning: torch.Tensor) -> bool:
        """True when the stored K/V were computed from this very tensor, unmodified since."""
        return (
            self._filled
            and self._source is not None
            and self._source() is conditioning
            and conditioning._version == self._source_version  # noqa: SLF001 (torch's in-place write counter)
        )

    def update(
        self, key: torch.Tensor, value: torch.Tensor, conditioning: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store K/V for `conditioning` (replacing any earlier ones) and return them."""
        check_key_value(key, value)
        if self.keys is not None and self.keys.shape == key.shape and self.keys.dtype == key.dtype:
            self.keys.copy_(key)  # same shape: reuse the buffers
            self.values.copy_(value)
        else:
            self.keys, self.values = key.detach().clone(), value.detach().clone()
        self._source = weakref.ref(conditioning) if conditioning is not None else None
        self._source_version = conditioning._version if conditioning is not None else -1  # noqa: SLF001
        self.num_computations += 1
        self._filled = True
        return self.keys, self.values

    def commit(self) -> None:
        """Nothing is pending in a cross-attention layer; committing is a no-op."""

    def get(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The stored K/V, a copy (the rule of every kind); attention reads `keys` / `values` while `is_filled`."""
        return (self.keys.clone(), self.values.clone()) if self._filled else None

    def reset(self) -> None:
        """Forget the conditioning (the next call recomputes) but keep the buffers."""
        if self.keys is not None:
            self.keys.zero_()
            self.values.zero_()
        self._source = None
        self._filled = False

    def get_seq_length(self) -> int:
        return self.keys.shape[1] if self._filled else 0

    def early_initialization(
        self, batch_size: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        """Text length is only known from the first update; nothing to allocate ahead. Refused while filled."""
        self.check_early_initialization(batch_size, num_heads, head_dim, dtype, device)

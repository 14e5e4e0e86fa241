"""Condition-token cache (GLM-Image's reference images): written once, read at every step.

Condition tokens are written with `update` + `commit` (several images append), then every
denoising step's `update` writes the current tokens right after them, in place, and attention reads
one contiguous view `[conditions; current]`: no per-step concatenation. A CFG branch that must not
see the conditions simply does not use the layer.
"""

from __future__ import annotations

import torch

from .base import CacheLayer, check_allocation_sizes, check_key_value, check_matches_buffer, check_positive


class StaticLayer(CacheLayer):
    """Args: max_tokens: condition tokens plus the current step's tokens that the buffer can hold."""

    def __init__(self, max_tokens: int) -> None:
        super().__init__()
        self.max_tokens = check_positive("max_tokens", max_tokens)
        self.condition_tokens = 0

    def early_initialization(
        self, batch_size: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        check_allocation_sizes(batch_size, num_heads, head_dim)
        self._allocate(batch_size, num_heads, head_dim, dtype, torch.device(device))

    def _allocate(self, batch: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.keys = torch.zeros(batch, self.max_tokens, heads, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)

    def update(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the current tokens after the conditions; return `[conditions; current]` views."""
        check_key_value(key, value)
        if self.keys is None:
            batch, _, heads, head_dim = key.shape
            self._allocate(batch, heads, head_dim, key.dtype, key.device)
        check_matches_buffer("key", key, self.keys)
        end = self.condition_tokens + key.shape[1]
        if end > self.max_tokens:
            raise ValueError(
                f"{self.condition_tokens} condition tokens + {key.shape[1]} new tokens exceed "
                f"`max_tokens`={self.max_tokens}."
            )
        self.keys[:, self.condition_tokens : end] = key
        self.values[:, self.condition_tokens : end] = value
        self.pending_tokens = key.shape[1]
        return self.keys[:, :end], self.values[:, :end]

    def commit(self) -> None:
        """Keep the pending tokens as condition tokens (a reference image written once)."""
        self._require_pending()
        self.condition_tokens += self.pending_tokens
        self.pending_tokens = 0

    def get(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.keys is None or self.condition_tokens == 0:
            return None
        conditions = slice(0, self.condition_tokens)  # a copy, as `get()` is in every kind
        return self.keys[:, conditions].clone(), self.values[:, conditions].clone()

    def reset(self) -> None:
        if self.keys is not None:
            self.keys.zero_()
            self.values.zero_()
        self.condition_tokens = 0
        self.pending_tokens = 0

    def get_seq_length(self) -> int:
        return self.condition_tokens

    # ------------------------------------------------------------------------------------ saving, loading
    def state_config(self) -> dict:
        return {"max_tokens": self.max_tokens}

    def host_state(self) -> dict:
        return {"pending_tokens": self.pending_tokens, "condition_tokens": self.condition_tokens}

    def load_host_state(self, state) -> None:
        self.pending_tokens, self.condition_tokens = state["pending_tokens"], state["condition_tokens"]

    def allocate_like(self, tensors, extra) -> None:
        batch, _, heads, head_dim = tensors["keys"].shape
        self._allocate(batch, heads, head_dim, tensors["keys"].dtype, tensors["keys"].device)

"""The shared contract of every cache layer, and the input checks they all use.

Tensors are `(batch, tokens, heads, head_dim)`, diffusers' attention layout. A layer holds committed
tokens (permanent until evicted) and pending tokens (the chunk being denoised); only `commit()` turns
pending into committed, so a chunk is a transaction.
"""

from __future__ import annotations

import abc

import torch


def check_positive(name: str, value: int, allow_zero: bool = False) -> int:
    """Validate a size argument, naming it in the error."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__}.")
    lowest = 0 if allow_zero else 1
    if value < lowest:
        allowed = ">= 0" if allow_zero else ">= 1"
        raise ValueError(f"`{name}` must be {allowed}, got {value}.")
    return value


def check_allocation_sizes(batch_size: int, num_heads: int, head_dim: int) -> None:
    """The sizes `early_initialization` allocates with, each a positive int named in the error."""
    for name, size in (("batch_size", batch_size), ("num_heads", num_heads), ("head_dim", head_dim)):
        check_positive(name, size)


def check_key_value(key: torch.Tensor, value: torch.Tensor) -> None:
    """Key and value must be 4-D `(batch, tokens, heads, head_dim)` tensors of one shape, dtype and device."""
    for name, tensor in (("key", key), ("value", value)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor, got {type(tensor).__name__}.")
        if tensor.ndim != 4:
            raise ValueError(f"`{name}` must have shape (batch, tokens, heads, head_dim), got {tuple(tensor.shape)}.")
    if key.shape != value.shape:  # the value buffer is allocated like the key buffer
        raise ValueError(
            f"`key` and `value` must have the same shape, got {tuple(key.shape)} and {tuple(value.shape)}."
        )
    if key.dtype != value.dtype:
        raise TypeError(f"`key` and `value` must share a dtype, got {key.dtype} and {value.dtype}.")
    if key.device != value.device:
        raise ValueError(f"`key` and `value` must be on one device, got {key.device} and {value.device}.")


def check_matches_buffer(name: str, tensor: torch.Tensor, buffer: torch.Tensor) -> None:
    """A tensor written into an allocated buffer must match its batch, heads, head_dim, dtype and device."""
    expected = (buffer.shape[0], buffer.shape[2], buffer.shape[3])
    received = (tensor.shape[0], tensor.shape[2], tensor.shape[3])
    if received != expected:
        raise ValueError(
            f"`{name}` has (batch, heads, head_dim) = {received} but the cache was initialised with {expected}; "
            "call `reset()` keeps the buffers, so build a new cache for another batch size or head count."
        )
    if tensor.dtype != buffer.dtype:
        raise TypeError(f"`{name}` has dtype {tensor.dtype} but the cache holds {buffer.dtype}.")
    if tensor.device != buffer.device:
        raise ValueError(f"`{name}` is on {tensor.device} but the cache lives on {buffer.device}.")


class CacheLayer(abc.ABC):
    """One block's cache. Subclasses allocate lazily from the first tensors or ahead via `early_initialization`."""

    is_compileable: bool = True
    is_sliding: bool = False
    can_rewind: bool = False  # whether `rewind` can forget committed tokens (a re-cache after a prompt switch)

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.pending_tokens: int = 0

    @property
    def is_initialized(self) -> bool:
        return self.keys is not None

    @abc.abstractmethod
    def update(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the pending tokens; return what attention must see."""

    @abc.abstractmethod
    def commit(self) -> None:
        """Make the pending tokens permanent."""

    @abc.abstractmethod
    def get(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What is committed now, without writing."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Empty the layer, keeping its buffers."""

    @abc.abstractmethod
    def get_seq_length(self) -> int:
        """Committed tokens held now (state kinds: the tokens their state summarises)."""

    def check_rewind(self, num_tokens: int) -> None:
        """Raise if `rewind(num_tokens)` would be refused; changes nothing (containers check every layer first)."""
        check_positive("num_tokens", num_tokens)
        if not self.can_rewind:
            raise TypeError(f"{type(self).__name__} cannot rewind (`can_rewind` is False).")

    def rewind(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` committed tokens so they can be written again."""
        self.check_rewind(num_tokens)

    @abc.abstractmethod
    def early_initialization(
        self, batch_size: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        """Allocate the buffers ahead of the first update (for `torch.compile` and export)."""

    def memory_bytes(self) -> int:
        """Bytes held by this layer's buffers."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.keys, self.values) if t is not None]

    def _require_pending(self) -> None:
        if self.pending_tokens == 0:
            raise RuntimeError(f"{type(self).__name__}.commit() called with nothing pending; call update() first.")

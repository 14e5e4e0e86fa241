"""The shared contract of every cache layer, and the input checks they all use.

Tensors are `(batch, tokens, heads, head_dim)`, diffusers' attention layout. A layer holds committed
tokens (permanent until evicted) and pending tokens (the chunk being denoised); only `commit()` turns
pending into committed, so a chunk is a transaction.

Layers are `nn.Module`s whose state lives in registered buffers (as gpt-fast's `KVCache`): `.to()`,
`state_dict()` (savable with safetensors) and `torch.export` (the cache is the exported program's
mutable state, carried from chunk to chunk) work on them. Host-side counters (Python ints) mirror
the device counters for checks outside the attention step.

`get()` follows one rule in every kind: it returns a snapshot (new tensors the caller may keep or
modify); the live buffers are read through `update()` only.
"""

from __future__ import annotations

import abc

import torch
from torch import nn


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


def check_dtype_device(dtype: torch.dtype, device: torch.device | str) -> torch.device:
    """`early_initialization`'s dtype must be a floating-point torch.dtype and device a valid device."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
        raise TypeError(f"`dtype` must be a floating-point torch.dtype of 16 bits or more, got {dtype!r}.")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(
            f"`device` must be a torch.device or a device string such as 'cpu', got {device!r}."
        ) from error


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


def check_matches_buffer(
    name: str,
    tensor: torch.Tensor,
    buffer: torch.Tensor,
    allow_smaller_batch: bool = False,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
) -> None:
    """A tensor written into an allocated buffer must match its batch, heads, head_dim, dtype and device.

    `allow_smaller_batch`: a buffer allocated for batch B also takes any batch b <= B (its first b rows).
    `dtype` / `device`: what the layer computes in, when its buffer is stored otherwise (quantized, offloaded).
    """
    if allow_smaller_batch:
        if torch.compiler.is_compiling():  # a symbolic batch: assert without specialising the graph on it
            torch._check(tensor.shape[0] <= buffer.shape[0])
        elif tensor.shape[0] > buffer.shape[0]:
            raise ValueError(
                f"`{name}` has batch {tensor.shape[0]} but the cache was allocated for at most {buffer.shape[0]} "
                "rows; allocate it with `early_initialization(batch_size=...)` for the largest batch you run."
            )
        expected, received = (buffer.shape[2], buffer.shape[3]), (tensor.shape[2], tensor.shape[3])
        what = "(heads, head_dim)"
    else:
        expected = (buffer.shape[0], buffer.shape[2], buffer.shape[3])
        received = (tensor.shape[0], tensor.shape[2], tensor.shape[3])
        what = "(batch, heads, head_dim)"
    if received != expected:
        raise ValueError(
            f"`{name}` has {what} = {received} but the cache was initialised with {expected}; "
            "`reset()` keeps the buffers, so build a new cache for another head count or size."
        )
    dtype = buffer.dtype if dtype is None else dtype
    device = buffer.device if device is None else device
    if tensor.dtype != dtype:
        raise TypeError(f"`{name}` has dtype {tensor.dtype} but the cache holds {dtype}.")
    if tensor.device != device:
        raise ValueError(
            f"`{name}` is on {tensor.device} but the cache computes on {device}; move the cache with "
            "`.to(device)` or build it on that device (it never copies its buffers behind your back)."
        )


class CacheLayer(nn.Module, abc.ABC):
    """One block's cache. Subclasses allocate lazily from the first tensors or ahead via `early_initialization`."""

    is_compileable: bool = True
    is_sliding: bool = False
    can_rewind: bool = False  # whether `rewind` can forget committed tokens (a re-cache after a prompt switch)

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("keys", None)
        self.register_buffer("values", None)
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
        """What is committed now, without writing: a snapshot (new tensors), never the live buffers."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Empty the layer, keeping its buffers."""

    @abc.abstractmethod
    def get_seq_length(self) -> int:
        """Committed tokens held now (state kinds: the tokens their state summarises)."""

    @property
    def in_use(self) -> bool:
        """True while the layer holds committed or pending tokens (cleared by `reset()`)."""
        return self.pending_tokens > 0 or self.get_seq_length() > 0

    def check_rewind(self, num_tokens: int) -> None:
        """Raise if `rewind(num_tokens)` would be refused; changes nothing (containers check every layer first)."""
        check_positive("num_tokens", num_tokens)
        if not self.can_rewind:
            raise TypeError(f"{type(self).__name__} cannot rewind (`can_rewind` is False).")

    def rewind(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` committed tokens so they can be written again."""
        self.check_rewind(num_tokens)

    def check_early_initialization(
        self, batch_size: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        """Raise if `early_initialization(...)` would be refused; changes nothing.

        A layer in use is refused rather than silently emptied: its stream would be lost without a word.
        """
        check_allocation_sizes(batch_size, num_heads, head_dim)
        check_dtype_device(dtype, device)
        if self.in_use:
            raise RuntimeError(
                f"{type(self).__name__}.early_initialization() on a layer in use ({self.get_seq_length()} committed, "
                f"{self.pending_tokens} pending tokens); call `reset()` first to start a new stream."
            )

    @abc.abstractmethod
    def early_initialization(
        self, batch_size: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        """Allocate the buffers ahead of the first update (for `torch.compile` and export)."""

    def memory_bytes(self, device: torch.device | str | None = None) -> int:
        """Bytes held by this layer's buffers (on `device` only, when given; e.g. "cuda" for an offloaded layer)."""
        tensors = self._tensors()
        if device is not None:
            device = torch.device(device)
            tensors = [t for t in tensors if t.device.type == device.type]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.keys, self.values) if t is not None]

    def _require_pending(self) -> None:
        if self.pending_tokens == 0:
            raise RuntimeError(f"{type(self).__name__}.commit() called with nothing pending; call update() first.")

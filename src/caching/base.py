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

Saving and loading (resume) go through `state_dict()` / `load_state_dict()`: the tensors are the layer's
persistent buffers, the host-side values (counters, flags, lengths) its `get_extra_state()`, a dict of
JSON values: `{"kind": class name, "config": constructor sizes, "state": host counters}`. Loading checks
kind and config first (a clear error names the difference), allocates the buffers of a layer that is still
lazy (on the device and in the dtype of the loaded tensors), and otherwise copies into the existing buffers
in place (same `data_ptr`, so compiled graphs stay valid).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..checks import check_int

EXTRA_STATE_KEY = "_extra_state"  # torch's state-dict name for what `get_extra_state` returns


def check_positive(name: str, value: int, allow_zero: bool = False) -> int:
    """A size argument: a positive int (or >= 0), named in the error (`rolldiff.checks.check_int`)."""
    return check_int(name, value, 0 if allow_zero else 1)


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
            torch._check(tensor.shape[0] <= buffer.shape[0])  # noqa: SLF001 (torch's documented symbolic check)
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
        if not isinstance(getattr(type(self), "keys", None), property):  # else a kind reads them from its storage
            self.register_buffer("keys", None)
            self.register_buffer("values", None)
        self.pending_tokens: int = 0

    @property
    def is_initialized(self) -> bool:
        return self.keys is not None

    @property
    def decides_on_host(self) -> bool:
        """Whether the next update reads the device to decide where it writes (StreamDiffusionV2's adaptive sink): a
        compiled step (`compile_cached_step`) runs that forward eager instead of breaking its graph."""
        return False

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

    # ----------------------------------------------------------------------------------------- saving, loading
    # Buffers a layer may or may not hold at a given time (saved only when held, e.g. a tail state).
    optional_buffers: tuple[str, ...] = ()
    # Config entries a lazily built layer may leave `None` and take from a loaded state (e.g. `chunk_tokens`).
    config_from_state: tuple[str, ...] = ()
    # Whether buffers may have another shape than a loaded state's (a layer whose buffers grow with use).
    buffers_grow: bool = False

    def state_config(self) -> dict[str, Any]:
        """The constructor sizes a loaded state must match (JSON values)."""
        return {}

    def host_state(self) -> dict[str, Any]:
        """The host-side values (JSON) that, with the buffers, are this layer's whole state."""
        return {"pending_tokens": self.pending_tokens}

    def load_host_state(self, state: Mapping[str, Any]) -> None:
        """Put back what `host_state` returned (the buffers are already loaded)."""
        self.pending_tokens = state["pending_tokens"]

    def get_extra_state(self) -> dict[str, Any]:
        return {"kind": type(self).__name__, "config": self.state_config(), "state": self.host_state()}

    def set_extra_state(self, state: Any) -> None:
        """Put back the host state; reached from `_load_from_state_dict` only, after `check_state` and
        `_adopt_config` (so nothing is checked twice)."""
        self.load_host_state(state["state"])

    def _adopt_config(self, config: Mapping[str, Any]) -> None:
        for name in self.config_from_state:
            if getattr(self, name) is None and config.get(name) is not None:
                setattr(self, name, config[name])

    def persistent_buffer_names(self) -> list[str]:
        """State-dict names (relative, dotted) of every buffer `state_dict()` saves once allocated, its storage's
        included; scratch (non-persistent buffers, the shared workspace) is left out."""
        names = []
        for prefix, module in self.named_modules():  # the workspace's buffers are all non-persistent
            skipped = module._non_persistent_buffers_set  # noqa: SLF001  torch keeps persistence only here
            names += [f"{prefix}.{n}" if prefix else n for n in module._buffers if n not in skipped]  # noqa: SLF001
        return names

    def state_tensors(self, state_dict: Mapping[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
        """This layer's saved tensors in `state_dict` (its keys under `prefix`), by relative buffer name: every
        persistent buffer, its storage's included (`storage.keys`)."""
        names = self.persistent_buffer_names()
        return {name: state_dict[prefix + name] for name in names if prefix + name in state_dict}

    def check_state(self, tensors: Mapping[str, torch.Tensor], extra: Any) -> None:
        """Raise ValueError, naming the difference, unless loading `tensors` (by buffer name) and `extra` (what
        `get_extra_state` returned) restores this layer exactly; changes nothing."""
        name = type(self).__name__
        if not isinstance(extra, Mapping) or extra.get("kind") != name or "config" not in extra:
            kind = extra.get("kind") if isinstance(extra, Mapping) else type(extra).__name__
            raise ValueError(f"A saved {kind} state cannot be loaded into a {name}; build the cache the same way.")
        own = self.state_config()
        for key, saved in extra["config"].items():
            if own.get(key) != saved and not (key in self.config_from_state and own.get(key) is None):
                raise ValueError(
                    f"The saved {name} has `{key}`={saved!r}, this one {own.get(key)!r}; build the cache the same way."
                )
        known = set(self.persistent_buffer_names())
        for key, tensor in tensors.items():
            if key not in known:
                raise ValueError(f"The saved {name} holds `{key}`, which this layer does not have.")
            current = self.get_buffer(key)
            fits = current is None or (current.shape == tensor.shape and current.dtype == tensor.dtype)
            if not fits and key not in self.optional_buffers and not self.buffers_grow:
                raise ValueError(
                    f"The saved {name}'s `{key}` is {tuple(tensor.shape)} {tensor.dtype}, this layer holds "
                    f"{tuple(current.shape)} {current.dtype}; build the cache with the same batch_size, heads, "
                    "head_dim and dtype."
                )

    def allocate_like(self, tensors: Mapping[str, torch.Tensor], extra: Mapping[str, Any]) -> None:
        """Allocate the buffers to receive `tensors` (a lazy layer being loaded), where they live."""
        raise NotImplementedError(f"{type(self).__name__} cannot be loaded before its buffers are allocated.")

    def loaded_without_host_state(self) -> None:
        """Called after loading tensors with no extra state (`strict=False`); a kind may re-derive its host state."""

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        extra = state_dict.get(prefix + EXTRA_STATE_KEY)
        if extra is None:  # tensors only: torch reports the missing extra state when `strict`
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)
            self.loaded_without_host_state()
            return
        tensors = self.state_tensors(state_dict, prefix)
        self.check_state(tensors, extra)
        self._adopt_config(extra["config"])
        if not tensors:  # saved before its first chunk: an empty layer
            self.reset()
            self.set_extra_state(extra)
            return
        grown = any(
            self.get_buffer(n) is not None and self.get_buffer(n).shape != t.shape
            for n, t in tensors.items()
            if n not in self.optional_buffers
        )
        if not self.is_initialized or grown:
            self.allocate_like(tensors, extra)
        device = next(t.device for n, t in self._buffers.items() if t is not None and n not in self.optional_buffers)
        for name in self.optional_buffers:
            current, saved = self._buffers.get(name), tensors.get(name)
            if saved is None:
                setattr(self, name, None)
            elif current is None or current.shape != saved.shape or current.dtype != saved.dtype:
                setattr(self, name, torch.empty_like(saved, device=device))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)

    def _require_pending(self) -> None:
        if self.pending_tokens == 0:
            raise RuntimeError(f"{type(self).__name__}.commit() called with nothing pending; call update() first.")

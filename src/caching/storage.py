"""Where a sliding-window layer's K/V live, behind one small interface: dense, quantized, or offloaded.

A storage holds `(batch, capacity, heads, head_dim)` keys and values, addressed by slot. It knows
nothing of positions, windows or masks: the layer computes the slots (the ring arithmetic) and hands
them over. The interface, shared by every storage:

    allocate(shape, chunk_tokens, dtype, device)                once; `reset()` keeps the buffers
    write(slots, key, value) -> (keys, values)                  the pending chunk into `slots`; what attention reads
    commit(slots, rows)                                         the pending chunk becomes permanent (offload: home)
    read(slots, rows) -> (keys, values)                         copies of `slots`, in the compute dtype and device
    reset(), share_workspace(workspace, work_parity), prefetch(rows), tensors(), resident_bytes()

- `KVStorage`: the K/V as they arrive, written in place (`index_copy_`); attention reads the buffers.
- `QuantizedKVStorage`: int8 / fp8 codes plus per token-and-head scales (`quantization.py`); attention reads
  a dequantized copy in the workspace, with the pending chunk itself exact.
- `OffloadedKVStorage(home)`: a dense or quantized storage in CPU memory (pinned with CUDA) as the home of
  the committed tokens; `write` fetches home into a device work buffer of the workspace (or waits for a
  `prefetch` started by the container), writes the chunk there and stages it to host memory; `commit`
  writes the staged chunk home, the only time home changes (so a prefetch never reads a half-written home
  and an aborted chunk leaves it intact).
All write into preallocated buffers: the steady state allocates nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from . import offload as offloading
from .quantization import as_bits, dequantize_into, quantize_into, storage_dtype
from .workspace import CacheWorkspace

HOME = torch.device("cpu")
# offloaded: the pending chunk in host memory, one buffer per stored tensor (written home at commit)
_STAGED_NAMES = {name: f"staged_{name}" for name in ("keys", "values", "key_scales", "value_scales")}

# Called with (name of a stored tensor, the chunk written into it) as a write encodes the chunk.
OnWritten = Callable[[str, torch.Tensor], None]


def _zeros(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    pin = device == HOME and torch.cuda.is_available()  # pinned host memory: asynchronous copies to the GPU
    return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)


class KVStorage(nn.Module):
    """Dense K/V `(batch, capacity, heads, head_dim)` in the compute dtype, on the compute device."""

    def __init__(self) -> None:
        super().__init__()
        for name in self.stored_names():
            self.register_buffer(name, None)
        self.workspace = CacheWorkspace()  # scratch (quantized, offloaded); a container shares one
        self._workspace_names: dict[str, str] = {}
        self._device: torch.device | None = None  # where attention runs (the home may be elsewhere)
        self._chunk_tokens = 0  # the largest chunk a write brings

    def stored_names(self) -> tuple[str, ...]:
        """The stored tensors, each `(batch, capacity, heads, ·)`."""
        return ("keys", "values")

    def stored(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.stored_names()}

    # ------------------------------------------------------------------------------------ allocation
    @property
    def is_allocated(self) -> bool:
        return self.keys is not None

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype K/V arrive and are read in (dense: the buffers' own, which follow `.to(dtype)`)."""
        return None if self.keys is None else self.keys.dtype

    @property
    def device(self) -> torch.device | None:
        """The compute device: where attention reads the K/V."""
        return None if self.keys is None else (self._device or self.keys.device)

    def allocate(
        self,
        shape: tuple[int, int, int, int],
        chunk_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
        home: torch.device | None = None,
    ) -> None:
        """Zeroed `shape` = `(batch, capacity, heads, head_dim)` buffers on `home` (default: `device`, where attention
        runs), for writes of up to `chunk_tokens` tokens in `dtype`."""
        self._device = device if home is not None and home != device else None
        self._chunk_tokens = chunk_tokens
        self._allocate_tensors(shape, dtype, device if home is None else home)
        self._reserve_workspace()

    def _allocate_tensors(self, shape: tuple[int, int, int, int], dtype: torch.dtype, where: torch.device) -> None:
        """The zeroed stored tensors on `where`, for K/V arriving in `dtype`."""
        self.keys = _zeros(shape, dtype, where)
        self.values = _zeros(shape, dtype, where)

    def share_workspace(self, workspace: CacheWorkspace, work_parity: int = 0) -> None:
        """Use a container's workspace (one scratch for all layers); `work_parity` picks an offload work buffer."""
        self.workspace = workspace
        self._reserve_workspace()

    def _reserve_workspace(self) -> None:
        """Name (and size) this storage's shares of the workspace: none for dense K/V."""

    def tensors(self) -> list[torch.Tensor]:
        """The buffers this storage holds (a layer's `memory_bytes` counts them)."""
        return [t for t in self.stored().values() if t is not None]

    def resident_bytes(self) -> int:
        """Bytes kept on the compute device."""
        return sum(t.nbytes for t in self.tensors())

    # ------------------------------------------------------------------------------------ the step
    def write(self, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the chunk `(b, tokens, heads, head_dim)` into `slots`; return K/V `(b, capacity, heads, head_dim)`."""
        rows = key.shape[0]
        return self.write_into({name: t[:rows] for name, t in self.stored().items()}, slots, key, value)

    def write_into(
        self,
        target: dict[str, torch.Tensor],
        slots: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        on_written: OnWritten | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`write` into `target` (tensors shaped like the stored ones: the buffers, or an offloaded layer's
        work views); `on_written(name, chunk)` sees each stored chunk as written (offload stages it)."""
        for name, chunk in (("keys", key), ("values", value)):
            target[name].index_copy_(1, slots, chunk)
            if on_written is not None:
                on_written(name, chunk)
        return target["keys"], target["values"]

    def commit(self, slots: torch.Tensor, rows: int) -> None:
        """The pending chunk (in `slots`) becomes permanent: already written in place."""

    def prefetch(self, rows: int) -> None:
        """Start bringing the stored K/V of `rows` rows to the compute device: they are there already."""

    def read(self, slots: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of `slots` of the first `rows` rows, `(rows, len(slots), heads, head_dim)`, compute dtype and device."""
        held = self.stored()
        slots = slots.to(held["keys"].device)
        return tuple(self.decode(held, name, slots, rows).to(self.device) for name in ("keys", "values"))

    def decode(self, held: dict[str, torch.Tensor], name: str, slots: torch.Tensor, rows: int) -> torch.Tensor:
        """`held[name]` at `slots` in the compute dtype (a copy)."""
        return held[name][:rows].index_select(1, slots)

    def reset(self) -> None:
        """Zero the stored tensors in place (same `data_ptr`)."""
        for tensor in self.stored().values():
            if tensor is not None:
                tensor.zero_()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        if any(key.startswith(prefix) for key in state_dict):  # else: saved before allocation, the layer reset us
            super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class QuantizedKVStorage(KVStorage):
    """Int8 / fp8 codes `(batch, capacity, heads, head_dim)` plus fp32 scales `(batch, capacity, heads, 1)`.

    Args: quantization: "int8" or "fp8" (`quantization.QUANTIZATION_FORMATS`).
    """

    def __init__(self, quantization: str) -> None:
        self.quantization = quantization
        super().__init__()
        self._compute_dtype: torch.dtype | None = None  # what the codes dequantize to

    def stored_names(self) -> tuple[str, ...]:
        return ("keys", "values", "key_scales", "value_scales")

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return None if self.keys is None else self._compute_dtype

    def _allocate_tensors(self, shape, dtype, where) -> None:
        self._compute_dtype = dtype
        codes = storage_dtype(self.quantization)
        self.keys = _zeros(shape, codes, where)
        self.values = _zeros(shape, codes, where)
        self.key_scales = _zeros((*shape[:3], 1), torch.float32, where)
        self.value_scales = _zeros((*shape[:3], 1), torch.float32, where)

    def set_compute_dtype(self, dtype: torch.dtype | None) -> None:
        """The dtype the codes dequantize to (a loaded state's)."""
        self._compute_dtype = dtype

    def _reserve_workspace(self) -> None:
        """The quantization staging (one chunk) and the dequantized K/V (the whole buffer), shared by all layers."""
        if self.keys is None:
            return
        batch, _, heads, head_dim = self.keys.shape
        device, ws, names = self.device, self.workspace, {}
        chunk = (batch, self._chunk_tokens, heads, head_dim)  # the largest chunk a write brings
        names["quant_work"] = ws.reserve("quant_work", chunk, torch.float32, device)
        names["quant_codes"] = ws.reserve("quant_codes", chunk, self.keys.dtype, device)
        names["quant_scales"] = ws.reserve("quant_scales", (*chunk[:3], 1), torch.float32, device)
        for name in ("keys", "values"):
            names[f"dequant_{name}"] = ws.reserve(f"dequant_{name}", self.keys.shape, self.compute_dtype, device)
        self._workspace_names = names

    def write_into(self, target, slots, key, value, on_written=None):
        view, names = self.workspace.view_named, self._workspace_names
        read = []
        for name, scale_name, chunk in (("keys", "key_scales", key), ("values", "value_scales", value)):
            codes = view(names["quant_codes"], chunk.shape)  # (B, T, H, D)
            scales = view(names["quant_scales"], (*chunk.shape[:3], 1))  # (B, T, H, 1)
            work = view(names["quant_work"], chunk.shape)
            quantize_into(chunk.detach(), codes, scales, work, self.quantization)  # storage carries no autograd
            as_bits(target[name]).index_copy_(1, slots, as_bits(codes))
            target[scale_name].index_copy_(1, slots, scales)
            if on_written is not None:
                on_written(name, codes)
                on_written(scale_name, scales)
            dequantized = view(names[f"dequant_{name}"], target[name].shape)  # (B, capacity, H, D)
            dequantize_into(target[name], target[scale_name], dequantized)
            read.append(dequantized.index_copy_(1, slots, chunk))  # the pending chunk itself stays exact
        return read[0], read[1]

    def decode(self, held, name, slots, rows):
        scales = held["key_scales" if name == "keys" else "value_scales"][:rows].index_select(1, slots)
        return (held[name][:rows].index_select(1, slots).float() * scales).to(self.compute_dtype)


class OffloadedKVStorage(nn.Module):
    """A `KVStorage` (dense or quantized) in CPU memory, visiting the compute device when its block runs.

    Args: home: the storage of the committed tokens, allocated by this one in CPU memory.
    """

    def __init__(self, home: KVStorage) -> None:
        super().__init__()
        self.home = home
        for name in _STAGED_NAMES.values():
            self.register_buffer(name, None)
        self._work_parity = 0  # which of the two shared work buffers this layer uses
        self._work_names: dict[str, str] = {}
        self._prefetch_event = None
        self._prefetched_rows: int | None = None

    # the stored tensors, compute dtype and device are the home's
    keys = property(lambda self: self.home.keys)
    values = property(lambda self: self.home.values)
    key_scales = property(lambda self: getattr(self.home, "key_scales", None))  # quantized home: its scales
    value_scales = property(lambda self: getattr(self.home, "value_scales", None))
    is_allocated = property(lambda self: self.home.is_allocated)
    compute_dtype = property(lambda self: self.home.compute_dtype)
    device = property(lambda self: self.home.device)

    @property
    def workspace(self) -> CacheWorkspace:
        return self.home.workspace

    @property
    def prefetched_rows(self) -> int | None:
        """Rows whose K/V a `prefetch` is bringing to the device for the next `write` (None: none under way)."""
        return self._prefetched_rows if self._prefetch_event is not None else None

    def _staged(self) -> dict[str, torch.Tensor]:
        held = {name: getattr(self, staged) for name, staged in _STAGED_NAMES.items()}
        return {name: tensor for name, tensor in held.items() if tensor is not None}

    def allocate(self, shape, chunk_tokens, dtype, device, home=None) -> None:
        """The home in CPU memory (pinned with CUDA), and host memory staging one chunk of each stored tensor."""
        self.home.allocate(shape, chunk_tokens, dtype, device, home=HOME)
        for name, tensor in self.home.stored().items():
            batch, _, heads, last = tensor.shape
            setattr(self, _STAGED_NAMES[name], _zeros((batch, chunk_tokens, heads, last), tensor.dtype, HOME))
        self._prefetch_event = None
        self._reserve_workspace()

    def share_workspace(self, workspace: CacheWorkspace, work_parity: int = 0) -> None:
        self._work_parity = work_parity % 2
        self.home.share_workspace(workspace, work_parity)
        self._reserve_workspace()

    def _reserve_workspace(self) -> None:
        """One device work buffer per stored tensor and parity, shared by every offloaded layer of the cache."""
        if not self.home.is_allocated:
            return
        ws, device = self.workspace, self.device
        self._work_names = {
            name: ws.reserve(f"offload{self._work_parity}_{name}", tuple(t.shape), t.dtype, device)
            for name, t in self.home.stored().items()
        }

    @property
    def work_parity(self) -> int:
        return self._work_parity

    def tensors(self) -> list[torch.Tensor]:
        return [*self.home.tensors(), *self._staged().values()]  # the work buffers are the workspace's

    def resident_bytes(self) -> int:
        return 0  # home and staging live in CPU memory; the work buffers are the workspace's

    # ------------------------------------------------------------------------------------ the step
    def _work(self, rows: int) -> dict[str, torch.Tensor]:
        return {
            name: self.workspace.view_named(self._work_names[name], (rows, *t.shape[1:]))
            for name, t in self.home.stored().items()
        }

    def prefetch(self, rows: int) -> None:
        """On CUDA, start copying home into the work buffer on the workspace's side stream (the next `write`
        waits for it); a no-op on CPU or before allocation."""
        if not self.home.is_allocated or rows > self.keys.shape[0] or self.device.type != "cuda":
            return
        stream = self.workspace.side_stream(self.device)
        self._prefetch_event = offloading.prefetch(self._work(rows), self.home.stored(), rows, stream)
        self._prefetched_rows = rows

    def _fetch(self, rows: int) -> dict[str, torch.Tensor]:
        """The committed K/V on the compute device (prefetched by the previous block, or copied now)."""
        work = self._work(rows)
        if self._prefetch_event is not None and self._prefetched_rows == rows:
            torch.cuda.current_stream(self.device).wait_event(self._prefetch_event)
        else:
            offloading.copy_rows(work, self.home.stored(), rows, non_blocking=self.device.type == "cuda")
        self._prefetch_event = None
        return work

    def _stage(self, name: str, chunk: torch.Tensor) -> None:
        """Copy the chunk written into `name` to host memory now (asynchronously); `commit` writes it home."""
        staged = getattr(self, _STAGED_NAMES[name])  # a buffer lookup, not the 4-entry dict of `_staged()`
        staged[: chunk.shape[0], : chunk.shape[1]].copy_(chunk, non_blocking=chunk.is_cuda)

    def write(self, slots, key, value):
        return self.home.write_into(self._fetch(key.shape[0]), slots, key, value, on_written=self._stage)

    def commit(self, slots: torch.Tensor, rows: int) -> None:
        """Write the staged chunk (`len(slots)` tokens of `rows` rows) into its home slots `slots` (on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # staged copies landed; no copy still reads home
        self._prefetch_event = None  # a prefetched copy predates this commit
        staged = {name: t[:rows, : slots.shape[0]] for name, t in self._staged().items()}
        offloading.write_home(self.home.stored(), staged, slots)

    def read(self, slots, rows):
        return self.home.read(slots, rows)

    def reset(self) -> None:
        self.home.reset()
        self._prefetch_event = None

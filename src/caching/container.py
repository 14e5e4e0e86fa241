"""`RollingKVCache`: the per-model container, mostly a list of layers.

`cache[i]` is block i's self-attention layer and `cache.cross[i]` its cross-attention layer (or
`None`). A family that needs more per block (SANA's temporal-convolution state) adds named slots:
`cache.slots["conv_state"][i]`. The container fans out `commit`, `rewind`, `crop`, `reset` and
`early_initialization`, and reports lengths and memory. One generation stream holds one cache.
Container operations check every layer before changing any, so a refused call leaves all layers as
they were.

The container is an `nn.Module` whose submodules are its layers (`layers.3`, `_cross_modules.3`,
`_slot_modules.conv_state.3`): `.to()` and `torch.export` see every buffer. Layers share one
`CacheWorkspace` (the dequantization and offload scratch), counted once by `memory_bytes()`.

`state_dict()` is the stream's state: the buffers of the self-attention and slot layers plus one
`*._extra_state` dict (JSON values) per layer and one for the container's layout; not the cross-attention
K/V (recomputed from the prompt) nor the workspace (scratch). `load_state_dict` into a cache built the same
way checks every layer first, restores them exactly (in place where allocated) and leaves the
cross-attention layers empty, for the pipeline to refill.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .base import EXTRA_STATE_KEY, CacheLayer, check_dtype_device
from .workspace import CacheWorkspace


def _layer_list(name: str, layers: Sequence[CacheLayer | None], expected: int | None, allow_none: bool) -> list:
    """Check a per-block list: a sequence of `expected` entries (any length if None), each a layer (or None)."""
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence | nn.ModuleList):
        raise TypeError(f"`{name}` must be a list of cache layers, got {type(layers).__name__}.")
    layers = list(layers)
    if expected is not None and len(layers) != expected:
        raise ValueError(f"`{name}` has {len(layers)} entries, expected one per block ({expected}).")
    for i, layer in enumerate(layers):
        if layer is None and allow_none:
            continue
        if not isinstance(layer, CacheLayer):
            allowed = "a CacheLayer or None" if allow_none else "a CacheLayer"
            raise TypeError(f"`{name}[{i}]` must be {allowed}, got {type(layer).__name__}.")
    return layers


def _registered(layers: list[CacheLayer | None]) -> nn.ModuleDict:
    """Per-block entries keyed by block index, `None` entries left out (a ModuleDict cannot hold None)."""
    return nn.ModuleDict({str(i): layer for i, layer in enumerate(layers) if layer is not None})


class RollingKVCache(nn.Module):
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
        super().__init__()
        layers = _layer_list("layers", layers, None, allow_none=False)
        if not layers:
            raise ValueError("`layers` must hold at least one CacheLayer.")
        cross_layers = [None] * len(layers) if cross_layers is None else cross_layers
        cross = _layer_list("cross_layers", cross_layers, len(layers), allow_none=True)
        if slots is not None and not isinstance(slots, Mapping):
            raise TypeError(f"`slots` must be a mapping of name -> per-block layers, got {type(slots).__name__}.")
        named_slots: dict[str, list[CacheLayer | None]] = {}
        for name, slot_layers in (slots or {}).items():
            if not isinstance(name, str) or not name.isidentifier() or name in ("layers", "cross"):
                raise ValueError(f"`slots` names must be identifiers other than 'layers'/'cross', got {name!r}.")
            named_slots[name] = _layer_list(f"slots[{name!r}]", slot_layers, len(layers), allow_none=True)
        everything = [*layers, *cross, *(layer for slot in named_slots.values() for layer in slot)]
        seen = [layer for layer in everything if layer is not None]
        if len({id(layer) for layer in seen}) != len(seen):
            raise ValueError("Each cache layer object may appear once in a cache (one per block and kind).")
        self.layers = nn.ModuleList(layers)
        self._cross_modules = _registered(cross)  # state_dict names: _cross_modules.3.keys (resume.py skips them)
        self._slot_modules = nn.ModuleDict({name: _registered(slot) for name, slot in named_slots.items()})
        self.cross: list[CacheLayer | None] = cross  # plain list, `None` where a block has none
        self.slots: dict[str, list[CacheLayer | None]] = named_slots
        self.workspace = CacheWorkspace()
        self._share_workspace()

    def _share_workspace(self) -> None:
        """One scratch for all layers; offloaded layers alternate work buffers and prefetch the next one."""
        offloaded = []
        for layer in self._all_layers():
            if hasattr(layer, "share_workspace"):
                parity = len(offloaded) if getattr(layer, "offload", False) else 0
                layer.share_workspace(self.workspace, parity)
                if getattr(layer, "offload", False):
                    offloaded.append(layer)
        # Block i prefetches the next offloaded block, unless that one reads the same work buffer.
        self._prefetch_next = {
            id(layer): following
            for layer, following in zip(offloaded, offloaded[1:] + offloaded[:1])
            if following is not layer and following.work_parity != layer.work_parity
        }
        for layer in offloaded:
            layer.set_prefetch_hook(self.prefetch_after)

    def prefetch_after(self, layer: CacheLayer, batch: int) -> None:
        """Start bringing the offloaded layer that runs after `layer` to the device (CUDA: on a side stream, while
        `layer`'s block computes). Offloaded layers call it after each `update`."""
        following = self._prefetch_next.get(id(layer))
        if following is not None:
            following.prefetch(batch)

    def __getitem__(self, index: int) -> CacheLayer:
        return self.layers[index]

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[CacheLayer]:
        return iter(self.layers)

    def _slot_layers(self) -> list[CacheLayer]:
        return [layer for slot in self.slots.values() for layer in slot if layer is not None]

    def _all_layers(self) -> list[CacheLayer]:
        return [layer for _, layer in self._layers_by_block()]

    def _layers_by_block(self) -> list[tuple[int, CacheLayer]]:
        """(block index, layer) for every layer of every kind: self-attention, cross-attention, then slots."""
        per_kind = [self.layers, self.cross, *self.slots.values()]
        return [(block, layer) for kind in per_kind for block, layer in enumerate(kind) if layer is not None]

    def _stream_layers(self) -> list[CacheLayer]:
        """Layers that advance with the stream (committed chunk by chunk): self-attention and slots."""
        return [*self.layers, *self._slot_layers()]

    @property
    def decides_on_host(self) -> bool:
        """Whether some self-attention layer's next update decides on the host (`CacheLayer.decides_on_host`): a
        compiled step runs that forward eager. Read once per forward: no list is built."""
        return any(layer.decides_on_host for layer in self.layers)

    @property
    def has_pending(self) -> bool:
        return any(layer.pending_tokens > 0 for layer in self._stream_layers())

    def commit(self, num_tokens: int | None = None) -> None:
        """Make every layer's pending chunk permanent. All layers must hold one; checked before any changes.

        `num_tokens`: commit only the first ones of each self-attention layer's pending tokens (the leaving chunk
        of a pipelined window under `context_policy="last_step"`); every stream layer must be able to."""
        missing = [i for i, layer in enumerate(self.layers) if layer.pending_tokens == 0]
        if missing:
            raise RuntimeError(
                f"RollingKVCache.commit() with nothing pending in layer(s) {missing[:8]}; "
                "run the model on a chunk (update every layer) before committing."
            )
        layers = [layer for layer in self._stream_layers() if layer.pending_tokens > 0]
        if num_tokens is None:
            for layer in layers:
                layer.commit()
            return
        unable = sorted({type(layer).__name__ for layer in layers if not hasattr(layer, "check_partial_commit")})
        if unable:
            raise TypeError(
                f"RollingKVCache.commit(num_tokens) needs layers that commit part of a chunk, not {unable}."
            )
        for layer in layers:
            layer.check_partial_commit(num_tokens)
        for layer in layers:
            layer.commit(num_tokens)

    @contextlib.contextmanager
    def context_pass(self) -> Iterator[None]:
        """The updates inside write the clean K/V the next `commit()` makes permanent (a context pass): a layer with a
        view of its own for it (`SlidingWindowLayer(context_window_tokens=...)`, Rolling Forcing's clean pass) shows
        that view; the others see as always. Ends on leaving the block, an exception included."""
        layers = [layer for layer in self.layers if hasattr(layer, "set_context_pass")]
        for layer in layers:
            layer.set_context_pass(True)
        try:
            yield
        finally:
            for layer in layers:
                layer.set_context_pass(False)

    def rewind(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` committed tokens of every stream layer (a re-cache).

        Every layer is checked first (`check_rewind`); only then is any layer changed.
        """
        for layer in self._stream_layers():
            layer.check_rewind(num_tokens)
        for layer in self._stream_layers():
            layer.rewind(num_tokens)

    def commit_replacing_last(self) -> None:
        """Commit the pending chunk in place of the last committed one, in every state layer that can (the
        linear-attention sums); the other stream layers (the temporal-conv state) commit as usual.
        Every layer is checked first (`check_replacing_last`); only then is any layer changed."""
        layers = self._stream_layers()
        for layer in layers:
            if hasattr(layer, "check_replacing_last"):
                layer.check_replacing_last()
        for layer in layers:
            if hasattr(layer, "commit_replacing_last"):
                layer.commit_replacing_last()
            elif layer.pending_tokens:
                layer.commit()

    def advance(self, num_tokens: int) -> None:
        """`advance(num_tokens)` on every sliding self-attention layer: the positions jump, the windows empty."""
        layers = [layer for layer in self.layers if hasattr(layer, "advance")]
        if len(layers) != len(self.layers):
            raise TypeError("Only caches of SlidingWindowLayer can advance.")
        for layer in layers:
            layer.advance(num_tokens)

    def set_cut_position(self, position: int | None) -> None:
        """`set_cut_position(position)` on every sliding self-attention layer: a scene cut places the pending chunk's
        re-indexed positions from token `position` on (None: back to right after the window)."""
        layers = [layer for layer in self.layers if hasattr(layer, "set_cut_position")]
        if len(layers) != len(self.layers):
            raise TypeError("Only caches of SlidingWindowLayer can place a scene cut.")
        for layer in layers:
            layer.set_cut_position(position)

    def crop(self, max_tokens: int) -> None:
        """`crop(max_tokens)` on every sliding self-attention layer (evict the oldest window tokens early).

        For one layer only (KV compression of one block), call `cache[i].crop(max_tokens)`.
        Every layer is checked first; only then is any layer changed.
        """
        croppable = [layer for layer in self.layers if hasattr(layer, "crop")]
        if not croppable:
            raise TypeError("No layer of this cache can crop (only SlidingWindowLayer can).")
        for layer in croppable:
            layer.check_crop(max_tokens)
        for layer in croppable:
            layer.crop(max_tokens)

    def reset(self) -> None:
        """Empty every layer, keeping the buffers (a new video with the same settings)."""
        for layer in self._all_layers():
            layer.reset()

    def reset_context(self) -> None:
        """Empty the stream layers (self-attention and slots), keeping the conditioning K/V: a context rebuilt
        under the same prompt (the recompute policy) needs no second text projection."""
        for layer in self._stream_layers():
            layer.reset()

    def reset_cross_attention(self) -> None:
        """Forget the conditioning K/V only (a prompt switch); self-attention context stays."""
        for layer in self.cross:
            if layer is not None:
                layer.reset()

    def early_initialization(
        self,
        batch_size: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str | Sequence[torch.device | str],
    ) -> None:
        """Allocate every layer for batches up to `batch_size` (a smaller batch then uses the first rows).

        `device` is one device, or one per block for a model split across devices (`device_map`): block i's
        layers of every kind (self, cross, slots) live where block i runs.
        Every layer is checked first (sizes, and that none holds a stream: `reset()` first).
        """
        devices = self._block_devices(device)
        for device_i in set(devices):
            check_dtype_device(dtype, device_i)
        placed = [(layer, devices[block]) for block, layer in self._layers_by_block()]
        for layer, layer_device in placed:
            if hasattr(layer, "check_early_initialization"):
                layer.check_early_initialization(batch_size, num_heads, head_dim, dtype, layer_device)
        for layer, layer_device in placed:
            layer.early_initialization(batch_size, num_heads, head_dim, dtype, layer_device)
        self._share_workspace()

    def _block_devices(self, device) -> list:
        if isinstance(device, (str, int, torch.device)):
            return [device] * len(self.layers)
        if not isinstance(device, Sequence) or len(device) != len(self.layers):
            raise ValueError(
                f"`device` must be one device or a sequence of one device per block ({len(self.layers)}), "
                f"got {device!r}."
            )
        return list(device)

    def get_seq_length(self, layer: int | None = None) -> int:
        """Committed tokens held by block `layer`'s self-attention layer, or the maximum over layers."""
        if layer is not None:
            return self.layers[layer].get_seq_length()
        return max(cache_layer.get_seq_length() for cache_layer in self.layers)

    def memory_bytes(self, device: torch.device | str | None = None) -> int:
        """Bytes held by all buffers of all layers, plus the shared workspace once (on `device` only, if given)."""
        layers = sum(layer.memory_bytes(device) for layer in self._all_layers())
        return layers + self.workspace.memory_bytes(device)

    # ------------------------------------------------------------------------------------ saving, loading
    def _layout(self) -> dict[str, Any]:
        def kinds(layers):
            return [None if layer is None else type(layer).__name__ for layer in layers]

        slots = {name: kinds(layers) for name, layers in self.slots.items()}
        return {"layers": kinds(self.layers), "cross": kinds(self.cross), "slots": slots}

    def get_extra_state(self) -> dict[str, Any]:
        return {"format": "rolldiff-cache-1", **self._layout()}

    def set_extra_state(self, state: Any) -> None:
        self._check_layout(state)

    def _check_layout(self, state: Any) -> None:
        if not isinstance(state, Mapping) or state.get("format") != "rolldiff-cache-1":
            raise ValueError(f"Not a saved RollingKVCache state (format 'rolldiff-cache-1'): {state!r:.200}.")
        own = self._layout()
        for part in ("layers", "cross", "slots"):
            if state.get(part) != own[part]:
                raise ValueError(
                    f"The saved cache's `{part}` are {state.get(part)}, this cache's {own[part]}: it was built "
                    "for another model or layout; build the cache the same way before loading."
                )

    def check_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Raise ValueError, naming the difference, unless `load_state_dict(state_dict)` can restore this cache
        exactly (same layout, kinds, sizes, batch, heads, head_dim and dtype); changes nothing."""
        if EXTRA_STATE_KEY in state_dict:
            self._check_layout(state_dict[EXTRA_STATE_KEY])
        for name, layer in self.named_modules():
            extra = state_dict.get(f"{name}.{EXTRA_STATE_KEY}")
            if not isinstance(layer, CacheLayer) or extra is None:
                continue
            prefix = f"{name}."
            tensors = layer.state_tensors(state_dict, prefix)
            # Keys under the layer's prefix that are none of its buffers: passed on so `check_state` names them.
            unknown = {
                k[len(prefix) :]: v
                for k, v in state_dict.items()
                if k.startswith(prefix) and k[len(prefix) :] not in tensors and k[len(prefix) :] != EXTRA_STATE_KEY
            }
            tensors = {**tensors, **unknown}
            try:
                layer.check_state(tensors, extra)
            except ValueError as error:
                raise ValueError(f"`{name}`: {error}") from None

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """Restore a `state_dict()` of a cache built the same way; every layer is checked before any is changed.

        Allocated buffers are written in place (same `data_ptr`); a layer that is still lazy allocates them
        on the device and in the dtype of the loaded tensors (load them where the model runs). The
        cross-attention layers are left empty: refill them from the prompt (`prepare_conditioning`).
        """
        self.check_state_dict(state_dict)
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self.reset_cross_attention()
        self._share_workspace()  # layers allocated by the load reserve their scratch
        return result

    def resident_bytes(self) -> int:
        """Bytes that live on the compute device: offloaded layers count only their slot maps and work buffers."""
        own = sum(
            layer.resident_bytes() if hasattr(layer, "resident_bytes") else layer.memory_bytes()
            for layer in self._all_layers()
        )
        return own + self.workspace.memory_bytes()

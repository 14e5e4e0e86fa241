"""Softmax self-attention cache with attention sink and a sliding window, written in place.

Layout of the `(batch, sink_tokens + ring_tokens, heads, head_dim)` buffer (`ring_tokens` is the window unless a
view below needs more):

    [ sink: slots 0 .. sink_tokens-1 | ring: ring_tokens slots, token p lives at sink + (p - sink) % ring ]

Token `p` (its absolute index in the stream) always lands in the same slot, so evicting means
nothing more than letting a later token overwrite that slot: no shift, no clone, no `torch.cat`.
The pending chunk (`chunk_tokens` at most) is written into the ring slots of the oldest committed
tokens, which are exactly the ones that fall out of the window as the chunk arrives; the
`window_tokens - chunk_tokens` most recent committed tokens are never touched before `commit()`, so an
exception mid-chunk leaves the committed state intact. Attention reads the whole buffer with a
boolean mask (`attention_mask`), so shapes never change and `torch.compile` builds one graph.
All counters are device tensors: no host sync, no Python-int guard that grows with the video.
In eager mode the slot arithmetic (positions, slots, slot map, mask) runs at a chunk's first step only;
its other denoising steps and the context pass write the same slots (compiled, it is part of the graph).

The layer owns positions, slots, the mask and commit / rewind / crop (the ring arithmetic, in one place);
where and how the K/V are stored is its `storage` (`storage.py`), chosen by two options:
- `quantization="int8"` / `"fp8"`: codes plus per token-and-head scales; `update` returns K/V dequantized
  into a scratch shared by the cache's layers, with the pending chunk exact;
- `offload=True`: committed K/V live in CPU memory and visit the compute device when the block runs.
A buffer allocated for batch B serves any batch b <= B: its first b rows.

What an update attends to (its view; the mask and the re-indexed positions follow it) is, by default, the sink, the
`window_tokens - chunk_tokens` most recent committed tokens and the chunk. Two options change it, each alone or
both (Rolling Forcing's loop, thu-ml/Causal-Forcing `long_video/wan/modules/causal_model.py:247-300`):
- `elastic_window`: an update of `n` tokens sees `window_tokens - n` committed ones, so a window of fewer chunks in
  flight (the end of a pipelined video) sees further back (`:266-272`: 21 frames less the query and the anchor);
- `context_window_tokens`: inside `RollingKVCache.context_pass()` an update sees the last `context_window_tokens`
  tokens of the stream ending with its chunk, the sink among them only while inside that span (`:247-262`).
The ring then holds the largest chunk plus the most committed tokens any update may see (`layout.ring_length`), so
the pending chunk still never overwrites a committed token a view reads, and an aborted chunk leaves every view
as it was.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..checks import check_choice, check_flag
from .base import (
    CacheLayer,
    check_dtype_device,
    check_key_value,
    check_matches_buffer,
    check_positive,
)
from .ema_sink import EmaSink
from .layout import context_start, ring_length, window_start
from .quantization import check_quantization
from .rolling_sink import SINK_MODES, RollingSink
from .storage import KVStorage, OffloadedKVStorage, QuantizedKVStorage
from .workspace import CacheWorkspace


def make_storage(quantization: str | None, offload: bool) -> KVStorage | OffloadedKVStorage:
    """The storage of a sliding layer's K/V: dense or quantized, resident or offloaded to CPU memory."""
    stored = KVStorage() if quantization is None else QuantizedKVStorage(quantization)
    return OffloadedKVStorage(stored) if offload else stored


class SlidingWindowLayer(CacheLayer):
    """Sink + sliding-window self-attention cache.

    Args:
        sink_tokens: tokens at the start of the stream that are never evicted (may be 0).
        window_tokens: the most recent tokens attention sees after the sink, counting the pending chunk
            (Self-Forcing's `local_attn_size`). Attention sees at most `sink_tokens + window_tokens` keys.
        chunk_tokens: the largest chunk `update` will receive; taken from the first update when `None`.
            Attention sees the `window_tokens - chunk_tokens` most recent committed tokens plus the chunk.
        quantization: `None` (K/V in the compute dtype), `"int8"` or `"fp8"` (per token-and-head scales).
        offload: keep the committed K/V in CPU memory (pinned with CUDA); they visit the compute device
            when the block runs. Eager only (`is_compileable` is False).
        sink_mode: `"fixed"` (the sink holds the first tokens; the window the most recent), `"rolling"`
            (Rolling Sink, `rolling_sink.py`: at each commit the chunk before the new one, once past the first
            `window_tokens - chunk_tokens` tokens, is overwritten by a ping-pong walk over a saved copy of them,
            at its own positions) or `"ema"` (Reward Forcing, `ema_sink.py`: at each commit the chunk leaving the
            window is blended into the sink, `sink = 0.999 sink + 0.001 chunk`; the chunk must equal the sink).
            Both need keys stored before RoPE (the model's `"relative"` positions), `chunk_tokens` and dense storage;
            rolling also `frame_tokens`.
        frame_tokens: tokens per latent frame (the rolling sink's unit; with the options below, the smallest update).
        elastic_window: the window counts the tokens actually pending, not `chunk_tokens`: an update of `n` tokens
            sees the `window_tokens - n` most recent committed ones (Rolling Forcing's window forward, thu-ml/
            Causal-Forcing `long_video/wan/modules/causal_model.py:266-272`: the working cache is 21 frames less the
            query and the 3-frame anchor, so it grows as the window of in-flight blocks empties).
        context_window_tokens: the span a context pass attends to, counted with its chunk: inside
            `RollingKVCache.context_pass()` an update of `n` tokens sees the last `context_window_tokens` tokens of the
            stream ending with it, the sink only while inside that span (Rolling Forcing's clean pass, `:247-262`:
            the last 21 frames of its buffer). `None`: a context pass sees what any update sees.
        Either option needs `chunk_tokens` (it sizes the ring, `ring_tokens`) and a fixed sink.
    """

    is_sliding = True
    can_rewind = True

    def __init__(  # noqa: PLR0913 (one keyword per cache feature, each documented above)
        self,
        sink_tokens: int,
        window_tokens: int,
        chunk_tokens: int | None = None,
        *,
        quantization: str | None = None,
        offload: bool = False,
        sink_mode: str = "fixed",
        frame_tokens: int | None = None,
        elastic_window: bool = False,
        context_window_tokens: int | None = None,
    ) -> None:
        super().__init__()
        self.sink_tokens = check_positive("sink_tokens", sink_tokens, allow_zero=True)
        self.window_tokens = check_positive("window_tokens", window_tokens)
        self.chunk_tokens: int | None = None
        if chunk_tokens is not None:
            self._set_chunk_tokens(chunk_tokens)
        self.quantization = check_quantization(quantization)
        check_flag("offload", offload)
        self.offload = offload
        self.is_compileable = not offload
        self.sink_mode, self.frame_tokens = check_choice("sink_mode", sink_mode, SINK_MODES), frame_tokens
        self.elastic_window = check_flag("elastic_window", elastic_window)
        self.context_window_tokens = (
            None if context_window_tokens is None else check_positive("context_window_tokens", context_window_tokens)
        )
        self.ring_tokens = self._ring_tokens()
        self.capacity = self.sink_tokens + self.ring_tokens
        self._context_pass = False  # inside `RollingKVCache.context_pass()` (`set_context_pass`)
        self.cut_position: int | None = None  # `set_cut_position`: where a scene cut places the pending tokens
        self.storage = make_storage(self.quantization, offload)
        self.rolling_sink = self._make_rolling_sink() if sink_mode == "rolling" else None
        self.ema_sink = self._make_ema_sink() if sink_mode == "ema" else None
        for name in ("slot_positions", "committed_tokens"):
            self.register_buffer(name, None)
        # committed_tokens: 0-dim long on the compute device; slot_positions: (capacity,) token index per slot, -1 empty
        self._committed_count = 0  # host mirror, read only outside the attention step
        self._stream_batch: int | None = None  # rows the stream uses since the last reset (eager updates)
        # Called as hook(self, batch) after an offloaded update: the container prefetches the next offloaded layer.
        self._prefetch_hook: Callable[[SlidingWindowLayer, int], None] | None = None
        # Eager steps of one chunk write the same slots: `update` does the slot arithmetic once per chunk.
        self._slot_arithmetic_done: tuple | None = None
        # `_frontier`: the ring holds every committed token of [frontier - ring, committed), none older;
        # `_window_full_flag` and `_prefix_readable` follow from it and the count (all set in `_set_counters`).
        self._set_counters(0, 0)

    @property
    def has_views(self) -> bool:
        """`elastic_window` or `context_window_tokens` is set: what an update sees depends on it, not on the window
        alone."""
        return self.elastic_window or self.context_window_tokens is not None

    def _ring_tokens(self) -> int:
        """Ring slots after the sink: the window, or what the views need (`layout.ring_length`)."""
        if not self.has_views:
            return self.window_tokens
        if self.chunk_tokens is None or self.sink_mode != "fixed":
            raise ValueError(
                "`elastic_window` / `context_window_tokens` size the ring by the largest chunk and need a fixed sink: "
                f"pass `chunk_tokens` and sink_mode='fixed' (got chunk_tokens={self.chunk_tokens}, "
                f"sink_mode={self.sink_mode!r})."
            )
        smallest = self._smallest_update
        return ring_length(
            self.window_tokens, self.chunk_tokens, smallest, self.elastic_window, self.context_window_tokens
        )

    @property
    def _smallest_update(self) -> int:
        """The fewest tokens an update of a layer with views may hold: one frame (one token without `frame_tokens`)."""
        return check_positive("frame_tokens", self.frame_tokens) if self.frame_tokens is not None else 1

    @property
    def _context_view(self) -> bool:
        """The update being made is a context pass with a view of its own (a host bool: compile guards on it)."""
        return self.context_window_tokens is not None and self._context_pass

    def set_context_pass(self, active: bool) -> None:
        """Mark the coming updates as a context pass (or not); `RollingKVCache.context_pass()` calls it. Only a layer
        with `context_window_tokens` sees differently in one."""
        self._context_pass = check_flag("active", active)

    def _make_rolling_sink(self) -> RollingSink:
        if self.quantization is not None or self.offload or self.chunk_tokens is None or self.frame_tokens is None:
            raise ValueError(
                "`sink_mode='rolling'` copies K/V between dense slots at each commit: it needs `chunk_tokens` and "
                f"`frame_tokens` and no `quantization`/`offload` (got chunk_tokens={self.chunk_tokens}, "
                f"frame_tokens={self.frame_tokens}, quantization={self.quantization!r}, offload={self.offload})."
            )
        frame_tokens = check_positive("frame_tokens", self.frame_tokens)
        return RollingSink(self.sink_tokens, self.window_tokens, self.chunk_tokens, frame_tokens, self._slot_of)

    def _make_ema_sink(self) -> EmaSink:
        if self.quantization is not None or self.offload or self.chunk_tokens is None:
            raise ValueError(
                "`sink_mode='ema'` blends dense K/V into the sink at each commit: it needs `chunk_tokens` and no "
                f"`quantization`/`offload` (got chunk_tokens={self.chunk_tokens}, quantization={self.quantization!r}, "
                f"offload={self.offload})."
            )
        return EmaSink(self.sink_tokens, self.window_tokens, self.chunk_tokens, self._slot_of)

    def _set_chunk_tokens(self, chunk_tokens: int) -> None:
        check_positive("chunk_tokens", chunk_tokens)
        if chunk_tokens > self.window_tokens:
            raise ValueError(
                f"A chunk of {chunk_tokens} tokens is larger than `window_tokens`={self.window_tokens}; "
                "the window counts the pending chunk, so `window_tokens` must be >= the chunk size."
            )
        self.chunk_tokens = chunk_tokens

    # ----------------------------------------------------------------------------------------- allocation
    def check_early_initialization(
        self, batch_size: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        if self.chunk_tokens is None:
            raise ValueError("`chunk_tokens` must be given to SlidingWindowLayer before `early_initialization`.")
        super().check_early_initialization(batch_size, num_heads, head_dim, dtype, device)

    def early_initialization(
        self, batch_size: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        """Allocate for batches up to `batch_size`; an empty layer of the same geometry keeps its buffers.

        Refused (RuntimeError) while the layer holds a stream: call `reset()` first.
        """
        self.check_early_initialization(batch_size, num_heads, head_dim, dtype, device)
        device = check_dtype_device(dtype, device)
        same = (
            self.keys is not None
            and self.keys.shape == (batch_size, self.capacity, num_heads, head_dim)
            and self.compute_dtype == dtype
            and self.slot_positions.device == device
        )
        if same:
            self.reset()
        else:
            self._allocate(batch_size, num_heads, head_dim, dtype, device)

    @property
    def buffer_tokens(self) -> int:
        """Slots the K/V buffers hold: the capacity (a subclass may keep a region of its own after it)."""
        return self.capacity

    def _allocate(self, batch: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.storage.allocate((batch, self.buffer_tokens, heads, head_dim), self.chunk_tokens, dtype, device)
        self.slot_positions = torch.full((self.capacity,), -1, dtype=torch.long, device=device)
        if self.rolling_sink is not None:
            self.rolling_sink.allocate(self.keys)
        self.committed_tokens = torch.zeros((), dtype=torch.long, device=device)
        # Scratch for the per-step index arithmetic, so the steady state allocates nothing.
        scratch = {
            "_offsets": torch.arange(self.chunk_tokens, dtype=torch.long, device=device),
            "_pending_positions": torch.empty(self.chunk_tokens, dtype=torch.long, device=device),
            "_pending_slots": torch.empty(self.chunk_tokens, dtype=torch.long, device=device),
            "_ring_offsets": torch.empty(self.chunk_tokens, dtype=torch.long, device=device),
            "_window_start_buffer": torch.zeros((), dtype=torch.long, device=device),
            "_pending_end": torch.zeros((), dtype=torch.long, device=device),
            "_mask": torch.zeros(self.capacity, dtype=torch.bool, device=device),
            "_scratch_mask": torch.zeros(self.capacity, dtype=torch.bool, device=device),
        }
        for name, tensor in scratch.items():
            self.register_buffer(name, tensor, persistent=False)
        if self.offload:  # host twins of the index scratch: the home slots of a commit, without allocating
            self._home_index = torch.zeros(
                4, self.chunk_tokens, dtype=torch.long
            )  # offsets, positions, slots, scratch
            torch.arange(self.chunk_tokens, out=self._home_index[0])
        self.pending_tokens, self._stream_batch = 0, None
        self._set_counters(0, 0, move_device=False)

    # The stored K/V (codes when quantized; in CPU memory when offloaded), through the storage.
    keys = property(lambda self: self.storage.keys)
    values = property(lambda self: self.storage.values)
    key_scales = property(lambda self: getattr(self.storage, "key_scales", None))
    value_scales = property(lambda self: getattr(self.storage, "value_scales", None))

    @property
    def is_initialized(self) -> bool:
        return self.storage.is_allocated

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype K/V arrive and are read in: the buffers' own (they follow `.to(dtype)`), or, quantized, the
        dtype given at allocation."""
        return self.storage.compute_dtype

    @property
    def workspace(self) -> CacheWorkspace:
        """Scratch of quantized / offloaded storage; a container shares one between its layers."""
        return self.storage.workspace

    def share_workspace(self, workspace: CacheWorkspace, work_parity: int = 0) -> None:
        """Use the container's workspace (one scratch for all layers); `work_parity` picks an offload work buffer."""
        self.storage.share_workspace(workspace, work_parity)

    @property
    def work_parity(self) -> int:
        """Which of the container's two device work buffers this offloaded layer reads (alternating by block)."""
        return getattr(self.storage, "work_parity", 0)

    def _tensors(self) -> list[torch.Tensor]:
        """What `memory_bytes` counts: the storage's buffers and the slot map (not the index scratch)."""
        return [*self.storage.tensors(), *([] if self.slot_positions is None else [self.slot_positions])]

    def resident_bytes(self) -> int:
        """Bytes this layer keeps on the compute device (an offloaded layer: only its slot map)."""
        slot_map = 0 if self.slot_positions is None else self.slot_positions.nbytes
        return self.storage.resident_bytes() + slot_map

    # ----------------------------------------------------------------------------------------- the window arithmetic
    def _slots_for(self, positions: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
        """Slot of each absolute token index: `p` in the sink, else `sink + (p - sink) % window`."""
        torch.clamp(positions, max=self.sink_tokens, out=out)
        torch.sub(positions, self.sink_tokens, out=scratch).clamp_(min=0).remainder_(self.ring_tokens)
        return out.add_(scratch)

    def _window_start(self, committed, out: torch.Tensor | None = None, num_pending: int = 0):
        """Absolute index of the oldest committed token after the sink that the next chunk sees (an elastic window:
        a chunk of `num_pending` tokens, when given)."""
        chunk = num_pending if self.elastic_window and num_pending else self.chunk_tokens
        return window_start(committed, self.sink_tokens, self.window_tokens, chunk, out=out)

    def _view_start(self, committed, num_pending: int, out: torch.Tensor | None = None):
        """Oldest token a context pass of `num_pending` tokens sees (no sink privileged), else the oldest after the sink
        that an update of `num_pending` tokens sees."""
        if self._context_view:
            return context_start(committed, num_pending, self.context_window_tokens, out=out)
        return self._window_start(committed, out=out, num_pending=num_pending)

    @property
    def committed_count(self) -> int:
        """Tokens committed since the last reset (a host int: the stream position, never read inside a step)."""
        return self._committed_count

    @property
    def window_full(self) -> bool:
        """True when every slot holds a token the next full chunk attends to: its mask is all True.

        The promise: `window_full` => `attention_mask.all()` after an `update` of `chunk_tokens` tokens, after
        any sequence of commit, rewind, crop and reset. A stored host bool (set only by `_set_counters`), so a
        compiled step can drop the mask (flash-attention kernels) without reading the device. Never inside a context
        pass with a view of its own (`context_window_tokens`).
        """
        return self._window_full_flag and not self._context_view  # stored bools: compile guards on them

    def _set_counters(self, committed: int, frontier: int, move_device: bool = True) -> None:
        """The one place the stream counters change (allocation, commit, rewind, crop, reset, loading a state).

        `committed`: tokens committed since the last reset (the next chunk starts at this index). `frontier`:
        the ring holds every committed token of `[max(sink, frontier - ring), committed)` in its own slot,
        and no older window token (older slots were overwritten by later writes, or evicted by `crop`).
        Every write of a chunk starting at `c` overwrites the slots of `c - ring ..` and nothing older, which
        `commit` records as `frontier = min(max(frontier, c + chunk_tokens), c + ring)` (any chunk since the
        last commit had at most `chunk_tokens` tokens); a rewind lowers `committed`, not `frontier`, so the
        slots rewound tokens still occupy count as overwritten. From the two counts:
        - the window is full when the next chunk's `window - chunk` recent tokens are all held and fill the ring:
          `ring == window`, `committed >= sink + window - chunk` and `frontier <= committed + chunk`;
        - the visible keys are slots `0 .. committed + n - 1` (`visible_prefix`) while no token sits outside its
          own index's slot: `committed + chunk <= capacity` and `frontier <= capacity`.
        The device counter moves by the same difference (in place: a traced commit stays relative), unless
        `move_device` is False (it was loaded or is being read back); the eager slot memo is forgotten.
        """
        if move_device and self.committed_tokens is not None:
            if committed == 0:
                self.committed_tokens.zero_()
            elif committed != self._committed_count:
                self.committed_tokens.add_(committed - self._committed_count)
        self._committed_count, self._frontier = committed, frontier
        chunk = self.chunk_tokens
        self._window_full_flag = (
            chunk is not None
            and self.ring_tokens == self.window_tokens
            and committed >= self.capacity - chunk
            and frontier <= committed + chunk
        )
        self._prefix_readable = chunk is not None and committed + chunk <= self.capacity and frontier <= self.capacity
        self.forget_slot_arithmetic()

    def visible_prefix(self, num_pending: int) -> int | None:
        """While the window fills, the keys a chunk of `num_pending` tokens attends to are exactly slots
        `0 .. n-1` (token p sits in slot p until the ring wraps): returns n, so attention can read that prefix
        with no mask (fused kernels, and only the work the tokens need: a stream's first chunk is 4x cheaper
        at sink 3 + window 9). `None` once a slot of the prefix may hold another token (the ring wrapped, or a
        crop emptied it; see `_set_counters`), and in a compiled or exported step, which keeps one graph with
        the mask (a prefix length would recompile per fill state). Host state only: no device read.
        """
        if torch.compiler.is_compiling():  # first: a compiled step must not guard on the flags below
            return None
        if not self._prefix_readable:
            return None
        committed = self._committed_count
        if self.has_views and self._view_start(committed, num_pending) > (
            0 if self._context_view else self.sink_tokens
        ):
            return None  # the view starts past the sink (elastic) or past token 0 (a context pass)
        return committed + num_pending

    def _refresh_mask(self, num_pending: int) -> None:
        positions, mask, below_end = self.slot_positions, self._mask, self._scratch_mask
        view_start = self._view_start(self.committed_tokens, num_pending, out=self._window_start_buffer)
        pending_end = torch.add(self.committed_tokens, num_pending, out=self._pending_end)
        torch.lt(positions, pending_end, out=below_end)  # drops leftovers of an aborted larger chunk
        torch.ge(positions, view_start, out=mask).logical_and_(below_end)
        if self._context_view:  # the sink's slots are seen like any other: while inside the span
            return
        sink = slice(0, self.sink_tokens)
        torch.ge(positions[sink], 0, out=mask[sink]).logical_and_(below_end[sink])

    # ----------------------------------------------------------------------------------------- the contract
    def update(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the pending chunk `(batch, chunk, heads, head_dim)`; return K/V `(batch, capacity, heads, head_dim)`.

        Attention must use them with `attention_mask` (True = attend). Calling `update` again before
        `commit()` overwrites the same slots (the next denoising step of the same chunk). The returned
        tensors are the first `batch` rows of the buffers (a quantized layer: the shared dequantized scratch,
        valid until the next layer's update; an offloaded layer: the shared device work buffer).
        """
        check_key_value(key, value)
        num_pending = key.shape[1]
        if num_pending < 1:
            raise ValueError("`key` must hold at least one token.")
        if self.has_views:
            self._check_view_update(num_pending)
        if self.keys is None:
            if self.chunk_tokens is None:
                self._set_chunk_tokens(num_pending)
            self._check_chunk(num_pending)
            batch, _, heads, head_dim = key.shape
            self._allocate(batch, heads, head_dim, key.dtype, key.device)
        else:
            self._check_chunk(num_pending)
            check_matches_buffer(
                "key", key, self.keys, allow_smaller_batch=True, dtype=self.compute_dtype,
                device=self.slot_positions.device,
            )  # fmt: skip
        batch = key.shape[0]
        if not torch.compiler.is_compiling():
            self._check_stream_batch(batch)
        eager = not torch.compiler.is_compiling()
        if eager and self._slot_arithmetic_done == self._slot_state(num_pending):
            slots = self._pending_slots[:num_pending]  # another step of the same chunk: same slots, map and mask
        else:
            positions = torch.add(
                self.committed_tokens, self._offsets[:num_pending], out=self._pending_positions[:num_pending]
            )
            slots = self._slots_for(positions, self._pending_slots[:num_pending], self._ring_offsets[:num_pending])
            self.slot_positions.index_copy_(0, slots, positions)
            self._refresh_mask(num_pending)
            self._slot_arithmetic_done = self._slot_state(num_pending) if eager else None
        keys, values = self.storage.write(slots, key, value)
        self.pending_tokens = num_pending
        if self.offload and self._prefetch_hook is not None:
            self._prefetch_hook(self, batch)
        return keys, values

    def _slot_state(self, num_pending: int) -> tuple[int, int, bool]:
        """The chunk (and view) whose slots, slot map and mask `update` last computed (eager); cleared by
        `_set_counters`."""
        return (self._committed_count, num_pending, self._context_view)

    def _check_view_update(self, num_pending: int) -> None:
        """An update the ring was sized for: one frame at least, and a context pass no longer than its span."""
        if num_pending < self._smallest_update:
            raise ValueError(
                f"`key` holds {num_pending} tokens, fewer than one frame ({self._smallest_update}): the ring of "
                "`elastic_window` / `context_window_tokens` is sized for updates of whole frames."
            )
        if self._context_view and num_pending > self.context_window_tokens:
            raise ValueError(
                f"A context pass of {num_pending} tokens is longer than `context_window_tokens`="
                f"{self.context_window_tokens}, the span it attends to counting itself; widen the span."
            )

    def forget_slot_arithmetic(self) -> None:
        """The next `update` recomputes its slots and mask (after anything changed the counters or the slot map
        outside this layer's methods, e.g. an exported program ran)."""
        self._slot_arithmetic_done = None

    def sync_host_counters(self) -> None:
        """Re-read the committed count from the device counter, after something other than this layer's methods
        advanced it (an exported program ran chunks). Assumes those chunks were committed, none rewound."""
        if self.committed_tokens is None:
            return
        committed = int(self.committed_tokens.item())
        self.pending_tokens = 0
        self._set_counters(committed, max(self._frontier, committed + self.chunk_tokens), move_device=False)

    # ----------------------------------------------------------------------------------------- saving, loading
    config_from_state = ("chunk_tokens",)

    def state_config(self) -> dict:
        return {
            "sink_tokens": self.sink_tokens,
            "window_tokens": self.window_tokens,
            "chunk_tokens": self.chunk_tokens,
            "quantization": self.quantization,
            "offload": self.offload,
            "sink_mode": self.sink_mode,
            "frame_tokens": self.frame_tokens,
            "elastic_window": self.elastic_window,
            "context_window_tokens": self.context_window_tokens,
        }

    def host_state(self) -> dict:
        dtype = self.compute_dtype
        return {
            "committed_tokens": self._committed_count,
            "frontier": self._frontier,
            "pending_tokens": self.pending_tokens,
            "stream_batch": self._stream_batch,
            "compute_dtype": None if dtype is None else str(dtype).removeprefix("torch."),
            **({} if self.ema_sink is None else {"ema_blended_until": self.ema_sink.blended_until}),
        }

    def load_host_state(self, state) -> None:
        self.pending_tokens, self._stream_batch = state["pending_tokens"], state["stream_batch"]
        dtype = state["compute_dtype"]
        if hasattr(self.storage, "set_compute_dtype"):  # quantized: what the codes dequantize to
            self.storage.set_compute_dtype(None if dtype is None else getattr(torch, dtype))
        self._set_counters(state["committed_tokens"], state["frontier"], move_device=False)
        if self.ema_sink is not None:
            self.ema_sink.blended_until = state.get("ema_blended_until", self._window_start(self._committed_count))
        if self.slot_positions is not None:
            self._refresh_mask(self.pending_tokens)  # the mask is scratch: what the last `update` computed

    def allocate_like(self, tensors, extra) -> None:
        batch, _, heads, head_dim = next(t for name, t in tensors.items() if name.endswith("keys")).shape
        dtype = extra["state"]["compute_dtype"]
        self._allocate(batch, heads, head_dim, getattr(torch, dtype), tensors["slot_positions"].device)

    def loaded_without_host_state(self) -> None:
        if self.committed_tokens is not None:  # host state unknown: no committed token counts as held intact
            committed = int(self.committed_tokens.item())
            self._set_counters(committed, committed + self.ring_tokens, move_device=False)
            if self.ema_sink is not None:  # what left the window before the state was saved was blended then
                self.ema_sink.blended_until = self._window_start(committed)

    def _check_chunk(self, num_pending: int) -> None:
        if num_pending > self.chunk_tokens:
            raise ValueError(
                f"`key` holds {num_pending} tokens but this layer takes chunks of at most "
                f"`chunk_tokens`={self.chunk_tokens} (window_tokens={self.window_tokens})."
            )

    def _check_stream_batch(self, batch: int) -> None:
        """One stream keeps its batch until `reset()`: rows it did not write hold no context."""
        if self._stream_batch is not None and batch != self._stream_batch and self._committed_count > 0:
            raise ValueError(
                f"`key` has batch {batch} but this stream has run with batch {self._stream_batch} since the last "
                "`reset()`; call `reset()` before serving another batch size."
            )
        self._stream_batch = batch

    # ----------------------------------------------------------------------------------------- offload
    def set_prefetch_hook(self, hook: Callable[[SlidingWindowLayer, int], None] | None) -> None:
        """`hook(self, batch)` runs after each offloaded `update` (a container prefetches the next layer then)."""
        self._prefetch_hook = hook

    def prefetch(self, batch: int) -> None:
        """Offloaded, on CUDA: start copying the committed K/V of `batch` rows to the device on a side stream (the
        next `update` waits for it); a no-op otherwise. The container calls it for the block that runs next."""
        self.storage.prefetch(batch)

    def _commit_slots(self) -> torch.Tensor:
        """The pending chunk's slots, from the host counters on CPU scratch (an offloaded layer's home is there)."""
        offsets, positions, slots, scratch = self._home_index[:, : self.pending_tokens]
        return self._slots_for(torch.add(offsets, self._committed_count, out=positions), slots, scratch)

    def check_partial_commit(self, num_tokens: int) -> None:
        """Refuse `commit(num_tokens)` unless 1 <= num_tokens <= the pending tokens (nothing changes)."""
        self._require_pending()
        if (
            isinstance(num_tokens, bool)
            or not isinstance(num_tokens, int)
            or not 1 <= num_tokens <= self.pending_tokens
        ):
            raise ValueError(
                f"`num_tokens` must be an int from 1 to the {self.pending_tokens} pending tokens, got {num_tokens!r}."
            )

    def commit(self, num_tokens: int | None = None) -> None:
        """Make the pending tokens permanent; with `num_tokens`, only the first ones (pipelined denoising under
        `context_policy="last_step"`: the leaving chunk's writes of a window's forward, the rest written again by
        the next update)."""
        if num_tokens is None:
            self._require_pending()
        else:
            self.check_partial_commit(num_tokens)
            self.pending_tokens = num_tokens
        if self.offload:  # home only changes now (resident storage was written in place by `update`)
            self.storage.commit(self._commit_slots(), self._stream_batch or self.keys.shape[0])
        start, pending = self._committed_count, self.pending_tokens
        # The writes since the last commit started at `start` and held at most `chunk_tokens` tokens.
        frontier = min(max(self._frontier, start + self.chunk_tokens), start + self.ring_tokens)
        self.pending_tokens = 0
        self._set_counters(start + pending, frontier)
        if self.rolling_sink is not None:
            self.rolling_sink.after_commit(self.keys, self.values, start, pending)
        if self.ema_sink is not None:
            self.ema_sink.after_commit(self.keys, self.values, start + pending)

    def reset(self) -> None:
        self.storage.reset()
        if self.rolling_sink is not None:
            self.rolling_sink.reset()
        if self.ema_sink is not None:
            self.ema_sink.reset()
        if self.slot_positions is not None:
            self.slot_positions.fill_(-1)
            self._mask.zero_()
        self.pending_tokens = 0
        self._stream_batch = None
        self.cut_position = None
        self._set_counters(0, 0)

    @property
    def in_use(self) -> bool:
        return self.pending_tokens > 0 or self._committed_count > 0

    def _visible_committed_positions(self) -> list[int]:
        """Absolute indices of the committed tokens the next chunk will see, oldest first.

        Reads the slot map (a host sync; never called from the attention step) so that tokens
        overwritten in the ring, e.g. before a `rewind`, or evicted by `crop`, are never reported as held.
        """
        total = self._committed_count
        if self.slot_positions is None or total == 0:
            return []
        sink = range(min(total, self.sink_tokens))
        start = self._window_start(total)
        candidates = [*sink, *range(start, total)]
        held = self.slot_positions.tolist()
        return [p for p in candidates if held[self._slot_of(p)] == p]

    def _slot_of(self, position: int) -> int:
        """Host twin of `_slots_for` for one position."""
        if position < self.sink_tokens:
            return position
        return self.sink_tokens + (position - self.sink_tokens) % self.ring_tokens

    def get(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Committed sink and window tokens in stream order, `(batch, tokens, heads, head_dim)`: a copy,
        in the compute dtype on the compute device (dequantized / fetched from home when so stored)."""
        positions = self._visible_committed_positions()
        if not positions:
            return None
        slots = torch.tensor([self._slot_of(p) for p in positions], dtype=torch.long)
        keys, values = self.storage.read(slots, self._stream_batch or self.keys.shape[0])
        return keys, values

    def get_seq_length(self) -> int:
        return len(self._visible_committed_positions())

    # ----------------------------------------------------------------------------------------- for attention
    @property
    def attention_mask(self) -> torch.Tensor:
        """`(capacity,)` bool, True where a slot holds a token the current chunk attends to."""
        return self._mask

    def pending_slot_mask(self) -> torch.Tensor:
        """`(capacity,)` bool, True where a slot holds a token of the pending chunk."""
        return self._mask & (self.slot_positions >= self.committed_tokens)

    def key_positions(self, reindexed: bool = False) -> torch.Tensor:
        """`(capacity,)` position of each slot's token: absolute, or re-indexed inside sink + window.

        Re-indexed positions put the sink at `0 .. sink-1` and the visible window right after it, so
        positions stay below `sink_tokens + window_tokens` however long the stream runs.
        """
        if not reindexed:
            return self.slot_positions
        return self._reindex(self.slot_positions, self.pending_tokens)

    def pending_positions(
        self, num_tokens: int, reindexed: bool = False, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """`(num_tokens,)` positions the next `update` of `num_tokens` tokens will get (for RoPE on queries)."""
        if self.committed_tokens is None:  # nothing allocated yet: the stream starts at 0 in both modes
            return torch.arange(num_tokens, device=device)
        # Written into the scratch that `update` fills with the same values: no allocation on the step.
        positions = torch.add(
            self.committed_tokens, self._offsets[:num_tokens], out=self._pending_positions[:num_tokens]
        )
        return self._reindex(positions, num_tokens) if reindexed else positions

    def _reindex(self, positions: torch.Tensor, num_pending: int) -> torch.Tensor:
        """Positions inside the view of an update of `num_pending` tokens: the sink first, the window right after it
        (a context pass with its own view: from its first token, the sink not privileged); the pending tokens from
        `cut_position` on while a scene cut is set."""
        view_start = self._view_start(self.committed_tokens, num_pending)
        if self._context_view:  # slots outside the span are masked: clamped only to stay inside the RoPE table
            return (positions - view_start).clamp_(0, self.context_window_tokens - 1)
        reindexed = torch.where(positions < self.sink_tokens, positions, positions - view_start + self.sink_tokens)
        if self.has_views:  # a larger ring holds masked slots beyond the view: keep them inside the table too
            reindexed = reindexed.clamp_(0, self.sink_tokens + self.window_tokens - 1)
        if self.cut_position is not None:
            pending = positions >= self.committed_tokens  # empty slots carry -1: never pending
            reindexed = torch.where(pending, positions - self.committed_tokens + self.cut_position, reindexed)
        return reindexed

    def set_cut_position(self, position: int | None) -> None:
        """A scene cut (Infinity-RoPE's RoPE cut, yesiltepe-hidir/infinity-rope `wan/modules/causal_model.py:27-44`):
        until set back to `None`, the pending tokens' re-indexed positions start at token `position` instead of
        right after the window, queries and keys alike, while the committed tokens keep theirs. The jump in time
        reads as a cut; the keys are stored before RoPE, so later chunks see these tokens at their plain places.
        Re-indexed positions only (the model's "relative" mode); set between chunks, cleared by `reset`."""
        if position is not None:
            check_positive("position", position, allow_zero=True)
        self.cut_position = position

    # ----------------------------------------------------------------------------------------- re-cache, crop
    def check_rewind(self, num_tokens: int) -> None:
        super().check_rewind(num_tokens)
        if self.pending_tokens:
            raise RuntimeError("rewind() with a chunk pending; commit it first.")
        rewindable = 0 if self.chunk_tokens is None else self._committed_count - self._reach_start()
        if num_tokens > rewindable:
            raise ValueError(
                f"`num_tokens`={num_tokens} exceeds the {max(rewindable, 0)} committed window tokens that can "
                "be rewound (the sink and evicted tokens cannot)."
            )

    def _reach_start(self) -> int:
        """The oldest committed token after the sink that some later update may see: the next chunk's window, or
        further back where a view reaches (the ring holds exactly those beside the largest chunk)."""
        if not self.has_views:
            return self._window_start(self._committed_count)
        return max(self.sink_tokens, self._committed_count - (self.ring_tokens - self.chunk_tokens))

    def rewind(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` committed tokens so they can be written again (a re-cache).

        Used after a prompt switch: the recent window is re-run under the new prompt and committed
        chunk by chunk into the same slots. Only the visible window can be rewound; the sink never is.
        """
        self.check_rewind(num_tokens)
        self._set_counters(self._committed_count - num_tokens, self._frontier)  # rewound slots stay overwritten

    def advance(self, num_tokens: int) -> None:
        """Move the stream position `num_tokens` forward with nothing written: the window is emptied, the sink kept.

        The next chunk then sits at its true absolute positions after a gap, attending to the sink and itself; a
        re-cache that runs several frames in one pass at their own positions (LongLive's) builds its pass in a
        small scratch cache this way, whatever the stream's length. Needs a full sink and no pending chunk.
        """
        check_positive("num_tokens", num_tokens, allow_zero=True)
        if self.pending_tokens:
            raise RuntimeError("advance() with a chunk pending; commit it first.")
        if self._committed_count < self.sink_tokens:
            raise ValueError(
                f"advance() needs the sink filled first ({self._committed_count} of {self.sink_tokens} tokens)."
            )
        if num_tokens == 0 or self.keys is None:
            return
        positions = self.slot_positions
        positions.masked_fill_(positions >= self.sink_tokens, -1)  # no window token is held any more
        committed = self._committed_count + num_tokens
        self._set_counters(committed, committed + self.ring_tokens)
        self._refresh_mask(0)

    def check_crop(self, max_tokens: int) -> list[int]:
        """Raise if `crop(max_tokens)` would be refused; return the positions it would evict (changes nothing)."""
        check_positive("max_tokens", max_tokens, allow_zero=True)
        if self.pending_tokens:
            raise RuntimeError("crop() with a chunk pending; commit it first.")
        held = self._visible_committed_positions()
        sink = [p for p in held if p < self.sink_tokens]
        if max_tokens < len(sink):
            raise ValueError(
                f"`max_tokens`={max_tokens} is below the {len(sink)} sink tokens held; crop evicts window tokens only."
            )
        window = [p for p in held if p >= self.sink_tokens]
        return window[: max(len(held) - max_tokens, 0)]

    def crop(self, max_tokens: int) -> None:
        """Keep at most `max_tokens` committed tokens, evicting the oldest window tokens early (KV compression).

        The stream position is unchanged (the next chunk's positions, and every other layer, are not
        affected); only this layer's mask loses the evicted slots. To forget the most recent tokens
        instead (transformers' `crop`), use `rewind`.
        """
        evicted = self.check_crop(max_tokens)
        if evicted:
            kept_from = evicted[-1] + 1  # every window token older than this is evicted, hidden ones too
            positions = self.slot_positions
            positions.masked_fill_((positions >= self.sink_tokens) & (positions < kept_from), -1)
            self._refresh_mask(0)
            self._set_counters(self._committed_count, max(self._frontier, kept_from + self.ring_tokens))

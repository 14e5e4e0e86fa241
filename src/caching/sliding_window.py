"""Softmax self-attention cache with attention sink and a sliding window, written in place.

Layout of the `(batch, sink_tokens + window_tokens, heads, head_dim)` buffer:

    [ sink: slots 0 .. sink_tokens-1 | ring: window_tokens slots, token p lives at sink + (p - sink) % window ]

Token `p` (its absolute index in the stream) always lands in the same slot, so evicting means
nothing more than letting a later token overwrite that slot: no shift, no clone, no `torch.cat`.
The pending chunk (`chunk_tokens` at most) is written into the ring slots of the oldest committed
tokens, which are exactly the ones that fall out of the window as the chunk arrives; the
`window_tokens - chunk_tokens` most recent committed tokens are never touched before `commit()`, so an
exception mid-chunk leaves the committed state intact. Attention reads the whole buffer with a
boolean mask (`attention_mask`), so shapes never change and `torch.compile` builds one graph.
All counters are device tensors: no host sync, no Python-int guard that grows with the video.
"""

from __future__ import annotations

import torch

from .base import CacheLayer, check_allocation_sizes, check_key_value, check_matches_buffer, check_positive
from .layout import window_start


class SlidingWindowLayer(CacheLayer):
    """Sink + sliding-window self-attention cache.

    Args:
        sink_tokens: tokens at the start of the stream that are never evicted (may be 0).
        window_tokens: the most recent tokens attention sees after the sink, counting the pending chunk
            (Self-Forcing's `local_attn_size`). Attention sees at most `sink_tokens + window_tokens` keys.
        chunk_tokens: the largest chunk `update` will receive; taken from the first update when `None`.
            Attention sees the `window_tokens - chunk_tokens` most recent committed tokens plus the chunk.
    """

    is_sliding = True
    can_rewind = True

    def __init__(self, sink_tokens: int, window_tokens: int, chunk_tokens: int | None = None) -> None:
        super().__init__()
        self.sink_tokens = check_positive("sink_tokens", sink_tokens, allow_zero=True)
        self.window_tokens = check_positive("window_tokens", window_tokens)
        self.chunk_tokens: int | None = None
        if chunk_tokens is not None:
            self._set_chunk_tokens(chunk_tokens)
        self.capacity = self.sink_tokens + self.window_tokens
        self.committed_tokens: torch.Tensor | None = None  # 0-dim long, on the cache device
        self.slot_positions: torch.Tensor | None = None  # (capacity,) absolute token index per slot, -1 empty
        self._committed_count = 0  # host mirror, read only outside the attention step

    def _set_chunk_tokens(self, chunk_tokens: int) -> None:
        check_positive("chunk_tokens", chunk_tokens)
        if chunk_tokens > self.window_tokens:
            raise ValueError(
                f"A chunk of {chunk_tokens} tokens is larger than `window_tokens`={self.window_tokens}; "
                "the window counts the pending chunk, so `window_tokens` must be >= the chunk size."
            )
        self.chunk_tokens = chunk_tokens

    # ----------------------------------------------------------------------------------------- allocation
    def early_initialization(
        self, batch_size: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        if self.chunk_tokens is None:
            raise ValueError("`chunk_tokens` must be given to SlidingWindowLayer before `early_initialization`.")
        check_allocation_sizes(batch_size, num_heads, head_dim)
        self._allocate(batch_size, num_heads, head_dim, dtype, torch.device(device))

    def _allocate(self, batch: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.keys = torch.zeros(batch, self.capacity, heads, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.slot_positions = torch.full((self.capacity,), -1, dtype=torch.long, device=device)
        self.committed_tokens = torch.zeros((), dtype=torch.long, device=device)
        # Scratch for the per-step index arithmetic, so the steady state allocates nothing.
        self._offsets = torch.arange(self.chunk_tokens, dtype=torch.long, device=device)
        self._pending_positions = torch.empty(self.chunk_tokens, dtype=torch.long, device=device)
        self._pending_slots = torch.empty_like(self._pending_positions)
        self._ring_offsets = torch.empty_like(self._pending_positions)
        self._window_start_buffer = torch.zeros((), dtype=torch.long, device=device)
        self._pending_end = torch.zeros((), dtype=torch.long, device=device)
        self._mask = torch.zeros(self.capacity, dtype=torch.bool, device=device)
        self._scratch_mask = torch.zeros_like(self._mask)

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.keys, self.values, self.slot_positions) if t is not None]

    # ----------------------------------------------------------------------------------------- the window arithmetic
    def _slots_for(self, positions: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
        """Slot of each absolute token index: `p` in the sink, else `sink + (p - sink) % window`."""
        torch.clamp(positions, max=self.sink_tokens, out=out)
        torch.sub(positions, self.sink_tokens, out=scratch).clamp_(min=0).remainder_(self.window_tokens)
        return out.add_(scratch)

    def _window_start(self, committed, out: torch.Tensor | None = None):
        """Absolute index of the oldest committed token after the sink that the next chunk sees."""
        return window_start(committed, self.sink_tokens, self.window_tokens, self.chunk_tokens, out=out)

    @property
    def window_full(self) -> bool:
        """True once every slot holds a token the next full chunk attends to: its mask is all True.

        A host-side flag (changed only by `commit`, `rewind` and `reset`), so a compiled step can drop the
        mask (flash-attention kernels) without reading the device.
        """
        return self.chunk_tokens is not None and self._committed_count >= self.capacity - self.chunk_tokens

    def _refresh_mask(self, num_pending: int) -> None:
        positions, mask, below_end = self.slot_positions, self._mask, self._scratch_mask
        window_start = self._window_start(self.committed_tokens, out=self._window_start_buffer)
        pending_end = torch.add(self.committed_tokens, num_pending, out=self._pending_end)
        torch.lt(positions, pending_end, out=below_end)  # drops leftovers of an aborted larger chunk
        torch.ge(positions, window_start, out=mask).logical_and_(below_end)
        sink = slice(0, self.sink_tokens)
        torch.ge(positions[sink], 0, out=mask[sink]).logical_and_(below_end[sink])

    # ----------------------------------------------------------------------------------------- the contract
    def update(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the pending chunk `(batch, chunk, heads, head_dim)`; return the whole buffers.

        Attention must use them with `attention_mask` (True = attend). Calling `update` again before
        `commit()` overwrites the same slots (the next denoising step of the same chunk).
        """
        check_key_value(key, value)
        num_pending = key.shape[1]
        if num_pending < 1:
            raise ValueError("`key` must hold at least one token.")
        if self.keys is None:
            if self.chunk_tokens is None:
                self._set_chunk_tokens(num_pending)
            self._check_chunk(num_pending)
            batch, _, heads, head_dim = key.shape
            self._allocate(batch, heads, head_dim, key.dtype, key.device)
        else:
            self._check_chunk(num_pending)
            check_matches_buffer("key", key, self.keys)
        positions = torch.add(
            self.committed_tokens, self._offsets[:num_pending], out=self._pending_positions[:num_pending]
        )
        slots = self._slots_for(positions, self._pending_slots[:num_pending], self._ring_offsets[:num_pending])
        self.keys.index_copy_(1, slots, key)
        self.values.index_copy_(1, slots, value)
        self.slot_positions.index_copy_(0, slots, positions)
        self._refresh_mask(num_pending)
        self.pending_tokens = num_pending
        return self.keys, self.values

    def _check_chunk(self, num_pending: int) -> None:
        if num_pending > self.chunk_tokens:
            raise ValueError(
                f"`key` holds {num_pending} tokens but this layer takes chunks of at most "
                f"`chunk_tokens`={self.chunk_tokens} (window_tokens={self.window_tokens})."
            )

    def commit(self) -> None:
        self._require_pending()
        self.committed_tokens.add_(self.pending_tokens)
        self._committed_count += self.pending_tokens
        self.pending_tokens = 0

    def reset(self) -> None:
        if self.keys is not None:
            self.keys.zero_()
            self.values.zero_()
            self.slot_positions.fill_(-1)
            self.committed_tokens.zero_()
            self._mask.zero_()
        self._committed_count = 0
        self.pending_tokens = 0

    def _visible_committed_positions(self) -> list[int]:
        """Absolute indices of the committed tokens the next chunk will see, oldest first.

        Reads the slot map (a host sync; never called from the attention step) so that tokens
        overwritten in the ring, e.g. before a `rewind`, are never reported as held.
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
        return self.sink_tokens + (position - self.sink_tokens) % self.window_tokens

    def get(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Committed sink and window tokens in stream order, `(batch, tokens, heads, head_dim)` (a copy)."""
        positions = self._visible_committed_positions()
        if not positions:
            return None
        slots = torch.tensor([self._slot_of(p) for p in positions], dtype=torch.long, device=self.keys.device)
        return self.keys.index_select(1, slots), self.values.index_select(1, slots)

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
        return self._reindex(self.slot_positions)

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
        return self._reindex(positions) if reindexed else positions

    def _reindex(self, positions: torch.Tensor) -> torch.Tensor:
        window_start = self._window_start(self.committed_tokens)
        return torch.where(positions < self.sink_tokens, positions, positions - window_start + self.sink_tokens)

    # ----------------------------------------------------------------------------------------- re-cache
    def check_rewind(self, num_tokens: int) -> None:
        super().check_rewind(num_tokens)
        if self.pending_tokens:
            raise RuntimeError("rewind() with a chunk pending; commit it first.")
        rewindable = 0 if self.chunk_tokens is None else self._committed_count - self._window_start(self._committed_count)
        if num_tokens > rewindable:
            raise ValueError(
                f"`num_tokens`={num_tokens} exceeds the {max(rewindable, 0)} committed window tokens that can "
                "be rewound (the sink and evicted tokens cannot)."
            )

    def rewind(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` committed tokens so they can be written again (a re-cache).

        Used after a prompt switch: the recent window is re-run under the new prompt and committed
        chunk by chunk into the same slots. Only the visible window can be rewound; the sink never is.
        """
        self.check_rewind(num_tokens)
        self.committed_tokens.sub_(num_tokens)
        self._committed_count -= num_tokens

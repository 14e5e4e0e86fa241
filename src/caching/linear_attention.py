"""Constant-size state of ReLU linear attention (SANA-Video / LongSANA), accumulated chunk by chunk.

For keys `k` and values `v` (after ReLU; `k` rotated for the numerator), a chunk contributes
`vk = sum_t v_t k_t^T` `(batch, heads, head_dim, head_dim)` and `k_sum = sum_t k_t` `(batch, heads, 1, head_dim)`.
Both are kept in fp32 over all committed chunks, or over the last `window_chunks` chunks. Sums are
formed in stream order, one chunk after another, so they equal a from-scratch recomputation exactly.
A per-block tail (e.g. the temporal convolution's last frame) rides along with the same commit.

`RewindableLinearAttentionLayer` also keeps what one commit changed, so it can forget the last committed
chunk (LongSANA's re-cache on a prompt switch). `map_vk_states` transforms every held `v k^T` in place
(LongSANA rotates their key axis to rebase RoPE positions).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from .base import CacheLayer, check_key_value, check_positive

# Every state tensor, registered as a buffer (`state_dict`, `.to()`, export); the per-chunk ring only with a window.
_STATE_NAMES = ("committed_vk", "committed_k_sum", "pending_vk", "pending_k_sum", "chunk_vk", "chunk_k_sum")
_SCRATCH_NAMES = ("_total_vk", "_total_k_sum")  # what `update` returns: recomputed every step, never saved


def chunk_state(
    key: torch.Tensor, value: torch.Tensor, key_for_normalizer: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(vk, k_sum)` of one chunk in fp32 from `(batch, tokens, heads, head_dim)` key/value."""
    normalizer_key = key if key_for_normalizer is None else key_for_normalizer
    vk = torch.einsum("bthd,bthe->bhde", value.float(), key.float())  # (B, H, D_v, D_k)
    k_sum = normalizer_key.float().sum(dim=1).unsqueeze(2)  # (B, H, 1, D_k)
    return vk, k_sum


class LinearAttentionLayer(CacheLayer):
    """Args: window_chunks: keep the sums of the last N committed chunks only; `None` keeps all (constant memory)."""

    def __init__(self, window_chunks: int | None = None) -> None:
        super().__init__()
        self.window_chunks = None if window_chunks is None else check_positive("window_chunks", window_chunks)
        self.committed_chunks = 0
        self._summarised_tokens: deque[int] = deque(maxlen=self.window_chunks)  # tokens of each held chunk
        for name in _STATE_NAMES:
            self.register_buffer(name, None)
        for name in _SCRATCH_NAMES:
            self.register_buffer(name, None, persistent=False)
        # The block's tail state (the caller's detached tensors, any shape): committed, and staged for the next commit.
        self.register_buffer("tail", None)
        self.register_buffer("_pending_tail", None)

    @property
    def is_initialized(self) -> bool:
        return self.committed_vk is not None

    def early_initialization(
        self, batch_size: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        """`dtype` is ignored for the sums, which are always fp32. Refused while the layer holds a stream."""
        self.check_early_initialization(batch_size, num_heads, head_dim, dtype, device)
        self._allocate(batch_size, num_heads, head_dim, torch.device(device))

    def _allocate(self, batch: int, heads: int, head_dim: int, device: torch.device) -> None:
        f32 = dict(dtype=torch.float32, device=device)
        self.committed_vk = torch.zeros(batch, heads, head_dim, head_dim, **f32)
        self.committed_k_sum = torch.zeros(batch, heads, 1, head_dim, **f32)
        self.pending_vk = torch.zeros_like(self.committed_vk)
        self.pending_k_sum = torch.zeros_like(self.committed_k_sum)
        self._total_vk = torch.zeros_like(self.committed_vk)
        self._total_k_sum = torch.zeros_like(self.committed_k_sum)
        if self.window_chunks is not None:  # ring of per-chunk states, oldest overwritten first
            self.chunk_vk = torch.zeros(self.window_chunks, *self.committed_vk.shape, **f32)
            self.chunk_k_sum = torch.zeros(self.window_chunks, *self.committed_k_sum.shape, **f32)

    def _tensors(self) -> list[torch.Tensor]:
        names = (*_STATE_NAMES, *_SCRATCH_NAMES, "tail", "_pending_tail")
        return [t for t in (getattr(self, n, None) for n in names) if t is not None]

    def update(
        self, key: torch.Tensor, value: torch.Tensor, key_for_normalizer: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Set the pending chunk's sums; return `(vk, k_sum)` of the committed context plus this chunk.

        `key_for_normalizer` is the key the denominator sums (SANA: before RoPE); defaults to `key`.
        """
        check_key_value(key, value)
        if key_for_normalizer is not None and key_for_normalizer.shape != key.shape:
            raise ValueError(
                f"`key_for_normalizer` must have the shape of `key` {tuple(key.shape)}, "
                f"got {tuple(key_for_normalizer.shape)}."
            )
        if key.shape[-1] != value.shape[-1]:
            raise ValueError(f"`key` and `value` head_dim differ: {key.shape[-1]} vs {value.shape[-1]}.")
        if self.committed_vk is None:
            batch, _, heads, head_dim = key.shape
            self._allocate(batch, heads, head_dim, key.device)
        else:
            self._check_matches_state(key)
        vk, k_sum = chunk_state(key, value, key_for_normalizer)
        self.pending_vk.copy_(vk)
        self.pending_k_sum.copy_(k_sum)
        self.pending_tokens = key.shape[1]
        torch.add(self.committed_vk, self.pending_vk, out=self._total_vk)
        torch.add(self.committed_k_sum, self.pending_k_sum, out=self._total_k_sum)
        return self._total_vk, self._total_k_sum

    def _check_matches_state(self, key: torch.Tensor) -> None:
        batch, heads, head_dim, _ = self.committed_vk.shape
        received = (key.shape[0], key.shape[2], key.shape[3])
        if received != (batch, heads, head_dim):
            raise ValueError(
                f"`key` has (batch, heads, head_dim) = {received} but the state was initialised with "
                f"{(batch, heads, head_dim)}."
            )
        if key.device != self.committed_vk.device:
            raise ValueError(f"`key` is on {key.device} but the state lives on {self.committed_vk.device}.")

    def update_tail(self, tail: torch.Tensor) -> None:
        """Stage the block's tail state for this chunk (kept by the next `commit`)."""
        self._pending_tail = tail.detach()

    def commit(self) -> None:
        self._require_pending()
        if self.window_chunks is None:
            self.committed_vk.add_(self.pending_vk)
            self.committed_k_sum.add_(self.pending_k_sum)
        else:
            slot = self.committed_chunks % self.window_chunks
            self.chunk_vk[slot].copy_(self.pending_vk)
            self.chunk_k_sum[slot].copy_(self.pending_k_sum)
            self._sum_window()
        self.committed_chunks += 1
        self._summarised_tokens.append(self.pending_tokens)
        if self._pending_tail is not None:
            self.tail, self._pending_tail = self._pending_tail, None
        self.pending_tokens = 0

    def _sum_window(self) -> None:
        """Re-sum the last `window_chunks` chunk states, oldest first, so rounding matches a fresh sum."""
        held = min(self.committed_chunks + 1, self.window_chunks)
        oldest = (self.committed_chunks + 1 - held) % self.window_chunks
        self.committed_vk.zero_()
        self.committed_k_sum.zero_()
        for i in range(held):
            slot = (oldest + i) % self.window_chunks
            self.committed_vk.add_(self.chunk_vk[slot])
            self.committed_k_sum.add_(self.chunk_k_sum[slot])

    def get(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(vk, k_sum)` of the committed chunks, a copy (the rule of every kind); `update` returns the live sums."""
        if self.committed_vk is None or self.committed_chunks == 0:
            return None
        return self.committed_vk.clone(), self.committed_k_sum.clone()

    def reset(self) -> None:
        self.tail = self._pending_tail = None  # the caller's tensors (detached views): drop, never zero them
        for tensor in self._tensors():
            tensor.zero_()
        self.committed_chunks = 0
        self._summarised_tokens.clear()
        self.pending_tokens = 0

    def get_seq_length(self) -> int:
        """Committed tokens the state summarises (those of the held chunks; the state has no token axis)."""
        return sum(self._summarised_tokens)

    # ------------------------------------------------------------------------------------ saving, loading
    optional_buffers = ("tail", "_pending_tail")

    def state_config(self) -> dict:
        return {"window_chunks": self.window_chunks}

    def host_state(self) -> dict:
        return {
            "pending_tokens": self.pending_tokens,
            "committed_chunks": self.committed_chunks,
            "summarised_tokens": list(self._summarised_tokens),
        }

    def load_host_state(self, state) -> None:
        self.pending_tokens, self.committed_chunks = state["pending_tokens"], state["committed_chunks"]
        self._summarised_tokens = deque(state["summarised_tokens"], maxlen=self.window_chunks)

    def allocate_like(self, tensors, extra) -> None:
        batch, heads, head_dim, _ = tensors["committed_vk"].shape
        self._allocate(batch, heads, head_dim, tensors["committed_vk"].device)

    @property
    def held_chunks(self) -> int:
        """Committed chunks whose sums are held (all of them, or the last `window_chunks`)."""
        return len(self._summarised_tokens)

    def vk_state_names(self) -> tuple[str, ...]:
        """Buffers holding `v k^T` sums `(..., D_v, D_k)` of committed chunks (not the pending chunk's)."""
        return ("committed_vk", "chunk_vk")

    @torch.no_grad()
    def map_vk_states(self, transform: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace every held `v k^T` state by `transform(state)` (same shape), in place, between chunks.

        For a change of the keys that is linear along their last axis (LongSANA: a RoPE rotation that moves
        every committed key to another position), so the sums stay what the changed keys would have given.
        """
        for name in self.vk_state_names():
            state = getattr(self, name)
            if state is not None:
                state.copy_(transform(state))


class RewindableLinearAttentionLayer(LinearAttentionLayer):
    """`LinearAttentionLayer` that can forget its last committed chunk (LongSANA's re-cache on a prompt switch).

    Before each commit it keeps the committed sums (and, windowed, the chunk about to be evicted), so
    `rewind` restores them exactly: two more state-sized buffers, constant in the video's length.
    """

    can_rewind = True
    _UNDO_NAMES = ("_previous_vk", "_previous_k_sum", "_evicted_vk", "_evicted_k_sum")

    def __init__(self, window_chunks: int | None = None) -> None:
        super().__init__(window_chunks)
        for name in self._UNDO_NAMES:
            self.register_buffer(name, None)
        self._evicted_tokens: int | None = None
        self._can_undo = False

    def _allocate(self, batch: int, heads: int, head_dim: int, device: torch.device) -> None:
        super()._allocate(batch, heads, head_dim, device)
        self._previous_vk = torch.zeros_like(self.committed_vk)
        self._previous_k_sum = torch.zeros_like(self.committed_k_sum)
        self._evicted_vk = torch.zeros_like(self.committed_vk)
        self._evicted_k_sum = torch.zeros_like(self.committed_k_sum)

    def _tensors(self) -> list[torch.Tensor]:
        return super()._tensors() + [t for t in (getattr(self, n) for n in self._UNDO_NAMES) if t is not None]

    def vk_state_names(self) -> tuple[str, ...]:
        return (*super().vk_state_names(), "_previous_vk", "_evicted_vk")

    def commit(self) -> None:
        self._require_pending()
        self._previous_vk.copy_(self.committed_vk)
        self._previous_k_sum.copy_(self.committed_k_sum)
        self._evicted_tokens = None
        if self.window_chunks is not None and self.committed_chunks >= self.window_chunks:
            slot = self.committed_chunks % self.window_chunks  # the oldest chunk, overwritten by this commit
            self._evicted_vk.copy_(self.chunk_vk[slot])
            self._evicted_k_sum.copy_(self.chunk_k_sum[slot])
            self._evicted_tokens = self._summarised_tokens[0]
        super().commit()
        self._can_undo = True

    def commit_replacing_last(self) -> None:
        """Commit the pending chunk IN PLACE of the last committed one: the pending sums were computed with that
        chunk's old contribution still in the state (LongSANA's re-cache of chunk 0 before chunk 1, whose past is
        chunk 0's own old state); the state then holds the new contribution once, as after a rewind and a commit."""
        self.check_replacing_last()
        tokens = self.pending_tokens
        self.rewind(self._summarised_tokens[-1])
        self.pending_tokens = tokens  # the pending sums are untouched by the rewind
        self.commit()

    def check_replacing_last(self) -> None:
        """Raise if `commit_replacing_last()` would be refused; changes nothing (containers check every layer first)."""
        self._require_pending()
        if not (self._summarised_tokens and self._can_undo):
            raise RuntimeError(
                f"{type(self).__name__}.commit_replacing_last() with nothing to replace: no committed chunk can be "
                "undone (none yet, or a rewind since the last commit); call commit() instead."
            )

    def check_rewind(self, num_tokens: int) -> None:
        super().check_rewind(num_tokens)
        last = self._summarised_tokens[-1] if self._summarised_tokens and self._can_undo else 0
        if num_tokens != last:
            raise ValueError(
                f"{type(self).__name__} can rewind exactly the last committed chunk ({last} tokens), "
                f"got `num_tokens`={num_tokens}."
            )

    def rewind(self, num_tokens: int) -> None:
        self.check_rewind(num_tokens)
        self.committed_vk.copy_(self._previous_vk)
        self.committed_k_sum.copy_(self._previous_k_sum)
        self.committed_chunks -= 1
        self._summarised_tokens.pop()
        if self._evicted_tokens is not None:
            slot = self.committed_chunks % self.window_chunks
            self.chunk_vk[slot].copy_(self._evicted_vk)
            self.chunk_k_sum[slot].copy_(self._evicted_k_sum)
            self._summarised_tokens.appendleft(self._evicted_tokens)
        self._can_undo = False
        self.pending_tokens = 0

    def reset(self) -> None:
        super().reset()
        self._can_undo = False

    def host_state(self) -> dict:
        return {**super().host_state(), "evicted_tokens": self._evicted_tokens, "can_undo": self._can_undo}

    def load_host_state(self, state) -> None:
        super().load_host_state(state)
        self._evicted_tokens, self._can_undo = state["evicted_tokens"], state["can_undo"]

"""Constant-size state of ReLU linear attention (SANA-Video / LongSANA), accumulated chunk by chunk.

For keys `k` and values `v` (after ReLU; `k` rotated for the numerator), a chunk contributes
`vk = sum_t v_t k_t^T` `(batch, heads, head_dim, head_dim)` and `k_sum = sum_t k_t` `(batch, heads, 1, head_dim)`.
Both are kept in fp32 over all committed chunks, or over the last `window_chunks` chunks. Sums are
formed in stream order, one chunk after another, so they equal a from-scratch recomputation exactly.
A per-block tail (e.g. the temporal convolution's last frame) rides along with the same commit.
"""

from __future__ import annotations

from collections import deque

import torch

from .base import CacheLayer, check_key_value, check_positive

# Every state tensor, registered as a buffer (`state_dict`, `.to()`, export); the per-chunk ring only with a window.
_STATE_NAMES = ("committed_vk", "committed_k_sum", "pending_vk", "pending_k_sum", "_total_vk", "_total_k_sum")
_STATE_NAMES += ("chunk_vk", "chunk_k_sum")


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
        self.tail: torch.Tensor | None = None
        self._pending_tail: torch.Tensor | None = None

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
        names = (*_STATE_NAMES, "tail", "_pending_tail")
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

    @property
    def held_chunks(self) -> int:
        """Committed chunks whose sums are held (all of them, or the last `window_chunks`)."""
        return len(self._summarised_tokens)

"""Conv-state layer: the last input frames of a causal temporal convolution, carried across chunks.

LongSANA makes SANA-Video's temporal convolution (`conv_temp`, kernel 3 over frames) block-causal:
the next chunk prepends the last `state_frames` input frames of the previous chunk's clean pass
(transformers keeps such `conv_states` beside recurrent states). Buffers, all allocated once:

    committed (B, C, state_frames, T) | pending (the chunk being denoised) | previous (one chunk back, for rewind)

`update(frames)` stages the chunk's last frames and returns the committed ones (zeros before the
first commit, the convolution's zero padding); only `commit()` makes them permanent, so an aborted
chunk leaves the state as it was. `frame_count` is a device tensor (0-dim int64) of committed frames:
a model reads positions from it without a host sync or a recompile per chunk.
"""

from __future__ import annotations

import torch

from ..checks import check_int
from .base import CacheLayer, check_allocation_sizes, check_positive

# committed, pending and previous frames; `frame_count`: committed frames, on the state's device
_STATE_NAMES = ("committed", "pending", "previous", "frame_count")


class ConvStateLayer(CacheLayer):
    """Args:
    tokens_per_frame: spatial tokens of one frame (`T`), needed to allocate ahead of the first update.
    state_frames: frames kept (kernel // 2 for a symmetric kernel: 1 for kernel 3).
    """

    can_rewind = True  # one chunk back: the re-cache of LongSANA's prompt switch

    def __init__(self, tokens_per_frame: int | None = None, state_frames: int = 1) -> None:
        super().__init__()
        self.tokens_per_frame = (
            None if tokens_per_frame is None else check_positive("tokens_per_frame", tokens_per_frame)
        )
        self.state_frames = check_positive("state_frames", state_frames)
        for name in _STATE_NAMES:  # buffers: `.to()`, `state_dict`, export
            self.register_buffer(name, None)
        self.committed_frames = 0  # host mirror, for checks outside the model's forward
        self._pending_frames = 0
        self._last_chunk_frames = 0  # frames of the last committed chunk (what `rewind` can undo)

    @property
    def is_initialized(self) -> bool:
        return self.committed is not None

    def early_initialization(
        self, batch_size: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        """Channels are `num_heads * head_dim` (SANA's FFN width equals the attention width)."""
        check_allocation_sizes(batch_size, num_heads, head_dim)
        if hasattr(self, "check_early_initialization"):  # refuses a layer that holds a stream
            self.check_early_initialization(batch_size, num_heads, head_dim, dtype, device)
        if self.tokens_per_frame is None:
            raise ValueError(
                "`ConvStateLayer(tokens_per_frame=...)` is required to allocate ahead of the first update."
            )
        shape = (batch_size, num_heads * head_dim, self.state_frames, self.tokens_per_frame)
        self._allocate(shape, dtype, torch.device(device))

    def _allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.committed = torch.zeros(shape, dtype=dtype, device=device)
        self.pending = torch.zeros_like(self.committed)
        self.previous = torch.zeros_like(self.committed)
        self.frame_count = torch.zeros((), dtype=torch.long, device=device)

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.committed, self.pending, self.previous, self.frame_count) if t is not None]

    def update(self, frames: torch.Tensor, value: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        """Stage the last `state_frames` of `frames` `(batch, channels, chunk_frames, tokens)`; return the committed state.

        Returns `(state, None)`, state `(batch, channels, state_frames, tokens)`; `value` is unused (the
        layer contract's second argument).
        """
        if not isinstance(frames, torch.Tensor) or frames.ndim != 4:
            shape = tuple(frames.shape) if isinstance(frames, torch.Tensor) else type(frames).__name__
            raise ValueError(f"`frames` must have shape (batch, channels, frames, tokens), got {shape}.")
        if frames.shape[2] < self.state_frames:
            raise ValueError(
                f"`frames` holds {frames.shape[2]} frames; the layer keeps the last `state_frames`={self.state_frames}."
            )
        expected = (frames.shape[0], frames.shape[1], self.state_frames, frames.shape[3])
        if self.committed is None:
            if self.tokens_per_frame is not None and frames.shape[3] != self.tokens_per_frame:
                raise ValueError(
                    f"`frames` has {frames.shape[3]} tokens per frame, the layer was built for {self.tokens_per_frame}."
                )
            self._allocate(expected, frames.dtype, frames.device)
        elif tuple(self.committed.shape) != expected:
            raise ValueError(
                f"`frames` gives a state of shape {expected} but the layer holds {tuple(self.committed.shape)}; "
                "build a new cache for another batch size, width or frame size."
            )
        elif frames.dtype != self.committed.dtype or frames.device != self.committed.device:
            raise TypeError(
                f"`frames` is {frames.dtype} on {frames.device}; the state is {self.committed.dtype} "
                f"on {self.committed.device}."
            )
        self.pending.copy_(frames[:, :, -self.state_frames :])
        self._pending_frames = frames.shape[2]
        self.pending_tokens = frames.shape[2] * frames.shape[3]
        return self.committed, None

    def commit(self) -> None:
        self._require_pending()
        self.previous.copy_(self.committed)
        self.committed.copy_(self.pending)
        self.frame_count.add_(self._pending_frames)
        self.committed_frames += self._pending_frames
        self._last_chunk_frames = self._pending_frames
        self._pending_frames = self.pending_tokens = 0

    def get(self) -> tuple[torch.Tensor, None] | None:
        """A snapshot (a copy) of the committed frames, as every layer kind returns."""
        return None if self.committed is None or self.committed_frames == 0 else (self.committed.clone(), None)

    def check_rewind(self, num_tokens: int) -> None:
        """Only the whole last committed chunk can be forgotten (the state keeps one chunk of history)."""
        super().check_rewind(num_tokens)
        last = self._last_chunk_frames * (0 if self.committed is None else self.committed.shape[3])
        if num_tokens != last:
            raise ValueError(
                f"ConvStateLayer can rewind exactly the last committed chunk ({last} tokens), got `num_tokens`={num_tokens}."
            )

    def rewind(self, num_tokens: int) -> None:
        self.check_rewind(num_tokens)
        self.committed.copy_(self.previous)
        self.previous.zero_()  # two chunks back is not kept
        self.frame_count.sub_(self._last_chunk_frames)
        self.committed_frames -= self._last_chunk_frames
        self._last_chunk_frames = self._pending_frames = self.pending_tokens = 0

    def reset(self) -> None:
        for tensor in self._tensors():
            tensor.zero_()
        self.committed_frames = self._pending_frames = self._last_chunk_frames = self.pending_tokens = 0

    def get_seq_length(self) -> int:
        """Tokens of the committed frames the state follows (the state itself holds `state_frames` of them)."""
        return 0 if self.committed is None else self.committed_frames * self.committed.shape[3]

    def shift_frames(self, num_frames: int) -> None:
        """Move the committed frame count by `num_frames` (negative: back), as when a model rebases its
        positions; the frames held are unchanged. The count stays >= 0."""
        check_int("num_frames", num_frames, -self.committed_frames, hint="the committed frames")
        if self.frame_count is not None:
            self.frame_count.add_(num_frames)
        self.committed_frames += num_frames

    # ------------------------------------------------------------------------------------ saving, loading
    config_from_state = ("tokens_per_frame",)

    def state_config(self) -> dict:
        return {"tokens_per_frame": self.tokens_per_frame, "state_frames": self.state_frames}

    def host_state(self) -> dict:
        return {
            "pending_tokens": self.pending_tokens,
            "committed_frames": self.committed_frames,
            "pending_frames": self._pending_frames,
            "last_chunk_frames": self._last_chunk_frames,
        }

    def load_host_state(self, state) -> None:
        self.pending_tokens, self.committed_frames = state["pending_tokens"], state["committed_frames"]
        self._pending_frames, self._last_chunk_frames = state["pending_frames"], state["last_chunk_frames"]

    def allocate_like(self, tensors, extra) -> None:
        committed = tensors["committed"]
        self._allocate(tuple(committed.shape), committed.dtype, committed.device)

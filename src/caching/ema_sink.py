"""The EMA sink: each chunk that leaves the window is blended into the sink instead of being forgotten.

Reward Forcing (JaydenLyh/Reward-Forcing@4317f5a, arXiv 2512.04678) keeps a sink of `sink_size` frames and, each time
its rolling buffer evicts that many tokens, updates the sink in place (`wan/modules/causal_model.py:88-108,
151-192`, `CausalWanSelfAttention.incremental_update`):

    sink <- alpha * sink + (1 - alpha) * evicted        (keys and values, token by token; alpha = 0.999)

so the sink carries a slow average of the whole video rather than its first frames alone. Upstream stores keys
before RoPE and rotates them where they sit (the sink at positions 0..), so the blend is of unrotated keys: here too
(`position_mode="relative"`). Its evictions happen at the first forward of a new chunk, each one chunk of
`sink_size` frames (its released 3-frame chunks, 3-frame sink and 6-frame window); an eviction of another size
replaces the first sink tokens instead (`:193-196`), which no released setting reaches, so here the chunk must equal
the sink and the window hold whole chunks (each eviction is then one whole chunk).

The blend happens at `commit()`, for the tokens the next chunk will no longer see: the same tokens upstream evicts
before that chunk's first forward, and nothing reads the cache in between. A re-cache after a prompt switch rewinds
and commits the recent window again; tokens already blended (`blended_until`) are never blended twice, as upstream's
in-place rewrites of earlier positions evict nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .layout import window_start

EMA_SINK_ALPHA = 0.999  # upstream's `compression_alpha` default, which its configs keep


class EmaSink:
    """The blend a `SlidingWindowLayer(sink_mode="ema")` makes at each commit.

    Args:
        sink_tokens, window_tokens, chunk_tokens: the layer's geometry; the chunk must equal the sink and the window
            hold whole chunks (one chunk leaves the window per chunk committed, and is blended whole).
        slot_of: the layer's slot of an absolute token index (the ring arithmetic has one home: the layer).
    """

    def __init__(self, sink_tokens: int, window_tokens: int, chunk_tokens: int, slot_of: Callable[[int], int]) -> None:
        if sink_tokens < 1 or chunk_tokens != sink_tokens or window_tokens % chunk_tokens:
            raise ValueError(
                f"`sink_mode='ema'` blends each chunk that leaves the window into the sink, token by token: it needs a "
                f"sink of one chunk and a window of whole chunks (got sink_tokens={sink_tokens}, "
                f"chunk_tokens={chunk_tokens}, window_tokens={window_tokens}; Reward Forcing: 3, 3 and 6 frames)."
            )
        self.sink_tokens, self.window_tokens, self.chunk_tokens = sink_tokens, window_tokens, chunk_tokens
        self.slot_of = slot_of
        self.blended_until = sink_tokens  # every window token before this has been blended into the sink

    def reset(self) -> None:
        self.blended_until = self.sink_tokens

    def after_commit(self, keys: torch.Tensor, values: torch.Tensor, committed: int) -> None:
        """`committed` tokens are committed: blend each whole chunk the next chunk no longer sees (and that was not
        blended before) into the sink, oldest first, in place."""
        sink = self.sink_tokens
        leaving = window_start(committed, sink, self.window_tokens, self.chunk_tokens)
        while self.blended_until + sink <= leaving:
            slot = self.slot_of(self.blended_until)  # a ring of whole chunks: a chunk's slots never wrap
            for stored in (keys, values):
                stored[:, :sink].lerp_(stored[:, slot : slot + sink], 1 - EMA_SINK_ALPHA)
            self.blended_until += sink

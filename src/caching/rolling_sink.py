"""Rolling Sink: past the first window, committed frames are replaced by a ping-pong walk over a saved copy of it.

Rolling Sink (haodong2000/RollingSink@d7fc0d9, arXiv 2602.07775) runs Self-Forcing's weights for minutes with a
sink whose content and positions slide (`wan/modules/causal_model.py:232-283`, in `CausalWanSelfAttention`):

    frames   [ fixed sink | source: the first S committed frames | ... | previous chunk | pending chunk ]
    S = window - chunk (frames);  frame p >= sink + S holds source frame m(p) once a newer chunk is committed:
    m(p) = r if r < S else 2S - 1 - r,  r = (p - sink) % 2S        (forward through the source, then back)

Upstream keeps the pre-RoPE K/V of the first `max_attention_size` tokens (`k_original`, `:237-239`) and, at each
t = 0 context pass once `current_end - 3 frames >= max_attention_size` (`:247`), overwrites the previous chunk's
3 frames (`insert_left..insert_right`, `:270-271`) with source frames `left..right` (`:248-256`), in reverse
frame order on odd laps (`:260-267`), rotated at the previous chunk's own positions (`:277-279`). Its released
setting (sink_size 0, a 21-frame buffer, 3-frame chunks) makes S = 18 and `reverse_window_size = 21 - 3` the lap.
Here the same map is written per frame, so a copied key keeps its slot's position: keys are stored before RoPE
(`position_mode="relative"`) and rotated at read time like every other key.

The copy happens at `commit()` (the end of a chunk's transaction), in place: the source is one preallocated
`(batch, S * frame_tokens, heads, head_dim)` buffer per K and V, filled from the ring while the first S frames are
committed; a commit then copies at most one chunk of frames into ring slots (slices, no index tensors, nothing
allocated), so memory and work stay constant however long the video runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

SINK_MODES = ("fixed", "rolling", "ema")  # "ema": Reward Forcing's sink, `ema_sink.py`


def source_frame(frame: int, source_frames: int) -> int:
    """The source frame (counted after the fixed sink) that window frame `frame` (also after the sink) holds once
    rolled: the identity inside the source, then back and forth over it (period `2 * source_frames`)."""
    lap = frame % (2 * source_frames)
    return lap if lap < source_frames else 2 * source_frames - 1 - lap


class RollingSink(nn.Module):
    """The saved first window and the copy a `SlidingWindowLayer(sink_mode="rolling")` makes at each commit.

    Args:
        sink_tokens: the layer's fixed sink (never rolled; the source starts after it).
        window_tokens, chunk_tokens: the layer's window and largest chunk; the source is the committed part of a
            full window, `window_tokens - chunk_tokens`.
        frame_tokens: tokens per latent frame: frames are the unit of the walk (a lap reverses frame order, not
            the tokens inside a frame, as upstream's per-block flips at `:262-267` restore).
        slot_of: the layer's slot of an absolute token index (the ring arithmetic has one home: the layer).
    """

    def __init__(  # noqa: PLR0913 (the ring's geometry, named)
        self,
        sink_tokens: int,
        window_tokens: int,
        chunk_tokens: int,
        frame_tokens: int,
        slot_of: Callable[[int], int],
    ) -> None:
        super().__init__()
        source_tokens = window_tokens - chunk_tokens
        if source_tokens < frame_tokens or source_tokens % frame_tokens or sink_tokens % frame_tokens:
            raise ValueError(
                f"`sink_mode='rolling'` needs whole frames of {frame_tokens} tokens: a sink of {sink_tokens} and a "
                f"source (window - chunk) of {source_tokens} tokens, at least one frame; widen `window_tokens`."
            )
        self.sink_tokens, self.source_tokens, self.frame_tokens = sink_tokens, source_tokens, frame_tokens
        self.window_tokens, self.chunk_tokens, self.slot_of = window_tokens, chunk_tokens, slot_of
        self.source_frames = source_tokens // frame_tokens
        self.register_buffer("source_keys", None)
        self.register_buffer("source_values", None)

    def allocate(self, keys: torch.Tensor) -> None:
        """Source buffers shaped like `keys` `(batch, capacity, heads, head_dim)` but `source_tokens` long."""
        batch, _, heads, head_dim = keys.shape
        shape = (batch, self.source_tokens, heads, head_dim)
        self.source_keys = torch.zeros(shape, dtype=keys.dtype, device=keys.device)
        self.source_values = torch.zeros(shape, dtype=keys.dtype, device=keys.device)

    def reset(self) -> None:
        if self.source_keys is not None:
            self.source_keys.zero_()
            self.source_values.zero_()

    def after_commit(self, keys: torch.Tensor, values: torch.Tensor, start: int, count: int) -> None:
        """Tokens `[start, start + count)` were just committed into the ring `keys`/`values`: save those inside the
        source, then roll the frames of the chunk before them (`[start - chunk_tokens, start)`) that lie past the
        source and are still held, each into its own slot (the layer's `slot_of`)."""
        sink, frame = self.sink_tokens, self.frame_tokens
        source_end = sink + self.source_tokens  # below the window's first wrap: token p sits in slot p
        low, high = max(start, sink), min(start + count, source_end)
        if low < high:
            self.source_keys[:, low - sink : high - sink].copy_(keys[:, low:high])
            self.source_values[:, low - sink : high - sink].copy_(values[:, low:high])
        oldest_held = start + count - self.window_tokens  # older window tokens were overwritten by this chunk
        first = max(start - self.chunk_tokens, source_end, oldest_held)
        first += -(first - sink) % frame  # whole frames only
        for position in range(first, start, frame):
            slot = self.slot_of(position)
            source = source_frame((position - sink) // frame, self.source_frames) * frame
            keys[:, slot : slot + frame].copy_(self.source_keys[:, source : source + frame])
            values[:, slot : slot + frame].copy_(self.source_values[:, source : source + frame])

"""The window arithmetic, in one place: which committed tokens (or frames) the next chunk sees.

    [ sink: 0 .. sink-1 | evicted ... | recent: window - chunk committed | the pending chunk ]

The window counts the pending chunk (Self-Forcing's `local_attn_size`) and excludes the sink, so a
chunk attends to `sink + window` at most. `window_start` is the one formula every user calls: the
`SlidingWindowLayer` (in tokens, on device tensors), `ChunkLayout` (in frames) and the re-cache.
`ChunkLayout` is the frame geometry every video family shares, and the one home of the window rules: the
window is larger than the chunk (it counts the chunk and must leave room for recent context), or it is
`ALL_FRAMES` ("all"), the one spelling of an unbounded window (every earlier frame stays visible: LongSANA's
state over every chunk, Self-Forcing's `local_attn_size: -1`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..checks import check_choice, check_flag, check_int
from ..choices import ALL_FRAMES
from .rolling_sink import SINK_MODES

POSITION_MODES = ("absolute", "relative")
# Infinity-RoPE's scene controls (yesiltepe-hidir/infinity-rope@63d7b84): a scene cut places its chunk at RoPE frame 45
# (`wan/modules/causal_model.py:27` `rope_cut`'s `transition_from`); the KV flush at a prompt switch keeps the sink
# and the last 2 committed frames (`pipeline/causal_inference.py:213-222` `kv_flush`: `[:, -3120:]`, 2 x 1560 tokens).
SCENE_CUT_FRAME = 45
FLUSH_KEPT_FRAMES = 2


def window_start(committed, sink: int, window: int, chunk: int, out: torch.Tensor | None = None):
    """Index of the oldest committed entry after the sink that the next chunk still sees (>= `sink`).

    `committed` (entries committed so far) is an int or a 0-dim tensor; `out` receives the tensor
    result in place so the attention step allocates nothing. Units are the caller's (tokens or frames).
    """
    recent = window - chunk  # committed entries the next chunk sees after the sink
    if isinstance(committed, torch.Tensor):
        return torch.sub(committed, recent, out=out).clamp_(min=sink)
    return max(sink, committed - recent)


def context_start(committed, chunk: int, context_window: int, out: torch.Tensor | None = None):
    """Index of the oldest entry a context pass of `chunk` entries starting at `committed` sees: the last
    `context_window` entries of the stream ending with the chunk, the sink not privileged (>= 0).

    Rolling Forcing's clean pass (thu-ml/Causal-Forcing `long_video/wan/modules/causal_model.py:247-251`,
    `extract_cache_start = max(0, local_end_index - max_attention_size)`). The same formula as `window_start` with
    no sink and the chunk counted: one home for both.
    """
    return window_start(committed, 0, context_window, chunk, out=out)


def ring_length(
    window: int, chunk: int, smallest_chunk: int, elastic_window: bool = False, context_window: int | None = None
) -> int:
    """Entries the ring after the sink must hold so that writing a chunk (`chunk` at most) never overwrites a
    committed entry that any update may see: the chunk plus the most committed entries an update sees.

    That is the window itself (`window - chunk` committed + the chunk) unless an update may see more:
    `elastic_window` (an update of `smallest_chunk` sees `window - smallest_chunk`) or a context pass
    (`context_window - smallest_chunk`). Rolling Forcing's recipe: 12 in flight + 20 = 32 frames, where its
    authors keep 21 after the anchor and concatenate the in-flight blocks at each forward instead.
    """
    if not elastic_window and context_window is None:
        return window
    seen = window - (smallest_chunk if elastic_window else chunk)
    if context_window is not None:
        seen = max(seen, context_window - smallest_chunk)
    return chunk + seen


@dataclass(frozen=True)
class ChunkLayout:
    """Cache geometry in latent frames, and its token equivalents.

    A chunk attends to `sink_frames + window_frames` frames at most: the sink, the most recent
    `window_frames - chunk_frames` committed frames, and itself.
    """

    tokens_per_frame: int
    chunk_frames: int = 3
    sink_frames: int = 3
    window_frames: int | str = 9  # or ALL_FRAMES
    position_mode: str = "absolute"
    sink_mode: str = "fixed"  # or "rolling": Rolling Sink (`rolling_sink.py`)
    # Rolling Forcing's views (`SlidingWindowLayer`): the window counts the frames actually pending, and the span a
    # context pass attends to (counting its chunk, the sink not privileged; None: the window's view).
    elastic_window: bool = False
    context_window_frames: int | None = None

    def __post_init__(self) -> None:
        for name in ("tokens_per_frame", "chunk_frames"):
            check_int(name, getattr(self, name), 1)
        check_int("sink_frames", self.sink_frames, 0)
        if not self.unbounded:
            check_int("window_frames", self.window_frames, 1, hint=f"or {ALL_FRAMES!r}: every earlier frame")
            if self.chunk_frames >= self.window_frames:
                raise ValueError(
                    f"`window_frames`={self.window_frames} must be larger than `chunk_frames`={self.chunk_frames} (or "
                    f"{ALL_FRAMES!r}): the window counts the chunk being generated, and must leave room for recent "
                    "context."
                )
        check_choice("position_mode", self.position_mode, POSITION_MODES)
        check_choice(
            "sink_mode",
            self.sink_mode,
            SINK_MODES,
            hint="'rolling': Rolling Sink's sliding sink; 'ema': Reward Forcing's",
        )
        if self.sink_mode != "fixed" and (self.position_mode != "relative" or self.unbounded):
            raise ValueError(
                f"`sink_mode={self.sink_mode!r}` writes keys into other slots, rotated at those slots' positions, and "
                f"needs a window that evicts: it needs position_mode='relative' and an integer `window_frames` (got "
                f"position_mode={self.position_mode!r}, window_frames={self.window_frames!r})."
            )
        if self.sink_mode == "ema" and (
            self.sink_frames != self.chunk_frames or self.window_frames % self.chunk_frames
        ):
            raise ValueError(
                f"`sink_mode='ema'` blends each chunk that leaves the window into the sink, frame by frame: it needs "
                f"sink_frames equal to chunk_frames and window_frames a multiple of it (got sink_frames="
                f"{self.sink_frames}, chunk_frames={self.chunk_frames}, window_frames={self.window_frames}; Reward "
                "Forcing: 3, 3 and 6)."
            )
        self._check_views()

    def _check_views(self) -> None:
        """`elastic_window` / `context_window_frames`: values, and what they cannot be combined with."""
        check_flag("elastic_window", self.elastic_window)
        if self.context_window_frames is not None:
            check_int("context_window_frames", self.context_window_frames, 1, hint="or None: the window's view")
        if not self.elastic_window and self.context_window_frames is None:
            return
        if self.unbounded or self.sink_mode != "fixed":
            raise ValueError(
                "`elastic_window` / `context_window_frames` change what a bounded window with a fixed sink shows: they "
                f"need an integer `window_frames` and sink_mode='fixed' (got window_frames={self.window_frames!r}, "
                f"sink_mode={self.sink_mode!r})."
            )

    @property
    def unbounded(self) -> bool:
        """Every earlier frame stays visible (`window_frames == ALL_FRAMES`): sizes below are then infinite."""
        return self.window_frames == ALL_FRAMES

    @property
    def _window(self) -> float:
        return math.inf if self.unbounded else self.window_frames

    # ---------------------------------------------------------------------------------------- sizes
    @property
    def context_frames(self) -> int:
        """Frames attended to at most (sink + window)."""
        return self.sink_frames + self._window

    @property
    def chunk_tokens(self) -> int:
        return self.chunk_frames * self.tokens_per_frame

    @property
    def sink_tokens(self) -> int:
        return self.sink_frames * self.tokens_per_frame

    @property
    def window_tokens(self) -> int:
        return self._window * self.tokens_per_frame

    @property
    def context_window_tokens(self) -> int | None:
        return None if self.context_window_frames is None else self.context_window_frames * self.tokens_per_frame

    @property
    def full_window_frames(self) -> int:
        """Committed frames after which every slot holds a visible token (attention needs no mask)."""
        return self.sink_frames + self._window - self.chunk_frames

    # ---------------------------------------------------------------------------------------- the window
    def window_start(self, committed_frames: int) -> int:
        """First frame after the sink that a chunk starting at `committed_frames` still sees."""
        if self.unbounded:
            return self.sink_frames
        return window_start(committed_frames, self.sink_frames, self.window_frames, self.chunk_frames)

    def visible_frames(self, chunk_start: int) -> list[int]:
        """Frames a chunk starting at `chunk_start` attends to, oldest first (sink, window, itself)."""
        end = chunk_start + self.chunk_frames
        sink = range(min(self.sink_frames, chunk_start))
        return [*sink, *range(min(self.window_start(chunk_start), chunk_start), end)]

    def rewindable_frames(self, committed_frames: int) -> int:
        """Committed frames after the sink that a later update may still see: what a re-cache rewrites (never the
        sink). The next chunk's window, or more where a view reaches further back (`elastic_window`, a context
        pass's `context_window_frames`: Rolling Forcing's clean pass reads up to 20 committed frames while a window
        of 4 blocks in flight reads 6)."""
        if self.unbounded or (not self.elastic_window and self.context_window_frames is None):
            return max(0, committed_frames - self.window_start(committed_frames))
        seen = ring_length(self.window_frames, self.chunk_frames, 1, self.elastic_window, self.context_window_frames)
        return max(0, committed_frames - max(self.sink_frames, committed_frames - (seen - self.chunk_frames)))

    def frame_position(self, frame: int | torch.Tensor, chunk_start: int) -> int | torch.Tensor:
        """RoPE frame index of `frame` as seen from the chunk starting at `chunk_start`.

        "relative" re-indexes the window to start right after the sink, so positions stay below
        `sink_frames + window_frames` however long the video runs.
        """
        if self.position_mode == "absolute":
            return frame
        shifted = frame - self.window_start(chunk_start) + self.sink_frames
        if isinstance(frame, torch.Tensor):
            return torch.where(frame < self.sink_frames, frame, shifted)
        return frame if frame < self.sink_frames else shifted

    def fitted_to(self, num_frames: int) -> ChunkLayout:
        """The same attention for a video of `num_frames` latent frames, with no slot the video can never fill.

        A window longer than the video evicts nothing, so shortening it to the frames left after the sink
        changes no visible frame, no position (relative positions start right after the sink either way) and
        no re-cache (the sink is kept, clipped to the video). The window stays one frame longer than a chunk at
        least, as every layout's must. An unbounded window becomes the one that holds the whole video.
        """
        if not self.unbounded and self.context_frames <= num_frames:
            return self
        sink = min(self.sink_frames, num_frames)
        window = max(num_frames - sink, self.chunk_frames + 1)
        context = self.context_window_frames  # a span past the video's length sees the whole video, as a shorter one
        if context is not None:
            context = min(context, max(num_frames, self.chunk_frames + 1))
        return dataclasses.replace(self, sink_frames=sink, window_frames=window, context_window_frames=context)

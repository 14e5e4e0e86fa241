"""Several videos' next chunks decoded in one call: their causal feature caches stacked along the batch.

Each stream owns a `StreamingWanDecoder` (a feature cache per causal conv, kept across chunks) or a
`StreamingTinyDecoder` (TAEHV's carries, one per temporal layer), so streams that
run side by side (sessions batched by `rolldiff serve`) would each pay a whole decode per chunk. When their caches
are at the same state (per conv the same kind, empty / "Rep" / a tensor of the same shape, and all at their first
chunk or all past it: equal `stack_key`s), the decoder makes exactly the same calls for each of
them, so one decode of their chunks stacked along the batch does all of them at once:

    cache slot i:  stream A (1, C, 2, h, w) + stream B (1, C, 2, h, w)  ->  (2, C, 2, h, w)  -> decode ->  row j back

The convolutions, norms and upsamplers act on each batch row alone, so row j equals stream j's own decode up to
float reordering (a batched conv may sum in another order). Afterwards each stream's cache slots are its rows of
the stacked entries (copies) and its position advances as its own decode would have. The caches move through the
decoders' public `state_dict` / `load_state_dict` (checked whole on load), so this module is the one home of the
stacking and the decoder's internals stay its own. Streams at another state (a new stream beside older ones)
decode in another call.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Sequence

import torch

from .streaming_decode import StreamingWanDecoder
from .streaming_tiny_decode import StreamingTinyDecoder

__all__ = ["decode_stacked", "stack_key"]

StreamingDecoder = StreamingWanDecoder | StreamingTinyDecoder
STACKABLE = (StreamingWanDecoder, StreamingTinyDecoder)  # exactly these classes: a subclass may decode otherwise


def stack_key(decoder: object, latents: torch.Tensor) -> Hashable | None:
    """What must be equal for two streams' chunks to decode in one call; None: this one decodes alone (not a
    `StreamingWanDecoder` or `StreamingTinyDecoder` exactly, so its decode may differ, or not a one-row chunk it
    would take)."""
    if type(decoder) not in STACKABLE:
        return None
    key = decoder.stack_key(latents)
    return None if key is None else (type(decoder).__name__, key)


@torch.no_grad()
def decode_stacked(decoders: Sequence[StreamingDecoder], latents: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`decoders[j].decode(latents[j])` for every j, in one decode of the stacked chunks.

    Args:
        decoders: distinct streaming decoders of one VAE (`StreamingWanDecoder`, `StreamingTinyDecoder`) whose `stack_key`s with their chunks are equal.
        latents: one chunk per decoder, each `(1, z_dim, latent_frames, height, width)`.

    Returns:
        Each stream's `(1, 3, pixel_frames, H, W)` frames (views of one batched result), in `decoders`' order.

    Raises:
        ValueError: (before any decoding) no decoders, counts that differ, a decoder listed twice, or keys that
            are not all equal (or None: a decoder or chunk that cannot stack).
    """
    if not decoders or len(decoders) != len(latents):
        raise ValueError(
            f"`decoders` and `latents` must pair one chunk with each decoder (at least one): got {len(decoders)} "
            f"decoders and {len(latents)} chunks."
        )
    if len({id(decoder) for decoder in decoders}) != len(decoders):
        raise ValueError("`decoders`: each chunk needs a decoder of its own; one decoder is listed twice.")
    keys = [stack_key(decoder, chunk) for decoder, chunk in zip(decoders, latents)]
    if None in keys or len(set(keys)) != 1:
        unstackable = [j for j, key in enumerate(keys) if key is None]
        raise ValueError(
            "`decoders` must be StreamingWanDecoders or StreamingTinyDecoders of one VAE at one cache state (all at their first chunk or all past it, "
            "feature caches of equal shapes) with one-row `latents` of one shape: equal `stack_key`s, got "
            f"{len(set(keys))} distinct keys"
            + (f"; entries {unstackable} cannot stack at all." if unstackable else ".")
        )
    if len(decoders) == 1:
        return [decoders[0].decode(latents[0])]
    stacked = _stacked(decoders)
    frames = stacked.decode(torch.cat(list(latents)))  # (rows, 3, pixel_frames, H, W)
    _unstack(stacked, decoders)
    return list(frames.split(1))


def _stacked(decoders: Sequence[StreamingDecoder]) -> StreamingDecoder:
    """One decoder (the same VAE, settings and latent statistics) whose feature cache is `decoders`' caches stacked
    along the batch (row j: decoder j; the entries under its `row_state_prefix`), at the first one's position (all
    are at their first frame or all past it)."""
    states = [decoder.state_dict() for decoder in decoders]
    first, prefix = states[0], decoders[0].row_state_prefix
    state = {
        key: torch.cat([s[key] for s in states]) if key.startswith(prefix) else value for key, value in first.items()
    }  # (rows, C, frames, h, w) per tensor slot
    video_shape = first.get("video_shape")  # unknown before a tiny decoder's first chunk (an empty tensor for Wan's)
    if video_shape is not None and video_shape.numel():
        state["video_shape"] = torch.tensor([len(decoders), *video_shape.tolist()[1:]], dtype=torch.int64)
    stacked = copy.copy(decoders[0])
    stacked.load_state_dict(state)
    return stacked


def _unstack(stacked: StreamingDecoder, decoders: Sequence[StreamingDecoder]) -> None:
    """After `stacked` decoded: each decoder takes its row of the cache (a copy: no row keeps the others' alive or
    shares their storage), advances by the frames decoded (decoders past their first frame may be at different
    positions) and keeps the video size, as its own decode would have left them."""
    state = stacked.state_dict()
    decoded = stacked.latent_frames_decoded - decoders[0].latent_frames_decoded
    position_key = stacked.position_key
    for row, decoder in enumerate(decoders):
        rows = {
            key: value[row : row + 1].clone() if key.startswith(stacked.row_state_prefix) else value
            for key, value in state.items()
        }
        rows["video_shape"] = torch.tensor([1, *state["video_shape"].tolist()[1:]], dtype=torch.int64)
        rows[position_key] = torch.tensor(decoder.latent_frames_decoded + decoded, dtype=torch.int64)
        decoder.load_state_dict(rows)

"""Several videos' next chunks decoded in one call: their causal feature caches stacked along the batch.

Each stream owns a `StreamingWanDecoder` (a feature cache per causal conv, kept across chunks), so streams that
run side by side (sessions batched by `rolldiff serve`) would each pay a whole decode per chunk. When their caches
are at the same state (per conv the same kind, empty / "Rep" / a tensor of the same shape, and all at their first
chunk or all past it), the decoder does exactly the same calls for each of them, so one decode of their chunks
stacked along the batch does all of them at once:

    cache slot i:  stream A (1, C, 2, h, w) + stream B (1, C, 2, h, w)  ->  (2, C, 2, h, w)  -> decode ->  row j back

The convolutions, norms and upsamplers act on each batch row alone, so row j equals stream j's own decode up to
float reordering (a batched conv may sum in another order). Afterwards each stream's cache slots are its rows of
the stacked entries (views: the convs replace cache entries, never write into them), and its position advances as
its own decode would have. Streams at another state (a new stream beside older ones) decode in another call.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Sequence

import torch

from .streaming_decode import StreamingWanDecoder

__all__ = ["decode_stacked", "stack_key"]


def stack_key(decoder: object, latents: torch.Tensor) -> Hashable | None:
    """What must be equal for two streams' chunks to decode in one call; None: this one decodes alone (not a
    `StreamingWanDecoder`, or a chunk of more than one batch row)."""
    if type(decoder) is not StreamingWanDecoder or latents.ndim != 5 or latents.shape[0] != 1:
        return None
    if decoder._video_shape not in (None, (1, *latents.shape[3:])):
        return None  # another video's size: its own decode refuses it
    slots = tuple(
        entry if entry is None or isinstance(entry, str) else (tuple(entry.shape), entry.dtype, entry.device)
        for entry in decoder._feat_cache
    )
    first = decoder.latent_frames_decoded == 0  # the decoder's first frame runs another path (`first_chunk`)
    return (id(decoder.vae), decoder.denormalize, first, tuple(latents.shape), latents.dtype, latents.device, slots)


@torch.no_grad()
def decode_stacked(decoders: Sequence[StreamingWanDecoder], latents: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`decoders[j].decode(latents[j])` for every j, in one decode of the stacked chunks.

    Args:
        decoders: distinct `StreamingWanDecoder`s of one VAE whose `stack_key`s with their chunks are equal.
        latents: one chunk per decoder, each `(1, z_dim, latent_frames, height, width)`.

    Returns:
        Each stream's `(1, 3, pixel_frames, H, W)` frames (views of one batched result), in `decoders`' order.
    """
    keys = [stack_key(decoder, chunk) for decoder, chunk in zip(decoders, latents)]
    if not decoders or len(decoders) != len(latents) or None in keys or len(set(keys)) != 1:
        raise ValueError(
            "`decoders` and `latents` must pair distinct StreamingWanDecoders at one cache state with one-row chunks "
            f"of one shape (equal `stack_key`s): got {len(decoders)} decoders, {len(latents)} chunks, "
            f"{len(set(keys))} distinct keys{' (one stacks nothing)' if None in keys else ''}."
        )
    if len({id(decoder) for decoder in decoders}) != len(decoders):
        raise ValueError("`decoders`: each chunk needs a decoder of its own; one decoder is listed twice.")
    if len(decoders) == 1:
        return [decoders[0].decode(latents[0])]
    first = decoders[0]
    stacked = copy.copy(first)  # the same VAE, settings and latent statistics; a cache of its own below
    stacked._feat_cache = [
        torch.cat([decoder._feat_cache[slot] for decoder in decoders]) if isinstance(entry, torch.Tensor) else entry
        for slot, entry in enumerate(first._feat_cache)
    ]  # (rows, C, frames, h, w) per tensor slot
    stacked._video_shape = None
    frames = stacked.decode(torch.cat(list(latents)))  # (rows, 3, pixel_frames, H, W)
    decoded = stacked._position - first._position
    for row, decoder in enumerate(decoders):
        decoder._feat_cache = [
            entry[row : row + 1] if isinstance(entry, torch.Tensor) else entry for entry in stacked._feat_cache
        ]
        decoder._position += decoded
        decoder._video_shape = (1, *stacked._video_shape[1:])
    return list(frames.split(1))

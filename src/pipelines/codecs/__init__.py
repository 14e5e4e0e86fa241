"""Streaming encoders and decoders: each keeps its own causal feature cache, so a chunk decodes (or encodes)
exactly as the whole clip would, and concurrent streams never share decoder state."""

from .overlap import OverlappedDecoder
from .streaming_decode import StreamingWanDecoder, denormalize_wan_latents
from .streaming_encode import StreamingWanEncoder, normalize_wan_latents
from .streaming_tiny_decode import StreamingTinyDecoder, StreamingTinyEncoder

__all__ = [
    "OverlappedDecoder",
    "StreamingTinyDecoder",
    "StreamingTinyEncoder",
    "StreamingWanDecoder",
    "StreamingWanEncoder",
    "denormalize_wan_latents",
    "normalize_wan_latents",
]

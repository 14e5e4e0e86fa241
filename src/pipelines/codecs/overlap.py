"""Decode chunk k on a side CUDA stream while the transformer denoises chunk k + 1.

A chunk's VAE decode depends only on that chunk's clean latents and the decoder's own memory, never on the
next chunk's denoising, so on a GPU the two can run at once: the chunk loop hands chunk k's latents to
`OverlappedDecoder.submit`, which queues the decode on a side stream and returns at once with chunk k - 1's
frames; the transformer's kernels for chunk k + 1 then fill the main stream while the side stream decodes.
Steady-state time per chunk becomes max(denoise, decode) instead of their sum; the price is that a chunk's
frames come back one chunk later (`decode_ahead` hands the first chunk back at once, so the time to the first
frame does not change).

Ordering, all on the device, with no host wait on the hot path:

    main:  [denoise k] -(event: latents ready)-> ............ [denoise k+1] ... [wait: frames k ready] [use]
    side:               [wait: latents ready] [decode k] -(event: frames k ready)->

The latents are `record_stream`-ed on the side stream and the frames on the consumer's stream, so the caching
allocator never hands their memory to another tensor while the other stream may still read it. The host waits
only where the consumer reads the frames (`.cpu()`, `.numpy()`). On the CPU (or with any non-CUDA device) the
wrapper decodes synchronously at `submit`: the same calls, the same frames, no overlap.

The frames equal the wrapped decoder's exactly: the same decoder runs the same kernels on the same inputs in
the same order, only on another stream. State (`state_dict`) is taken at a chunk boundary after draining the
side stream; a chunk whose frames were decoded but not yet handed back travels in the state as
`pending_frames`, so a resumed stream hands it back first and no chunk is lost or decoded twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import torch

PENDING_KEY = "pending_frames"


class StreamingDecoder(Protocol):
    """What a pipeline's `make_decoder()` returns (`StreamingWanDecoder`, `StreamingTinyDecoder`)."""

    def decode(self, latents: torch.Tensor) -> torch.Tensor: ...

    def reset(self) -> None: ...

    def num_pixel_frames(self, latent_frames: int) -> int: ...

    @property
    def latent_frames_decoded(self) -> int: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...


class OverlappedDecoder:
    """A streaming decoder whose chunk decodes run on a side CUDA stream, one chunk behind the chunk loop.

    Use either `submit` (overlapped) or `decode` (serial), not both within one video:

        frames_before = decoder.submit(latents_k)   # chunk k-1's frames, or None for the first chunk
        ...
        last = decoder.result()                     # the last chunk's frames at the end of the video

    Args:
        decoder: the streaming decoder to wrap (any object with the `StreamingDecoder` interface); it is
            driven from the side stream and must not be used directly while wrapped.
        device: where the decoder computes. A CUDA device gets the side stream; anything else decodes
            synchronously inside `submit`.
    """

    def __init__(self, decoder: StreamingDecoder, device: torch.device | str) -> None:
        self.decoder = decoder
        self.device = torch.device(device)
        self.overlaps = self.device.type == "cuda"
        self._side = torch.cuda.Stream(device=self.device) if self.overlaps else None
        self._pending: torch.Tensor | None = None  # frames decoded (or being decoded) and not yet handed back
        self._done: torch.cuda.Event | None = None  # recorded on the side stream after the pending decode
        self._closed = False

    # ---------------------------------------------------------------------------------------- hot path
    def submit(self, latents: torch.Tensor) -> torch.Tensor | None:
        """Start decoding the next chunk; return the previous chunk's frames (None when there was none).

        Args:
            latents: the chunk's latents, as the wrapped decoder's `decode` takes them, produced on the
                current stream (no host sync needed: the side stream waits for them on the device).

        Returns:
            The previous chunk's `(batch, 3, pixel_frames, H, W)` frames, ready for the current stream (it waits
            for them on the device; the host waits only when it reads them).
        """
        self._check_open("submit")
        previous = self._take()
        if not self.overlaps:
            self._pending = self.decoder.decode(latents)
            return previous
        producer = torch.cuda.current_stream(self.device)
        ready = torch.cuda.Event()
        ready.record(producer)
        self._side.wait_event(ready)
        if latents.is_cuda:
            latents.record_stream(self._side)  # its memory stays reserved until the side stream has read it
        with torch.cuda.stream(self._side):
            self._pending = self.decoder.decode(latents)
            self._done = torch.cuda.Event()
            self._done.record(self._side)
        return previous

    def result(self) -> torch.Tensor | None:
        """The frames of the last submitted chunk, ready for the current stream (None if none is pending)."""
        self._check_open("result")
        return self._take()

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Serial semantics: decode this chunk and return its frames (with nothing pending)."""
        if self._pending is not None:
            raise RuntimeError(
                "OverlappedDecoder.decode: a submitted chunk's frames are still pending; take them with result() "
                "first (decode and submit must not be mixed within one video)."
            )
        self.submit(latents)
        return self._take()

    def _take(self) -> torch.Tensor | None:
        frames, self._pending = self._pending, None
        if frames is not None and self._done is not None:
            consumer = torch.cuda.current_stream(self.device)
            consumer.wait_event(self._done)  # device-side wait: the host goes on
            frames.record_stream(consumer)
        self._done = None
        return frames

    # ---------------------------------------------------------------------------------------- boundaries
    def drain(self) -> None:
        """Block the host until the side stream's work (the pending decode) is done; the frames stay pending."""
        if self._done is not None:
            self._done.synchronize()

    def close(self) -> torch.Tensor | None:
        """End the video: drain the side stream and return the frames not handed back yet (None if none).

        After `close`, `submit`, `decode` and `result` raise; `reset()` makes the decoder usable again.
        """
        if self._closed:
            return None
        self.drain()
        frames = self._take()
        self._closed = True
        return frames

    def reset(self) -> None:
        """Start a new video: drain, drop any pending frames, reset the wrapped decoder."""
        self.drain()
        self._pending, self._done = None, None
        self.decoder.reset()
        self._closed = False

    @property
    def has_pending(self) -> bool:
        """True while a submitted chunk's frames have not been handed back."""
        return self._pending is not None

    @property
    def latent_frames_decoded(self) -> int:
        """Latent frames submitted so far in this video (the pending chunk included)."""
        return self.decoder.latent_frames_decoded

    def num_pixel_frames(self, latent_frames: int) -> int:
        """Pixel frames the next submitted chunk of `latent_frames` latent frames will decode to."""
        return self.decoder.num_pixel_frames(latent_frames)

    # ---------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The wrapped decoder's state after draining, plus `pending_frames` if a chunk was not handed back.

        Keys other than `pending_frames` are the wrapped decoder's own, so a state saved with nothing pending
        loads into the plain decoder and back.
        """
        self.drain()
        state = dict(self.decoder.state_dict())
        if PENDING_KEY in state:
            raise ValueError(f"The wrapped decoder's state already uses the key {PENDING_KEY!r}.")
        if self._pending is not None:
            state[PENDING_KEY] = self._pending
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()`: the wrapped decoder's memory, and the pending chunk's frames if any."""
        self.drain()
        inner = {key: value for key, value in state.items() if key != PENDING_KEY}
        self.decoder.load_state_dict(inner)
        pending = state.get(PENDING_KEY)
        self._pending = None if pending is None else pending.to(self.device)
        self._done = None  # loaded on the current stream: already ordered before anything that reads it
        self._closed = False
        if self.overlaps:  # the loaded memory was allocated on this stream and will be read (and freed) on the side
            for tensor in self.decoder.state_dict().values():
                if tensor.is_cuda:
                    tensor.record_stream(self._side)

    def _check_open(self, method: str) -> None:
        if self._closed:
            raise RuntimeError(f"OverlappedDecoder.{method}: the decoder was closed; call reset() for a new video.")


def decode_ahead(latent_chunks: Iterable[torch.Tensor], decoder: OverlappedDecoder) -> Iterator[torch.Tensor]:
    """Each chunk's frames, in order, with chunk k's decode overlapping the production of chunk k + 1.

    A video's first chunk is decoded and handed back at once (the time to the first frame stays that of a
    serial loop); from then on each chunk's frames come back once the next chunk's latents exist, and the last
    when `latent_chunks` ends. A decoder resumed mid-video (`load_state_dict`, maybe with a pending chunk) goes
    on where it was. Pulling the next latent chunk is what queues the next denoise: keep the producer free of
    host syncs (`.item()`, `bool(tensor)`) to let the two streams overlap.
    """
    first = decoder.latent_frames_decoded == 0 and not decoder.has_pending
    for latents in latent_chunks:
        if first:
            yield decoder.decode(latents)
            first = False
            continue
        previous = decoder.submit(latents)
        if previous is not None:
            yield previous
    last = decoder.result()
    if last is not None:
        yield last

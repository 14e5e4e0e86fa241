"""OverlappedDecoder: the same frames as the serial decoder, one chunk behind, in order, with exact state.

On the CPU the wrapper decodes synchronously (the CUDA side-stream path is checked by
`benchmarks/gpu_checks.py` on a GPU); everything else (ordering, draining, state with a pending chunk,
refusals) is the same code on every device and is specified here.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from tiny_components import tiny_vae

from rolldiff.pipelines.codecs.overlap import PENDING_KEY, OverlappedDecoder, decode_ahead
from rolldiff.pipelines.codecs.streaming_decode import StreamingWanDecoder

CHUNK_SIZES = (1, 3, 3, 3)  # latent frames per chunk (a 1-frame first chunk, as Wan's 4k+1 videos start)


class TraceDecoder:
    """A decoder whose frames are its call count: chunk k decodes to a (1, 3, frames, 1, 1) tensor of k."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.calls = 0
        self.decoded = 0

    @property
    def latent_frames_decoded(self) -> int:
        return self.decoded

    def num_pixel_frames(self, latent_frames: int) -> int:
        return latent_frames

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        frames = torch.full((1, 3, latents.shape[2], 1, 1), float(self.calls))
        self.calls += 1
        self.decoded += latents.shape[2]
        return frames

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"calls": torch.tensor(self.calls), "decoded": torch.tensor(self.decoded)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.calls, self.decoded = int(state["calls"]), int(state["decoded"])


def latent_chunks(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 4, frames, 4, 4, generator=generator) for frames in CHUNK_SIZES]


@pytest.fixture(scope="module")
def vae():
    torch.manual_seed(0)
    return tiny_vae(temporal=True)


@pytest.fixture(scope="module")
def serial_frames(vae) -> list[torch.Tensor]:
    decoder = StreamingWanDecoder(vae, denormalize=True)
    return [decoder.decode(chunk) for chunk in latent_chunks()]


def trace_values(frames: torch.Tensor | None) -> float | None:
    return None if frames is None else float(frames.flatten()[0])


# ----------------------------------------------------------------------------------------- order
def test_submit_hands_back_the_previous_chunk_and_result_the_last():
    decoder = OverlappedDecoder(TraceDecoder(), "cpu")
    handed = [trace_values(decoder.submit(torch.zeros(1, 1, 2, 1, 1))) for _ in range(3)]
    assert handed == [None, 0.0, 1.0]
    assert decoder.has_pending
    assert trace_values(decoder.result()) == 2.0
    assert decoder.result() is None and not decoder.has_pending


def test_decode_ahead_yields_every_chunk_once_in_order_the_first_at_once():
    produced = []

    def producer():
        for index in range(4):
            produced.append(index)
            yield torch.zeros(1, 1, 1, 1, 1)

    frames_when = []
    for frames in decode_ahead(producer(), OverlappedDecoder(TraceDecoder(), "cpu")):
        frames_when.append((trace_values(frames), len(produced)))
    # chunk 0 comes back before chunk 1 is produced; chunk k (k >= 1) once chunk k + 1 exists; the last at the end
    assert frames_when == [(0.0, 1), (1.0, 3), (2.0, 4), (3.0, 4)]


# ----------------------------------------------------------------------------------------- equality
def test_overlapped_frames_equal_the_serial_decoder_exactly(vae, serial_frames):
    decoder = OverlappedDecoder(StreamingWanDecoder(vae, denormalize=True), "cpu")
    overlapped = list(decode_ahead(latent_chunks(), decoder))
    assert len(overlapped) == len(serial_frames)
    for ours, serial in zip(overlapped, serial_frames):
        assert torch.equal(ours, serial)


def test_decode_keeps_serial_semantics(vae, serial_frames):
    decoder = OverlappedDecoder(StreamingWanDecoder(vae, denormalize=True), "cpu")
    for chunk, serial in zip(latent_chunks(), serial_frames):
        assert torch.equal(decoder.decode(chunk), serial)
    assert decoder.latent_frames_decoded == sum(CHUNK_SIZES)


def test_decode_while_a_chunk_is_pending_is_refused():
    decoder = OverlappedDecoder(TraceDecoder(), "cpu")
    decoder.submit(torch.zeros(1, 1, 1, 1, 1))
    with pytest.raises(RuntimeError, match=r"pending.*result\(\)"):
        decoder.decode(torch.zeros(1, 1, 1, 1, 1))


def test_frame_counts_delegate_to_the_wrapped_decoder(vae):
    decoder = OverlappedDecoder(StreamingWanDecoder(vae, denormalize=True), "cpu")
    upsample = decoder.decoder.temporal_upsample  # 2 for this tiny VAE (Wan 2.1's is 4)
    assert decoder.num_pixel_frames(3) == 1 + 2 * upsample  # the first latent frame -> 1 pixel frame
    decoder.submit(latent_chunks()[0])
    assert decoder.latent_frames_decoded == 1  # the pending chunk counts
    assert decoder.num_pixel_frames(3) == 3 * upsample


# ----------------------------------------------------------------------------------------- state
def test_state_with_a_pending_chunk_resumes_without_losing_or_repeating_a_chunk(vae, serial_frames):
    chunks = latent_chunks()
    first = OverlappedDecoder(StreamingWanDecoder(vae, denormalize=True), "cpu")
    handed = [first.decode(chunks[0])]
    assert first.submit(chunks[1]) is None  # nothing was pending after the serial first chunk
    handed.append(first.submit(chunks[2]))
    state = first.state_dict()
    assert PENDING_KEY in state  # chunk 2 was decoded but not handed back

    resumed = OverlappedDecoder(StreamingWanDecoder(vae, denormalize=True), "cpu")
    resumed.load_state_dict(state)
    handed += [resumed.submit(chunks[3]), resumed.result()]
    assert [frames.shape[2] for frames in handed] == [frames.shape[2] for frames in serial_frames]
    for ours, serial in zip(handed, serial_frames, strict=True):
        assert torch.equal(ours, serial)


def test_decode_ahead_resumed_mid_video_goes_on_where_the_saved_stream_was(vae, serial_frames):
    chunks = latent_chunks()
    first = OverlappedDecoder(StreamingWanDecoder(vae, denormalize=True), "cpu")
    handed = list(itertools.islice(decode_ahead(iter(chunks[:3]), first), 2))  # chunk 2 decoded, not handed back
    resumed = OverlappedDecoder(StreamingWanDecoder(vae, denormalize=True), "cpu")
    resumed.load_state_dict(first.state_dict())
    handed += list(decode_ahead(iter(chunks[3:]), resumed))
    for ours, serial in zip(handed, serial_frames, strict=True):
        assert torch.equal(ours, serial)


def test_state_with_nothing_pending_is_the_wrapped_decoders_own(vae):
    chunks = latent_chunks()
    plain = StreamingWanDecoder(vae, denormalize=True)
    plain.decode(chunks[0])
    wrapped = OverlappedDecoder(StreamingWanDecoder(vae, denormalize=True), "cpu")
    wrapped.decode(chunks[0])
    ours, theirs = wrapped.state_dict(), plain.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs)
    into_plain = StreamingWanDecoder(vae, denormalize=True)
    into_plain.load_state_dict(ours)  # a resume file saved with overlap loads without it
    assert torch.equal(into_plain.decode(chunks[1]), plain.decode(chunks[1]))


def test_state_delegates_to_any_decoder_of_the_interface():
    decoder = OverlappedDecoder(TraceDecoder(), "cpu")
    decoder.decode(torch.zeros(1, 1, 2, 1, 1))
    again = OverlappedDecoder(TraceDecoder(), "cpu")
    again.load_state_dict(decoder.state_dict())
    assert (again.decoder.calls, again.latent_frames_decoded) == (1, 2)


# ----------------------------------------------------------------------------------------- close / reset
def test_close_drains_and_returns_the_frames_not_handed_back():
    decoder = OverlappedDecoder(TraceDecoder(), "cpu")
    decoder.submit(torch.zeros(1, 1, 1, 1, 1))
    decoder.submit(torch.zeros(1, 1, 1, 1, 1))
    assert trace_values(decoder.close()) == 1.0
    assert decoder.close() is None  # idempotent
    with pytest.raises(RuntimeError, match=r"closed.*reset\(\)"):
        decoder.submit(torch.zeros(1, 1, 1, 1, 1))


def test_reset_drops_the_pending_chunk_and_starts_a_new_video():
    decoder = OverlappedDecoder(TraceDecoder(), "cpu")
    decoder.submit(torch.zeros(1, 1, 3, 1, 1))
    decoder.close()
    decoder.reset()
    assert not decoder.has_pending and decoder.latent_frames_decoded == 0
    assert trace_values(decoder.decode(torch.zeros(1, 1, 1, 1, 1))) == 0.0


def test_a_cpu_device_decodes_synchronously():
    decoder = OverlappedDecoder(TraceDecoder(), torch.device("cpu"))
    assert not decoder.overlaps
    decoder.submit(torch.zeros(1, 1, 1, 1, 1))
    assert decoder.decoder.calls == 1  # decoded inside submit, before it returned

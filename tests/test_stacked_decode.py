"""`decode_stacked`: several streams' chunks decoded in one call (feature caches stacked along the batch) equal
each stream's own decode, and leave each cache where its own decode would have."""

import pytest
import torch
from tiny_components import seeded_wan_vae

from rolldiff.models.tiny_autoencoder import TinyVideoAutoencoder
from rolldiff.pipelines.codecs.stacked_decode import decode_stacked, stack_key
from rolldiff.pipelines.codecs.streaming_decode import StreamingWanDecoder
from rolldiff.pipelines.codecs.streaming_tiny_decode import StreamingTinyDecoder
from rolldiff.serving.batching import DecodeCall, Lockstep

Z_DIM = 4
LATENT_SIZE = 4
CHUNK = 2  # latent frames per chunk
CHUNKS = 4  # the last one decoded solo after three stacked
STREAMS = 3
TOLERANCE = 1e-5  # fp32: a batched conv may sum in another order; measured max difference printed below


def make_vae():
    # the real Wan 2.1 layout (4x in time), as tests/test_streaming_decode.py's "temporal_4x"
    return seeded_wan_vae(Z_DIM, dim_mult=[1, 2, 2, 2], temperal_downsample=[False, True, True])


def chunks_of(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    latents = torch.randn(1, Z_DIM, CHUNK * CHUNKS, LATENT_SIZE, LATENT_SIZE, generator=generator)
    return list(latents.split(CHUNK, dim=2))


def solo_run(vae, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
    decoder = StreamingWanDecoder(vae, denormalize=True)
    return [decoder.decode(chunk) for chunk in chunks]


def test_stacked_chunks_equal_solo_decodes_and_caches_continue_as_solo_ones():
    vae = make_vae()
    videos = [chunks_of(seed) for seed in range(STREAMS)]
    expected = [solo_run(vae, chunks) for chunks in videos]
    decoders = [StreamingWanDecoder(vae, denormalize=True) for _ in range(STREAMS)]

    worst = 0.0
    for index in range(CHUNKS - 1):  # three chunks stacked, the first one included
        keys = {stack_key(decoder, video[index]) for decoder, video in zip(decoders, videos)}
        assert len(keys) == 1 and None not in keys
        got = decode_stacked(decoders, [video[index] for video in videos])
        for stream in range(STREAMS):
            assert got[stream].shape == expected[stream][index].shape
            worst = max(worst, (got[stream] - expected[stream][index]).abs().max().item())
            torch.testing.assert_close(got[stream], expected[stream][index], atol=TOLERANCE, rtol=0)
    print(f"stacked vs solo decode, max |difference| over {CHUNKS - 1} chunks x {STREAMS} streams: {worst:.3g}")

    last = CHUNKS - 1  # each cache goes on alone: its own next chunk equals the all-solo run's
    for stream, decoder in enumerate(decoders):
        assert decoder.latent_frames_decoded == CHUNK * last
        solo = decoder.decode(videos[stream][last])
        torch.testing.assert_close(solo, expected[stream][last], atol=TOLERANCE, rtol=0)
        state = decoder.state_dict()
        assert all(v.shape[0] == 1 for k, v in state.items() if k.startswith("feat_cache."))


def test_streams_at_different_positions_past_their_first_chunk_stack():
    vae = make_vae()
    early, late = chunks_of(1), chunks_of(2)
    want_early, want_late = solo_run(vae, early), solo_run(vae, late)
    ahead, behind = StreamingWanDecoder(vae, denormalize=True), StreamingWanDecoder(vae, denormalize=True)
    ahead.decode(late[0])
    ahead.decode(late[1])
    behind.decode(early[0])

    got = decode_stacked([ahead, behind], [late[2], early[1]])

    torch.testing.assert_close(got[0], want_late[2], atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(got[1], want_early[1], atol=TOLERANCE, rtol=0)
    assert (ahead.latent_frames_decoded, behind.latent_frames_decoded) == (3 * CHUNK, 2 * CHUNK)
    torch.testing.assert_close(behind.decode(early[2]), want_early[2], atol=TOLERANCE, rtol=0)


def test_a_decoder_at_its_first_chunk_beside_older_ones_has_another_key_and_decodes_alone():
    vae = make_vae()
    old, new = chunks_of(1), chunks_of(2)
    older = StreamingWanDecoder(vae, denormalize=True)
    older.decode(old[0])
    fresh = StreamingWanDecoder(vae, denormalize=True)
    assert stack_key(older, old[1]) != stack_key(fresh, new[0])
    assert stack_key(object(), new[0]) is None  # not a StreamingWanDecoder: decodes alone
    assert stack_key(fresh, torch.cat([new[0], new[0]])) is None  # two rows: decodes alone

    lockstep = Lockstep(pipe=None, members=2)
    calls = [DecodeCall(older, old[1]), DecodeCall(fresh, new[0])]
    lockstep._run(calls)  # one round holding both: two decodes, none shared

    assert lockstep.decodes == 2 and lockstep.shared_decodes == 0
    assert all(call.error is None for call in calls)
    torch.testing.assert_close(calls[0].result, solo_run(vae, old)[1], atol=0, rtol=0)
    torch.testing.assert_close(calls[1].result, solo_run(vae, new)[0], atol=0, rtol=0)


def test_a_lockstep_round_decodes_lined_up_members_in_one_call():
    vae = make_vae()
    videos = [chunks_of(seed) for seed in range(STREAMS)]
    decoders = [StreamingWanDecoder(vae, denormalize=True) for _ in range(STREAMS)]
    lockstep = Lockstep(pipe=None, members=STREAMS)
    for index in range(3):
        calls = [DecodeCall(decoder, video[index]) for decoder, video in zip(decoders, videos)]
        lockstep._run(calls)
        for call, video in zip(calls, videos):
            torch.testing.assert_close(call.result, solo_run(vae, video[: index + 1])[index], atol=TOLERANCE, rtol=0)
    assert lockstep.decodes == 3 and lockstep.shared_decodes == 3 * STREAMS


def test_mismatched_keys_are_refused_before_any_decode():
    vae = make_vae()
    older, fresh = StreamingWanDecoder(vae), StreamingWanDecoder(vae)
    older.decode(chunks_of(1)[0])
    before = older.state_dict()
    with pytest.raises(ValueError, match="equal `stack_key`s, got 2 distinct keys"):
        decode_stacked([older, fresh], [chunks_of(1)[1], chunks_of(2)[0]])
    assert older.latent_frames_decoded == CHUNK and fresh.latent_frames_decoded == 0
    assert all(torch.equal(before[k], v) for k, v in older.state_dict().items())
    with pytest.raises(ValueError, match=r"entries \[1\] cannot stack"):
        decode_stacked([older, StreamingWanDecoder(vae)], [chunks_of(1)[1], torch.randn(2, Z_DIM, CHUNK, 4, 4)])


def test_one_decoder_twice_and_unpaired_chunks_are_refused():
    vae = make_vae()
    decoder = StreamingWanDecoder(vae)
    chunk = chunks_of(1)[0]
    with pytest.raises(ValueError, match="one decoder is listed twice"):
        decode_stacked([decoder, decoder], [chunk, chunk])
    with pytest.raises(ValueError, match="got 2 decoders and 1 chunks"):
        decode_stacked([decoder, StreamingWanDecoder(vae)], [chunk])
    with pytest.raises(ValueError, match="got 0 decoders"):
        decode_stacked([], [])
    assert decoder.latent_frames_decoded == 0


# ----------------------------------------------------------------------------------------- the tiny decoder (TAEHV)
def make_tiny():
    torch.manual_seed(0)  # small channels, the real 4x time upscale
    return TinyVideoAutoencoder(latent_channels=Z_DIM, encoder_channels=8, decoder_channels=(16, 8, 8, 8)).eval()


def test_tiny_decoders_stack_and_continue_as_solo_ones():
    """The same contract for `StreamingTinyDecoder` (the GPU rows' decoder): 3 streams, 3 chunks stacked (the first,
    with its warm-up frames dropped, included), then a 4th decoded solo, each equal to its all-solo run."""
    tiny = make_tiny()
    videos = [chunks_of(seed) for seed in range(STREAMS)]
    expected = []
    for chunks in videos:
        solo = StreamingTinyDecoder(tiny)
        expected.append([solo.decode(chunk) for chunk in chunks])
    decoders = [StreamingTinyDecoder(tiny) for _ in range(STREAMS)]
    worst = 0.0
    for index in range(CHUNKS - 1):
        got = decode_stacked(decoders, [video[index] for video in videos])
        for stream in range(STREAMS):
            worst = max(worst, (got[stream] - expected[stream][index]).abs().max().item())
            torch.testing.assert_close(got[stream], expected[stream][index], atol=TOLERANCE, rtol=0)
    print(f"stacked vs solo tiny decode, max |difference| over {CHUNKS - 1} chunks x {STREAMS} streams: {worst:.3g}")
    for stream, decoder in enumerate(decoders):
        assert decoder.latent_frames_decoded == CHUNK * (CHUNKS - 1)
        last = decoder.decode(videos[stream][-1])
        torch.testing.assert_close(last, expected[stream][-1], atol=TOLERANCE, rtol=0)


def test_a_tiny_decoder_never_stacks_with_a_wan_one_or_a_fresh_one():
    tiny, chunks = make_tiny(), chunks_of(1)
    older, fresh = StreamingTinyDecoder(tiny), StreamingTinyDecoder(tiny)
    older.decode(chunks[0])
    assert stack_key(older, chunks[1]) != stack_key(fresh, chunks[0])  # the first chunk drops warm-up frames
    assert stack_key(fresh, chunks[0]) != stack_key(StreamingWanDecoder(make_vae()), chunks[0])
    assert stack_key(fresh, torch.randn(1, Z_DIM + 1, CHUNK, 4, 4)) is None  # channels it would refuse
    with pytest.raises(ValueError, match="distinct keys"):
        decode_stacked([older, fresh], [chunks[1], chunks[0]])

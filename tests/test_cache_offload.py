"""Specification of offloaded sliding-window layers (`offload=True`).

Committed K/V live in CPU memory (pinned when CUDA is present); the block's K/V visit the compute
device in a work buffer shared by the cache's layers (two, alternating, so the next block can be
prefetched on a side stream on CUDA). On CPU the same code path runs (home -> work buffer copies).
Outputs are identical with and without offload, and home only changes at `commit()`.
"""

import pytest
import torch
from cache_helpers import NewStorageCounter, attend, with_options
from tiny_components import tiny_transformer

from rolldiff.caching import RollingKVCache, SlidingWindowLayer
from rolldiff.models import ChunkLayout

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="pinned memory and side-stream prefetch need a CUDA device")


def stream_outputs(cache: RollingKVCache, chunks: int = 7, seed: int = 0, rewind_at: int = 4) -> list[torch.Tensor]:
    """Attention outputs of every layer at every step of a stream (3 steps per chunk, a re-cache at `rewind_at`)."""
    generator = torch.Generator().manual_seed(seed)
    device = cache[0].slot_positions.device if cache[0].slot_positions is not None else "cpu"
    outputs = []
    for chunk in range(chunks):
        if chunk == rewind_at:
            cache.rewind(2)  # forget the last chunk, then write it again
        for _step in range(3):
            for layer in cache:
                query, key, value = torch.randn(3, 2, 2, 2, 8, generator=generator).to(device).unbind(0)
                outputs.append(attend(layer, query, key, value))
        cache.commit()
    return outputs


def build(**options) -> RollingKVCache:
    return RollingKVCache([SlidingWindowLayer(2, 6, 2, **options) for _ in range(3)])


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_outputs_are_identical_with_and_without_offload(quantization):
    plain = build(quantization=quantization)
    expected = stream_outputs(plain)
    offloaded = build(quantization=quantization, offload=True)
    got = stream_outputs(offloaded)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    for layer, reference in zip(offloaded, plain):  # the sink and window - chunk recent tokens
        assert layer.get_seq_length() == 2 + 4 and all(map(torch.equal, layer.get(), reference.get()))


def test_committed_state_lives_at_home_and_work_buffers_are_shared():
    cache = build(offload=True)
    cache.early_initialization(2, 2, 8, torch.float32, "cpu")
    assert all(layer.keys.device.type == "cpu" for layer in cache)
    plain = build()
    plain.early_initialization(2, 2, 8, torch.float32, "cpu")
    one_layer = cache[0].keys.nbytes + cache[0].values.nbytes
    # two work buffers (alternating blocks) instead of three layers on the device
    assert cache.workspace.memory_bytes() == 2 * one_layer
    assert cache.resident_bytes() < plain.resident_bytes() == plain.memory_bytes()
    assert [layer.work_parity for layer in cache] == [0, 1, 0]


def test_home_changes_only_at_commit():
    layer = SlidingWindowLayer(2, 4, 2, offload=True)
    for _ in range(3):
        layer.update(*torch.randn(2, 1, 2, 1, 4).unbind(0))
        layer.commit()
    home = (layer.keys.clone(), layer.values.clone())
    before = layer.get()
    layer.update(*torch.randn(2, 1, 2, 1, 4).unbind(0))  # an aborted chunk
    assert torch.equal(layer.keys, home[0]) and torch.equal(layer.values, home[1])
    assert all(torch.equal(a, b) for a, b in zip(layer.get(), before))
    layer.commit()
    assert not torch.equal(layer.keys, home[0])


@pytest.mark.parametrize("offload", [False, True])
def test_a_key_on_another_device_is_refused_not_copied(offload):
    layer = SlidingWindowLayer(1, 4, 2, offload=offload)
    layer.early_initialization(1, 1, 4, torch.float32, "cpu")
    key = torch.randn(1, 2, 1, 4, device="meta")
    with pytest.raises(ValueError, match="`key` is on meta but the cache computes on cpu"):
        layer.update(key, key)
    assert layer.pending_tokens == 0


def test_offloaded_layers_are_not_compileable():
    assert SlidingWindowLayer(1, 4, 2).is_compileable and not SlidingWindowLayer(1, 4, 2, offload=True).is_compileable
    with pytest.raises(TypeError, match="offload"):
        SlidingWindowLayer(1, 4, 2, offload="yes")


@torch.no_grad()
def test_model_output_is_identical_with_and_without_offload():
    model = tiny_transformer()
    layout = ChunkLayout(4, chunk_frames=2, sink_frames=2, window_frames=4, position_mode="relative")
    text = torch.randn(1, 7, 16, generator=torch.Generator().manual_seed(1))
    plain = model.make_cache(layout)
    offloaded = with_options(plain, offload=True)
    generator = torch.Generator().manual_seed(2)
    for _chunk in range(4):
        for sigma in (0.8, 0.3, 0.0):
            latents = torch.randn(1, 4, 2, 4, 4, generator=generator)
            timestep = torch.tensor([sigma * 1000.0])
            outputs = [model(latents, timestep, text, kv_cache=c, layout=layout).sample for c in (plain, offloaded)]
            assert torch.equal(*outputs)
        plain.commit()
        offloaded.commit()


@needs_cuda
def test_cuda_home_is_pinned_and_the_next_block_is_prefetched():
    cache = build(offload=True)
    cache.early_initialization(2, 2, 8, torch.float32, "cuda")
    assert all(layer.keys.is_pinned() and layer.slot_positions.is_cuda for layer in cache)
    expected = stream_outputs(build())
    got = stream_outputs(cache)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, expected))
    query, key, value = torch.randn(3, 2, 2, 2, 8, device="cuda").unbind(0)
    attend(cache[0], query, key, value)
    assert cache[1].storage.prefetched_rows == 2  # block 1's K/V are on their way while block 0 computes


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_steady_state_allocates_nothing(quantization):
    layer = SlidingWindowLayer(4, 12, 4, quantization=quantization, offload=True)
    layer.early_initialization(1, 2, 8, torch.float32, "cpu")
    for chunk in range(6):
        key, value = torch.randn(2, 1, 4, 2, 8).unbind(0)
        with NewStorageCounter() as counter:
            for _step in range(3):
                layer.update(key, value)
            layer.commit()
        assert counter.allocations == [], chunk

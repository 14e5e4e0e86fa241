"""Specification of `AdaptiveSinkLayer` (StreamDiffusionV2's cache, `rolldiff/caching/adaptive_sink.py`) on scalar-sized
traces: which step's write each slot holds, when a sink frame is refreshed, and the in-place contract.

Geometry as the recipe's, one token a frame: a sink of 3 slots + 3, a first chunk of 2 frames, then chunks of 1 in 4
writes each. The layer against upstream's own queues and latents is `tests/test_recipes_streamdiffusionv2.py`.
"""

from __future__ import annotations

import pytest
import torch

from rolldiff.caching import AdaptiveSinkLayer, AdaptiveSinkPolicy, RollingKVCache


def layer(threshold: float = -1.0, writes: int = 4) -> AdaptiveSinkLayer:
    return AdaptiveSinkLayer(3, 3, 2, frame_tokens=1, policy=AdaptiveSinkPolicy(threshold, writes))


def chunk(cache: AdaptiveSinkLayer, frames: int, keys=None, writes: int = 4) -> list[list[int]]:
    """Write one chunk (`writes` steps, each `keys` or random) and commit; the slots each step wrote."""
    slots = []
    for _ in range(writes):
        key = torch.randn(1, frames, 1, 2) if keys is None else keys
        cache.update(key, key)
        slots.append(cache._pending_slots[:frames].tolist())
    cache.commit()
    return slots


def test_the_first_chunk_of_a_full_cache_pops_at_its_first_step():
    """Upstream's counter starts at the second step of the chunk that fills the 6 slots (chunk 4), so from chunk 5 on
    a chunk's first step writes where the previous chunk's last steps wrote, then the queue moves on: a frame's last
    step survives until the next chunk's first step; older frames keep their first, noisiest step."""
    cache = layer()
    assert chunk(cache, 2) == [[0, 1]] * 4
    assert [chunk(cache, 1) for _ in range(3)] == [[[2]] * 4, [[3]] * 4, [[4]] * 4]
    assert chunk(cache, 1) == [[5], [3], [3], [3]]  # chunk 4 fills the cache at its first step
    assert [chunk(cache, 1) for _ in range(4)] == [
        [[3], [4], [4], [4]],
        [[4], [5], [5], [5]],
        [[5], [3], [3], [3]],
        [[3], [4], [4], [4]],
    ]
    assert cache.queue == [5, 6, 4] and cache.refreshes == 0  # token ends: the ring slots 4, 5, 3 next


def test_a_frame_unlike_a_sink_frame_replaces_it():
    """The new frame's mean key and value against each sink slot's: the least similar, below the threshold, goes to
    the front of the queue and is written once the cache is full (a refresh). An empty sink slot counts as unlike
    (cosine 0), so the first one-frame chunk queues one for slot 2, which a later chunk consumes, as upstream does."""
    cache = layer(threshold=0.2)
    like = torch.tensor([1.0, 0.0]).view(1, 1, 1, 2)
    chunk(cache, 2, keys=like.expand(1, 2, 1, 2))
    chunk(cache, 1, keys=like)  # slot 2 was empty at its first step: its token end (3) goes to the front
    assert cache.queue == [3, 4]
    for _ in range(3):
        chunk(cache, 1, keys=like)  # like every sink slot: nothing queued
    assert cache.queue == [3, 4, 5, 6] and cache.refreshes == 0
    assert chunk(cache, 1, keys=like)[0] == [2] and cache.refreshes == 1  # the queued slot 2, consumed and dropped
    unlike = -like  # cosine -1 with every sink slot: slot 0 (the first argmin) goes to the front
    assert chunk(cache, 1, keys=unlike)[0] == [0] and cache.refreshes == 2
    assert torch.equal(cache.keys[0, 0], unlike[0, 0])


def test_writes_go_in_place_and_an_aborted_chunk_is_refused():
    cache = layer()
    chunk(cache, 2)
    keys, values = cache.keys.data_ptr(), cache.values.data_ptr()
    for _ in range(20):
        chunk(cache, 1)
    assert (cache.keys.data_ptr(), cache.values.data_ptr()) == (keys, values)
    for _ in range(3):  # an aborted chunk: 3 of its 4 steps written, never committed
        cache.update(torch.randn(1, 1, 1, 2), torch.randn(1, 1, 1, 2))
    cache.update(torch.randn(1, 1, 1, 2), torch.randn(1, 1, 1, 2))
    with pytest.raises(RuntimeError, match="aborted chunk cannot be re-run"):
        cache.update(torch.randn(1, 1, 1, 2), torch.randn(1, 1, 1, 2))


def test_a_saved_layer_continues_exactly():
    torch.manual_seed(0)
    original = RollingKVCache([layer(threshold=0.5)])
    chunk(original[0], 2)
    for _ in range(7):
        chunk(original[0], 1)
    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in original.state_dict().items()}
    loaded = RollingKVCache([layer(threshold=0.5)])
    loaded.load_state_dict(state)
    for _ in range(6):
        keys = torch.randn(1, 1, 1, 2)
        assert chunk(original[0], 1, keys) == chunk(loaded[0], 1, keys)
    assert original[0].queue == loaded[0].queue and original[0].refreshes == loaded[0].refreshes
    assert torch.equal(original[0].keys, loaded[0].keys)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(threshold=1.5), r"`adaptive_sink_threshold` must be a number in \[-1, 1\]"),
        (dict(forwards_per_chunk=0), r"`forwards_per_chunk` must be"),
    ],
)
def test_bad_policies_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdaptiveSinkPolicy(**kwargs)


def test_bad_layers_are_refused():
    with pytest.raises(ValueError, match="whole frames"):
        AdaptiveSinkLayer(3, 3, 2, frame_tokens=2, policy=AdaptiveSinkPolicy())
    cache = layer()
    with pytest.raises(ValueError, match="batch 1"):
        cache.update(torch.randn(2, 1, 1, 2), torch.randn(2, 1, 1, 2))
    with pytest.raises(TypeError, match="cannot rewind"):
        cache.rewind(1)

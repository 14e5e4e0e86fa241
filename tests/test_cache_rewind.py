"""`rewind`: forgetting the recent window so a prompt switch can re-cache it; the sink never moves."""

import pytest
import torch

from rolldiff.caching import CrossAttentionLayer, RollingKVCache, SlidingWindowLayer


def _scalar(values):
    return torch.tensor(values, dtype=torch.float32).view(1, len(values), 1, 1)


def _layer_after(chunks: int) -> SlidingWindowLayer:
    """sink 2, window 6, chunk 2; chunk i holds values (10 i + 1, 10 i + 2)."""
    layer = SlidingWindowLayer(sink_tokens=2, window_tokens=6, chunk_tokens=2)
    for i in range(chunks):
        layer.update(_scalar([10 * i + 1, 10 * i + 2]), _scalar([10 * i + 1, 10 * i + 2]))
        layer.commit()
    return layer


def test_rewind_then_rewrite_replaces_only_the_window():
    layer = _layer_after(5)  # committed 10 tokens; visible: sink (1, 2) + last 4 (31, 32, 41, 42)
    assert layer.get()[0].flatten().tolist() == [1, 2, 31, 32, 41, 42]
    layer.rewind(4)
    # sink + positions 4, 5: the window would reach back to 2, 3 but the ring already overwrote them
    assert layer.get()[0].flatten().tolist() == [1, 2, 21, 22]
    for values in ([131, 132], [141, 142]):
        layer.update(_scalar(values), _scalar(values))
        layer.commit()
    assert layer.get()[0].flatten().tolist() == [1, 2, 131, 132, 141, 142]


def test_rewind_keeps_positions_so_the_next_chunk_continues_the_stream():
    layer = _layer_after(5)
    before = layer.pending_positions(2).tolist()
    layer.rewind(4)
    for values in ([131, 132], [141, 142]):
        layer.update(_scalar(values), _scalar(values))
        layer.commit()
    assert layer.pending_positions(2).tolist() == before == [10, 11]


def test_the_sink_and_evicted_tokens_cannot_be_rewound():
    layer = _layer_after(5)
    with pytest.raises(ValueError, match="num_tokens"):
        layer.rewind(5)
    sink_only = _layer_after(1)
    with pytest.raises(ValueError, match="num_tokens"):
        sink_only.rewind(1)
    assert sink_only.get()[0].flatten().tolist() == [1, 2]


def test_rewind_with_a_chunk_pending_is_refused():
    layer = _layer_after(3)
    layer.update(_scalar([91, 92]), _scalar([91, 92]))
    with pytest.raises(RuntimeError, match="pending"):
        layer.rewind(2)


def test_container_rewinds_every_self_attention_layer():
    layers = [_layer_after(4), _layer_after(4)]
    cache = RollingKVCache(layers, [CrossAttentionLayer(), None])
    cache.rewind(2)
    assert [layer.pending_positions(2).tolist() for layer in cache] == [[6, 7], [6, 7]]


def test_commit_replacing_last_keeps_the_new_contribution_once():
    """LongSANA's re-cache before chunk 1: the pending chunk was computed over the last chunk's old state; after
    `commit_replacing_last` the state holds the new contribution alone, as a rewind + commit would."""
    from rolldiff.caching import RewindableLinearAttentionLayer

    torch.manual_seed(0)
    layer = RewindableLinearAttentionLayer()
    old_key, old_value = torch.rand(1, 4, 2, 3), torch.rand(1, 4, 2, 3)
    new_key, new_value = torch.rand(1, 4, 2, 3), torch.rand(1, 4, 2, 3)
    layer.update(old_key, old_value)
    layer.commit()
    total_vk, _ = layer.update(new_key, new_value)  # the pass reads the old chunk as its past
    reference = RewindableLinearAttentionLayer()
    expected_total, _ = reference.update(old_key, old_value)
    reference.commit()
    torch.testing.assert_close(total_vk, reference.update(new_key, new_value)[0])
    layer.commit_replacing_last()
    fresh = RewindableLinearAttentionLayer()
    fresh.update(new_key, new_value)
    fresh.commit()
    torch.testing.assert_close(layer.get()[0], fresh.get()[0], atol=0, rtol=0)
    assert layer.committed_chunks == 1


def test_a_refused_commit_replacing_last_leaves_the_pending_chunk_committable():
    """With nothing to replace (no chunk committed yet, or a rewind since), `commit_replacing_last` is refused
    before any change: the pending chunk is still there for `commit()`."""
    from rolldiff.caching import RewindableLinearAttentionLayer

    torch.manual_seed(0)
    key, value = torch.rand(1, 4, 2, 3), torch.rand(1, 4, 2, 3)
    layer = RewindableLinearAttentionLayer()
    layer.update(key, value)
    with pytest.raises(RuntimeError, match="nothing to replace"):
        layer.commit_replacing_last()
    assert layer.pending_tokens == 4
    layer.commit()
    assert layer.committed_chunks == 1 and layer.get_seq_length() == 4


def test_a_container_checks_every_layer_before_committing_any_in_place_of_the_last():
    from rolldiff.caching import RewindableLinearAttentionLayer

    torch.manual_seed(0)
    key, value = torch.rand(1, 4, 2, 3), torch.rand(1, 4, 2, 3)
    first, second = RewindableLinearAttentionLayer(), RewindableLinearAttentionLayer()
    first.update(key, value)
    first.commit()  # `first` could replace its last chunk, `second` has none
    cache = RollingKVCache([first, second])
    before = first.get()[0].clone()
    for layer in cache:
        layer.update(key, value)
    with pytest.raises(RuntimeError, match="nothing to replace"):
        cache.commit_replacing_last()
    assert first.committed_chunks == 1 and torch.equal(first.get()[0], before)
    assert [layer.pending_tokens for layer in cache] == [4, 4]
    cache.commit()
    assert [layer.committed_chunks for layer in cache] == [2, 1]

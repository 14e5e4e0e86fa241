"""Specification of `SlidingWindowLayer`: sink + sliding window, written in place, read through a mask.

Scalar traces follow transformers' synthetic cache tests: batch 1, 1 head, head_dim 1, and the token at
absolute index p carries the value p + 1, so a buffer reads as the list of tokens it holds. At every
step we check the stored buffer (slot order) and what attention sees (the masked slots, in slot order
and in stream order). Slot of token p: p if p < sink else sink + (p - sink) % window.
"""

import random

import pytest
import torch
import torch.nn.functional as F
from cache_helpers import NewStorageCounter

from rolldiff.caching import SlidingWindowLayer


def scalar_chunk(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).view(1, len(values), 1, 1)  # (B, T, H, D)


def same_storage(view: torch.Tensor, buffer: torch.Tensor) -> bool:
    return view.data_ptr() == buffer.data_ptr() and view.shape == buffer.shape


def buffer_pointers(layer: SlidingWindowLayer) -> dict[str, int]:
    """data_ptr of every tensor the layer holds (registered buffers and plain attributes)."""
    tensors = {**dict(layer.named_buffers()), **{n: t for n, t in vars(layer).items() if isinstance(t, torch.Tensor)}}
    tensors.update(keys=layer.keys, values=layer.values)  # held by the layer's storage
    return {name: t.data_ptr() for name, t in tensors.items()}


def update_scalars(layer: SlidingWindowLayer, *values: float) -> dict[str, list[float]]:
    """Write a chunk of scalar tokens (value = -key) and report buffer and attended tokens."""
    key = scalar_chunk(*values)
    keys, vals = layer.update(key, -key)
    assert same_storage(keys, layer.keys) and same_storage(vals, layer.values)  # the buffers, not a copy
    mask = layer.attention_mask
    attended = keys[0, mask, 0, 0]
    order = torch.argsort(layer.key_positions()[mask])
    assert torch.equal(vals[0, mask, 0, 0], -attended)
    return {
        "buffer": layer.keys[0, :, 0, 0].tolist(),
        "slot_order": attended.tolist(),
        "stream_order": attended[order].tolist(),
    }


def committed_scalars(layer: SlidingWindowLayer) -> list[float] | None:
    cached = layer.get()
    return None if cached is None else cached[0][0, :, 0, 0].tolist()


# (chunk, stored buffer, attended in slot order, attended in stream order); every chunk is committed.
TRACES = {
    # sink 2, window 4, chunk 2: sink fills with the first chunk, then the ring wraps (7, 8 over 3, 4).
    "sink_fill_then_wrap": (
        dict(sink_tokens=2, window_tokens=4, chunk_tokens=2),
        [
            ([1, 2], [1, 2, 0, 0, 0, 0], [1, 2], [1, 2]),
            ([3, 4], [1, 2, 3, 4, 0, 0], [1, 2, 3, 4], [1, 2, 3, 4]),
            ([5, 6], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]),
            ([7, 8], [1, 2, 7, 8, 5, 6], [1, 2, 7, 8, 5, 6], [1, 2, 5, 6, 7, 8]),
            ([9, 10], [1, 2, 7, 8, 9, 10], [1, 2, 7, 8, 9, 10], [1, 2, 7, 8, 9, 10]),
            ([11, 12], [1, 2, 11, 12, 9, 10], [1, 2, 11, 12, 9, 10], [1, 2, 9, 10, 11, 12]),
        ],
    ),
    # sink 3, chunk 2: warm-up (first chunk smaller than the sink), then a chunk straddling the sink edge.
    "warm_up_and_straddle_sink": (
        dict(sink_tokens=3, window_tokens=4, chunk_tokens=2),
        [
            ([1, 2], [1, 2, 0, 0, 0, 0, 0], [1, 2], [1, 2]),
            ([3, 4], [1, 2, 3, 4, 0, 0, 0], [1, 2, 3, 4], [1, 2, 3, 4]),
            ([5, 6], [1, 2, 3, 4, 5, 6, 0], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]),
            ([7, 8], [1, 2, 3, 8, 5, 6, 7], [1, 2, 3, 8, 5, 6, 7], [1, 2, 3, 5, 6, 7, 8]),
            ([9, 10], [1, 2, 3, 8, 9, 10, 7], [1, 2, 3, 8, 9, 10, 7], [1, 2, 3, 7, 8, 9, 10]),
        ],
    ),
    # sink 1 token, chunk 2: the first chunk straddles the sink; (7, 8) crosses the ring's edge
    # (slots 3 then 1); a final short chunk (9) hides the stale token 7 left in slot 3.
    "chunk_crosses_window_edge": (
        dict(sink_tokens=1, window_tokens=3, chunk_tokens=2),
        [
            ([1, 2], [1, 2, 0, 0], [1, 2], [1, 2]),
            ([3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]),
            ([5, 6], [1, 5, 6, 4], [1, 5, 6, 4], [1, 4, 5, 6]),
            ([7, 8], [1, 8, 6, 7], [1, 8, 6, 7], [1, 6, 7, 8]),
            ([9], [1, 8, 9, 7], [1, 8, 9], [1, 8, 9]),
        ],
    ),
    # chunk == window: attention sees the sink and the pending chunk only.
    "chunk_fills_window": (
        dict(sink_tokens=1, window_tokens=2, chunk_tokens=2),
        [
            ([1, 2], [1, 2, 0], [1, 2], [1, 2]),
            ([3, 4], [1, 4, 3], [1, 4, 3], [1, 3, 4]),
            ([5, 6], [1, 6, 5], [1, 6, 5], [1, 5, 6]),
        ],
    ),
    # no sink: a plain ring of 3 with one-token chunks.
    "no_sink": (
        dict(sink_tokens=0, window_tokens=3, chunk_tokens=1),
        [
            ([1], [1, 0, 0], [1], [1]),
            ([2], [1, 2, 0], [1, 2], [1, 2]),
            ([3], [1, 2, 3], [1, 2, 3], [1, 2, 3]),
            ([4], [4, 2, 3], [4, 2, 3], [2, 3, 4]),
            ([5], [4, 5, 3], [4, 5, 3], [3, 4, 5]),
        ],
    ),
}


@pytest.mark.parametrize("name", sorted(TRACES))
def test_scalar_trace(name):
    sizes, steps = TRACES[name]
    layer = SlidingWindowLayer(**sizes)
    for chunk, buffer, slot_order, stream_order in steps:
        seen = update_scalars(layer, *chunk)
        assert seen == {"buffer": buffer, "slot_order": slot_order, "stream_order": stream_order}, chunk
        layer.commit()


def test_chunk_tokens_is_fixed_by_the_first_update():
    layer = SlidingWindowLayer(sink_tokens=1, window_tokens=3)
    update_scalars(layer, 1, 2)
    assert layer.chunk_tokens == 2
    with pytest.raises(ValueError, match="chunk_tokens"):
        layer.update(scalar_chunk(1, 2, 3), scalar_chunk(1, 2, 3))


def test_get_returns_committed_sink_and_window_in_stream_order():
    layer = SlidingWindowLayer(sink_tokens=2, window_tokens=4, chunk_tokens=2)
    assert layer.get() is None and layer.get_seq_length() == 0
    for i in range(5):
        update_scalars(layer, 2 * i + 1, 2 * i + 2)
        layer.commit()
        stream = list(range(1, 2 * i + 3))
        visible = stream[:2] + stream[2:][-2:]  # the sink, then `window - chunk` most recent tokens
        assert committed_scalars(layer) == visible
        assert layer.get_seq_length() == len(visible)
    assert layer._committed_count == 10 and layer.committed_tokens.item() == 10


def test_get_returns_a_copy():
    layer = SlidingWindowLayer(sink_tokens=1, window_tokens=3, chunk_tokens=1)
    update_scalars(layer, 1)
    layer.commit()
    keys, values = layer.get()
    keys.fill_(100)
    values.fill_(100)
    assert committed_scalars(layer) == [1]
    assert layer.keys[0, 0, 0, 0] == 1 and layer.values[0, 0, 0, 0] == -1


def test_denoising_steps_overwrite_the_same_slots():
    layer = SlidingWindowLayer(sink_tokens=1, window_tokens=3, chunk_tokens=2)
    update_scalars(layer, 1, 2)
    layer.commit()
    first = update_scalars(layer, 30, 40)
    second = update_scalars(layer, 3, 4)
    assert first["buffer"] == [1, 2, 30, 40]
    assert second == {"buffer": [1, 2, 3, 4], "slot_order": [1, 2, 3, 4], "stream_order": [1, 2, 3, 4]}
    assert layer.committed_tokens.item() == 2 and layer.pending_tokens == 2
    layer.commit()
    assert layer.committed_tokens.item() == 4 and committed_scalars(layer) == [1, 4]  # window - chunk = 1


def test_repeated_steps_in_the_wrapped_ring_overwrite_the_same_slots():
    layer = SlidingWindowLayer(sink_tokens=2, window_tokens=4, chunk_tokens=2)
    for i in range(3):
        update_scalars(layer, 2 * i + 1, 2 * i + 2)
        layer.commit()
    for noisy in ([70, 80], [71, 81], [72, 82]):
        assert update_scalars(layer, *noisy)["stream_order"] == [1, 2, 5, 6, *noisy]
    assert update_scalars(layer, 7, 8)["buffer"] == [1, 2, 7, 8, 5, 6]


def test_later_steps_of_a_chunk_reuse_its_slot_arithmetic(monkeypatch):
    """Eager: the slots, slot map and mask are computed at a chunk's first step only; anything that moves the
    counters or the map (commit, rewind, crop, reset, a new chunk size) makes the next update compute them."""
    layer = SlidingWindowLayer(sink_tokens=1, window_tokens=4, chunk_tokens=2)
    computed = []
    real_refresh = SlidingWindowLayer._refresh_mask
    monkeypatch.setattr(
        SlidingWindowLayer, "_refresh_mask", lambda self, n: computed.append(n) or real_refresh(self, n)
    )

    def steps(*chunks):
        computed.clear()
        results = [update_scalars(layer, *chunk)["stream_order"] for chunk in chunks]
        return len(computed), results

    assert steps([1, 2], [1, 2], [1, 2]) == (1, [[1, 2]] * 3)
    layer.commit()
    assert steps([3, 4], [3, 4]) == (1, [[1, 2, 3, 4]] * 2)
    layer.commit()
    assert steps([5, 6]) == (1, [[1, 3, 4, 5, 6]])  # 6 lands in the slot of 2
    layer.commit()
    layer.rewind(2)  # back to after [3, 4]: the slot map changed since that chunk was last written
    assert steps([50, 60], [50, 60]) == (1, [[1, 3, 4, 50, 60]] * 2)
    assert steps([7]) == (1, [[1, 3, 4, 7]])  # a smaller chunk: 60's slot is no longer visible
    layer.reset()
    assert steps([1, 2], [1, 2]) == (1, [[1, 2]] * 2)


def test_positions_absolute_and_reindexed():
    layer = SlidingWindowLayer(sink_tokens=1, window_tokens=3, chunk_tokens=2)
    assert layer.pending_positions(2).tolist() == [0, 1]
    for i in range(3):
        update_scalars(layer, 2 * i + 1, 2 * i + 2)
        layer.commit()
    # committed 6 tokens; the next chunk is tokens 6, 7 and sees sink token 0 and window token 5.
    assert layer.pending_positions(2).tolist() == [6, 7]
    assert layer.pending_positions(2, reindexed=True).tolist() == [2, 3]
    seen = update_scalars(layer, 7, 8)
    assert seen["buffer"] == [1, 8, 6, 7]
    assert layer.key_positions().tolist() == [0, 7, 5, 6]
    assert layer.key_positions(reindexed=True).tolist() == [0, 3, 1, 2]
    # re-indexed positions of attended keys stay below sink + window however long the stream runs
    for i in range(4, 40):
        update_scalars(layer, 2 * i + 1, 2 * i + 2)
        visible = layer.key_positions(reindexed=True)[layer.attention_mask]
        assert sorted(visible.tolist()) == [0, 1, 2, 3]
        layer.commit()


def test_reset_empties_and_keeps_buffers():
    layer = SlidingWindowLayer(sink_tokens=1, window_tokens=3, chunk_tokens=2)
    for i in range(4):
        update_scalars(layer, 2 * i + 1, 2 * i + 2)
        layer.commit()
    pointers = (layer.keys.data_ptr(), layer.values.data_ptr())
    layer.reset()
    assert (layer.keys.data_ptr(), layer.values.data_ptr()) == pointers
    assert layer.keys.abs().sum() == 0 and layer.values.abs().sum() == 0
    assert not layer.attention_mask.any()
    assert layer.get() is None and layer.get_seq_length() == 0 and layer.committed_tokens.item() == 0
    assert layer.pending_positions(2).tolist() == [0, 1]
    # the stream starts over exactly like a fresh layer
    assert update_scalars(layer, 1, 2) == {"buffer": [1, 2, 0, 0], "slot_order": [1, 2], "stream_order": [1, 2]}
    assert (layer.keys.data_ptr(), layer.values.data_ptr()) == pointers


# Transaction: an update without commit (an exception mid-chunk) leaves the committed state untouched.


@pytest.mark.parametrize("aborted", [[50, 60], [50]], ids=["full_chunk", "short_chunk"])
@pytest.mark.parametrize("committed_chunks", [1, 2, 5])
def test_an_uncommitted_chunk_leaves_the_committed_state(committed_chunks, aborted):
    layer = SlidingWindowLayer(sink_tokens=1, window_tokens=3, chunk_tokens=2)
    reference = SlidingWindowLayer(sink_tokens=1, window_tokens=3, chunk_tokens=2)
    for i in range(committed_chunks):
        for cache in (layer, reference):
            update_scalars(cache, 2 * i + 1, 2 * i + 2)
            cache.commit()
    before = committed_scalars(layer)
    update_scalars(layer, *aborted)  # raised before commit() in the caller
    assert committed_scalars(layer) == before
    assert layer.get_seq_length() == reference.get_seq_length()
    # the next chunk (same position, any size) sees what it would have seen without the aborted one
    for nxt in ([7, 8], [7]):
        assert update_scalars(layer, *nxt)["stream_order"] == update_scalars(reference, *nxt)["stream_order"]
    layer.commit()
    reference.commit()
    assert committed_scalars(layer) == committed_scalars(reference)


# Equivalence with a naive cat-and-slice cache on random sizes.


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask=None) -> torch.Tensor:
    """SDPA on `(batch, tokens, heads, head_dim)` tensors; `mask` is `(key_tokens,)` bool."""
    attn_mask = None if mask is None else mask[None]  # (1, S) broadcasts over (B, H, L, S)
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=attn_mask
    )
    return out.transpose(1, 2)  # (B, T, H, D)


class NaiveSinkWindowCache:
    """Keeps every committed chunk; attention sees the sink, the last `window - chunk` tokens, the pending chunk."""

    def __init__(self, sink_tokens: int, window_tokens: int, chunk_tokens: int):
        self.sink_tokens, self.recent_tokens = sink_tokens, window_tokens - chunk_tokens
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def visible(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for committed, pending in ((self.keys, key), (self.values, value)):
            everything = torch.cat([*committed, pending[:, :0]], dim=1)
            sink, rest = everything[:, : self.sink_tokens], everything[:, self.sink_tokens :]
            recent = rest[:, rest.shape[1] - min(rest.shape[1], self.recent_tokens) :]
            out.append(torch.cat([sink, recent, pending], dim=1))
        return out[0], out[1]

    def commit(self, key: torch.Tensor, value: torch.Tensor) -> None:
        self.keys.append(key)
        self.values.append(value)


@pytest.mark.parametrize("seed", range(24))
def test_attention_matches_naive_cat_and_slice(seed):
    rng = random.Random(seed)
    tokens_per_frame = rng.randint(1, 4)
    chunk_frames = rng.randint(1, 3)
    sink_frames = rng.randint(0, 3)
    window_frames = rng.randint(chunk_frames, chunk_frames + 5)
    variable_chunks = rng.random() < 0.5  # e.g. a one-frame first chunk, or a short last chunk
    sink, window, chunk = (f * tokens_per_frame for f in (sink_frames, window_frames, chunk_frames))
    layer = SlidingWindowLayer(sink, window, chunk)
    naive = NaiveSinkWindowCache(sink, window, chunk)
    generator = torch.Generator().manual_seed(seed)
    prefixes_seen = 0
    for _ in range(14):
        frames = rng.randint(1, chunk_frames) if variable_chunks else chunk_frames
        for _step in range(3):  # denoising steps of one chunk
            query, key, value = torch.randn(3, 1, frames * tokens_per_frame, 2, 8, generator=generator).unbind(0)
            keys, values = layer.update(key, value)
            visible_keys, visible_values = naive.visible(key, value)
            expected = sdpa(query, visible_keys, visible_values)
            torch.testing.assert_close(sdpa(query, keys, values, layer.attention_mask), expected, atol=1e-6, rtol=0)
            # the very same tokens: masked slots sorted by absolute position == the naive stream
            mask = layer.attention_mask
            stream_order = torch.argsort(layer.key_positions()[mask])
            assert torch.equal(keys[:, mask][:, stream_order], visible_keys)
            assert torch.equal(values[:, mask][:, stream_order], visible_values)
            prefix = layer.visible_prefix(key.shape[1])
            if prefix is not None:  # window filling: the first slots are exactly the visible keys, in order
                assert torch.equal(keys[:, :prefix], visible_keys) and torch.equal(values[:, :prefix], visible_values)
                prefixes_seen += 1
        layer.commit()
        naive.commit(key, value)
        committed = naive.visible(key[:, :0], value[:, :0])
        if committed[0].shape[1] == 0:  # no sink and chunk == window: nothing committed stays visible
            assert layer.get() is None
        else:
            torch.testing.assert_close(tuple(layer.get()), tuple(committed), atol=0, rtol=0)
    assert prefixes_seen > 0  # every stream starts by filling its window
    assert layer.visible_prefix(chunk) is None  # 14 chunks later the ring has wrapped


def test_visible_prefix_while_filling_and_never_once_slots_may_hold_other_tokens():
    """sink 2 + window 4, chunks of 2: slots 0..5 hold tokens 0..5 until the ring wraps."""
    assert SlidingWindowLayer(sink_tokens=2, window_tokens=4).visible_prefix(2) is None  # chunk size unknown yet
    layer = SlidingWindowLayer(sink_tokens=2, window_tokens=4, chunk_tokens=2)
    layer.update(scalar_chunk(1, 2), scalar_chunk(1, 2))
    assert layer.visible_prefix(2) == 2
    layer.commit()
    layer.update(scalar_chunk(3, 4), scalar_chunk(3, 4))
    assert layer.visible_prefix(2) == 4 and layer.visible_prefix(1) == 3
    layer.commit()
    assert layer.visible_prefix(2) == 6  # the last chunk before the ring wraps
    for values in ((5, 6), (7, 8)):
        layer.update(scalar_chunk(*values), scalar_chunk(*values))
        layer.commit()
    assert layer.visible_prefix(2) is None  # tokens 7, 8 sit in slots 2, 3
    layer.rewind(2)  # back to 6 committed: slots 2, 3 still hold 7, 8, not 2, 3
    assert layer.visible_prefix(2) is None
    layer.reset()
    assert layer.visible_prefix(2) == 2
    for values in ((1, 2), (3, 4)):
        layer.update(scalar_chunk(*values), scalar_chunk(*values))
        layer.commit()
    layer.crop(3)  # an evicted slot inside the prefix
    assert layer.visible_prefix(2) is None
    layer.reset()
    layer.update(scalar_chunk(1, 2), scalar_chunk(1, 2))
    layer.commit()
    loaded = SlidingWindowLayer(sink_tokens=2, window_tokens=4, chunk_tokens=2)
    loaded.update(scalar_chunk(0, 0), scalar_chunk(0, 0))
    loaded.load_state_dict(layer.state_dict())
    assert loaded.visible_prefix(2) == 4  # the loaded counters say no slot of the prefix holds another token


# Steady state: same buffers, same graph.


def test_steady_state_keeps_every_buffer():
    layer = SlidingWindowLayer(sink_tokens=4, window_tokens=12, chunk_tokens=4)
    layer.early_initialization(1, 2, 8, torch.float32, "cpu")
    pointers = buffer_pointers(layer)
    assert {"keys", "values", "slot_positions", "committed_tokens", "_mask"} <= pointers.keys()
    for _ in range(30):
        for _step in range(4):
            key, value = torch.randn(2, 1, 4, 2, 8).unbind(0)
            keys, values = layer.update(key, value)
            assert (keys.data_ptr(), values.data_ptr()) == (pointers["keys"], pointers["values"])
            assert layer.attention_mask.data_ptr() == pointers["_mask"]
        layer.commit()
        now = buffer_pointers(layer)
        assert now == pointers


def test_steady_state_update_and_commit_allocate_nothing():
    layer = SlidingWindowLayer(sink_tokens=4, window_tokens=12, chunk_tokens=4)
    layer.early_initialization(1, 2, 8, torch.float32, "cpu")
    for chunk in range(8):
        key, value = torch.randn(2, 1, 4, 2, 8).unbind(0)
        with NewStorageCounter() as counter:
            for _step in range(4):
                layer.update(key, value)
            layer.commit()
        assert counter.allocations == [], chunk


def test_compiles_once_and_never_recompiles():
    layer = SlidingWindowLayer(sink_tokens=3, window_tokens=9, chunk_tokens=3)
    eager_layer = SlidingWindowLayer(sink_tokens=3, window_tokens=9, chunk_tokens=3)
    for cache in (layer, eager_layer):
        cache.early_initialization(1, 2, 8, torch.float32, "cpu")
    graphs = []

    def count_graphs(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    def attend(cache, query, key, value):
        keys, values = cache.update(key, value)
        return sdpa(query, keys, values, cache.attention_mask)

    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        torch._dynamo.reset()
        compiled = torch.compile(attend, backend=count_graphs, fullgraph=True)
        generator = torch.Generator().manual_seed(0)
        for _ in range(22):
            for _step in range(3):
                query, key, value = torch.randn(3, 1, 3, 2, 8, generator=generator).unbind(0)
                out = compiled(layer, query, key, value)
                torch.testing.assert_close(out, attend(eager_layer, query, key, value), atol=0, rtol=0)
            layer.commit()
            eager_layer.commit()
        torch._dynamo.reset()
    assert len(graphs) == 1
    assert torch.equal(layer.keys, eager_layer.keys) and torch.equal(layer.attention_mask, eager_layer.attention_mask)


def test_advance_moves_the_position_empties_the_window_and_keeps_the_sink():
    """A scalar trace: sink 1, window 3, chunks of 1 token; after `advance(5)` the next token sits at position 7 and
    sees the sink and itself only (LongLive's one-pass re-cache builds its pass this way)."""
    layer = SlidingWindowLayer(sink_tokens=1, window_tokens=3, chunk_tokens=1)
    for value in (1.0, 2.0):
        layer.update(torch.full((1, 1, 1, 1), value), torch.full((1, 1, 1, 1), value))
        layer.commit()
    layer.advance(5)
    assert layer.committed_count == 7 and not layer.window_full
    held = layer.get()[0].flatten().tolist()
    assert held == [1.0]  # the sink only: the window token (2.0) is gone, nothing else was written
    assert layer.pending_positions(1).tolist() == [7]
    keys, _ = layer.update(torch.full((1, 1, 1, 1), 9.0), torch.full((1, 1, 1, 1), 9.0))
    assert keys[0, layer.attention_mask, 0, 0].tolist() == [1.0, 9.0]
    with pytest.raises(RuntimeError, match="pending"):
        layer.advance(1)

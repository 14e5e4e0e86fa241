"""Specification of the cache's input checks: each bad input raises a clear error that names the argument,
before the layer changes at all (buffers, counters and pending state are as they were)."""

import pytest
import torch

from rolldiff.caching import (
    CrossAttentionLayer,
    LinearAttentionLayer,
    RollingKVCache,
    SlidingWindowLayer,
    StaticLayer,
)


def kv(tokens: int = 2, batch: int = 1, heads: int = 2, head_dim: int = 4, **kwargs) -> tuple[torch.Tensor, ...]:
    key = torch.randn(batch, tokens, heads, head_dim, **kwargs)  # (B, T, H, D)
    return key, torch.randn_like(key)


def snapshot(layer) -> dict:
    """Every attribute of the layer; tensors as (data_ptr, copy)."""
    state = {}
    attributes = {name: item for name, item in vars(layer).items() if name not in ("_buffers", "_modules")}
    for name, item in {**attributes, **dict(layer.named_buffers())}.items():
        if isinstance(item, torch.Tensor):
            state[name] = (item.data_ptr(), item.clone())
        elif not callable(item):
            state[name] = item
    return state


def assert_unchanged(layer, before: dict) -> None:
    after = snapshot(layer)
    assert after.keys() == before.keys()
    for name, item in before.items():
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
            assert after[name][0] == item[0], name
            assert torch.equal(after[name][1], item[1]), name
        else:
            assert after[name] == item, name


def committed_sliding_layer() -> SlidingWindowLayer:
    """A layer mid-stream: two chunks committed, so the failed call has state to spoil."""
    layer = SlidingWindowLayer(sink_tokens=2, window_tokens=4, chunk_tokens=2)
    for _ in range(2):
        layer.update(*kv())
        layer.commit()
    return layer


# Sizes


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        (dict(sink_tokens=-1, window_tokens=4), ValueError, "sink_tokens"),
        (dict(sink_tokens=0, window_tokens=0), ValueError, "window_tokens"),
        (dict(sink_tokens=0, window_tokens=-3), ValueError, "window_tokens"),
        (dict(sink_tokens=0, window_tokens=4, chunk_tokens=0), ValueError, "chunk_tokens"),
        (dict(sink_tokens=True, window_tokens=4), TypeError, "sink_tokens"),
        (dict(sink_tokens=0, window_tokens=4.0), TypeError, "window_tokens"),
        (dict(sink_tokens=0, window_tokens=4, chunk_tokens=2.0), TypeError, "chunk_tokens"),
        (dict(sink_tokens=0, window_tokens=4, chunk_tokens=False), TypeError, "chunk_tokens"),
        (dict(sink_tokens=0, window_tokens=4, chunk_tokens=5), ValueError, "window_tokens"),
    ],
)
def test_sliding_window_sizes(kwargs, error, name):
    with pytest.raises(error, match=name):
        SlidingWindowLayer(**kwargs)


@pytest.mark.parametrize(
    "build, error, name",
    [
        (lambda: StaticLayer(0), ValueError, "max_tokens"),
        (lambda: StaticLayer(8.0), TypeError, "max_tokens"),
        (lambda: LinearAttentionLayer(window_chunks=0), ValueError, "window_chunks"),
        (lambda: LinearAttentionLayer(window_chunks=True), TypeError, "window_chunks"),
    ],
)
def test_other_layer_sizes(build, error, name):
    with pytest.raises(error, match=name):
        build()


def test_first_chunk_larger_than_the_window():
    layer = SlidingWindowLayer(sink_tokens=1, window_tokens=4)
    before = snapshot(layer)
    with pytest.raises(ValueError, match="window_tokens"):
        layer.update(*kv(tokens=5))
    assert_unchanged(layer, before)
    assert layer.keys is None and layer.chunk_tokens is None


def test_chunk_larger_than_chunk_tokens():
    layer = committed_sliding_layer()
    before = snapshot(layer)
    with pytest.raises(ValueError, match="chunk_tokens"):
        layer.update(*kv(tokens=3))
    assert_unchanged(layer, before)


@pytest.mark.parametrize("fresh", [True, False], ids=["first_update", "mid_stream"])
def test_empty_chunk(fresh):
    layer = SlidingWindowLayer(sink_tokens=1, window_tokens=4) if fresh else committed_sliding_layer()
    before = snapshot(layer)
    with pytest.raises(ValueError, match="`key`"):
        layer.update(*kv(tokens=0))
    assert_unchanged(layer, before)


# Shapes, dtypes, devices (checked on a layer mid-stream)


BAD_INPUTS = {
    "key_ndim": (lambda: (torch.randn(1, 2, 8), torch.randn(1, 2, 2, 4)), ValueError, "`key`"),
    "value_ndim": (lambda: (torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4, 1)), ValueError, "`value`"),
    "key_not_a_tensor": (lambda: ([[0.0]], torch.randn(1, 2, 2, 4)), TypeError, "`key`"),
    "value_tokens": (lambda: (torch.randn(1, 2, 2, 4), torch.randn(1, 1, 2, 4)), ValueError, "`value`"),
    "value_head_dim": (lambda: (torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 8)), ValueError, "`value`"),
    "key_value_dtype": (lambda: (torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4).double()), TypeError, "`value`"),
    "buffer_dtype": (lambda: kv(dtype=torch.float64), TypeError, "`key`"),
    "key_value_device": (
        lambda: (torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4, device="meta")),
        ValueError,
        "`value`",
    ),
    "buffer_device": (lambda: kv(device="meta"), ValueError, "`key`"),
    "batch_size": (lambda: kv(batch=2), ValueError, "batch"),
    "num_heads": (lambda: kv(heads=3), ValueError, "heads"),
    "head_dim": (lambda: kv(head_dim=8), ValueError, "head_dim"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_sliding_window_bad_input_changes_nothing(case):
    make, error, name = BAD_INPUTS[case]
    layer = committed_sliding_layer()
    layer.update(*kv())  # a pending chunk too: a failed denoising step must not spoil it either
    before = snapshot(layer)
    with pytest.raises(error, match=name):
        layer.update(*make())
    assert_unchanged(layer, before)


AGAINST_A_BUFFER = {"buffer_dtype", "buffer_device", "batch_size", "num_heads", "head_dim"}


@pytest.mark.parametrize("case", sorted(set(BAD_INPUTS) - AGAINST_A_BUFFER))
def test_sliding_window_bad_first_input_allocates_nothing(case):
    make, error, name = BAD_INPUTS[case]
    layer = SlidingWindowLayer(sink_tokens=2, window_tokens=4)
    with pytest.raises(error, match=name):
        layer.update(*make())
    assert layer.keys is None and layer.values is None and layer.chunk_tokens is None


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_static_layer_bad_input_changes_nothing(case):
    make, error, name = BAD_INPUTS[case]
    layer = StaticLayer(max_tokens=8)
    layer.update(*kv())
    layer.commit()
    before = snapshot(layer)
    with pytest.raises(error, match=name):
        layer.update(*make())
    assert_unchanged(layer, before)


def test_static_layer_overflow_changes_nothing():
    layer = StaticLayer(max_tokens=5)
    layer.update(*kv(tokens=3))
    layer.commit()
    before = snapshot(layer)
    with pytest.raises(ValueError, match="max_tokens"):
        layer.update(*kv(tokens=3))
    assert_unchanged(layer, before)


@pytest.mark.parametrize("case", sorted(set(BAD_INPUTS) - {"buffer_dtype"}))  # sums are fp32 whatever comes in
def test_linear_attention_bad_input_changes_nothing(case):
    make, error, name = BAD_INPUTS[case]
    layer = LinearAttentionLayer(window_chunks=2)
    layer.update(*kv())
    layer.commit()
    before = snapshot(layer)
    with pytest.raises(error, match=name):
        layer.update(*make())
    assert_unchanged(layer, before)


def test_linear_attention_normalizer_key_shape():
    layer = LinearAttentionLayer()
    layer.update(*kv())
    layer.commit()
    before = snapshot(layer)
    key, value = kv()
    with pytest.raises(ValueError, match="key_for_normalizer"):
        layer.update(key, value, key_for_normalizer=key[:, :1])
    assert_unchanged(layer, before)


@pytest.mark.parametrize("case", ["key_ndim", "value_ndim", "value_tokens", "key_value_dtype", "key_value_device"])
def test_cross_attention_bad_input_changes_nothing(case):
    make, error, name = BAD_INPUTS[case]
    layer = CrossAttentionLayer()
    prompt = torch.randn(1, 3, 8)
    layer.update(*kv(tokens=3), conditioning=prompt)
    before = snapshot(layer)
    with pytest.raises(error, match=name):
        layer.update(*make(), conditioning=torch.randn(1, 3, 8))
    assert_unchanged(layer, before)
    assert layer.is_cached_for(prompt)


# Commit and allocation misuse


@pytest.mark.parametrize(
    "build", [lambda: SlidingWindowLayer(1, 4), lambda: StaticLayer(8), lambda: LinearAttentionLayer()]
)
def test_commit_with_nothing_pending(build):
    layer = build()
    with pytest.raises(RuntimeError, match="nothing pending"):
        layer.commit()
    layer.update(*kv())
    layer.commit()
    before = snapshot(layer)
    with pytest.raises(RuntimeError, match="nothing pending"):
        layer.commit()  # a second commit of the same chunk
    assert_unchanged(layer, before)


def test_early_initialization_needs_chunk_tokens():
    layer = SlidingWindowLayer(sink_tokens=1, window_tokens=4)
    with pytest.raises(ValueError, match="chunk_tokens"):
        layer.early_initialization(1, 2, 4, torch.float32, "cpu")
    assert layer.keys is None


@pytest.mark.parametrize(
    "sizes, name", [((0, 2, 4), "batch_size"), ((1, -2, 4), "num_heads"), ((1, 2, 4.0), "head_dim")]
)
@pytest.mark.parametrize(
    "build", [lambda: SlidingWindowLayer(1, 4, 2), lambda: StaticLayer(8), lambda: LinearAttentionLayer()]
)
def test_early_initialization_sizes(build, sizes, name):
    layer = build()
    with pytest.raises((ValueError, TypeError), match=name):
        layer.early_initialization(*sizes, torch.float32, "cpu")
    assert not layer.is_initialized


def test_container_arguments():
    with pytest.raises(ValueError, match="layers"):
        RollingKVCache([])
    with pytest.raises(TypeError, match=r"layers\[1\]"):
        RollingKVCache([SlidingWindowLayer(1, 4), "not a layer"])
    with pytest.raises(ValueError, match="cross_layers"):
        RollingKVCache([SlidingWindowLayer(1, 4)], [None, None])

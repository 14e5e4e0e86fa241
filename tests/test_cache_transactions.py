"""Specification of cache transactions (issue 12): every container operation checks every layer before
changing any; `early_initialization` on a layer in use is refused (reset first), on an empty one it
reuses or reallocates consistently; `get()` returns a copy in every kind; junk is refused up front."""

import pytest
import torch

from rolldiff.caching import (
    ConvStateLayer,
    CrossAttentionLayer,
    LinearAttentionLayer,
    RollingKVCache,
    SlidingWindowLayer,
    StaticLayer,
)


def kv(tokens: int = 2, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    key = torch.randn(batch, tokens, 2, 4)  # (B, T, H, D)
    return key, torch.randn_like(key)


def filled(kind: str):
    """A layer of `kind` holding one committed chunk."""
    if kind.startswith("sliding"):
        options = {"sliding_int8": dict(quantization="int8"), "sliding_offload": dict(offload=True)}.get(kind, {})
        layer = SlidingWindowLayer(2, 4, 2, **options)
    elif kind == "cross":
        layer = CrossAttentionLayer()
        layer.update(*kv(3))
        return layer
    elif kind == "linear":
        layer = LinearAttentionLayer()
    elif kind == "static":
        layer = StaticLayer(8)
    if kind == "conv_state":
        layer = ConvStateLayer()
        layer.update(torch.randn(1, 8, 2, 3))
    else:
        layer.update(*kv())
    layer.commit()
    return layer


STREAM_KINDS = ["sliding", "sliding_int8", "sliding_offload", "linear", "conv_state"]


def storages(layer) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in layer.buffers()}


@pytest.mark.parametrize("kind", [*STREAM_KINDS, "cross", "static"])
def test_get_returns_a_copy_in_every_kind(kind):
    layer = filled(kind)
    held = [t for t in layer.get() if t is not None]
    assert held and not {t.untyped_storage().data_ptr() for t in held} & storages(layer)
    before = [t.clone() for t in held]
    for tensor in held:
        tensor.fill_(123.0)
    assert all(torch.equal(a, b) for a, b in zip([t for t in layer.get() if t is not None], before))


@pytest.mark.parametrize("kind", [*STREAM_KINDS, "cross"])
def test_early_initialization_of_a_layer_in_use_is_refused(kind):
    layer = filled(kind)
    before = [t.clone() for t in layer.get() if t is not None]
    length = layer.get_seq_length()
    with pytest.raises(RuntimeError, match=r"in use.*reset\(\)"):
        layer.early_initialization(1, 2, 4, torch.float32, "cpu")
    assert layer.get_seq_length() == length
    assert all(torch.equal(a, b) for a, b in zip([t for t in layer.get() if t is not None], before))


@pytest.mark.parametrize("options", [{}, dict(quantization="int8"), dict(offload=True)])
def test_early_initialization_after_reset_keeps_same_geometry_buffers(options):
    layer = SlidingWindowLayer(2, 4, 2, **options)
    layer.early_initialization(2, 2, 4, torch.float32, "cpu")
    pointers = [t.data_ptr() for t in (layer.keys, layer.values, layer.slot_positions)]
    layer.update(*kv(batch=2))
    layer.commit()
    layer.reset()
    layer.early_initialization(2, 2, 4, torch.float32, "cpu")
    assert [t.data_ptr() for t in (layer.keys, layer.values, layer.slot_positions)] == pointers
    assert layer._committed_count == 0 and layer.committed_tokens.item() == 0 and layer.get() is None
    layer.early_initialization(3, 2, 4, torch.float16, "cpu")  # another geometry: a consistent fresh layer
    assert layer.keys.shape[0] == 3 and layer.compute_dtype == torch.float16 and layer.committed_tokens.item() == 0
    layer.update(*(t.half() for t in kv(batch=3)))
    assert layer.pending_tokens == 2


def test_early_initialization_with_a_bad_dtype_or_device_names_it():
    layer = SlidingWindowLayer(2, 4, 2)
    with pytest.raises(TypeError, match="`dtype`"):
        layer.early_initialization(1, 2, 4, torch.int8, "cpu")
    with pytest.raises(ValueError, match="`device`"):
        layer.early_initialization(1, 2, 4, torch.float32, "not-a-device")
    assert layer.keys is None


def test_container_early_initialization_checks_every_layer_first():
    fresh, used = SlidingWindowLayer(2, 4, 2), filled("sliding")
    static = filled("static")
    for layers in ([fresh, used], [SlidingWindowLayer(2, 4, 2), static]):
        cache = RollingKVCache(layers)
        with pytest.raises(RuntimeError, match="in use"):
            cache.early_initialization(1, 2, 4, torch.float32, "cpu")
        assert layers[0].keys is None  # nothing allocated before the refusal
    assert used.get_seq_length() == 2 and static.get_seq_length() == 2


def test_container_rewind_and_crop_check_every_layer_first():
    short, long = SlidingWindowLayer(2, 4, 2), SlidingWindowLayer(2, 8, 2)
    cache = RollingKVCache([long, short])
    for _ in range(5):
        for layer in cache:
            layer.update(*kv())
        cache.commit()
    before = [(layer._committed_count, [t.clone() for t in layer.get()]) for layer in cache]
    with pytest.raises(ValueError, match="num_tokens"):
        cache.rewind(4)  # the long window can, the short one cannot
    with pytest.raises(ValueError, match="max_tokens"):
        cache.crop(1)  # below the sink in both
    after = [(layer._committed_count, [t.clone() for t in layer.get()]) for layer in cache]
    for (count, tensors), (count_after, tensors_after) in zip(before, after):
        assert count == count_after and all(map(torch.equal, tensors, tensors_after))


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: RollingKVCache([SlidingWindowLayer(1, 4)], ["junk"]), TypeError, r"cross_layers\[0\]"),
        (lambda: RollingKVCache([SlidingWindowLayer(1, 4)], "junk"), TypeError, "cross_layers"),
        (lambda: RollingKVCache(SlidingWindowLayer(1, 4)), TypeError, "layers"),
        (lambda: RollingKVCache([SlidingWindowLayer(1, 4)], slots=["conv"]), TypeError, "slots"),
        (lambda: RollingKVCache([SlidingWindowLayer(1, 4)], slots={"bad name": [None]}), ValueError, "slots"),
        (lambda: RollingKVCache([SlidingWindowLayer(1, 4)], slots={"conv": [None, None]}), ValueError, "conv"),
    ],
)
def test_container_refuses_junk(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_one_layer_object_cannot_serve_two_blocks():
    layer = SlidingWindowLayer(1, 4)
    with pytest.raises(ValueError, match="once"):
        RollingKVCache([layer, layer])

"""Specification of quantized sliding-window layers (`quantization="int8"` / `"fp8"`).

Stored: codes plus fp32 per token-and-head absmax scales. Read: dequantized into a scratch shared by
the cache's layers, with the pending chunk exact. Bounds are stated against the unquantized layer on
unit-variance K/V (head_dim 64 and 128, fp32): attention output max |error| <= 0.03 (int8, measured
~0.018) and <= 0.15 (fp8 e4m3, measured ~0.086).
"""

import pytest
import torch
from cache_helpers import GraphCounter, NewStorageCounter, attend, with_options
from tiny_components import tiny_transformer

from rolldiff.caching import RollingKVCache, SlidingWindowLayer
from rolldiff.models import ChunkLayout

FORMATS = ["int8", "fp8"]
ATTENTION_BOUND = {"int8": 0.03, "fp8": 0.15}
ELEMENT_BOUND = {"int8": 1 / 254, "fp8": 1 / 16}  # |x - dequantized| / max|x| of its token and head


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("quantization", FORMATS)
def test_memory_is_at_most_055_of_bf16(quantization, head_dim):
    sizes = dict(sink_tokens=4, window_tokens=12, chunk_tokens=4)
    plain, quantized = SlidingWindowLayer(**sizes), SlidingWindowLayer(**sizes, quantization=quantization)
    for layer in (plain, quantized):
        layer.early_initialization(1, 1, head_dim, torch.bfloat16, "cpu")
    ratio = quantized.memory_bytes() / plain.memory_bytes()
    assert ratio <= 0.55, ratio
    assert quantized.keys.dtype in (torch.int8, torch.float8_e4m3fn) and quantized.key_scales.dtype == torch.float32


@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("quantization", FORMATS)
def test_the_scales_are_the_stored_ones_resident_or_offloaded(quantization, offload):
    layer = SlidingWindowLayer(2, 6, 2, quantization=quantization, offload=offload)
    layer.early_initialization(1, 2, 8, torch.float32, "cpu")
    home = layer.storage.home if offload else layer.storage
    assert layer.key_scales is home.key_scales and layer.value_scales is home.value_scales
    assert layer.key_scales.shape == (1, 8, 2, 1) and layer.key_scales.dtype == torch.float32
    assert SlidingWindowLayer(2, 6, 2, offload=offload).key_scales is None  # dense: no scales


@pytest.mark.parametrize("quantization", FORMATS)
def test_dequantization_scratch_is_shared_and_counted_once(quantization):
    layers = [SlidingWindowLayer(2, 6, 2, quantization=quantization) for _ in range(3)]
    cache = RollingKVCache(layers)
    cache.early_initialization(2, 2, 8, torch.float32, "cpu")
    assert all(layer.workspace is cache.workspace for layer in layers)
    scratch = cache.workspace.memory_bytes()
    one_layer = 2 * (2 * 8 * 2 * 8 * 4)  # dequantized K and V (batch 2, capacity 8, 2 heads, head_dim 8, fp32)
    assert one_layer <= scratch < 2 * one_layer  # plus the chunk-sized quantization scratch, once
    assert cache.memory_bytes() == sum(layer.memory_bytes() for layer in layers) + scratch
    key = torch.randn(2, 2, 2, 8)
    for layer in layers:  # every layer's update returns the same storage: the one scratch
        keys, _ = layer.update(key, key)
        assert keys.data_ptr() == cache.workspace.view("dequant_keys", keys.shape, torch.float32, "cpu").data_ptr()


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("quantization", FORMATS)
def test_attention_error_is_bounded(quantization, head_dim):
    reference = SlidingWindowLayer(4, 12, 4)
    quantized = SlidingWindowLayer(4, 12, 4, quantization=quantization)
    generator = torch.Generator().manual_seed(0)
    worst = 0.0
    for _chunk in range(8):
        for _step in range(3):
            query, key, value = torch.randn(3, 2, 4, 2, head_dim, generator=generator).unbind(0)
            expected = attend(reference, query, key, value)
            worst = max(worst, (attend(quantized, query, key, value) - expected).abs().max().item())
        reference.commit()
        quantized.commit()
    assert 0 < worst <= ATTENTION_BOUND[quantization]


@pytest.mark.parametrize("quantization", FORMATS)
def test_pending_chunk_is_exact_and_committed_tokens_are_within_the_element_bound(quantization):
    layer = SlidingWindowLayer(2, 4, 2, quantization=quantization)
    plain = SlidingWindowLayer(2, 4, 2)
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        key, value = torch.randn(2, 1, 2, 3, 16, generator=generator).unbind(0)
        keys, values = layer.update(key, value)
        plain.update(key, value)
        pending = layer.pending_slot_mask()
        assert torch.equal(keys[:, pending], plain.keys[:, pending])  # exact: attention sees the chunk as given
        assert torch.equal(values[:, pending], plain.values[:, pending])
        layer.commit()
        plain.commit()
        for got, exact in zip(layer.get(), plain.get()):
            scale = exact.abs().amax(dim=-1, keepdim=True)
            assert ((got - exact).abs() <= scale * ELEMENT_BOUND[quantization] + 1e-7).all()


def test_an_all_zero_token_round_trips():
    layer = SlidingWindowLayer(1, 2, 1, quantization="int8")
    layer.update(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4))
    layer.commit()
    keys, values = layer.get()
    assert torch.equal(keys, torch.zeros(1, 1, 1, 4)) and not keys.isnan().any()


@pytest.mark.parametrize("quantization", FORMATS)
def test_steady_state_allocates_nothing(quantization):
    layer = SlidingWindowLayer(4, 12, 4, quantization=quantization)
    layer.early_initialization(1, 2, 8, torch.bfloat16, "cpu")
    for chunk in range(6):
        key, value = torch.randn(2, 1, 4, 2, 8, dtype=torch.bfloat16).unbind(0)
        with NewStorageCounter() as counter:
            for _step in range(3):
                layer.update(key, value)
            layer.commit()
        assert counter.allocations == [], chunk


@pytest.mark.parametrize("quantization", FORMATS)
def test_compiles_once_and_matches_eager(quantization):
    layers = [SlidingWindowLayer(3, 9, 3, quantization=quantization) for _ in range(2)]
    for layer in layers:
        layer.early_initialization(1, 2, 8, torch.float32, "cpu")
    counter = GraphCounter()
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        torch._dynamo.reset()
        compiled = torch.compile(attend, backend=counter, fullgraph=True)
        generator = torch.Generator().manual_seed(0)
        for _ in range(8):
            query, key, value = torch.randn(3, 1, 3, 2, 8, generator=generator).unbind(0)
            out = compiled(layers[0], query, key, value)
            torch.testing.assert_close(out, attend(layers[1], query, key, value), atol=0, rtol=0)
            for layer in layers:
                layer.commit()
        torch._dynamo.reset()
    assert len(counter.graphs) == 1
    assert torch.equal(layers[0].keys.view(torch.uint8), layers[1].keys.view(torch.uint8))


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization.*'int4'"):
        SlidingWindowLayer(1, 4, 2, quantization="int4")


@pytest.mark.parametrize("quantization, bound", [("int8", 0.005), ("fp8", 0.02)])
@torch.no_grad()
def test_model_output_with_a_quantized_cache_is_within_its_bound(quantization, bound):
    """The Krea-like model over 5 chunks: max |output - unquantized output| (outputs reach ~2; measured 9e-4, 3e-3)."""
    model = tiny_transformer()
    layout = ChunkLayout(4, chunk_frames=2, sink_frames=2, window_frames=4, position_mode="relative")
    text = torch.randn(1, 7, 16, generator=torch.Generator().manual_seed(1))
    plain = model.make_cache(layout)
    quantized = with_options(plain, quantization=quantization)
    generator, worst = torch.Generator().manual_seed(2), 0.0
    for _chunk in range(5):
        for sigma in (0.8, 0.3, 0.0):
            latents, timestep = torch.randn(1, 4, 2, 4, 4, generator=generator), torch.tensor([sigma * 1000.0])
            outputs = [model(latents, timestep, text, kv_cache=c, layout=layout).sample for c in (plain, quantized)]
            worst = max(worst, (outputs[0] - outputs[1]).abs().max().item())
        plain.commit()
        quantized.commit()
    assert 0 < worst <= bound


@torch.no_grad()
def test_model_step_with_an_int8_cache_compiles_into_two_graphs():
    """Window filling, then full: the quantized storage adds no graph and no recompile as the stream grows."""
    model = tiny_transformer()
    layout = ChunkLayout(4, chunk_frames=1, sink_frames=1, window_frames=3, position_mode="relative")
    text = torch.randn(1, 7, 16, generator=torch.Generator().manual_seed(1))
    caches = []
    for _ in range(2):
        cache = with_options(model.make_cache(layout), quantization="int8")
        cache.early_initialization(
            1, model.config.num_attention_heads, model.config.attention_head_dim, torch.float32, "cpu"
        )
        model.prepare_conditioning(cache, text)
        caches.append(cache)
    counter = GraphCounter()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    generator = torch.Generator().manual_seed(0)
    try:
        for _chunk in range(12):
            noisy = torch.randn(1, 4, 1, 4, 4, generator=generator)
            for sigma in (1.0, 0.5, 0.0):
                timestep = torch.tensor([sigma * 1000.0])
                got = compiled(noisy, timestep, text, kv_cache=caches[0], layout=layout).sample
                expected = model(noisy, timestep, text, kv_cache=caches[1], layout=layout).sample
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
            for cache in caches:
                cache.commit()
    finally:
        torch._dynamo.reset()
    assert len(counter.graphs) == 2

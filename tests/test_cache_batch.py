"""Specification of smaller batches on one allocation: a cache allocated for batch B serves any b <= B.

The same storage (views of the first b rows), no reallocation, and one compiled step for every b
(the batch marked dynamic); a larger batch, or a batch change mid-stream, is refused with a clear error.
"""

import pytest
import torch
from cache_helpers import GraphCounter, attend
from tiny_components import tiny_transformer

from rolldiff.caching import CrossAttentionLayer, RollingKVCache, SlidingWindowLayer
from rolldiff.models import ChunkLayout


def layers(count: int = 2, **options) -> RollingKVCache:
    return RollingKVCache([SlidingWindowLayer(2, 6, 2, **options) for _ in range(count)])


def run_stream(cache: RollingKVCache, batch: int, chunks: int = 5, step=attend) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(batch)
    outputs = []
    for _ in range(chunks):
        for _step in range(2):
            for layer in cache:
                query, key, value = torch.randn(3, batch, 2, 2, 8, generator=generator).unbind(0)
                outputs.append(step(layer, query, key, value))
        cache.commit()
    return outputs


@pytest.mark.parametrize("quantization", [None, "int8"])
@pytest.mark.parametrize("batch", [1, 2, 3])
def test_a_cache_for_three_serves_smaller_batches_in_place(batch, quantization):
    big = layers(quantization=quantization)
    big.early_initialization(3, 2, 8, torch.float32, "cpu")
    pointers = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in big]
    exact = layers(quantization=quantization)
    exact.early_initialization(batch, 2, 8, torch.float32, "cpu")
    for got, expected in zip(run_stream(big, batch), run_stream(exact, batch)):
        assert got.shape[0] == batch and torch.equal(got, expected)
    assert [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in big] == pointers
    assert all(big[0].get()[0].shape[0] == batch for _ in [0])  # get() reports the stream's rows
    for layer, reference in zip(big, exact):
        assert all(map(torch.equal, layer.get(), reference.get()))


def test_a_larger_batch_is_refused_before_any_change():
    layer = SlidingWindowLayer(2, 6, 2)
    layer.early_initialization(2, 2, 8, torch.float32, "cpu")
    key = torch.randn(3, 2, 2, 8)
    with pytest.raises(ValueError, match=r"`key` has batch 3 but the cache was allocated for at most 2"):
        layer.update(key, key)
    assert layer.pending_tokens == 0 and not layer.attention_mask.any()


def test_changing_the_batch_mid_stream_needs_a_reset():
    layer = SlidingWindowLayer(2, 6, 2)
    layer.early_initialization(3, 2, 8, torch.float32, "cpu")
    layer.update(*torch.randn(2, 2, 2, 2, 8).unbind(0))
    layer.commit()
    with pytest.raises(ValueError, match="batch 1 but this stream has run with batch 2.*reset"):
        layer.update(*torch.randn(2, 1, 2, 2, 8).unbind(0))
    layer.reset()
    layer.update(*torch.randn(2, 1, 2, 2, 8).unbind(0))  # a new stream may use another batch
    assert layer.pending_tokens == 2


def test_one_compiled_step_serves_every_batch_up_to_the_allocation():
    compiled_cache, eager_cache = layers(), layers()
    for cache in (compiled_cache, eager_cache):
        cache.early_initialization(4, 2, 8, torch.float32, "cpu")
    counter = GraphCounter()
    torch._dynamo.reset()
    compiled = torch.compile(lambda layer, qkv: attend(layer, *qkv.unbind(0)), backend=counter, fullgraph=True)

    def compiled_step(layer, query, key, value):
        qkv = torch.stack([query, key, value])  # (3, batch, tokens, heads, head_dim): one batch symbol
        torch._dynamo.decorators.mark_unbacked(qkv, 1)  # one graph for every batch, 1 included
        return compiled(layer, qkv)

    for batch in (4, 1, 3, 2):
        for cache in (compiled_cache, eager_cache):
            cache.reset()
        got, expected = run_stream(compiled_cache, batch, 3, compiled_step), run_stream(eager_cache, batch, 3)
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), batch
    torch._dynamo.reset()
    assert len(counter.graphs) == 1


@torch.no_grad()
def test_model_cache_for_three_serves_a_batch_of_two():
    model = tiny_transformer()
    layout = ChunkLayout(4, chunk_frames=2, sink_frames=2, window_frames=4, position_mode="relative")
    big = model.make_cache(layout, batch_size=3, dtype=torch.float32, device="cpu")
    exact = model.make_cache(layout, batch_size=2, dtype=torch.float32, device="cpu")
    pointer = big[0].keys.data_ptr()
    text = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(1))
    generator = torch.Generator().manual_seed(2)
    for _chunk in range(3):
        for sigma in (0.7, 0.0):
            latents = torch.randn(2, 4, 2, 4, 4, generator=generator)
            timestep = torch.full((2,), sigma * 1000.0)
            outputs = [model(latents, timestep, text, kv_cache=c, layout=layout).sample for c in (big, exact)]
            assert torch.equal(*outputs)
        big.commit()
        exact.commit()
    assert big[0].keys.data_ptr() == pointer and isinstance(big.cross[0], CrossAttentionLayer)


@torch.no_grad()
def test_compiled_model_serves_batches_one_to_three_from_one_cache_without_recompiling():
    """After one round of batches (3, 2, 1) the compiled step never recompiles: each class of batch (the first,
    dynamic b >= 2, b = 1) x window state (filling, full) is one graph, all on the one allocation."""
    model = tiny_transformer()
    layout = ChunkLayout(4, chunk_frames=1, sink_frames=1, window_frames=3, position_mode="relative")
    compiled_cache = model.make_cache(layout, batch_size=3, dtype=torch.float32, device="cpu")
    eager_cache = model.make_cache(layout, batch_size=3, dtype=torch.float32, device="cpu")
    pointer = compiled_cache[0].keys.data_ptr()
    counter = GraphCounter()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    counts = []
    try:
        for batch in (3, 2, 1, 3, 2, 1):
            text = torch.randn(batch, 7, 16, generator=torch.Generator().manual_seed(batch))
            for cache in (compiled_cache, eager_cache):
                cache.reset()
                model.prepare_conditioning(cache, text)
            for _chunk in range(4):
                noisy, timestep = torch.randn(batch, 4, 1, 4, 4), torch.full((batch,), 500.0)
                for tensor in (noisy, timestep, text):
                    torch._dynamo.maybe_mark_dynamic(tensor, 0)
                got = compiled(noisy, timestep, text, kv_cache=compiled_cache, layout=layout).sample
                expected = model(noisy, timestep, text, kv_cache=eager_cache, layout=layout).sample
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
                compiled_cache.commit()
                eager_cache.commit()
            counts.append(len(counter.graphs))
    finally:
        torch._dynamo.reset()
    assert counts[2] == counts[-1] <= 6, counts  # the second round of batches compiled nothing
    assert compiled_cache[0].keys.data_ptr() == pointer

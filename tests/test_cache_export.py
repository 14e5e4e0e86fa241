"""Specification of export and state: the cache is the exported program's mutable state.

A chunk step that holds the cache as a submodule exports (`export_chunk`) with every cache tensor as
a BUFFER input mutated in place; running the exported program chunk after chunk equals eager exactly.
Layers are `nn.Module`s: `state_dict()` saves with safetensors and loads into a fresh cache that then
continues the stream identically.
"""

import copy
import json

import pytest
import torch
from cache_helpers import sdpa
from safetensors.torch import load_file, save_file
from tiny_components import tiny_transformer
from torch import nn

from rolldiff.caching import RollingKVCache, SlidingWindowLayer, merge_extra_state, split_extra_state
from rolldiff.caching.export import export_chunk, sync_host_counters
from rolldiff.models import ChunkLayout


class ToyChunk(nn.Module):
    """Two denoising steps through a two-block cached attention stack, then commit: one chunk."""

    def __init__(self, cache: RollingKVCache):
        super().__init__()
        self.cache = cache
        self.project = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, tokens, heads, 8)
        for _step in range(2):
            hidden = x
            for layer in self.cache:
                query, key, value = self.project(hidden).chunk(3, dim=-1)
                hidden = hidden + sdpa(query, *layer.update(key, value), layer.attention_mask)
            x = 0.5 * (x + hidden)
        self.cache.commit()
        return x


def toy_cache(quantization=None) -> RollingKVCache:
    cache = RollingKVCache([SlidingWindowLayer(2, 6, 2, quantization=quantization) for _ in range(2)])
    cache.early_initialization(1, 2, 8, torch.float32, "cpu")
    return cache


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_exported_chunks_carry_the_cache_like_eager(quantization):
    torch.manual_seed(0)
    step = ToyChunk(toy_cache(quantization))
    eager = copy.deepcopy(step)
    program = export_chunk(step, (torch.randn(1, 2, 2, 8),))
    buffers = set(program.graph_signature.buffers)
    for i in range(2):
        names = ("storage.keys", "storage.values", "slot_positions", "committed_tokens")
        assert {f"cache.layers.{i}.{name}" for name in names} <= buffers
    if quantization is None:  # the functional form names the mutated buffers (torch 2.13 cannot decompose the
        # in-place writes into the quantized layers' shared workspace views; the program itself runs, below)
        mutated = set(program.run_decompositions().graph_signature.buffers_to_mutate.values())
        assert {"cache.layers.0.storage.keys", "cache.layers.1.committed_tokens"} <= mutated
    assert step.cache[0]._committed_count == 0 and step.cache[0].pending_tokens == 0  # the trace left no trace
    run = program.module()
    for chunk in range(7):  # past warm-up: the ring wraps
        x = torch.randn(1, 2, 2, 8)
        assert torch.equal(run(x), eager(x)), chunk
    sync_host_counters(step)
    assert [layer.get_seq_length() for layer in step.cache] == [layer.get_seq_length() for layer in eager.cache]
    assert all(map(torch.equal, step.cache[1].get(), eager.cache[1].get()))


def test_export_needs_an_allocated_cache():
    step = ToyChunk(RollingKVCache([SlidingWindowLayer(2, 6, 2) for _ in range(2)]))
    with pytest.raises(RuntimeError, match="early_initialization"):
        export_chunk(step, (torch.randn(1, 2, 2, 8),))
    with pytest.raises(ValueError, match="no cache layer"):
        export_chunk(nn.Linear(2, 2), (torch.randn(1, 2),))


def test_state_dict_saves_with_safetensors_and_resumes_the_stream(tmp_path):
    torch.manual_seed(0)
    step = ToyChunk(toy_cache("int8"))
    for _ in range(4):
        step(torch.randn(1, 2, 2, 8))
    state = step.cache.state_dict()
    assert "layers.0.storage.keys" in state and "layers.0.storage.key_scales" in state
    assert not any("workspace" in k for k in state)
    tensors, extras = split_extra_state(state)
    save_file(tensors, tmp_path / "cache.safetensors")
    resumed = ToyChunk(toy_cache("int8"))
    resumed.project.load_state_dict(step.project.state_dict())
    resumed.cache.load_state_dict(
        merge_extra_state(load_file(tmp_path / "cache.safetensors"), json.loads(json.dumps(extras)))
    )
    for _ in range(3):
        x = torch.randn(1, 2, 2, 8)
        assert torch.equal(resumed(x), step(x))


@torch.no_grad()
def test_exported_model_chunk_equals_eager():
    """The Krea-like model: two denoising steps + the context pass + commit, exported once, run for 5 chunks."""

    class ModelChunk(nn.Module):
        def __init__(self, model, cache, layout):
            super().__init__()
            self.model, self.cache, self.layout = model, cache, layout

        def forward(self, noisy, clean, text):
            outputs = []
            for sigma in (0.8, 0.4):
                timestep = torch.full((noisy.shape[0],), sigma * 1000.0)
                outputs.append(self.model(noisy, timestep, text, kv_cache=self.cache, layout=self.layout).sample)
            self.model(clean, torch.zeros(noisy.shape[0]), text, kv_cache=self.cache, layout=self.layout)
            self.cache.commit()
            return torch.stack(outputs)

    torch.manual_seed(0)
    model = tiny_transformer()
    layout = ChunkLayout(4, chunk_frames=2, sink_frames=2, window_frames=4, position_mode="relative")
    text = torch.randn(1, 7, 16)
    caches = [model.make_cache(layout, batch_size=1, dtype=torch.float32, device="cpu") for _ in range(2)]
    for cache in caches:
        model.prepare_conditioning(cache, text)  # the program reads the text K/V from the cache
    step, eager = ModelChunk(model, caches[0], layout), ModelChunk(model, caches[1], layout)
    run = export_chunk(step, (torch.randn(1, 4, 2, 4, 4), torch.randn(1, 4, 2, 4, 4), text)).module()
    for chunk in range(5):
        noisy, clean = torch.randn(2, 1, 4, 2, 4, 4).unbind(0)
        # fp32 rounding, not bitwise: buffer alignment (which MKL rounds with) follows the allocator's
        # history, and after some other tests (e.g. the attention-backend one) one value differs by 5e-7. A
        # program reading a stale or wrong cache slot would differ at O(1).
        torch.testing.assert_close(
            run(noisy, clean, text), eager(noisy, clean, text), rtol=1e-5, atol=1e-6, msg=str(chunk)
        )


@torch.no_grad()
def test_a_saved_model_cache_resumes_the_stream(tmp_path):
    """docs/cache.md's recipe: save with safetensors, load into a fresh cache, refill the text K/V, continue."""
    model = tiny_transformer()
    layout = ChunkLayout(4, chunk_frames=2, sink_frames=2, window_frames=4, position_mode="relative")
    text = torch.randn(1, 7, 16, generator=torch.Generator().manual_seed(1))
    cache = model.make_cache(layout, batch_size=1, dtype=torch.float32, device="cpu")
    generator = torch.Generator().manual_seed(2)

    def chunk(kv_cache, latents):
        out = model(latents, torch.tensor([500.0]), text, kv_cache=kv_cache, layout=layout).sample
        model(latents, torch.tensor([0.0]), text, kv_cache=kv_cache, layout=layout)
        kv_cache.commit()
        return out

    for _ in range(4):
        chunk(cache, torch.randn(1, 4, 2, 4, 4, generator=generator))
    tensors, extras = split_extra_state(cache.state_dict())
    assert not any(key.startswith("_cross_modules") for key in [*tensors, *extras])  # recomputed from the text
    save_file(tensors, tmp_path / "cache.safetensors")
    fresh = model.make_cache(layout, batch_size=1, dtype=torch.float32, device="cpu")
    fresh.load_state_dict(merge_extra_state(load_file(tmp_path / "cache.safetensors"), extras))
    assert not any(layer.is_filled for layer in fresh.cross)  # the next step refills them from the text
    assert [layer.get_seq_length() for layer in fresh] == [layer.get_seq_length() for layer in cache]
    for _ in range(2):
        latents = torch.randn(1, 4, 2, 4, 4, generator=generator)
        assert torch.equal(chunk(fresh, latents), chunk(cache, latents))


def test_to_moves_and_casts_the_whole_cache():
    cache = toy_cache()
    layer = cache[0]
    layer.update(*torch.randn(2, 1, 2, 2, 8).unbind(0))
    layer.commit()
    cache.to(torch.float64)
    assert layer.keys.dtype == torch.float64 and layer.committed_tokens.dtype == torch.long
    keys, _ = layer.update(*torch.randn(2, 1, 2, 2, 8, dtype=torch.float64).unbind(0))
    assert keys.dtype == torch.float64 and layer.get_seq_length() == 2
    with pytest.raises(TypeError, match="float32 but the cache holds torch.float64"):
        layer.update(*torch.randn(2, 1, 2, 2, 8).unbind(0))

"""Specification of the other layer kinds (cross-attention, static, linear attention) and of `RollingKVCache`."""

import pytest
import torch

from rolldiff.caching import (
    CrossAttentionLayer,
    LinearAttentionLayer,
    RollingKVCache,
    SlidingWindowLayer,
    StaticLayer,
    chunk_state,
)


def kv(tokens: int = 2, batch: int = 1, heads: int = 2, head_dim: int = 4, generator=None) -> tuple[torch.Tensor, ...]:
    key = torch.randn(batch, tokens, heads, head_dim, generator=generator)  # (B, T, H, D)
    return key, torch.randn(key.shape, generator=generator)


def scalar_chunk(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).view(1, len(values), 1, 1)  # (B, T, H, D)


# CrossAttentionLayer


def cross_attention_kv(layer: CrossAttentionLayer, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a model's cross-attention does: project the prompt only when the layer is not cached for it."""
    if not layer.is_cached_for(prompt):
        layer.update(prompt * 2, prompt * 3, conditioning=prompt)
    return layer.keys, layer.values  # attention reads the live buffers while `is_filled`; get() is a copy


def prompt_embeds(tokens: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, tokens, 2, 4, generator=torch.Generator().manual_seed(seed))  # (B, T, H, D)


def test_cross_attention_is_computed_once_per_prompt():
    layer = CrossAttentionLayer()
    prompt = prompt_embeds()
    assert not layer.is_cached_for(prompt) and layer.get() is None
    for _chunk in range(5):
        for _step in range(4):
            keys, values = cross_attention_kv(layer, prompt)
            assert torch.equal(keys, prompt * 2) and torch.equal(values, prompt * 3)
        layer.commit()  # a no-op: cross-attention has nothing pending
    assert layer.num_computations == 1
    assert layer.is_cached_for(prompt)


def test_cross_attention_replaces_and_never_appends():
    layer = CrossAttentionLayer()
    prompt = prompt_embeds()
    first_keys, _ = layer.update(*kv(tokens=3), conditioning=prompt)
    pointer = first_keys.data_ptr()
    for _ in range(4):
        keys, values = layer.update(*kv(tokens=3), conditioning=prompt)
        assert keys.shape == values.shape == (1, 3, 2, 4)
        assert keys.data_ptr() == pointer  # same shape: the buffers are reused
    assert layer.get_seq_length() == 3 and layer.num_computations == 5


def test_cross_attention_stores_a_copy():
    layer = CrossAttentionLayer()
    key, value = kv(tokens=3)
    layer.update(key, value, conditioning=prompt_embeds())
    expected = key.clone()
    key.fill_(0)
    assert torch.equal(layer.get()[0], expected)


def test_cross_attention_new_prompt_invalidates():
    layer = CrossAttentionLayer()
    prompt, other = prompt_embeds(seed=0), prompt_embeds(seed=1)
    cross_attention_kv(layer, prompt)
    assert not layer.is_cached_for(other)
    keys, _ = cross_attention_kv(layer, other)
    assert torch.equal(keys, other * 2) and layer.num_computations == 2
    assert not layer.is_cached_for(prompt) and layer.is_cached_for(other)


def test_cross_attention_identical_values_in_a_new_tensor_count_as_a_new_prompt():
    layer = CrossAttentionLayer()
    prompt = prompt_embeds()
    cross_attention_kv(layer, prompt)
    assert not layer.is_cached_for(prompt.clone())


def test_cross_attention_in_place_modified_prompt_invalidates():
    layer = CrossAttentionLayer()
    prompt = prompt_embeds()
    cross_attention_kv(layer, prompt)
    prompt.add_(1.0)
    assert not layer.is_cached_for(prompt)
    keys, _ = cross_attention_kv(layer, prompt)
    assert torch.equal(keys, prompt * 2) and layer.num_computations == 2


def test_cross_attention_prompt_of_another_length_replaces():
    layer = CrossAttentionLayer()
    cross_attention_kv(layer, prompt_embeds(tokens=3))
    keys, _ = cross_attention_kv(layer, prompt_embeds(tokens=5))
    assert keys.shape == (1, 5, 2, 4) and layer.get_seq_length() == 5


def test_cross_attention_reset_forgets_but_keeps_buffers():
    layer = CrossAttentionLayer()
    prompt = prompt_embeds()
    keys, values = cross_attention_kv(layer, prompt)
    pointers = (keys.data_ptr(), values.data_ptr())
    layer.reset()
    assert layer.get() is None and layer.get_seq_length() == 0
    assert not layer.is_cached_for(prompt)
    assert (layer.keys.data_ptr(), layer.values.data_ptr()) == pointers
    keys, values = cross_attention_kv(layer, prompt)
    assert (keys.data_ptr(), values.data_ptr()) == pointers
    assert layer.num_computations == 2


# StaticLayer


def test_static_conditions_then_each_step_reads_conditions_and_current():
    layer = StaticLayer(max_tokens=5)
    keys, _ = layer.update(scalar_chunk(1, 2), -scalar_chunk(1, 2))  # the reference image, at t = 0
    assert keys[0, :, 0, 0].tolist() == [1, 2]
    layer.commit()
    assert layer.get()[0][0, :, 0, 0].tolist() == [1, 2] and layer.get_seq_length() == 2
    pointers = (layer.keys.data_ptr(), layer.values.data_ptr())
    for step in range(4):
        current = scalar_chunk(10 * step, 10 * step + 1, 10 * step + 2)
        keys, values = layer.update(current, -current)
        assert keys[0, :, 0, 0].tolist() == [1, 2, 10 * step, 10 * step + 1, 10 * step + 2]
        assert torch.equal(values, -keys)
        # a view of the buffer, not a concatenation
        assert (keys.data_ptr(), values.data_ptr()) == pointers
        assert keys._base is layer.keys and values._base is layer.values
    assert layer.get()[0][0, :, 0, 0].tolist() == [1, 2] and layer.condition_tokens == 2
    assert (layer.keys.data_ptr(), layer.values.data_ptr()) == pointers


def test_static_several_references_append():
    layer = StaticLayer(max_tokens=8)
    for reference in ([1, 2], [3], [4, 5]):
        layer.update(scalar_chunk(*reference), scalar_chunk(*reference))
        layer.commit()
    assert layer.get()[0][0, :, 0, 0].tolist() == [1, 2, 3, 4, 5]
    keys, _ = layer.update(scalar_chunk(9, 9, 9), scalar_chunk(9, 9, 9))
    assert keys[0, :, 0, 0].tolist() == [1, 2, 3, 4, 5, 9, 9, 9]


def test_static_without_conditions_reads_current_only():
    layer = StaticLayer(max_tokens=4)
    keys, _ = layer.update(scalar_chunk(7, 8), scalar_chunk(7, 8))
    assert keys[0, :, 0, 0].tolist() == [7, 8] and layer.get() is None


def test_static_overflow_raises():
    layer = StaticLayer(max_tokens=4)
    layer.update(scalar_chunk(1, 2, 3), scalar_chunk(1, 2, 3))
    layer.commit()
    with pytest.raises(ValueError, match="max_tokens"):
        layer.update(scalar_chunk(4, 5), scalar_chunk(4, 5))
    keys, _ = layer.update(scalar_chunk(4), scalar_chunk(4))
    assert keys[0, :, 0, 0].tolist() == [1, 2, 3, 4]


def test_static_reset_keeps_buffers():
    layer = StaticLayer(max_tokens=4)
    layer.update(scalar_chunk(1, 2), scalar_chunk(1, 2))
    layer.commit()
    pointers = (layer.keys.data_ptr(), layer.values.data_ptr())
    layer.reset()
    assert layer.get() is None and layer.get_seq_length() == 0
    assert (layer.keys.data_ptr(), layer.values.data_ptr()) == pointers
    assert layer.keys.abs().sum() == 0


# LinearAttentionLayer


def reference_state(chunks, pending) -> tuple[torch.Tensor, torch.Tensor]:
    """From scratch: each chunk's `(v k^T, sum k)` in fp32, summed oldest first, then the pending chunk."""
    batch, _, heads, head_dim = pending[0].shape
    vk = torch.zeros(batch, heads, head_dim, head_dim)
    k_sum = torch.zeros(batch, heads, 1, head_dim)
    for key, value, normalizer_key in [*chunks, pending]:
        vk = vk + torch.einsum("bthd,bthe->bhde", value.float(), key.float())  # (B, H, D_v, D_k)
        k_sum = k_sum + normalizer_key.float().sum(dim=1).unsqueeze(2)  # (B, H, 1, D_k)
    return vk, k_sum


@pytest.mark.parametrize("window_chunks", [None, 3])
@pytest.mark.parametrize("separate_normalizer", [False, True])
def test_linear_attention_equals_recomputation_from_scratch(window_chunks, separate_normalizer):
    layer = LinearAttentionLayer(window_chunks=window_chunks)
    generator = torch.Generator().manual_seed(0)
    committed = []
    for _ in range(10):
        for _step in range(3):  # denoising steps: each replaces the pending chunk
            key, value = (t.relu() for t in kv(tokens=5, heads=2, head_dim=4, generator=generator))
            normalizer_key = key.roll(1, dims=-1) if separate_normalizer else key  # e.g. k before RoPE
            vk, k_sum = layer.update(key, value, key_for_normalizer=normalizer_key if separate_normalizer else None)
            assert vk.dtype == k_sum.dtype == torch.float32
            held = committed if window_chunks is None else committed[max(0, len(committed) - window_chunks) :]
            expected_vk, expected_k_sum = reference_state(held, (key, value, normalizer_key))
            assert torch.equal(vk, expected_vk) and torch.equal(k_sum, expected_k_sum)
        layer.commit()
        committed.append((key, value, normalizer_key))
        held = committed if window_chunks is None else committed[-window_chunks:]
        assert layer.held_chunks == len(held)
        assert layer.get_seq_length() == sum(k.shape[1] for k, _, _ in held)  # tokens summarised
    # and it is the right math: one einsum over every held token
    keys, values, normalizer_keys = (torch.cat(parts, dim=1) for parts in zip(*held))
    vk, k_sum = layer.get()
    torch.testing.assert_close(vk, torch.einsum("bthd,bthe->bhde", values, keys))
    torch.testing.assert_close(k_sum, normalizer_keys.sum(dim=1, keepdim=True).transpose(1, 2))


def test_linear_attention_chunk_state():
    key, value = (t.relu() for t in kv(tokens=3))
    vk, k_sum = chunk_state(key.half(), value.half())
    assert vk.shape == (1, 2, 4, 4) and k_sum.shape == (1, 2, 1, 4)
    assert vk.dtype == k_sum.dtype == torch.float32
    torch.testing.assert_close(vk[0, 1], value.half().float()[0, :, 1].T @ key.half().float()[0, :, 1])


def test_linear_attention_pending_chunk_is_not_committed():
    layer = LinearAttentionLayer()
    assert layer.get() is None
    layer.update(*kv())
    assert layer.get() is None  # an exception here would leave nothing behind
    layer.commit()
    vk, k_sum = (t.clone() for t in layer.get())
    layer.update(*kv())
    layer.update(*kv())
    assert torch.equal(layer.get()[0], vk) and torch.equal(layer.get()[1], k_sum)


def test_linear_attention_tail_is_kept_on_commit_only():
    layer = LinearAttentionLayer()
    first, second = torch.ones(1, 4, 1), torch.full((1, 4, 1), 2.0)
    layer.update(*kv())
    layer.update_tail(first)
    assert layer.tail is None
    layer.commit()
    assert torch.equal(layer.tail, first)
    layer.update(*kv())
    layer.update_tail(second)
    assert torch.equal(layer.tail, first)  # the aborted/uncommitted chunk's tail is not visible yet
    layer.commit()
    assert torch.equal(layer.tail, second)


def test_linear_attention_reset_leaves_the_callers_tail_alone():
    layer = LinearAttentionLayer()
    last_frame = torch.ones(1, 4, 1)  # a view of the model's activations, owned by the caller
    layer.update(*kv())
    layer.update_tail(last_frame)
    layer.commit()
    layer.reset()
    assert layer.tail is None and torch.equal(last_frame, torch.ones(1, 4, 1))


def test_linear_attention_reset_keeps_buffers():
    layer = LinearAttentionLayer(window_chunks=2)
    for _ in range(3):
        layer.update(*kv())
        layer.commit()
    pointers = [t.data_ptr() for t in (layer.committed_vk, layer.committed_k_sum, layer.chunk_vk)]
    layer.reset()
    assert layer.get() is None and layer.get_seq_length() == 0 and layer.tail is None
    assert [t.data_ptr() for t in (layer.committed_vk, layer.committed_k_sum, layer.chunk_vk)] == pointers
    assert layer.committed_vk.abs().sum() == 0


# RollingKVCache


def make_cache(blocks: int = 3, with_cross: bool = True) -> RollingKVCache:
    layers = [SlidingWindowLayer(sink_tokens=2, window_tokens=4, chunk_tokens=2) for _ in range(blocks)]
    cross = [CrossAttentionLayer() for _ in range(blocks)] if with_cross else None
    return RollingKVCache(layers, cross)


def run_chunk(cache: RollingKVCache, blocks=None) -> None:
    for i in range(len(cache)) if blocks is None else blocks:
        cache[i].update(*kv())


def test_container_indexing_and_length():
    layers = [SlidingWindowLayer(2, 4), LinearAttentionLayer(), StaticLayer(8)]
    cross = [CrossAttentionLayer(), None, CrossAttentionLayer()]
    cache = RollingKVCache(layers, cross)
    assert len(cache) == 3 and list(cache) == layers
    assert all(cache[i] is layers[i] and cache.cross[i] is cross[i] for i in range(3))
    assert RollingKVCache(layers).cross == [None, None, None]


def test_container_commit_fans_out():
    cache = make_cache()
    for chunk in range(1, 4):
        run_chunk(cache)
        assert cache.has_pending
        cache.commit()
        assert not cache.has_pending
        assert [layer.committed_tokens.item() for layer in cache] == [2 * chunk] * 3


def test_container_commit_with_a_layer_not_updated_changes_nothing():
    cache = make_cache()
    run_chunk(cache)
    cache.commit()
    run_chunk(cache, blocks=[0, 2])  # block 1 was skipped (or raised)
    with pytest.raises(RuntimeError, match=r"\[1\]"):
        cache.commit()
    assert [layer.committed_tokens.item() for layer in cache] == [2, 2, 2]
    assert [layer.pending_tokens for layer in cache] == [2, 0, 2]
    with pytest.raises(RuntimeError, match="nothing pending"):
        make_cache().commit()


def test_container_seq_length_is_the_maximum():
    layers = [SlidingWindowLayer(1, 2, 1), SlidingWindowLayer(1, 6, 1), LinearAttentionLayer(window_chunks=2)]
    cache = RollingKVCache(layers)
    assert cache.get_seq_length() == 0
    for _ in range(5):
        for layer in cache:
            layer.update(*kv(tokens=1))
        cache.commit()
    # 5 tokens committed; a layer holds sink + min(4, window - chunk) of them; the linear layer its last 2 chunks
    assert [cache.get_seq_length(i) for i in range(3)] == [2, 5, 2]
    assert cache.get_seq_length() == 5


def test_container_memory_bytes_is_the_sum_of_buffers():
    cache = make_cache()
    cache.early_initialization(1, 2, 4, torch.float32, "cpu")
    run_chunk(cache)
    for cross in cache.cross:
        cross.update(*kv(tokens=7))
    expected = sum(layer.keys.nbytes + layer.values.nbytes + layer.slot_positions.nbytes for layer in cache) + sum(
        layer.keys.nbytes + layer.values.nbytes for layer in cache.cross
    )
    assert cache.memory_bytes() == expected
    assert cache[0].keys.nbytes == 1 * 6 * 2 * 4 * 4  # (batch, sink + window, heads, head_dim) fp32


def test_container_reset_keeps_pointers():
    cache = make_cache()
    run_chunk(cache)
    cache.commit()
    for cross in cache.cross:
        cross.update(*kv(tokens=3))
    tensors = [*cache, *cache.cross]
    pointers = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in tensors]
    cache.reset()
    assert [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in tensors] == pointers
    assert cache.get_seq_length() == 0 and all(layer.get() is None for layer in tensors)


def test_container_reset_cross_attention_keeps_self_attention():
    cache = make_cache()
    prompt = prompt_embeds()
    run_chunk(cache)
    cache.commit()
    for cross in cache.cross:
        cross.update(*kv(tokens=3), conditioning=prompt)
    cache.reset_cross_attention()
    assert all(not cross.is_cached_for(prompt) for cross in cache.cross)
    assert cache.get_seq_length() == 2 and all(layer.get() is not None for layer in cache)


def test_container_early_initialization_allocates():
    cache = RollingKVCache(
        [SlidingWindowLayer(2, 4, 2), LinearAttentionLayer(window_chunks=2), StaticLayer(8)],
        [CrossAttentionLayer(), None, None],
    )
    assert cache.memory_bytes() == 0
    cache.early_initialization(2, 3, 4, torch.float16, "cpu")
    assert cache[0].keys.shape == (2, 6, 3, 4) and cache[0].keys.dtype == torch.float16
    assert cache[1].committed_vk.shape == (2, 3, 4, 4) and cache[1].committed_vk.dtype == torch.float32
    assert cache[2].keys.shape == (2, 8, 3, 4)
    assert cache.memory_bytes() > 0
    pointer = cache[0].keys.data_ptr()
    cache[0].update(*(t.half() for t in kv(tokens=2, batch=2, heads=3)))
    assert cache[0].keys.data_ptr() == pointer

"""Specification of per-layer lengths: layers of one cache hold different windows, or are cropped
differently; `get_seq_length()` is the maximum over layers and each layer's mask is its own.

A two-block attention stack run chunk by chunk through the cache equals the same stack on the whole
sequence with each block's dense mask (sink + its own window, minus the tokens cropped from it).
"""

import pytest
import torch
from cache_helpers import sdpa
from torch import nn

from rolldiff.caching import RollingKVCache, SlidingWindowLayer
from rolldiff.caching.layout import window_start

SINK, CHUNK, WINDOWS = 2, 2, (4, 8)  # tokens; block 0 is local, block 1 sees twice as far


class Stack(nn.Module):
    """Blocks of single-head attention with residuals: `(batch, tokens, 1, 8)` in and out."""

    def __init__(self, blocks: int = 2):
        super().__init__()
        self.projections = nn.ModuleList(nn.Linear(8, 24) for _ in range(blocks))

    def cached(self, x: torch.Tensor, cache: RollingKVCache) -> torch.Tensor:
        for projection, layer in zip(self.projections, cache):
            query, key, value = projection(x).chunk(3, dim=-1)
            x = x + sdpa(query, *layer.update(key, value), layer.attention_mask)
        return x

    def dense(self, x: torch.Tensor, masks: list[torch.Tensor]) -> torch.Tensor:
        for projection, mask in zip(self.projections, masks):
            query, key, value = projection(x).chunk(3, dim=-1)
            x = x + sdpa(query, key, value, mask)
        return x


def dense_mask(tokens: int, window: int, evicted: dict[int, set[int]]) -> torch.Tensor:
    """`(tokens, tokens)` bool: a chunk sees the sink, its window of committed tokens and itself.

    `evicted[c]`: positions cropped from this block before chunk `c` (hidden from that chunk on).
    """
    mask = torch.zeros(tokens, tokens, dtype=torch.bool)
    for start in range(0, tokens, CHUNK):
        gone = set().union(*(positions for chunk, positions in evicted.items() if chunk <= start // CHUNK))
        visible = [*range(min(SINK, start)), *range(window_start(start, SINK, window, CHUNK), start)]
        rows = slice(start, start + CHUNK)
        mask[rows, [p for p in visible if p not in gone]] = True
        mask[rows, rows] = True
    return mask


@torch.no_grad()
def run(crop_block: int | None = None, crop_before_chunk: int = 4, crop_to: int = 3):
    torch.manual_seed(0)
    stack, chunks = Stack(), 8
    cache = RollingKVCache([SlidingWindowLayer(SINK, window, CHUNK) for window in WINDOWS])
    sequence = torch.randn(1, chunks * CHUNK, 1, 8)
    evicted: list[dict[int, set[int]]] = [{}, {}]
    outputs = []
    for chunk in range(chunks):
        if chunk == crop_before_chunk and crop_block is not None:
            evicted[crop_block][chunk] = set(cache[crop_block].check_crop(crop_to))
            cache[crop_block].crop(crop_to)
            assert cache[crop_block].get_seq_length() == crop_to
        outputs.append(stack.cached(sequence[:, chunk * CHUNK : (chunk + 1) * CHUNK], cache))
        cache.commit()
        lengths = [layer.get_seq_length() for layer in cache]
        assert cache.get_seq_length() == max(lengths)
    masks = [dense_mask(chunks * CHUNK, window, evicted[i]) for i, window in enumerate(WINDOWS)]
    return torch.cat(outputs, dim=1), stack.dense(sequence, masks), cache, evicted


def test_blocks_with_different_windows_match_the_dense_reference():
    cached, dense, cache, _ = run()
    torch.testing.assert_close(cached, dense, atol=1e-6, rtol=0)
    assert [layer.get_seq_length() for layer in cache] == [SINK + 4 - CHUNK, SINK + 8 - CHUNK]
    assert cache.get_seq_length() == SINK + 8 - CHUNK
    assert cache[0].attention_mask.sum() < cache[1].attention_mask.sum()  # each block its own mask


def test_cropping_one_block_matches_the_dense_reference_with_its_tokens_evicted():
    cached, dense, cache, evicted = run(crop_block=1)
    assert evicted[1][4] == {2, 3, 4, 5, 6}  # 8 held -> 3: the 5 oldest window tokens go, the sink stays
    torch.testing.assert_close(cached, dense, atol=1e-6, rtol=0)
    uncropped, *_ = run()
    assert not torch.allclose(cached, uncropped)  # the crop changed what block 1 saw
    assert cache[0]._committed_count == cache[1]._committed_count  # the stream position is shared


def test_crop_refuses_below_the_sink_and_with_a_chunk_pending():
    layer = SlidingWindowLayer(SINK, 8, CHUNK)
    for _ in range(3):
        layer.update(*torch.randn(2, 1, CHUNK, 1, 4).unbind(0))
        layer.commit()
    with pytest.raises(ValueError, match="`max_tokens`=1 is below the 2 sink tokens"):
        layer.crop(1)
    layer.update(*torch.randn(2, 1, CHUNK, 1, 4).unbind(0))
    with pytest.raises(RuntimeError, match="pending"):
        layer.crop(3)
    assert layer.get_seq_length() == 6

"""`commit(num_tokens)`: the first tokens of a pending write made permanent, the rest dropped (pipelined denoising
under `context_policy="last_step"` commits the leaving chunk of a window's forward).

The spec: a layer that wrote `w` tokens and committed the first `n` holds what a layer that wrote only those `n`
and committed them holds. Random walks over updates of random size, aborted updates and partial commits compare
every attention output of the two, in plain, int8 and offloaded storage, long enough to wrap the ring 3 times.
"""

from __future__ import annotations

import random

import pytest
import torch
from cache_helpers import attend

from rolldiff.caching import (
    AdaptiveSinkLayer,
    AdaptiveSinkPolicy,
    LinearAttentionLayer,
    RollingKVCache,
    SlidingWindowLayer,
)

SINK, WINDOW, PENDING = 2, 14, 6  # the pending region: 3 chunks of 2 tokens in flight


def _kv(tokens: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    query = torch.randn(1, tokens, 2, 4, generator=generator)
    return query, torch.randn(1, tokens, 2, 4, generator=generator), torch.randn(1, tokens, 2, 4, generator=generator)


OPTIONS = {
    "plain": {},
    "int8": dict(quantization="int8"),
    "offload": dict(offload=True),
    "rolling_sink": dict(sink_mode="rolling", frame_tokens=1),  # the roll follows the committed tokens alone
    "elastic_window": dict(elastic_window=True, frame_tokens=1),  # Rolling Forcing's view: a ring of 19 slots
}


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_partial_commit_holds_what_writing_only_those_tokens_holds(options, seed):
    rng, generator = random.Random(seed), torch.Generator().manual_seed(seed)
    partial = SlidingWindowLayer(SINK, WINDOW, PENDING, **options)
    only_those = SlidingWindowLayer(SINK, WINDOW, PENDING, **options)
    committed = 0
    while committed < SINK + 3 * WINDOW:
        written = rng.randint(1, PENDING)
        query, key, value = _kv(written, generator)
        torch.testing.assert_close(attend(partial, query, key, value), attend(only_those, query, key, value))
        if rng.random() < 0.2:
            continue  # an aborted write: the next one overwrites it
        kept = rng.randint(1, written)
        partial.commit(kept)
        only_those.update(key[:, :kept], value[:, :kept])
        only_those.commit()
        committed += kept
        assert partial.committed_count == only_those.committed_count == committed
        assert partial.window_full == only_those.window_full


def test_bad_partial_commits_are_refused_before_anything_changes():
    layer = SlidingWindowLayer(SINK, WINDOW, PENDING)
    key = torch.randn(1, 4, 2, 4)
    layer.update(key, key)
    for bad in (0, 5, 2.0, True):
        with pytest.raises(ValueError, match=r"`num_tokens` must be an int from 1 to the 4 pending tokens"):
            layer.commit(bad)
    assert layer.pending_tokens == 4 and layer.committed_count == 0
    layer.commit(3)
    assert layer.committed_count == 3 and layer.pending_tokens == 0
    with pytest.raises(RuntimeError, match="nothing pending"):
        layer.commit(1)


def test_layers_that_commit_whole_chunks_say_so():
    adaptive = AdaptiveSinkLayer(1, 3, 1, frame_tokens=1, policy=AdaptiveSinkPolicy())
    cache = RollingKVCache([SlidingWindowLayer(SINK, WINDOW, PENDING), adaptive])
    for layer in cache:
        layer.update(torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4))
    with pytest.raises(TypeError, match="AdaptiveSinkLayer commits whole chunks"):
        cache.commit(1)
    assert cache[0].pending_tokens == 1  # checked before any layer changed
    linear = RollingKVCache([LinearAttentionLayer()])
    linear[0].update(torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4))
    with pytest.raises(TypeError, match=r"commit\(num_tokens\) needs layers that commit part of a chunk"):
        linear.commit(1)


def test_the_container_commits_the_first_tokens_of_every_layer():
    cache = RollingKVCache([SlidingWindowLayer(SINK, WINDOW, PENDING) for _ in range(3)])
    for layer in cache:
        layer.update(torch.randn(1, 6, 2, 4), torch.randn(1, 6, 2, 4))
    with pytest.raises(ValueError, match="pending tokens"):
        cache.commit(7)
    assert all(layer.pending_tokens == 6 for layer in cache)
    cache.commit(2)
    assert [layer.committed_count for layer in cache] == [2, 2, 2]
    assert cache.get_seq_length() == 2

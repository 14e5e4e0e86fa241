"""Shared helpers of the cache feature tests: attention over a cache layer, and an allocation counter."""

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask=None) -> torch.Tensor:
    """SDPA on `(batch, tokens, heads, head_dim)` tensors; `mask` is `(key_tokens,)` or `(query, key)` bool."""
    attn_mask = None if mask is None else mask[None] if mask.ndim == 1 else mask
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=attn_mask
    )
    return out.transpose(1, 2)  # (B, T, H, D)


def attend(layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """One cached attention step: write the chunk, attend over the whole buffer through the layer's mask."""
    keys, values = layer.update(key, value)
    return sdpa(query, keys, values, layer.attention_mask)


class NewStorageCounter(TorchDispatchMode):
    """Records every ATen op whose output lives in a storage none of its inputs owns (an allocation)."""

    def __init__(self):
        super().__init__()
        self.allocations: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = tree_flatten((args, kwargs))[0]
        owned = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in owned:
                self.allocations.append((str(func), tensor.untyped_storage().nbytes()))
        return out


class GraphCounter:
    """A `torch.compile` backend that runs the graph eagerly and counts the graphs it was given."""

    def __init__(self):
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs.append(gm)
        return gm.forward


def with_options(cache, **options):
    """A cache like `cache` (same per-block windows, fresh layers) whose self-attention layers take `options`."""
    from rolldiff.caching import CrossAttentionLayer, RollingKVCache, SlidingWindowLayer

    layers = [SlidingWindowLayer(lay.sink_tokens, lay.window_tokens, lay.chunk_tokens, **options) for lay in cache]
    cross = [None if lay is None else CrossAttentionLayer() for lay in cache.cross]
    return RollingKVCache(layers, cross)

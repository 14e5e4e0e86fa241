"""One cache API for every rolldiff model: layer kinds plus the `RollingKVCache` container."""

from .base import CacheLayer
from .condition import ConditionKVCache, ConditionLayer
from .container import RollingKVCache
from .conv_state import ConvStateLayer
from .cross_attention import CrossAttentionLayer
from .export import export_chunk, sync_host_counters
from .linear_attention import LinearAttentionLayer, chunk_state
from .sliding_window import SlidingWindowLayer
from .static import StaticLayer
from .workspace import CacheWorkspace

__all__ = [
    "CacheLayer",
    "CacheWorkspace",
    "ConvStateLayer",
    "ConditionKVCache",
    "ConditionLayer",
    "CrossAttentionLayer",
    "LinearAttentionLayer",
    "RollingKVCache",
    "SlidingWindowLayer",
    "StaticLayer",
    "chunk_state",
    "export_chunk",
    "sync_host_counters",
]

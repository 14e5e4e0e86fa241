"""One cache API for every rolldiff model: layer kinds plus the `RollingKVCache` container."""

from .adaptive_sink import AdaptiveSinkLayer, AdaptiveSinkPolicy
from .base import CacheLayer
from .condition import ConditionKVCache, ConditionLayer
from .container import RollingKVCache
from .conv_state import ConvStateLayer
from .cross_attention import CrossAttentionLayer
from .export import export_chunk, sync_host_counters
from .linear_attention import LinearAttentionLayer, RewindableLinearAttentionLayer, chunk_state
from .sliding_window import SlidingWindowLayer
from .state import merge_extra_state, split_extra_state
from .static import StaticLayer
from .workspace import CacheWorkspace

__all__ = [
    "AdaptiveSinkLayer",
    "AdaptiveSinkPolicy",
    "CacheLayer",
    "CacheWorkspace",
    "ConvStateLayer",
    "ConditionKVCache",
    "ConditionLayer",
    "CrossAttentionLayer",
    "LinearAttentionLayer",
    "RewindableLinearAttentionLayer",
    "RollingKVCache",
    "SlidingWindowLayer",
    "StaticLayer",
    "chunk_state",
    "export_chunk",
    "merge_extra_state",
    "split_extra_state",
    "sync_host_counters",
]

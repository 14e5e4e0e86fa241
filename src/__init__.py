"""rolldiff: long videos, chunk by chunk, with a rolling key/value cache.

Model and pipeline classes are importable from here, which is where saved pipelines'
`model_index.json` points (`["rolldiff", "KreaRealtimeTransformer3DModel"]`).
"""

from .caching import (
    CacheLayer,
    CrossAttentionLayer,
    LinearAttentionLayer,
    RollingKVCache,
    SlidingWindowLayer,
    StaticLayer,
)
from .models import ChunkLayout, KreaRealtimeTransformer3DModel
from .pipelines import KreaRealtimeVideoPipeline, KreaRealtimeVideoPipelineOutput

__version__ = "0.1.0"

__all__ = [
    "CacheLayer",
    "ChunkLayout",
    "CrossAttentionLayer",
    "KreaRealtimeTransformer3DModel",
    "KreaRealtimeVideoPipeline",
    "KreaRealtimeVideoPipelineOutput",
    "LinearAttentionLayer",
    "RollingKVCache",
    "SlidingWindowLayer",
    "StaticLayer",
]

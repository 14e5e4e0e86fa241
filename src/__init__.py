"""rolldiff: long videos, chunk by chunk, with a rolling key/value cache.

Model and pipeline classes are importable from here, which is where saved pipelines'
`model_index.json` points (`["rolldiff", "KreaRealtimeTransformer3DModel"]`).
"""

from .caching import (
    CacheLayer,
    ConditionKVCache,
    ConditionLayer,
    ConvStateLayer,
    CrossAttentionLayer,
    LinearAttentionLayer,
    RollingKVCache,
    SlidingWindowLayer,
    StaticLayer,
)
from .models import (
    ChunkLayout,
    GlmImageCachedTransformer2DModel,
    KreaRealtimeTransformer3DModel,
    LongSanaTransformer3DModel,
    TinyVideoAutoencoder,
)
from .pipelines import (
    ChunkStream,
    GlmImageCachedPipeline,
    KreaRealtimeVideoPipeline,
    KreaRealtimeVideoPipelineOutput,
    LongSanaVideoPipeline,
    LongSanaVideoPipelineOutput,
)

__version__ = "0.1.0"

__all__ = [
    "CacheLayer",
    "ChunkLayout",
    "ChunkStream",
    "ConditionKVCache",
    "ConditionLayer",
    "ConvStateLayer",
    "CrossAttentionLayer",
    "GlmImageCachedPipeline",
    "GlmImageCachedTransformer2DModel",
    "KreaRealtimeTransformer3DModel",
    "KreaRealtimeVideoPipeline",
    "KreaRealtimeVideoPipelineOutput",
    "LinearAttentionLayer",
    "LongSanaTransformer3DModel",
    "LongSanaVideoPipeline",
    "LongSanaVideoPipelineOutput",
    "RollingKVCache",
    "SlidingWindowLayer",
    "StaticLayer",
    "TinyVideoAutoencoder",
]

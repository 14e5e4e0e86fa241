"""rolldiff: long videos, chunk by chunk, with a rolling key/value cache."""

from .caching import (
    CacheLayer,
    CrossAttentionLayer,
    LinearAttentionLayer,
    RollingKVCache,
    SlidingWindowLayer,
    StaticLayer,
)

__version__ = "0.1.0"

__all__ = [
    "CacheLayer",
    "CrossAttentionLayer",
    "LinearAttentionLayer",
    "RollingKVCache",
    "SlidingWindowLayer",
    "StaticLayer",
]

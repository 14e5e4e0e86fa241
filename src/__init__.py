"""rolldiff: long videos, chunk by chunk, with a rolling key/value cache.

Model and pipeline classes are importable from here, which is where saved pipelines'
`model_index.json` points (`["rolldiff", "KreaRealtimeTransformer3DModel"]`). They are imported when first used
(PEP 562, as diffusers and transformers do), so `import rolldiff` and the `rolldiff` command's `--help` and
`--version` do not load torch and diffusers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what type checkers and editors see; at run time `__getattr__` imports each name when used
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

# Where the public names come from, lowest floor first: a cache class imports only `caching`, a model class `caching`
# and `models`, a pipeline class all three (each floor imports the ones below it anyway).
_SUBPACKAGES = (".caching", ".models", ".pipelines")


def __getattr__(name: str):
    """A public class, imported with its subpackage on first use (then kept, so the next use is a plain lookup); the
    subpackages themselves (`rolldiff.caching`, ...) as `import rolldiff` used to give them."""
    if f".{name}" in _SUBPACKAGES:
        return importlib.import_module(f".{name}", __name__)
    if name in __all__:
        for package in _SUBPACKAGES:
            module = importlib.import_module(package, __name__)
            if hasattr(module, name):
                globals()[name] = value = getattr(module, name)
                return value
    raise AttributeError(f"module 'rolldiff' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

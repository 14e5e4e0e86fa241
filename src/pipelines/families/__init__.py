"""The family pipelines: the chunk loop's shared base (`ChunkedVideoPipeline`) and one pipeline per model family
(Krea-like causal Wan, LongSANA-like linear attention, GLM-Image's cached decoder). File names say "pipeline_"
so a path never reads like its model's file in `rolldiff.models`."""

from .chunked_video import CacheAllocationError, ChunkedVideoPipeline, ChunkedVideoPipelineOutput
from .pipeline_glm_image import GlmImageCachedPipeline
from .pipeline_krea_realtime import KreaCacheOptions, KreaRealtimeVideoPipeline, KreaRealtimeVideoPipelineOutput
from .pipeline_long_sana import LongSanaCacheOptions, LongSanaVideoPipeline, LongSanaVideoPipelineOutput

__all__ = [
    "CacheAllocationError",
    "ChunkedVideoPipeline",
    "ChunkedVideoPipelineOutput",
    "GlmImageCachedPipeline",
    "KreaCacheOptions",
    "KreaRealtimeVideoPipeline",
    "KreaRealtimeVideoPipelineOutput",
    "LongSanaCacheOptions",
    "LongSanaVideoPipeline",
    "LongSanaVideoPipelineOutput",
]

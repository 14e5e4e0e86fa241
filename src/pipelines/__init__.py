"""DiffusionPipeline subclasses that run the chunk loop."""

from .codecs.streaming_decode import StreamingWanDecoder, denormalize_wan_latents
from .families.chunked_video import ChunkedVideoPipeline, ChunkedVideoPipelineOutput
from .families.pipeline_glm_image import GlmImageCachedPipeline
from .families.pipeline_krea_realtime import KreaRealtimeVideoPipeline, KreaRealtimeVideoPipelineOutput
from .families.pipeline_long_sana import LongSanaVideoPipeline, LongSanaVideoPipelineOutput
from .io.video_writer import StreamingVideoWriter
from .request.prompt_schedule import PromptSchedule
from .request.request import CacheOptions, VideoRequest
from .stream import ChunkStream

__all__ = [
    "CacheOptions",
    "ChunkStream",
    "ChunkedVideoPipeline",
    "ChunkedVideoPipelineOutput",
    "GlmImageCachedPipeline",
    "KreaRealtimeVideoPipeline",
    "KreaRealtimeVideoPipelineOutput",
    "LongSanaVideoPipeline",
    "LongSanaVideoPipelineOutput",
    "PromptSchedule",
    "StreamingVideoWriter",
    "StreamingWanDecoder",
    "VideoRequest",
    "denormalize_wan_latents",
]

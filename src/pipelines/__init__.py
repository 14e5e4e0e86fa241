"""DiffusionPipeline subclasses that run the chunk loop."""

from .chunked_video import ChunkedVideoPipeline, ChunkedVideoPipelineOutput
from .glm_image import GlmImageCachedPipeline
from .krea_realtime import KreaRealtimeVideoPipeline, KreaRealtimeVideoPipelineOutput
from .long_sana import LongSanaVideoPipeline, LongSanaVideoPipelineOutput
from .prompt_schedule import PromptSchedule
from .request import CacheOptions, VideoRequest
from .stream import ChunkStream
from .streaming_decode import StreamingWanDecoder, denormalize_wan_latents
from .video_writer import StreamingVideoWriter

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

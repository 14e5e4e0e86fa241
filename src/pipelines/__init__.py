"""DiffusionPipeline subclasses that run the chunk loop."""

from .glm_image import GlmImageCachedPipeline
from .krea_realtime import KreaRealtimeVideoPipeline, KreaRealtimeVideoPipelineOutput
from .prompt_schedule import PromptSchedule
from .streaming_decode import StreamingWanDecoder, denormalize_wan_latents
from .video_writer import StreamingVideoWriter

__all__ = [
    "GlmImageCachedPipeline",
    "KreaRealtimeVideoPipeline",
    "KreaRealtimeVideoPipelineOutput",
    "PromptSchedule",
    "StreamingVideoWriter",
    "StreamingWanDecoder",
    "denormalize_wan_latents",
]

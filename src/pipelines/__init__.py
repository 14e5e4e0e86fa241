"""DiffusionPipeline subclasses that run the chunk loop."""

from .krea_realtime import KreaRealtimeVideoPipeline, KreaRealtimeVideoPipelineOutput
from .prompt_schedule import PromptSchedule
from .streaming_decode import StreamingWanDecoder, denormalize_wan_latents
from .video_writer import StreamingVideoWriter

__all__ = [
    "KreaRealtimeVideoPipeline",
    "KreaRealtimeVideoPipelineOutput",
    "PromptSchedule",
    "StreamingVideoWriter",
    "StreamingWanDecoder",
    "denormalize_wan_latents",
]

"""DiffusionPipeline subclasses that run the chunk loop, and what they are made of.

families/   the family pipelines (`ChunkedVideoPipeline` and the Krea-like, LongSANA-like, GLM-Image ones)
request/    one call resolved once: `VideoCall` -> `build_request` -> the frozen `VideoRequest`
stream.py   `ChunkStream`, one live generation, and `StreamPipeline`, what it needs from its pipeline
codecs/     streaming encoders and decoders (Wan VAE, the tiny autoencoder), the overlapped decode
io/         input videos and images, the streaming mp4 writer, resume states
"""

from .codecs.streaming_decode import StreamingWanDecoder, denormalize_wan_latents
from .families.chunked_video import CacheAllocationError, ChunkedVideoPipeline, ChunkedVideoPipelineOutput
from .families.pipeline_glm_image import GlmImageCachedPipeline
from .families.pipeline_krea_realtime import KreaRealtimeVideoPipeline, KreaRealtimeVideoPipelineOutput
from .families.pipeline_long_sana import LongSanaVideoPipeline, LongSanaVideoPipelineOutput
from .io.resume import ResumeError, write_video
from .io.video_writer import StreamingVideoWriter
from .request import CacheOptions, PromptSchedule, VideoCall, VideoRequest, build_request
from .stream import ChunkStream, StreamPipeline

__all__ = [
    "CacheAllocationError",
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
    "ResumeError",
    "StreamPipeline",
    "StreamingVideoWriter",
    "StreamingWanDecoder",
    "VideoCall",
    "VideoRequest",
    "build_request",
    "denormalize_wan_latents",
    "write_video",
]

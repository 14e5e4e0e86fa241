"""Files in and out: input videos and images (`video_input`), the streaming mp4 writer (`video_writer`) and the
resume state kept beside a video (`resume`)."""

from .resume import ResumeError, write_video
from .video_input import VideoInput, read_image
from .video_writer import StreamingVideoWriter

__all__ = ["ResumeError", "StreamingVideoWriter", "VideoInput", "read_image", "write_video"]

"""Files in and out: input videos and images (`video_input`), the streaming mp4 writer (`video_writer`), the
resume state kept beside a video (`resume`) and subtitles drawn into frames (`subtitles`)."""

from .resume import ResumeError, write_video
from .subtitles import draw_subtitle, subtitle_overlay
from .video_input import VideoInput, read_image
from .video_writer import StreamingVideoWriter

__all__ = [
    "ResumeError",
    "StreamingVideoWriter",
    "VideoInput",
    "draw_subtitle",
    "read_image",
    "subtitle_overlay",
    "write_video",
]

"""The Gradio demo: type a prompt, watch the video appear chunk by chunk, switch the prompt while it runs.

A video can start from a picture or follow an input video (an uploaded clip, or the webcam frame by frame).
Split by job: `fields` checks every value typed (no UI), `session` runs the generations (no UI), `video` writes
what the page shows, `serving` checks the address to listen on, `page` is the Gradio layout and its wiring.
Importing `rolldiff.demo` does not import Gradio (the command-line tool checks an address with it before knowing
Gradio is installed); the page's names (`build_demo`) import it when first used.
"""

from .fields import (
    CACHE_FIELDS,
    DEFAULT_SEED,
    EXAMPLE_PROMPTS,
    FIELD_LABELS,
    MAX_SEED,
    ChunkSettings,
    DemoInputError,
    DemoSettings,
    GenerateConfig,
    GenerateFields,
    InputConfig,
    parse_image,
    parse_length,
    parse_position_mode,
    parse_prompt,
    parse_recipe,
    parse_seconds,
    parse_steps,
    parse_strength,
    parse_video,
    parse_whole_number,
    prompt_notes,
    prompt_warnings,
    relabel,
)
from .serving import check_address, launch
from .session import (
    Chunk,
    DemoSession,
    FrameQueue,
    Generation,
    LivePrompt,
    LiveStream,
    ModelShelf,
    VideoPlan,
    cut_to_prompt,
    frame_size,
    generate_frames,
    push_webcam_frame,
    stop_generation,
    stop_webcam,
    streaming_available,
    switch_prompt,
)
from .video import VideoSoFar

_PAGE_NAMES = ("build_demo",)


def __getattr__(name: str):
    """`build_demo` from `page`, imported (with Gradio) on first use (PEP 562)."""
    if name in _PAGE_NAMES:
        from . import page

        return getattr(page, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CACHE_FIELDS",
    "DEFAULT_SEED",
    "EXAMPLE_PROMPTS",
    "FIELD_LABELS",
    "MAX_SEED",
    "Chunk",
    "ChunkSettings",
    "DemoInputError",
    "DemoSession",
    "DemoSettings",
    "FrameQueue",
    "GenerateConfig",
    "GenerateFields",
    "Generation",
    "InputConfig",
    "LivePrompt",
    "LiveStream",
    "ModelShelf",
    "VideoPlan",
    "VideoSoFar",
    "build_demo",
    "check_address",
    "frame_size",
    "generate_frames",
    "launch",
    "parse_image",
    "parse_length",
    "parse_position_mode",
    "parse_prompt",
    "parse_recipe",
    "parse_seconds",
    "parse_steps",
    "parse_strength",
    "parse_video",
    "parse_whole_number",
    "prompt_notes",
    "prompt_warnings",
    "push_webcam_frame",
    "relabel",
    "stop_generation",
    "stop_webcam",
    "streaming_available",
    "switch_prompt",
    "cut_to_prompt",
]

"""One call, resolved once: `VideoCall` (the arguments as given) -> `build_request` (recipe, loop defaults, the
pipeline config, every check) -> the frozen `VideoRequest` the chunk loop reads. Beside it: the step plan
(`steps`), the start image / input video (`conditioning`), the prompt schedule and the text encoding."""

from .builder import LOOP_DEFAULTS, build_request, longest_num_frames, num_frames_for, resolve_call
from .call import CALL_ARGUMENTS, VideoCall
from .prompt_schedule import PromptSchedule
from .request import CacheOptions, VideoGeometry, VideoRequest
from .steps import StepPlan, plan_steps

__all__ = [
    "CALL_ARGUMENTS",
    "LOOP_DEFAULTS",
    "CacheOptions",
    "PromptSchedule",
    "StepPlan",
    "VideoCall",
    "VideoGeometry",
    "VideoRequest",
    "build_request",
    "longest_num_frames",
    "num_frames_for",
    "plan_steps",
    "resolve_call",
]

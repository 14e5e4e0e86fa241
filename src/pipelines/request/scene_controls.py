"""Infinity-RoPE's scene controls, checked: scene cuts at prompt switches (`scene_cuts=`) and the KV flush
(`recache="flush"`).

Both move the positions of re-indexed keys (the model's `position_mode="relative"`: keys stored before RoPE and
rotated where they sit), so both need that mode, a fixed sink, no window views, and chunks denoised one at a time.
A scene cut also needs its RoPE frames (`SCENE_CUT_FRAME` and the chunk's frames after it) inside the model's table.
"""

from __future__ import annotations

from typing import Any

from ...caching.layout import SCENE_CUT_FRAME, ChunkLayout
from ...checks import is_int
from .prompt_schedule import PromptSchedule

_NEEDS = (
    "position_mode='relative', sink_mode='fixed', no elastic_window or context_window_frames, "
    "denoising='sequential' and a context_policy other than 'recompute'"
)
_NOT_OFFERED = "`{name}` is offered by the Krea-like pipeline (KreaRealtimeVideoPipeline) only."


def _refuse_conflicts(what: str, layout: ChunkLayout, denoising: str, context_policy: str) -> None:
    """Raise naming every setting `what` (a control, as the error starts) cannot run with, and the value given."""
    given = {
        "position_mode": (layout.position_mode, layout.position_mode != "relative"),
        "sink_mode": (layout.sink_mode, layout.sink_mode != "fixed"),
        "elastic_window": (layout.elastic_window, layout.elastic_window),
        "context_window_frames": (layout.context_window_frames, layout.context_window_frames is not None),
        "denoising": (denoising, denoising != "sequential"),
        "context_policy": (context_policy, context_policy == "recompute"),
    }
    got = ", ".join(f"{name}={value!r}" for name, (value, wrong) in given.items() if wrong)
    if got:
        raise ValueError(f"{what}: it needs {_NEEDS}; got {got}.")


def check_flush(recache_mode: str, layout: ChunkLayout, denoising: str, context_policy: str) -> None:
    """`recache="flush"` drops the window's older frames and closes the gap by moving keys stored before RoPE."""
    if recache_mode == "flush":
        _refuse_conflicts("`recache='flush'` closes the window up by moving keys stored before RoPE", layout,
                          denoising, context_policy)  # fmt: skip


def check_cut_setup(name: str, pipe: Any, layout: ChunkLayout, denoising: str, context_policy: str) -> None:
    """A scene cut (asked by `name`) can be placed by `pipe` in a stream of these settings: the pipeline offers cuts,
    the settings are those a cut needs, and its RoPE frames lie inside the model's table (`rope_max_seq_len`)."""
    if not getattr(pipe, "offers_scene_cuts", False):
        raise ValueError(_NOT_OFFERED.format(name=name))
    _refuse_conflicts(f"`{name}` places a cut chunk by re-indexing keys stored before RoPE", layout, denoising,
                      context_policy)  # fmt: skip
    last = SCENE_CUT_FRAME + layout.chunk_frames - 1
    rope_frames = getattr(pipe.transformer.config, "rope_max_seq_len", None)
    if rope_frames is not None and last >= rope_frames:
        raise ValueError(
            f"`{name}` places a cut chunk at RoPE frames {SCENE_CUT_FRAME}..{last}, past this model's RoPE table of "
            f"{rope_frames} frames (`rope_max_seq_len`)."
        )


def scene_cut_entries(
    scene_cuts: Any, schedule: PromptSchedule, pipe: Any, layout: ChunkLayout, denoising: str, context_policy: str
) -> tuple[int, ...]:
    """The prompt-schedule entries whose switch is a scene cut: `scene_cuts` names their frames."""
    if scene_cuts is None:
        return ()
    check_cut_setup("scene_cuts", pipe, layout, denoising, context_policy)
    frames = list(scene_cuts) if isinstance(scene_cuts, (list, tuple, set, frozenset)) else None
    if not frames or not all(is_int(frame) for frame in frames):
        raise ValueError(
            f"`scene_cuts` must be a non-empty list of int frames of prompt switches, got {scene_cuts!r}."
        )
    cut_frames, switches = {int(frame) for frame in frames}, [frame for frame, _ in schedule.entries[1:]]
    unknown = sorted(cut_frames - set(switches))
    if unknown:
        raise ValueError(
            f"`scene_cuts` frames {unknown} are not prompt switches: a cut starts a new prompt, so each must be a frame "
            f"of `prompt_schedule` after the first prompt (the switches are at {switches or 'no frame'})."
        )
    return tuple(i for i, (frame, _) in enumerate(schedule.entries) if i and frame in cut_frames)

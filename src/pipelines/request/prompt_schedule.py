"""Prompt schedules: which prompt is active at which frame of a long video.

A schedule is `[(frame, prompt), ...]` (or `{frame: prompt}`) in pixel frames, strictly increasing,
starting at 0 unless a base `prompt` covers the frames before the first entry. A prompt may be one
string or one per batch element. The chunk loop switches at the first chunk starting at or after an
entry's frame, so frames before the switch frame are never touched, and a switch after the last chunk's
first frame would never apply: `build` refuses it when told where the last chunk starts. Frames are any
integer type (numpy's too); strings and floats are refused as what they are, not as out of range.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...checks import is_int


def as_prompt_list(name: str, prompt) -> list[str]:
    """`prompt` (one string, or one per batch element) as a list; raises naming `name` if it is not one."""
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p.strip() for p in prompts):
        raise ValueError(
            f"`{name}` must be a non-empty string or a non-empty list of non-empty strings, got {prompt!r}."
        )
    return prompts


class ScheduleFrameError(ValueError):
    """A `prompt_schedule` frame refused; `frame` is the one at fault, so a front end that builds the schedule from
    several inputs can name the input that gave it."""

    def __init__(self, message: str, frame: int) -> None:
        super().__init__(message)
        self.frame = frame


def _check_frame(frame, num_frames: int, last_chunk_start: int | None, previous: int) -> int:
    """One switch frame: an int in [0, num_frames), after the previous one, no later than the last chunk's start."""
    if not is_int(frame):
        raise ValueError(
            f"`prompt_schedule` frame {frame!r} is a {type(frame).__name__}; frames must be ints "
            f"(pixel frame numbers in [0, {num_frames}))."
        )
    frame = int(frame)
    if not 0 <= frame < num_frames:
        raise ScheduleFrameError(
            f"`prompt_schedule` frame {frame!r} is out of range: frames must be ints in [0, {num_frames}).", frame
        )
    if last_chunk_start is not None and frame > last_chunk_start:
        raise ScheduleFrameError(
            f"`prompt_schedule` frame {frame} comes after the last chunk starts (frame "
            f"{last_chunk_start}), so the switch would never apply; a switch takes effect at the first "
            "chunk starting at or after its frame. Use an earlier frame or a longer video.",
            frame,
        )
    if frame <= previous:
        raise ScheduleFrameError(
            f"`prompt_schedule` frames must be strictly increasing; {frame} follows {previous}.", frame
        )
    return frame


def _schedule_entries(
    schedule, num_frames: int, last_chunk_start: int | None, has_prompt: bool
) -> list[tuple[int, list[str]]]:
    """`prompt_schedule` as checked `(frame, prompts)` entries."""
    pairs = list(schedule.items()) if isinstance(schedule, dict) else list(schedule)
    if not pairs:
        raise ValueError("`prompt_schedule` is empty; give at least one (frame, prompt) pair or omit it.")
    entries, previous = [], -1
    for pair in pairs:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise ValueError(f"`prompt_schedule` entries must be (frame, prompt) pairs, got {pair!r}.")
        frame = _check_frame(pair[0], num_frames, last_chunk_start, previous)
        if frame == 0 and has_prompt:
            raise ValueError("Give either `prompt` or a `prompt_schedule` entry at frame 0, not both.")
        entries.append((frame, as_prompt_list("prompt_schedule", pair[1])))
        previous = frame
    return entries


@dataclass(frozen=True)
class PromptSchedule:
    """`entries`: `(start_frame, prompts per batch element)`, sorted, the first at frame 0."""

    entries: tuple[tuple[int, tuple[str, ...]], ...]

    @property
    def batch_size(self) -> int:
        return len(self.entries[0][1])

    @classmethod
    def build(
        cls,
        prompt: str | list[str] | None,
        schedule: Sequence[tuple[int, str]] | dict | None,
        num_frames: int,
        last_chunk_start: int | None = None,
    ) -> PromptSchedule:
        """Validate `prompt` and `prompt_schedule` together; raises ValueError naming the bad argument.

        `last_chunk_start`: the first pixel frame of the video's last chunk; a later switch is refused.
        """
        entries: list[tuple[int, list[str]]] = []
        if prompt is not None:
            entries.append((0, as_prompt_list("prompt", prompt)))
        if schedule is not None:
            entries += _schedule_entries(schedule, num_frames, last_chunk_start, has_prompt=prompt is not None)
        if not entries:
            raise ValueError("Either `prompt` or `prompt_schedule` is required.")
        if entries[0][0] != 0:
            raise ValueError(
                f"`prompt_schedule` starts at frame {entries[0][0]}; without `prompt` it must start at frame 0."
            )
        sizes = {len(p) for _, p in entries}
        if len(sizes) > 1:
            raise ValueError(f"Every prompt in `prompt`/`prompt_schedule` must have the same batch size, got {sizes}.")
        return cls(tuple((frame, tuple(p)) for frame, p in entries))

    def active_index(self, frame: int) -> int:
        """Index of the entry active at pixel frame `frame`."""
        return max(i for i, (start, _) in enumerate(self.entries) if start <= frame)

    def prompts(self, index: int) -> list[str]:
        return list(self.entries[index][1])

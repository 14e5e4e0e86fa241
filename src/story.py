"""Stories: Infinity-RoPE's prompt syntax, one line for a whole multi-scene video.

`"a man walks in a park[5s] | he sits on a bench[10s#] | a city at night[10s] ; Morning | Rest | Night"`:
scenes separated by `|`, each with its length in brackets (`[5s]`, `[2.5s]`), `#` in them for a hard cut; after
`;`, one subtitle per scene (yesiltepe-hidir/infinity-rope@63d7b84 README.md "Prompting Structure",
`pipeline/causal_inference.py:95-110,398-443`, `utils/interactive.py`).

As upstream's code runs it: a scene lasts `max(1, int(seconds * fps / chunk_pixel_frames))` whole chunks (a scene
without a length 14, its `default_blocks_per_scene`); each switch lands at the first frame of the next scene's first
chunk (a KV flush under `recipe="infinity-rope"`); a scene marked `#` makes the switch AFTER it a hard cut
(`scene_cut_flags[i]` decides the boundary between scenes i and i + 1, `causal_inference.py:104-109`; the README
words it as the marked scene starting with the cut, which their own prompt file, every scene marked, cannot tell
apart). In the example the cut is where "a city at night" starts. Subtitles last their scene's seconds
(`int(seconds * fps)` frames each).

`pipe(**parse_story(text).arguments(pipe, fps=16, recipe="infinity-rope"))` makes the video; `rolldiff generate
--story TEXT` writes it, subtitles drawn in.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

STORY_ARGUMENTS = ("prompt", "prompt_schedule", "scene_cuts")  # what a story sets, so a call may not
DEFAULT_SCENE_CHUNKS = 14  # upstream's `default_blocks_per_scene`, for a scene without a length
_LENGTH = re.compile(r"\[\s*(\d+(?:\.\d+)?)\s*s\s*(#?)\s*\]")  # "[10s]", "[2.5s#]"
# A bracket left once the length is read: a second one, one this syntax cannot read, one never closed or opened.
_UNREAD = re.compile(r"\[[^\[\]]*\]?|\]")


@dataclass(frozen=True)
class Scene:
    """One scene: its prompt, its length (None: `DEFAULT_SCENE_CHUNKS` chunks) and whether its `#` makes the switch
    to the next scene a hard cut."""

    text: str
    seconds: float | None = None
    cut: bool = False


@dataclass(frozen=True)
class Story:
    """A parsed story: its scenes in order and one subtitle per scene ("" for none)."""

    scenes: tuple[Scene, ...]
    subtitles: tuple[str, ...] = ()

    @property
    def seconds(self) -> float | None:
        """The story's length: its scenes' seconds added up (None when a scene has no length)."""
        lengths = [scene.seconds for scene in self.scenes]
        return None if None in lengths else float(sum(lengths))

    def scene_chunks(self, fps: float, chunk_pixel_frames: int) -> list[int]:
        """Whole chunks per scene, as upstream counts them (at least one)."""
        return [
            DEFAULT_SCENE_CHUNKS if scene.seconds is None else max(1, int(scene.seconds * fps / chunk_pixel_frames))
            for scene in self.scenes
        ]

    def arguments(self, pipe, fps: float, **call: Any) -> dict[str, Any]:
        """`call` with the story's `prompt_schedule`, `scene_cuts` and `num_frames` (whole chunks covering the
        story: its seconds, else its chunks), for `pipe(...)` or `pipe.stream(...)`; a `num_frames` in `call`
        wins (switches past it are refused by the pipeline, naming them).

        Raises:
            ValueError: a `fps` that is not a positive number, a `call` giving a prompt, a schedule or cuts of its
                own (`check_story_call`), or an argument of `call` the pipeline refuses.
        """
        from .checks import check_number
        from .pipelines.request.builder import whole_chunk_grid
        from .pipelines.request.call import VideoCall
        from .pipelines.request.text_encoding import PromptWarning

        fps = check_number("fps", fps, 0, above=True)
        check_story_call(call)
        if self.scenes[-1].cut:
            warnings.warn(
                f"`story`: the last scene (scene {len(self.scenes)}) is marked '#', and a mark makes the switch AFTER "
                "its scene a hard cut (as Infinity-RoPE's code reads it), so it cuts nothing; to cut where a scene "
                "starts, mark the scene before it ('...[10s#] | ...').",
                PromptWarning,
                stacklevel=2,
            )
        first, chunk = whole_chunk_grid(pipe, VideoCall.bind("story", (), call))
        chunks = self.scene_chunks(fps, chunk * pipe.vae_scale_factor_temporal)
        starts = [pipe.latent_to_pixel_start(first + chunk * sum(chunks[:index])) for index in range(len(chunks) + 1)]
        frames = [0, *starts[1:-1]]  # the first scene from frame 0 (before a start image's lone frame too)
        schedule = [(frame, scene.text) for frame, scene in zip(frames, self.scenes, strict=True)]
        cuts = [frame for frame, scene in zip(frames[1:], self.scenes[:-1], strict=True) if scene.cut]
        if "num_frames" not in call:
            total = starts[-1]  # the frame after the last scene's chunks
            seconds = self.seconds if self.seconds is not None else total / fps
            call["num_frames"] = pipe.num_frames_for(seconds, fps, **call)
        return {**call, "prompt": None, "prompt_schedule": schedule, "scene_cuts": cuts or None}

    def subtitle_spans(self, fps: float) -> list[tuple[int, int, str]]:
        """`(first frame, end frame, text)` per non-empty subtitle: each lasts its scene's `int(seconds * fps)`
        frames (upstream's `add_subtitles`); a scene without a length ends the timed subtitles."""
        spans, start = [], 0
        for scene, text in zip(self.scenes, self.subtitles, strict=False):
            if scene.seconds is None:
                break
            end = start + int(scene.seconds * fps)
            if text:
                spans.append((start, end, text))
            start = end
        return spans


def check_story_call(call: Mapping[str, Any]) -> None:
    """A story holds the prompts, their switches and cuts: a call that gives any of them as well is refused (one
    home for the rule; front ends check their inputs here before any model loads)."""
    given = [f"`{name}`" for name in STORY_ARGUMENTS if call.get(name) is not None]
    if given:
        raise ValueError(f"`story` holds the prompts, their switches and cuts; drop {' and '.join(given)}.")


def parse_story(text: Any) -> Story:
    """The story in `text` (Infinity-RoPE's syntax: `scene[10s] | scene[5s#] ; subtitle | subtitle`).

    Raises:
        ValueError: naming `story`: not a string, an empty scene, a length that is not `[Ns]`/`[Ns#]` or is 0,
            or more subtitles than scenes.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(
            f"`story` must be scenes as text, e.g. 'a red circle[5s#] | a blue square[5s]', got {text!r}."
        )
    scenes_text, _, subtitles_text = text.partition(";")
    scenes = tuple(_scene(part, number) for number, part in enumerate(scenes_text.split("|"), start=1))
    subtitles = tuple(part.strip() for part in subtitles_text.split("|")) if subtitles_text.strip() else ()
    if len(subtitles) > len(scenes):
        raise ValueError(
            f"`story` has {len(subtitles)} subtitles (after ';') for {len(scenes)} scenes; give at most one per scene."
        )
    return Story(scenes, subtitles + ("",) * (len(scenes) - len(subtitles)))


def _scene(part: str, number: int) -> Scene:
    length = _LENGTH.search(part)
    text = _LENGTH.sub(" ", part, count=1) if length else part
    text = " ".join(text.split())
    unread = _UNREAD.search(text)
    if unread:
        raise ValueError(
            f"`story` scene {number}: {unread.group(0)!r} is not its length (a scene has one, written '[10s]', or "
            "'[10s#]' for a hard cut after the scene)."
        )
    if not text:
        raise ValueError(f"`story` scene {number} has no prompt; every scene between '|' needs words.")
    seconds = float(length.group(1)) if length else None
    if seconds is not None and seconds <= 0:
        raise ValueError(f"`story` scene {number} lasts {length.group(0)}; a scene lasts more than 0 seconds.")
    return Scene(text, seconds, cut=bool(length and length.group(2)))

"""Every value the demo takes, checked before any work: the Generate form's fields and `build_demo`'s settings.

Gradio's own preprocessing is off for the Generate event, so a field arrives raw (a number, the text of one, an
uploaded file as Gradio's `{"path": ...}` record, or anything a caller of the API sends) and is read here. A bad
field raises `DemoInputError` (a ValueError) whose message starts with the field's label, says what to type and
repeats what was typed: "Seed: type a whole number from 0 to 4294967295, got -1.". A bad `build_demo` setting
raises a ValueError naming the argument.

One home per rule: a rule the pipeline checks (the strength's range, the step list, one input at a time, a prompt
the tokenizer can read, the cache geometry) is the pipeline's alone. The demo turns a field's text into a value
and lets the pipeline decide; `relabel` shows the pipeline's message with the field labels
(`FIELD_LABELS`): "`strength` must be a number in (0, 1] ..." becomes "Strength: must be a number in (0, 1] ...".
What the pipeline's own prompt check warns about (unknown words, truncation) is recorded as the video's notes
(`prompt_warnings`), so each warning is issued once.
"""

from __future__ import annotations

import math
import os
import re
import threading
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import PIL.Image

from ..caching.layout import POSITION_MODES
from ..pipelines.io.video_input import read_image
from ..pipelines.request.builder import cache_options, resolve_call
from ..pipelines.request.call import VideoCall
from ..pipelines.request.conditioning import DEFAULT_STRENGTH, check_strength
from ..pipelines.request.text_encoding import PromptWarning

# Each one starts right on both embedded models at the default seed (0): the tiny models' first frames are their
# weak spot, and "a green triangle moving right" at seed 0 opens with empty frames (tests/test_demo.py checks these).
EXAMPLE_PROMPTS = [
    "a red circle moving left",
    "a blue square moving up",
    "a green square moving left",
    "a yellow circle moving down",
]
DEFAULT_SEED = 0
MAX_SEED = 2**32 - 1  # what the Seed field's widget accepts

# The Advanced fields: the pipeline's cache option each one sets, and its label.
CACHE_FIELDS = {"chunk_frames": "Chunk frames", "sink_frames": "Sink frames", "window_frames": "Window frames"}


class DemoInputError(ValueError):
    """A demo field holds a value the demo cannot use; the message names the field and says what to type."""


# ---------------------------------------------------------------------------------------- the pipeline's words
IMAGE_LABEL, VIDEO_LABEL, WEBCAM_LABEL, STRENGTH_LABEL = "Start image", "Input video", "Webcam", "Strength"
PROMPT_LABEL, STEPS_LABEL, SWITCH_LABEL = "Prompt", "Denoising steps", "Switch prompt to"
RECIPE_LABEL = "Recipe"
LENGTH_LABEL = "Length (seconds)"

# The pipeline's argument names (as its messages spell them, in backticks) and the field that sets each one.
FIELD_LABELS: dict[str, str] = {
    "prompt": PROMPT_LABEL,
    "prompt_schedule": SWITCH_LABEL,  # the live switches are the video's prompt schedule
    "strength": STRENGTH_LABEL,
    "image": IMAGE_LABEL,
    "video": VIDEO_LABEL,
    "denoising_steps": STEPS_LABEL,
    **CACHE_FIELDS,
    "position_mode": "Position mode",
    "recipe": RECIPE_LABEL,
    "height": "Frame height",  # a `build_demo` setting: each model's native size unless set
    "width": "Frame width",
    "num_frames": LENGTH_LABEL,  # the frames are the seconds asked for, in whole chunks
    "seconds": LENGTH_LABEL,
}
_ARGUMENT = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*)`")


def relabel(error: Exception, labels: Mapping[str, str] = FIELD_LABELS) -> DemoInputError:
    """The pipeline's refusal as the page shows it: the message starts with the label of the first field it names
    and every argument it names (`` `name` ``) is shown as its field's label (`labels`: argument name -> label).

    "`strength` must be a number in (0, 1] ..., got 0." -> "Strength: must be a number in (0, 1] ..., got 0.";
    "Give either `image` (...) or `video` (...), not both." -> "Start image: give either Start image (...) or
    Input video (...), not both.". A `DemoInputError` (already the demo's words) is returned as it is; a message
    naming no field keeps the pipeline's words.
    """
    if isinstance(error, DemoInputError):
        return error
    message = str(error)
    named = [match.group(1) for match in _ARGUMENT.finditer(message) if match.group(1) in labels]
    if not named:
        return DemoInputError(message)
    first = named[0]
    lead = f"`{first}`"
    if message.startswith(lead):  # "`strength` must be ..." / "`window_frames`=2 must be ...": the field leads
        rest = message[len(lead) :].removeprefix("=").lstrip()
    else:  # "Give either `image` ...": the sentence follows the label, in the demo's lower case
        rest = message[0].lower() + message[1:] if message[1:2].islower() else message
    rest = _ARGUMENT.sub(lambda match: labels.get(match.group(1), match.group(0)), rest)
    return DemoInputError(f"{labels[first]}: {rest}")


_RECORDING = threading.RLock()  # `warnings`' state is the process's: one recorder at a time


@contextmanager
def prompt_warnings(show: bool = True) -> Iterator[list[str]]:
    """The `PromptWarning`s this thread issues inside the block (the pipeline's own prompt check: unknown words,
    truncation), collected as notes in the list yielded; each is issued once, by the pipeline.

    `show`: the warnings are also passed on as usual (the server log); False when the same check issues them again
    later (a live switch is checked once more by the stream as it lands). Warnings of other threads (other
    sessions) and of other kinds pass on untouched and are never taken as this block's notes.
    """
    notes: list[str] = []
    thread = threading.get_ident()
    with _RECORDING, warnings.catch_warnings():
        passed_on = warnings.showwarning  # restored by `catch_warnings` on the way out

        def showwarning(message, category, filename, lineno, file=None, line=None):
            ours = threading.get_ident() == thread and issubclass(category, PromptWarning)
            if ours:
                notes.append(str(message))
            if show or not ours:
                passed_on(message, category, filename, lineno, file, line)

        warnings.showwarning = showwarning
        warnings.simplefilter("always", PromptWarning)  # a note for every Generate, not once per process
        yield notes


# ---------------------------------------------------------------------------------------- one field
def _number(label: str, value: Any) -> float:
    """A finite number from a field's raw value (a number or the text of one); a refusal repeats what was typed."""
    number = value
    if isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            raise DemoInputError(f"{label}: type a number, got {value!r}.") from None
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        raise DemoInputError(f"{label}: type a number, got {value!r}.")
    if not math.isfinite(number):
        raise DemoInputError(f"{label}: type a finite number, got {value!r}.")
    return number


def _is_empty(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


def parse_whole_number(label: str, value: Any, lowest: int, highest: int | None = None) -> int:
    """A whole number in `[lowest, highest]`, or `DemoInputError` naming the field, the value and the range."""
    allowed = f"a whole number from {lowest}" + (f" to {highest}" if highest is not None else " up")
    number = _number(label, value)
    if number != int(number) or number < lowest or (highest is not None and number > highest):
        raise DemoInputError(f"{label}: type {allowed}, got {value!r}.")
    return int(number)


def parse_seconds(value: Any, max_seconds: float) -> float:
    """The video length: a number of seconds in `(0, max_seconds]`."""
    seconds = _number(LENGTH_LABEL, value)
    if not 0 < seconds <= max_seconds:
        raise DemoInputError(f"{LENGTH_LABEL}: type a number above 0 and at most {max_seconds:g}, got {value!r}.")
    return float(seconds)


def parse_length(value: Any, max_seconds: float) -> tuple[float, str | None]:
    """The video length the Generate form asks for, and the note saying it was clamped (None: taken as typed).

    A length above `max_seconds` (100000, 1e9) is clamped to it, said in the note: "Length (seconds): 100000 is
    more than this demo makes; making the longest, 60 s."; 0, a negative length, or what is not a finite number
    is refused (`DemoInputError`), never quietly made 1 s.
    """
    seconds = _number(LENGTH_LABEL, value)
    if not seconds > 0:
        raise DemoInputError(f"{LENGTH_LABEL}: type a number above 0 and at most {max_seconds:g}, got {value!r}.")
    if seconds > max_seconds:
        return float(max_seconds), (
            f"{LENGTH_LABEL}: {value!s} is more than this demo makes; making the longest, {max_seconds:g} s."
        )
    return float(seconds), None


def parse_prompt(value: Any, label: str = "Prompt") -> str:
    """The prompt's text without surrounding spaces; an empty one is refused with an example to type."""
    if value is not None and not isinstance(value, str):
        raise DemoInputError(f"{label}: type some words, got {value!r}.")
    prompt = (value or "").strip()
    if not prompt:
        raise DemoInputError(f"{label}: type a prompt first, for example “{EXAMPLE_PROMPTS[0]}”.")
    return prompt


def parse_steps(value: Any) -> list[int | float] | None:
    """Denoising steps typed as "1000, 750, 500, 250" (or sent as a list), as numbers (whole ones as ints); empty
    means the model's own. Which lists are allowed is the pipeline's rule (`denoising_steps`), checked when the
    stream is made and shown with this field's label (`relabel`)."""
    if _is_empty(value):
        return None
    parts = re.split(r"[,\s]+", value.strip()) if isinstance(value, str) else value
    if not isinstance(parts, (list, tuple)):
        raise DemoInputError(f"{STEPS_LABEL}: type decreasing numbers from 1000 down, such as 1000, 750, 500, 250.")
    numbers = [_number(STEPS_LABEL, part) for part in parts if part != ""]
    return [int(number) if number == int(number) else float(number) for number in numbers]


def parse_position_mode(value: Any) -> str | None:
    """One of the cache's position modes; empty means the model's own."""
    if value not in (None, "", *POSITION_MODES):
        raise DemoInputError(f"Position mode: choose one of {', '.join(POSITION_MODES)}, got {value!r}.")
    return value or None


def parse_recipe(value: Any) -> str | None:
    """A recipe's name as typed; empty means the model's own. Whether the model has it is the pipeline's rule
    (`get_recipe`), shown with the field's label."""
    if _is_empty(value):
        return None
    if not isinstance(value, str):
        raise DemoInputError(f"{RECIPE_LABEL}: pick a recipe's name from the list (or none), got {value!r}.")
    return value.strip()


def prompt_notes(pipe, prompt: str, name: str = "prompt") -> list[str]:
    """What the model's tokenizer will not read in `prompt` (unknown words, truncation), from the pipeline's own
    check (`check_prompt_text`), for a prompt checked before a stream uses it (a live switch). The warnings are
    recorded, not issued: the stream's check issues them when it takes the prompt.

    Raises:
        ValueError: the tokenizer knows no word of `prompt` (the pipeline's refusal, naming `name`).
    """
    with prompt_warnings(show=False) as notes:
        pipe.check_prompt_text([prompt], pipe.config.max_sequence_length, name)
    return notes


# ---------------------------------------------------------------------------------------- the input pictures
def _upload_path(label: str, value: Any, what: str, uploads: str | None) -> str | None:
    """The file path of an upload (Gradio's file record `{"path": ...}`, or a path), or `None` when nothing is given.

    `uploads`: the folder every file must be in (the page passes Gradio's upload folder: a record sent through the
    API may name any path, and Gradio does not check every kind of record); `None` for a Python caller's own files.
    """
    if isinstance(value, dict):
        value = value.get("path")
    if _is_empty(value):
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise DemoInputError(f"{label}: upload {what}, got {value!r}.")
    path = os.fspath(value)
    if uploads is not None and os.path.commonpath([os.path.realpath(path), os.path.realpath(uploads)]) != (
        os.path.realpath(uploads)
    ):
        raise DemoInputError(f"{label}: upload {what}; {path!r} is not a file uploaded to this demo.")
    if not os.path.isfile(path):
        raise DemoInputError(f"{label}: there is no file at {path!r}; upload {what} again.")
    return path


def parse_image(value: Any, uploads: str | None = None) -> PIL.Image.Image | np.ndarray | None:
    """The start image: an upload (read now, so a file that is not a picture is refused before any work), or a
    PIL image or `(H, W, 3)` array given from Python (checked by the pipeline); `None` when the field is empty.
    `uploads`: the folder an uploaded file must be in (None: anywhere)."""
    if isinstance(value, (PIL.Image.Image, np.ndarray)):
        return value
    path = _upload_path(IMAGE_LABEL, value, "a picture (PNG, JPEG or WebP)", uploads)
    if path is None:
        return None
    try:
        return read_image(path)  # reads the whole file: a broken one fails here
    except ValueError as exc:
        name = os.path.basename(path)
        raise DemoInputError(
            f"{IMAGE_LABEL}: {name!r} is not a picture PIL can read ({_without_folders(str(exc), path)}); upload a "
            "PNG, JPEG or WebP."
        ) from None


def _without_folders(message: str, path: str) -> str:
    """`message` with `path` (as given, or resolved) shown as the file's own name: the page never shows where the
    server keeps its uploads."""
    name = os.path.basename(path)
    for spelling in sorted({path, os.path.abspath(path), os.path.realpath(path)}, key=len, reverse=True):
        message = message.replace(spelling, name)
    return message


def parse_video(value: Any, uploads: str | None = None) -> str | None:
    """The uploaded input video's path (the pipeline decodes it as chunks need it); `None` when the field is empty.
    `uploads`: the folder an uploaded file must be in (None: anywhere)."""
    return _upload_path(VIDEO_LABEL, value, "a video file (mp4, webm, ...)", uploads)


def parse_strength(value: Any) -> float:
    """How much of each input chunk is replaced; empty means the pipeline's default (0.8). Its range is the
    pipeline's (`check_strength`), asked now: the field is sent with every Generate, an input video or not."""
    if _is_empty(value):
        return DEFAULT_STRENGTH
    strength = _number(STRENGTH_LABEL, value)
    try:
        return check_strength(strength)
    except ValueError as exc:
        raise relabel(exc) from None


def parse_switch(label: str, value: Any) -> bool:
    """A checkbox: True or False (`None`: False)."""
    if value is None or isinstance(value, bool):
        return bool(value)
    raise DemoInputError(f"{label}: send true or false, got {value!r}.")


@dataclass(frozen=True)
class InputConfig:
    """What the video starts from: nothing (text-to-video), a start image (image-to-video), or an input video
    (video-to-video): an uploaded clip or this session's webcam, with `strength`.

    Two fields feed the pipeline's one `video=`, so a clip and the webcam together are refused here (the demo's own
    rule); a start image with an input video is the pipeline's to refuse (`image` with `video`), when the stream
    is made, with these fields' labels (`labels`).
    """

    image: PIL.Image.Image | np.ndarray | None = None
    video: str | None = None  # an uploaded clip's path
    webcam: bool = False
    strength: float = DEFAULT_STRENGTH

    def __post_init__(self) -> None:
        if self.video is not None and self.webcam:
            raise DemoInputError(
                f"{VIDEO_LABEL} and {WEBCAM_LABEL}: give one of them, not both (both are the input video): clear "
                "the input video or untick Webcam."
            )

    @classmethod
    def parse(cls, image: Any, video: Any, webcam: Any, strength: Any, uploads: str | None = None) -> InputConfig:
        """The raw input fields, each read, then the combination (one input video at most). `uploads`: the folder
        uploaded files must be in (None: anywhere)."""
        return cls(
            image=parse_image(image, uploads),
            video=parse_video(video, uploads),
            webcam=parse_switch(WEBCAM_LABEL, webcam),
            strength=parse_strength(strength),
        )

    @property
    def kind(self) -> str:
        """ "text", "image", "clip" or "webcam": what the video starts from."""
        if self.image is not None:
            return "image"
        if self.video is not None:
            return "clip"
        return "webcam" if self.webcam else "text"

    @property
    def labels(self) -> dict[str, str]:
        """`FIELD_LABELS` for these inputs: the pipeline's `video` is the Webcam field when the webcam is the input."""
        return {**FIELD_LABELS, "video": WEBCAM_LABEL} if self.webcam else dict(FIELD_LABELS)

    def stream_arguments(self, webcam_frames: Any = None) -> dict[str, Any]:
        """`pipe.stream`'s `image=`, and `video=` + `strength=`, as given (the pipeline refuses both together);
        `webcam_frames` (an iterator of `(H, W, 3)` frames) is the video when the webcam is the input."""
        if self.webcam and webcam_frames is None:
            raise ValueError("the webcam is the input video: pass its frames as `webcam_frames`.")
        arguments: dict[str, Any] = {} if self.image is None else {"image": self.image}
        video = webcam_frames if self.webcam else self.video
        if video is not None:
            arguments.update(video=video, strength=self.strength)
        return arguments


# ---------------------------------------------------------------------------------------- the Advanced section
@dataclass(frozen=True)
class ChunkSettings:
    """The Advanced section: a recipe, cache geometry in latent frames, denoising steps, position mode; `None` =
    the model's. A field set explicitly wins over the recipe's value, as in `pipe(..., recipe=...)`."""

    chunk_frames: int | None = None
    sink_frames: int | None = None
    window_frames: int | None = None
    denoising_steps: list[int | float] | None = None
    position_mode: str | None = None
    recipe: str | None = None

    @classmethod
    def parse(
        cls, chunk: Any, sink: Any, window: Any, steps: Any, position_mode: Any, recipe: Any = None
    ) -> ChunkSettings:
        """The raw Advanced fields; an empty field is the model's default."""

        def optional(name: str, value: Any, lowest: int) -> int | None:
            return None if _is_empty(value) else parse_whole_number(CACHE_FIELDS[name], value, lowest)

        mode = parse_position_mode(position_mode)
        return cls(
            chunk_frames=optional("chunk_frames", chunk, 1),
            sink_frames=optional("sink_frames", sink, 0),
            window_frames=optional("window_frames", window, 1),
            denoising_steps=parse_steps(steps),
            position_mode=mode,
            recipe=parse_recipe(recipe),
        )

    def cache_options(self, pipe) -> dict[str, Any]:
        """The options that were set, as `stream` takes them; one this model does not have is refused."""
        options = {name: getattr(self, name) for name in (*CACHE_FIELDS, "position_mode")}
        options = {name: value for name, value in options.items() if value is not None}
        for name in options:
            if name not in pipe.cache_options:
                label = CACHE_FIELDS.get(name, "Position mode")
                raise DemoInputError(f"{label}: {type(pipe).__name__} has no such setting; leave the field empty.")
        return options

    def stream_options(self, pipe) -> dict[str, Any]:
        """Every argument the section gives `pipe.stream`: the steps, the cache options set, and the recipe."""
        recipe = {} if self.recipe is None else {"recipe": self.recipe}
        return {"denoising_steps": self.denoising_steps, **self.cache_options(pipe), **recipe}

    @classmethod
    def of_model(cls, pipe, recipe: str | None = None) -> ChunkSettings:
        """The values a run takes when no field is set: the model's registered config (`None`: it has no such
        option; `"all"`: an unbounded window) under `recipe`'s settings, else under the recipe its folder names.

        Raises:
            ValueError: `pipe` has no recipe `recipe` (the pipeline's message, naming the recipes it has).
        """
        call = resolve_call(pipe, VideoCall(recipe=recipe))  # as a run resolves it: the recipe, then the config
        options = cache_options(pipe, call)
        own = {name: getattr(options, name) for name in (*CACHE_FIELDS, "position_mode") if name in pipe.cache_options}
        steps = pipe.config.denoising_steps if call.denoising_steps is None else call.denoising_steps
        return cls(denoising_steps=list(steps), recipe=call.recipe, **own)


@dataclass(frozen=True)
class GenerateFields:
    """The Generate form as typed: one raw value per field. The field names are the `/generate` API's argument
    names; an argument an API caller leaves out is `None` (the model's own setting, seed 0, no input picture).
    Fields added later come after the older ones, so that positional API calls written before them still mean the
    same: the input fields (`image`, `video`, `webcam`, `strength`), then `recipe`."""

    prompt: Any = None
    seconds: Any = None
    seed: Any = None
    model: Any = None
    chunk_frames: Any = None
    sink_frames: Any = None
    window_frames: Any = None
    denoising_steps: Any = None
    position_mode: Any = None
    image: Any = None  # the start image: an upload record `{"path": ...}`, a path, a PIL image or an array
    video: Any = None  # the input video: an upload record or a path
    webcam: Any = None  # True: the input video is this session's webcam
    strength: Any = None
    recipe: Any = None  # a checkpoint's own settings by name (`rolldiff.recipes`); empty: the model's

    @classmethod
    def names(cls) -> list[str]:
        return [field.name for field in fields(cls)]

    def check(self, max_seconds: float, uploads: str | None = None) -> GenerateConfig:
        """The checked values; the first bad field raises `DemoInputError` (in the order of `names()`).

        `uploads`: the folder the start image's and input video's files must be in; the page passes Gradio's
        upload folder, so an API caller cannot name another file on the server. None: anywhere (Python callers).
        """
        prompt = parse_prompt(self.prompt)
        seconds, clamped = parse_length(self.seconds, max_seconds)
        return GenerateConfig(
            prompt=prompt,
            seconds=seconds,
            seed=parse_whole_number("Seed", DEFAULT_SEED if self.seed is None else self.seed, 0, MAX_SEED),
            model=None if _is_empty(self.model) else self.model,
            settings=ChunkSettings.parse(
                self.chunk_frames,
                self.sink_frames,
                self.window_frames,
                self.denoising_steps,
                self.position_mode,
                self.recipe,
            ),
            inputs=InputConfig.parse(self.image, self.video, self.webcam, self.strength, uploads),
            notes=() if clamped is None else (clamped,),
        )


@dataclass(frozen=True)
class GenerateConfig:
    """One generation, checked: what to make (`model` None = the demo's first model), how, and from what."""

    prompt: str
    seconds: float
    seed: int
    model: str | None = None
    settings: ChunkSettings = ChunkSettings()
    inputs: InputConfig = InputConfig()
    notes: tuple[str, ...] = ()  # what the form changed, said with the run: a length clamped to the longest


# ---------------------------------------------------------------------------------------- the demo's settings
@dataclass(frozen=True)
class DemoSettings:
    """`build_demo`'s page settings, checked when made (a ValueError naming the argument).

    `height`, `width`: pixels, `None` = each model's native size (checked against a model by `frame_size`).
    `fps`: frames per second of the video shown. `max_seconds`: the longest video a person may ask for.
    `streaming`: stream one mp4 segment per chunk (`gr.Video(streaming=True)`), else send the whole video so far.
    """

    height: int | None = None
    width: int | None = None
    fps: int = 16
    max_seconds: int = 60
    max_concurrency: int = 2
    streaming: bool = False

    def __post_init__(self) -> None:
        for name in ("fps", "max_seconds", "max_concurrency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive whole number, got {value!r}.")

    @classmethod
    def names(cls) -> list[str]:
        return [field.name for field in fields(cls)]

"""Every value the demo takes, checked before any work: the Generate form's fields and `build_demo`'s settings.

Gradio's own preprocessing is off for the Generate event, so a field arrives raw (a number, the text of one, or
anything a caller of the API sends) and is checked here. A bad field raises `DemoInputError` (a ValueError) whose
message starts with the field's label, says what to type and repeats what was typed: "Seed: type a whole number
from 0 to 4294967295, got -1.". A bad `build_demo` setting raises a ValueError naming the argument.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Any

from ..caching.layout import POSITION_MODES
from ..pipelines.text_encoding import check_prompts

EXAMPLE_PROMPTS = [
    "a red circle moving left",
    "a blue square moving up",
    "a green triangle moving right",
    "a yellow circle moving down",
]
MAX_SEED = 2**32 - 1  # what the Seed field's widget accepts

# The Advanced fields: the pipeline's cache option each one sets, and its label.
CACHE_FIELDS = {"chunk_frames": "Chunk frames", "sink_frames": "Sink frames", "window_frames": "Window frames"}


class DemoInputError(ValueError):
    """A demo field holds a value the demo cannot use; the message names the field and says what to type."""


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
    label = "Length (seconds)"
    seconds = _number(label, value)
    if not 0 < seconds <= max_seconds:
        raise DemoInputError(f"{label}: type a number above 0 and at most {max_seconds:g}, got {value!r}.")
    return float(seconds)


def parse_prompt(value: Any, label: str = "Prompt") -> str:
    """The prompt's text without surrounding spaces; an empty one is refused with an example to type."""
    if value is not None and not isinstance(value, str):
        raise DemoInputError(f"{label}: type some words, got {value!r}.")
    prompt = (value or "").strip()
    if not prompt:
        raise DemoInputError(f"{label}: type a prompt first, for example “{EXAMPLE_PROMPTS[0]}”.")
    return prompt


def parse_steps(value: Any) -> list[int] | None:
    """Denoising steps typed as "1000, 750, 500, 250" (or sent as a list); empty means the model's own."""
    label = "Denoising steps"
    if _is_empty(value):
        return None
    parts = re.split(r"[,\s]+", value.strip()) if isinstance(value, str) else value
    if not isinstance(parts, (list, tuple)):
        raise DemoInputError(f"{label}: type decreasing numbers from 1000 down, such as 1000, 750, 500, 250.")
    steps = [parse_whole_number(label, part, 1, 1000) for part in parts if part != ""]
    if not steps or any(a <= b for a, b in zip(steps, steps[1:])):
        raise DemoInputError(f"{label}: type strictly decreasing numbers in 1..1000, such as 1000, 750, 500, 250.")
    return steps


def parse_position_mode(value: Any) -> str | None:
    """One of the cache's position modes; empty means the model's own."""
    if value not in (None, "", *POSITION_MODES):
        raise DemoInputError(f"Position mode: choose one of {', '.join(POSITION_MODES)}, got {value!r}.")
    return value or None


def prompt_notes(pipe, prompt: str, name: str = "prompt") -> list[str]:
    """What the model's tokenizer will not read in `prompt`, as the pipeline reports it (unknown words, truncation).

    Raises:
        ValueError: the tokenizer knows no word of `prompt` (the pipeline would refuse it too).
    """
    tokenizer = getattr(pipe, "tokenizer", None)
    if tokenizer is None:
        return []
    return check_prompts(tokenizer, [prompt], pipe.config.max_sequence_length, name)


# ---------------------------------------------------------------------------------------- the Advanced section
@dataclass(frozen=True)
class ChunkSettings:
    """The Advanced section: cache geometry in latent frames, denoising steps, position mode; `None` = the model's."""

    chunk_frames: int | None = None
    sink_frames: int | None = None
    window_frames: int | None = None
    denoising_steps: list[int] | None = None
    position_mode: str | None = None

    @classmethod
    def parse(cls, chunk: Any, sink: Any, window: Any, steps: Any, position_mode: Any) -> ChunkSettings:
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

    @classmethod
    def of_model(cls, pipe) -> ChunkSettings:
        """The model's own values, from its registered config (`None`: it has no such option, or it is unbounded)."""
        own = {name: pipe.config[name] for name in (*CACHE_FIELDS, "position_mode") if name in pipe.cache_options}
        return cls(denoising_steps=list(pipe.config.denoising_steps), **own)


# ---------------------------------------------------------------------------------------- the Generate form
@dataclass(frozen=True)
class GenerateFields:
    """The Generate form as typed: one raw value per field, in the page's order. The field names are the
    `/generate` API's argument names; an argument an API caller leaves out is `None` (the model's own setting,
    seed 0)."""

    prompt: Any = None
    seconds: Any = None
    seed: Any = None
    model: Any = None
    chunk_frames: Any = None
    sink_frames: Any = None
    window_frames: Any = None
    denoising_steps: Any = None
    position_mode: Any = None

    @classmethod
    def names(cls) -> list[str]:
        return [field.name for field in fields(cls)]

    def check(self, max_seconds: float) -> GenerateConfig:
        """The checked values; the first bad field raises `DemoInputError` (the page's fields in order)."""
        return GenerateConfig(
            prompt=parse_prompt(self.prompt),
            seconds=parse_seconds(self.seconds, max_seconds),
            seed=parse_whole_number("Seed", 0 if self.seed is None else self.seed, 0, MAX_SEED),
            model=None if _is_empty(self.model) else self.model,
            settings=ChunkSettings.parse(
                self.chunk_frames, self.sink_frames, self.window_frames, self.denoising_steps, self.position_mode
            ),
        )


@dataclass(frozen=True)
class GenerateConfig:
    """One generation, checked: what to make (`model` None = the demo's first model) and how."""

    prompt: str
    seconds: float
    seed: int
    model: str | None = None
    settings: ChunkSettings = ChunkSettings()


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

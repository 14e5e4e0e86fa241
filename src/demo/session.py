"""What a browser session does, without Gradio: the live prompt, the model shelf, the chunks and what they cost.

One pipeline per model (read-only weights) serves every session at once, without a lock: each generation owns its
stream (KV cache, VAE feature cache, scheduler) and its random generator, and the model passes per-call state down
the call, so sessions never see each other's frames.

A live prompt switch lands at the next chunk boundary, where the chunk loop re-encodes the text and re-caches the
recent window (LongLive's re-cache), exactly as a `prompt_schedule` switch at that frame would: `LivePrompt.applied`
is the `prompt_schedule` that reproduces the video. Each chunk's time and the cache's `memory_bytes()` are
recorded against the chunk index: both should be flat lines, which is the point of a rolling cache.

A video can start from a picture (image-to-video) or follow an input video (video-to-video): an uploaded clip, or
the session's webcam. Webcam frames arrive one by one from the browser, in another thread than the generation's;
a `FrameQueue` hands them over: the stream reads it as any iterator of frames (the pipeline resizes them), and the
input, so the video, ends when the webcam stops (`close`), when no frame comes for a while (a closed tab), or when
the video reaches its length.

All contact with the pipeline's stream internals is in one class, `LiveStream` (marked below); everything else
uses the pipeline's public API.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..defaults import embedded_models, load_pipeline, native_size
from ..pipelines.io.video_writer import frames_to_uint8
from .fields import (
    WEBCAM_LABEL,
    ChunkSettings,
    DemoInputError,
    DemoSettings,
    GenerateConfig,
    prompt_notes,
    prompt_warnings,
    relabel,
)


# ---------------------------------------------------------------------------------------- the live prompt
class LivePrompt:
    """The prompt of one running generation: switched from any thread, taken as each chunk starts.

    `switch` may be called from any thread; the switch lands at the next chunk that starts (several switches
    before it: the latest wins). `applied` lists `(frame, prompt)` for every prompt the video actually used: the
    `prompt_schedule` that reproduces it, with `cuts` its `scene_cuts` (the frames of the switches that were cuts).
    """

    def __init__(self, prompt: str) -> None:
        self.prompt = prompt  # the first one
        self._lock = threading.Lock()
        self._prompts = [(prompt, False)]  # every (prompt, scene cut) asked for; the latest is taken at the next chunk
        self._active = 0
        self._asked_frame = -1  # the start frame of the latest chunk that took its prompt
        self.last_chunk_start: int | None = None  # pixel frame the video's last chunk starts at, once known
        self.applied: list[tuple[int, str]] = [(0, prompt)]
        self.cuts: list[int] = []
        self.notes: list[str] = []  # what the tokenizer did not read in the prompts switched to

    def switch(self, prompt: str, notes: list[str] = (), scene_cut: bool = False) -> bool:
        """Take `prompt` at the next chunk (as a hard cut with `scene_cut`); False (and nothing changes) if the last
        chunk has already started."""
        with self._lock:
            if self.last_chunk_start is not None and self._asked_frame >= self.last_chunk_start:
                return False
            self._prompts.append((prompt, scene_cut))
            self.notes.extend(notes)
            return True

    def at_chunk(self, frame: int) -> tuple[int, str, bool]:
        """Called as each chunk starts, with its first pixel frame: `(switch number, prompt, scene cut)` for that
        chunk.

        The switch number grows by one per switch taken (0: the first prompt), so a switch to the same text is
        still a switch (re-encoded and re-cached, as in a `prompt_schedule`). A switch taken is added to `applied`.
        """
        with self._lock:
            self._asked_frame = frame
            latest = len(self._prompts) - 1
            prompt, cut = self._prompts[latest]
            if latest != self._active:
                self._active = latest
                self.applied.append((frame, prompt))
                if cut:
                    self.cuts.append(frame)
            return latest, prompt, cut


# ---------------------------------------------------------------------------------------- the webcam
class FrameQueue:
    """Frames pushed one by one from any thread (the browser's webcam), read by one stream as an iterator.

    Bounded: when the reader falls behind, the oldest frame is dropped (`frames_dropped`), so a live input follows
    the camera instead of lagging ever further behind it. The reader blocks until a frame comes; its iteration
    ends once the queued frames are read after `close()` (the webcam stopped), or when no frame has come for
    `idle_seconds` (`first_frame_seconds` for the first one: the person may still be starting the camera). An
    ended queue stays ended; `push` then returns False and keeps nothing.
    """

    def __init__(self, max_frames: int = 64, idle_seconds: float = 10.0, first_frame_seconds: float = 60.0) -> None:
        for name, value in (("max_frames", max_frames), ("idle_seconds", idle_seconds),
                            ("first_frame_seconds", first_frame_seconds)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"`{name}` must be a positive number, got {value!r}.")
        if not isinstance(max_frames, int):
            raise ValueError(f"`max_frames` must be a whole number, got {max_frames!r}.")
        self.idle_seconds = float(idle_seconds)
        self.first_frame_seconds = float(first_frame_seconds)
        self._frames: deque = deque(maxlen=max_frames)
        self._changed = threading.Condition()
        self._closed = False
        self.frames_pushed = 0  # taken in (dropped ones included)
        self.frames_dropped = 0  # pushed out unread by newer frames
        self.frames_read = 0

    def push(self, frame: Any) -> bool:
        """Queue one `(H, W, 3)` frame (the newest); False, keeping nothing, once the input has ended."""
        with self._changed:
            if self._closed:
                return False
            if len(self._frames) == self._frames.maxlen:
                self.frames_dropped += 1
            self._frames.append(frame)
            self.frames_pushed += 1
            self._changed.notify_all()
            return True

    def close(self) -> None:
        """End the input: the reader gets the frames already queued, then the end."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def __iter__(self) -> FrameQueue:
        return self

    def __next__(self) -> Any:
        """The oldest queued frame, waiting for one if need be; StopIteration once the input has ended."""
        timeout = self.idle_seconds if self.frames_read else self.first_frame_seconds
        with self._changed:
            if not self._changed.wait_for(lambda: self._frames or self._closed, timeout=timeout):
                self._closed = True  # nothing came: the camera or the browser is gone
            if not self._frames:
                raise StopIteration
            self.frames_read += 1
            return self._frames.popleft()


# ---------------------------------------------------------------------------------------- one stream
@dataclass(frozen=True)
class VideoPlan:
    """What one stream makes: pixel frames and size, the seed, the cache settings, and what it starts from
    (`inputs`: `pipe.stream`'s `image=`, or `video=` and `strength=`; empty: text-to-video)."""

    num_frames: int
    height: int
    width: int
    seed: int = 0
    settings: ChunkSettings = field(default_factory=ChunkSettings)
    inputs: Mapping[str, Any] = field(default_factory=dict)


class LiveStream:
    """One generation's decoded chunks (a `ChunkStream`), following a `LivePrompt` as it changes.

    Before each chunk it asks the live prompt which switch is in effect at that chunk's first frame and, when
    it changed, hands it to the stream's `switch_prompt` (applied at that chunk boundary, with the re-cache).
    """

    def __init__(self, pipe, live: LivePrompt, plan: VideoPlan) -> None:
        """Checks every argument now (the pipeline's ValueError) and does no work yet."""
        self._pipe, self._live, self._switch = pipe, live, 0
        self._stream = pipe.stream(
            live.prompt, plan.num_frames, plan.height, plan.width,
            generator=torch.Generator("cpu").manual_seed(plan.seed), output_type="np",
            **plan.settings.stream_options(pipe), **plan.inputs,
        )  # fmt: skip
        live.last_chunk_start = self._stream.last_chunk_start

    def __iter__(self) -> LiveStream:
        return self

    def __next__(self) -> np.ndarray:
        """The next chunk's frames `(1, frames, height, width, 3)` in [0, 1]; StopIteration after the last."""
        stream = self._stream
        if stream.next_chunk >= stream.num_chunks:  # no chunk left for a switch to land on
            return next(stream)
        first_frame = self._pipe.latent_to_pixel_start(stream.request.geometry.chunk_start(stream.next_chunk))
        number, prompt, cut = self._live.at_chunk(first_frame)
        if number != self._switch:
            self._switch = number
            stream.switch_prompt(prompt, scene_cut=cut)
        return next(stream)

    def check_scene_cut(self) -> None:
        """Raise ValueError naming what this video's settings lack for a scene cut (`ChunkStream.check_scene_cut`)."""
        self._stream.check_scene_cut()

    def cache_bytes(self) -> int:
        """What the stream's KV caches (one per guidance branch) hold now, in bytes."""
        return self._stream.memory_bytes()

    @property
    def num_chunks(self) -> int:
        """The chunks the stream is planned to make (an input video that ends early ends it sooner)."""
        return self._stream.num_chunks

    @property
    def chunk_frames(self) -> int:
        """Latent frames per chunk, as the stream resolved them (the field's, else the recipe's or the model's): a
        chunk's own, not the cache's span of the chunks in flight (pipelined denoising) or of a longer first one."""
        return self._stream.request.geometry.chunk_frames

    @property
    def recipe(self) -> str | None:
        """The recipe the stream runs (the field's, else the one the model's folder names; None: no recipe)."""
        return self._stream.request.recipe

    @staticmethod
    def check_frame_size(pipe, height: int, width: int) -> None:
        """Refuse a frame size `pipe.stream` would refuse (multiples of VAE factor x patch), with its message."""
        pipe.check_size("height", height)
        pipe.check_size("width", width)


@dataclass
class Chunk:
    """One generated chunk: its frames `(frames, height, width, 3)` uint8 and what making it cost."""

    frames: np.ndarray
    seconds: float  # model and decoder time for this chunk
    cache_bytes: int  # the KV cache's `memory_bytes()` after this chunk


def generate_frames(
    pipe,
    live: LivePrompt,
    num_frames: int,
    height: int,
    width: int,
    seed: int,
    settings: ChunkSettings | None = None,
    inputs: Mapping[str, Any] | None = None,
) -> Iterator[Chunk]:
    """Each chunk of the video, following `live`'s prompt as it changes; `settings` None: the model's own.

    `inputs`: what the video starts from, as `pipe.stream` takes it: `{"image": picture}`, or `{"video": clip,
    "strength": 0.8}` where the clip is a path, an array or any iterator of frames (a `FrameQueue`); the video
    then ends with the input. Checks every argument now (raising the pipeline's ValueError) and returns the
    generator of chunks.
    """
    return _timed(_live_stream(pipe, live, num_frames, height, width, seed, settings, inputs))


def _live_stream(pipe, live, num_frames, height, width, seed, settings=None, inputs=None) -> LiveStream:
    plan = VideoPlan(num_frames, height, width, seed, settings or ChunkSettings(), dict(inputs or {}))
    return LiveStream(pipe, live, plan)


def _timed(stream: LiveStream, stopped: threading.Event | None = None) -> Iterator[Chunk]:
    while stopped is None or not stopped.is_set():
        start = time.perf_counter()
        frames = next(stream, None)  # (1, frames, height, width, 3) in [0, 1]
        if frames is None:
            return
        seconds = time.perf_counter() - start
        frames = frames_to_uint8(frames[0])
        yield Chunk(frames, seconds, stream.cache_bytes())


def frame_size(pipe, settings: DemoSettings) -> tuple[int, int]:
    """`(height, width)` in pixels for `pipe`: the settings', else the model's native size; DemoInputError if the
    model cannot make it."""
    native_height, native_width = native_size(pipe)
    height = native_height if settings.height is None else settings.height
    width = native_width if settings.width is None else settings.width
    try:
        LiveStream.check_frame_size(pipe, height, width)
    except ValueError as exc:
        raise DemoInputError(f"this model cannot make {height}x{width} frames: {exc}") from exc
    return height, width


def streaming_available() -> bool:
    """Gradio's streaming video output needs ffmpeg and ffprobe on the PATH."""
    return bool(shutil.which("ffmpeg") and shutil.which("ffprobe"))


# ---------------------------------------------------------------------------------------- models
class ModelShelf:
    """The pipelines the demo can switch between, each loaded once on first use and shared by every session."""

    def __init__(self, sources: Mapping[str, Any]) -> None:
        """`sources`: name -> a loaded pipeline, or a function of no arguments that loads it."""
        if not sources:
            raise ValueError("the demo needs at least one model; none was given and none is embedded.")
        self.names = list(sources)
        self._sources = dict(sources)
        self._loaded: dict[str, Any] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_demo(
        cls,
        model_path: str | Path | None = None,
        pipeline=None,
        models: Mapping[str, Any] | None = None,
        device: str | None = None,
        dtype: str | None = None,
    ) -> ModelShelf:
        """`models` if given, else `pipeline`, else the model at `model_path`, else every embedded model."""
        if models is None and pipeline is not None:
            models = {"pipeline": pipeline}
        elif models is None and model_path is not None:
            models = {str(model_path): _loader(model_path, device, dtype)}
        elif models is None:
            models = {name: _loader(name, device, dtype) for name in embedded_models()}
        return cls(models)

    def get(self, name: str):
        """The pipeline called `name`, loaded now if it is the first time; DemoInputError for an unknown name."""
        if name not in self._sources:
            raise DemoInputError(f"Model: choose one of {', '.join(self.names)}, got {name!r}.")
        with self._lock:  # two sessions asking for a model at once load it once
            if name not in self._loaded:
                source = self._sources[name]
                pipe = source() if callable(source) and not hasattr(source, "components") else source
                pipe.set_progress_bar_config(disable=True)
                self._loaded[name] = pipe
            return self._loaded[name]


def _loader(name: str | Path, device: str | None, dtype: str | None) -> Callable[[], Any]:
    return lambda: load_pipeline(name, device=device, dtype=dtype)


# ---------------------------------------------------------------------------------------- one Generate press
INPUT_NOTES = {  # what a run starts from, said with it (an upload the page refused is no input: say so)
    "text": "Text-to-video: no start image or input video (a file the uploader refused is not used).",
    "image": "Image-to-video: from the start image.",
    "clip": "Video-to-video: from the input video.",
    "webcam": "Video-to-video: from your webcam.",
}


class Generation:
    """One video for one session: its model, its live prompt, its input, its chunks so far and their statistics."""

    def __init__(self, shelf: ModelShelf, config: GenerateConfig, settings: DemoSettings) -> None:
        """Checks everything before any work: a DemoInputError naming the field (the pipeline's refusals are
        relabelled with the fields' labels: `relabel`).

        The pipeline checks the prompt once, as the stream is made: what its tokenizer will not read (unknown
        words, truncation) becomes `notes`, said with the video, not refused. With the webcam as input, `webcam`
        is the `FrameQueue` the browser's frames go to (`push_webcam_frame`).
        """
        self.model = config.model or shelf.names[0]
        self.pipe = shelf.get(self.model)
        self.height, self.width = frame_size(self.pipe, settings)
        self.fps = settings.fps
        self.live = LivePrompt(config.prompt)
        self.inputs = config.inputs
        self.webcam = FrameQueue() if config.inputs.webcam else None
        try:
            self.num_frames = self.pipe.num_frames_for(
                config.seconds, settings.fps, chunk_frames=config.settings.chunk_frames, image=config.inputs.image,
                recipe=config.settings.recipe,
            )  # fmt: skip
            with prompt_warnings() as self.notes:  # the stream's own prompt check: each warning issued once
                stream = _live_stream(
                    self.pipe, self.live, self.num_frames, self.height, self.width, config.seed, config.settings,
                    config.inputs.stream_arguments(self.webcam),
                )  # fmt: skip
        except DemoInputError:
            raise
        except ValueError as exc:  # the pipeline's rule, in the words of the field it is about
            raise relabel(exc, config.inputs.labels) from exc
        self.seconds = config.seconds
        self.form_notes = list(config.notes)  # what the form changed (a length clamped to the longest)
        self.stream = stream
        self.num_chunks = stream.num_chunks
        self.chunk_frames = stream.chunk_frames
        self.recipe = stream.recipe
        self._stopped = threading.Event()
        self._chunks = _timed(stream, self._stopped)
        self.chunk_seconds: list[float] = []  # per chunk made so far
        self.chunk_cache_bytes: list[int] = []
        self.frames_written = 0
        self.frames_per_second = 0.0

    def __iter__(self) -> Iterator[Chunk]:
        """The chunks as they are made, each counted in the statistics before it is handed on.

        Raises:
            DemoInputError: the webcam ended (stopped, or silent) before it sent the frames of one chunk.
        """
        start = time.perf_counter()
        for chunk in self._chunks:
            self.chunk_seconds.append(chunk.seconds)
            self.chunk_cache_bytes.append(chunk.cache_bytes)
            self.frames_written += len(chunk.frames)
            self.frames_per_second = self.frames_written / (time.perf_counter() - start)
            yield chunk
        if self.webcam is not None and self.frames_written == 0 and not self.stopped:
            raise DemoInputError(
                f"{WEBCAM_LABEL}: it sent {self.webcam.frames_pushed} frame(s) before it stopped, too few for one "
                "chunk. Start the webcam (its Record button), then press Generate, and keep it running."
            )

    def close(self) -> None:
        """The generation is over (ended, stopped or replaced): its webcam input ends, later frames are dropped."""
        if self.webcam is not None:
            self.webcam.close()

    def stop(self) -> None:
        """End the video after the chunk being made (what was made is kept, and shown as the finished video); its
        webcam input ends too."""
        self._stopped.set()
        self.close()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def plan_note(self) -> str:
        """What this run makes, said before its first chunk: "4 s -> 66 frames, whole chunks of 3 latent frames
        (6 chunks) at 16 fps.", then the input it starts from and what the form changed (a clamped length)."""
        chunks = f"{self.num_chunks} chunk{'s' if self.num_chunks != 1 else ''}"
        length = (
            f"{self.seconds:g} s -> {self.num_frames} frames, whole chunks of {self.chunk_frames} latent "
            f"frame{'s' if self.chunk_frames != 1 else ''} "
            f"({chunks}) at {self.fps} fps."
        )
        recipe = [] if self.recipe is None else [f"Recipe: {self.recipe} (the Advanced fields you set win)."]
        return " ".join([length, *recipe, INPUT_NOTES[self.inputs.kind], *self.form_notes])

    def details(self) -> dict[str, Any]:
        """The run so far, as the page's JSON shows it."""
        return {
            "model": self.model,
            "recipe": self.recipe,
            "frames": f"{self.frames_written} / {self.num_frames}",
            "size": f"{self.height}x{self.width} at {self.fps} fps",
            "frames_per_second": round(self.frames_per_second, 2),
            "cache_bytes": self.chunk_cache_bytes[-1],
            "prompt_schedule": [[frame, text] for frame, text in self.live.applied],
            "scene_cuts": list(self.live.cuts),
            "prompt_notes": self.notes + self.live.notes,
            **self._input_details(),
        }

    def _input_details(self) -> dict[str, Any]:
        details: dict[str, Any] = {"input": self.inputs.kind}
        if self.inputs.kind in ("clip", "webcam"):
            details["strength"] = self.inputs.strength
        if self.webcam is not None:
            details["webcam_frames"] = {"received": self.webcam.frames_pushed, "dropped": self.webcam.frames_dropped}
        return details

    def tables(self):
        """The two plots' data: chunk number (1 = the first, as the status line counts) against milliseconds and
        against cache KiB (pandas DataFrames)."""
        import pandas as pd  # Gradio's plots take DataFrames; pandas comes with Gradio

        index = list(range(1, len(self.chunk_seconds) + 1))  # chunk 1 is the first, as the status line counts
        times = pd.DataFrame({"chunk": index, "milliseconds": [round(s * 1000.0, 2) for s in self.chunk_seconds]})
        memory = pd.DataFrame({"chunk": index, "KiB": [round(b / 1024.0, 2) for b in self.chunk_cache_bytes]})
        return times, memory


@dataclass
class DemoSession:
    """What one browser session owns: its running generation, if any (what a prompt switch and the webcam's frames
    steer)."""

    generation: Generation | None = field(default=None)

    @contextmanager
    def steering(self, generation: Generation) -> Iterator[Generation]:
        """While the block runs, prompt switches and webcam frames of this session go to `generation` (unless a
        newer one starts); when it ends, however it ends, so does its webcam input."""
        self.generation = generation
        try:
            yield generation
        finally:
            generation.close()
            if self.generation is generation:
                self.generation = None


def push_webcam_frame(frame: Any, session: DemoSession) -> bool:
    """Hand one webcam frame `(H, W, 3)` to the session's running webcam generation; False if none takes it (no
    generation, one not fed by the webcam, or one whose input has ended): frames before Generate are not kept."""
    generation = session.generation
    if frame is None or generation is None or generation.webcam is None:
        return False
    return generation.webcam.push(frame)


def stop_generation(session: DemoSession) -> str:
    """Stop: the session's running video ends after the chunk being made; returns what to tell the person."""
    generation = session.generation
    if generation is None:
        return "Nothing is generating."
    generation.stop()
    return "Stopping after the chunk being made."


def stop_webcam(session: DemoSession) -> None:
    """The webcam stopped: the running generation's input ends, so the video ends after the frames already sent."""
    generation = session.generation
    if generation is not None:
        generation.close()


def switch_prompt(prompt: Any, session: DemoSession, scene_cut: bool = False) -> str:
    """Switch the session's running video to `prompt` at its next chunk (a hard cut with `scene_cut`); returns what
    to tell the person."""
    prompt = prompt.strip() if isinstance(prompt, str) else ""
    if not prompt:
        return "Type the prompt to switch to."
    generation = session.generation
    if generation is None:
        return "Nothing is generating: press Generate first."
    try:
        notes = prompt_notes(generation.pipe, prompt, "switch prompt")
        if scene_cut:
            generation.stream.check_scene_cut()
    except ValueError as exc:  # no word the model knows, or settings a cut cannot run with: nothing changes
        return f"Not {'cutting' if scene_cut else 'switching'}: {exc}"
    if not generation.live.switch(prompt, notes, scene_cut):
        return "Too late to switch: the last chunk is being made. Press Generate to start with it."
    action = "Cutting" if scene_cut else "Switching"
    return " ".join([f"{action} to “{prompt}” at the next chunk.", *notes])


def cut_to_prompt(prompt: Any, session: DemoSession) -> str:
    """`switch_prompt` as a hard scene cut (Infinity-RoPE's: needs the relative position mode)."""
    return switch_prompt(prompt, session, scene_cut=True)

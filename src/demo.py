"""Gradio demo: type a prompt, watch the video appear chunk by chunk, switch the prompt while it runs.

One pipeline per model (read-only weights) serves every browser session at once, without a lock: each
generation owns its `StreamState` (KV cache, VAE feature cache, scheduler) and its random generator, and the
model passes per-call state down the call, so sessions never see each other's frames.

Live prompt switching runs the pipeline's own `stream` with a `LivePrompt` in place of its fixed
`PromptSchedule`: the chunk loop asks the schedule for the active prompt at every chunk boundary, and on a
change it re-encodes the text and re-caches the recent window (LongLive's re-cache), exactly as a
`prompt_schedule` switch at that frame would.

While a video generates the page plots each chunk's time and the cache's `memory_bytes()` against the chunk
index: both should be flat lines, which is the point of a rolling cache.

Every field is checked before any work (`parse_*`, raising `DemoInputError`, shown as a `gr.Error`); Gradio's
own preprocessing is off for the generate event so a bad value reaches those checks instead of failing inside
Gradio with a generic "exception". Importing this module starts nothing: `build_demo(...)` returns the
`gr.Blocks`, `launch(demo, host, port)` checks the address and serves it.
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import imageio_ffmpeg
import numpy as np
import torch

from .caching.layout import POSITION_MODES
from .defaults import embedded_models, frames_for_seconds, load_pipeline, native_size
from .pipelines import StreamingVideoWriter
from .pipelines.chunked_video import StreamState
from .pipelines.text_encoding import check_prompts

EXAMPLE_PROMPTS = [
    "a red circle moving left",
    "a blue square moving up",
    "a green triangle moving right",
    "a yellow circle moving down",
]
MAX_SEED = 2**32 - 1


class DemoInputError(ValueError):
    """A demo field holds a value the demo cannot use; the message names the field and says what to type."""


# ---------------------------------------------------------------------------------------- checking the fields
def _number(label: str, value: Any) -> float:
    """A finite number from a field's raw value (a number or the text of one)."""
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise DemoInputError(f"{label}: type a number, got {value!r}.") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DemoInputError(f"{label}: type a number, got {value!r}.")
    if not math.isfinite(value):
        raise DemoInputError(f"{label}: type a finite number, got {value!r}.")
    return value


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
    if value is not None and not isinstance(value, str):
        raise DemoInputError(f"{label}: type some words, got {value!r}.")
    prompt = (value or "").strip()
    if not prompt:
        raise DemoInputError(f"{label}: type a prompt first, for example “{EXAMPLE_PROMPTS[0]}”.")
    return prompt


def parse_steps(value: Any) -> list[int] | None:
    """Denoising steps typed as "1000, 750, 500, 250"; empty means the model's own."""
    label = "Denoising steps"
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    parts = re.split(r"[,\s]+", value.strip()) if isinstance(value, str) else value
    if not isinstance(parts, (list, tuple)):
        raise DemoInputError(f"{label}: type decreasing numbers from 1000 down, such as 1000, 750, 500, 250.")
    steps = [parse_whole_number(label, part, 1, 1000) for part in parts if part != ""]
    if not steps or any(a <= b for a, b in zip(steps, steps[1:])):
        raise DemoInputError(f"{label}: type strictly decreasing numbers in 1..1000, such as 1000, 750, 500, 250.")
    return steps


def prompt_notes(pipe, prompt: str, name: str = "prompt") -> list[str]:
    """What the model's tokenizer will not read in `prompt`, as the pipeline reports it (unknown words, truncation).

    Raises:
        ValueError: the tokenizer knows no word of `prompt` (the pipeline would refuse it too).
    """
    tokenizer = getattr(pipe, "tokenizer", None)
    if tokenizer is None:
        return []
    return check_prompts(tokenizer, [prompt], pipe.config.max_sequence_length, name)


# The Advanced fields: the pipeline's cache option each one sets, and its label.
CACHE_FIELDS = {"chunk_frames": "Chunk frames", "sink_frames": "Sink frames", "window_frames": "Window frames"}


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
            empty = value is None or (isinstance(value, str) and not value.strip())
            return None if empty else parse_whole_number(CACHE_FIELDS[name], value, lowest)

        if position_mode not in (None, "", *POSITION_MODES):
            raise DemoInputError(f"Position mode: choose one of {', '.join(POSITION_MODES)}, got {position_mode!r}.")
        return cls(
            chunk_frames=optional("chunk_frames", chunk, 1),
            sink_frames=optional("sink_frames", sink, 0),
            window_frames=optional("window_frames", window, 1),
            denoising_steps=parse_steps(steps),
            position_mode=position_mode or None,
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


# ---------------------------------------------------------------------------------------- generation
class LivePrompt:
    """The prompt of one running generation, read at every chunk boundary; duck-types `PromptSchedule`.

    `switch` may be called from any thread; the switch lands at the next chunk that starts. `applied` lists
    `(frame, prompt)` for every prompt the video actually used: the `prompt_schedule` that reproduces it.
    """

    batch_size = 1

    def __init__(self, prompt: str) -> None:
        self._lock = threading.Lock()
        self._prompts = [prompt]
        self._active = 0
        self._asked_frame = -1  # the start frame of the latest chunk the loop asked about
        self.last_chunk_start: int | None = None  # pixel frame the video's last chunk starts at, once known
        self.applied: list[tuple[int, str]] = [(0, prompt)]
        self.notes: list[str] = []  # what the tokenizer did not read in the prompts switched to

    def switch(self, prompt: str, notes: list[str] = ()) -> bool:
        """Take `prompt` at the next chunk; False (and nothing changes) if the last chunk has already started."""
        with self._lock:
            if self.last_chunk_start is not None and self._asked_frame >= self.last_chunk_start:
                return False
            self._prompts.append(prompt)
            self.notes.extend(notes)
            return True

    def active_index(self, frame: int) -> int:
        """Called by the chunk loop with the pixel frame each chunk starts at: the latest prompt wins."""
        with self._lock:
            self._asked_frame = frame
            latest = len(self._prompts) - 1
            if latest != self._active:
                self._active = latest
                self.applied.append((frame, self._prompts[latest]))
            return latest

    def prompts(self, index: int) -> list[str]:
        with self._lock:
            return [self._prompts[index]]

    may_switch = True  # switches can come at any chunk: the chunk loop keeps what a re-cache needs


@dataclass
class Chunk:
    """One generated chunk: its frames `(frames, height, width, 3)` uint8 and what making it cost."""

    frames: np.ndarray
    seconds: float  # model and decoder time for this chunk
    cache_bytes: int  # the KV cache's `memory_bytes()` after this chunk


@dataclass
class DemoSession:
    """What one browser session owns: the prompt of its running generation and its pipeline, if any."""

    live: LivePrompt | None = None
    pipe: Any = None


def generate_frames(
    pipe,
    live: LivePrompt,
    num_frames: int,
    height: int,
    width: int,
    seed: int,
    settings: ChunkSettings = ChunkSettings(),
) -> Iterator[Chunk]:
    """Each chunk of the video, following `live`'s prompt as it changes.

    Checks every argument now (raising the pipeline's ValueError) and returns the generator of chunks. Sessions
    share `pipe` without a lock: each stream's caches, decoder and scheduler live in its own `StreamState`.
    """
    state = StreamState()  # this video's own caches (what the memory plot reads) and decoder
    chunks = pipe.stream(
        live.prompts(0), num_frames, height, width, denoising_steps=settings.denoising_steps,
        generator=torch.Generator("cpu").manual_seed(seed), output_type="np", state=state,
        **settings.cache_options(pipe),
    )  # fmt: skip
    state.run.schedule = live  # the chunk loop asks it for the active prompt at every chunk boundary
    live.last_chunk_start = pipe._latent_to_pixel_start(state.run.num_latent_frames - state.run.chunk_shape[2])
    return _timed(chunks, state)


def _timed(chunks: Iterator[np.ndarray], state: StreamState) -> Iterator[Chunk]:
    while True:
        start = time.perf_counter()
        frames = next(chunks, None)  # (1, frames, height, width, 3) in [0, 1]
        if frames is None:
            return
        seconds = time.perf_counter() - start
        frames = (frames[0] * 255.0).round().clip(0, 255).astype(np.uint8)
        yield Chunk(frames, seconds, sum(cache.memory_bytes() for cache in state.caches))


def concat_mp4(segments: list[Path], out: Path) -> Path:
    """Join mp4 segments of the same size and codec into `out` without re-encoding."""
    listing = out.with_suffix(".txt")
    listing.write_text("".join(f"file '{segment.resolve()}'\n" for segment in segments))
    command = [imageio_ffmpeg.get_ffmpeg_exe(), "-y", "-v", "error", "-f", "concat", "-safe", "0"]
    subprocess.run([*command, "-i", str(listing), "-c", "copy", str(out)], check=True, capture_output=True)
    return out


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

    def get(self, name: str):
        if name not in self._sources:
            raise DemoInputError(f"Model: choose one of {', '.join(self.names)}, got {name!r}.")
        with self._lock:  # two sessions asking for a model at once load it once
            if name not in self._loaded:
                source = self._sources[name]
                pipe = source() if callable(source) and not hasattr(source, "components") else source
                pipe.set_progress_bar_config(disable=True)
                self._loaded[name] = pipe
            return self._loaded[name]


def _check_size(pipe, height: int, width: int) -> None:
    """Refuse a frame size this model cannot make (the pipeline's own rule: multiples of VAE factor x patch)."""
    _, patch_height, patch_width = pipe.transformer.config.patch_size
    pipe._check_size("height", height, patch_height)
    pipe._check_size("width", width, patch_width)


# ---------------------------------------------------------------------------------------- serving
def check_address(host: Any, port: Any) -> None:
    """Refuse, with a ValueError naming `host` or `port`, an address the demo could not serve on."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"`port` must be a whole number from 1 to 65535, got {port!r}.")
    if not isinstance(host, str) or not host.strip():
        raise ValueError(f"`host` must be an address of this machine such as 127.0.0.1 or 0.0.0.0, got {host!r}.")
    if re.fullmatch(r"[\d.]+", host):  # looks like IPv4: must be one (no name lookup for "999.1.1.1")
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise ValueError(f"`host` {host!r} is not a valid IPv4 address (four numbers 0-255).") from None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise ValueError(f"`host` {host!r} is not an address or a name this machine can resolve ({exc}).") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will
        try:
            probe.bind(address)
        except OSError as exc:
            raise ValueError(
                f"cannot serve on `host` {host!r} `port` {port}: {exc.strerror or exc}. Use a free port, and an "
                "address of this machine (127.0.0.1 for this machine only, 0.0.0.0 for every network)."
            ) from None


def launch(demo, host: str = "127.0.0.1", port: int = 7860, **launch_kwargs: Any):
    """Serve `demo` on `host:port` after checking the address (a ValueError before anything starts)."""
    check_address(host, port)
    return demo.launch(server_name=host, server_port=port, **launch_kwargs)


def _stats_tables(chunks: list[Chunk]):
    """The two plots' data: chunk index against milliseconds and against cache KiB."""
    import pandas as pd

    index = list(range(len(chunks)))
    times = pd.DataFrame({"chunk": index, "milliseconds": [round(c.seconds * 1000.0, 2) for c in chunks]})
    memory = pd.DataFrame({"chunk": index, "KiB": [round(c.cache_bytes / 1024.0, 2) for c in chunks]})
    return times, memory


def build_demo(
    model_path: str | Path | None = None,
    pipeline=None,
    max_concurrency: int = 2,
    *,
    models: Mapping[str, Any] | None = None,
    device: str | None = None,
    dtype: str | None = None,
    height: int | None = None,
    width: int | None = None,
    fps: int = 16,
    max_seconds: int = 60,
    streaming: bool | None = None,
):
    """The demo's `gr.Blocks`, queued with `max_concurrency` generations at once; `launch(demo)` serves it.

    Args:
        model_path: a pipeline folder or Hub id to serve. Ignored if `pipeline` or `models` is given.
        pipeline: an already loaded pipeline to serve (its weights are shared, read-only, by every session).
        models: name -> loaded pipeline (or a function loading one): the models the page can switch between.
            Default: every embedded model, loaded when first chosen.
        height, width: pixels; default: each model's native size.
        streaming: stream mp4 segments into a `gr.Video(streaming=True)`; default: when ffmpeg and ffprobe are on
            the PATH. Otherwise the whole video so far is sent again after every chunk.

    Raises:
        ValueError: a bad `fps`, `max_seconds`, `max_concurrency`, `height` or `width` (checked on the first model).
    """
    import gradio as gr

    for name, value in (("fps", fps), ("max_seconds", max_seconds), ("max_concurrency", max_concurrency)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a positive whole number, got {value!r}.")
    if models is None:
        if pipeline is not None:
            models = {"pipeline": pipeline}
        elif model_path is not None:
            models = {str(model_path): lambda: load_pipeline(model_path, device=device, dtype=dtype)}
        else:
            models = {name: _loader(name, device, dtype) for name in embedded_models()}
    shelf = ModelShelf(models)
    streaming = streaming_available() if streaming is None else streaming

    def frame_size(pipe) -> tuple[int, int]:
        native_height, native_width = native_size(pipe)
        size = (native_height if height is None else height, native_width if width is None else width)
        try:
            _check_size(pipe, *size)
        except ValueError as exc:
            raise DemoInputError(f"this model cannot make {size[0]}x{size[1]} frames: {exc}") from exc
        return size

    first = shelf.get(shelf.names[0])
    try:
        frame_size(first)
    except DemoInputError as exc:
        raise ValueError(f"`height`={height!r}, `width`={width!r}: {exc}") from exc

    def generate(
        prompt, seconds, seed=None, model=None, chunk_frames=None, sink_frames=None, window_frames=None,
        denoising_steps=None, position_mode=None, session: DemoSession | None = None,
    ):  # fmt: skip
        """Raw field values (an omitted API argument is None: the model's own setting)."""
        model_name = model or shelf.names[0]
        try:
            prompt = parse_prompt(prompt)
            seconds = parse_seconds(seconds, max_seconds)
            seed = parse_whole_number("Seed", 0 if seed is None else seed, 0, MAX_SEED)
            settings = ChunkSettings.parse(chunk_frames, sink_frames, window_frames, denoising_steps, position_mode)
            pipe = shelf.get(model_name)
            notes = prompt_notes(pipe, prompt)
            run_height, run_width = frame_size(pipe)
            num_frames = frames_for_seconds(pipe, seconds, fps, settings.chunk_frames)
            live = LivePrompt(prompt)
            chunks = generate_frames(pipe, live, num_frames, run_height, run_width, seed, settings)
        except ValueError as exc:  # ours and the pipeline's: each names the field or argument
            raise _refusal(gr, exc) from exc
        for note in notes:  # unknown words are ignored: say so where the person looks
            gr.Warning(note)
        session.live, session.pipe = live, pipe
        workdir = Path(tempfile.mkdtemp(prefix="rolldiff-demo-"))
        segments: list[Path] = []
        done: list[Chunk] = []
        written, start = 0, time.perf_counter()
        try:
            for index, chunk_out in enumerate(_reported(chunks, gr)):
                segment = workdir / f"segment-{index:05d}.mp4"
                with StreamingVideoWriter(segment, fps=fps) as writer:
                    writer.write(chunk_out.frames)
                segments.append(segment)
                done.append(chunk_out)
                written += len(chunk_out.frames)
                video = segment if streaming else concat_mp4(segments, workdir / f"video-{index:05d}.mp4")
                frames_per_second = written / (time.perf_counter() - start)
                details = {
                    "model": model_name,
                    "frames": f"{written} / {num_frames}",
                    "size": f"{run_height}x{run_width} at {fps} fps",
                    "frames_per_second": round(frames_per_second, 2),
                    "cache_bytes": chunk_out.cache_bytes,
                    "prompt_schedule": [[frame, text] for frame, text in live.applied],
                    "prompt_notes": notes + live.notes,
                }
                times, memory = _stats_tables(done)
                summary = (
                    f"**{frames_per_second:.1f} frames per second** · chunk {index + 1} took "
                    f"{chunk_out.seconds * 1000:.0f} ms · cache {chunk_out.cache_bytes / 1024:.1f} KiB"
                )
                memory = gr.LinePlot(memory, y_lim=[0, 1.5 * float(memory["KiB"].max())])  # the flat line mid-plot
                yield video, summary, times, memory, details
                if not streaming:  # Gradio copied it into its cache before asking for the next chunk
                    video.unlink()
        finally:
            if session.live is live:
                session.live, session.pipe = None, None
            shutil.rmtree(workdir, ignore_errors=True)

    def switch_prompt(prompt: str, session: DemoSession) -> str:
        prompt = (prompt or "").strip()
        if not prompt:
            return "Type the prompt to switch to."
        live, pipe = session.live, session.pipe
        if live is None:
            return "Nothing is generating: press Generate first."
        try:
            notes = prompt_notes(pipe, prompt, "switch prompt")
        except ValueError as exc:  # no word the model knows: keep the current prompt
            return f"Not switching: {exc}"
        if not live.switch(prompt, notes):
            return "Too late to switch: the last chunk is being made. Press Generate to start with it."
        return " ".join([f"Switching to “{prompt}” at the next chunk.", *notes])

    def model_defaults(model_name: str):
        """Show the chosen model's own settings as the Advanced fields' placeholders (empty = the model's)."""
        try:
            pipe = shelf.get(model_name)
            size = frame_size(pipe)
        except ValueError as exc:
            raise _refusal(gr, exc) from exc
        fields = _advanced_fields(pipe)
        return (
            _model_info(pipe, size),
            *(gr.Textbox(value="", **fields[name]) for name in CACHE_FIELDS),
            gr.Textbox(value="", **fields["denoising_steps"]),
            gr.Radio(value="", **fields["position_mode"]),
        )

    fields = _advanced_fields(first)
    with gr.Blocks(title="rolldiff") as demo:
        gr.Markdown(
            "# rolldiff\nLong videos chunk by chunk with a rolling KV cache. "
            "Change the prompt while it runs: the switch lands at the next chunk."
        )
        session = gr.State(DemoSession())
        with gr.Row():
            with gr.Column():
                with gr.Row():
                    model = gr.Dropdown(
                        shelf.names, value=shelf.names[0], label="Model", elem_id="model", scale=2,
                        interactive=len(shelf.names) > 1,
                    )  # fmt: skip
                    model_info = gr.Markdown(_model_info(first, frame_size(first)), elem_id="model-info")
                prompt = gr.Textbox(label="Prompt", value=EXAMPLE_PROMPTS[0], elem_id="prompt")
                with gr.Row(elem_id="examples"):  # set in the browser: no round trip, so Generate right after uses it
                    for text in EXAMPLE_PROMPTS:
                        example = gr.Button(text, size="sm", variant="secondary", min_width=80)
                        example.click(None, None, prompt, js=f"() => {json.dumps(text)}", api_visibility="private")
                seconds = gr.Slider(1, max_seconds, value=5, step=1, label="Length (seconds)", elem_id="seconds")
                seed = gr.Number(value=0, precision=0, label="Seed", minimum=0, maximum=MAX_SEED, elem_id="seed")
                with gr.Accordion("Advanced", open=False, elem_id="advanced"):
                    gr.Markdown(
                        "Cache geometry in latent frames (one latent frame is several video frames). "
                        "Leave a field empty for the model's own value."
                    )
                    with gr.Row():
                        chunk, sink, window = (
                            gr.Textbox("", label=CACHE_FIELDS[name], info=info, elem_id=name, **fields[name])
                            for name, info in (
                                ("chunk_frames", "made at once"),
                                ("sink_frames", "first frames, kept forever"),
                                ("window_frames", "recent frames seen, with the chunk"),
                            )
                        )
                    steps = gr.Textbox(
                        label="Denoising steps", elem_id="steps", **fields["denoising_steps"],
                        info="decreasing noise levels in 1..1000: fewer steps, faster chunks",
                    )  # fmt: skip
                    position_mode = gr.Radio(
                        value="", label="Position mode", elem_id="position_mode", **fields["position_mode"],
                        info="absolute: RoPE positions grow with the video; relative: re-indexed inside the window",
                    )  # fmt: skip
                with gr.Row():
                    generate_button = gr.Button("Generate", variant="primary", elem_id="generate")
                    stop_button = gr.Button("Stop", elem_id="stop")
                new_prompt = gr.Textbox(label="Switch prompt to", value=EXAMPLE_PROMPTS[1], elem_id="new-prompt")
                switch_button = gr.Button("Switch prompt", elem_id="switch")
                switch_status = gr.Markdown()
            with gr.Column():
                video = gr.Video(label="Video", streaming=streaming, autoplay=True, elem_id="video")
                summary = gr.Markdown(elem_id="summary")
                with gr.Row():
                    plot = dict(x="chunk", y_lim=[0, None], height=220, x_title="chunk")
                    time_plot = gr.LinePlot(y="milliseconds", title="Time per chunk", elem_id="time-plot", **plot)
                    memory_plot = gr.LinePlot(y="KiB", title="Cache memory", elem_id="memory-plot", **plot)
                details = gr.JSON(label="Run", open=False)
        inputs = [prompt, seconds, seed, model, chunk, sink, window, steps, position_mode, session]
        outputs = [video, summary, time_plot, memory_plot, details]
        # preprocess=False: raw field values reach `generate`'s checks (Gradio's would fail on "abc" or inf).
        run = generate_button.click(generate, inputs, outputs, api_name="generate", preprocess=False)
        stop_button.click(None, cancels=[run])
        model.change(
            model_defaults, model, [model_info, chunk, sink, window, steps, position_mode], api_name="select_model"
        )
        # Unlimited concurrency: a switch must never wait behind the generations it is meant to steer.
        switch = dict(fn=switch_prompt, inputs=[new_prompt, session], outputs=switch_status, concurrency_limit=None)
        switch_button.click(**switch, api_name="switch_prompt")
        new_prompt.submit(**switch, api_visibility="private")
        demo.queue(default_concurrency_limit=max_concurrency)
    return demo


def _model_info(pipe, size: tuple[int, int]) -> str:
    return f"{type(pipe).__name__}, {size[0]}x{size[1]} pixels"


def _advanced_fields(pipe) -> dict[str, dict[str, Any]]:
    """Each Advanced field's placeholder (the model's own value) and visibility (whether the model has it)."""
    own = ChunkSettings.of_model(pipe)

    def shown(name: str) -> str:
        value = getattr(own, name)
        return f"{'every earlier frame' if value is None else value} (the model's)"  # None: an unbounded window

    fields = {name: dict(placeholder=shown(name), visible=name in pipe.cache_options) for name in CACHE_FIELDS}
    fields["denoising_steps"] = dict(placeholder=", ".join(map(str, own.denoising_steps)) + " (the model's)")
    choices = [(f"the model's ({own.position_mode})", ""), *((mode, mode) for mode in POSITION_MODES)]
    fields["position_mode"] = dict(choices=choices, visible="position_mode" in pipe.cache_options)
    return fields


def _loader(name: str, device: str | None, dtype: str | None) -> Callable[[], Any]:
    return lambda: load_pipeline(name, device=device, dtype=dtype)


def _refusal(gr, exc: Exception):
    """A field the person must change: the message stays until closed, and the server log is not a traceback."""
    return gr.Error(str(exc), duration=None, print_exception=False)


def _reported(chunks: Iterator[Chunk], gr) -> Iterator[Chunk]:
    """The chunks; a ValueError or a NaN chunk (`FloatingPointError`) while making one is shown as a `gr.Error`."""
    while True:
        try:
            chunk = next(chunks, None)
        except (ValueError, FloatingPointError) as exc:
            raise gr.Error(str(exc)) from exc
        if chunk is None:
            return
        yield chunk

"""The demo's Gradio page: the layout, and the wiring of its events to the session logic (`session.py`).

Type a prompt, watch the video appear chunk by chunk beside two live plots (time per chunk, cache memory), switch
the prompt while it runs. A start image (image-to-video) or an input video (video-to-video: an uploaded clip, or
the webcam streamed frame by frame) can lead the video; the generated video shows beside the input.

Gradio's own preprocessing is off for the Generate event, so a bad value reaches the demo's checks (`fields.py`)
instead of failing inside Gradio with a generic "exception"; a refusal is shown as a `gr.Error` that names the
field. Uploaded files are taken only from Gradio's upload folder. `build_demo(...)` returns the `gr.Blocks` and
starts nothing.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import gradio as gr
from gradio.utils import get_upload_folder

from ..caching.layout import ALL_FRAMES, POSITION_MODES
from ..pipelines.request.conditioning import DEFAULT_STRENGTH
from ..recipes import list_recipes
from .fields import (
    CACHE_FIELDS,
    DEFAULT_SEED,
    EXAMPLE_PROMPTS,
    IMAGE_LABEL,
    LENGTH_LABEL,
    MAX_SEED,
    RECIPE_LABEL,
    STRENGTH_LABEL,
    VIDEO_LABEL,
    WEBCAM_LABEL,
    ChunkSettings,
    DemoInputError,
    DemoSettings,
    GenerateFields,
    relabel,
)
from .session import (
    DemoSession,
    Generation,
    ModelShelf,
    cut_to_prompt,
    frame_size,
    push_webcam_frame,
    stop_generation,
    stop_webcam,
    streaming_available,
    switch_prompt,
)
from .video import VideoSoFar

# Small webcam frames: the pipeline resizes every frame to the model's size anyway, and small ones upload quickly.
WEBCAM_CONSTRAINTS = {"video": {"width": {"ideal": 320}, "height": {"ideal": 240}}}
# The embedded models are tiny: their first frames (the first chunk, made from nothing) are where they err most.
WEAK_START_NOTE = (
    "The embedded models are tiny: their first frames are their weak spot (the first chunk can show a wrong "
    "colour or an empty frame before the prompt's shape settles in)."
)
PREVIEW_HEIGHT = 256  # the live preview's box: fixed, so the page never jumps while the video grows
# Whole-chunk ticks: Vega picks about one x tick per 40 px and a step of 1 or more once the axis spans at least
# width / 56 units, so an axis of 20+ chunks has whole ticks on plots up to 1100 px wide.
MIN_PLOT_CHUNKS = 21
# After a run, however it ended: a webcam still recording is stopped (its own Stop button), so it does not go on
# sending frames nobody reads.
STOP_WEBCAM_JS = """() => {
  const stop = [...document.querySelectorAll('#webcam button')].find((b) => b.innerText.trim() === 'Stop');
  if (stop) stop.click();
}"""
ADVANCED_INFO = {
    "chunk_frames": "made at once",
    "sink_frames": "first frames, kept forever",
    "window_frames": "recent frames seen, with the chunk",
}


def build_demo(
    model_path: str | Path | None = None,
    pipeline=None,
    max_concurrency: int = 2,
    *,
    models: Mapping[str, Any] | None = None,
    device: str | None = None,
    dtype: str | None = None,
    **settings: Any,
) -> gr.Blocks:
    """The demo's `gr.Blocks`, queued with `max_concurrency` generations at once; `launch(demo)` serves it.

    Args:
        model_path: a pipeline folder or Hub id to serve. Ignored if `pipeline` or `models` is given.
        pipeline: an already loaded pipeline to serve (its weights are shared, read-only, by every session).
        models: name -> loaded pipeline (or a function loading one): the models the page can switch between.
            Default: every embedded model, loaded when first chosen.
        device, dtype: where and in what dtype `model_path` or the embedded models load.
        **settings: `DemoSettings`' fields: `height`, `width` (pixels; default each model's native size), `fps`
            (16), `max_seconds` (60), `streaming` (stream mp4 segments into a `gr.Video(streaming=True)`; default:
            when ffmpeg and ffprobe are on the PATH, otherwise the whole video so far is sent after every chunk).

    Raises:
        ValueError: a bad `fps`, `max_seconds`, `max_concurrency`, `height` or `width` (checked on the first model).
        TypeError: a setting `DemoSettings` does not have.
    """
    page_settings = _settings(max_concurrency, settings)  # before any model loads
    shelf = ModelShelf.for_demo(model_path, pipeline, models, device, dtype)
    first = shelf.get(shelf.names[0])
    try:
        size = frame_size(first, page_settings)
    except DemoInputError as exc:
        raise ValueError(f"`height`={page_settings.height!r}, `width`={page_settings.width!r}: {exc}") from exc
    with gr.Blocks(title="rolldiff") as demo:
        gr.Markdown(
            "# rolldiff\nLong videos chunk by chunk with a rolling KV cache. "
            "Change the prompt while it runs: the switch lands at the next chunk (*Cut to it* makes it a hard scene "
            "cut, with the relative position mode).\n\n"
            f"{WEAK_START_NOTE}",
            elem_id="intro",
        )
        session = gr.State(DemoSession())
        with gr.Row():
            with gr.Column():
                form = _model_row(shelf, first, size) | _prompt_fields(page_settings)
                inputs, webcam = _input_section()
                form |= inputs | _advanced_section(first)
                controls = _controls()
            with gr.Column():
                outputs = _outputs(page_settings, controls["status"])
        _wire(form, controls, outputs, session, _Handlers(shelf, page_settings))
        _wire_webcam(form["webcam"], webcam, session, page_settings)
        demo.queue(default_concurrency_limit=page_settings.max_concurrency)
    return demo


def _settings(max_concurrency: Any, settings: dict[str, Any]) -> DemoSettings:
    allowed = [name for name in DemoSettings.names() if name != "max_concurrency"]
    unknown = sorted(set(settings) - set(allowed))
    if unknown:
        raise TypeError(f"build_demo() got unexpected argument(s) {unknown}; its settings are {allowed}.")
    if settings.get("streaming") is None:
        settings = {**settings, "streaming": streaming_available()}
    return DemoSettings(max_concurrency=max_concurrency, **settings)


# ---------------------------------------------------------------------------------------- layout
def _model_row(shelf: ModelShelf, first, size: tuple[int, int]) -> dict[str, Any]:
    with gr.Row():
        model = gr.Dropdown(
            shelf.names, value=shelf.names[0], label="Model", elem_id="model", scale=2,
            interactive=len(shelf.names) > 1,
        )  # fmt: skip
        info = gr.Markdown(_model_info(first, size), elem_id="model-info")
    return {"model": model, "model_info": info}


def _prompt_fields(settings: DemoSettings) -> dict[str, Any]:
    prompt = gr.Textbox(label="Prompt", value=EXAMPLE_PROMPTS[0], elem_id="prompt")
    with gr.Row(elem_id="examples"):  # set in the browser: no round trip, so Generate right after uses it
        for text in EXAMPLE_PROMPTS:
            example = gr.Button(text, size="sm", variant="secondary", min_width=80)
            example.click(None, None, prompt, js=f"() => {json.dumps(text)}", api_visibility="private")
    seconds = gr.Number(
        value=5,
        label=LENGTH_LABEL,
        elem_id="seconds",
        info=f"up to {settings.max_seconds} s; made in whole chunks (the run says how many frames)",
    )  # fmt: skip  (no widget bounds: the browser would clamp a typed value silently; the demo says so instead)
    seed = gr.Number(value=DEFAULT_SEED, precision=0, label="Seed", minimum=0, maximum=MAX_SEED, elem_id="seed")
    return {"prompt": prompt, "seconds": seconds, "seed": seed}


def _input_section() -> tuple[dict[str, Any], gr.Image]:
    """The start image, the input video (an upload, or the webcam when ticked) and the strength; and the webcam."""
    with gr.Accordion("Start from an image or a video", open=True, elem_id="inputs"):
        gr.Markdown(
            "Leave both empty for text-to-video. A start image is the first frame; an input video (uploaded, or "
            "your webcam) is re-rendered chunk by chunk, and the video ends when it ends."
        )
        with gr.Row():
            image = gr.Image(
                label=IMAGE_LABEL, sources=["upload", "clipboard"], type="filepath", height=180, elem_id="start-image"
            )
            video = gr.Video(label=VIDEO_LABEL, sources=["upload"], height=180, elem_id="input-video")
        use_webcam = gr.Checkbox(
            False, label=WEBCAM_LABEL, elem_id="use-webcam",
            info="the input video is your webcam: start it (Record), then press Generate; Stop ends the video",
        )  # fmt: skip
        webcam = gr.Image(
            label="Your webcam", sources=["webcam"], streaming=True, type="numpy", visible=False, elem_id="webcam",
            webcam_options=gr.WebcamOptions(constraints=WEBCAM_CONSTRAINTS),
        )  # fmt: skip
        strength = gr.Slider(
            0.05, 1.0, value=DEFAULT_STRENGTH, step=0.05, label=STRENGTH_LABEL, elem_id="strength",
            info="of an input video: how much of each chunk is replaced (1: its content is ignored)",
        )  # fmt: skip
    return {"image": image, "video": video, "webcam": use_webcam, "strength": strength}, webcam


def _advanced_section(first) -> dict[str, Any]:
    fields = _advanced_fields(first)
    with gr.Accordion("Advanced", open=False, elem_id="advanced"):
        recipe = gr.Dropdown(
            value="", label=RECIPE_LABEL, elem_id="recipe", **fields["recipe"],
            info="a checkpoint's authors' own inference settings: chunk, sink, window, steps, positions",
        )  # fmt: skip
        gr.Markdown(
            "Cache geometry in latent frames (one latent frame is several video frames). "
            "Leave a field empty for the recipe's or the model's own value; a value set here wins."
        )
        with gr.Row():
            geometry = {
                name: gr.Textbox("", label=label, info=ADVANCED_INFO[name], elem_id=name, **fields[name])
                for name, label in CACHE_FIELDS.items()
            }
        steps = gr.Textbox(
            label="Denoising steps", elem_id="steps", **fields["denoising_steps"],
            info="decreasing noise levels from 1000 down: fewer steps, faster chunks",
        )  # fmt: skip
        position_mode = gr.Radio(
            value="", label="Position mode", elem_id="position_mode", **fields["position_mode"],
            info="absolute: RoPE positions grow with the video; relative: re-indexed inside the window",
        )  # fmt: skip
    return {**geometry, "denoising_steps": steps, "position_mode": position_mode, "recipe": recipe}


def _controls() -> dict[str, Any]:
    with gr.Row():
        generate = gr.Button("Generate", variant="primary", elem_id="generate")
        stop = gr.Button("Stop", elem_id="stop")
    new_prompt = gr.Textbox(label="Switch prompt to", value=EXAMPLE_PROMPTS[1], elem_id="new-prompt")
    with gr.Row():
        switch = gr.Button("Switch prompt", elem_id="switch")
        cut = gr.Button("Cut to it", elem_id="cut")  # a hard scene cut (Infinity-RoPE's), relative positions only
    status = gr.Markdown(elem_id="status")
    return {"generate": generate, "stop": stop, "new_prompt": new_prompt, "switch": switch, "cut": cut,
            "status": status}  # fmt: skip


def _outputs(settings: DemoSettings, status: gr.Markdown) -> list[Any]:
    """The Generate event's outputs, in the order `_Handlers.generate` yields them (the video first and the
    details last, as API callers read them)."""
    preview = gr.Image(
        label="Live preview", type="filepath", height=PREVIEW_HEIGHT, interactive=False, elem_id="preview",
        show_label=True,
    )  # fmt: skip
    plan = gr.Markdown(elem_id="plan")
    summary = gr.Markdown(elem_id="summary")
    # Streaming: each chunk's segment is appended to one player. Otherwise the finished video comes once, at the
    # end (a player re-created after every chunk would collapse and make the page jump).
    label = "Video" if settings.streaming else "Finished video (when the run ends)"
    video = gr.Video(label=label, streaming=settings.streaming, autoplay=settings.streaming, elem_id="video")
    with gr.Row():
        plot = dict(x="chunk", y_lim=[0, None], x_lim=[1, MIN_PLOT_CHUNKS], height=220, x_title="chunk")
        time_plot = gr.LinePlot(y="milliseconds", title="Time per chunk", elem_id="time-plot", **plot)
        memory_plot = gr.LinePlot(y="KiB", title="Cache memory", elem_id="memory-plot", **plot)
    details = gr.JSON(label="Run", open=False)
    return [video, summary, time_plot, memory_plot, preview, plan, status, details]


def _model_info(pipe, size: tuple[int, int]) -> str:
    return f"{type(pipe).__name__}, {size[0]}x{size[1]} pixels"


def _advanced_fields(pipe, recipe: str | None = None) -> dict[str, dict[str, Any]]:
    """Each Advanced field's placeholder (the value a run takes when it is empty: `recipe`'s, else the recipe the
    model's folder names, else the model's) and visibility (whether the model has it); the recipe menu lists the
    recipes of the model's pipeline class."""
    own = ChunkSettings.of_model(pipe, recipe)
    whose = "the recipe's" if own.recipe is not None else "the model's"

    def shown(name: str) -> str:
        value = getattr(own, name)
        return f"{'every earlier frame' if value == ALL_FRAMES else value} ({whose})"

    fields = {name: dict(placeholder=shown(name), visible=name in pipe.cache_options) for name in CACHE_FIELDS}
    fields["denoising_steps"] = dict(placeholder=", ".join(map(str, own.denoising_steps)) + f" ({whose})")
    choices = [(f"{whose} ({own.position_mode})", ""), *((mode, mode) for mode in POSITION_MODES)]
    fields["position_mode"] = dict(choices=choices, visible="position_mode" in pipe.cache_options)
    folder_recipe = pipe.config.get("recipe")
    recipes = list_recipes(type(pipe).__name__)
    model_own = f"the model's ({folder_recipe})" if folder_recipe else "the model's own settings"
    fields["recipe"] = dict(choices=[(model_own, ""), *((name, name) for name in recipes)], visible=bool(recipes))
    return fields


# ---------------------------------------------------------------------------------------- events
class _Handlers:
    """The page's event functions over one model shelf and one set of settings."""

    def __init__(self, shelf: ModelShelf, settings: DemoSettings) -> None:
        self.shelf = shelf
        self.settings = settings

    def generate(self, form: GenerateFields, session: DemoSession) -> Iterator[tuple]:
        """The Generate event, yielding the outputs of `_outputs` (video, summary, time plot, memory plot, preview,
        plan, status, details): first what the run makes (the plan; the last run's video and the status line
        cleared), then after every chunk the preview (the chunk, updated in place), the summary, the two plots and
        the details (streaming: the chunk's segment too), and last (not streaming) the finished video; streaming,
        the player has had every segment and Gradio offers them joined."""
        try:
            config = form.check(self.settings.max_seconds, uploads=get_upload_folder())  # no other files
            generation = Generation(self.shelf, config, self.settings)
        except ValueError as exc:  # ours, and the pipeline's relabelled: each starts with the field's label
            raise _refusal(exc) from exc
        for note in generation.notes:  # unknown words are ignored: say so where the person looks
            gr.Warning(note)
        streaming, skip = self.settings.streaming, gr.skip()
        plan = generation.plan_note()
        with session.steering(generation), VideoSoFar(self.settings.fps, streaming) as video:
            starting = f"Making chunk 1 of {generation.num_chunks} ..."
            yield skip if streaming else None, starting, skip, skip, None, plan, "", skip
            for chunk in _reported(iter(generation)):
                segment = video.add(chunk.frames)
                times, memory = generation.tables()
                x_lim = [1, max(generation.num_chunks, MIN_PLOT_CHUNKS)]
                times = gr.LinePlot(times, x_lim=x_lim)
                memory = gr.LinePlot(memory, x_lim=x_lim, y_lim=[0, 1.5 * float(memory["KiB"].max())])  # mid-plot
                shown = segment if streaming else skip
                preview = video.preview(chunk.frames)
                yield shown, _summary(generation), times, memory, preview, skip, skip, generation.details()
            if not streaming:  # streaming, the player already has every segment (and Gradio joins them)
                finished = video.finished()
                yield finished, _summary(generation, done=True), skip, skip, skip, skip, "", generation.details()

    def model_defaults(self, model_name: str) -> tuple:
        """Show the chosen model's own settings as the Advanced fields' placeholders (empty = the model's)."""
        try:
            pipe = self.shelf.get(model_name)
            size = frame_size(pipe, self.settings)
        except ValueError as exc:
            raise _refusal(exc) from exc
        fields = _advanced_fields(pipe)
        return (
            _model_info(pipe, size),
            *(gr.Textbox(value="", **fields[name]) for name in CACHE_FIELDS),
            gr.Textbox(value="", **fields["denoising_steps"]),
            gr.Radio(value="", **fields["position_mode"]),
            gr.Dropdown(value="", **fields["recipe"]),
        )

    def recipe_defaults(self, model_name: str, recipe: str) -> tuple:
        """Show the chosen recipe's settings as the Advanced fields' placeholders; the values typed stay."""
        try:
            fields = _advanced_fields(self.shelf.get(model_name), recipe or None)
        except ValueError as exc:
            raise _refusal(relabel(exc)) from exc
        placeholders = (
            gr.Textbox(placeholder=fields[name]["placeholder"]) for name in (*CACHE_FIELDS, "denoising_steps")
        )
        return *placeholders, gr.Radio(choices=fields["position_mode"]["choices"])


def _summary(generation: Generation, done: bool = False) -> str:
    """The status line; chunks are counted from 1, as the plots' x axis is."""
    made = len(generation.chunk_seconds)
    if not made:
        return "Stopped before the first chunk." if generation.stopped else "No chunk was made."
    line = (
        f"**{generation.frames_per_second:.1f} frames per second** · chunk {made} of {generation.num_chunks} took "
        f"{generation.chunk_seconds[-1] * 1000:.0f} ms · cache {generation.chunk_cache_bytes[-1] / 1024:.1f} KiB"
    )
    if done:
        ended = "Stopped" if generation.stopped else "Done"
        line += f" · {ended}: {generation.frames_written} frames in {made} chunks"
    return line


def _form_event(handler: Callable[[GenerateFields, DemoSession], Iterator]) -> Callable:
    """`handler` as Gradio calls an event function: one value per input (the form's fields, then the session).

    Gradio names the `/generate` API's arguments after the function's parameters, so this one's signature is
    `GenerateFields`' fields (with their defaults) and `session`; `handler` gets one `GenerateFields`.
    """

    def event(*values: Any) -> Iterator:
        *form, session = values
        yield from handler(GenerateFields(*form), session)

    parameters = [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)
        for name in (*GenerateFields.names(), "session")
    ]
    event.__signature__ = inspect.Signature(parameters)
    return event


def _wire(form: dict, controls: dict, outputs: list, session: gr.State, handlers: _Handlers) -> None:
    inputs = [form[name] for name in GenerateFields.names()] + [session]
    # preprocess=False: raw field values reach the form's checks (Gradio's would fail on "abc" or inf).
    run = controls["generate"].click(
        _form_event(handlers.generate), inputs, outputs, api_name="generate", preprocess=False
    )
    # Stop ends the video after the chunk being made, so what was made is still shown and downloadable.
    controls["stop"].click(stop_generation, session, controls["status"], concurrency_limit=None, api_name="stop")
    # However the run ended: the status line ("Switching to ...") is cleared and a recording webcam is stopped.
    run.then(_cleared, None, controls["status"], js=STOP_WEBCAM_JS, api_visibility="private")
    advanced = [form[name] for name in ("model_info", *CACHE_FIELDS, "denoising_steps", "position_mode", "recipe")]
    form["model"].change(handlers.model_defaults, form["model"], advanced, api_name="select_model")
    form["recipe"].change(
        handlers.recipe_defaults, [form["model"], form["recipe"]], advanced[1:-1], api_name="select_recipe"
    )
    # Unlimited concurrency: a switch must never wait behind the generations it is meant to steer.
    switch = dict(fn=switch_prompt, inputs=[controls["new_prompt"], session], outputs=controls["status"])
    controls["switch"].click(**switch, concurrency_limit=None, api_name="switch_prompt")
    controls["new_prompt"].submit(**switch, concurrency_limit=None, api_visibility="private")
    cut = dict(fn=cut_to_prompt, inputs=[controls["new_prompt"], session], outputs=controls["status"])
    controls["cut"].click(**cut, concurrency_limit=None, api_name="cut_to_prompt")


def _wire_webcam(use_webcam: gr.Checkbox, webcam: gr.Image, session: gr.State, settings: DemoSettings) -> None:
    """Show the webcam when ticked; each frame it streams goes to the session's running generation, and when it
    stops (its Stop button, or Gradio's stream ends) the generation's input ends with it."""
    use_webcam.change(lambda on: gr.Image(visible=bool(on)), use_webcam, webcam, api_visibility="private")
    streamed = webcam.stream(
        _webcam_frame, [webcam, session], None, stream_every=1.0 / settings.fps, concurrency_limit=None,
        api_visibility="private",
    )  # fmt: skip
    streamed.then(stop_webcam, session, None, api_visibility="private")


def _cleared() -> str:
    return ""


def _webcam_frame(frame: Any, session: DemoSession) -> None:
    push_webcam_frame(frame, session)  # frames nobody waits for (no webcam generation) are dropped


def _refusal(exc: Exception) -> gr.Error:
    """A field the person must change: the message stays until closed, and the server log is not a traceback."""
    return gr.Error(str(exc), duration=None, print_exception=False)


def _reported(chunks: Iterator) -> Iterator:
    """The chunks; a ValueError or a NaN chunk (`FloatingPointError`) while making one is shown as a `gr.Error`."""
    while True:
        try:
            chunk = next(chunks, None)
        except (ValueError, FloatingPointError) as exc:
            raise gr.Error(str(exc)) from exc
        if chunk is None:
            return
        yield chunk

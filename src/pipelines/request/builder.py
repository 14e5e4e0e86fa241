"""`build_request`: one call's arguments (`VideoCall`) resolved and checked into the frozen `VideoRequest`.

The one place a call is resolved, in this order: the recipe (the call's, else the one the pipeline folder's
`model_index.json` names) fills what the call left `None`, then the loop's defaults (`LOOP_DEFAULTS`), then
the pipeline config (cache options, steps, sizes, text length). Every argument is then checked, group by
group, before any model work; the input video's reader opens last, after every other check passed.

`pipe(...)`, `pipe.stream(...)`, `generate_to_file`, resume, the CLI, the demo and the evaluation all come
through here, and `num_frames_for` answers "how many frames" from the same resolution, so a front end
never re-implements a rule: it relabels this module's errors (a flag name, a field label) instead.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

from ...caching.layout import ALL_FRAMES, ChunkLayout
from ...checks import check_choice, check_flag, check_number
from ...recipes import get_recipe
from ..acceleration import CompiledStep, is_compiled
from ..parallel.plan import check_devices
from .call import VideoCall
from .conditioning import build_conditioning, resolve_strength, strength_steps
from .prompt_schedule import PromptSchedule
from .request import (
    CacheOptions,
    VideoGeometry,
    VideoRequest,
    check_blend_chunks,
    check_callback,
    check_context_noise,
    check_context_policy,
    check_embeds,
    check_first_frame,
    check_generator,
    check_guidance_scale,
    check_latents,
    check_negative_prompt,
    check_num_frames,
    check_output_type,
    check_recache,
    check_recompute_fits,
)
from .scene_controls import check_flush, scene_cut_entries
from .steps import StepMapping, StepPlan, plan_steps
from .text_encoding import check_max_sequence_length

# What the loop does when neither the call nor its recipe says (the cache options' defaults are the config's).
LOOP_DEFAULTS: dict[str, Any] = {
    "sigma_mapping": "shift",
    "integer_timesteps": False,
    "context_noise": 0.0,
    "context_policy": "rolling",
    "recompute_first_frame": "keep",
    "recache": "causal",
    "prompt_blend_chunks": 1,
    "denoising": "sequential",
    "video_noise_mix": "sigma",
    "normalize_input_latents": True,
}
DENOISING_MODES = ("sequential", "pipelined", "stream_batch")
IMAGE_MODES = ("chunk", "frame")
FIRST_CHUNK_RULES = ("whole", "remainder", "frame", "extra_frame")
VIDEO_NOISE_MIXES = ("sigma", "strength", "motion")


class RequestPipeline(Protocol):
    """What `build_request` reads from a pipeline (`ChunkedVideoPipeline` provides it): its config and VAE
    arithmetic, its family's options and layout, and its transformer's frame budget."""

    config: Any
    transformer: Any
    scheduler: Any
    vae: Any
    options_class: type[CacheOptions]
    recache_modes: tuple[str, ...]
    vae_scale_factor_temporal: int
    vae_scale_factor_spatial: int
    callback_tensor_inputs: tuple[str, ...]

    def frames_to_latent(self, num_frames: int) -> int: ...

    def latent_to_frames(self, latent_frames: int) -> int: ...

    def latent_to_pixel_start(self, latent_frame: int) -> int: ...

    def valid_num_frames(
        self, num_frames: int, chunk_frames: int | None = None, first_frame_alone: bool = False
    ) -> tuple[int, int]: ...

    def check_size(self, name: str, size: Any) -> int: ...

    def make_layout(
        self, tokens_per_frame: int, options: CacheOptions, num_latent_frames: int, largest_chunk: int | None = None
    ) -> ChunkLayout: ...

    def check_prompt_text(
        self, prompts: list[str], max_sequence_length: int, name: str, require_known_word: bool = True
    ) -> None: ...


# ---------------------------------------------------------------------------------------- the recipe
def resolve_call(pipe: RequestPipeline, call: VideoCall) -> VideoCall:
    """`call` with what it left `None` taken from its recipe (the call's, else the folder's), then from the loop's
    defaults; `recipe` holds the name used. What is still `None` is the pipeline config's to fill. The call's own
    `image_mode` is checked first: a recipe's applies only when the call has an image, the call's must have one."""
    check_image_mode(call.image_mode, call.image)
    check_input_options(call)
    name = call.recipe if call.recipe is not None else pipe.config.get("recipe")
    settings = dict(LOOP_DEFAULTS)
    if name is not None:
        settings.update(get_recipe(name, type(pipe).__name__).settings)
    missing = {key: value for key, value in settings.items() if getattr(call, key) is None}
    return call.replace(recipe=name, **missing)


def check_image_mode(image_mode: Any, image: Any) -> None:
    """A given `image_mode` is one of `IMAGE_MODES` and comes with an `image`."""
    if image_mode is None:
        return
    check_choice("image_mode", image_mode, IMAGE_MODES)
    if image is None:
        raise ValueError("`image_mode` applies to `image=` (image-to-video) only; pass an `image` or drop it.")


def check_input_options(call: VideoCall) -> None:
    """Options the call gives for an input it does not have (a recipe's apply only when the input is there)."""
    for name in ("video_denoising_steps", "video_noise_mix"):
        if getattr(call, name) is not None and call.video is None:
            raise ValueError(f"`{name}` applies to `video=` (video-to-video) only; pass a `video` or drop it.")
    if call.normalize_input_latents is not None and call.video is None:
        raise ValueError(
            "`normalize_input_latents` applies to an input video (`video=`) only (a start image is frame 0 of the "
            "output: it is always encoded in the space the decoder reads); pass a `video` or drop it."
        )


def first_chunk_rule(call: VideoCall) -> str:
    """The first chunk's rule of a resolved call: as asked, or one latent frame for a start image in the "frame"
    convention (a recipe's `image_mode` applies only when the call has an `image`)."""
    if call.image_mode is None or call.image is None or call.image_mode == "chunk":
        rule = call.first_chunk or "whole"
        return check_choice("first_chunk", rule, FIRST_CHUNK_RULES)
    if call.first_chunk not in (None, "frame", "extra_frame"):  # extra_frame: the image is the lone first pixel frame
        raise ValueError(
            f"`image_mode='frame'` makes the first chunk one latent frame, but `first_chunk`={call.first_chunk!r} "
            "(given or set by the recipe) asks otherwise; pass first_chunk='frame' or image_mode='chunk'."
        )
    return "frame"


def cache_options(pipe: RequestPipeline, call: VideoCall) -> CacheOptions:
    """The family's cache options for a resolved call: its values, else the pipeline config's."""
    given = {name: getattr(call, name) for name in CacheOptions.known_names}
    return pipe.options_class.resolve(pipe.config, given, type(pipe).__name__)


def _resolved(pipe: RequestPipeline, call: VideoCall) -> tuple[VideoCall, CacheOptions, str]:
    """The resolved call, its cache options and its first chunk's rule: what `build_request` and `num_frames_for`
    both start from."""
    call = resolve_call(pipe, call)
    return call, cache_options(pipe, call), first_chunk_rule(call)


# ---------------------------------------------------------------------------------------- frame counts
def num_frames_for(pipe: RequestPipeline, seconds: Any, fps: Any, call: VideoCall) -> int:
    """The fewest frames a `call` makes that last at least `seconds` at `fps`: whole chunks of the call's chunk
    length (after one latent frame for a start image in the "frame" convention), as `build_request` resolves
    them."""
    seconds = check_number("seconds", seconds, 0, above=True)
    fps = check_number("fps", fps, 0, above=True)
    requested = max(1, math.ceil(round(seconds * fps, 6)))  # round first: 0.1 s * 30 fps is 3 frames, not 4
    below, above, _ = _whole_chunks(pipe, call, requested)
    return below if below >= requested else above


def longest_num_frames(pipe: RequestPipeline, call: VideoCall, at_most: int) -> int:
    """The most frames `call` may make, at most `at_most`: whole chunks as `build_request` resolves them, ending
    before the positions leave what the model represents (`frame_budget`: absolute positions end at the RoPE
    table). What a stream "until stopped" runs (`rolldiff serve`'s `"num_frames": null`)."""
    *_, layout = _whole_chunks(pipe, call, at_most)
    budget = pipe.transformer.frame_budget(layout)
    if budget is not None:
        at_most = min(at_most, pipe.latent_to_frames(budget))
    return _whole_chunks(pipe, call, at_most)[0]


def whole_chunk_grid(pipe: RequestPipeline, call: VideoCall) -> tuple[int, int]:
    """`(first latent frame of the whole chunks, latent frames per whole chunk)` of a `call`, as `build_request`
    resolves them: whole chunk k starts at latent frame `first + k * chunk` (`first` is 1 after a start image's
    lone latent frame in the "frame" convention, else 0); `pipe.latent_to_pixel_start` gives its pixel frame."""
    _, options, first_chunk = _resolved(pipe, call)
    return int(_starts_alone(first_chunk)), options.chunk_frames


def _starts_alone(first_chunk: str) -> bool:
    """Whether a first-chunk rule puts one latent frame before the whole chunks (a start image's, either way)."""
    return first_chunk in ("frame", "extra_frame")


def _whole_chunks(pipe: RequestPipeline, call: VideoCall, frames: int) -> tuple[int, int, ChunkLayout]:
    """The reachable frame counts just below and above `frames` for the call's chunks (after one latent frame for a
    start image in the "frame" convention), and the layout they were read from."""
    _, options, first_chunk = _resolved(pipe, call)
    # the family's layout checks the chunk and window (its one home); frames are the same at any frame size
    layout = pipe.make_layout(1, options, pipe.frames_to_latent(frames))
    return (*pipe.valid_num_frames(frames, layout.chunk_frames, _starts_alone(first_chunk)), layout)


# ---------------------------------------------------------------------------------------- the request
def build_request(pipe: RequestPipeline, call: VideoCall) -> VideoRequest:
    """Resolve `call` (recipe, loop defaults, config) and check every argument before any work; the frozen
    request the chunk loop reads."""
    check_output_type(call.output_type)
    call, options, first_chunk = _resolved(pipe, call)
    geometry, layout = _geometry(pipe, call, options, first_chunk)
    _check_context_window(layout)
    schedule = _schedule(pipe, call, geometry)
    guidance_scale = check_guidance_scale(call.guidance_scale)
    max_sequence_length = check_max_sequence_length(
        pipe.config.max_sequence_length if call.max_sequence_length is None else call.max_sequence_length
    )
    batch_size = schedule.batch_size
    geometry = dataclasses.replace(geometry, chunk_shape=(batch_size, *geometry.chunk_shape[1:]))
    negatives = check_negative_prompt(call.negative_prompt, call.negative_prompt_embeds, guidance_scale, batch_size)
    _check_schedule_text(pipe, call, schedule, negatives, max_sequence_length)
    check_generator(call.generator, batch_size)
    latent_shape = (*geometry.chunk_shape[:2], geometry.num_latent_frames, *geometry.chunk_shape[3:])
    step_plan = _step_plan(pipe, call, call.denoising_steps, call.sigmas)
    denoising = check_choice("denoising", call.denoising, DENOISING_MODES)
    checked = dict(
        step_plan=step_plan,
        denoising=denoising,
        first_step_plan=None
        if call.first_chunk_steps is None
        else _step_plan(pipe, call, call.first_chunk_steps, name="first_chunk_steps"),
        latents=check_latents(call.latents, latent_shape),
        callback_tensor_inputs=check_callback(
            call.callback_on_step_end, call.callback_on_step_end_tensor_inputs, pipe.callback_tensor_inputs
        ),
        context_noise=check_context_noise(call.context_noise),
        context_policy=check_context_policy(call.context_policy),
        recompute_first_frame=check_first_frame(call.recompute_first_frame),
        recache_mode=check_recache(call.recache, pipe.recache_modes),
        overlap_decode=check_flag("overlap_decode", call.overlap_decode),
        prompt_blend_chunks=check_blend_chunks(call.prompt_blend_chunks),
        video_step_plan=None
        if call.video_denoising_steps is None
        else _step_plan(pipe, call, call.video_denoising_steps, name="video_denoising_steps"),
        video_noise_mix=check_choice(
            "video_noise_mix", call.video_noise_mix, VIDEO_NOISE_MIXES, hint="'motion': StreamDiffusionV2's"
        ),
        # a start image is frame 0 of the output: encoded in the space the decoder reads, whatever the recipe says
        normalize_input_latents=check_flag("normalize_input_latents", call.normalize_input_latents)
        or call.video is None,
        step_mapping=_step_mapping(pipe, call),
        devices=check_devices(pipe, call),
    )
    _check_vae_needs(pipe, call, checked)
    _check_adaptive_sink(pipe, call, options, geometry)
    if denoising == "stream_batch":
        _check_stream_batch(pipe, call, options, schedule, guidance_scale, checked)
    if denoising == "pipelined":
        layout, checked["in_flight_frames"] = _pipelined_layout(pipe, call, options, geometry, layout, checked)
    check_recompute_fits(checked["context_policy"], layout, pipelined=denoising == "pipelined")
    check_flush(checked["recache_mode"], layout, denoising, checked["context_policy"])
    checked["scene_cuts"] = scene_cut_entries(
        call.scene_cuts, schedule, pipe, layout, denoising, checked["context_policy"]
    )
    conditioning = build_conditioning(  # last: an input file's reader opens here, after every other check
        call.image,
        call.video,
        call.strength,
        batch_size,
        geometry.height,
        geometry.width,
        pipe.latent_to_frames(geometry.chunk_frames),
    )
    return VideoRequest(
        geometry=geometry,
        layout=layout,
        options=options,
        schedule=schedule,
        guidance_scale=guidance_scale,
        negative_prompt=negatives,
        max_sequence_length=max_sequence_length,
        output_type=call.output_type,
        prompt_embeds=call.prompt_embeds,
        negative_prompt_embeds=call.negative_prompt_embeds,
        generator=call.generator,
        callback_on_step_end=call.callback_on_step_end,
        conditioning=conditioning,
        recipe=call.recipe,
        **checked,
    )


def _check_context_window(layout: ChunkLayout) -> None:
    """A context pass's span (`context_window_frames`) counts its chunk and must leave room for context."""
    span = getattr(layout, "context_window_frames", None)
    if span is not None and span <= layout.chunk_frames:
        raise ValueError(
            f"`context_window_frames`={span} must be larger than `chunk_frames`={layout.chunk_frames}: the span a "
            "context pass attends to counts its chunk and must leave room for recent context (Rolling Forcing: 21)."
        )


def _pipelined_layout(
    pipe: RequestPipeline,
    call: VideoCall,
    options: CacheOptions,
    geometry: VideoGeometry,
    layout: ChunkLayout,
    checked: dict[str, Any],
) -> tuple[ChunkLayout, int]:
    """The cache layout of `denoising="pipelined"` and the latent frames in flight at most: its pending region holds
    every in-flight chunk (as many as there are steps, fewer in a shorter video), all written and attended to in one
    forward. Strength cuts the steps of a video-to-video chunk, and so the chunks in flight. The adaptive sink keeps
    its layout: its in-flight region lies after its slots (`AdaptiveSinkPolicy.in_flight_frames`)."""
    if not getattr(pipe, "offers_pipelined_denoising", False):
        raise ValueError(
            f"`denoising='pipelined'` is offered by the Krea-like pipeline, not by {type(pipe).__name__}; "
            "use denoising='sequential'."
        )
    if call.first_chunk_steps is not None:
        from_recipe = call.recipe is not None and get_recipe(call.recipe).settings.get("first_chunk_steps") is not None
        source = f" (recipe={call.recipe!r} sets it: keep its denoising='sequential')" if from_recipe else ""
        raise ValueError(
            "`first_chunk_steps` gives the first chunk more steps than the others, but `denoising='pipelined'` moves "
            f"every in-flight chunk one step per forward; drop one of them{source}."
        )
    adaptive = getattr(options, "adaptive_sink", False)  # its in-flight region lies after its slots
    if geometry.first_chunk_frames != geometry.chunk_frames and call.image is None and not adaptive:
        raise ValueError("`denoising='pipelined'` needs chunks of one size; give `num_frames` as whole chunks.")
    num_steps = len(checked["step_plan"].steps)
    if call.video is not None:  # the steps an input chunk runs (`VideoRequest.step_plan_for`)
        mix = checked["video_noise_mix"]
        if mix == "motion":
            raise ValueError(
                "`video_noise_mix='motion'` picks each input chunk's first step from its motion, but "
                "`denoising='pipelined'` moves every chunk in flight along one step list; pass "
                "video_noise_mix='strength' or 'sigma' (or, under recipe='streamdiffusionv2', its own pipelining: "
                "denoising='stream_batch')."
            )
        num_steps = len((checked["video_step_plan"] or checked["step_plan"]).steps)
        if mix == "sigma":
            num_steps = strength_steps(num_steps, resolve_strength(call.strength))
    in_flight = min(num_steps, geometry.num_chunks) * geometry.chunk_frames
    in_flight += max(0, geometry.first_chunk_frames - geometry.chunk_frames)  # StreamDiffusionV2's larger first one
    window = options.window_frames  # as asked: `layout`'s may be fitted to a short video
    if window != ALL_FRAMES and window <= in_flight and not adaptive:
        chunks = in_flight // geometry.chunk_frames
        views = layout.elastic_window or layout.context_window_frames is not None  # a bounded window only
        unbounded = "" if views else ", or 'all'"
        raise ValueError(
            f"`window_frames`={window} must be larger than the {in_flight} latent frames "
            f"`denoising='pipelined'` keeps in flight ({chunks} chunks of {geometry.chunk_frames}, one per step): the "
            f"window counts them. Pass window_frames={in_flight + window - geometry.chunk_frames} to keep "
            f"the committed context of sequential denoising, {in_flight + 1} at least{unbounded}."
        )
    if adaptive:
        return layout, in_flight
    pending = dataclasses.replace(options, chunk_frames=in_flight)
    pipelined = pipe.make_layout(layout.tokens_per_frame, pending, geometry.num_latent_frames)
    pipe.transformer.check_frame_budget(geometry.num_latent_frames, pipelined)
    return pipelined, in_flight


def _check_vae_needs(pipe: RequestPipeline, call: VideoCall, checked: dict[str, Any]) -> None:
    """What needs the VAE, refused up front on a pipeline without one (latents in, latents out)."""
    if pipe.vae is not None:
        return
    if checked["context_policy"] == "recompute" and checked["recompute_first_frame"] == "reencode":
        source = f" (set by the recipe {call.recipe!r})" if call.recipe else ""
        raise ValueError(
            f"`recompute_first_frame='reencode'`{source} re-encodes each rebuilt context's first frame from decoded "
            "pixels with the VAE, but this pipeline has no VAE; pass recompute_first_frame='keep'."
        )
    if call.image is not None or call.video is not None:
        name = "image" if call.image is not None else "video"
        raise ValueError(f"`{name}` is encoded by the VAE, but this pipeline has no VAE; load one with its `vae`.")
    if call.output_type != "latent" and getattr(pipe, "tiny_autoencoder", None) is None:
        raise ValueError(
            f"`output_type`={call.output_type!r} decodes with the VAE, but this pipeline has no VAE; pass "
            "output_type='latent' or load a decoder (`load_tiny_autoencoder`)."
        )


def _step_mapping(pipe: RequestPipeline, call: VideoCall) -> StepMapping:
    """The call's step-to-sigma mapping (checked with the step lists by `plan_steps`)."""
    shift = pipe.scheduler.config.shift if call.timestep_shift is None else call.timestep_shift
    return StepMapping(call.sigma_mapping, float(shift), bool(call.integer_timesteps))


def _check_adaptive_sink(
    pipe: RequestPipeline, call: VideoCall, options: CacheOptions, geometry: VideoGeometry
) -> None:
    """StreamDiffusionV2's adaptive sink: one-frame chunks, one queue (batch 1), the same writes in every chunk and,
    its decisions being host reads, an eager transformer, or one compiled by `compile_cached_step` under pipelined
    denoising (whose in-flight writes decide nothing; the decided forwards run eager)."""
    if not getattr(options, "adaptive_sink", False):
        return
    compiled_step = isinstance(pipe.transformer.forward, CompiledStep)
    if is_compiled(pipe.transformer) and (call.denoising != "pipelined" or not compiled_step):
        how = "under denoising='pipelined'" if compiled_step else "by compile_cached_step (--compile), pipelined"
        raise ValueError(
            "`adaptive_sink=True` decides each refresh on the host as its write happens (upstream's `.item()`): its "
            f"cache runs compiled only {how}, where a forward writes the chunks in flight without deciding and the "
            "decided writes run eager. This pipeline's transformer is compiled: pass denoising='pipelined' with a "
            "transformer compiled by compile_cached_step, load it uncompiled (drop --compile / --cuda-graphs), or "
            "use a sliding-window recipe."
        )
    conflicts = {
        "chunk_frames": geometry.chunk_frames != 1,
        "first_chunk_steps": call.first_chunk_steps is not None,
        "batch": geometry.batch_size != 1,
    }
    if any(conflicts.values()):
        raise ValueError(
            "`adaptive_sink=True` decides a refresh for one-frame chunks (upstream's `v.shape[1] <= frame_seqlen`), "
            "keeps one eviction queue per stream and pops it once per chunk's writes: it needs chunk_frames=1, "
            "batch 1 and no `first_chunk_steps`; got "
            f"{[name for name, conflict in conflicts.items() if conflict]} otherwise."
        )


def _check_stream_batch(
    pipe: RequestPipeline,
    call: VideoCall,
    options: CacheOptions,
    schedule: PromptSchedule,
    guidance_scale: float,
    checked: dict[str, Any],
) -> None:
    """StreamDiffusionV2's stream batch (`rolldiff.pipelines.stream_batch`): one cache per step, as upstream, and only
    what upstream's loop has: its adaptive-sink cache under `context_policy="last_step"` (no context pass), one
    prompt, one guidance branch, every chunk the same steps."""
    conflicts = {
        "a transformer without one cache per batch row": not getattr(pipe.transformer, "accepts_row_caches", False),
        f"context_policy={checked['context_policy']!r}": checked["context_policy"] != "last_step",
        "adaptive_sink=False": not getattr(options, "adaptive_sink", False),
        f"guidance_scale={guidance_scale}": guidance_scale > 1.0,
        "a prompt switch (`prompt_schedule`)": len(schedule.entries) > 1,
        "`first_chunk_steps`": call.first_chunk_steps is not None,
        "a start image": call.image is not None,  # its first chunk is committed, not denoised, and not copied per step
    }
    found = [name for name, conflict in conflicts.items() if conflict]
    if found:
        raise ValueError(
            "`denoising='stream_batch'` is StreamDiffusionV2's stream batch: one forward of a row per step, each row "
            "through its own copy of the adaptive-sink cache, committed as written. It needs a Krea-like pipeline, "
            "context_policy='last_step' and adaptive_sink=True (recipe='streamdiffusionv2'), guidance_scale=1, one "
            f"prompt, no `first_chunk_steps` and no `image`; got {found}. Pass denoising='sequential' otherwise."
        )


def _step_plan(pipe: RequestPipeline, call: VideoCall, steps, sigmas=None, name: str = "denoising_steps") -> StepPlan:
    """`steps` (None: the config's) under the call's sigma mapping and shift (`sigmas`: explicit ones)."""
    shift = call.timestep_shift
    return plan_steps(
        pipe.config.denoising_steps if steps is None else steps,
        call.sigma_mapping,
        pipe.scheduler.config.shift if shift is None else shift,
        call.integer_timesteps,
        sigmas,
        scheduler_shift=float(pipe.scheduler.config.shift),
        name=name,
    )


def _check_rope_grid(pipe: RequestPipeline, **sizes: int) -> None:
    """Each side's patches inside the RoPE table (`rope_max_seq_len` rows and columns), or a refusal naming it
    before any work (past the table a token has no position: an IndexError mid-video)."""
    config = pipe.transformer.config
    limit = config.rope_max_seq_len
    for (name, pixels), patch in zip(sizes.items(), config.patch_size[1:], strict=True):
        per_position = pipe.vae_scale_factor_spatial * patch
        if pixels // per_position > limit:
            raise ValueError(
                f"`{name}`={pixels} is {pixels // per_position} patch positions, more than the RoPE table's {limit}: "
                f"make it at most {limit * per_position} pixels."
            )


def _geometry(
    pipe: RequestPipeline, call: VideoCall, options: CacheOptions, first_chunk: str
) -> tuple[VideoGeometry, ChunkLayout]:
    """Frames, sizes and the cache layout of one video, inside the positions' range: whole chunks, or a first
    chunk that takes the leftover frames (`first_chunk="remainder"`, LongSANA) or is one latent frame
    (`first_chunk="frame"`: a start image's single latent frame, Self-Forcing / CausVid image-to-video) or holds one
    latent frame more than the others (`first_chunk="extra_frame"`, StreamDiffusionV2)."""
    num_frames = check_num_frames(call.num_frames)
    height = pipe.check_size("height", pipe.config.height if call.height is None else call.height)
    width = pipe.check_size("width", pipe.config.width if call.width is None else call.width)
    spatial = pipe.vae_scale_factor_spatial
    _check_rope_grid(pipe, height=height, width=width)
    latent_frames = pipe.frames_to_latent(num_frames)
    tokens_per_frame = pipe.transformer.tokens_per_frame(height // spatial, width // spatial)
    layout = pipe.make_layout(tokens_per_frame, options, latent_frames)
    chunk_frames = layout.chunk_frames
    first = _first_chunk_frames(pipe, num_frames, latent_frames, chunk_frames, first_chunk)
    if first > chunk_frames:  # the model and cache are sized by the largest chunk, the first
        layout = pipe.make_layout(tokens_per_frame, options, latent_frames, first)
    if getattr(options, "adaptive_sink", False) and latent_frames > pipe.transformer.config.get(
        "rope_max_seq_len", 1024
    ):
        raise ValueError(
            f"{latent_frames} latent frames exceed the RoPE table of {pipe.transformer.config.rope_max_seq_len} "
            "positions, and `adaptive_sink=True` compares keys stored at their absolute positions: make `num_frames` "
            "at most that many latent frames (StreamDiffusionV2 itself moves positions past frame 50 back to frame 5, "
            "`streamv2v/inference_wo_batch.py:314-316`; this pipeline does not)."
        )
    pipe.transformer.check_frame_budget(latent_frames, layout)
    channels = pipe.transformer.config.in_channels
    return VideoGeometry(
        num_frames=num_frames,
        height=height,
        width=width,
        num_latent_frames=latent_frames,
        chunk_shape=(1, channels, chunk_frames, height // spatial, width // spatial),
        first_chunk_frames=first,
    ), layout


def _first_chunk_frames(pipe: RequestPipeline, num_frames: int, latent_frames: int, chunk: int, rule: str) -> int:
    """Latent frames of the first chunk under `rule`; raises naming the nearest valid `num_frames` otherwise."""
    temporal = pipe.vae_scale_factor_temporal
    whole_latents = not (num_frames - 1) % temporal
    if rule == "frame" and latent_frames > 1 and (latent_frames - 1) % chunk == 0 and whole_latents:
        return 1
    if rule == "extra_frame" and latent_frames > chunk and (latent_frames - 1) % chunk == 0 and whole_latents:
        return chunk + 1  # the lone first frame's latent and a chunk: 1 + 4 * chunk pixel frames
    if rule == "remainder" and latent_frames >= chunk and whole_latents:
        return chunk + latent_frames % chunk
    if rule == "whole" and latent_frames % chunk == 0 and whole_latents:
        return chunk
    alone = _starts_alone(rule)
    below, above = pipe.valid_num_frames(num_frames, chunk, first_frame_alone=alone)
    raise ValueError(
        f"`num_frames`={num_frames} cannot be made of {'one frame and then ' if alone else ''}whole chunks of "
        f"{chunk} latent frames (VAE temporal factor {temporal}); nearest valid values: {below} or {above}"
        + ("" if alone else " (or `first_chunk='remainder'`: the first chunk takes the leftover frames).")
    )


def _schedule(pipe: RequestPipeline, call: VideoCall, geometry: VideoGeometry) -> PromptSchedule:
    """The prompt schedule (`prompt_embeds` stand for the prompt at frame 0); its batch is the video's."""
    if call.prompt_embeds is not None and call.prompt is not None:
        raise ValueError("Give either `prompt` or `prompt_embeds`, not both.")
    schedule_prompt = call.prompt
    if call.prompt_embeds is not None:
        check_embeds("prompt_embeds", call.prompt_embeds)
        schedule_prompt = ["<prompt_embeds>"] * call.prompt_embeds.shape[0]
    last_chunk_start = pipe.latent_to_pixel_start(geometry.last_chunk_start)
    return PromptSchedule.build(schedule_prompt, call.prompt_schedule, geometry.num_frames, last_chunk_start)


def _check_schedule_text(
    pipe: RequestPipeline, call: VideoCall, schedule: PromptSchedule, negatives, max_sequence_length: int
) -> None:
    """Unknown words and truncation warned about, prompts with no known word refused (`check_prompts`)."""
    for index, (_, prompts) in enumerate(schedule.entries):
        if index == 0 and call.prompt_embeds is not None:
            continue
        name = "prompt_schedule" if index > 0 or call.prompt is None else "prompt"
        pipe.check_prompt_text(list(prompts), max_sequence_length, name)
    if negatives:
        pipe.check_prompt_text(list(negatives), max_sequence_length, "negative_prompt", require_known_word=False)

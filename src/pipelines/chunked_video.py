"""`ChunkedVideoPipeline`: what every autoregressive video pipeline shares (Krea-like, LongSana-like).

`__call__` and `stream` keep diffusers' explicit signature; `build_request` validates the call once into a
frozen `VideoRequest`, and `stream` returns a `ChunkStream` (`rolldiff.pipelines.stream`), the live
generation that owns its caches, decoder, scheduler copy and position. `__call__` and `generate_to_file` are
thin users of that stream, so the three give the same frames, and one pipeline serves concurrent callers.

A family subclasses this with its options dataclass (`options_class`, a `CacheOptions`) and the hooks at the
bottom (`make_layout`, `transformer_step`, `recache_frames`, `recache`, and optionally `make_stream_cache`,
`make_decoder`); its transformer implements `rolldiff.models.family.VideoTransformer`. See
docs/model_families.md.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import torch
from diffusers import DiffusionPipeline
from diffusers.utils import BaseOutput
from diffusers.video_processor import VideoProcessor

from ..caching.layout import ChunkLayout
from ..models.tiny_autoencoder import TinyVideoAutoencoder
from ..models.weights import check_pipeline_weights
from ..recipes import get_recipe
from .acceleration import capture_cuda_graphs, enable_fp8, fastest_attention_backend, set_attention_backend
from .conditioning import build_conditioning
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
    check_flag,
    check_generator,
    check_guidance_scale,
    check_latents,
    check_negative_prompt,
    check_num_frames,
    check_output_type,
    check_recache,
    check_size,
)
from .steps import StepPlan, plan_steps
from .stream import ChunkStream
from .streaming_decode import StreamingWanDecoder
from .streaming_encode import StreamingWanEncoder
from .streaming_tiny_decode import StreamingTinyDecoder
from .text_encoding import check_max_sequence_length, check_prompts, encode_prompts

FIRST_CHUNK_RULES = ("whole", "remainder", "frame")
# What the loop does when neither the call nor its recipe says (the cache options' defaults are the config's).
LOOP_DEFAULTS: dict[str, Any] = {
    "sigma_mapping": "shift",
    "integer_timesteps": False,
    "context_noise": 0.0,
    "context_policy": "rolling",
    "recompute_first_frame": "keep",
    "recache": "causal",
    "prompt_blend_chunks": 1,
}


class CacheAllocationError(MemoryError):
    """The stream's cache does not fit in memory; the message names the settings that size it."""


@dataclass
class ChunkedVideoPipelineOutput(BaseOutput):
    """`frames`: `(batch, frames, height, width, 3)` np in [0, 1], a list of PIL lists, `(batch, frames, 3, H, W)`
    torch, or latents `(batch, channels, latent_frames, h, w)` for `output_type="latent"`."""

    frames: np.ndarray | list[list[PIL.Image.Image]] | torch.Tensor | None


def concat_chunks(chunks: list[Any], output_type: str) -> Any:
    """Join a stream's items along time: what `__call__` returns for the whole video."""
    if not chunks:
        return None
    if output_type == "latent":
        return torch.cat(chunks, dim=2)
    if output_type == "pt":
        return torch.cat(chunks, dim=1)
    if output_type == "pil":
        return [[image for chunk in chunks for image in chunk[b]] for b in range(len(chunks[0]))]
    return np.concatenate(chunks, axis=1)


_ARGUMENTS = """
        Args:
            prompt: the text, or one per batch element; omit it when `prompt_schedule` starts at 0 or
                `prompt_embeds` are given.
            num_frames: pixel frames; must be whole chunks (`valid_num_frames` tells the nearest).
            height, width: pixels, multiples of the VAE factor times the patch size (default: the config's).
            prompt_schedule: `[(frame, prompt), ...]` switches; each takes effect at the next chunk boundary.
            negative_prompt, negative_prompt_embeds: the unconditional branch when `guidance_scale > 1`.
            prompt_embeds: precomputed text embeddings `(batch, tokens, channels)` for the first prompt.
            denoising_steps: step values in (0, 1000], strictly decreasing, warped by the scheduler's shift.
            guidance_scale: > 1 enables classifier-free guidance with its own cache for the negative branch.
            generator: a `torch.Generator` (or one per batch element); chunk k's noise is drawn when it starts.
            latents: optional starting noise for the whole video `(batch, channels, latent_frames, h, w)`.
            output_type: "np", "pil", "pt" or "latent".
            max_sequence_length: text tokens (default from the config).
            callback_on_step_end: `callback(pipe, step, timestep, tensors) -> dict`, called after every
                denoising step with the next step's input `latents`; returned `latents` replace them.
                Set `pipe.interrupt = True` to stop before the next step: the output holds the chunks
                finished so far (`frames` is None if none finished).
            callback_on_step_end_tensor_inputs: the tensors the callback receives ("latents", "prompt_embeds").
            chunk_frames, sink_frames, window_frames, position_mode, attention_bias, kv_quantization,
                kv_offload, attention_bias_mode: the family's cache options (`cache_options`; the family's pipeline docstring says
                what each means); `None` takes the pipeline config's value, and a family refuses an option it
                does not have. A window longer than the video is shortened to what the video can fill.
            image: a start frame (image-to-video): a PIL image, an `(H, W, 3)` array, a `(3, H, W)` tensor, or one
                per batch element; resized like diffusers' `VideoProcessor`. It is encoded and becomes the clean
                first chunk: frame 0 of the video is the image.
            image_mode: "chunk" (Krea: the image repeated over the first chunk; the default) or "frame" (Self-Forcing
                / CausVid: the image's single latent frame is the first committed context; `num_frames` then takes
                one latent frame and whole chunks). `None` takes the recipe's (`self-forcing`: "frame",
                `krea-realtime`: "chunk"), else "chunk".
            overlap_decode: on CUDA, decode chunk k on a side stream while chunk k + 1 denoises (frames still come
                in order, equal to the serial decode; each arrives once the next chunk's latents exist, the first at
                once). Decodes in place on other devices, and serially under `context_policy="recompute"` with
                `recompute_first_frame="reencode"` (each chunk's context is re-encoded from the last chunk's pixels).
            video: an input video (video-to-video), streamed chunk by chunk: a file path, an `(F, H, W, 3)` array,
                or any iterator of frames (endless included, e.g. a webcam). The output ends with the input.
            strength: how much of each input chunk is replaced, in (0, 1] (default 0.8, diffusers'); of the N
                denoising steps the last `int(N * strength)` run. 1.0 equals text-to-video with the same noise.
"""


IMAGE_MODES = ("chunk", "frame")


def check_image_mode(image_mode: str | None, image: Any) -> None:
    """A given `image_mode` must be one of `IMAGE_MODES` and come with an `image`."""
    if image_mode is None:
        return
    if image_mode not in IMAGE_MODES:
        raise ValueError(f"`image_mode` must be one of {IMAGE_MODES}, got {image_mode!r}.")
    if image is None:
        raise ValueError("`image_mode` applies to `image=` (image-to-video) only; pass an `image` or drop it.")


def _first_chunk_rule(first_chunk: str | None, image: Any, image_mode: str | None) -> str:
    """The first chunk's rule: as asked, or one latent frame for a start image in the "frame" convention.

    `image_mode` is the call's or its recipe's; a recipe's applies only when the call has an `image`.
    """
    if image_mode is None or image is None:
        return first_chunk or "whole"
    check_image_mode(image_mode, image)
    if image_mode == "chunk":
        return first_chunk or "whole"
    if first_chunk not in (None, "frame"):
        raise ValueError(
            f"`image_mode='frame'` makes the first chunk one latent frame, but `first_chunk`={first_chunk!r} (given or "
            "set by the recipe) asks otherwise; pass first_chunk='frame' or image_mode='chunk'."
        )
    return "frame"


def _shared_docstring(method: Callable) -> Callable:
    """`__call__` and `stream` take the same arguments: one docstring documents them."""
    method.__doc__ = (method.__doc__ or "") + _ARGUMENTS
    return method


class ChunkedVideoPipeline(DiffusionPipeline):
    """Base of the autoregressive video pipelines: the explicit call signature, validation, streams, writing.

    Subclasses register their components and config (`denoising_steps`, `max_sequence_length`, `height`,
    `width` and every field of `options_class`), call `set_vae_factors(vae)`, and implement the family hooks.
    """

    options_class: type[CacheOptions] = CacheOptions
    cache_options: tuple[str, ...] = ()  # the names of `options_class`'s fields (set for each subclass)
    recache_modes: tuple[str, ...] = ("causal",)  # the re-cache modes the family offers (`recache=`)
    output_class = ChunkedVideoPipelineOutput
    _callback_tensor_inputs = ["latents", "prompt_embeds"]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.cache_options = cls.options_class.names()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """diffusers' loader, after refusing a local folder whose model weights do not match their config.json
        (diffusers would only warn and leave layers random or drop weights)."""
        folder = Path(str(pretrained_model_name_or_path)).expanduser()
        if folder.is_dir():
            check_pipeline_weights(folder)
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)

    @property
    def interrupt(self) -> bool:
        """Set by `pipe.interrupt = True` (e.g. from a callback): the run stops before its next step."""
        return getattr(self, "_interrupt", False)

    @interrupt.setter
    def interrupt(self, value: bool) -> None:
        self._interrupt = bool(value)

    @property
    def execution_device(self) -> torch.device:
        """Where the models run (diffusers' `_execution_device`: the GPU under model CPU offload)."""
        return self._execution_device

    # ---------------------------------------------------------------------------------------- frame counts
    def frames_to_latent(self, num_frames: int) -> int:
        return (num_frames - 1) // self.vae_scale_factor_temporal + 1

    def latent_to_frames(self, latent_frames: int) -> int:
        return (latent_frames - 1) * self.vae_scale_factor_temporal + 1

    def latent_to_pixel_start(self, latent_frame: int) -> int:
        """First pixel frame decoded from latent frame `latent_frame` (the first latent frame is 1 pixel frame)."""
        return 0 if latent_frame == 0 else (latent_frame - 1) * self.vae_scale_factor_temporal + 1

    def valid_num_frames(
        self, num_frames: int, chunk_frames: int | None = None, first_frame_alone: bool = False
    ) -> tuple[int, int]:
        """The reachable frame counts just below and above `num_frames` for this VAE and chunking.

        `first_frame_alone`: the video starts with one latent frame before its whole chunks (`image_mode="frame"`).
        """
        chunk = chunk_frames or self.config.chunk_frames
        offset = int(first_frame_alone)
        chunks = max(1, (self.frames_to_latent(max(num_frames, 1)) - offset) // chunk)
        return tuple(self.latent_to_frames(offset + n * chunk) for n in (chunks, chunks + 1))

    def check_size(self, name: str, size: Any) -> int:
        """A pixel side (`name` is "height" or "width"): a positive multiple of the VAE factor times the patch."""
        patch = dict(zip(("height", "width"), self.transformer.config.patch_size[1:]))[name]
        factor = self.vae_scale_factor_spatial
        return check_size(name, size, factor * patch, f"VAE factor {factor} x patch {patch}")

    # ---------------------------------------------------------------------------------------- validation
    @_shared_docstring
    def stream(  # noqa: PLR0913 (diffusers' explicit call signature, checked once here)
        self,
        prompt: str | list[str] | None = None,
        num_frames: int = 81,
        height: int | None = None,
        width: int | None = None,
        *,
        prompt_schedule: Sequence[tuple[int, str]] | dict[int, str] | None = None,
        negative_prompt: str | list[str] | None = None,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        denoising_steps: Sequence[float] | None = None,
        guidance_scale: float = 1.0,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        output_type: str = "np",
        max_sequence_length: int | None = None,
        callback_on_step_end: Callable | None = None,
        callback_on_step_end_tensor_inputs: list[str] | None = None,
        chunk_frames: int | None = None,
        sink_frames: int | None = None,
        window_frames: int | None = None,
        position_mode: str | None = None,
        attention_bias: float | None = None,
        kv_quantization: str | None = None,
        kv_offload: bool | None = None,
        attention_bias_mode: str | None = None,
        image: Any = None,
        video: Any = None,
        strength: float | None = None,
        image_mode: str | None = None,
        overlap_decode: bool = False,
        recipe: str | None = None,
        sigma_mapping: str | None = None,
        sigmas: Sequence[float] | None = None,
        integer_timesteps: bool | None = None,
        timestep_shift: float | None = None,
        context_noise: float | None = None,
        context_policy: str | None = None,
        first_chunk: str | None = None,
        recache: str | None = None,
        recompute_first_frame: str | None = None,
        prompt_blend_chunks: int | None = None,
    ) -> ChunkStream:
        """A live generation (`ChunkStream`): iterate it for each chunk's frames as soon as they are made.

        Every argument is checked now, before any model work; the stream starts at its first iteration. Each
        item is what `__call__` returns for those frames: `(batch, frames, H, W, 3)` np in [0, 1] for "np",
        PIL lists, `(batch, frames, 3, H, W)` torch for "pt", or the chunk's latents for "latent". The stream
        also takes `switch_prompt(...)` at chunk boundaries and round-trips through `state_dict()`.
        """
        check_output_type(output_type)
        check_image_mode(image_mode, image)
        settings = self.recipe_settings(
            recipe,
            image_mode=image_mode,
            chunk_frames=chunk_frames,
            sink_frames=sink_frames,
            window_frames=window_frames,
            position_mode=position_mode,
            attention_bias=attention_bias,
            kv_quantization=kv_quantization,
            kv_offload=kv_offload,
            attention_bias_mode=attention_bias_mode,
            denoising_steps=denoising_steps,
            sigma_mapping=sigma_mapping,
            sigmas=sigmas,
            integer_timesteps=integer_timesteps,
            timestep_shift=timestep_shift,
            context_noise=context_noise,
            context_policy=context_policy,
            first_chunk=first_chunk,
            recache=recache,
            recompute_first_frame=recompute_first_frame,
            prompt_blend_chunks=prompt_blend_chunks,
        )
        given = {name: settings.pop(name) for name in CacheOptions.known_names}
        options = self.options_class.resolve(self.config, given, type(self).__name__)
        first_chunk = _first_chunk_rule(settings["first_chunk"], image, settings["image_mode"])
        geometry, layout = self._geometry(num_frames, height, width, options, first_chunk)
        schedule = self._schedule(prompt, prompt_schedule, prompt_embeds, geometry)
        guidance_scale = check_guidance_scale(guidance_scale)
        max_sequence_length = check_max_sequence_length(
            self.config.max_sequence_length if max_sequence_length is None else max_sequence_length
        )
        batch_size = schedule.batch_size
        geometry = dataclasses.replace(geometry, chunk_shape=(batch_size, *geometry.chunk_shape[1:]))
        negatives = check_negative_prompt(negative_prompt, negative_prompt_embeds, guidance_scale, batch_size)
        self._check_schedule_text(schedule, negatives, max_sequence_length, prompt_embeds is not None, prompt is None)
        latent_shape = (*geometry.chunk_shape[:2], geometry.num_latent_frames, *geometry.chunk_shape[3:])
        check_generator(generator, batch_size)
        checked = dict(
            step_plan=self._step_plan(settings),
            latents=check_latents(latents, latent_shape),
            callback_tensor_inputs=check_callback(
                callback_on_step_end, callback_on_step_end_tensor_inputs, tuple(self._callback_tensor_inputs)
            ),
            context_noise=check_context_noise(settings["context_noise"]),
            context_policy=check_context_policy(settings["context_policy"], layout),
            recompute_first_frame=check_first_frame(settings["recompute_first_frame"]),
            recache_mode=check_recache(settings["recache"], self.recache_modes),
            overlap_decode=check_flag("overlap_decode", overlap_decode),
            prompt_blend_chunks=check_blend_chunks(settings["prompt_blend_chunks"]),
        )
        conditioning = build_conditioning(  # last: an input file's reader opens here, after every other check
            image,
            video,
            strength,
            batch_size,
            geometry.height,
            geometry.width,
            self.latent_to_frames(layout.chunk_frames),
        )
        request = VideoRequest(
            geometry=geometry,
            layout=layout,
            options=options,
            schedule=schedule,
            guidance_scale=guidance_scale,
            negative_prompt=negatives,
            max_sequence_length=max_sequence_length,
            output_type=output_type,
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            generator=generator,
            callback_on_step_end=callback_on_step_end,
            conditioning=conditioning,
            recipe=settings["recipe"],
            **checked,
        )
        return ChunkStream(self, request)

    def recipe_settings(self, recipe: str | None, **given: Any) -> dict[str, Any]:
        """The call's recipe-settable arguments: the given ones, else the recipe's (the call's, or the one the
        pipeline folder names in `model_index.json`), else the loop's default (`LOOP_DEFAULTS`) or None (the
        config's value)."""
        name = recipe if recipe is not None else self.config.get("recipe")
        settings = {key: LOOP_DEFAULTS.get(key) for key in given}  # None: the config's value (or the first chunk's)
        if name is not None:
            settings.update(get_recipe(name, type(self).__name__).settings)
        settings.update({key: value for key, value in given.items() if value is not None})
        return {**settings, "recipe": name}

    def _step_plan(self, settings: dict[str, Any]) -> StepPlan:
        steps = settings["denoising_steps"]
        shift = settings["timestep_shift"]
        return plan_steps(
            self.config.denoising_steps if steps is None else steps,
            settings["sigma_mapping"],
            self.scheduler.config.shift if shift is None else shift,
            settings["integer_timesteps"],
            settings["sigmas"],
            scheduler_shift=float(self.scheduler.config.shift),
        )

    def _geometry(
        self, num_frames, height, width, options: CacheOptions, first_chunk: str
    ) -> tuple[VideoGeometry, ChunkLayout]:
        """Frames, sizes and the cache layout of one video, inside the positions' range: whole chunks, or a first
        chunk that takes the leftover frames (`first_chunk="remainder"`, LongSANA) or is one latent frame
        (`first_chunk="frame"`: a start image's single latent frame, Self-Forcing / CausVid image-to-video)."""
        if first_chunk not in FIRST_CHUNK_RULES:
            raise ValueError(f"`first_chunk` must be one of {FIRST_CHUNK_RULES}, got {first_chunk!r}.")
        num_frames = check_num_frames(num_frames)
        height = self.check_size("height", self.config.height if height is None else height)
        width = self.check_size("width", self.config.width if width is None else width)
        spatial = self.vae_scale_factor_spatial
        latent_frames = self.frames_to_latent(num_frames)
        tokens_per_frame = self.transformer.tokens_per_frame(height // spatial, width // spatial)
        layout = self.make_layout(tokens_per_frame, options, latent_frames)
        chunk_frames = layout.chunk_frames
        first = self._first_chunk_frames(num_frames, latent_frames, chunk_frames, first_chunk)
        if first > chunk_frames:  # the model and cache are sized by the largest chunk, the first
            layout = self.make_layout(tokens_per_frame, options, latent_frames, first)
        self.transformer.check_frame_budget(latent_frames, layout)
        channels = self.transformer.config.in_channels
        return VideoGeometry(
            num_frames=num_frames,
            height=height,
            width=width,
            num_latent_frames=latent_frames,
            chunk_shape=(1, channels, chunk_frames, height // spatial, width // spatial),
            first_chunk_frames=first,
        ), layout

    def _first_chunk_frames(self, num_frames: int, latent_frames: int, chunk: int, rule: str) -> int:
        """Latent frames of the first chunk under `rule`; raises naming the nearest valid `num_frames` otherwise."""
        temporal = self.vae_scale_factor_temporal
        if (
            rule == "frame"
            and latent_frames > 1
            and (latent_frames - 1) % chunk == 0
            and not (num_frames - 1) % temporal
        ):
            return 1
        if rule == "remainder" and latent_frames >= chunk and not (num_frames - 1) % temporal:
            return chunk + latent_frames % chunk
        if rule == "whole" and latent_frames % chunk == 0 and not (num_frames - 1) % temporal:
            return chunk
        offset = 1 if rule == "frame" else 0
        below, above = self.valid_num_frames(num_frames, chunk, first_frame_alone=rule == "frame")
        raise ValueError(
            f"`num_frames`={num_frames} cannot be made of {'one frame and then ' if offset else ''}whole chunks of "
            f"{chunk} latent frames (VAE temporal factor {temporal}); nearest valid values: {below} or {above}"
            + ("" if offset else " (or `first_chunk='remainder'`: the first chunk takes the leftover frames).")
        )

    def _schedule(self, prompt, prompt_schedule, prompt_embeds, geometry: VideoGeometry) -> PromptSchedule:
        """The prompt schedule (`prompt_embeds` stand for the prompt at frame 0); its batch is the video's."""
        if prompt_embeds is not None and prompt is not None:
            raise ValueError("Give either `prompt` or `prompt_embeds`, not both.")
        schedule_prompt = prompt
        if prompt_embeds is not None:
            check_embeds("prompt_embeds", prompt_embeds)
            schedule_prompt = ["<prompt_embeds>"] * prompt_embeds.shape[0]
        last_chunk_start = self.latent_to_pixel_start(geometry.last_chunk_start)
        return PromptSchedule.build(schedule_prompt, prompt_schedule, geometry.num_frames, last_chunk_start)

    def _check_schedule_text(self, schedule, negatives, max_sequence_length, first_is_embeds, from_schedule) -> None:
        """Unknown words and truncation warned about, prompts with no known word refused (`check_prompts`)."""
        for index, (_, prompts) in enumerate(schedule.entries):
            if index == 0 and first_is_embeds:
                continue
            name = "prompt_schedule" if index > 0 or from_schedule else "prompt"
            self.check_prompt_text(list(prompts), max_sequence_length, name)
        if negatives:
            self.check_prompt_text(list(negatives), max_sequence_length, "negative_prompt", require_known_word=False)

    def check_prompt_text(
        self, prompts: list[str], max_sequence_length: int, name: str, require_known_word: bool = True
    ) -> None:
        """Warn about words the tokenizer will not read; refuse a prompt with none it knows (if it must know one)."""
        tokenizer = getattr(self, "tokenizer", None)
        if tokenizer is not None:
            check_prompts(tokenizer, prompts, max_sequence_length, name, require_known_word=require_known_word)

    # ---------------------------------------------------------------------------------------- public API
    @torch.no_grad()
    @_shared_docstring
    def __call__(  # noqa: PLR0913 (diffusers' explicit call signature)
        self,
        prompt: str | list[str] | None = None,
        num_frames: int = 81,
        height: int | None = None,
        width: int | None = None,
        *,
        prompt_schedule: Sequence[tuple[int, str]] | dict[int, str] | None = None,
        negative_prompt: str | list[str] | None = None,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        denoising_steps: Sequence[float] | None = None,
        guidance_scale: float = 1.0,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        output_type: str = "np",
        max_sequence_length: int | None = None,
        callback_on_step_end: Callable | None = None,
        callback_on_step_end_tensor_inputs: list[str] | None = None,
        chunk_frames: int | None = None,
        sink_frames: int | None = None,
        window_frames: int | None = None,
        position_mode: str | None = None,
        attention_bias: float | None = None,
        kv_quantization: str | None = None,
        kv_offload: bool | None = None,
        attention_bias_mode: str | None = None,
        image: Any = None,
        video: Any = None,
        strength: float | None = None,
        image_mode: str | None = None,
        overlap_decode: bool = False,
        recipe: str | None = None,
        sigma_mapping: str | None = None,
        sigmas: Sequence[float] | None = None,
        integer_timesteps: bool | None = None,
        timestep_shift: float | None = None,
        context_noise: float | None = None,
        context_policy: str | None = None,
        first_chunk: str | None = None,
        recache: str | None = None,
        recompute_first_frame: str | None = None,
        prompt_blend_chunks: int | None = None,
        return_dict: bool = True,
    ) -> ChunkedVideoPipelineOutput | tuple:
        """Generate a whole video: the frames of one `stream(...)` with the same arguments, joined.

        Every chunk is decoded by the stream's own causal decoder, so the result equals the stream's items
        frame for frame (and one whole-clip `vae.decode`), and concurrent calls on one pipeline never share
        decoder state. `return_dict=False` returns `(frames,)`.
        """
        stream = self.stream(
            prompt,
            num_frames,
            height,
            width,
            prompt_schedule=prompt_schedule,
            negative_prompt=negative_prompt,
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            denoising_steps=denoising_steps,
            guidance_scale=guidance_scale,
            generator=generator,
            latents=latents,
            output_type=output_type,
            max_sequence_length=max_sequence_length,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            chunk_frames=chunk_frames,
            sink_frames=sink_frames,
            window_frames=window_frames,
            position_mode=position_mode,
            attention_bias=attention_bias,
            kv_quantization=kv_quantization,
            kv_offload=kv_offload,
            attention_bias_mode=attention_bias_mode,
            image=image,
            video=video,
            strength=strength,
            image_mode=image_mode,
            overlap_decode=overlap_decode,
            recipe=recipe,
            sigma_mapping=sigma_mapping,
            sigmas=sigmas,
            integer_timesteps=integer_timesteps,
            timestep_shift=timestep_shift,
            context_noise=context_noise,
            context_policy=context_policy,
            first_chunk=first_chunk,
            recache=recache,
            recompute_first_frame=recompute_first_frame,
            prompt_blend_chunks=prompt_blend_chunks,
        )
        frames = concat_chunks(list(stream), output_type)
        if not return_dict:
            return (frames,)
        return self.output_class(frames=frames)

    def generate_to_file(
        self,
        path: str,
        prompt: str | None = None,
        fps: int = 16,
        *,
        resume: bool = False,
        state_every_s: float = 60.0,
        quality: float = 5,
        **kwargs: Any,
    ) -> int:
        """Stream a video straight into an mp4 at `path` in constant memory; returns the frames in the file.

        Takes the arguments of `stream` (batch size 1). The file appears at `path` only when generation
        succeeds; a failed or interrupted run keeps the frames done as `path`'s partial file (`video.partial.mp4`)
        and never touches an existing file at `path`. Every `state_every_s` seconds (0: every chunk) the run's
        state is saved beside it (`video.resume.safetensors`); `resume=True` continues from there, and the
        resumed video equals an uninterrupted one. `quality` is the encoder's, 1 (smallest file) to 10 (lossless
        with libx264). See `rolldiff.pipelines.resume.write_video`.
        """
        from .resume import write_video  # resume's file I/O is only needed here

        if kwargs.get("output_type", "np") != "np":
            raise ValueError("`output_type`: `generate_to_file` writes frames itself; do not pass it.")
        stream = self.stream(prompt, **kwargs)  # checks every argument before any work
        return write_video(stream, path, fps, resume=resume, state_every_s=state_every_s, quality=quality)

    # ---------------------------------------------------------------------------------------- speed
    def enable_fp8(self) -> bool:
        """float8 weights and activations for the transformer's per-step linear layers (torchao; CUDA, sm 8.9+,
        bf16 weights): `acceleration.enable_fp8`. Apply before compiling. Refused elsewhere, naming why
        (`AccelerationUnavailable`); False when no layer was converted."""
        return enable_fp8(self.transformer)

    def set_attention_backend(self, name: str = "fastest") -> str:
        """Every attention through diffusers' backend `name`, or the fastest the transformer's device offers
        ("fastest": FA3, flash, cuDNN or SDPA); masked calls fall back to SDPA. Returns the backend set. Chosen and
        checked on one device, the transformer's (`acceleration.set_attention_backend` checks there)."""
        from .acceleration import transformer_device

        chosen = fastest_attention_backend(transformer_device(self.transformer)) if name == "fastest" else name
        set_attention_backend(self.transformer, chosen)
        return chosen

    def enable_cuda_graphs(self):
        """Replay the compiled cached step as CUDA graphs (`torch.compile(mode="reduce-overhead", fullgraph=True)`:
        2 graphs, the ring buffers' static addresses); one stream per transformer. Refused off CUDA or under
        offload hooks (`AccelerationUnavailable`)."""
        return capture_cuda_graphs(self.transformer)

    # ---------------------------------------------------------------------------------------- the loop's pieces
    def branch_embeds(self, request: VideoRequest, prompt_index: int) -> torch.Tensor:
        """The conditional branch's text embeddings for schedule entry `prompt_index`."""
        if prompt_index == 0 and request.prompt_embeds is not None:
            return request.prompt_embeds.to(device=self.execution_device, dtype=self.transformer.dtype)
        return self.encode_prompt(request.schedule.prompts(prompt_index), request.max_sequence_length)

    def set_conditioning(self, cache, embeds: torch.Tensor) -> None:
        """Tell the cache the prompt changed; fill the text K/V now unless offload hooks move the model per call."""
        cache.reset_cross_attention()
        if getattr(self.transformer, "_hf_hook", None) is None:  # offloaded: filled lazily by the first step
            self.transformer.prepare_conditioning(cache, embeds)

    def context_pass(
        self, clean: torch.Tensor, embeds: Sequence[torch.Tensor], caches: Sequence, request, timestep: float = 0.0
    ) -> None:
        """Write the clean chunk's K/V at `timestep` (0; Self-Forcing's `context_noise`) into every branch's cache
        and commit."""
        timestep = torch.full((clean.shape[0],), float(timestep), device=clean.device)
        for branch_embeds, cache in zip(embeds, caches):
            self.transformer_step(clean, timestep, branch_embeds, cache, request)
            cache.commit()

    def postprocess(self, video: torch.Tensor, output_type: str) -> Any:
        """`(batch, 3, frames, H, W)` in [-1, 1] -> the requested output type."""
        return self.video_processor.postprocess_video(video.float(), output_type=output_type)

    def encode_prompt(self, prompts: list[str], max_sequence_length: int) -> torch.Tensor:
        """Text embeddings `(batch, max_sequence_length, channels)` on the execution device in the transformer's
        dtype, zero past each prompt's end (UMT5 and Gemma encoders alike; see `encode_prompts`)."""
        return encode_prompts(
            self.tokenizer,
            self.text_encoder,
            prompts,
            check_max_sequence_length(max_sequence_length),
            device=self.execution_device,
            dtype=self.transformer.dtype,
        )

    def set_vae_factors(self, vae) -> None:
        """Temporal and spatial compression of the Wan VAE (its `temperal_downsample` flags), and the processor."""
        downsample = getattr(vae.config, "temperal_downsample", [False, True, True]) if vae is not None else None
        self.vae_scale_factor_temporal = 2 ** sum(downsample) if downsample is not None else 4
        self.vae_scale_factor_spatial = 2 ** len(downsample) if downsample is not None else 8
        self.video_processor = VideoProcessor(vae_scale_factor=self.vae_scale_factor_spatial)

    def cache_device(self, device: torch.device) -> torch.device | None:
        """The execution device; `None` (each block's own device) for a transformer split by `device_map`."""
        device_map = getattr(self.transformer, "hf_device_map", None) or {}
        return None if len(set(device_map.values())) > 1 else device

    # ---------------------------------------------------------------------------------------- family hooks
    def make_layout(
        self, tokens_per_frame: int, options: CacheOptions, num_latent_frames: int, largest_chunk: int | None = None
    ) -> ChunkLayout:
        """The family's cache geometry for a video of `num_latent_frames`, never larger than the video fills;
        `largest_chunk` (latent frames) when the first chunk is longer than `options.chunk_frames`."""
        raise NotImplementedError

    def make_stream_cache(self, request: VideoRequest, dtype: torch.dtype, device: torch.device):
        """One stream's cache for one guidance branch, allocated now (a failure names the settings that size it)."""
        try:
            return self.transformer.make_cache(
                request.layout, request.batch_size, dtype, self.cache_device(device), **self.cache_storage(request)
            )
        except (torch.OutOfMemoryError, RuntimeError) as error:
            if not isinstance(error, torch.OutOfMemoryError) and "alloc" not in str(error).lower():
                raise
            layout = request.layout
            raise CacheAllocationError(
                f"The KV cache for `sink_frames`={layout.sink_frames}, `window_frames`={layout.window_frames} "
                f"({layout.context_frames * layout.tokens_per_frame} tokens per block, batch {request.batch_size}) "
                f"does not fit in memory: {str(error).splitlines()[0]} Lower `window_frames` / `sink_frames`, the "
                "frame size or the batch, or store the cache with `kv_quantization` / `kv_offload`."
            ) from None

    def cache_storage(self, request: VideoRequest) -> dict[str, Any]:
        """Keyword arguments of the transformer's `make_cache` beyond the layout (e.g. quantized storage)."""
        return {}

    def make_encoder(self) -> StreamingWanEncoder:
        """A fresh streaming encoder for one stream's start image or input video (its own feature cache)."""
        return StreamingWanEncoder(self.vae)

    def make_decoder(self):
        """A fresh streaming decoder for one stream: the Wan VAE's causal decoder with a feature cache of its own,
        or the tiny autoencoder's (TAEHV) after `load_tiny_autoencoder`."""
        tiny = getattr(self, "tiny_autoencoder", None)
        if tiny is not None:
            return StreamingTinyDecoder(tiny)  # TAEHV decodes the transformer's latents as they are
        return StreamingWanDecoder(self.vae, denormalize=True)

    def load_tiny_autoencoder(self, path_or_model: str | os.PathLike | TinyVideoAutoencoder | None):
        """Decode with a tiny autoencoder (TAEHV architecture: `taew2_1.pth` / `.safetensors` for Wan 2.1) instead of
        the full VAE: every stream made afterwards decodes through it, about 25x less work per chunk. `None`
        returns to the full VAE. The VAE still encodes start images and input videos. Returns the autoencoder."""
        if path_or_model is None or isinstance(path_or_model, TinyVideoAutoencoder):
            tiny = path_or_model
        else:
            tiny = TinyVideoAutoencoder.from_single_file(path_or_model)
        if tiny is not None:
            channels = self.transformer.config.out_channels
            if tiny.config.latent_channels != channels:
                raise ValueError(
                    f"`path_or_model`: the tiny autoencoder decodes {tiny.config.latent_channels} latent channels, this "
                    f"transformer makes {channels} (taew2_1 is for Wan 2.1's 16)."
                )
            tiny = tiny.to(self.vae.device)
            tiny = (tiny if tiny.dtype == self.vae.dtype else tiny.to(dtype=self.vae.dtype)).eval()
        self.tiny_autoencoder = tiny
        return tiny

    def transformer_step(self, latents, timestep, embeds, cache, request: VideoRequest) -> torch.Tensor:
        """One forward of the chunk through `cache`; returns the velocity."""
        raise NotImplementedError

    def recache_frames(self, layout: ChunkLayout, committed_frames: int, chunk_frames: int) -> int:
        """Clean latent frames to keep for a re-cache after a prompt switch (`chunk_frames`: the chunk just
        committed, which is not every chunk's size when the first takes the leftover frames)."""
        raise NotImplementedError

    def recache(self, recent: torch.Tensor, embeds: torch.Tensor, cache, request: VideoRequest) -> None:
        """Rewrite the recent context under the new prompt (the family's re-cache)."""
        raise NotImplementedError

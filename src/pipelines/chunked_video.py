"""`ChunkedVideoPipeline`: what every autoregressive video pipeline shares (Krea-like, LongSana-like).

The chunk loop: each chunk of a few latent frames starts from fresh noise and is denoised in a few
steps by a per-run copy of the pipeline's `FlowMatchEulerDiscreteScheduler` in stochastic mode (each
step predicts x0 = x_t - sigma v and re-noises it to the next sigma, as Self-Forcing and LongSANA do);
every step overwrites the same pending cache entries. Then one context pass of the clean chunk at
t = 0 writes its K/V (or state) and `commit()` advances the cache. `stream` yields decoded frames chunk
by chunk (the Wan VAE decodes causally with its feature cache kept alive), so hours of video fit in
the memory of the first minute.

Noise and seeds: nothing the size of the video is allocated. Chunk k's starting noise
`(batch, channels, chunk_frames, h, w)` is drawn from `generator` when chunk k starts, followed by one
draw per denoising step (the scheduler's re-noise), so a seed fixes the whole video and a chunk's
noise depends on the seed and its index only.

A family implements the hooks at the bottom (`_make_layout`, `_transformer_step`, `_recache`, ...)
and declares its cache options (`cache_options`), which are call arguments and config defaults.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler
from diffusers.utils import BaseOutput
from diffusers.utils.torch_utils import randn_tensor
from diffusers.video_processor import VideoProcessor

from ..models.weights import check_pipeline_weights
from .prompt_schedule import PromptSchedule
from .streaming_decode import StreamingWanDecoder, denormalize_wan_latents
from .text_encoding import check_max_sequence_length, check_prompts, encode_prompts

OUTPUT_TYPES = ("np", "pil", "pt", "latent")


@dataclass
class ChunkedVideoPipelineOutput(BaseOutput):
    """`frames`: `(batch, frames, height, width, 3)` np in [0, 1], a list of PIL lists, `(batch, frames, 3, H, W)`
    torch, or latents `(batch, channels, latent_frames, h, w)` for `output_type="latent"`."""

    frames: np.ndarray | list[list[PIL.Image.Image]] | torch.Tensor


@dataclass
class ChunkRun:
    """Everything one generation needs, validated before any work."""

    layout: Any
    schedule: PromptSchedule
    batch_size: int
    num_latent_frames: int
    chunk_shape: tuple[int, int, int, int, int]  # (batch, channels, chunk_frames, h, w)
    denoising_steps: list[float]
    guidance_scale: float
    negative_prompt: list[str] | None
    max_sequence_length: int
    options: dict[str, Any]  # the family's cache options, resolved against the config
    prompt_embeds: torch.Tensor | None = None
    negative_prompt_embeds: torch.Tensor | None = None

    @property
    def num_chunks(self) -> int:
        return self.num_latent_frames // self.chunk_shape[2]


@dataclass
class StreamState:
    """The loop's state at a chunk boundary: what a resumed run needs besides the caches' tensors.

    Pass an empty `StreamState()` as `stream(..., state=)` to hold the live state of that stream (its
    caches, decoder, position); `on_start(state, run)` runs once the caches exist, before the first chunk
    (a resume restores them there, see `rolldiff.pipelines.resume`).
    """

    caches: list = field(default_factory=list)  # one RollingKVCache per guidance branch (conditional first)
    embeds: list[torch.Tensor] = field(default_factory=list)  # text embeddings per branch
    active_prompt: int = 0  # index into the prompt schedule
    next_chunk: int = 0
    recent: torch.Tensor | None = None  # clean latents a re-cache re-runs after a prompt switch
    scheduler: FlowMatchEulerDiscreteScheduler | None = field(default=None, repr=False)
    run: ChunkRun | None = field(default=None, repr=False)  # set by `stream` once the arguments are checked
    decoder: StreamingWanDecoder | None = field(default=None, repr=False)
    on_start: Callable | None = field(default=None, repr=False)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class ChunkedVideoPipeline(DiffusionPipeline):
    """Base of the autoregressive video pipelines: validation, the chunk loop, streaming decode, writing.

    Subclasses register their components and config (including `denoising_steps`,
    `max_sequence_length`, `height`, `width` and every name in `cache_options`), set
    `vae_scale_factor_temporal` / `vae_scale_factor_spatial` / `video_processor`, and implement the hooks.
    """

    cache_options: tuple[str, ...] = ()
    _callback_tensor_inputs = ["latents", "prompt_embeds"]

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

    # ---------------------------------------------------------------------------------------- frame counts
    def _frames_to_latent(self, num_frames: int) -> int:
        return (num_frames - 1) // self.vae_scale_factor_temporal + 1

    def _latent_to_frames(self, latent_frames: int) -> int:
        return (latent_frames - 1) * self.vae_scale_factor_temporal + 1

    def _latent_to_pixel_start(self, latent_frame: int) -> int:
        """First pixel frame decoded from latent frame `latent_frame` (the first latent frame is 1 pixel frame)."""
        return 0 if latent_frame == 0 else (latent_frame - 1) * self.vae_scale_factor_temporal + 1

    def valid_num_frames(self, num_frames: int, chunk_frames: int | None = None) -> tuple[int, int]:
        """The reachable frame counts just below and above `num_frames` for this VAE and chunking."""
        chunk = chunk_frames or self.config.chunk_frames
        chunks = max(1, self._frames_to_latent(max(num_frames, 1)) // chunk)
        return self._latent_to_frames(chunks * chunk), self._latent_to_frames((chunks + 1) * chunk)

    # ---------------------------------------------------------------------------------------- validation
    def _resolve_options(self, options: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(
            name for name, value in options.items() if name not in self.cache_options and value is not None
        )
        if unknown:
            raise TypeError(
                f"{type(self).__name__} got unexpected argument(s) {unknown}; its cache options are "
                f"{list(self.cache_options)}."
            )
        return {name: self.config[name] if options.get(name) is None else options[name] for name in self.cache_options}

    def _check_size(self, name: str, size, patch: int) -> int:
        multiple = self.vae_scale_factor_spatial * patch
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size <= 0 or size % multiple:
            raise ValueError(
                f"`{name}` must be a positive multiple of {multiple} (VAE factor {self.vae_scale_factor_spatial} x "
                f"patch {patch}), got {size!r}."
            )
        return int(size)

    def _prepare_run(
        self,
        prompt,
        prompt_schedule,
        negative_prompt,
        num_frames,
        height,
        width,
        denoising_steps,
        guidance_scale,
        output_type,
        latents,
        max_sequence_length,
        prompt_embeds,
        negative_prompt_embeds,
        options: dict[str, Any],
    ) -> ChunkRun:
        """Check every argument and derive the run's geometry; raises before any model work."""
        config = self.config
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"`output_type` must be one of {OUTPUT_TYPES}, got {output_type!r}.")
        options = self._resolve_options(options)
        if isinstance(num_frames, bool) or not isinstance(num_frames, numbers.Integral) or num_frames < 1:
            raise ValueError(f"`num_frames` must be a positive int, got {num_frames!r}.")
        num_frames = int(num_frames)
        _, p_h, p_w = self.transformer.config.patch_size
        height = self._check_size("height", config.height if height is None else height, p_h)
        width = self._check_size("width", config.width if width is None else width, p_w)
        spatial = self.vae_scale_factor_spatial
        tokens_per_frame = self.transformer.tokens_per_frame(height // spatial, width // spatial)
        layout = self._make_layout(tokens_per_frame, options)
        chunk_frames = layout.chunk_frames
        latent_frames = self._frames_to_latent(num_frames)
        reachable = (num_frames - 1) % self.vae_scale_factor_temporal == 0 and latent_frames % chunk_frames == 0
        if not reachable:
            below, above = self.valid_num_frames(num_frames, chunk_frames)
            raise ValueError(
                f"`num_frames`={num_frames} cannot be made of whole chunks of {chunk_frames} latent frames "
                f"(VAE temporal factor {self.vae_scale_factor_temporal}); nearest valid values: {below} or {above}."
            )
        self._check_length(latent_frames, layout)
        steps = list(config.denoising_steps if denoising_steps is None else denoising_steps)
        if (
            not steps
            or not all(_is_number(s) and 0 < s <= 1000 for s in steps)
            or any(a <= b for a, b in zip(steps, steps[1:]))
        ):
            raise ValueError(f"`denoising_steps` must be strictly decreasing numbers in (0, 1000], got {steps}.")
        if not _is_number(guidance_scale) or not math.isfinite(guidance_scale) or guidance_scale < 1.0:
            raise ValueError(
                f"`guidance_scale` must be a finite number >= 1.0 (1.0 disables guidance), got {guidance_scale!r}."
            )
        if prompt_embeds is not None and prompt is not None:
            raise ValueError("Give either `prompt` or `prompt_embeds`, not both.")
        schedule_prompt = prompt
        if prompt_embeds is not None:
            self._check_embeds("prompt_embeds", prompt_embeds)
            schedule_prompt = ["<prompt_embeds>"] * prompt_embeds.shape[0]  # stands for the embeds at frame 0
        last_chunk_start = self._latent_to_pixel_start(latent_frames - chunk_frames)
        schedule = PromptSchedule.build(schedule_prompt, prompt_schedule, num_frames, last_chunk_start)
        batch_size = schedule.batch_size
        max_sequence_length = check_max_sequence_length(
            config.max_sequence_length if max_sequence_length is None else max_sequence_length
        )
        negatives = None
        if guidance_scale > 1.0 and negative_prompt_embeds is None:
            negatives = (
                [negative_prompt or ""] * batch_size if not isinstance(negative_prompt, list) else negative_prompt
            )
            if len(negatives) != batch_size:
                raise ValueError(f"`negative_prompt` has {len(negatives)} entries, expected {batch_size}.")
        if negative_prompt_embeds is not None:
            self._check_embeds("negative_prompt_embeds", negative_prompt_embeds, batch_size)
        self._check_prompt_text(schedule, negatives, max_sequence_length, prompt_embeds is not None, prompt is None)
        channels = self.transformer.config.in_channels
        latent_shape = (batch_size, channels, latent_frames, height // spatial, width // spatial)
        if latents is not None:
            if not isinstance(latents, torch.Tensor) or tuple(latents.shape) != latent_shape:
                got = tuple(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__
                raise ValueError(f"`latents` must be a tensor of shape {latent_shape}, got {got}.")
            if not torch.isfinite(latents).all():
                raise ValueError("`latents` contain NaN or infinite values.")
        return ChunkRun(
            layout=layout,
            schedule=schedule,
            batch_size=batch_size,
            num_latent_frames=latent_frames,
            chunk_shape=(batch_size, channels, chunk_frames, height // spatial, width // spatial),
            denoising_steps=[float(s) for s in steps],
            guidance_scale=float(guidance_scale),
            negative_prompt=negatives,
            max_sequence_length=max_sequence_length,
            options=options,
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
        )

    def _check_prompt_text(self, schedule, negatives, max_sequence_length, first_is_embeds, from_schedule) -> None:
        """Unknown words and truncation warned about, prompts with no known word refused (`check_prompts`)."""
        tokenizer = getattr(self, "tokenizer", None)
        if tokenizer is None:
            return
        for index, (_, prompts) in enumerate(schedule.entries):
            if index == 0 and first_is_embeds:
                continue
            name = "prompt_schedule" if index > 0 or from_schedule else "prompt"
            check_prompts(tokenizer, prompts, max_sequence_length, name)
        if negatives:
            check_prompts(tokenizer, negatives, max_sequence_length, "negative_prompt", require_known_word=False)

    def _check_embeds(self, name: str, embeds, batch_size: int | None = None) -> None:
        if not isinstance(embeds, torch.Tensor) or embeds.ndim != 3:
            got = f"shape {tuple(embeds.shape)}" if isinstance(embeds, torch.Tensor) else type(embeds).__name__
            raise ValueError(f"`{name}` must be a (batch, tokens, channels) tensor, got {got}.")
        if batch_size is not None and embeds.shape[0] != batch_size:
            raise ValueError(f"`{name}` has batch {embeds.shape[0]}, expected {batch_size}.")

    def _check_callback_inputs(self, names: list[str] | None) -> list[str]:
        names = ["latents"] if names is None else list(names)
        unknown = [n for n in names if n not in self._callback_tensor_inputs]
        if unknown:
            raise ValueError(
                f"`callback_on_step_end_tensor_inputs` has {unknown}; allowed: {self._callback_tensor_inputs}."
            )
        return names

    # ---------------------------------------------------------------------------------------- the chunk loop
    def _run_scheduler(self) -> FlowMatchEulerDiscreteScheduler:
        """A private scheduler per stream (concurrent streams never share step counters), re-noising each step."""
        return FlowMatchEulerDiscreteScheduler.from_config(
            self.scheduler.config, stochastic_sampling=True, use_dynamic_shifting=False
        )

    def _branch_embeds(self, run: ChunkRun, prompt_index: int) -> torch.Tensor:
        if prompt_index == 0 and run.prompt_embeds is not None:
            return run.prompt_embeds.to(device=self._execution_device, dtype=self.transformer.dtype)
        return self.encode_prompt(run.schedule.prompts(prompt_index), run.max_sequence_length)

    def _start_stream(self, run: ChunkRun, state: StreamState | None = None) -> StreamState:
        """Encode the prompts and make the caches, into `state` when one is given (the caller holds it)."""
        device, dtype = self._execution_device, self.transformer.dtype
        embeds = [self._branch_embeds(run, 0)]
        if run.guidance_scale > 1.0:
            negative = run.negative_prompt_embeds
            if negative is None:
                negative = self.encode_prompt(run.negative_prompt, run.max_sequence_length)
            embeds.append(negative.to(device=device, dtype=dtype))
        caches = [self._make_cache(run, dtype, self._cache_device(device)) for _ in embeds]
        for cache, branch_embeds in zip(caches, embeds):
            self._set_conditioning(cache, branch_embeds)
        keeps_recent = run.schedule.may_switch  # only a prompt switch re-runs recent frames
        recent = torch.zeros((*run.chunk_shape[:2], 0, *run.chunk_shape[3:]), device=device, dtype=dtype)
        state = StreamState() if state is None else state
        state.caches, state.embeds, state.run = caches, embeds, run
        state.recent, state.scheduler = (recent if keeps_recent else None), self._run_scheduler()
        if state.on_start is not None:
            state.on_start(state, run)
        return state

    def _set_conditioning(self, cache, embeds: torch.Tensor) -> None:
        """Tell the cache the prompt changed; fill the text K/V now unless offload hooks move the model per call."""
        cache.reset_cross_attention()
        if getattr(self.transformer, "_hf_hook", None) is None:  # offloaded: filled lazily by the first step
            self.transformer.prepare_conditioning(cache, embeds)

    def _switch_prompt(self, state: StreamState, run: ChunkRun, prompt_index: int) -> None:
        """New cross-attention K/V for the conditional branch, then the family's re-cache of recent context."""
        state.active_prompt = prompt_index
        state.embeds[0] = self._branch_embeds(run, prompt_index)
        self._set_conditioning(state.caches[0], state.embeds[0])
        if state.recent is not None and state.recent.shape[2] > 0:
            self._recache(state.recent, state.embeds[0], state.caches[0], run)

    def _denoise(self, chunk: torch.Tensor, timestep: float, state: StreamState, run: ChunkRun) -> torch.Tensor:
        """The velocity for one chunk at `timestep` (guided when a negative branch exists)."""
        t = torch.full((chunk.shape[0],), timestep, device=chunk.device, dtype=torch.float32)
        velocity = self._transformer_step(chunk, t, state.embeds[0], state.caches[0], run)
        if len(state.caches) > 1:
            unconditional = self._transformer_step(chunk, t, state.embeds[1], state.caches[1], run)
            velocity = unconditional + run.guidance_scale * (velocity - unconditional)
        return velocity

    def _context_pass(self, clean: torch.Tensor, embeds: Sequence[torch.Tensor], caches: Sequence, run) -> None:
        """Write the clean chunk's K/V at t = 0 into every branch's cache and commit."""
        timestep = torch.zeros(clean.shape[0], device=clean.device)
        for branch_embeds, cache in zip(embeds, caches):
            self._transformer_step(clean, timestep, branch_embeds, cache, run)
            cache.commit()

    def _generate_latents(
        self,
        run: ChunkRun,
        generator,
        latents: torch.Tensor | None,
        callback: Callable | None,
        tensor_inputs,
        state: StreamState | None = None,
    ) -> Iterator[torch.Tensor]:
        """Yield each chunk's clean latents `(batch, channels, chunk_frames, h, w)` in the model's dtype."""
        device, dtype = self._execution_device, self.transformer.dtype
        state = self._start_stream(run, state)
        scheduler = state.scheduler
        chunk_frames = run.chunk_shape[2]
        step_index = state.next_chunk * len(run.denoising_steps)  # a resumed stream counts on
        self._interrupt = False
        with self.progress_bar(total=run.num_chunks) as progress:
            progress.update(state.next_chunk)  # a resumed stream starts part-way
            for chunk_index in range(state.next_chunk, run.num_chunks):
                start = chunk_index * chunk_frames
                now_active = run.schedule.active_index(self._latent_to_pixel_start(start))
                if now_active != state.active_prompt:
                    self._switch_prompt(state, run, now_active)
                if latents is None:  # drawn now, chunk by chunk: nothing the size of the video exists
                    noisy = randn_tensor(run.chunk_shape, generator=generator, device=device, dtype=torch.float32)
                else:
                    noisy = latents[:, :, start : start + chunk_frames].to(device=device, dtype=torch.float32)
                scheduler.set_timesteps(sigmas=[s / 1000.0 for s in run.denoising_steps], device=device)
                for timestep in scheduler.timesteps:
                    if self.interrupt:
                        return
                    velocity = self._denoise(noisy.to(dtype), float(timestep), state, run)
                    noisy = scheduler.step(velocity.float(), timestep, noisy, generator=generator).prev_sample
                    noisy = noisy.float()
                    if callback is not None:
                        values = {"latents": noisy, "prompt_embeds": state.embeds[0]}
                        result = callback(self, step_index, timestep, {k: values[k] for k in tensor_inputs})
                        noisy = self._callback_latents(result, noisy)
                    step_index += 1
                clean = noisy.to(dtype)  # the last step re-noises to sigma 0: the clean chunk
                self._check_finite(clean, chunk_index)
                self._context_pass(clean, state.embeds, state.caches, run)
                if state.recent is not None:
                    keep = self._recache_frames(run.layout, start + chunk_frames)
                    state.recent = torch.cat([state.recent, clean], dim=2)[:, :, -keep:] if keep else clean[:, :, :0]
                state.next_chunk = chunk_index + 1
                progress.update()
                yield clean

    @staticmethod
    def _callback_latents(result, latents: torch.Tensor) -> torch.Tensor:
        if result is None:
            return latents
        if not isinstance(result, dict):
            raise TypeError(f"`callback_on_step_end` must return a dict (or None), got {type(result).__name__}.")
        new = result.get("latents", latents)
        if not isinstance(new, torch.Tensor) or new.shape != latents.shape:
            raise ValueError(
                f"`callback_on_step_end` returned `latents` that are not a {tuple(latents.shape)} tensor."
            )
        return new.float()

    @staticmethod
    def _check_finite(clean: torch.Tensor, chunk_index: int) -> None:
        if not torch.isfinite(clean).all():
            raise FloatingPointError(
                f"Chunk {chunk_index} produced NaN or infinite latents; generation stopped (frames before it are kept)."
            )

    # ---------------------------------------------------------------------------------------- public API
    def stream(
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
        state: StreamState | None = None,
        **cache_options: Any,
    ) -> Iterator[Any]:
        """Yield each chunk's decoded frames as soon as it is generated.

        Takes `__call__`'s arguments (except `return_dict`). Each item is what `__call__` would return for
        those frames: `(batch, frames, H, W, 3)` np in [0, 1] for "np", PIL lists, `(batch, frames, 3, H, W)`
        torch for "pt", or the chunk's latents for "latent". Every argument is checked before any work.
        `state`: an empty `StreamState()` the stream fills and keeps current (caches, decoder, next chunk).
        """
        run = self._prepare_run(
            prompt, prompt_schedule, negative_prompt, num_frames, height, width, denoising_steps, guidance_scale,
            output_type, latents, max_sequence_length, prompt_embeds, negative_prompt_embeds, cache_options,
        )  # fmt: skip
        tensor_inputs = self._check_callback_inputs(callback_on_step_end_tensor_inputs)
        self._check_generator(generator, run.batch_size)
        if state is not None:
            if not isinstance(state, StreamState) or state.caches:
                raise ValueError("`state` must be a new, empty StreamState(); a stream fills it.")
            state.run = run
        return self._stream_chunks(run, generator, latents, output_type, callback_on_step_end, tensor_inputs, state)

    @staticmethod
    def _check_generator(generator, batch_size: int) -> None:
        generators = generator if isinstance(generator, list) else [generator]
        if generator is None:
            return
        if not all(isinstance(g, torch.Generator) for g in generators):
            raise TypeError(
                f"`generator` must be a torch.Generator or a list of them, got {type(generator).__name__} "
                "(use torch.Generator().manual_seed(seed))."
            )
        if isinstance(generator, list) and len(generator) != batch_size:
            raise ValueError(
                f"`generator` is a list of {len(generator)}, expected one per batch element ({batch_size})."
            )

    @torch.no_grad()
    def _stream_chunks(self, run: ChunkRun, generator, latents, output_type: str, callback, tensor_inputs, state=None):
        state = StreamState() if state is None else state
        decoder = state.decoder = StreamingWanDecoder(self.vae) if output_type != "latent" else None
        for clean in self._generate_latents(run, generator, latents, callback, tensor_inputs, state):
            if decoder is None:
                yield clean
                continue
            video = decoder.decode(denormalize_wan_latents(clean.to(self.vae.dtype), self.vae))
            yield self._postprocess(video, output_type)
        self.maybe_free_model_hooks()

    def _postprocess(self, video: torch.Tensor, output_type: str):
        """`(batch, 3, frames, H, W)` in [-1, 1] -> the requested output type."""
        return self.video_processor.postprocess_video(video.float(), output_type=output_type)

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str] | None = None,
        num_frames: int = 81,
        height: int | None = None,
        width: int | None = None,
        *,
        return_dict: bool = True,
        output_type: str = "np",
        **kwargs: Any,
    ) -> ChunkedVideoPipelineOutput | tuple:
        """Generate a whole video (all of `stream`'s arguments), then decode it in one pass.

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
            **cache_options: the family's cache geometry (`cache_options`), defaults from the config.
        """
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"`output_type` must be one of {OUTPUT_TYPES}, got {output_type!r}.")
        chunks = list(self.stream(prompt, num_frames, height, width, output_type="latent", **kwargs))
        if not chunks:  # interrupted before the first chunk finished
            frames = None
        else:
            latents_out = torch.cat(chunks, dim=2)
            del chunks
            if output_type == "latent":
                frames = latents_out
            else:
                video = self.vae.decode(denormalize_wan_latents(latents_out.to(self.vae.dtype), self.vae)).sample
                frames = self._postprocess(video, output_type)
        self.maybe_free_model_hooks()
        if not return_dict:
            return (frames,)
        return self.output_class(frames=frames)

    output_class = ChunkedVideoPipelineOutput

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
        from .resume import write_video  # resume imports this module

        return write_video(
            self, path, prompt, fps, resume=resume, state_every_s=state_every_s, quality=quality, **kwargs
        )

    # ---------------------------------------------------------------------------------------- family hooks
    def encode_prompt(self, prompts: list[str], max_sequence_length: int) -> torch.Tensor:
        """Text embeddings `(batch, max_sequence_length, channels)` on the execution device in the transformer's
        dtype, zero past each prompt's end (UMT5 and Gemma encoders alike; see `encode_prompts`)."""
        return encode_prompts(
            self.tokenizer,
            self.text_encoder,
            prompts,
            check_max_sequence_length(max_sequence_length),
            device=self._execution_device,
            dtype=self.transformer.dtype,
        )

    def _set_vae_factors(self, vae) -> None:
        """Temporal and spatial compression of the Wan VAE (its `temperal_downsample` flags), and the processor."""
        downsample = getattr(vae.config, "temperal_downsample", [False, True, True]) if vae is not None else None
        self.vae_scale_factor_temporal = 2 ** sum(downsample) if downsample is not None else 4
        self.vae_scale_factor_spatial = 2 ** len(downsample) if downsample is not None else 8
        self.video_processor = VideoProcessor(vae_scale_factor=self.vae_scale_factor_spatial)

    def _make_layout(self, tokens_per_frame: int, options: dict[str, Any]):
        """The family's cache geometry (with `chunk_frames`) from the resolved cache options; validates them."""
        raise NotImplementedError

    def _check_length(self, num_latent_frames: int, layout) -> None:
        """Refuse a video the positions cannot reach (e.g. absolute RoPE past the table)."""

    def _cache_device(self, device: torch.device) -> torch.device | None:
        """The execution device; `None` (each block's own device) for a transformer split by `device_map`."""
        device_map = getattr(self.transformer, "hf_device_map", None) or {}
        return None if len(set(device_map.values())) > 1 else device

    def _make_cache(self, run: ChunkRun, dtype: torch.dtype, device: torch.device | None):
        """One stream's cache for one guidance branch (default: the transformer's `make_cache`)."""
        return self.transformer.make_cache(run.layout, run.batch_size, dtype, device)

    def _transformer_step(self, latents, timestep, embeds, cache, run: ChunkRun) -> torch.Tensor:
        """One forward of the chunk through `cache`; returns the velocity."""
        raise NotImplementedError

    def _recache_frames(self, layout, committed_frames: int) -> int:
        """Clean latent frames to keep for a re-cache after a prompt switch."""
        raise NotImplementedError

    def _recache(self, recent: torch.Tensor, embeds: torch.Tensor, cache, run: ChunkRun) -> None:
        """Rewrite the recent context under the new prompt (the family's re-cache)."""
        raise NotImplementedError

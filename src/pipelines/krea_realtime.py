"""`KreaRealtimeVideoPipeline`: long text-to-video, chunk by chunk, with a rolling KV cache.

The chunk loop (Self-Forcing / Krea Realtime / LongLive): each chunk of `chunk_frames` latent frames
starts from noise and is denoised in a few steps (default [1000, 750, 500, 250] warped by the
scheduler's shift), re-noised between steps; every step overwrites the same pending cache slots.
Then one context pass of the clean chunk at t = 0 writes its K/V and `commit()` advances the cache,
evicting what falls out of the window. `stream` yields decoded frames chunk by chunk (the VAE decodes
causally with its feature cache kept alive), so hours of video fit in the memory of the first minute.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import PIL.Image
import torch
from diffusers import AutoencoderKLWan, DiffusionPipeline, FlowMatchEulerDiscreteScheduler
from diffusers.utils import BaseOutput
from diffusers.utils.torch_utils import randn_tensor
from diffusers.video_processor import VideoProcessor

from ..caching import RollingKVCache
from ..models.krea_realtime import POSITION_MODES, ChunkLayout, KreaRealtimeTransformer3DModel
from .flow_matching import add_noise, predict_clean, sigma_for_step
from .prompt_schedule import PromptSchedule
from .streaming_decode import StreamingWanDecoder, denormalize_wan_latents
from .text_encoding import encode_prompts
from .video_writer import StreamingVideoWriter

OUTPUT_TYPES = ("np", "pil", "pt", "latent")


@dataclass
class KreaRealtimeVideoPipelineOutput(BaseOutput):
    """`frames`: `(batch, frames, height, width, 3)` np in [0, 1], a list of PIL lists, `(batch, frames, 3, H, W)`
    torch, or latents `(batch, channels, latent_frames, h, w)` for `output_type="latent"`."""

    frames: np.ndarray | list[list[PIL.Image.Image]] | torch.Tensor


@dataclass
class _Run:
    """Everything one generation needs, validated before any work."""

    layout: ChunkLayout
    schedule: PromptSchedule
    batch_size: int
    num_latent_frames: int
    latent_shape: tuple[int, int, int, int, int]
    sigmas: list[float]
    guidance_scale: float
    negative_prompt: list[str] | None
    attention_bias: float
    max_sequence_length: int


class KreaRealtimeVideoPipeline(DiffusionPipeline):
    """Text-to-video for causal Wan 2.1 checkpoints (Krea Realtime 14B, Self-Forcing / LongLive 1.3B).

    Components: `tokenizer` + `text_encoder` (UMT5), `transformer` (`KreaRealtimeTransformer3DModel`),
    `vae` (`AutoencoderKLWan`), `scheduler` (flow matching; its `shift` warps the denoising steps).
    Registered defaults (saved in `model_index.json`): the cache geometry in latent frames, the position
    mode, the denoising steps, the text length, Krea's KV-cache attention bias, and the native frame size
    (`height`/`width`, used when a call gives none).
    """

    model_cpu_offload_seq = "text_encoder->transformer->vae"
    _callback_tensor_inputs = ["latents", "prompt_embeds"]

    def __init__(
        self,
        tokenizer,
        text_encoder,
        transformer: KreaRealtimeTransformer3DModel,
        vae: AutoencoderKLWan,
        scheduler: FlowMatchEulerDiscreteScheduler,
        chunk_frames: int = 3,
        sink_frames: int = 3,
        window_frames: int = 9,
        position_mode: str = "absolute",
        denoising_steps: list[int] | tuple[int, ...] = (1000, 750, 500, 250),
        max_sequence_length: int = 512,
        attention_bias: float = 1.0,
        height: int = 480,
        width: int = 832,
    ) -> None:
        super().__init__()
        self.register_modules(
            tokenizer=tokenizer, text_encoder=text_encoder, transformer=transformer, vae=vae, scheduler=scheduler
        )
        self.register_to_config(
            chunk_frames=chunk_frames,
            sink_frames=sink_frames,
            window_frames=window_frames,
            position_mode=position_mode,
            denoising_steps=list(denoising_steps),
            max_sequence_length=max_sequence_length,
            attention_bias=attention_bias,
            height=height,
            width=width,
        )
        downsample = getattr(vae.config, "temperal_downsample", [False, True, True]) if vae is not None else None
        self.vae_scale_factor_temporal = 2 ** sum(downsample) if downsample is not None else 4
        self.vae_scale_factor_spatial = 2 ** len(downsample) if downsample is not None else 8
        self.video_processor = VideoProcessor(vae_scale_factor=self.vae_scale_factor_spatial)

    # ---------------------------------------------------------------------------------------- validation
    def _frames_to_latent(self, num_frames: int) -> int:
        return (num_frames - 1) // self.vae_scale_factor_temporal + 1

    def _latent_to_frames(self, latent_frames: int) -> int:
        return (latent_frames - 1) * self.vae_scale_factor_temporal + 1

    def valid_num_frames(self, num_frames: int, chunk_frames: int | None = None) -> tuple[int, int]:
        """The reachable frame counts just below and above `num_frames` for this VAE and chunking."""
        chunk = chunk_frames or self.config.chunk_frames
        chunks = max(1, self._frames_to_latent(max(num_frames, 1)) // chunk)
        return self._latent_to_frames(chunks * chunk), self._latent_to_frames((chunks + 1) * chunk)

    def _prepare_run(
        self,
        prompt,
        prompt_schedule,
        negative_prompt,
        num_frames: int,
        height: int,
        width: int,
        denoising_steps,
        guidance_scale: float,
        output_type: str,
        latents: torch.Tensor | None,
        chunk_frames,
        sink_frames,
        window_frames,
        position_mode,
        attention_bias,
        max_sequence_length,
    ) -> _Run:
        """Check every argument and derive the run's geometry; raises before any model work."""
        config = self.config
        height = config.height if height is None else height
        width = config.width if width is None else width
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"`output_type` must be one of {OUTPUT_TYPES}, got {output_type!r}.")
        layout_args = dict(
            chunk_frames=config.chunk_frames if chunk_frames is None else chunk_frames,
            sink_frames=config.sink_frames if sink_frames is None else sink_frames,
            window_frames=config.window_frames if window_frames is None else window_frames,
            position_mode=config.position_mode if position_mode is None else position_mode,
        )
        if layout_args["position_mode"] not in POSITION_MODES:
            raise ValueError(f"`position_mode` must be one of {POSITION_MODES}, got {layout_args['position_mode']!r}.")
        if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1:
            raise ValueError(f"`num_frames` must be a positive int, got {num_frames!r}.")
        spatial = self.vae_scale_factor_spatial
        _, p_h, p_w = self.transformer.config.patch_size
        for name, size, patch in (("height", height, p_h), ("width", width, p_w)):
            if isinstance(size, bool) or not isinstance(size, int) or size <= 0 or size % (spatial * patch):
                raise ValueError(
                    f"`{name}` must be a positive multiple of {spatial * patch} (VAE factor {spatial} x patch "
                    f"{patch}), got {size!r}."
                )
        tokens_per_frame = self.transformer.tokens_per_frame(height // spatial, width // spatial)
        layout = ChunkLayout(tokens_per_frame=tokens_per_frame, **layout_args)
        latent_frames = self._frames_to_latent(num_frames)
        reachable = (num_frames - 1) % self.vae_scale_factor_temporal == 0 and latent_frames % layout.chunk_frames == 0
        if not reachable:
            below, above = self.valid_num_frames(num_frames, layout.chunk_frames)
            raise ValueError(
                f"`num_frames`={num_frames} cannot be made of whole chunks of {layout.chunk_frames} latent frames "
                f"(VAE temporal factor {self.vae_scale_factor_temporal}); nearest valid values: {below} or {above}."
            )
        self.transformer.check_frame_budget(latent_frames, layout)
        steps = list(config.denoising_steps if denoising_steps is None else denoising_steps)
        if not steps or any(not 0 < s <= 1000 for s in steps) or any(a <= b for a, b in zip(steps, steps[1:])):
            raise ValueError(f"`denoising_steps` must be strictly decreasing values in (0, 1000], got {steps}.")
        if guidance_scale < 1.0:
            raise ValueError(f"`guidance_scale` must be >= 1.0 (1.0 disables guidance), got {guidance_scale}.")
        schedule = PromptSchedule.build(prompt, prompt_schedule, num_frames)
        batch_size = schedule.batch_size
        negatives = None
        if guidance_scale > 1.0:
            negatives = (
                [negative_prompt or ""] * batch_size if not isinstance(negative_prompt, list) else negative_prompt
            )
            if len(negatives) != batch_size:
                raise ValueError(f"`negative_prompt` has {len(negatives)} entries, expected {batch_size}.")
        channels = self.transformer.config.in_channels
        latent_shape = (batch_size, channels, latent_frames, height // spatial, width // spatial)
        if latents is not None and tuple(latents.shape) != latent_shape:
            raise ValueError(f"`latents` must have shape {latent_shape}, got {tuple(latents.shape)}.")
        shift = self.scheduler.config.get("shift", 1.0)
        bias = config.attention_bias if attention_bias is None else attention_bias
        if not 0 < bias <= 1.0:
            raise ValueError(f"`attention_bias` must be in (0, 1] (1 disables it), got {bias}.")
        return _Run(
            layout=layout,
            schedule=schedule,
            batch_size=batch_size,
            num_latent_frames=latent_frames,
            latent_shape=latent_shape,
            sigmas=[sigma_for_step(s, shift) for s in steps],
            guidance_scale=guidance_scale,
            negative_prompt=negatives,
            attention_bias=bias,
            max_sequence_length=max_sequence_length or config.max_sequence_length,
        )

    # ---------------------------------------------------------------------------------------- the chunk loop
    def _encode(self, prompts: list[str], run: _Run) -> torch.Tensor:
        return encode_prompts(
            self.tokenizer,
            self.text_encoder,
            prompts,
            run.max_sequence_length,
            device=self._execution_device,
            dtype=self.transformer.dtype,
        )

    def _denoise(self, chunk: torch.Tensor, sigma: float, embeds, caches, run: _Run) -> torch.Tensor:
        """The velocity for one chunk at noise level `sigma` (guided when a negative cache exists)."""
        timestep = torch.full((chunk.shape[0],), sigma * 1000.0, device=chunk.device, dtype=torch.float32)
        velocity = self.transformer(
            chunk, timestep, embeds[0], kv_cache=caches[0], layout=run.layout, attention_bias=run.attention_bias
        ).sample
        if len(caches) > 1:
            unconditional = self.transformer(
                chunk, timestep, embeds[1], kv_cache=caches[1], layout=run.layout, attention_bias=run.attention_bias
            ).sample
            velocity = unconditional + run.guidance_scale * (velocity - unconditional)
        return velocity

    def _context_pass(self, clean: torch.Tensor, embeds, caches, run: _Run) -> None:
        """Write the clean chunk's K/V at t = 0 into every branch's cache and commit."""
        timestep = torch.zeros(clean.shape[0], device=clean.device)
        for branch_embeds, cache in zip(embeds, caches):
            self.transformer(
                clean, timestep, branch_embeds, kv_cache=cache, layout=run.layout, attention_bias=run.attention_bias
            )
            cache.commit()

    def _recache(self, frames: torch.Tensor, embeds, cache: RollingKVCache, run: _Run) -> None:
        """LongLive's re-cache after a prompt switch: re-run the recent window under the new prompt.

        The sink is never touched; the recent clean frames are rewound and written again chunk by chunk
        at t = 0 into the same slots, so the next chunk sees its past as if told by the new prompt.
        """
        if frames.shape[2] == 0:
            return
        cache.rewind(frames.shape[2] * run.layout.tokens_per_frame)
        for start in range(0, frames.shape[2], run.layout.chunk_frames):
            clean = frames[:, :, start : start + run.layout.chunk_frames]
            self._context_pass(clean, [embeds], [cache], run)

    def _generate_latents(
        self,
        run: _Run,
        generator,
        latents: torch.Tensor | None,
        callback_on_step_end: Callable | None,
        callback_on_step_end_tensor_inputs: list[str],
    ) -> Iterator[torch.Tensor]:
        """Yield each chunk's clean latents `(batch, channels, chunk_frames, h, w)` in the model's dtype."""
        device, dtype = self._execution_device, self.transformer.dtype
        layout = run.layout
        prompt_embeds = self._encode(run.schedule.prompts(0), run)
        embeds = [prompt_embeds]
        caches = [self.transformer.make_cache(layout, run.batch_size, dtype, device)]
        if run.negative_prompt is not None:
            embeds.append(self._encode(run.negative_prompt, run))
            caches.append(self.transformer.make_cache(layout, run.batch_size, dtype, device))
        if latents is None:
            latents = randn_tensor(run.latent_shape, generator=generator, device=device, dtype=torch.float32)
        recent = latents.new_zeros((*run.latent_shape[:2], 0, *run.latent_shape[3:])).to(dtype)  # for a re-cache
        active = 0
        step_index = 0
        num_chunks = run.num_latent_frames // layout.chunk_frames
        with self.progress_bar(total=num_chunks) as progress:
            for chunk_index in range(num_chunks):
                start = chunk_index * layout.chunk_frames
                now_active = run.schedule.active_index(self._latent_to_pixel_start(start))
                if now_active != active:  # prompt switch: new cross-attention K/V, re-cache the window
                    active = now_active
                    embeds[0] = prompt_embeds = self._encode(run.schedule.prompts(active), run)
                    caches[0].reset_cross_attention()
                    self._recache(recent, prompt_embeds, caches[0], run)
                noisy = latents[:, :, start : start + layout.chunk_frames].to(device=device, dtype=dtype)
                for i, sigma in enumerate(run.sigmas):
                    velocity = self._denoise(noisy, sigma, embeds, caches, run)
                    clean = predict_clean(noisy.float(), velocity.float(), sigma).to(dtype)
                    if i + 1 < len(run.sigmas):
                        noise = randn_tensor(noisy.shape, generator=generator, device=device, dtype=torch.float32)
                        noisy = add_noise(clean.float(), noise, run.sigmas[i + 1]).to(dtype)
                    if callback_on_step_end is not None:
                        values = {"latents": clean, "prompt_embeds": prompt_embeds}
                        kwargs = {k: values[k] for k in callback_on_step_end_tensor_inputs}
                        result = callback_on_step_end(self, step_index, sigma * 1000.0, kwargs) or {}
                        clean = result.get("latents", clean)
                    step_index += 1
                self._context_pass(clean, embeds, caches, run)
                keep = layout.rewindable_frames(start + layout.chunk_frames)
                recent = torch.cat([recent, clean], dim=2)[:, :, recent.shape[2] + clean.shape[2] - keep :]
                progress.update()
                yield clean

    def _latent_to_pixel_start(self, latent_frame: int) -> int:
        """First pixel frame decoded from latent frame `latent_frame` (the first latent frame is 1 pixel frame)."""
        return 0 if latent_frame == 0 else (latent_frame - 1) * self.vae_scale_factor_temporal + 1

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
        denoising_steps: Sequence[int] | None = None,
        guidance_scale: float = 1.0,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        output_type: str = "np",
        chunk_frames: int | None = None,
        sink_frames: int | None = None,
        window_frames: int | None = None,
        position_mode: str | None = None,
        attention_bias: float | None = None,
        max_sequence_length: int | None = None,
        callback_on_step_end: Callable | None = None,
        callback_on_step_end_tensor_inputs: list[str] | None = None,
    ) -> Iterator[Any]:
        """Yield each chunk's decoded frames as soon as it is generated.

        Each item is what `__call__` would return for those frames: `(batch, frames, H, W, 3)` np in [0, 1]
        for "np", PIL lists, `(batch, frames, 3, H, W)` torch for "pt", or the chunk's latents. Arguments
        are checked before any work. `prompt_schedule` is `[(frame, prompt), ...]`; a switch takes effect at
        the first chunk that starts at or after its frame.
        """
        run = self._prepare_run(
            prompt, prompt_schedule, negative_prompt, num_frames, height, width, denoising_steps, guidance_scale,
            output_type, latents, chunk_frames, sink_frames, window_frames, position_mode, attention_bias,
            max_sequence_length,
        )  # fmt: skip
        tensor_inputs = self._check_callback_inputs(callback_on_step_end_tensor_inputs)
        return self._stream_chunks(run, generator, latents, output_type, callback_on_step_end, tensor_inputs)

    @torch.no_grad()
    def _stream_chunks(
        self, run: _Run, generator, latents, output_type: str, callback, tensor_inputs
    ) -> Iterator[Any]:
        decoder = StreamingWanDecoder(self.vae) if output_type != "latent" else None
        for clean in self._generate_latents(run, generator, latents, callback, tensor_inputs):
            if decoder is None:
                yield clean
                continue
            video = decoder.decode(denormalize_wan_latents(clean.to(self.vae.dtype), self.vae))
            yield self._postprocess(video, output_type)
        self.maybe_free_model_hooks()

    def _check_callback_inputs(self, names: list[str] | None) -> list[str]:
        names = ["latents"] if names is None else list(names)
        unknown = [n for n in names if n not in self._callback_tensor_inputs]
        if unknown:
            raise ValueError(
                f"`callback_on_step_end_tensor_inputs` has {unknown}; allowed: {self._callback_tensor_inputs}."
            )
        return names

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
        prompt_schedule: Sequence[tuple[int, str]] | dict[int, str] | None = None,
        negative_prompt: str | list[str] | None = None,
        denoising_steps: Sequence[int] | None = None,
        guidance_scale: float = 1.0,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        output_type: str = "np",
        return_dict: bool = True,
        chunk_frames: int | None = None,
        sink_frames: int | None = None,
        window_frames: int | None = None,
        position_mode: str | None = None,
        attention_bias: float | None = None,
        max_sequence_length: int | None = None,
        callback_on_step_end: Callable | None = None,
        callback_on_step_end_tensor_inputs: list[str] | None = None,
    ) -> KreaRealtimeVideoPipelineOutput | tuple:
        """Generate a whole video and decode it in one pass (see `stream` for long videos).

        Args:
            prompt: the text, or one per batch element; may be omitted when `prompt_schedule` starts at 0.
            num_frames: pixel frames; must be whole chunks (`valid_num_frames` tells the nearest).
            height, width: pixels, multiples of the VAE factor times the patch size (default: the config's).
            prompt_schedule: `[(frame, prompt), ...]` switches; each takes effect at the next chunk boundary.
            denoising_steps: step values in (0, 1000], strictly decreasing, warped by the scheduler's shift.
            guidance_scale: > 1 enables classifier-free guidance with its own cache for the negative branch.
            chunk_frames, sink_frames, window_frames, position_mode: cache geometry in latent frames
                (defaults from the pipeline config); the window counts the chunk and excludes the sink.
        """
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"`output_type` must be one of {OUTPUT_TYPES}, got {output_type!r}.")
        chunks = self.stream(  # the same run, kept as latents, then decoded in one pass
            prompt, num_frames, height, width, prompt_schedule=prompt_schedule, negative_prompt=negative_prompt,
            denoising_steps=denoising_steps, guidance_scale=guidance_scale, generator=generator, latents=latents,
            output_type="latent", chunk_frames=chunk_frames, sink_frames=sink_frames, window_frames=window_frames,
            position_mode=position_mode, attention_bias=attention_bias, max_sequence_length=max_sequence_length,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
        )  # fmt: skip
        chunks = list(chunks)
        latents_out = torch.cat(chunks, dim=2)
        if output_type == "latent":
            frames = latents_out
        else:
            video = self.vae.decode(denormalize_wan_latents(latents_out.to(self.vae.dtype), self.vae)).sample
            frames = self._postprocess(video, output_type)
        self.maybe_free_model_hooks()
        if not return_dict:
            return (frames,)
        return KreaRealtimeVideoPipelineOutput(frames=frames)

    def generate_to_file(self, path: str, prompt: str | None = None, fps: int = 16, **kwargs: Any) -> int:
        """Stream a video straight into an mp4 at `path` in constant memory; returns the frames written.

        Takes the arguments of `stream` (batch size 1). Frames already written stay a playable file if
        generation fails part-way.
        """
        if kwargs.get("output_type", "np") != "np":
            raise ValueError("`generate_to_file` writes frames itself; do not pass `output_type`.")
        kwargs["output_type"] = "np"
        chunks = self.stream(prompt, **kwargs)  # validates every argument before the file is opened
        with StreamingVideoWriter(path, fps=fps) as writer:
            for frames in chunks:
                if frames.shape[0] != 1:
                    raise ValueError(f"`generate_to_file` writes one video; got a batch of {frames.shape[0]}.")
                writer.write((frames[0] * 255.0).round().clip(0, 255).astype(np.uint8))
            return writer.frames_written

"""`ChunkStream`: one live generation of a long video, chunk by chunk.

A stream owns everything that changes while a video is generated: one `RollingKVCache` per guidance branch
(conditional first), the text embeddings per branch, its own scheduler copy, its own streaming decoder, the
recent clean latents a re-cache after a prompt switch re-runs, and its position. The pipeline it came from is
only read (weights, config, the family hooks), so one loaded pipeline serves any number of concurrent
streams, each with the result it gets alone.

Per chunk (`__next__`): apply a prompt switch due at this boundary (the schedule's, or `switch_prompt`'s),
draw the chunk's noise, denoise it in a few steps (each predicts x0 = x_t - sigma v and re-noises it to the
next sigma; every step overwrites the same pending cache entries), run one clean context pass at t = 0 that
writes its K/V (or state; none under `context_policy="last_step"`: what the steps wrote is committed),
`commit()`, decode the chunk causally and return it. An exception before the commit leaves every cache as it was
at the last commit (a chunk is a transaction), except StreamDiffusionV2's adaptive sink, which writes in place as
upstream does (`rolldiff.caching.AdaptiveSinkLayer`).

Noise: chunk k's starting noise `(batch, channels, chunk_frames, h, w)` is drawn when chunk k starts, then
one draw per step (the scheduler's re-noise): a seed fixes the whole video, nothing the size of the video is
ever allocated.

`state_dict()` / `load_state_dict()` round-trip a stream at a chunk boundary (caches through their layers'
extra state, decoder memory, latents, generators, position), which is all `rolldiff.pipelines.io.resume` saves.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.utils.torch_utils import randn_tensor

from ..caching.layout import SCENE_CUT_FRAME
from ..checks import check_flag, check_int
from .codecs.overlap import OverlappedDecoder, decode_ahead
from .pipelined import PipelinedDenoising
from .request.conditioning import ConditioningInput
from .request.prompt_schedule import as_prompt_list
from .request.request import VideoRequest, check_embeds
from .request.scene_controls import check_cut_setup
from .request.steps import StepPlan
from .stream_batch import StreamBatchDenoising
from .video_noise import VideoNoiseMix

STREAM_STATE_VERSION = 2  # bumped whenever the keys of `ChunkStream.state_dict` change meaning


@runtime_checkable
class StreamPipeline(Protocol):
    """What a `ChunkStream` reads from its pipeline: components and config, the family hooks of one step, the
    context pass and the re-cache, the codecs, text encoding and frame arithmetic. It holds none of a stream's
    state, so one pipeline serves many streams."""

    transformer: Any
    scheduler: Any

    @property
    def execution_device(self) -> torch.device: ...

    def make_stream_cache(self, request: VideoRequest, dtype: torch.dtype, device: torch.device) -> Any: ...

    def make_decoder(self) -> Any: ...

    def make_encoder(self, normalize: bool = True) -> Any: ...

    def transformer_step(
        self, latents: torch.Tensor, timestep: torch.Tensor, embeds: torch.Tensor, cache: Any, request: VideoRequest
    ) -> torch.Tensor: ...

    def context_pass(
        self,
        clean: torch.Tensor,
        embeds: Sequence[torch.Tensor],
        caches: Sequence,
        request: VideoRequest,
        timestep: float = 0.0,
    ) -> None: ...

    def recache_frames(self, layout: Any, committed_frames: int, chunk_frames: int) -> int: ...

    def recache(self, recent: torch.Tensor, embeds: torch.Tensor, cache: Any, request: VideoRequest) -> None: ...

    def set_conditioning(self, cache: Any, embeds: torch.Tensor) -> None: ...

    def branch_embeds(self, request: VideoRequest, prompt_index: int) -> torch.Tensor: ...

    def encode_prompt(self, prompts: list[str], max_sequence_length: int) -> torch.Tensor: ...

    def check_prompt_text(
        self, prompts: list[str], max_sequence_length: int, name: str, require_known_word: bool = True
    ) -> None: ...

    def postprocess(self, video: torch.Tensor, output_type: str) -> Any: ...

    def latent_to_frames(self, latent_frames: int) -> int: ...

    def latent_to_pixel_start(self, latent_frame: int) -> int: ...

    def progress_bar(self, iterable: Any = None, total: int | None = None) -> Any: ...

    def maybe_free_model_hooks(self) -> None: ...

    def stream_started(self, stream: ChunkStream) -> None: ...

    def stream_ended(self, stream: ChunkStream) -> None: ...


def default_generator(device: torch.device) -> torch.Generator:
    """The generator `randn_tensor` draws from when the call passes none."""
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index or 0]
    return torch.default_generator


class ChunkStream(PipelinedDenoising, StreamBatchDenoising, Iterator[Any]):
    """One live generation: iterate it for each chunk's decoded frames (or latents, for `output_type="latent"`).

    Made by `pipe.stream(...)`, which validated every argument first. Each item is what `__call__` returns for
    those frames: `(batch, frames, H, W, 3)` np in [0, 1] for "np", PIL lists for "pil", `(batch, frames, 3, H,
    W)` torch for "pt", or the chunk's latents `(batch, channels, chunk_frames, h, w)` for "latent".

    Public surface: iteration, `switch_prompt`, `interrupt`, `state_dict` / `load_state_dict`, `close`, and
    read-only properties (`request`, `num_chunks`, `next_chunk`, `caches`, `frames_emitted`, `interrupted`,
    `memory_bytes()`).
    """

    def __init__(self, pipe: StreamPipeline, request: VideoRequest) -> None:
        self._pipe = pipe
        self._request = request
        self._started = False
        self._closed = False
        self._interrupted = threading.Event()  # set by `interrupt()`, from any thread
        self._next_chunk = 0
        self._step_index = 0  # denoising steps done over the video (what callbacks see)
        self._frames_emitted = 0
        self._active_prompt = 0  # index into the prompt schedule
        self._pending: torch.Tensor | None = None  # embeddings of a `switch_prompt` not applied yet
        self._pending_blend: int | None = None  # that switch's own blend length (None: the request's)
        self._pending_cut = False  # that switch is a scene cut
        self._blend: list[torch.Tensor] = []  # the coming chunks' embeddings of a prompt blend in progress
        self._first_pixels: torch.Tensor | None = None  # the pixel frames a re-encoded first frame comes from
        self._caches: list = []
        self._embeds: list[torch.Tensor] = []
        self._recent: torch.Tensor | None = None
        self._first_frame: torch.Tensor | None = None  # chunk 0's first clean latent frame (the recompute policy)
        self._decoder = None
        self._inputs: ConditioningInput | None = None  # a start image or an input video, with its encoder
        self._progress = None
        self._overlapped: Iterator[torch.Tensor] | None = None  # frames, one chunk behind (`overlap_decode`)
        self._scheduler = FlowMatchEulerDiscreteScheduler.from_config(
            pipe.scheduler.config, stochastic_sampling=True, use_dynamic_shifting=False
        )  # its own: concurrent streams never share step counters
        self._plain_scheduler = FlowMatchEulerDiscreteScheduler.from_config(
            pipe.scheduler.config, stochastic_sampling=True, use_dynamic_shifting=False, shift=1.0
        )  # for a step plan's own sigmas, which are final (no second shift)
        self._fed: dict[StepPlan, torch.Tensor] = {}  # per step plan: the fed timesteps, (steps, batch), made once
        self._placed: tuple[torch.device, torch.dtype] | None = None  # `_placement`, fixed by `_allocate`
        self._init_pipelined()  # `denoising="pipelined"`: the chunks in flight (rolldiff.pipelines.pipelined)
        self._init_stream_batch()  # `denoising="stream_batch"`: a cache per step, the rows in flight

    # ---------------------------------------------------------------------------------------- properties
    @property
    def _placement(self) -> tuple[torch.device, torch.dtype]:
        """Where and in what dtype the models run: fixed when the caches are made there (`_allocate`), looked up
        before. diffusers finds a pipeline's device by walking every module for offload hooks, about 3 ms a lookup on
        the embedded model; looked up per chunk, that was 8 % of a chunk's time."""
        if self._placed is not None:
            return self._placed
        return self._pipe.execution_device, self._pipe.transformer.dtype

    @property
    def pipeline(self) -> StreamPipeline:
        """The pipeline this stream reads (weights, config, family hooks); it holds none of the stream's state."""
        return self._pipe

    @property
    def request(self) -> VideoRequest:
        """The validated arguments of this video."""
        return self._request

    @property
    def num_chunks(self) -> int:
        return self._request.num_chunks

    @property
    def next_chunk(self) -> int:
        """Index of the chunk the next iteration generates (chunks done so far)."""
        return self._next_chunk

    @property
    def frames_emitted(self) -> int:
        """Pixel frames (latent frames for "latent") this stream has returned so far."""
        return self._frames_emitted

    @property
    def active_prompt(self) -> int:
        """Index of the prompt-schedule entry in effect (`switch_prompt` does not change it)."""
        return self._active_prompt

    @property
    def caches(self) -> tuple:
        """The stream's caches, one per guidance branch (conditional first); empty before the first chunk."""
        return tuple(self._caches)

    @property
    def last_chunk_start(self) -> int:
        """The first pixel frame of the video's last chunk (a later switch could never apply)."""
        return self._pipe.latent_to_pixel_start(self._request.geometry.last_chunk_start)

    @property
    def embeds(self) -> tuple[torch.Tensor, ...]:
        """The text embeddings in use, one per guidance branch (conditional first); empty before the first chunk."""
        return tuple(self._embeds)

    @property
    def next_chunk_frames(self) -> int:
        """Pixel frames the next chunk spans: what it reads from an input video (1 + t(c - 1) first, then t c)."""
        geometry, to_pixels = self._request.geometry, self._pipe.latent_to_pixel_start
        start = geometry.chunk_start(self._next_chunk)
        return to_pixels(start + geometry.chunk_size(self._next_chunk)) - to_pixels(start)

    @property
    def interrupted(self) -> bool:
        """Whether `interrupt()` (or `pipe.interrupt = True` while this stream ran) asked it to stop."""
        return self._interrupted.is_set()

    def interrupt(self) -> None:
        """Stop this stream before its next denoising step (safe from any thread; other streams go on): iteration
        then ends, and the chunks finished so far are all it made (`__call__` returns them)."""
        self._interrupted.set()

    def memory_bytes(self) -> int:
        """Bytes the stream's caches hold now."""
        return sum(cache.memory_bytes() for cache in self._caches) + self._stream_batch_bytes()

    # ---------------------------------------------------------------------------------------- prompts
    def switch_prompt(
        self,
        prompt: str | list[str] | None = None,
        *,
        prompt_embeds: torch.Tensor | None = None,
        blend_chunks: int | None = None,
        scene_cut: bool = False,
    ) -> int:
        """Switch to `prompt` (or precomputed `prompt_embeds`) at the next chunk boundary; returns the index of the
        first chunk made under it (`next_chunk`).

        The text is checked now (unknown words warned about, a prompt with no known word refused) and encoded
        now, so the loop never waits on it; the next chunk then re-caches the recent context under it (the
        family's re-cache). `blend_chunks` blends into it over that many chunks (default: the request's
        `prompt_blend_chunks`). `scene_cut=True` makes the switch a hard cut (the request's `scene_cuts`). A later call
        before that boundary replaces an earlier one. Call it between chunks (from the thread that iterates, or while
        no chunk is being made).
        """
        if (prompt is None) == (prompt_embeds is None):
            raise ValueError("`switch_prompt` takes either `prompt` or `prompt_embeds`.")
        self._refuse_switch_in_stream_batch()
        if blend_chunks is not None:
            blend_chunks = check_int("blend_chunks", blend_chunks, 1, hint="1: switch at once")
        if check_flag("scene_cut", scene_cut):
            self.check_scene_cut()
        if self._closed or self._next_chunk >= self.num_chunks:
            raise RuntimeError(
                "`switch_prompt`: this stream has made its last chunk, so the switch would never apply."
            )
        batch_size = self._request.batch_size
        if prompt_embeds is not None:
            embeds = check_embeds("prompt_embeds", prompt_embeds, batch_size)
        else:
            prompts = as_prompt_list("prompt", prompt)
            if isinstance(prompt, str):
                prompts = prompts * batch_size
            elif len(prompts) != batch_size:
                raise ValueError(
                    f"`prompt` must be a non-empty str or a list of {batch_size} non-empty str, got {prompt!r}."
                )
            self._pipe.check_prompt_text(prompts, self._request.max_sequence_length, "prompt")
            embeds = self._pipe.encode_prompt(prompts, self._request.max_sequence_length)
        device, dtype = self._placement
        self._pending = embeds.to(device=device, dtype=dtype)
        self._pending_blend, self._pending_cut = blend_chunks, scene_cut
        return self._next_chunk

    def check_scene_cut(self) -> None:
        """Raise ValueError naming what this stream's settings lack for `switch_prompt(..., scene_cut=True)` (a front
        end asks before it queues a cut); returns if a cut can be placed."""
        request = self._request
        check_cut_setup("scene_cut", self._pipe, request.layout, request.denoising, request.context_policy)

    @contextlib.contextmanager
    def _scene_cut(self, cut: bool) -> Iterator[None]:
        """A scene cut's chunk: every branch's cache places it at RoPE frame `SCENE_CUT_FRAME` for all its passes
        (denoising steps and context pass), then back to plain positions, whatever happens in between."""
        if not cut:
            yield
            return
        for cache in self._caches:
            cache.set_cut_position(SCENE_CUT_FRAME * self._request.layout.tokens_per_frame)
        try:
            yield
        finally:
            for cache in self._caches:
                cache.set_cut_position(None)

    def _switch_to(self, embeds: torch.Tensor) -> None:
        """New cross-attention K/V for the conditional branch, then the family's re-cache of recent context."""
        self._embeds[0] = embeds
        self._pipe.set_conditioning(self._caches[0], embeds)
        # recompute: the next chunk rebuilds its context anyway; last_step: upstream (StreamDiffusionV2) keeps its
        # self-attention cache at a new prompt, only the text K/V change (`causal_stream_inference.py:156-159`)
        recompute = self._request.context_policy in ("recompute", "last_step")
        if self._recent is not None and self._recent.shape[2] > 0 and not recompute:
            self._pipe.recache(self._recent, embeds, self._caches[0], self._request)

    def _apply_due_switches(self) -> bool:
        """A switch due at this chunk boundary (the schedule's, then `switch_prompt`'s) starts a blend of
        `prompt_blend_chunks` steps (Krea's `interpolate_prompt_embeds`: `lerp(current, new, linspace(0, 1, N))`, one
        step a chunk, from whatever embedding is current); each chunk of a blend is one switch. Returns whether this
        chunk starts a scene cut."""
        request = self._request
        start = request.geometry.chunk_start(self._next_chunk)
        target, cut = None, False
        now_active = request.schedule.active_index(self._pipe.latent_to_pixel_start(start))
        if now_active != self._active_prompt:
            self._active_prompt = now_active
            target = self._pipe.branch_embeds(request, now_active)
            cut = now_active in request.scene_cuts
        blend_chunks = request.prompt_blend_chunks
        if self._pending is not None:
            target, self._pending, cut = self._pending, None, self._pending_cut
            blend_chunks, self._pending_blend, self._pending_cut = self._pending_blend or blend_chunks, None, False
        if target is not None:
            weights = torch.linspace(0, 1, blend_chunks) if blend_chunks > 1 else [1.0]
            current = self._embeds[0]
            self._blend = [torch.lerp(current, target, float(w)) for w in weights]
        if self._blend:
            self._switch_to(self._blend.pop(0))
        return cut

    # ---------------------------------------------------------------------------------------- start
    def _start(self) -> None:
        """Encode the prompts, make the caches and the decoder, and condition the caches (once, before the first
        chunk)."""
        if self._started:
            return
        pipe, request = self._pipe, self._request
        embeds = [pipe.branch_embeds(request, 0)]
        if request.uses_guidance:
            negative = request.negative_prompt_embeds
            if negative is None:
                negative = pipe.encode_prompt(list(request.negative_prompt), request.max_sequence_length)
            device, dtype = self._placement
            embeds.append(negative.to(device=device, dtype=dtype))
        self._allocate()
        self._condition(embeds)

    def _allocate(self) -> None:
        """Make the caches (one per guidance branch), the decoder and the input's encoder: no text encoded, no
        conditioning (a loaded state brings its own embeddings)."""
        pipe, request = self._pipe, self._request
        device, dtype = pipe.execution_device, pipe.transformer.dtype
        self._placed = (device, dtype)  # the stream runs there from now on: its caches are made there
        self._caches = [pipe.make_stream_cache(request, dtype, device) for _ in range(1 + request.uses_guidance)]
        chunk_shape = request.chunk_shape
        self._recent = torch.zeros((*chunk_shape[:2], 0, *chunk_shape[3:]), device=device, dtype=dtype)
        self._decoder = pipe.make_decoder() if request.output_type != "latent" or request.reencodes else None
        overlaps = request.overlap_decode and not request.reencodes  # a re-encode needs chunk k's pixels first
        if overlaps and self._decoder is not None and request.output_type != "latent":
            # chunk k decodes on a side stream while chunk k + 1 denoises (CUDA; decodes in place elsewhere)
            self._decoder = OverlappedDecoder(self._decoder, device)
            self._overlapped = decode_ahead(self._latent_chunks(), self._decoder)
        conditioning = request.conditioning
        if conditioning is not None:
            encoder = pipe.make_encoder(normalize=request.normalize_input_latents)
            mix = VideoNoiseMix(request.video_noise_mix, conditioning.strength) if conditioning.video else None
            self._inputs = ConditioningInput(conditioning, encoder, mix)
        pipe.stream_started(self)
        self._started = True

    def _condition(self, embeds: list[torch.Tensor]) -> None:
        """Use `embeds` (one per branch, conditional first) and fill each cache's text K/V from them."""
        self._embeds = embeds
        for cache, branch_embeds in zip(self._caches, embeds):
            self._pipe.set_conditioning(cache, branch_embeds)

    # ---------------------------------------------------------------------------------------- iteration
    def __iter__(self) -> ChunkStream:
        return self

    def __next__(self) -> Any:
        if self._closed or (self._next_chunk >= self.num_chunks and self._overlapped is None):
            self.close()
            raise StopIteration
        with torch.no_grad():
            self._start()
            if self._progress is None:
                self._progress = self._pipe.progress_bar(total=self.num_chunks)
                self._progress.update(self._next_chunk)  # a resumed stream starts part-way
            if self._overlapped is not None:
                return self._next_overlapped()
            clean = self._generate_chunk()
            if clean is None:  # interrupted before the chunk finished, or the input ended
                self.close()
                raise StopIteration
            self._progress.update()
            return self._emit(clean)

    def _latent_chunks(self) -> Iterator[torch.Tensor]:
        """The clean latents of every chunk still to come (for the overlapped decode)."""
        while self._next_chunk < self.num_chunks:
            clean = self._generate_chunk()
            if clean is None:
                return
            self._progress.update()
            yield clean

    def _next_overlapped(self) -> Any:
        video = next(self._overlapped, None)
        if video is None:
            self.close()
            raise StopIteration
        self._frames_emitted += video.shape[2]
        return self._pipe.postprocess(video, self._request.output_type)

    def _generate_chunk(self) -> torch.Tensor | None:
        """Denoise, context-pass and commit the next chunk; its clean latents in the model's dtype (None: the
        input video ended, or the stream was interrupted)."""
        request = self._request
        geometry, index = request.geometry, self._next_chunk
        start, chunk_frames = geometry.chunk_start(index), geometry.chunk_size(index)
        recompute = request.context_policy == "recompute"
        if recompute:  # under the embedding the previous chunk was made with, as Krea's server does
            self._rebuild_context()
        with self._scene_cut(self._apply_due_switches()):
            return self._make_chunk(index, start, chunk_frames, recompute)

    def _make_chunk(self, index: int, start: int, chunk_frames: int, recompute: bool) -> torch.Tensor | None:
        """The body of `_generate_chunk`, once the chunk's prompt is in place."""
        pipe, request = self._pipe, self._request
        pipelined, batched = request.denoising == "pipelined", self._stream_batched(index)
        # pipelined, stream batch: a video-to-video chunk's input is read when it enters, a few chunks ahead
        reads_input = self._inputs is not None and not ((pipelined or batched) and self._inputs.is_video)
        given = self._inputs.latents(index, chunk_frames) if reads_input else None
        if given is None and reads_input and self._inputs.is_video:
            return None  # the input ended: the output ends with it, at its last whole chunk
        denoised = given is None or self._inputs.is_video
        if not denoised:
            clean = given.to(self._placement[1])  # the start image's chunk: clean context, nothing to denoise
        else:
            clean = self._denoised(index, given, pipelined, batched)
            if clean is None:
                return None
        if not torch.isfinite(clean).all():
            raise FloatingPointError(
                f"Chunk {index} produced NaN or infinite latents; generation stopped (frames before it are kept)."
            )
        if index == 0 and recompute:
            self._first_frame = clean[:, :, :1].clone()  # a copy: a view would keep the whole chunk alive
        self._commit_context(clean, batched, denoised)
        keep = (
            self._context_frames() - 1
            if recompute
            else pipe.recache_frames(request.layout, start + chunk_frames, chunk_frames)
        )
        held = self._recent.shape[2] + chunk_frames
        self._recent = torch.cat([self._recent, clean], dim=2)[:, :, max(0, held - keep) :]
        self._next_chunk += 1
        return clean

    def _denoised(self, index: int, given: torch.Tensor | None, pipelined: bool, batched: bool) -> torch.Tensor | None:
        """Chunk `index` made by the request's loop: the stream batch, the pipelined window or the sequential steps."""
        if batched:
            return self._stream_batch_chunk(index)
        if pipelined:
            return self._pipelined_chunk(index)
        return self._denoise_chunk(given)

    def _commit_context(self, clean: torch.Tensor, batched: bool, denoised: bool = True) -> None:
        """Make the chunk's K/V the context of the next ones, by the request's policy: a clean context pass
        ("rolling"), the last step's writes ("last_step"; the stream batch commits each row's itself) or nothing
        ("recompute": the next chunk rebuilds its context). A start image's chunk ran no step: under "last_step"
        its context pass is the one write it gets."""
        request = self._request
        if request.context_policy == "last_step" and denoised:
            # pipelined: the forward wrote every in-flight chunk; only the leaving (first) one is committed
            tokens = clean.shape[2] * request.layout.tokens_per_frame if request.denoising == "pipelined" else None
            if not batched:
                for cache in self._caches:
                    cache.commit(tokens)
        elif request.context_policy in ("rolling", "last_step"):
            self._pipe.context_pass(clean, self._embeds, self._caches, request, timestep=request.context_noise)

    def _context_frames(self) -> int:
        """Latent frames a rebuilt context holds (the recompute policy): the window less the chunk."""
        return self._request.layout.full_window_frames

    def _rebuild_context(self) -> None:
        """The recompute policy (Krea Realtime's `GenerationSession`): every branch's cache emptied, then refilled
        in one t = 0 pass over [the first latent frame, the last clean frames], bidirectional among themselves and
        committed at positions 0..; the chunk then attends to them and to itself. Nothing before chunk 1."""
        if self._next_chunk == 0:
            return
        first = self._first_frame
        if self._request.reencodes and self._next_chunk > 1:
            # Krea's default: the oldest decoded pixel frame of the last chunk's span, encoded alone (a fresh encoder)
            first = self._pipe.make_encoder().encode(self._first_pixels[:, :, :1]).to(first.dtype)
        context = torch.cat([first, self._recent], dim=2)[:, :, : self._context_frames()]
        for cache in self._caches:
            cache.reset_context()  # the text K/V stay: the rebuild runs under the embedding already cached
        self._pipe.context_pass(context, self._embeds, self._caches, self._request)

    def _starting_latents(
        self, index: int, given: torch.Tensor | None, sigma: torch.Tensor | float | None
    ) -> torch.Tensor:
        """Chunk `index`'s latents before its first step, float32: its noise, drawn now (chunk by chunk: nothing the
        size of the video exists) or sliced from the call's `latents`, mixed with `given` input latents at its first
        `sigma` (flow matching: x_sigma = sigma * noise + (1 - sigma) * x0), or at a level of its own (a float:
        StreamDiffusionV2's `noise_scale`, `rolldiff.pipelines.video_noise`)."""
        request, device = self._request, self._placement[0]
        shape = request.geometry.shape_of(index)
        if request.latents is None:
            noisy = randn_tensor(shape, generator=request.generator, device=device, dtype=torch.float32)
        else:
            start = request.geometry.chunk_start(index)
            noisy = request.latents[:, :, start : start + shape[2]].to(device=device, dtype=torch.float32)
        if given is None:
            return noisy
        sigma = sigma.to(device) if isinstance(sigma, torch.Tensor) else sigma
        return sigma * noisy + (1.0 - sigma) * given.to(device=device, dtype=torch.float32)

    def _denoise_chunk(self, given: torch.Tensor | None) -> torch.Tensor | None:
        """The chunk from fresh noise (text-to-video) or from `given` input latents noised to `strength`."""
        request = self._request
        device, dtype = self._placement
        plan, level = request.step_plan_for(self._next_chunk), None
        if given is not None and self._inputs.noise_mix is not None:  # an input video's chunk
            plan, level = self._inputs.noise_mix.plan_and_level(plan, request.step_mapping)
        scheduler, fed = self._schedule(plan, device)
        noisy = self._starting_latents(self._next_chunk, given, scheduler.sigmas[0] if level is None else level)
        for timestep, fed_timestep in zip(scheduler.timesteps, fed.unbind(0)):
            if self._interrupted.is_set():
                return None
            velocity = self._velocity(noisy.to(dtype), fed_timestep)
            noisy = scheduler.step(velocity.float(), timestep, noisy, generator=request.generator).prev_sample
            noisy = self._after_step(noisy.float(), timestep)
        return noisy.to(dtype)  # the last step re-noises to sigma 0: the clean chunk

    def _schedule(self, plan: StepPlan, device: torch.device) -> tuple[FlowMatchEulerDiscreteScheduler, torch.Tensor]:
        """This chunk's scheduler and the timesteps the model is fed, `(steps, batch)` float32 on `device`:
        diffusers' shift mapping done by the scheduler itself, or the plan's own sigmas taken as given (a copy
        with shift 1) and its timesteps. The fed timesteps are made once per plan and stream (one host read, not
        one a step), then reused by every chunk."""
        if plan.sigmas is None:
            scheduler = self._scheduler
            scheduler.set_timesteps(sigmas=[s / 1000.0 for s in plan.steps], device=device)
        else:
            scheduler = self._plain_scheduler
            scheduler.set_timesteps(sigmas=list(plan.sigmas), timesteps=list(plan.timesteps), device=device)
        scheduler.set_begin_index(0)  # step by position: a run-time first step may repeat the next (500, 500, ...)
        fed = self._fed.get(plan)
        if fed is None:
            values = scheduler.timesteps.tolist() if plan.timesteps is None else list(plan.timesteps)
            column = torch.tensor(values, dtype=torch.float32).unsqueeze(1)  # each value as float32, as before
            fed = column.expand(-1, self._request.batch_size).contiguous().to(device)
            self._fed[plan] = fed
        return scheduler, fed

    def _velocity(self, chunk: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        """The velocity for one chunk at `timestep` `(batch,)` (guided when a negative branch exists)."""
        request = self._request
        velocity = self._pipe.transformer_step(chunk, timestep, self._embeds[0], self._caches[0], request)
        if len(self._caches) > 1:
            unconditional = self._pipe.transformer_step(chunk, timestep, self._embeds[1], self._caches[1], request)
            velocity = unconditional + request.guidance_scale * (velocity - unconditional)
        return velocity

    def _after_step(self, latents: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        """Run `callback_on_step_end` (its returned `latents` replace the next step's input)."""
        callback = self._request.callback_on_step_end
        index, self._step_index = self._step_index, self._step_index + 1
        if callback is None:
            return latents
        values = {"latents": latents, "prompt_embeds": self._embeds[0]}
        result = callback(self._pipe, index, timestep, {k: values[k] for k in self._request.callback_tensor_inputs})
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

    def _emit(self, clean: torch.Tensor) -> Any:
        latent_output = self._request.output_type == "latent"
        if self._decoder is None:
            self._frames_emitted += clean.shape[2]
            return clean
        video = self._decoder.decode(clean)  # (batch, 3, frames, H, W) in [-1, 1]
        if self._request.reencodes:  # the pixel span of the latest chunk's first frames
            span = self._pipe.latent_to_frames(self._request.geometry.chunk_frames)
            held = video if self._first_pixels is None else torch.cat([self._first_pixels, video], dim=2)
            self._first_pixels = held[:, :, -span:]
        if latent_output:
            self._frames_emitted += clean.shape[2]
            return clean
        self._frames_emitted += video.shape[2]
        return self._pipe.postprocess(video, self._request.output_type)

    def close(self) -> None:
        """End the stream: close its input video (stopping ffmpeg for a file, even if the stream never started), its
        progress bar, and release offload hooks; iteration then stops."""
        if self._closed:
            return
        self._closed = True
        conditioning = self._request.conditioning
        if conditioning is not None and conditioning.video is not None:
            conditioning.video.close()
        if isinstance(self._decoder, OverlappedDecoder):
            self._decoder.drain()
        if self._progress is not None:
            self._progress.close()
        self._pipe.stream_ended(self)
        self._pipe.maybe_free_model_hooks()

    # ---------------------------------------------------------------------------------------- state
    def _generators(self) -> list[torch.Generator]:
        generator = self._request.generator
        if generator is None:
            return [default_generator(self._placement[0])]
        return generator if isinstance(generator, list) else [generator]

    def state_dict(self) -> dict[str, Any]:
        """The stream at its chunk boundary: tensors, plus each cache layer's host counters (`*._extra_state`).

        Keys: `cache.<branch>.<...>` (each cache's `state_dict()`: the stream layers' buffers and extra state;
        the cross-attention K/V are recomputed from `embeds.<branch>` on load), `decoder.<...>`, `recent`,
        `embeds.<branch>`, `pending_embeds` (a switch not applied yet), `generator.<i>` (the random
        generators' states) and `position` (version, next chunk, steps done, frames emitted, active prompt).
        """
        self._start()
        state: dict[str, Any] = {}
        for branch, cache in enumerate(self._caches):
            state.update({f"cache.{branch}.{key}": value for key, value in cache.state_dict().items()})
        if self._decoder is not None:
            state.update({f"decoder.{key}": value for key, value in self._decoder.state_dict().items()})
        state.update({f"embeds.{branch}": embeds for branch, embeds in enumerate(self._embeds)})
        if self._pending is not None:
            state["pending_embeds"] = self._pending
            if self._pending_blend is not None:
                state["pending_blend"] = torch.tensor(self._pending_blend, dtype=torch.int64)
            if self._pending_cut:
                state["pending_cut"] = torch.tensor(True)
        state["recent"] = self._recent
        if self._first_frame is not None:
            state["first_frame"] = self._first_frame
        if self._first_pixels is not None:
            state["first_pixels"] = self._first_pixels
        state.update({f"blend.{i}": embeds for i, embeds in enumerate(self._blend)})
        if self._inputs is not None:
            state.update({f"inputs.{key}": value for key, value in self._inputs.state_dict().items()})
        for index, generator in enumerate(self._generators()):
            state[f"generator.{index}"] = generator.get_state()
        state.update(self._pipelined_state())
        state.update(self._stream_batch_state())
        position = [STREAM_STATE_VERSION, self._next_chunk, self._step_index, self._frames_emitted]
        state["position"] = torch.tensor([*position, self._active_prompt], dtype=torch.int64)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()` of a stream made with the same arguments (before iterating this one)."""
        if self._next_chunk or self._closed:
            raise RuntimeError("load_state_dict() must come before the stream's first chunk.")
        position = state.get("position")
        if not isinstance(position, torch.Tensor) or position.numel() != 5 or int(position[0]) != STREAM_STATE_VERSION:
            raise ValueError(
                f"This state is not a ChunkStream state of version {STREAM_STATE_VERSION} (saved by another "
                "rolldiff version); start the video over."
            )
        if not self._started:
            self._allocate()  # the saved embeddings condition the caches below: no prompt is encoded
        device, dtype = self._placement
        for branch, cache in enumerate(self._caches):
            prefix = f"cache.{branch}."
            cache.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
        if self._decoder is not None:
            self._decoder.load_state_dict({k[8:]: v for k, v in state.items() if k.startswith("decoder.")})
        self._condition(
            [state[f"embeds.{branch}"].to(device=device, dtype=dtype) for branch in range(len(self._caches))]
        )
        pending = state.get("pending_embeds")
        self._pending = None if pending is None else pending.to(device=device, dtype=dtype)
        pending_blend = state.get("pending_blend")
        self._pending_blend = None if pending_blend is None else int(pending_blend)
        self._pending_cut = bool(state.get("pending_cut", False))
        self._recent = state["recent"].to(device=device, dtype=dtype)
        first_frame = state.get("first_frame")
        self._first_frame = None if first_frame is None else first_frame.to(device=device, dtype=dtype)
        pixels = state.get("first_pixels")
        self._first_pixels = None if pixels is None else pixels.to(device)
        blend = sorted((k for k in state if k.startswith("blend.")), key=lambda k: int(k.split(".")[1]))
        self._blend = [state[k].to(device=device, dtype=dtype) for k in blend]
        if self._inputs is not None:
            self._inputs.load_state_dict({k[7:]: v for k, v in state.items() if k.startswith("inputs.")})
        generators = self._generators()
        saved = sorted(k for k in state if k.startswith("generator."))
        if len(saved) != len(generators):
            raise ValueError(f"The state holds {len(saved)} generator state(s); this stream has {len(generators)}.")
        for index, generator in enumerate(generators):
            generator.set_state(state[f"generator.{index}"])
        self._load_pipelined_state(state, device)
        self._load_stream_batch_state(state, device)
        _, self._next_chunk, self._step_index, self._frames_emitted, self._active_prompt = map(int, position)

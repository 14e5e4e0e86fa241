"""`KreaRealtimeVideoPipeline`: long text-to-video, chunk by chunk, with a rolling sink + window KV cache.

The chunk loop, validation, streaming decode and writing live in `ChunkedVideoPipeline`; this file
holds what is Krea / Self-Forcing / LongLive specific: UMT5 prompts, the sink + window `ChunkLayout`,
Krea's KV-cache attention bias, and LongLive's re-cache after a prompt switch (the recent window
rewound and re-run under the new prompt; the sink kept bit for bit).

Example:
    ```py
    >>> import torch
    >>> from rolldiff import KreaRealtimeVideoPipeline
    >>> from rolldiff.defaults import default_model_path

    >>> pipe = KreaRealtimeVideoPipeline.from_pretrained(default_model_path())
    >>> video = pipe("a red circle moving left", num_frames=96, generator=torch.Generator().manual_seed(0)).frames
    >>> for frames in pipe.stream("a blue square moving up", num_frames=960):  # constant memory
    ...     pass  # (1, 3, 32, 32, 3) per chunk
    ```
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler
from diffusers.loaders import WanLoraLoaderMixin

from ...caching import AdaptiveSinkPolicy, RollingKVCache
from ...caching.layout import FLUSH_KEPT_FRAMES, ChunkLayout
from ...checks import check_choice, check_flag, check_number
from ...models.krea_realtime import ATTENTION_BIAS_MODES, KreaRealtimeTransformer3DModel
from ..request.request import CacheOptions, VideoRequest
from .chunked_video import ChunkedVideoPipeline, ChunkedVideoPipelineOutput

__all__ = ["KreaCacheOptions", "KreaRealtimeVideoPipeline", "KreaRealtimeVideoPipelineOutput"]

KV_QUANTIZATIONS = (None, "int8", "fp8")


@dataclass(frozen=True)
class KreaCacheOptions(CacheOptions):
    """The Krea-like family's cache options (see `KreaRealtimeVideoPipeline`); the geometry is checked by
    `ChunkLayout`, the rest here."""

    chunk_frames: int
    sink_frames: int
    window_frames: int
    position_mode: str
    attention_bias: float
    kv_quantization: str | None
    kv_offload: bool
    attention_bias_mode: str
    sink_mode: str = "fixed"  # the layout checks the value (`ChunkLayout`); here what it cannot be stored with
    elastic_window: bool = False  # Rolling Forcing's views: the layout checks both (`ChunkLayout._check_views`)
    context_window_frames: int | None = None
    adaptive_sink: bool = False  # StreamDiffusionV2's (`rolldiff.caching.AdaptiveSinkLayer`)
    adaptive_sink_threshold: float = 0.2  # its `adapt_sink_threshold`

    def __post_init__(self) -> None:
        check_number("attention_bias", self.attention_bias, 0, 1, above=True, hint="1 disables it")
        check_choice(
            "attention_bias_mode",
            self.attention_bias_mode,
            ATTENTION_BIAS_MODES,
            hint="Scope's leaves the first frame unbiased",
        )
        check_choice("kv_quantization", self.kv_quantization, KV_QUANTIZATIONS)
        check_flag("kv_offload", self.kv_offload)
        if self.sink_mode != "fixed" and (self.kv_quantization is not None or self.kv_offload):
            raise ValueError(
                f"`sink_mode={self.sink_mode!r}` writes dense K/V between cache slots at each commit: pass "
                f"kv_quantization=None and kv_offload=False (got kv_quantization={self.kv_quantization!r}, "
                f"kv_offload={self.kv_offload})."
            )
        self._check_adaptive_sink()

    def _check_adaptive_sink(self) -> None:
        """The adaptive sink compares and writes dense keys stored after RoPE, in a sink of whole frames."""
        check_flag("adaptive_sink", self.adaptive_sink)
        AdaptiveSinkPolicy(self.adaptive_sink_threshold)  # checks the threshold
        if not self.adaptive_sink:
            return
        conflicts = {
            "position_mode": self.position_mode != "absolute",
            "sink_frames": self.sink_frames < 1,
            "sink_mode": self.sink_mode != "fixed",
            "kv_quantization": self.kv_quantization is not None,
            "kv_offload": self.kv_offload,
            "attention_bias": self.attention_bias != 1.0,
        }
        if any(conflicts.values()):
            raise ValueError(
                "`adaptive_sink=True` compares each new frame's keys, stored after RoPE, with the sink's and writes "
                "dense K/V in place: it needs position_mode='absolute', sink_frames >= 1, sink_mode='fixed', no "
                f"kv_quantization, no kv_offload and attention_bias=1; got {self._named(conflicts)}."
            )

    def _named(self, conflicts: dict[str, bool]) -> str:
        return ", ".join(f"{name}={getattr(self, name)!r}" for name, conflict in conflicts.items() if conflict)


@dataclass
class KreaRealtimeVideoPipelineOutput(ChunkedVideoPipelineOutput):
    """`frames`: `(batch, frames, height, width, 3)` np in [0, 1], a list of PIL lists, `(batch, frames, 3, H, W)`
    torch, or latents `(batch, channels, latent_frames, h, w)` for `output_type="latent"`."""


class KreaRealtimeVideoPipeline(ChunkedVideoPipeline, WanLoraLoaderMixin):
    """Text-to-video for causal Wan 2.1 checkpoints (Krea Realtime 14B, Self-Forcing / LongLive 1.3B).

    Components: `tokenizer` + `text_encoder` (UMT5), `transformer` (`KreaRealtimeTransformer3DModel`),
    `vae` (`AutoencoderKLWan`), `scheduler` (`FlowMatchEulerDiscreteScheduler`; its `shift` warps the
    denoising steps). Registered defaults (saved in `model_index.json`): the cache geometry in latent
    frames, the position mode, the denoising steps, the text length, Krea's KV-cache attention bias,
    and the native frame size (`height`/`width`, used when a call gives none); `fused_loras` records the LoRAs
    fused in (`rolldiff.pipelines.lora`: diffusers' `load_lora_weights` works here as on `WanPipeline`).

    Cache options (call arguments of `__call__` / `stream`, defaults from the config):
        chunk_frames: latent frames generated per chunk.
        sink_frames: first latent frames, never evicted (attention sink).
        window_frames: most recent latent frames attended to after the sink, counting the chunk.
        position_mode: "absolute" (keys after RoPE, bounded by the RoPE table) or "relative"
            (keys re-rotated inside sink + window, unbounded length).
        attention_bias: Krea's KV-cache bias, `log(bias)` added to past tokens' scores (1 = off).
        attention_bias_mode: "past" (every earlier token, the sink included) or "scope" (daydreamlive/scope's
            port: the first frame and the current chunk unbiased).
        kv_quantization: None, "int8" or "fp8": store the K/V window quantized (about 0.52x of bf16).
        kv_offload: keep the committed K/V window in CPU memory; each block's is brought in when it runs.
        sink_mode: "fixed", "rolling" (Rolling Sink: past the first window, each older chunk is replaced by the
            first `window - chunk` frames walked forward and back, at its own positions; needs "relative") or "ema"
            (Reward Forcing: each chunk leaving the window is blended into the sink, 0.999 / 0.001; needs "relative"
            and a sink of one chunk).
        elastic_window: the window counts the frames actually being denoised, so fewer in flight see more committed
            frames (Rolling Forcing's emptying windows).
        context_window_frames: the latent frames a context pass attends to, counting its chunk: the last ones of the
            video, the sink among them only while inside (Rolling Forcing's clean pass); None: the window's view.
        adaptive_sink: StreamDiffusionV2's adaptive sink (a sink frame is replaced when a new frame no longer
            resembles it, decided per step and block; `rolldiff.caching.AdaptiveSinkLayer`).
        adaptive_sink_threshold: its cosine-similarity threshold (0.2 upstream).
    """

    model_cpu_offload_seq = "text_encoder->transformer->vae"
    options_class = KreaCacheOptions
    recache_modes = ("causal", "longlive", "flush")
    offers_pipelined_denoising = True  # `denoising="pipelined"` (rolldiff.pipelines.pipelined)
    offers_scene_cuts = True  # `scene_cuts=` / `switch_prompt(scene_cut=True)` (Infinity-RoPE's RoPE cut)
    output_class = KreaRealtimeVideoPipelineOutput

    def __init__(  # noqa: PLR0913 (the config: components and their registered defaults)
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
        attention_bias_mode: str = "past",
        height: int = 480,
        width: int = 832,
        recipe: str | None = None,
        kv_quantization: str | None = None,
        kv_offload: bool = False,
        sink_mode: str = "fixed",
        elastic_window: bool = False,
        context_window_frames: int | None = None,
        adaptive_sink: bool = False,
        adaptive_sink_threshold: float = 0.2,
        lora_adapter: str | None = None,
        fused_loras: list[dict] | None = None,
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
            attention_bias_mode=attention_bias_mode,
            height=height,
            width=width,
            recipe=recipe,
            kv_quantization=kv_quantization,
            kv_offload=kv_offload,
            sink_mode=sink_mode,
            elastic_window=elastic_window,
            context_window_frames=context_window_frames,
            adaptive_sink=adaptive_sink,
            adaptive_sink_threshold=adaptive_sink_threshold,
            lora_adapter=lora_adapter,
            fused_loras=list(fused_loras or []),
        )
        self.set_vae_factors(vae)

    # ---------------------------------------------------------------------------------------- family hooks
    def make_layout(
        self,
        tokens_per_frame: int,
        options: KreaCacheOptions,
        num_latent_frames: int,
        largest_chunk: int | None = None,
    ) -> ChunkLayout:
        if largest_chunk is not None and not options.adaptive_sink:
            raise ValueError(
                "A first chunk larger than the others (`first_chunk='remainder'` or 'extra_frame') needs the adaptive "
                "sink (`adaptive_sink=True`, whose slots follow its own queue); the sliding window counts one chunk "
                "size. Give `num_frames` as whole chunks (`valid_num_frames`)."
            )
        layout = ChunkLayout(
            tokens_per_frame=tokens_per_frame,
            chunk_frames=options.chunk_frames if largest_chunk is None else largest_chunk,
            sink_frames=options.sink_frames,
            window_frames=options.window_frames,
            position_mode=options.position_mode,
            sink_mode=options.sink_mode,
            elastic_window=options.elastic_window,
            context_window_frames=options.context_window_frames,
        )
        return layout.fitted_to(num_latent_frames)

    def cache_storage(self, request: VideoRequest) -> dict:
        options = request.options
        storage = {"quantization": options.kv_quantization, "offload": options.kv_offload}
        if options.adaptive_sink:  # upstream pops its queue once per `total_steps` writes: one chunk's
            storage["adaptive_sink"] = AdaptiveSinkPolicy(
                options.adaptive_sink_threshold, request.writes_per_chunk, in_flight_frames=request.in_flight_frames
            )
        return storage

    def transformer_step(
        self, latents, timestep, embeds, cache: RollingKVCache, request: VideoRequest
    ) -> torch.Tensor:
        return self.transformer(
            latents,
            timestep,
            embeds,
            kv_cache=cache,
            layout=request.layout,
            attention_bias=float(request.options.attention_bias),
            attention_bias_mode=request.options.attention_bias_mode,
        ).sample

    def recache_frames(self, layout: ChunkLayout, committed_frames: int, chunk_frames: int) -> int:
        # LongLive's one-pass re-cache may re-run up to sink + window frames: keep that many (a few latent frames)
        return min(committed_frames, layout.context_frames)

    def recache(
        self, recent: torch.Tensor, embeds: torch.Tensor, cache: RollingKVCache, request: VideoRequest
    ) -> None:
        """Rewrite the recent context under the new prompt (the sink is never touched in "causal" mode).

        - `recache="causal"` (rolldiff's default): rewind the visible window and write it again at t = 0, chunk by
          chunk, so each re-cached chunk sees its past as the next chunk will.
        - `recache="longlive"` (LongLive's `interactive_causal_inference.py:54-90`): the last `min(sink + window,
          frame)` frames re-run in ONE pass with no mask between them, so each sees all the others; a switch inside
          the first `sink + window` frames re-runs from frame 0 and rewrites the sink too.
        - `recache="flush"` (Infinity-RoPE's `kv_flush`, `pipeline/causal_inference.py:213-222`): nothing re-runs; the
          window keeps only its last `FLUSH_KEPT_FRAMES` committed frames, moved up to right after the sink.
        """
        layout: ChunkLayout = request.layout
        if request.recache_mode == "longlive":
            self._longlive_recache(recent, embeds, cache, request)
            return
        if request.recache_mode == "flush":
            _flush(cache, layout, self.transformer.committed_frames(cache, layout))
            return
        frames = min(recent.shape[2], layout.rewindable_frames(self.transformer.committed_frames(cache, layout)))
        if frames == 0:  # everything committed is sink: nothing to re-cache
            return
        recent = recent[:, :, recent.shape[2] - frames :]
        cache.rewind(frames * layout.tokens_per_frame)
        # one chunk a pass, as made (pipelined, the layout's chunk is all of them in flight): boundaries counted back
        # from the newest, so a chunk only partly inside the window is re-run alone for that part
        edges = sorted({0, *range(frames, 0, -request.geometry.chunk_frames)})
        for start, end in zip(edges, edges[1:]):
            self.context_pass(recent[:, :, start:end], [embeds], [cache], request)

    def _longlive_recache(self, recent, embeds, cache: RollingKVCache, request: VideoRequest) -> None:
        """LongLive's pass, computed in a small scratch cache at the frames' own positions, then written in place
        of the window (or of everything, for an early switch)."""
        layout, tokens = request.layout, request.layout.tokens_per_frame
        frame = self.transformer.committed_frames(cache, layout)
        start = 0 if frame <= layout.context_frames else frame - layout.window_frames  # past the sink upstream skips
        frames = recent[:, :, recent.shape[2] - (frame - start) :]
        count = frames.shape[2]
        # a window of twice the pass: once committed, the whole pass is still what `get()` returns
        scratch_layout = dataclasses.replace(
            layout, chunk_frames=count, window_frames=2 * count, sink_mode="fixed", elastic_window=False,
            context_window_frames=None,
        )  # fmt: skip
        scratch = self.transformer.make_cache(scratch_layout)
        if start > 0:  # the kept sink at its positions, then the stream position moved to the pass's first frame
            sink = [tuple(t[:, : layout.sink_tokens] for t in layer.get()) for layer in cache]
            _write_key_values(scratch, sink, layout.sink_tokens)
            scratch.advance((start - layout.sink_frames) * tokens)
        self.set_conditioning(scratch, embeds)  # under offload hooks, filled inside the forward below
        timestep = torch.zeros(frames.shape[0], device=frames.device)
        self.transformer(frames, timestep, embeds, kv_cache=scratch, layout=scratch_layout)
        scratch.commit()
        recached = [tuple(t[:, -count * tokens :] for t in layer.get()) for layer in scratch]
        if start == 0:  # every slot rewritten: the stream's cache holds exactly the re-cached frames
            cache.reset_context()  # the text K/V stay: the switch already set them for `embeds`
            _write_key_values(cache, recached, layout.chunk_tokens)
            return
        window = layout.rewindable_frames(frame) * tokens  # the frames the next chunk sees after the sink
        cache.rewind(window)
        _write_key_values(cache, [(k[:, -window:], v[:, -window:]) for k, v in recached], layout.chunk_tokens)


def _flush(cache: RollingKVCache, layout: ChunkLayout, committed_frames: int) -> None:
    """Infinity-RoPE's KV flush: the sink and the window's last `FLUSH_KEPT_FRAMES` frames kept, written again from
    position 0 so the kept frames sit right after the sink and nothing older stays visible (the stream position moves
    back; keys are stored before RoPE, so the next chunk sees them as upstream's buffer `[:, 1560:4680] = [:, -3120:]`
    puts them)."""
    held = layout.rewindable_frames(committed_frames)
    if held <= FLUSH_KEPT_FRAMES:  # nothing older to drop (upstream would copy slots no chunk has written yet)
        return
    sink, kept = layout.sink_tokens, FLUSH_KEPT_FRAMES * layout.tokens_per_frame
    pieces = [[(t[:, :sink], t[:, -kept:]) for t in layer.get()] for layer in cache]  # once per switch, not per step
    cache.reset_context()  # the text K/V stay: the switch already set them
    _write_key_values(
        cache, [tuple(torch.cat(pair, dim=1) for pair in layer) for layer in pieces], layout.chunk_tokens
    )


def _write_key_values(cache: RollingKVCache, keys_values: list[tuple[torch.Tensor, torch.Tensor]], chunk: int) -> None:
    """Commit per-block K/V `(batch, tokens, heads, head_dim)`, as stored (after RoPE in absolute mode), chunk by
    chunk."""
    for start in range(0, keys_values[0][0].shape[1], chunk):
        for layer, (key, value) in zip(cache, keys_values):
            layer.update(key[:, start : start + chunk], value[:, start : start + chunk])
        cache.commit()

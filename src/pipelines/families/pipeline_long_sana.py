"""`LongSanaVideoPipeline`: long text-to-video with block-causal SANA-Video (LongSANA) and a constant-size state.

The chunk loop, validation, streaming decode, writing and the prompt schedule live in
`ChunkedVideoPipeline`; this file holds what is LongSANA specific: Gemma-style prompts (with their
attention mask), a sink-less `ChunkLayout` whose window is whole chunks (or every chunk: LongSANA's
default), absolute frame positions (refused past the RoPE table) or positions re-based in place to
stay inside it (`position_mode="relative"`, unbounded length), and LongSANA's re-cache on a prompt
switch: only the last chunk is rewound and re-run at t = 0 under the new prompt, so its contribution
to the state is replaced, not added twice.

Example:
    ```py
    >>> import torch
    >>> from rolldiff.defaults import load_pipeline

    >>> pipe = load_pipeline("tiny-bouncing-shapes-sana")  # a LongSanaVideoPipeline
    >>> video = pipe("a red circle moving left", num_frames=96, generator=torch.Generator().manual_seed(0)).frames
    >>> for frames in pipe.stream("a blue square moving up", num_frames=960):  # constant memory
    ...     pass  # (1, 3, 32, 32, 3) per chunk
    ```
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler
from diffusers.loaders import SanaLoraLoaderMixin

from ...caching import RollingKVCache
from ...caching.layout import ALL_FRAMES, POSITION_MODES, ChunkLayout
from ...checks import check_choice, check_int, is_int
from ...models.long_sana import LongSanaTransformer3DModel
from ..request.request import CacheOptions, VideoRequest
from .chunked_video import ChunkedVideoPipeline, ChunkedVideoPipelineOutput

__all__ = ["LongSanaCacheOptions", "LongSanaVideoPipeline", "LongSanaVideoPipelineOutput"]


@dataclass
class LongSanaVideoPipelineOutput(ChunkedVideoPipelineOutput):
    """`frames`: `(batch, frames, height, width, 3)` np in [0, 1], a list of PIL lists, `(batch, frames, 3, H, W)`
    torch, or latents `(batch, channels, latent_frames, h, w)` for `output_type="latent"`."""


@dataclass(frozen=True)
class LongSanaCacheOptions(CacheOptions):
    """The SANA-like family's cache options (see `LongSanaVideoPipeline`), checked here."""

    chunk_frames: int
    sink_frames: int
    window_frames: int | str
    position_mode: str

    def __post_init__(self) -> None:
        chunk, window = self.chunk_frames, self.window_frames
        check_int("chunk_frames", chunk, 1)
        if self.sink_frames != 0:
            raise ValueError(f"`sink_frames` must be 0: LongSANA has no attention sink, got {self.sink_frames!r}.")
        if window != ALL_FRAMES and is_int(window) and window % chunk:  # the rest is `ChunkLayout`'s rule
            raise ValueError(
                f"`window_frames` must be whole chunks for LongSANA (a multiple of `chunk_frames`={chunk}: the state "
                f"is kept per chunk) or {ALL_FRAMES!r} (every earlier chunk), got {window!r}."
            )
        check_choice("position_mode", self.position_mode, POSITION_MODES)


class LongSanaVideoPipeline(ChunkedVideoPipeline, SanaLoraLoaderMixin):
    """Text-to-video for block-causal SANA-Video checkpoints (LongSANA).

    Prompts are encoded by the shared `encode_prompt`: Gemma embeddings zero past each prompt's end, and
    the zeros mark the padding (each step passes `embeds != 0` as the cross-attention mask, as SANA-Video
    passes its tokenizer's attention mask).

    Components: `tokenizer` + `text_encoder` (Gemma-2 style), `transformer` (`LongSanaTransformer3DModel`),
    `vae` (`AutoencoderKLWan`), `scheduler` (`FlowMatchEulerDiscreteScheduler`; its `shift` warps the
    denoising steps: LongSANA's [1000, 960, 889, 727] are [1000, 750, 500, 250] under shift 8).
    LoRAs load with diffusers' `load_lora_weights` (`SanaLoraLoaderMixin`); `fused_loras` in the config records
    those fused in (`rolldiff.pipelines.lora`).

    Cache options (call arguments of `__call__` / `stream`, defaults from the config; the names are the
    Krea-like pipeline's, so callers drive both families alike):
        chunk_frames: latent frames generated per chunk (LongSANA: 10).
        sink_frames: must be 0 (LongSANA has no attention sink).
        window_frames: latent frames a chunk sees, counting itself, in whole chunks; `"all"`: every earlier chunk
            (LongSANA's default; the state is a running sum, so memory stays constant either way); `None` in a
            call: the config's value.
        position_mode: "absolute" (frame positions as trained, refused past the RoPE table) or "relative"
            (the committed state is re-based in place when the table would run out: unbounded length).
    """

    model_cpu_offload_seq = "text_encoder->transformer->vae"
    options_class = LongSanaCacheOptions
    recache_modes = ("causal", "longsana")
    output_class = LongSanaVideoPipelineOutput

    def __init__(  # noqa: PLR0913 (the config: components and their registered defaults)
        self,
        tokenizer,
        text_encoder,
        transformer: LongSanaTransformer3DModel,
        vae: AutoencoderKLWan,
        scheduler: FlowMatchEulerDiscreteScheduler,
        chunk_frames: int = 10,
        sink_frames: int = 0,
        window_frames: int | str = ALL_FRAMES,
        position_mode: str = "absolute",
        denoising_steps: list[int] | tuple[int, ...] = (1000, 750, 500, 250),
        max_sequence_length: int = 300,
        height: int = 480,
        width: int = 832,
        recipe: str | None = None,
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
            window_frames=ALL_FRAMES if window_frames is None else window_frames,  # None: folders saved before "all"
            position_mode=position_mode,
            denoising_steps=list(denoising_steps),
            max_sequence_length=max_sequence_length,
            height=height,
            width=width,
            recipe=recipe,
            lora_adapter=lora_adapter,
            fused_loras=list(fused_loras or []),
        )
        self.set_vae_factors(vae)

    # ---------------------------------------------------------------------------------------- family hooks
    def make_layout(
        self,
        tokens_per_frame: int,
        options: LongSanaCacheOptions,
        num_latent_frames: int,
        largest_chunk: int | None = None,
    ) -> ChunkLayout:
        chunk, window, mode = largest_chunk or options.chunk_frames, options.window_frames, options.position_mode
        table = self.transformer.config.rope_max_seq_len
        if mode == "relative" and 2 * chunk > table:
            raise ValueError(
                f"`position_mode='relative'` re-bases positions to the middle of the RoPE table ({table} frames): "
                f"`chunk_frames` must be at most {table // 2}, got {chunk}."
            )
        if is_int(window):  # a window past the video keeps no more state than the video makes (whole chunks)
            window = min(window, chunk * max(2, math.ceil(num_latent_frames / chunk)))
        return ChunkLayout(
            tokens_per_frame,
            chunk_frames=chunk,
            sink_frames=0,
            window_frames=window,
            position_mode=mode,
        )

    def transformer_step(
        self, latents, timestep, embeds, cache: RollingKVCache, request: VideoRequest
    ) -> torch.Tensor:
        if request.layout.position_mode == "relative":
            self._keep_positions_in_table(cache, latents.shape[2])
        text_mask = embeds.abs().amax(dim=-1) > 0  # (batch, text_tokens): False on padding
        return self.transformer(
            latents, embeds, timestep, encoder_attention_mask=text_mask, kv_cache=cache, layout=request.layout
        ).sample

    def _keep_positions_in_table(self, cache: RollingKVCache, chunk_frames: int) -> None:
        """Re-base the committed state to the middle of the RoPE table when the next chunk would leave it."""
        committed = self.transformer.committed_frames(cache)
        table = self.transformer.config.rope_max_seq_len
        if committed + chunk_frames > table:
            self.transformer.rebase_positions(cache, committed - table // 2)

    def recache_frames(self, layout: ChunkLayout, committed_frames: int, chunk_frames: int) -> int:
        """LongSANA re-runs only the last chunk on a prompt switch (`chunk_frames`: the chunk just committed)."""
        return min(chunk_frames, committed_frames)

    def recache(
        self, recent: torch.Tensor, embeds: torch.Tensor, cache: RollingKVCache, request: VideoRequest
    ) -> None:
        """LongSANA's re-cache: rewind the last chunk's state and write it again at t = 0 under the new prompt.

        The linear-attention sums return to what they were before that chunk (exactly: the layer keeps the
        previous sums), the temporal-conv state to the chunk before it; the chunk is then committed again,
        so the state holds its new contribution once.
        """
        frames = recent.shape[2]
        if request.recache_mode == "longsana" and self.transformer.committed_frames(cache) == frames:
            # NVlabs' interactive pipeline before chunk 1 re-runs chunk 0 over chunk 0's own old state (its
            # `_accumulate_kv_cache(kv_cache, 0)` is that entry), at chunk 0's positions, then replaces it
            for conv in cache.slots["conv_state"]:
                conv.shift_frames(-frames)
            timestep = torch.zeros(recent.shape[0], device=recent.device)
            self.transformer_step(recent, timestep, embeds, cache, request)
            cache.commit_replacing_last()
            return
        cache.rewind(frames * request.layout.tokens_per_frame)
        self.context_pass(recent, [embeds], [cache], request)

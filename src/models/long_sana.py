"""Block-causal SANA-Video (LongSANA) with a constant-size state cache.

`LongSanaTransformer3DModel` subclasses diffusers' `SanaVideoTransformer3DModel`, so diffusers-format
SANA-Video checkpoints load unchanged; without a cache or a layout the forward is exactly diffusers'.
Three pieces are swapped, each reading the per-call context bound by `forward` (never model state):

- self-attention (ReLU linear attention): a chunk attends to itself plus the committed state of the
  earlier chunks (all, or the last N), kept per block in a `LinearAttentionLayer`:
  `out = ((vk_past + vk_chunk) q_rot) / ((k_sum_past + k_sum_chunk) q + eps)`, fp32, RoPE on the
  numerator only, as the base model does;
- the feed-forward's temporal convolution (`conv_temp`, kernel 3 over frames): the chunk's input is
  prefixed by the previous chunk's last input frame (`ConvStateLayer`), the first output dropped, so
  time is bidirectional inside a chunk and causal across chunks;
- the text cross-attention: K/V computed once per prompt into a `CrossAttentionLayer`;
- the RoPE module: positions are absolute latent frames (`frame_count` of the cache + the chunk's
  frames), computed once per forward on device (no per-chunk recompile).

A whole-sequence reference (`layout` without `kv_cache`) computes the same block-causal model with
per-chunk cumulative sums instead of a cache; with `teacher_forcing=True` the input is
`[clean; noisy]` and every noisy chunk sees the clean chunks before it (training).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.modeling_utils import ModelMixin  # noqa: F401  diffusers' pipeline loader looks it up here
from diffusers.models.transformers.transformer_sana_video import (
    SanaAttnProcessor2_0,
    SanaLinearAttnProcessor3_0,
    SanaVideoTransformer3DModel,
    WanRotaryPosEmbed,
)
from einops import rearrange

from ..caching import ConvStateLayer, CrossAttentionLayer, RewindableLinearAttentionLayer, RollingKVCache
from ..caching.layout import ALL_FRAMES, ChunkLayout
from ..checks import check_int
from .call_context import CallContextSlot, bind_call_context
from .patch_grid import tokens_per_latent_frame
from .placement import block_devices

LINEAR_ATTENTION_EPS = 1e-15  # diffusers' SanaLinearAttnProcessor3_0


def sana_layout(
    tokens_per_frame: int, chunk_frames: int = 10, context_chunks: int | None = None, position_mode: str = "absolute"
) -> ChunkLayout:
    """The `ChunkLayout` of a LongSANA stream: no sink; a chunk sees `context_chunks` earlier chunks (None: all).

    The window counts the chunk itself, as for every family: `window_frames = chunk_frames * (context_chunks + 1)`.
    """
    window = ALL_FRAMES if context_chunks is None else chunk_frames * (context_chunks + 1)
    return ChunkLayout(
        tokens_per_frame, chunk_frames=chunk_frames, sink_frames=0, window_frames=window, position_mode=position_mode
    )


def context_chunks(layout: ChunkLayout) -> int | None:
    """Earlier chunks a chunk sees under `layout` (None: all); the window must be whole chunks, with no sink."""
    if layout.sink_frames:
        raise ValueError(f"LongSANA has no attention sink: `layout.sink_frames` must be 0, got {layout.sink_frames}.")
    if layout.unbounded:
        return None
    if layout.window_frames % layout.chunk_frames:
        raise ValueError(
            f"`layout.window_frames`={layout.window_frames} must be a multiple of `chunk_frames`="
            f"{layout.chunk_frames} (the state is kept per chunk)."
        )
    return layout.window_frames // layout.chunk_frames - 1


# ----------------------------------------------------------------------------------------- per-call context
@dataclass
class SanaCallContext:
    """What the processors of one forward read (bound for the call by `bind_call_context`)."""

    self_layers: list | None = None  # cached: one LinearAttentionLayer per block
    cross_layers: list | None = None  # cached: one CrossAttentionLayer (or None) per block
    conv_layers: list | None = None  # cached: one ConvStateLayer per block
    frame_positions: torch.Tensor | None = None  # (frames,) RoPE frame index of every input frame
    chunk_frames: int = 0  # reference: frames per chunk
    copies: int = 1  # reference: 1 = block-causal sequence, 2 = [clean; noisy] teacher forcing
    context_chunks: int | None = None  # reference: earlier chunks seen (None: all)


def _rotate(hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs of `(batch, tokens, heads, head_dim)`, as diffusers' SANA processor does."""
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(hidden_states)


def _rotate_to_state(state: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`_rotate` with the tables moved to the state's device."""
    return _rotate(state, cos.to(state.device), sin.to(state.device))


def _linear_attention_readout(query, query_rotated, vk, k_sum) -> torch.Tensor:
    """`(vk q_rot) / (k_sum q + eps)` per token: query `(B, T, H, D)`, vk `(B, H, D, D)`, k_sum `(B, H, 1, D)`."""
    numerator = torch.einsum("bhde,bthe->bthd", vk, query_rotated.float())
    denominator = torch.einsum("bhoe,bthe->btho", k_sum, query.float())
    return numerator / (denominator + LINEAR_ATTENTION_EPS)


# ----------------------------------------------------------------------------------------- processors
class LongSanaLinearAttnProcessor(SanaLinearAttnProcessor3_0):
    """ReLU linear self-attention of block `index`: diffusers' (no context), cached, or the block-causal reference."""

    def __init__(self, index: int, slot: CallContextSlot) -> None:
        self.index = index
        self.slot = slot

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        context = self.slot.context
        if context is None or (context.self_layers is None and context.chunk_frames == 0):
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        original_dtype = hidden_states.dtype
        query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        query = F.relu(query.unflatten(2, (attn.heads, -1)))  # (B, L, H, D)
        key = F.relu(key.unflatten(2, (attn.heads, -1)))
        value = value.unflatten(2, (attn.heads, -1))
        query_rotated, key_rotated = _rotate(query, *rotary_emb), _rotate(key, *rotary_emb)
        if context.self_layers is not None:
            layer = context.self_layers[self.index]
            vk, k_sum = layer.update(key_rotated, value, key_for_normalizer=key)  # past + this chunk, fp32
            out = _linear_attention_readout(query, query_rotated, vk, k_sum)
        else:
            out = self._reference(query, query_rotated, key, key_rotated, value, context)
        out = out.flatten(2, 3).to(original_dtype)  # (B, L, H * D)
        return attn.to_out[1](attn.to_out[0](out))

    @staticmethod
    def _reference(query, query_rotated, key, key_rotated, value, context: SanaCallContext) -> torch.Tensor:
        """Block-causal linear attention over a whole sequence of `copies` x chunks via per-chunk cumulative sums.

        Copy 0 is the clean sequence; every copy's chunk i sees the clean chunks before it (the last
        `context_chunks` of them, or all) plus itself.
        """
        tokens_per_chunk = context.chunk_frames * (query.shape[1] // context.frame_positions.shape[0])

        def chunks(t):  # (B, L, H, D) -> (B, copies, chunks, tokens_per_chunk, H, D)
            return rearrange(t.float(), "b (n c t) h d -> b n c t h d", n=context.copies, t=tokens_per_chunk)

        vk = torch.einsum("bncthd,bncthe->bnchde", chunks(value), chunks(key_rotated))  # per-chunk states
        k_sum = chunks(key).sum(dim=3).unsqueeze(-2)  # (B, copies, chunks, H, 1, D)
        clean_vk, clean_k_sum = vk[:, 0], k_sum[:, 0]
        # prefix[i] = sum of clean chunks 0 .. i-1
        prefix_vk = F.pad(clean_vk.cumsum(dim=1), (0, 0, 0, 0, 0, 0, 1, 0))[:, :-1]
        prefix_k_sum = F.pad(clean_k_sum.cumsum(dim=1), (0, 0, 0, 0, 0, 0, 1, 0))[:, :-1]
        if context.context_chunks is not None:  # drop chunks older than the window: prefix[i] - prefix[i - N]
            n = context.context_chunks
            prefix_vk = prefix_vk - F.pad(prefix_vk, (0, 0, 0, 0, 0, 0, n, 0))[:, : prefix_vk.shape[1]]
            prefix_k_sum = prefix_k_sum - F.pad(prefix_k_sum, (0, 0, 0, 0, 0, 0, n, 0))[:, : prefix_k_sum.shape[1]]
        total_vk = prefix_vk[:, None] + vk  # (B, copies, chunks, H, D, D)
        total_k_sum = prefix_k_sum[:, None] + k_sum
        numerator = torch.einsum("bnchde,bncthe->bncthd", total_vk, chunks(query_rotated))
        denominator = torch.einsum("bnchoe,bncthe->bnctho", total_k_sum, chunks(query))
        out = numerator / (denominator + LINEAR_ATTENTION_EPS)
        return rearrange(out, "b n c t h d -> b (n c t) h d")


class LongSanaCrossAttnProcessor(SanaAttnProcessor2_0):
    """Text cross-attention whose K/V are computed once per prompt into the block's `CrossAttentionLayer`.

    The pipeline signals a prompt change by resetting the layers (`cache.reset_cross_attention()`).
    """

    def __init__(self, index: int, slot: CallContextSlot) -> None:
        super().__init__()
        self.index = index
        self.slot = slot

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        context = self.slot.context
        layer = None if context is None or context.cross_layers is None else context.cross_layers[self.index]
        if layer is None:
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask)
        batch_size = hidden_states.shape[0]
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, encoder_hidden_states.shape[1], batch_size)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])
        query = attn.to_q(hidden_states)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        query = query.unflatten(2, (attn.heads, -1))
        if not layer.is_filled:  # `prepare_conditioning` fills it; else the first step does (a host flag)
            key, value = layer.update(*text_key_value(attn, encoder_hidden_states))
        else:
            key, value = layer.keys, layer.values  # the live buffers (`get()` returns a copy)
        out = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        out = attn.to_out[1](attn.to_out[0](out.flatten(2, 3).type_as(query)))
        return out / attn.rescale_output_factor


def text_key_value(attn, text_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-attention K/V `(batch, text_tokens, heads, head_dim)` of the projected, normalised caption."""
    key, value = attn.to_k(text_states), attn.to_v(text_states)
    if attn.norm_k is not None:
        key = attn.norm_k(key)
    return key.unflatten(2, (attn.heads, -1)), value.unflatten(2, (attn.heads, -1))


class BlockCausalTemporalConv(torch.nn.Conv2d):
    """`conv_temp` over `(batch, channels, frames, tokens)`: symmetric inside a chunk, causal across chunks.

    Same parameters as diffusers' `nn.Conv2d(C, C, (3, 1), padding=(1, 0))`. Cached: the committed last
    input frame of the previous chunk is prepended and the first output frame dropped. Reference: the
    same per chunk, every copy's chunk i prefixed by clean chunk i-1's last frame (zeros for chunk 0).
    """

    def __init__(self, channels: int, index: int, slot: CallContextSlot) -> None:
        super().__init__(channels, channels, kernel_size=(3, 1), stride=1, padding=(1, 0), bias=False)
        self.index = index
        self.slot = slot

    @classmethod
    def taking_over(cls, conv: torch.nn.Conv2d, index: int, slot: CallContextSlot) -> BlockCausalTemporalConv:
        """This conv holding `conv`'s own parameters: built on the meta device, so there is no second
        initialisation and no draw from the global generator (a seeded model stays diffusers' model)."""
        with torch.device("meta"):
            temporal = cls(conv.in_channels, index, slot)
        temporal.load_state_dict(conv.state_dict(), assign=True)
        return temporal

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        context = self.slot.context
        if context is None or (context.conv_layers is None and context.chunk_frames == 0):
            return super().forward(frames)
        if context.conv_layers is not None:
            previous, _ = context.conv_layers[self.index].update(frames)  # (B, C, 1, T), zeros at the start
            return super().forward(torch.cat([previous, frames], dim=2))[:, :, 1:]
        by_chunk = rearrange(frames, "b c (n k f) t -> b n k c f t", n=context.copies, f=context.chunk_frames)
        last_clean = F.pad(by_chunk[:, 0, :-1, :, -1:], (0, 0, 0, 0, 0, 0, 1, 0))  # (B, chunks, C, 1, T)
        previous = last_clean[:, None].expand(-1, context.copies, -1, -1, -1, -1)
        padded = torch.cat([previous, by_chunk], dim=4)  # (B, copies, chunks, C, 1 + f, T)
        out = super().forward(padded.flatten(0, 2))[:, :, 1:]
        return rearrange(out, "(b n k) c f t -> b c (n k f) t", n=context.copies, k=by_chunk.shape[2])


class LongSanaRotaryPosEmbed(WanRotaryPosEmbed):
    """diffusers' SANA RoPE; inside a cached or reference call the frame positions come from the context."""

    def __init__(self, attention_head_dim: int, patch_size, max_seq_len: int, slot: CallContextSlot) -> None:
        super().__init__(attention_head_dim, patch_size, max_seq_len)
        self.slot = slot

    def forward(self, hidden_states: torch.Tensor):
        context = self.slot.context
        if context is None or context.frame_positions is None:
            return super().forward(hidden_states)
        _, _, _, height, width = hidden_states.shape
        grid_h, grid_w = height // self.patch_size[1], width // self.patch_size[2]
        split = [self.t_dim, self.h_dim, self.w_dim]
        tables = []
        for table in (self.freqs_cos, self.freqs_sin):
            t_table, h_table, w_table = table.split(split, dim=1)
            frames = t_table[context.frame_positions]  # (F, t_dim)
            num_frames = frames.shape[0]
            parts = (
                frames[:, None, None].expand(-1, grid_h, grid_w, -1),
                h_table[:grid_h][None, :, None].expand(num_frames, -1, grid_w, -1),
                w_table[:grid_w][None, None, :].expand(num_frames, grid_h, -1, -1),
            )
            tables.append(torch.cat(parts, dim=-1).reshape(1, num_frames * grid_h * grid_w, 1, -1))
        return tables[0], tables[1]


def per_token_timestep(timestep: torch.Tensor, batch_size: int, frames: int, tokens_per_frame: int) -> torch.Tensor:
    """`timestep` in a form diffusers' SANA-Video embeds: one entry per sample or one per token.

    Those forms (`batch` or `batch x tokens` entries, any shape) pass unchanged, so without a cache the model
    stays diffusers'; `(batch, frames)`, a noise level per latent frame, becomes `(batch, tokens)`.
    """
    tokens = frames * tokens_per_frame
    if timestep.numel() in (batch_size, batch_size * tokens):
        return timestep
    if timestep.shape == (batch_size, frames):
        return timestep.repeat_interleave(tokens_per_frame, dim=1)
    raise ValueError(
        f"`timestep` of shape {tuple(timestep.shape)} fits neither diffusers' forms ({batch_size} or "
        f"{batch_size} x {tokens} entries: one per sample or per token) nor one per latent frame "
        f"{(batch_size, frames)}."
    )


# ----------------------------------------------------------------------------------------- model
class LongSanaTransformer3DModel(SanaVideoTransformer3DModel):
    """`SanaVideoTransformer3DModel` that generates chunk by chunk from a constant-size state cache.

    The config (and so every checkpoint) is exactly SANA-Video's. Chunk geometry is a generation
    setting passed to `make_cache` and `forward` as a `ChunkLayout` (see `sana_layout`).
    """

    _skip_keys = ["kv_cache"]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._call_slot = CallContextSlot()
        config = self.config
        self.rope = LongSanaRotaryPosEmbed(
            config.attention_head_dim, config.patch_size, config.rope_max_seq_len, self._call_slot
        )
        for index, block in enumerate(self.transformer_blocks):
            block.attn1.set_processor(LongSanaLinearAttnProcessor(index, self._call_slot))
            if block.attn2 is not None:
                block.attn2.set_processor(LongSanaCrossAttnProcessor(index, self._call_slot))
            block.ff.conv_temp = BlockCausalTemporalConv.taking_over(block.ff.conv_temp, index, self._call_slot)

    # The config is exactly SANA-Video's: ConfigMixin reads the accepted keys from this signature.
    __init__.__signature__ = inspect.signature(SanaVideoTransformer3DModel.__init__)

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=None) -> None:
        """Checkpointed blocks are recomputed during backward, after `forward` has unbound its context:
        each checkpointed call re-binds the context it ran with, so the recomputation is the same function."""
        checkpoint = gradient_checkpointing_func or torch.utils.checkpoint.checkpoint
        slot = self._call_slot

        def with_call_context(block, *args):
            return checkpoint(functools.partial(bind_call_context, slot, slot.context, block), *args)

        super()._set_gradient_checkpointing(enable, with_call_context)

    # ---------------------------------------------------------------------------------------- cache
    def tokens_per_frame(self, latent_height: int, latent_width: int) -> int:
        """Tokens of one latent frame of `latent_height x latent_width`."""
        return tokens_per_latent_frame(self.config.patch_size, latent_height, latent_width)

    def make_cache(
        self, layout: ChunkLayout, batch_size: int | None = None, dtype=None, device=None
    ) -> RollingKVCache:
        """Per block: a linear-attention state, a cross-attention layer, and `slots["conv_state"]`.

        Allocated now if `batch_size` is given (what `torch.compile` wants), else at the first chunk; on `device`,
        or without it on each block's own device (a model split by `device_map`).
        """
        window = context_chunks(layout)
        blocks = self.transformer_blocks
        cache = RollingKVCache(
            [RewindableLinearAttentionLayer(window) for _ in blocks],
            [CrossAttentionLayer() if block.attn2 is not None else None for block in blocks],
            slots={"conv_state": [ConvStateLayer(layout.tokens_per_frame) for _ in blocks]},
        )
        if batch_size is not None:
            cache.early_initialization(
                batch_size,
                self.config.num_attention_heads,
                self.config.attention_head_dim,
                dtype or self.dtype,
                device or block_devices(blocks),  # no `device`: where each block runs (`device_map` splits)
            )
        return cache

    @torch.no_grad()
    def prepare_conditioning(self, kv_cache: RollingKVCache, encoder_hidden_states: torch.Tensor) -> None:
        """Compute every block's text K/V into the cache now (a new prompt): cached steps only read them.

        Calling it is the explicit "the prompt changed" signal; a compiled step then never sees an empty
        cross-attention layer (one graph). Same maths as diffusers' forward: caption projection + RMS norm.
        """
        batch_size = encoder_hidden_states.shape[0]
        text_states = self.caption_projection(encoder_hidden_states)
        text_states = self.caption_norm(text_states.view(batch_size, -1, text_states.shape[-1]))
        for block, layer in zip(self.transformer_blocks, kv_cache.cross):
            if layer is not None:
                layer.reset()
                layer.update(*text_key_value(block.attn2, text_states))

    def committed_frames(self, kv_cache: RollingKVCache, layout: ChunkLayout | None = None) -> int:
        """Latent frames committed to `kv_cache` so far (the stream position, a host counter)."""
        return kv_cache.slots["conv_state"][0].committed_frames

    def frame_budget(self, layout: ChunkLayout | None = None) -> int | None:
        """Absolute frame positions end at the RoPE table; `position_mode="relative"` re-bases them, no limit."""
        relative = layout is not None and layout.position_mode == "relative"
        return None if relative else self.config.rope_max_seq_len

    def check_frame_budget(self, num_latent_frames: int, layout: ChunkLayout | None = None) -> None:
        """Refuse a video whose absolute frame positions would leave the RoPE table (never silently wrong).

        `position_mode="relative"` re-bases the positions in place (`rebase_positions`), so it has no budget.
        """
        limit = self.frame_budget(layout)
        if limit is not None and num_latent_frames > limit:
            raise ValueError(  # names the arguments, so the command line and the demo show their flags and fields
                f"`num_frames` is {num_latent_frames} latent frames, more than the RoPE table's {limit} positions "
                "(`rope_max_seq_len`) with `position_mode`='absolute': make fewer frames, or give "
                "`position_mode`='relative' (positions re-based in place: no length limit)."
            )

    @torch.no_grad()
    def rebase_positions(self, kv_cache: RollingKVCache, num_frames: int) -> None:
        """Move every committed frame `num_frames` positions back, so a stream can run past the RoPE table.

        RoPE enters only the numerator `q_rot . k_rot`, which depends on the positions' difference; so
        shifting all positions by the same amount changes nothing but the table index. The committed
        states hold `v k_rot^T`: rotating their key axis by `-num_frames` frames re-indexes them exactly
        (up to rounding) in place, and the next chunk starts `num_frames` earlier. Host-side, between
        chunks; no recompile (buffers change in place, the counter is a device tensor).
        """
        conv_layers = kv_cache.slots["conv_state"]
        committed = self.committed_frames(kv_cache)
        check_int("num_frames", num_frames, 1, committed, hint="the committed frames")
        split = [self.rope.t_dim, self.rope.h_dim, self.rope.w_dim]
        t_cos, h_cos, w_cos = self.rope.freqs_cos.split(split, dim=1)
        t_sin, h_sin, w_sin = self.rope.freqs_sin.split(split, dim=1)
        step = min(num_frames, t_cos.shape[0] - 1)  # rotate by table entries: several steps past the table size
        remaining = num_frames
        while remaining:
            shift = min(step, remaining)
            cos = torch.cat([t_cos[shift], h_cos[0], w_cos[0]]).float()  # rotation by -shift frames
            sin = torch.cat([-t_sin[shift], h_sin[0], w_sin[0]]).float()
            rotate = functools.partial(_rotate_to_state, cos=cos, sin=sin)
            for layer in kv_cache.layers:  # (..., D_v, D_k) states: rotate every row along the key axis
                layer.map_vk_states(rotate)
            remaining -= shift
        for layer in conv_layers:
            layer.shift_frames(-num_frames)

    # ---------------------------------------------------------------------------------------- forward
    def forward(  # noqa: PLR0913 (diffusers' SANA-Video forward, plus the cache's arguments)
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        guidance: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        attention_kwargs: dict[str, Any] | None = None,
        controlnet_block_samples: tuple[torch.Tensor] | None = None,
        return_dict: bool = True,
        kv_cache: RollingKVCache | None = None,
        layout: ChunkLayout | None = None,
        teacher_forcing: bool = False,
    ) -> tuple[torch.Tensor, ...] | Transformer2DModelOutput:
        """Denoise `hidden_states` `(batch, channels, frames, height, width)`.

        - no `kv_cache`, no `layout`: diffusers' SANA-Video, unchanged;
        - `kv_cache` and `layout`: one chunk at the cache's next frames; its state is written as pending
          (call `kv_cache.commit()` after the clean t = 0 pass);
        - `layout` only: the whole-sequence block-causal reference, starting at frame 0; with
          `teacher_forcing` the frames are `[clean; noisy]` halves (noisy chunk i sees clean chunks < i).
        `timestep`: every form diffusers takes (`batch` or `batch x tokens` entries: `(batch,)`, `(batch, 1)`,
        `(batch, tokens)`, ...), or `(batch, frames)` for a noise level per latent frame.
        """
        if kv_cache is not None and layout is None:
            raise ValueError("`layout` (a ChunkLayout, see `sana_layout`) is required together with `kv_cache`.")
        if teacher_forcing and (layout is None or kv_cache is not None):
            raise ValueError("`teacher_forcing=True` needs `layout` and no `kv_cache` (it is the training reference).")
        batch_size, _, num_frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.config.patch_size
        grid_frames, grid_h, grid_w = num_frames // p_t, height // p_h, width // p_w
        timestep = per_token_timestep(timestep, batch_size, grid_frames, grid_h * grid_w)
        context = None
        if layout is not None:
            if grid_h * grid_w != layout.tokens_per_frame:
                raise ValueError(
                    f"`layout.tokens_per_frame`={layout.tokens_per_frame} does not match the input's "
                    f"{grid_h}x{grid_w} tokens per frame."
                )
            window = context_chunks(layout)
            if kv_cache is not None:
                if grid_frames > layout.chunk_frames:
                    raise ValueError(f"A chunk of {grid_frames} frames exceeds `chunk_frames`={layout.chunk_frames}.")
                conv_layers = kv_cache.slots.get("conv_state")
                if conv_layers is None or len(kv_cache) != len(self.transformer_blocks):
                    raise ValueError("`kv_cache` was not built by this model's `make_cache`.")
                if not torch.compiler.is_compiling():  # host-side check; a compiled step relies on the pipeline's
                    self.check_frame_budget(self.committed_frames(kv_cache, layout) + grid_frames)
                start = conv_layers[0].frame_count  # device tensor: no host sync, no recompile per chunk
                offsets = torch.arange(grid_frames, device=hidden_states.device)
                positions = offsets if start is None else start + offsets
                context = SanaCallContext(
                    self_layers=kv_cache.layers,
                    cross_layers=kv_cache.cross,
                    conv_layers=conv_layers,
                    frame_positions=positions,
                )
            else:
                copies = 2 if teacher_forcing else 1
                if grid_frames % (copies * layout.chunk_frames):
                    raise ValueError(
                        f"The reference needs whole chunks: {grid_frames} frames is not a multiple of "
                        f"{copies} x `chunk_frames`={layout.chunk_frames}."
                    )
                sequence_frames = grid_frames // copies
                self.check_frame_budget(sequence_frames)
                positions = torch.arange(sequence_frames, device=hidden_states.device).repeat(copies)
                context = SanaCallContext(
                    frame_positions=positions, chunk_frames=layout.chunk_frames, copies=copies, context_chunks=window
                )
        return bind_call_context(
            self._call_slot,
            context,
            super().forward,
            hidden_states,
            encoder_hidden_states,
            timestep,
            guidance=guidance,
            encoder_attention_mask=encoder_attention_mask,
            attention_mask=attention_mask,
            attention_kwargs=attention_kwargs,
            controlnet_block_samples=controlnet_block_samples,
            return_dict=return_dict,
        )

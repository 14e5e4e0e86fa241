"""Causal Wan 2.1 video transformer with a rolling KV cache (Krea Realtime, Self-Forcing, LongLive).

`KreaRealtimeTransformer3DModel` subclasses diffusers' `WanTransformer3DModel`, so every
diffusers-format Wan 2.1 checkpoint loads unchanged. It adds:

- causal attention processors that read and write a `RollingKVCache` (one `SlidingWindowLayer` for
  self-attention and one `CrossAttentionLayer` for the text per block), built by `make_cache`;
- two position modes: `"absolute"` stores keys after RoPE at absolute frame positions (what
  Self-Forcing / Krea checkpoints were trained with; bounded by the 1024-entry RoPE table) and
  `"relative"` stores keys before RoPE and rotates them at read time with positions re-indexed inside
  sink + window (unbounded length);
- Krea's KV-cache attention bias: `log(bias)` added to the scores of every cached (past) token;
- a dense reference path over a whole sequence with the block-causal, sink + window mask, used by the
  equivalence tests and by training.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.modeling_utils import ModelMixin  # noqa: F401  diffusers' pipeline loader looks it up here
from diffusers.models.transformers.transformer_wan import WanAttention, WanTransformer3DModel

from ..caching import CrossAttentionLayer, RollingKVCache, SlidingWindowLayer

POSITION_MODES = ("absolute", "relative")


# ----------------------------------------------------------------------------------------- chunk geometry
@dataclass(frozen=True)
class ChunkLayout:
    """Cache geometry in latent frames, and its token equivalents.

    The window counts the pending chunk (Self-Forcing's `local_attn_size`) and excludes the sink, so a
    chunk attends to `sink_frames + window_frames` frames at most: the sink, the most recent
    `window_frames - chunk_frames` committed frames, and itself.
    """

    tokens_per_frame: int
    chunk_frames: int = 3
    sink_frames: int = 3
    window_frames: int = 9
    position_mode: str = "absolute"

    def __post_init__(self) -> None:
        for name in ("tokens_per_frame", "chunk_frames", "window_frames"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
        if isinstance(self.sink_frames, bool) or not isinstance(self.sink_frames, int) or self.sink_frames < 0:
            raise ValueError(f"`sink_frames` must be an int >= 0, got {self.sink_frames!r}.")
        if self.chunk_frames >= self.window_frames:
            raise ValueError(
                f"`window_frames`={self.window_frames} must be larger than `chunk_frames`={self.chunk_frames}: "
                "the window counts the chunk being generated, and must leave room for recent context."
            )
        if self.position_mode not in POSITION_MODES:
            raise ValueError(f"`position_mode` must be one of {POSITION_MODES}, got {self.position_mode!r}.")

    @property
    def context_frames(self) -> int:
        """Frames attended to at most (sink + window)."""
        return self.sink_frames + self.window_frames

    def visible_frames(self, chunk_start: int) -> list[int]:
        """Frames a chunk starting at `chunk_start` attends to, oldest first (sink, window, itself)."""
        end = chunk_start + self.chunk_frames
        first_recent = max(0, chunk_start - (self.window_frames - self.chunk_frames))
        return sorted({*range(min(self.sink_frames, end)), *range(first_recent, end)})

    def rewindable_frames(self, committed_frames: int) -> int:
        """Committed frames the next chunk sees after the sink: what a re-cache rewrites (never the sink)."""
        next_chunk = set(self.visible_frames(committed_frames))
        return sum(1 for frame in range(self.sink_frames, committed_frames) if frame in next_chunk)

    def frame_position(self, frame: int | torch.Tensor, chunk_start: int) -> int | torch.Tensor:
        """RoPE frame index of `frame` as seen from the chunk starting at `chunk_start`."""
        if self.position_mode == "absolute":
            return frame
        window_start = max(self.sink_frames, chunk_start - (self.window_frames - self.chunk_frames))
        shifted = frame - window_start + self.sink_frames
        if isinstance(frame, torch.Tensor):
            return torch.where(frame < self.sink_frames, frame, shifted)
        return frame if frame < self.sink_frames else shifted


def block_causal_frame_mask(num_frames: int, layout: ChunkLayout) -> torch.Tensor:
    """`(frames, frames)` bool mask, True = attend: each chunk sees its sink, its recent window and itself."""
    frame_visible = torch.zeros(num_frames, num_frames, dtype=torch.bool)
    for chunk_start in range(0, num_frames, layout.chunk_frames):
        chunk_end = min(chunk_start + layout.chunk_frames, num_frames)
        visible = [f for f in layout.visible_frames(chunk_start) if f < num_frames]
        frame_visible[chunk_start:chunk_end, visible] = True
    return frame_visible


def teacher_forcing_frame_mask(num_frames: int, layout: ChunkLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Frame indices `(2F,)` and mask `(2F, 2F)` for a `[clean frames; noisy frames]` training sequence.

    Clean frames attend block-causally among themselves (they play the cached context). Each noisy
    chunk attends to the clean frames its clean twin would see before it (sink + window) and to itself,
    exactly what a chunk sees at generation time with a clean cache.
    """
    if num_frames % layout.chunk_frames:
        raise ValueError(f"`num_frames`={num_frames} must be a multiple of `chunk_frames`={layout.chunk_frames}.")
    clean = block_causal_frame_mask(num_frames, layout)
    mask = torch.zeros(2 * num_frames, 2 * num_frames, dtype=torch.bool)
    mask[:num_frames, :num_frames] = clean
    for chunk_start in range(0, num_frames, layout.chunk_frames):
        rows = slice(num_frames + chunk_start, num_frames + chunk_start + layout.chunk_frames)
        context = [f for f in layout.visible_frames(chunk_start) if f < chunk_start]
        mask[rows, context] = True
        mask[rows, rows] = True
    return torch.arange(num_frames).repeat(2), mask


# ----------------------------------------------------------------------------------------- rotary embedding
def apply_rotary(hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of `(batch, tokens, heads, head_dim)` by `cos`/`sin` `(1, tokens, 1, head_dim)`."""
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return rotated.type_as(hidden_states)


# ----------------------------------------------------------------------------------------- per-call state
@dataclass
class CausalCallState:
    """What the attention processors of one forward need; set by the model for the duration of a call."""

    kv_cache: RollingKVCache | None = None
    layout: ChunkLayout | None = None
    conditioning: torch.Tensor | None = None  # the raw text embeddings the cross-attention K/V belong to
    dense_mask: torch.Tensor | None = None  # (tokens, tokens) bool for the dense reference path
    frame_ids: torch.Tensor | None = None  # (tokens,) latent frame of every token in the dense path
    rope_tables: tuple[torch.Tensor, ...] = field(default_factory=tuple)  # cos/sin tables split (t, h, w)
    grid: tuple[int, int] = (1, 1)  # post-patch (height, width)
    attention_bias: float = 1.0  # Krea's KV-cache bias; 1.0 = off


def rope_for_tokens(state: CausalCallState, frames: torch.Tensor, within_frame: torch.Tensor):
    """`(cos, sin)` `(1, tokens, 1, head_dim)` for tokens at `frames` and `within_frame` (row-major) positions."""
    cos_t, cos_h, cos_w, sin_t, sin_h, sin_w = state.rope_tables
    width = state.grid[1]
    rows, cols = within_frame // width, within_frame % width
    frames = frames.clamp(min=0)  # empty cache slots carry -1; they are masked out anyway
    cos = torch.cat([cos_t[frames], cos_h[rows], cos_w[cols]], dim=-1)[None, :, None, :]
    sin = torch.cat([sin_t[frames], sin_h[rows], sin_w[cols]], dim=-1)[None, :, None, :]
    return cos, sin


# ----------------------------------------------------------------------------------------- processors
class KreaRealtimeSelfAttnProcessor:
    """Self-attention of block `index`: plain (Wan), dense block-causal (reference), or through the cache."""

    def __init__(self, index: int, state: CausalCallState) -> None:
        self.index = index
        self.state = state

    def __call__(
        self, attn: WanAttention, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None
    ):
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))  # (B, L, H, D)
        key = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        state = self.state
        if state.kv_cache is not None:
            out = self._cached(query, key, value, state.kv_cache[self.index])
        elif state.dense_mask is not None:
            out = self._dense(query, key, value)
        else:
            query, key = apply_rotary(query, *rotary_emb), apply_rotary(key, *rotary_emb)
            out = _sdpa(query, key, value)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))

    def _rope(self, positions: torch.Tensor):
        tokens_per_frame = self.state.layout.tokens_per_frame
        return rope_for_tokens(self.state, positions // tokens_per_frame, positions % tokens_per_frame)

    def _cached(self, query, key, value, layer: SlidingWindowLayer) -> torch.Tensor:
        num_tokens = query.shape[1]
        if self.state.layout.position_mode == "absolute":
            rope = self._rope(layer.pending_positions(num_tokens, device=query.device))
            query, key = apply_rotary(query, *rope), apply_rotary(key, *rope)
            keys, values = layer.update(key, value)  # stored after RoPE
        else:
            keys, values = layer.update(key, value)  # stored before RoPE, rotated at read time
            query = apply_rotary(query, *self._rope(layer.pending_positions(num_tokens, reindexed=True)))
            keys = apply_rotary(keys, *self._rope(layer.key_positions(reindexed=True)))
        mask = layer.attention_mask
        if self.state.attention_bias != 1.0:
            past = mask & ~layer.pending_slot_mask()
            mask = _bias_mask(mask, past, self.state.attention_bias, query.dtype)
        return _sdpa(query, keys, values, mask[None, None, None, :])

    def _dense(self, query, key, value) -> torch.Tensor:
        """Whole sequence, one query chunk at a time so each chunk rotates keys by its own positions."""
        state, layout = self.state, self.state.layout
        frame_ids = state.frame_ids
        within = torch.arange(query.shape[1], device=query.device) % layout.tokens_per_frame
        outputs = []
        tokens_per_chunk = layout.chunk_frames * layout.tokens_per_frame
        for start in range(0, query.shape[1], tokens_per_chunk):
            rows = slice(start, start + tokens_per_chunk)
            chunk_start = int(frame_ids[start])
            positions = layout.frame_position(frame_ids, chunk_start)
            cos, sin = rope_for_tokens(state, positions, within)
            chunk_query = apply_rotary(query[:, rows], cos[:, rows], sin[:, rows])
            rotated_keys = apply_rotary(key, cos, sin)
            mask = state.dense_mask[rows]
            if state.attention_bias != 1.0:
                past = mask & (frame_ids < chunk_start)[None, :]
                mask = _bias_mask(mask, past, state.attention_bias, query.dtype)
            outputs.append(_sdpa(chunk_query, rotated_keys, value, mask[None, None]))
        return torch.cat(outputs, dim=1)


class KreaRealtimeCrossAttnProcessor:
    """Text cross-attention whose K/V are computed once per prompt and kept in the cache."""

    def __init__(self, index: int, state: CausalCallState) -> None:
        self.index = index
        self.state = state

    def __call__(
        self, attn: WanAttention, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None
    ):
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        cache = self.state.kv_cache
        layer = cache.cross[self.index] if cache is not None else None
        if layer is not None and layer.is_cached_for(self.state.conditioning):
            key, value = layer.get()
        else:
            key = attn.norm_k(attn.to_k(encoder_hidden_states)).unflatten(2, (attn.heads, -1))
            value = attn.to_v(encoder_hidden_states).unflatten(2, (attn.heads, -1))
            if layer is not None:
                key, value = layer.update(key, value, conditioning=self.state.conditioning)
        out = _sdpa(query, key, value).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def _sdpa(query, key, value, mask: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA on `(batch, tokens, heads, head_dim)` tensors."""
    out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), mask)
    return out.transpose(1, 2)


def _bias_mask(mask: torch.Tensor, past: torch.Tensor, bias: float, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask: `-inf` where not attended, `log(bias)` on past tokens, 0 on the current chunk."""
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    additive = additive.masked_fill(past, math.log(bias))
    return additive.masked_fill(~mask, float("-inf"))


# ----------------------------------------------------------------------------------------- model
class KreaRealtimeTransformer3DModel(WanTransformer3DModel):
    """`WanTransformer3DModel` that generates chunk by chunk from a rolling KV cache.

    The config (and so every checkpoint) is exactly Wan 2.1's. Cache geometry and position mode are
    generation settings, passed to `make_cache`.
    """

    _skip_keys = ["kv_cache"]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._call_state = CausalCallState()
        for index, block in enumerate(self.blocks):
            block.attn1.set_processor(KreaRealtimeSelfAttnProcessor(index, self._call_state))
            block.attn2.set_processor(KreaRealtimeCrossAttnProcessor(index, self._call_state))

    # The config is exactly Wan's: ConfigMixin reads the accepted keys from this signature.
    __init__.__signature__ = inspect.signature(WanTransformer3DModel.__init__)

    # ---------------------------------------------------------------------------------------- cache
    def tokens_per_frame(self, latent_height: int, latent_width: int) -> int:
        """Tokens of one latent frame of `latent_height x latent_width`."""
        _, p_h, p_w = self.config.patch_size
        if latent_height % p_h or latent_width % p_w:
            raise ValueError(
                f"Latent size {latent_height}x{latent_width} must be divisible by the patch size {p_h}x{p_w}."
            )
        return (latent_height // p_h) * (latent_width // p_w)

    def make_cache(
        self, layout: ChunkLayout, batch_size: int | None = None, dtype=None, device=None
    ) -> RollingKVCache:
        """One `SlidingWindowLayer` + `CrossAttentionLayer` per block; allocated now if `batch_size` is given."""
        tokens = layout.tokens_per_frame
        layers = [
            SlidingWindowLayer(
                layout.sink_frames * tokens, layout.window_frames * tokens, layout.chunk_frames * tokens
            )
            for _ in self.blocks
        ]
        cache = RollingKVCache(layers, [CrossAttentionLayer() for _ in self.blocks])
        if batch_size is not None:
            heads = self.config.num_attention_heads
            cache.early_initialization(
                batch_size, heads, self.config.attention_head_dim, dtype or self.dtype, device or self.device
            )
        return cache

    def check_frame_budget(self, num_latent_frames: int, layout: ChunkLayout) -> None:
        """Refuse a video whose absolute positions would leave the RoPE table (never silently wrong)."""
        limit = self.config.rope_max_seq_len
        if layout.position_mode == "absolute" and num_latent_frames > limit:
            raise ValueError(
                f"{num_latent_frames} latent frames exceed the RoPE table of {limit} positions in "
                "`position_mode='absolute'`; use position_mode='relative' for longer videos."
            )

    # ---------------------------------------------------------------------------------------- forward
    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_image: torch.Tensor | None = None,
        return_dict: bool = True,
        attention_kwargs: dict[str, Any] | None = None,
        kv_cache: RollingKVCache | None = None,
        layout: ChunkLayout | None = None,
        frame_indices: torch.Tensor | None = None,
        frame_mask: torch.Tensor | None = None,
        attention_bias: float = 1.0,
    ) -> torch.Tensor | Transformer2DModelOutput:
        """Denoise `hidden_states` `(batch, channels, frames, height, width)`.

        - no `kv_cache`, no `layout`: plain Wan 2.1 (full attention over the given frames);
        - `layout` without `kv_cache`: the dense reference, the whole sequence under the block-causal,
          sink + window mask, starting at frame 0; `timestep` may be
          `(batch, frames)` so context chunks run at t = 0 and the current chunk noised;
          `frame_indices` `(frames,)` and `frame_mask` `(frames, frames)` replace the default
          positions and mask (teacher forcing: see `teacher_forcing_frame_mask`);
        - `kv_cache` and `layout`: one chunk; its K/V are written as pending into the cache (call
          `kv_cache.commit()` after the clean context pass).
        """
        if kv_cache is not None and layout is None:
            raise ValueError("`layout` (a ChunkLayout) is required together with `kv_cache`.")
        if encoder_hidden_states_image is not None:
            raise ValueError("Image conditioning (`encoder_hidden_states_image`) is not supported by this model.")
        batch_size, _, num_frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.config.patch_size
        grid_frames, grid_h, grid_w = num_frames // p_t, height // p_h, width // p_w
        state = self._call_state
        if layout is not None:
            if grid_h * grid_w != layout.tokens_per_frame:
                raise ValueError(
                    f"`layout.tokens_per_frame`={layout.tokens_per_frame} does not match the input's "
                    f"{grid_h}x{grid_w} tokens per frame."
                )
            if kv_cache is not None and grid_frames > layout.chunk_frames:
                raise ValueError(f"A chunk of {grid_frames} frames exceeds `chunk_frames`={layout.chunk_frames}.")
            if kv_cache is not None and layout.position_mode == "absolute":
                end_frame = kv_cache[0]._committed_count // layout.tokens_per_frame + grid_frames
                self.check_frame_budget(end_frame, layout)

        # 1. Patch embedding and positions
        rotary_emb = self.rope(hidden_states)
        hidden_states = self.patch_embedding(hidden_states).flatten(2).transpose(1, 2).contiguous()  # (B, L, C)
        split = [self.rope.t_dim, self.rope.h_dim, self.rope.w_dim]
        state.rope_tables = (*self.rope.freqs_cos.split(split, dim=1), *self.rope.freqs_sin.split(split, dim=1))
        state.grid = (grid_h, grid_w)
        state.layout, state.kv_cache, state.attention_bias = layout, kv_cache, attention_bias
        state.conditioning = encoder_hidden_states
        if layout is not None and kv_cache is None:
            if frame_mask is None:
                frame_mask = block_causal_frame_mask(grid_frames, layout)
            if frame_indices is None:
                frame_indices = torch.arange(grid_frames)
            if frame_mask.shape != (grid_frames, grid_frames) or frame_indices.shape != (grid_frames,):
                raise ValueError(
                    f"`frame_mask` must be ({grid_frames}, {grid_frames}) and `frame_indices` ({grid_frames},), "
                    f"got {tuple(frame_mask.shape)} and {tuple(frame_indices.shape)}."
                )
            tokens = grid_h * grid_w
            device = hidden_states.device
            state.dense_mask = frame_mask.to(device).repeat_interleave(tokens, 0).repeat_interleave(tokens, 1)
            state.frame_ids = frame_indices.to(device).repeat_interleave(tokens)

        # 2. Time and text embeddings; `(batch, frames)` timesteps become per-token
        if timestep.ndim == 2:
            timestep = timestep.repeat_interleave(grid_h * grid_w, dim=1)
            token_count = timestep.shape[1]
            timestep = timestep.flatten()
        else:
            token_count = None
        temb, timestep_proj, text_states, _ = self.condition_embedder(
            timestep, encoder_hidden_states, None, timestep_seq_len=token_count
        )
        timestep_proj = timestep_proj.unflatten(2 if token_count else 1, (6, -1))

        # 3. Blocks
        try:
            for block in self.blocks:
                if torch.is_grad_enabled() and self.gradient_checkpointing:
                    hidden_states = self._gradient_checkpointing_func(
                        block, hidden_states, text_states, timestep_proj, rotary_emb
                    )
                else:
                    hidden_states = block(hidden_states, text_states, timestep_proj, rotary_emb)
        finally:
            state.kv_cache = state.conditioning = state.dense_mask = state.frame_ids = None
            state.layout = None

        # 4. Output norm, projection and unpatchify
        if temb.ndim == 3:
            shift, scale = (self.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2)
            shift, scale = shift.squeeze(2), scale.squeeze(2)
        else:
            shift, scale = (self.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        hidden_states = (self.norm_out(hidden_states.float()) * (1 + scale) + shift).type_as(hidden_states)
        hidden_states = self.proj_out(hidden_states)
        hidden_states = hidden_states.reshape(batch_size, grid_frames, grid_h, grid_w, p_t, p_h, p_w, -1)
        output = hidden_states.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)
        if not return_dict:
            return (output,)
        return Transformer2DModelOutput(sample=output)

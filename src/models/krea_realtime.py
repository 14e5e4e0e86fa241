"""Causal Wan 2.1 video transformer with a rolling KV cache (Krea Realtime, Self-Forcing, LongLive).

`KreaRealtimeTransformer3DModel` subclasses diffusers' `WanTransformer3DModel` and runs its forward
and blocks unchanged (LoRA scale, attention backends, gradient checkpointing keep working). Only
four pieces differ:

- the rotary module: inside a cached or dense call it returns a per-call `CausalAttentionInputs`
  (cache, layout, positions, RoPE tables, masks, computed once per forward) instead of the plain
  cos/sin, and diffusers' blocks hand that object to every self-attention processor unchanged;
- the self-attention processor: plain Wan, the dense block-causal reference, or one chunk through
  its `SlidingWindowLayer` (positions `"absolute"`: keys stored after RoPE; `"relative"`: keys stored
  before RoPE and rotated at read time with positions re-indexed inside sink + window);
- the cross-attention processor: the text K/V come from the block's `CrossAttentionLayer`, filled once
  per prompt (`prepare_conditioning`, or lazily at the first step);
- the text projection (`CachedTextProjection`, same weights and keys): skipped in a cached step whose
  every block already holds its text K/V, since nothing reads the projected text then.

Per-call state is never stored on the model: the call's inputs are bound to a per-thread
`CallContextSlot` for the duration of one forward, so one model serves any number of concurrent
streams, each with its own cache, and a cached step compiles with `fullgraph=True` into one graph
while the window fills and one once it is full (then attention runs without a mask).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import PixArtAlphaTextProjection
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.modeling_utils import ModelMixin  # noqa: F401  diffusers' pipeline loader looks it up here
from diffusers.models.transformers.transformer_wan import (
    WanAttention,
    WanAttnProcessor,
    WanRotaryPosEmbed,
    WanTransformer3DModel,
)

from ..caching import CrossAttentionLayer, RollingKVCache, SlidingWindowLayer
from ..caching.adaptive_sink import AdaptiveSinkLayer, AdaptiveSinkPolicy
from ..caching.layout import POSITION_MODES, ChunkLayout
from .attention_backends import attention_backend_for
from .call_context import CallContextSlot, bind_call_context
from .patch_grid import tokens_per_latent_frame
from .placement import block_devices
from .weights import StrictWeightsMixin

__all__ = [
    "POSITION_MODES",
    "CausalAttentionInputs",
    "ChunkLayout",
    "KreaRealtimeTransformer3DModel",
    "block_causal_frame_mask",
    "teacher_forcing_frame_mask",
]


# ----------------------------------------------------------------------------------------- dense masks
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
    """Rotate interleaved pairs of `(batch, tokens, heads, head_dim)` by `cos`/`sin` `(1, tokens, 1, head_dim)`.

    Wan's tables repeat each frequency for both members of a pair, so pair `(x1, x2)` becomes
    `(x1, x2) * cos + (x2, x1) * (-sin, sin)`: the same products and sums as diffusers' Wan rotation
    (bit for bit), in 4 elementwise kernels instead of 8.
    """
    swapped = hidden_states.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (x2, x1) per pair
    sin_pairs = sin.unflatten(-1, (-1, 2))  # the table: small next to the states
    signed_sin = torch.stack((-sin_pairs[..., 0], sin_pairs[..., 1]), dim=-1).flatten(-2)
    return (hidden_states * cos + swapped * signed_sin).type_as(hidden_states)


@dataclass
class RopeTables:
    """Wan's 3-D RoPE tables split into (frames, rows, cols) parts, and the post-patch frame width."""

    cos: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    sin: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    grid_width: int

    def lookup(self, frames: torch.Tensor, within_frame: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(cos, sin)` `(1, tokens, 1, head_dim)` of tokens at `frames` and row-major `within_frame` positions."""
        rows, cols = within_frame // self.grid_width, within_frame % self.grid_width
        frames = frames.clamp(min=0)  # empty cache slots carry -1; they are masked out anyway
        cos = torch.cat([self.cos[0][frames], self.cos[1][rows], self.cos[2][cols]], dim=-1)
        sin = torch.cat([self.sin[0][frames], self.sin[1][rows], self.sin[2][cols]], dim=-1)
        return cos[None, :, None, :], sin[None, :, None, :]

    def for_tokens(self, positions: torch.Tensor, tokens_per_frame: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE of tokens at absolute (or re-indexed) stream `positions`."""
        return self.lookup(positions // tokens_per_frame, positions % tokens_per_frame)


# ----------------------------------------------------------------------------------------- per-call inputs
@dataclass
class DenseChunk:
    """One query chunk of the dense reference: its rows, the RoPE of every key as it sees them, its mask."""

    rows: slice
    cos: torch.Tensor  # (1, tokens, 1, head_dim)
    sin: torch.Tensor
    mask: torch.Tensor  # (chunk_tokens, tokens) bool, or additive float when a bias is set


@dataclass
class CausalAttentionInputs:
    """What the self-attention processors of one forward share; built once by the rotary module.

    Cached calls: `kv_cache` and `layout`; RoPE of the pending queries (and, in "relative" mode, of the
    keys of each distinct window geometry) is computed by the first block that needs it and reused by
    the rest. Dense calls: `dense_chunks`, one entry per query chunk.
    """

    rope: RopeTables
    layout: ChunkLayout
    kv_cache: RollingKVCache | None = None
    conditioning: torch.Tensor | None = None  # the raw text embeddings the cross-attention K/V belong to
    rows: list[CausalAttentionInputs] | None = None  # one per batch row when each row has its own cache
    text_cached: bool = False  # every block holds its text K/V: the text projection is skipped
    attention_bias: float = 1.0
    attention_bias_mode: str = "past"  # "past": every earlier token; "scope": not the first frame (Scope's port)
    dense_chunks: list[DenseChunk] = field(default_factory=list)
    dense_layouts: list[ChunkLayout] | None = None  # per-block layouts of the dense path (None: `layout`)
    block_dense_chunks: dict[int, list[DenseChunk]] = field(default_factory=dict)
    shared_rope: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    shared_masks: dict[tuple, torch.Tensor] = field(default_factory=dict)

    def query_rope(self, layer: SlidingWindowLayer, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE of the chunk being written, shared by every block of the same geometry."""
        reindexed = self.layout.position_mode == "relative"
        geometry = (layer.sink_tokens, layer.window_tokens, layer.cut_position)
        key = ("query", num_tokens, *geometry) if reindexed else ("query", num_tokens)
        if key not in self.shared_rope:
            positions = layer.pending_positions(num_tokens, reindexed=reindexed)
            self.shared_rope[key] = self.rope.for_tokens(positions, self.layout.tokens_per_frame)
        return self.shared_rope[key]

    def key_rope(self, layer: SlidingWindowLayer) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE of every slot re-indexed inside sink + window ("relative" mode), after the layer's update."""
        key = ("keys", layer.sink_tokens, layer.window_tokens, layer.cut_position)
        if key not in self.shared_rope:
            positions = layer.key_positions(reindexed=True)
            self.shared_rope[key] = self.rope.for_tokens(positions, self.layout.tokens_per_frame)
        return self.shared_rope[key]

    def bias_mask(
        self, layer: SlidingWindowLayer, num_tokens: int, visible: slice, dtype: torch.dtype
    ) -> torch.Tensor:
        """The additive attention-bias mask of the `visible` keys, after the layer's update: built once per step
        and shared by every block of the same geometry (their slot maps and counters move together, as for
        `key_rope`)."""
        geometry = (layer.sink_tokens, layer.window_tokens, layer.chunk_tokens)
        key = ("bias", *geometry, num_tokens, visible.stop, self.attention_bias_mode, dtype)
        if key not in self.shared_masks:
            mask = layer.attention_mask
            past = mask & ~layer.pending_slot_mask()
            if self.attention_bias_mode == "scope":  # Scope leaves the first frame unbiased
                past = past & (layer.key_positions() >= self.layout.tokens_per_frame)
            self.shared_masks[key] = _bias_mask(mask, past, self.attention_bias, dtype)[visible]
        return self.shared_masks[key]


ATTENTION_BIAS_MODES = ("past", "scope")


def _holds_text(caches: Sequence[RollingKVCache]) -> bool:
    """Every block of every cache holds its text K/V: a cached step then skips the text projection."""
    return all(layer is not None and layer.is_filled for cache in caches for layer in cache.cross)


def _stacked_rope(
    inputs: CausalAttentionInputs, kind: str, per_row: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' RoPE tables `(1, tokens, 1, head_dim)` stacked to `(rows, tokens, 1, head_dim)`, once per forward and
    table shape (the rows' own memos already hold each table: blocks of one geometry share them)."""
    key = ("rows", kind, *(id(cos) for cos, _ in per_row))
    if key not in inputs.shared_rope:
        inputs.shared_rope[key] = (torch.cat([cos for cos, _ in per_row]), torch.cat([sin for _, sin in per_row]))
    return inputs.shared_rope[key]


class CachedTextProjection(PixArtAlphaTextProjection):
    """Wan's text projection, skipped in a cached step whose every block already holds its text K/V.

    Those blocks read the K/V from the cache and never the projected text, and projecting 512 tokens of
    4096 channels costs 8.9 GFLOP per step: about one Wan-1.3B block on a 120-token chunk. The research
    loops project it every step. Same module, weights and checkpoint keys as diffusers'.
    """

    def __init__(self, *args: Any, call_slot: CallContextSlot, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.call_slot = call_slot

    def forward(self, caption: torch.Tensor) -> torch.Tensor:
        inputs = self.call_slot.context
        if inputs is not None and inputs.text_cached:
            return caption[:, :0]  # no block reads it (each reads its cached K/V); empty, not a wrong value
        return super().forward(caption)


class CausalRotaryPosEmbed(WanRotaryPosEmbed):
    """Wan's rotary module; inside a cached or dense call it hands the call's inputs to the blocks instead."""

    def __init__(self, *args: Any, call_slot: CallContextSlot, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.call_slot = call_slot

    def forward(self, hidden_states: torch.Tensor):
        inputs = self.call_slot.context
        return super().forward(hidden_states) if inputs is None else inputs


# ----------------------------------------------------------------------------------------- processors
class KreaRealtimeSelfAttnProcessor(WanAttnProcessor):
    """Self-attention of block `index`: plain Wan, dense block-causal (reference), or through the cache."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def __call__(
        self, attn: WanAttention, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None
    ):
        if not isinstance(rotary_emb, CausalAttentionInputs):
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        inputs = rotary_emb
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))  # (B, L, H, D)
        key = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        if inputs.rows is not None:
            out = self._cached_rows(query, key, value, inputs)
        elif inputs.kv_cache is not None:
            out = self._cached(query, key, value, inputs.kv_cache[self.index], inputs)
        else:
            out = self._dense(query, key, value, inputs)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))

    def _attend(self, query, key, value, mask: torch.Tensor | None) -> torch.Tensor:
        # a mask-free kernel (flash-attn 2/3) cannot take the filling window's mask: SDPA for that call
        backend = attention_backend_for(self._attention_backend, masked=mask is not None)
        return dispatch_attention_fn(query, key, value, attn_mask=mask, backend=backend)

    def _cached(self, query, key, value, layer: SlidingWindowLayer, inputs: CausalAttentionInputs) -> torch.Tensor:
        num_tokens = query.shape[1]
        absolute = inputs.layout.position_mode == "absolute"
        if absolute:
            rope = inputs.query_rope(layer, num_tokens)
            query, key = apply_rotary(query, *rope), apply_rotary(key, *rope)
        keys, values = layer.update(key, value)  # absolute: stored after RoPE; relative: rotated at read time
        visible = slice(None, layer.visible_prefix(num_tokens))  # window filling (eager): slots 0.., no mask
        keys, values = keys[:, visible], values[:, visible]
        if not absolute:
            query = apply_rotary(query, *inputs.query_rope(layer, num_tokens))
            keys = apply_rotary(keys, *(table[:, visible] for table in inputs.key_rope(layer)))
        if inputs.attention_bias != 1.0:
            mask = inputs.bias_mask(layer, num_tokens, visible, query.dtype)
        elif visible.stop is not None or (num_tokens == layer.chunk_tokens and layer.window_full):
            mask = None  # every key read is visible: no mask, so fused (flash) kernels apply
        else:
            mask = layer.attention_mask
        return self._attend(query, keys, values, None if mask is None else mask[None, None, None, :])

    def _cached_rows(self, query, key, value, inputs: CausalAttentionInputs) -> torch.Tensor:
        """Row `i` `(1, tokens, heads, head_dim)` written to and read from its own cache `inputs.rows[i]` (sessions
        batched by `rolldiff serve`): each row's RoPE positions, slot map and mask are its own, as in its solo
        `_cached`, while the rotation and the attention run once for the batch. While every row's window fills,
        the batch reads slots up to the longest filled prefix, unmasked when the prefixes are equal (as a solo call
        reads its own); otherwise every row reads its whole buffer under its own mask (the same keys, so the same
        result up to float reordering)."""
        rows, num_tokens = inputs.rows, query.shape[1]
        layers = [row.kv_cache[self.index] for row in rows]
        absolute = inputs.layout.position_mode == "absolute"
        pairs = list(zip(rows, layers))
        if absolute:
            cos, sin = _stacked_rope(inputs, "query", [row.query_rope(layer, num_tokens) for row, layer in pairs])
            query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
        written = [layer.update(key[i : i + 1], value[i : i + 1]) for i, layer in enumerate(layers)]
        if len({keys.shape for keys, _ in written}) != 1:  # buffers of other capacities: one attention per row
            return torch.cat([
                self._attend(query[i : i + 1], keys, values, layer.attention_mask[None, None, None, :])
                for i, ((keys, values), layer) in enumerate(zip(written, layers))
            ])  # fmt: skip
        prefixes = [layer.visible_prefix(num_tokens) for layer in layers]
        filling = inputs.attention_bias == 1.0 and None not in prefixes  # every row's keys are slots 0 .. its prefix
        visible = slice(None, max(prefixes)) if filling else slice(None)
        keys = torch.cat([keys[:, visible] for keys, _ in written])
        values = torch.cat([values[:, visible] for _, values in written])
        if not absolute:
            query_rope = _stacked_rope(inputs, "query", [row.query_rope(layer, num_tokens) for row, layer in pairs])
            query = apply_rotary(query, *query_rope)
            key_rope = _stacked_rope(inputs, "keys", [row.key_rope(layer) for row, layer in pairs])
            keys = apply_rotary(keys, *(table[:, visible] for table in key_rope))
        if inputs.attention_bias != 1.0:
            mask = torch.stack([row.bias_mask(layer, num_tokens, slice(None), query.dtype) for row, layer in pairs])
        elif (filling and len(set(prefixes)) == 1) or (
            num_tokens == layers[0].chunk_tokens and all(layer.window_full for layer in layers)
        ):
            mask = None  # every key read is visible to every row: no mask, so fused (flash) kernels apply
        else:  # while filling, a row's mask over the longest prefix is True on its own prefix only
            mask = torch.stack([layer.attention_mask[visible] for layer in layers])
        return self._attend(query, keys, values, None if mask is None else mask[:, None, None, :])

    def _dense(self, query, key, value, inputs: CausalAttentionInputs) -> torch.Tensor:
        """Whole sequence, one query chunk at a time so each chunk rotates keys by its own positions."""
        chunks = inputs.block_dense_chunks.get(self.index, inputs.dense_chunks)
        outputs = []
        for chunk in chunks:
            chunk_query = apply_rotary(query[:, chunk.rows], chunk.cos[:, chunk.rows], chunk.sin[:, chunk.rows])
            rotated_keys = apply_rotary(key, chunk.cos, chunk.sin)
            mask = chunk.mask if chunk.mask.dtype == torch.bool else chunk.mask.to(query.dtype)
            outputs.append(self._attend(chunk_query, rotated_keys, value, mask[None, None]))
        return torch.cat(outputs, dim=1)


class KreaRealtimeCrossAttnProcessor(WanAttnProcessor):
    """Text cross-attention whose K/V are computed once per prompt and kept in the block's cache layer."""

    def __init__(self, index: int, call_slot: CallContextSlot) -> None:
        super().__init__()
        self.index = index
        self.call_slot = call_slot

    def __call__(
        self, attn: WanAttention, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None
    ):
        inputs = self.call_slot.context
        if inputs is not None and inputs.rows is not None:
            return self._rows(attn, hidden_states, encoder_hidden_states, inputs.rows)
        cache = None if inputs is None else inputs.kv_cache
        if cache is None or cache.cross[self.index] is None:
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        key, value = self._text_key_value(attn, cache, encoder_hidden_states, inputs.conditioning)
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        out = dispatch_attention_fn(query, key, value, backend=self._attention_backend)
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3).type_as(query)))

    def _text_key_value(self, attn: WanAttention, cache: RollingKVCache, text_states, conditioning):
        """The block's text K/V from `cache`: kept until the prompt changes (`reset_cross_attention()` /
        `prepare_conditioning`), else computed from `text_states` now and kept."""
        layer = cache.cross[self.index]
        if layer is not None and layer.is_filled:
            return layer.keys, layer.values
        key, value = text_key_value(attn, text_states)
        return (key, value) if layer is None else layer.update(key, value, conditioning=conditioning)

    def _rows(self, attn: WanAttention, hidden_states, encoder_hidden_states, rows: list[CausalAttentionInputs]):
        """Row `i` reads the text K/V of its own cache (filled now if empty, from its row of the text states); one
        attention call for the batch when every row's text has the same length."""
        keys, values = zip(*[
            self._text_key_value(attn, row.kv_cache, encoder_hidden_states[i : i + 1], row.conditioning)
            for i, row in enumerate(rows)
        ])  # fmt: skip
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))  # (B, L, H, D)
        if len({key.shape for key in keys}) == 1:
            out = dispatch_attention_fn(query, torch.cat(keys), torch.cat(values), backend=self._attention_backend)
        else:  # text lengths differ between rows: one call per row
            out = torch.cat([
                dispatch_attention_fn(query[i : i + 1], key, value, backend=self._attention_backend)
                for i, (key, value) in enumerate(zip(keys, values))
            ])  # fmt: skip
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3).type_as(query)))


def text_key_value(attn: WanAttention, text_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-attention K/V `(batch, text_tokens, heads, head_dim)` of the projected text states."""
    key = attn.norm_k(attn.to_k(text_states)).unflatten(2, (attn.heads, -1))
    value = attn.to_v(text_states).unflatten(2, (attn.heads, -1))
    return key, value


def _bias_mask(mask: torch.Tensor, past: torch.Tensor, bias: float, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask: `-inf` where not attended, `log(bias)` on past tokens, 0 on the current chunk."""
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    additive = additive.masked_fill(past, math.log(bias))
    return additive.masked_fill(~mask, float("-inf"))


# ----------------------------------------------------------------------------------------- model
class KreaRealtimeTransformer3DModel(StrictWeightsMixin, WanTransformer3DModel):
    """`WanTransformer3DModel` that generates chunk by chunk from a rolling KV cache.

    The config (and so every checkpoint) is exactly Wan 2.1's. Cache geometry and position mode are
    generation settings, passed to `make_cache` and `forward`. `from_pretrained` of a local folder
    refuses weights that do not match the config (missing, unexpected or mis-shaped keys, by name).
    """

    _skip_keys = ["kv_cache"]
    accepts_row_caches = True  # `kv_cache` may be one cache per batch row (sessions batched by `rolldiff serve`)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._call_slot = CallContextSlot()
        self.rope = CausalRotaryPosEmbed(
            self.config.attention_head_dim,
            self.config.patch_size,
            self.config.rope_max_seq_len,
            call_slot=self._call_slot,
        )
        text = self.condition_embedder.text_embedder
        with torch.device("meta"):  # takes `text`'s weights: no second init, no draw from the random generator
            cached_text = CachedTextProjection(
                text.linear_1.in_features, text.linear_1.out_features, text.linear_2.out_features,
                act_fn="gelu_tanh", call_slot=self._call_slot,
            )  # fmt: skip
        cached_text.load_state_dict(text.state_dict(), assign=True)
        self.condition_embedder.text_embedder = cached_text
        for index, block in enumerate(self.blocks):
            block.attn1.set_processor(KreaRealtimeSelfAttnProcessor(index))
            block.attn2.set_processor(KreaRealtimeCrossAttnProcessor(index, self._call_slot))

    # The config is exactly Wan's: ConfigMixin reads the accepted keys from this signature.
    __init__.__signature__ = inspect.signature(WanTransformer3DModel.__init__)

    # ---------------------------------------------------------------------------------------- cache
    def tokens_per_frame(self, latent_height: int, latent_width: int) -> int:
        """Tokens of one latent frame of `latent_height x latent_width`."""
        return tokens_per_latent_frame(self.config.patch_size, latent_height, latent_width)

    def block_layouts(self, layout: ChunkLayout, window_frames_per_block: Sequence[int] | None) -> list[ChunkLayout]:
        """One layout per block: `layout` everywhere, or with a window of its own per block (local/global mixes)."""
        if window_frames_per_block is None:
            return [layout] * len(self.blocks)
        windows = list(window_frames_per_block)
        if len(windows) != len(self.blocks):
            raise ValueError(
                f"`window_frames_per_block` has {len(windows)} entries, expected one per block ({len(self.blocks)})."
            )
        layouts = []
        for index, window in enumerate(windows):
            try:
                layouts.append(dataclasses.replace(layout, window_frames=window))
            except (TypeError, ValueError) as error:  # ChunkLayout's message names `window_frames`
                raise ValueError(
                    f"`window_frames_per_block[{index}]`={window!r} is not a valid window: {error}"
                ) from None
        return layouts

    def make_cache(
        self,
        layout: ChunkLayout,
        batch_size: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        window_frames_per_block: Sequence[int] | None = None,
        quantization: str | None = None,
        offload: bool = False,
        adaptive_sink: AdaptiveSinkPolicy | None = None,
    ) -> RollingKVCache:
        """One `SlidingWindowLayer` + `CrossAttentionLayer` per block; allocated now if `batch_size` is given.

        `window_frames_per_block` gives each block its own window (in latent frames, counting the
        chunk), as hybrid local/global attention does; the sink and chunk stay `layout`'s.
        `quantization` ("int8" / "fp8") and `offload` (committed K/V in CPU memory, brought to the
        block's device when it runs) are the `SlidingWindowLayer` options (see docs/cache.md).
        `layout.sink_mode="rolling"` gives every layer Rolling Sink's sliding sink (`caching/rolling_sink.py`);
        `layout.elastic_window` / `layout.context_window_frames` give them Rolling Forcing's views.
        `adaptive_sink` gives every block StreamDiffusionV2's `AdaptiveSinkLayer` instead (`caching/adaptive_sink.py`).
        """
        if adaptive_sink is not None:
            layers = self._adaptive_sink_layers(layout, adaptive_sink, window_frames_per_block, quantization, offload)
        else:
            layers = self._sliding_layers(layout, window_frames_per_block, quantization, offload)
        cache = RollingKVCache(layers, [CrossAttentionLayer() for _ in self.blocks])
        if batch_size is not None:
            heads, head_dim = self.config.num_attention_heads, self.config.attention_head_dim
            # No `device`: each block's layers live where the block runs (a model split by `device_map`).
            cache.early_initialization(
                batch_size, heads, head_dim, dtype or self.dtype, device or block_devices(self.blocks)
            )
        return cache

    def _adaptive_sink_layers(
        self,
        layout: ChunkLayout,
        policy: AdaptiveSinkPolicy,
        window_frames_per_block: Sequence[int] | None,
        quantization: str | None,
        offload: bool,
    ) -> list[AdaptiveSinkLayer]:
        """One `AdaptiveSinkLayer` per block: dense, one window for all (its slots follow its own queue)."""
        conflicts = (
            window_frames_per_block is not None,
            quantization is not None,
            offload,
            layout.sink_mode != "fixed",
            layout.elastic_window or layout.context_window_frames is not None,
        )
        if any(conflicts):
            raise ValueError(
                "`adaptive_sink` writes dense K/V in slots its eviction queue picks and attention reads them all: no "
                "`window_frames_per_block`, `quantization`, `offload`, rolling `sink_mode` or window views with it."
            )
        sizes = (layout.sink_tokens, layout.window_tokens, layout.chunk_tokens)
        return [AdaptiveSinkLayer(*sizes, frame_tokens=layout.tokens_per_frame, policy=policy) for _ in self.blocks]

    def _sliding_layers(
        self,
        layout: ChunkLayout,
        window_frames_per_block: Sequence[int] | None,
        quantization: str | None,
        offload: bool,
    ) -> list[SlidingWindowLayer]:
        return [
            SlidingWindowLayer(
                block.sink_tokens, block.window_tokens, block.chunk_tokens, quantization=quantization, offload=offload,
                sink_mode=block.sink_mode, frame_tokens=block.tokens_per_frame, elastic_window=block.elastic_window,
                context_window_tokens=block.context_window_tokens,
            )
            for block in self.block_layouts(layout, window_frames_per_block)
        ]  # fmt: skip

    @torch.no_grad()
    def prepare_conditioning(self, kv_cache: RollingKVCache, encoder_hidden_states: torch.Tensor) -> None:
        """Compute every block's text K/V into the cache now (a new prompt), so cached steps only read them.

        Calling it is the explicit "the prompt changed" signal; a compiled step then never sees an empty
        cross-attention layer, which keeps it at one graph per window state.
        """
        text_states = self.condition_embedder.text_embedder(encoder_hidden_states)
        for block, layer in zip(self.blocks, kv_cache.cross):
            if layer is not None:
                layer.reset()
                layer.update(*text_key_value(block.attn2, text_states), conditioning=encoder_hidden_states)

    def frame_budget(self, layout: ChunkLayout) -> int | None:
        """Absolute positions end at the RoPE table; relative ones are re-based and never do."""
        return self.config.rope_max_seq_len if layout.position_mode == "absolute" else None

    def check_frame_budget(self, num_latent_frames: int, layout: ChunkLayout) -> None:
        """Refuse a video whose absolute positions would leave the RoPE table (never silently wrong)."""
        limit = self.frame_budget(layout)
        if limit is not None and num_latent_frames > limit:
            raise ValueError(  # names the arguments, so the command line and the demo show their flags and fields
                f"`num_frames` is {num_latent_frames} latent frames, more than the RoPE table's {limit} positions with "
                "`position_mode`='absolute': make fewer frames, or give `position_mode`='relative' (positions "
                "re-based in place: no length limit)."
            )

    def committed_frames(self, kv_cache: RollingKVCache, layout: ChunkLayout) -> int:
        """Latent frames committed to `kv_cache` so far (the stream position, a host counter)."""
        return kv_cache[0].committed_count // layout.tokens_per_frame

    # ---------------------------------------------------------------------------------------- forward
    def forward(  # noqa: PLR0913 (diffusers' Wan forward, plus the cache's arguments)
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_image: torch.Tensor | None = None,
        return_dict: bool = True,
        attention_kwargs: dict[str, Any] | None = None,
        kv_cache: RollingKVCache | Sequence[RollingKVCache] | None = None,
        layout: ChunkLayout | Sequence[ChunkLayout] | None = None,
        frame_indices: torch.Tensor | None = None,
        frame_mask: torch.Tensor | None = None,
        attention_bias: float = 1.0,
        attention_bias_mode: str = "past",
    ) -> torch.Tensor | Transformer2DModelOutput:
        """Denoise `hidden_states` `(batch, channels, frames, height, width)`.

        - no `kv_cache`, no `layout`: plain Wan 2.1 (full attention over the given frames);
        - `layout` without `kv_cache`: the dense reference, the whole sequence under the block-causal,
          sink + window mask, starting at frame 0; `timestep` may be `(batch, frames)` so context chunks
          run at t = 0 and the current chunk noised; `frame_indices` `(frames,)` and `frame_mask`
          `(frames, frames)` replace the default positions and mask (teacher forcing: see
          `teacher_forcing_frame_mask`); `layout` may be one layout per block (per-block windows);
        - `kv_cache` and `layout`: one chunk; its K/V are written as pending into the cache (call
          `kv_cache.commit()` after the clean context pass). `kv_cache` may be a list of caches, one per batch row
          (sessions batched by `rolldiff serve`): each row is written to and attends through its own cache, at its
          own position and window fill, and `timestep` `(batch,)` may differ per row; each row's result is its solo
          call's up to float reordering.
        `attention_kwargs` are diffusers' (e.g. `{"scale": 0.5}` for LoRA adapters). `attention_bias` < 1 adds
        `log(attention_bias)` to the scores of earlier frames' tokens: every one (`attention_bias_mode="past"`), or
        all but the first frame's (`"scope"`: daydreamlive/scope's port of Krea's bias).
        """
        if kv_cache is not None and layout is None:
            raise ValueError("`layout` (a ChunkLayout) is required together with `kv_cache`.")
        if attention_bias_mode not in ATTENTION_BIAS_MODES:
            raise ValueError(
                f"`attention_bias_mode` must be one of {ATTENTION_BIAS_MODES}, got {attention_bias_mode!r}."
            )
        if encoder_hidden_states_image is not None:
            raise ValueError("Image conditioning (`encoder_hidden_states_image`) is not supported by this model.")
        if layout is None:
            return super().forward(
                hidden_states,
                timestep,
                encoder_hidden_states,
                return_dict=return_dict,
                attention_kwargs=attention_kwargs,
            )  # LoRA's `apply_lora_scale` reads `attention_kwargs` from keywords only
        block_layouts = list(layout) if isinstance(layout, Sequence) else None
        if block_layouts is not None and len(block_layouts) != len(self.blocks):
            raise ValueError(
                f"`layout` has {len(block_layouts)} entries, expected one per block ({len(self.blocks)})."
            )
        layout = block_layouts[0] if block_layouts is not None else layout
        batch, _, num_frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.config.patch_size
        grid_frames, grid_h, grid_w = num_frames // p_t, height // p_h, width // p_w
        row_caches = self._row_caches(kv_cache, batch)
        for cache in row_caches or [kv_cache]:
            self._check_layout(layout, cache, grid_frames, grid_h * grid_w)
        split = [self.rope.t_dim, self.rope.h_dim, self.rope.w_dim]
        rope = RopeTables(self.rope.freqs_cos.split(split, dim=1), self.rope.freqs_sin.split(split, dim=1), grid_w)
        inputs = CausalAttentionInputs(
            rope=rope,
            layout=layout,
            kv_cache=kv_cache,
            conditioning=encoder_hidden_states,
            attention_bias=attention_bias,
            attention_bias_mode=attention_bias_mode,
            text_cached=kv_cache is not None and _holds_text([kv_cache]),
        ) if row_caches is None else self._row_inputs(
            rope, layout, row_caches, encoder_hidden_states, attention_bias, attention_bias_mode
        )  # fmt: skip
        if kv_cache is None:
            self._add_dense_chunks(inputs, block_layouts, grid_frames, frame_indices, frame_mask, hidden_states.device)
        if timestep.ndim == 2:  # (batch, frames) -> (batch, tokens): diffusers' per-token timestep path
            timestep = timestep.repeat_interleave(grid_h * grid_w, dim=1)
        return bind_call_context(
            self._call_slot,
            inputs,
            super().forward,
            hidden_states,
            timestep,
            encoder_hidden_states,
            return_dict=return_dict,
            attention_kwargs=attention_kwargs,
        )

    @staticmethod
    def _row_caches(kv_cache, batch: int) -> list[RollingKVCache] | None:
        """`kv_cache` as one cache per batch row (a list or tuple), checked; None for a single cache (or none)."""
        if not isinstance(kv_cache, (list, tuple)):
            return None
        if len(kv_cache) != batch or not all(isinstance(cache, RollingKVCache) for cache in kv_cache):
            raise ValueError(
                f"`kv_cache` as a sequence holds one RollingKVCache per batch row: expected {batch}, got "
                f"{[type(cache).__name__ for cache in kv_cache]}."
            )
        if len({id(cache) for cache in kv_cache}) != batch:
            raise ValueError("`kv_cache`: each batch row needs a cache of its own; one cache is listed twice.")
        return list(kv_cache)

    @staticmethod
    def _row_inputs(
        rope: RopeTables,
        layout: ChunkLayout,
        caches: list[RollingKVCache],
        encoder_hidden_states: torch.Tensor,
        attention_bias: float,
        attention_bias_mode: str,
    ) -> CausalAttentionInputs:
        """The call's inputs when each batch row has its own cache: one `CausalAttentionInputs` per row (its RoPE and
        masks memoized apart, since rows sit at different positions), under one that holds them."""
        rows = [
            CausalAttentionInputs(
                rope=rope,
                layout=layout,
                kv_cache=cache,
                conditioning=encoder_hidden_states[i : i + 1],
                attention_bias=attention_bias,
                attention_bias_mode=attention_bias_mode,
            )
            for i, cache in enumerate(caches)
        ]
        text_cached = _holds_text(caches)
        return CausalAttentionInputs(
            rope=rope,
            layout=layout,
            conditioning=encoder_hidden_states,
            attention_bias=attention_bias,
            attention_bias_mode=attention_bias_mode,
            text_cached=text_cached,
            rows=rows,
        )

    def _check_layout(self, layout: ChunkLayout, kv_cache, grid_frames: int, tokens_per_frame: int) -> None:
        if tokens_per_frame != layout.tokens_per_frame:
            raise ValueError(
                f"`layout.tokens_per_frame`={layout.tokens_per_frame} does not match the input's "
                f"{tokens_per_frame} tokens per frame."
            )
        if kv_cache is None:
            return
        # the layers may take more in one update than a chunk (the adaptive sink's pipelined in-flight region)
        first_layer = kv_cache[0] if len(kv_cache) else None
        layer_tokens = getattr(first_layer, "chunk_tokens", None) or 0
        largest = max(layout.chunk_frames, layer_tokens // layout.tokens_per_frame)
        if grid_frames > largest:
            raise ValueError(f"A chunk of {grid_frames} frames exceeds `chunk_frames`={largest}.")
        if layout.position_mode == "absolute" and not torch.compiler.is_compiling():
            self.check_frame_budget(self.committed_frames(kv_cache, layout) + grid_frames, layout)

    def _add_dense_chunks(
        self,
        inputs: CausalAttentionInputs,
        block_layouts: list[ChunkLayout] | None,
        grid_frames: int,
        frame_indices: torch.Tensor | None,
        frame_mask: torch.Tensor | None,
        device: torch.device,
    ) -> None:
        """RoPE and mask of every query chunk of the dense reference, once per distinct block layout."""
        if frame_indices is None:
            frame_indices = torch.arange(grid_frames)
        if frame_indices.shape != (grid_frames,):
            raise ValueError(f"`frame_indices` must be ({grid_frames},), got {tuple(frame_indices.shape)}.")
        if frame_mask is not None and frame_mask.shape != (grid_frames, grid_frames):
            raise ValueError(f"`frame_mask` must be ({grid_frames}, {grid_frames}), got {tuple(frame_mask.shape)}.")
        by_layout: dict[ChunkLayout, list[DenseChunk]] = {}
        for index, layout in enumerate(block_layouts or [inputs.layout]):
            if layout not in by_layout:
                mask = block_causal_frame_mask(grid_frames, layout) if frame_mask is None else frame_mask
                by_layout[layout] = self._dense_chunks(inputs, layout, frame_indices.to(device), mask.to(device))
            inputs.block_dense_chunks[index] = by_layout[layout]
        inputs.dense_chunks = inputs.block_dense_chunks[0]

    @staticmethod
    def _dense_chunks(
        inputs: CausalAttentionInputs, layout: ChunkLayout, frame_indices: torch.Tensor, frame_mask: torch.Tensor
    ) -> list[DenseChunk]:
        tokens = layout.tokens_per_frame
        frame_ids = frame_indices.repeat_interleave(tokens)  # (L,) latent frame of every token
        token_mask = frame_mask.repeat_interleave(tokens, 0).repeat_interleave(tokens, 1)  # (L, L)
        within = torch.arange(frame_ids.shape[0], device=frame_ids.device) % tokens
        chunk_tokens = layout.chunk_tokens
        dtype = inputs.rope.cos[0].dtype
        chunks = []
        for start in range(0, frame_ids.shape[0], chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            chunk_start = int(frame_ids[start])
            cos, sin = inputs.rope.lookup(layout.frame_position(frame_ids, chunk_start), within)
            mask = token_mask[rows]
            if inputs.attention_bias != 1.0:
                past = mask & (frame_ids < chunk_start)[None, :]
                if inputs.attention_bias_mode == "scope":
                    past = past & (frame_ids > 0)[None, :]
                mask = _bias_mask(mask, past, inputs.attention_bias, dtype)
            chunks.append(DenseChunk(rows, cos, sin, mask))
        return chunks

"""GLM-Image's diffusion decoder with rolldiff's condition cache.

`GlmImageCachedTransformer2DModel` subclasses diffusers' `GlmImageTransformer2DModel`: the same
config and weights (published checkpoints load unchanged), diffusers' forward and blocks run as
they are. diffusers' forward already passes a per-block cache down (`kv_caches=`), so per-call state
is never stored on the model; only the attention processor differs, and only when the block's cache
is a `ConditionLayer`: then the reference images' K/V are read from the layer's buffer (one view
`[conditions; current]`, written in place) instead of diffusers' per-step `torch.cat`, and samples
with different condition lengths get a key mask. With no cache, or with diffusers' own
`GlmImageKVCache`, the processor is diffusers' own, so the model *is* the diffusers model.
"""

from __future__ import annotations

import torch
from diffusers.configuration_utils import register_to_config
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.attention_processor import Attention
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.modeling_utils import ModelMixin  # noqa: F401  diffusers' pipeline loader looks it up here
from diffusers.models.transformers.transformer_glm_image import GlmImageAttnProcessor, GlmImageTransformer2DModel

from ..caching.condition import ConditionKVCache, ConditionLayer

__all__ = ["GlmImageCachedTransformer2DModel", "GlmImageConditionAttnProcessor"]


def joint_attention_mask(
    text_mask: torch.Tensor | None,
    condition_mask: torch.Tensor | None,
    text_tokens: int,
    query_tokens: int,
    key_tokens: int,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """The attention mask for `L` queries over `S` keys (`[conditions; glyph; image]`), or None.

    `condition_mask` `(B, S)` bool (True = attend) hides the gap between a sample's conditions and
    the longest sample's. `text_mask` `(B, glyph tokens)` is diffusers' glyph mask, built as diffusers
    builds it (a 0/1 float mask, which SDPA adds as a bias) so outputs stay equal to diffusers'; the
    cached conditions count as valid keys for it.
    """
    if text_mask is None:
        return None if condition_mask is None else condition_mask[:, None, None, :]  # (B, 1, 1, S)
    valid = torch.ones(text_mask.shape[0], key_tokens, device=text_mask.device)  # (B, S)
    valid[:, key_tokens - query_tokens : key_tokens - query_tokens + text_tokens] = text_mask.float()
    query_valid = valid[:, key_tokens - query_tokens :]  # (B, L)
    mask = ((query_valid[:, :, None] * valid[:, None, :]) > 0)[:, None].to(dtype)  # (B, 1, L, S)
    if condition_mask is not None:
        mask = mask.masked_fill(~condition_mask[:, None, None, :], float("-inf"))
    return mask


class GlmImageConditionAttnProcessor(GlmImageAttnProcessor):
    """diffusers' GLM-Image joint attention; a `ConditionLayer` cache supplies the reference images' K/V in place."""

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        kv_cache=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(kv_cache, ConditionLayer):  # no cache, or diffusers' GlmImageLayerKVCache
            return super().__call__(
                attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb, kv_cache
            )
        dtype = encoder_hidden_states.dtype
        text_tokens = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)  # (B, L = text + image, C)

        # 1. QKV projections and QK normalization, (B, L, H, D)
        query = attn.to_q(hidden_states).unflatten(2, (attn.heads, -1))
        key = attn.to_k(hidden_states).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        if attn.norm_q is not None:
            query = attn.norm_q(query).to(dtype=dtype)
        if attn.norm_k is not None:
            key = attn.norm_k(key).to(dtype=dtype)

        # 2. RoPE on the image tokens (conditions are stored after RoPE, as diffusers stores them)
        if image_rotary_emb is not None:
            query[:, text_tokens:] = apply_rotary_emb(
                query[:, text_tokens:], image_rotary_emb, sequence_dim=1, use_real_unbind_dim=-2
            )
            key[:, text_tokens:] = apply_rotary_emb(
                key[:, text_tokens:], image_rotary_emb, sequence_dim=1, use_real_unbind_dim=-2
            )

        # 3. The condition cache: write / read `[conditions; current]` (B, S, H, D) / skip
        key, value = kv_cache.update(key, value)
        mask = joint_attention_mask(
            attention_mask, kv_cache.attention_mask, text_tokens, query.shape[1], key.shape[1], query.dtype
        )

        # 4. Attention and output projection
        hidden_states = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=mask,
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        hidden_states = hidden_states.flatten(2, 3).to(query.dtype)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        encoder_hidden_states, hidden_states = hidden_states.split(
            [text_tokens, hidden_states.shape[1] - text_tokens], dim=1
        )
        return hidden_states, encoder_hidden_states


class GlmImageCachedTransformer2DModel(GlmImageTransformer2DModel):
    """diffusers' GLM-Image decoder whose `kv_caches=` also takes a `ConditionKVCache` (`make_cache()`).

    Call sequence (what `GlmImageCachedPipeline` does, and diffusers' pipeline with its own cache):
    `cache.set_mode("write")`, one batch-1 forward per reference image at t = 0, `cache.next_sample()`
    after each sample's images; then per step `set_mode("read")` for the conditional forward and
    `set_mode("skip")` for the unconditional one.
    """

    @register_to_config
    def __init__(  # noqa: PLR0913 (the config: diffusers' GlmImageTransformer2DModel arguments)
        self,
        patch_size: int = 2,
        in_channels: int = 16,
        out_channels: int = 16,
        num_layers: int = 30,
        attention_head_dim: int = 40,
        num_attention_heads: int = 64,
        text_embed_dim: int = 1472,
        time_embed_dim: int = 512,
        condition_dim: int = 256,
        prior_vq_quantizer_codebook_size: int = 16384,
    ):
        super().__init__(
            patch_size=patch_size,
            in_channels=in_channels,
            out_channels=out_channels,
            num_layers=num_layers,
            attention_head_dim=attention_head_dim,
            num_attention_heads=num_attention_heads,
            text_embed_dim=text_embed_dim,
            time_embed_dim=time_embed_dim,
            condition_dim=condition_dim,
            prior_vq_quantizer_codebook_size=prior_vq_quantizer_codebook_size,
        )
        for block in self.transformer_blocks:
            block.attn1.set_processor(GlmImageConditionAttnProcessor())

    def make_cache(
        self,
        max_tokens: int | None = None,
        batch_size: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        shared_workspace: bool = False,
    ) -> ConditionKVCache:
        """The condition cache for one generation call (reusable across calls: `clear()` keeps its buffers).

        `max_tokens`: conditions + current (glyph + image) tokens per sample; None sizes the buffers at
        first use. With `batch_size` too, they are allocated now (model dtype/device unless given).
        `shared_workspace`: blocks keep only their conditions and read through one shared buffer
        (diffusers' peak memory; for batches that repeat a sample, e.g. `num_images_per_prompt` > 1).
        """
        cache = ConditionKVCache(self.config.num_layers, max_tokens, shared_workspace)
        if batch_size is not None:
            if max_tokens is None:
                raise ValueError("`make_cache(batch_size=...)` allocates ahead and needs `max_tokens` too.")
            cache.early_initialization(
                batch_size,
                self.config.num_attention_heads,
                self.config.attention_head_dim,
                dtype or self.dtype,
                device or self.device,
            )
        return cache

    def image_tokens(self, height: int, width: int) -> int:
        """Decoder tokens of a latent of `height` x `width` (latent pixels)."""
        return (height // self.config.patch_size) * (width // self.config.patch_size)

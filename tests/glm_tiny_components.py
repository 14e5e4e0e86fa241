"""Tiny random GLM-Image components that run diffusers' `GlmImagePipeline` offline on CPU.

Follows the verified recipe in ../shared/REFERENCE.md: a word-level prior tokenizer whose image-end
token lies outside the `vision_vocab_size` ids the prior samples, a 2-layer GLM prior, a 1-layer
ByT5-style glyph encoder, a 16x VAE x decoder patch, one codebook size (32) in three places.
`PooledPriorForDiffusers` is the one allowed patch, on diffusers' side only: diffusers 0.42.1
`torch.cat`s `get_image_features(...).pooler_output`, which transformers 5.x returns as a list of
per-image (C, h, w) maps; the subclass hands that call flat chunks and splits them back.
"""

from __future__ import annotations

import numpy as np
import PIL.Image
import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, GlmImagePipeline, GlmImageTransformer2DModel
from einops import rearrange
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import (
    ByT5Tokenizer,
    GlmImageConfig,
    GlmImageForConditionalGeneration,
    GlmImageImageProcessorPil,
    GlmImageProcessor,
    PreTrainedTokenizerFast,
    T5Config,
    T5EncoderModel,
)

from rolldiff import GlmImageCachedPipeline, GlmImageCachedTransformer2DModel

CODEBOOK = 32  # the prior's vision vocabulary = its VQ codebook = the decoder's prior-token embedding
IMAGE_START, IMAGE_END = "<|dit_token_16384|>", "<|dit_token_16385|>"
SPECIAL = ["<pad>", "<unk>", IMAGE_START, IMAGE_END, "<|image|>", "<sop>", "<eop>"]
WORDS = "a an the red cat dog photo of make it blue".split()
CHAT_TEMPLATE = (
    "{%- for message in messages -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}" + IMAGE_START + "<|image|>" + IMAGE_END + "{%- else -%}{{ item['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endfor -%}"
)
DECODER_CONFIG = dict(
    patch_size=2,
    in_channels=4,
    out_channels=4,
    num_layers=1,
    attention_head_dim=8,
    num_attention_heads=2,
    text_embed_dim=32,
    time_embed_dim=16,
    condition_dim=8,
    prior_vq_quantizer_codebook_size=CODEBOOK,
)


def prior_tokenizer() -> PreTrainedTokenizerFast:
    """Ids 0..31 are the prior's image tokens; the special tokens, digits and words come after them."""
    names = [f"<|dit_token_{i}|>" for i in range(CODEBOOK)] + SPECIAL + [str(d) for d in range(10)] + WORDS
    backend = Tokenizer(models.WordLevel(vocab={name: i for i, name in enumerate(names)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)]
    )
    backend.add_special_tokens(
        [AddedToken(name, special=True, normalized=False) for name in names[:CODEBOOK] + SPECIAL]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        padding_side="left",  # batched prompts: generation starts at the same position for every sample
        unk_token="<unk>",
        bos_token=IMAGE_START,
        eos_token=IMAGE_END,
        extra_special_tokens={"image_token": "<|image|>", "grid_bos_token": "<sop>", "grid_eos_token": "<eop>"},
    )


def prior_processor() -> GlmImageProcessor:
    image_processor = GlmImageImageProcessorPil(
        patch_size=16, temporal_patch_size=1, merge_size=1, size={"shortest_edge": 256, "longest_edge": 1024 * 1024}
    )
    return GlmImageProcessor(image_processor=image_processor, tokenizer=prior_tokenizer(), chat_template=CHAT_TEMPLATE)


def prior_config(tokenizer: PreTrainedTokenizerFast) -> GlmImageConfig:
    ids = tokenizer.convert_tokens_to_ids
    return GlmImageConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=512,
            vision_vocab_size=CODEBOOK,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 2, 2]},
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        ),
        vision_config=dict(
            depth=1, hidden_size=32, num_heads=2, image_size=32, patch_size=16, intermediate_size=32, in_channels=3
        ),
        vq_config=dict(embed_dim=32, num_embeddings=CODEBOOK, latent_channels=32),
        image_token_id=ids("<|image|>"),
        image_start_token_id=ids(IMAGE_START),
        image_end_token_id=ids(IMAGE_END),
    )


class PooledPriorForDiffusers(GlmImageForConditionalGeneration):
    """The diffusers-side patch only: flat chunks for diffusers' `torch.cat`, maps again for the tokenizer.

    Only diffusers' call (no `images_per_sample`) gets flat chunks; `generate` keeps the maps it expects.
    """

    def get_image_features(self, pixel_values, image_grid_thw=None, images_per_sample=None, **kwargs):
        outputs = super().get_image_features(pixel_values, image_grid_thw, images_per_sample, **kwargs)
        if images_per_sample is None:
            outputs.pooler_output = tuple(rearrange(m, "c h w -> (h w) c") for m in outputs.pooler_output)
        return outputs

    def get_image_tokens(self, hidden_states, image_grid_thw=None):
        sizes = (image_grid_thw[:, 1] * image_grid_thw[:, 2]).tolist()
        maps = [
            rearrange(chunk, "(h w) c -> c h w", h=int(h), w=int(w))
            for chunk, (_, h, w) in zip(torch.split(hidden_states, sizes), image_grid_thw.tolist())
        ]
        return super().get_image_tokens(maps, image_grid_thw)


def glyph_encoder() -> T5EncoderModel:
    config = T5Config(
        vocab_size=384,
        d_model=32,
        d_kv=8,
        d_ff=32,
        num_layers=1,
        num_heads=2,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",
    )
    return T5EncoderModel(config).eval()


def tiny_vae() -> AutoencoderKL:
    return AutoencoderKL(
        block_out_channels=(4, 8, 8, 8),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=4,
        norm_num_groups=4,
        layers_per_block=1,
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    ).eval()


def tiny_decoder(seed: int = 0, cls: type = GlmImageCachedTransformer2DModel, **overrides):
    torch.manual_seed(seed)
    return cls(**{**DECODER_CONFIG, **overrides}).eval()


def tiny_components(seed: int = 0) -> dict:
    """Components for `GlmImageCachedPipeline` (ours: the cached decoder, the unpatched prior)."""
    torch.manual_seed(seed)
    processor = prior_processor()
    prior = GlmImageForConditionalGeneration(prior_config(processor.tokenizer)).eval()
    return dict(
        tokenizer=ByT5Tokenizer(),
        processor=processor,
        text_encoder=glyph_encoder(),
        vision_language_encoder=prior,
        vae=tiny_vae(),
        transformer=tiny_decoder(seed + 1),
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )


def tiny_pipelines(seed: int = 0) -> tuple[GlmImageCachedPipeline, GlmImagePipeline]:
    """Ours and diffusers' pipeline on the same weights (diffusers' with its decoder class and patched prior)."""
    components = tiny_components(seed)
    ours = GlmImageCachedPipeline(**components)
    prior = components["vision_language_encoder"]
    diffusers_prior = PooledPriorForDiffusers(prior.config).eval()
    diffusers_prior.load_state_dict(prior.state_dict())
    decoder = GlmImageTransformer2DModel(**DECODER_CONFIG).eval()
    decoder.load_state_dict(components["transformer"].state_dict())
    reference = GlmImagePipeline(**{**components, "vision_language_encoder": diffusers_prior, "transformer": decoder})
    ours.set_progress_bar_config(disable=True)
    reference.set_progress_bar_config(disable=True)
    return ours, reference


def reference_image(height: int = 32, width: int = 32, seed: int = 0) -> PIL.Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return PIL.Image.fromarray(pixels)

"""Tiny SANA-like components for the toy world: the same classes as SANA-Video, sized for 32x32 frames on a CPU.

- VAE: the Krea-like default's trained `AutoencoderKLWan` (loaded, frozen), so both embedded models share
  one latent space and only the transformer is trained;
- text: a Gemma-style word-level tokenizer over the toy vocabulary (`<pad>=0 <eos>=1 <bos>=2 <unk>=3`, a
  leading `<bos>`) and a randomly initialised, frozen `Gemma2Model` (prompts only need distinct embeddings);
- transformer: `LongSanaTransformer3DModel`, 4 blocks of 4 heads x 36 (RoPE 12 + 12 + 12), patch (1, 2, 2):
  an 8x8 latent frame is 16 tokens, as in the Krea-like default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import Gemma2Config, Gemma2Model, PreTrainedTokenizerFast

from ..caching.layout import ChunkLayout
from ..models.long_sana import LongSanaTransformer3DModel, sana_layout
from ..models.patch_grid import tokens_per_latent_frame
from .tiny_components import toy_vocabulary

PAD_TOKEN, EOS_TOKEN, BOS_TOKEN, UNK_TOKEN = "<pad>", "<eos>", "<bos>", "<unk>"
EMBEDDING_STD = 0.5  # see build_gemma_text_encoder


@dataclass(frozen=True)
class SanaTinyConfig:
    """Every size of the tiny SANA-like model and the generation settings it is trained for.

    Field names the shared training helpers read (`height`, `width`, `max_sequence_length`, `shift`,
    `denoising_steps`, `layout()`) match `TinyConfig`'s.
    """

    # Video (latents from the Krea-like default's VAE: 8 channels, 8x8, one latent frame per video frame)
    height: int = 32
    width: int = 32
    z_dim: int = 8
    spatial_factor: int = 4
    # Transformer
    num_heads: int = 4
    head_dim: int = 36
    num_layers: int = 4
    mlp_ratio: float = 2.5
    patch_size: tuple[int, int, int] = (1, 2, 2)
    rope_max_seq_len: int = 1024
    # Text
    text_dim: int = 32
    max_sequence_length: int = 8  # "<bos> a red circle moving left" = 6 tokens
    # Generation settings (stored as the pipeline's defaults)
    chunk_frames: int = 3
    context_chunks: int | None = 3  # earlier chunks a chunk sees: the 9 frames the training clips cover
    shift: float = 5.0
    denoising_steps: tuple[int, ...] = (1000, 750, 500, 250)

    @property
    def latent_size(self) -> tuple[int, int]:
        return self.height // self.spatial_factor, self.width // self.spatial_factor

    @property
    def tokens_per_frame(self) -> int:
        return tokens_per_latent_frame(self.patch_size, *self.latent_size)

    def layout(self) -> ChunkLayout:
        return sana_layout(self.tokens_per_frame, self.chunk_frames, self.context_chunks)


def build_gemma_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer over the toy vocabulary with Gemma's special ids; prepends `<bos>` as Gemma does."""
    specials = [PAD_TOKEN, EOS_TOKEN, BOS_TOKEN, UNK_TOKEN]
    vocab = {token: index for index, token in enumerate([*specials, *toy_vocabulary()])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN, bos_token=BOS_TOKEN, unk_token=UNK_TOKEN
    )


def build_gemma_text_encoder(config: SanaTinyConfig, vocab_size: int, seed: int = 0) -> Gemma2Model:
    """Randomly initialised, frozen one-layer `Gemma2Model` of width `config.text_dim`.

    Token embeddings are drawn at std `EMBEDDING_STD`, not Gemma's 0.02: Gemma-2 normalises the attention and
    feed-forward outputs before adding them (post-norms), so at 0.02 a random layer's mixing swamps each word's
    own embedding. The prompt's last word ("left") then lived in under a third of its token ("left" and "up"
    differed by 1.7 of a norm of 5.7, while "red" vs "blue" earlier in the prompt moved it by 4.9), and the first
    model trained on it learned colour and shape but ignored the direction. At 0.5 each token is mostly its own
    word (distinct words are near-orthogonal, 8.1 of 8.0) with some context mixed in, as T5's unit-scale
    embeddings are for the Krea-like default's UMT5.
    """
    torch.manual_seed(seed)
    gemma = Gemma2Config(
        vocab_size=vocab_size,
        hidden_size=config.text_dim,
        intermediate_size=2 * config.text_dim,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=config.text_dim // 2,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        attn_implementation="eager",
    )
    model = Gemma2Model(gemma).eval()
    with torch.no_grad():
        model.embed_tokens.weight.normal_(std=EMBEDDING_STD)
        model.embed_tokens.weight[gemma.pad_token_id].zero_()
    model.requires_grad_(False)
    return model


def build_sana_transformer(config: SanaTinyConfig, seed: int = 0) -> LongSanaTransformer3DModel:
    """Tiny `LongSanaTransformer3DModel` over `z_dim`-channel latents."""
    torch.manual_seed(seed)
    width = config.num_heads * config.head_dim
    return LongSanaTransformer3DModel(
        in_channels=config.z_dim,
        out_channels=config.z_dim,
        num_attention_heads=config.num_heads,
        attention_head_dim=config.head_dim,
        num_layers=config.num_layers,
        num_cross_attention_heads=config.num_heads,
        cross_attention_head_dim=config.head_dim,
        cross_attention_dim=width,
        caption_channels=config.text_dim,
        mlp_ratio=config.mlp_ratio,
        sample_size=config.latent_size[0],
        patch_size=config.patch_size,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=config.rope_max_seq_len,
    )


def build_sana_scheduler(config: SanaTinyConfig) -> FlowMatchEulerDiscreteScheduler:
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=config.shift)

"""Tiny configs and builders for the embedded toy-world model (same classes as the real Krea-like models).

Sizes are chosen for 32x32 toy-world frames on a CPU:

- VAE: `AutoencoderKLWan` with no temporal downsampling (1 latent frame = 1 video frame, so a pipeline chunk of 3
  latent frames is 3 video frames) and two spatial downsamples (32x32 -> 8x8 latents);
- transformer: `KreaRealtimeTransformer3DModel` with patch (1, 2, 2), so a latent frame is 4x4 = 16 tokens and a
  patch holds `z_dim * 4` values, fewer than the model width (wider patches left frames full of noise);
- text: a word-level tokenizer over the toy vocabulary and a randomly initialised, frozen `UMT5EncoderModel`
  (prompts only need distinct embeddings; the transformer's text projection learns the rest).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

from ..models.krea_realtime import ChunkLayout, KreaRealtimeTransformer3DModel
from ..models.patch_grid import tokens_per_latent_frame
from ..toyworld.world import COLOURS, DIRECTIONS, SHAPES

PAD_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "</s>", "<unk>"


@dataclass(frozen=True)
class TinyConfig:
    """Every size of the tiny model and the generation settings it is trained for."""

    # Video
    height: int = 32
    width: int = 32
    # VAE: 32x32 pixels -> 8x8 latents of `z_dim` channels
    vae_base_dim: int = 16
    z_dim: int = 8
    vae_dim_mult: tuple[int, ...] = (1, 2, 2)  # two downsamples: spatial factor 4
    # Transformer: 4x4 = 16 tokens per latent frame, each a 2x2 patch of z_dim * 4 = 32 values < 144
    num_heads: int = 4
    head_dim: int = 36  # RoPE splits it 12 (time) + 12 (height) + 12 (width)
    num_layers: int = 4
    ffn_dim: int = 432
    patch_size: tuple[int, int, int] = (1, 2, 2)
    # Text
    text_dim: int = 32
    text_layers: int = 1
    max_sequence_length: int = 8  # "a red circle moving left" + eos = 6 tokens
    # Generation settings (stored as the pipeline's defaults)
    chunk_frames: int = 3
    sink_frames: int = 3
    window_frames: int = 9
    position_mode: str = "relative"
    shift: float = 5.0
    denoising_steps: tuple[int, ...] = (1000, 750, 500, 250)

    @property
    def spatial_factor(self) -> int:
        return 2 ** (len(self.vae_dim_mult) - 1)

    @property
    def latent_size(self) -> tuple[int, int]:
        return self.height // self.spatial_factor, self.width // self.spatial_factor

    @property
    def tokens_per_frame(self) -> int:
        return tokens_per_latent_frame(self.patch_size, *self.latent_size)

    def layout(self) -> ChunkLayout:
        return ChunkLayout(
            tokens_per_frame=self.tokens_per_frame,
            chunk_frames=self.chunk_frames,
            sink_frames=self.sink_frames,
            window_frames=self.window_frames,
            position_mode=self.position_mode,
        )


def toy_vocabulary() -> list[str]:
    """Every word of the toy-world prompts, in a fixed order."""
    return ["a", "moving", *COLOURS, *SHAPES, *DIRECTIONS]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level tokenizer over the toy vocabulary; appends `</s>` like T5's tokenizer, pads with `<pad>` = 0."""
    vocab = {token: index for index, token in enumerate([PAD_TOKEN, EOS_TOKEN, UNK_TOKEN, *toy_vocabulary()])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS_TOKEN}", special_tokens=[(EOS_TOKEN, vocab[EOS_TOKEN])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN, unk_token=UNK_TOKEN
    )


def build_text_encoder(config: TinyConfig, vocab_size: int, seed: int = 0) -> UMT5EncoderModel:
    """Randomly initialised, frozen `UMT5EncoderModel` of width `config.text_dim`."""
    torch.manual_seed(seed)
    umt5 = UMT5Config(
        vocab_size=vocab_size,
        d_model=config.text_dim,
        d_kv=config.text_dim // 4,
        d_ff=config.text_dim * 2,
        num_layers=config.text_layers,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    model = UMT5EncoderModel(umt5).eval()
    model.requires_grad_(False)
    return model


def build_vae(config: TinyConfig, seed: int = 0) -> AutoencoderKLWan:
    """`AutoencoderKLWan` with spatial factor 4, no temporal downsampling; latent statistics set after training."""
    torch.manual_seed(seed)
    return AutoencoderKLWan(
        base_dim=config.vae_base_dim,
        z_dim=config.z_dim,
        dim_mult=list(config.vae_dim_mult),
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False] * (len(config.vae_dim_mult) - 1),
        latents_mean=[0.0] * config.z_dim,
        latents_std=[1.0] * config.z_dim,
        scale_factor_temporal=1,
        scale_factor_spatial=config.spatial_factor,
    )


def build_transformer(config: TinyConfig, seed: int = 0) -> KreaRealtimeTransformer3DModel:
    """Tiny `KreaRealtimeTransformer3DModel` over `z_dim`-channel latents."""
    torch.manual_seed(seed)
    return KreaRealtimeTransformer3DModel(
        patch_size=config.patch_size,
        num_attention_heads=config.num_heads,
        attention_head_dim=config.head_dim,
        in_channels=config.z_dim,
        out_channels=config.z_dim,
        text_dim=config.text_dim,
        freq_dim=64,
        ffn_dim=config.ffn_dim,
        num_layers=config.num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=1024,
    )


def build_scheduler(config: TinyConfig) -> FlowMatchEulerDiscreteScheduler:
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=config.shift)

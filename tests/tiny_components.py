"""Tiny random components for CPU tests: word-level tokenizer, UMT5, Wan VAE, 2-layer causal transformer."""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

from rolldiff import KreaRealtimeTransformer3DModel, KreaRealtimeVideoPipeline

WORDS = "a an the red green blue yellow circle square triangle moving left right up down cat dog".split()
TRANSFORMER_CONFIG = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=32,
    ffn_dim=32,
    num_layers=2,
    rope_max_seq_len=64,
)


def word_tokenizer() -> PreTrainedTokenizerFast:
    """An in-memory word-level tokenizer (no files, no network)."""
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def tiny_text_encoder() -> UMT5EncoderModel:
    config = UMT5Config(vocab_size=len(WORDS) + 3, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
    return UMT5EncoderModel(config).eval()


def tiny_vae(temporal: bool = True) -> AutoencoderKLWan:
    return AutoencoderKLWan(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, temporal],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    ).eval()


def seeded_wan_vae(z_dim: int = 4, **layout) -> AutoencoderKLWan:
    """A tiny random `AutoencoderKLWan` of `layout` (dim_mult, temperal_downsample, patch_size, ...) with made-up
    latent statistics, the same weights on every call: what the streaming encoder and decoder tests run."""
    torch.manual_seed(0)
    stats = dict(latents_mean=[0.1, -0.2, 0.3, -0.4], latents_std=[1.5, 0.5, 2.0, 1.0])
    return AutoencoderKLWan(base_dim=8, z_dim=z_dim, num_res_blocks=1, **stats, **layout).eval()


def tiny_transformer(seed: int = 0, **overrides) -> KreaRealtimeTransformer3DModel:
    torch.manual_seed(seed)
    return KreaRealtimeTransformer3DModel(**{**TRANSFORMER_CONFIG, **overrides}).eval()


def tiny_pipeline(temporal_vae: bool = False, **config) -> KreaRealtimeVideoPipeline:
    torch.manual_seed(0)
    defaults = dict(chunk_frames=2, sink_frames=2, window_frames=4, max_sequence_length=8)
    return KreaRealtimeVideoPipeline(
        tokenizer=word_tokenizer(),
        text_encoder=tiny_text_encoder(),
        transformer=tiny_transformer(),
        vae=tiny_vae(temporal_vae),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        **{**defaults, **config},
    )


def interrupted_run(pipe, path, prompt: str) -> dict:
    """Start `pipe.generate_to_file(path, prompt)` (3 chunks of 16x16, the state saved at every chunk) and stop it like
    Ctrl-C at its 5th step. Returns the run's arguments, for a resume that should (or should not) continue it."""
    import pytest

    def interrupt(pipe, step, timestep, tensors):
        if step == 5:
            raise KeyboardInterrupt
        return tensors

    run = dict(fps=8, num_frames=12, height=16, width=16, state_every_s=0, generator=torch.Generator().manual_seed(0))
    with pytest.raises(KeyboardInterrupt):
        pipe.generate_to_file(str(path), prompt, callback_on_step_end=interrupt, **run)
    return run

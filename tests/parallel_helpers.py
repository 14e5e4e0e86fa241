"""What the split-stream tests share: the random-weights pipeline of 3 blocks (one per stage at 3 stages, so a wrong
stage cannot hide), a fixed seed, and the check that no worker process is left running."""

from __future__ import annotations

import multiprocessing

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from tiny_components import tiny_text_encoder, tiny_transformer, tiny_vae, word_tokenizer

from rolldiff import KreaRealtimeVideoPipeline


def random_three_block_pipe() -> KreaRealtimeVideoPipeline:
    """Random weights, 3 blocks, 1-frame chunks, 3 steps."""
    torch.manual_seed(0)
    pipe = KreaRealtimeVideoPipeline(
        tokenizer=word_tokenizer(),
        text_encoder=tiny_text_encoder(),
        transformer=tiny_transformer(seed=1, num_layers=3),
        vae=tiny_vae(False),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        chunk_frames=1,
        sink_frames=1,
        window_frames=8,
        max_sequence_length=8,
        denoising_steps=[1000, 750, 500],
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def seeded() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def no_children_left() -> None:
    for child in multiprocessing.active_children():
        child.join(timeout=10)
    assert multiprocessing.active_children() == []

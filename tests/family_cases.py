"""One entry per video family for the contract suite (tests/test_family_contract.py).

A family joins the suite by adding a `FamilyCase`: how to build a tiny pipeline of it (3 blocks, so an error in
one block cannot hide behind the last), how its model runs the dense block-causal reference for one chunk, and
how diffusers' own class (the reference it subclasses) computes one chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, SanaVideoTransformer3DModel, WanTransformer3DModel
from test_long_sana_pipeline import tiny_sana_pipeline
from tiny_components import tiny_text_encoder, tiny_transformer, tiny_vae, word_tokenizer

from rolldiff import KreaRealtimeVideoPipeline

BLOCKS = 3


def _text_mask(embeds: torch.Tensor) -> torch.Tensor:
    return embeds.abs().amax(dim=-1) > 0  # what the SANA-like pipeline passes: False on padding


@dataclass(frozen=True)
class FamilyCase:
    name: str
    make_pipeline: Callable[[], object]
    # (model, clean frames before the chunk, the noisy chunk, its timestep (batch,), text, layout) -> velocity
    dense_velocity: Callable[..., torch.Tensor]
    diffusers_class: type
    # (diffusers model, chunk, timestep, text) -> velocity
    diffusers_velocity: Callable[..., torch.Tensor]
    size: tuple[int, int] = (16, 16)


# ----------------------------------------------------------------------------------------- Krea-like
def _krea_pipeline():
    torch.manual_seed(0)
    pipe = KreaRealtimeVideoPipeline(
        tokenizer=word_tokenizer(),
        text_encoder=tiny_text_encoder(),
        transformer=tiny_transformer(num_layers=BLOCKS),
        vae=tiny_vae(temporal=False),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        chunk_frames=2,
        sink_frames=2,
        window_frames=4,
        max_sequence_length=8,
        height=16,
        width=16,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _krea_dense(model, before, chunk, timestep, text, layout) -> torch.Tensor:
    sequence = torch.cat([before, chunk], dim=2)
    per_frame = torch.cat([torch.zeros(1, before.shape[2]), timestep.float()[:, None].expand(1, chunk.shape[2])], 1)
    return model(sequence, per_frame, text, layout=layout).sample[:, :, before.shape[2] :]


def _wan_velocity(reference, chunk, timestep, text) -> torch.Tensor:
    return reference(chunk, timestep, text).sample


# ----------------------------------------------------------------------------------------- SANA-like
def _sana_pipeline():
    return tiny_sana_pipeline(num_layers=BLOCKS)


def _sana_dense(model, before, chunk, timestep, text, layout) -> torch.Tensor:
    """Teacher forcing: `[clean; noisy]`, noisy chunk i sees the clean chunks before it (the other noisy ones:
    zeros, which it never sees)."""
    frames, start = before.shape[2] + chunk.shape[2], before.shape[2]
    clean = torch.cat([before, torch.zeros_like(chunk)], dim=2)
    noisy = torch.cat([torch.zeros_like(before), chunk], dim=2)
    per_frame = torch.cat([torch.zeros(1, frames), torch.full((1, frames), float(timestep[0]))], dim=1)
    out = model(
        torch.cat([clean, noisy], 2),
        text,
        per_frame,
        encoder_attention_mask=_text_mask(text),
        layout=layout,
        teacher_forcing=True,
    ).sample
    return out[:, :, frames + start :]


def _sana_velocity(reference, chunk, timestep, text) -> torch.Tensor:
    return reference(chunk, text, timestep, encoder_attention_mask=_text_mask(text)).sample


FAMILIES = [
    FamilyCase("krea", _krea_pipeline, _krea_dense, WanTransformer3DModel, _wan_velocity),
    FamilyCase("sana", _sana_pipeline, _sana_dense, SanaVideoTransformer3DModel, _sana_velocity),
]

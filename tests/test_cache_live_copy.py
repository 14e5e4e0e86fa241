"""Specification of one live copy: during a long stream there is exactly one copy of each cache, and
no chunk's latents, decoded frames or replaced prompt embeddings survive into the next chunk.

Counted, not guessed: every live tensor storage in the process (`gc`), at every chunk boundary of a
pipeline stream, with and without classifier-free guidance (one cache per branch).
"""

import gc
import weakref

import pytest
import torch
from tiny_components import tiny_pipeline
from torch import nn

PROMPT = "a red circle moving left"
SIZE = dict(height=16, width=16)


@pytest.fixture(scope="module")
def pipe():
    pipeline = tiny_pipeline()
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def live_storages() -> dict[int, int]:
    """data_ptr -> nbytes of every storage a live tensor in the process uses."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, nn.Parameter) and not obj.is_meta:  # real tensors (not fakes left by compile)
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return storages


@pytest.mark.parametrize("guidance_scale", [1.0, 3.0], ids=["no_cfg", "cfg"])
@torch.no_grad()
def test_one_cache_copy_and_nothing_of_an_old_chunk_survives(pipe, guidance_scale):
    seen = {}
    latents_of_chunk: list[weakref.ref] = []

    def keep_weak(pipeline, step, timestep, tensors):
        latents_of_chunk.append(weakref.ref(tensors["latents"]))
        return tensors

    schedule = [(0, PROMPT), (8, "a blue square moving up")]  # a prompt switch half-way
    stream = pipe.stream(
        prompt_schedule=schedule, num_frames=16, guidance_scale=guidance_scale, negative_prompt="moving up",
        generator=torch.Generator().manual_seed(0), output_type="pt",
        callback_on_step_end=keep_weak, **SIZE,
    )  # fmt: skip
    copies, totals, previous_frames, first_embeds = [], [], None, None
    before = live_storages()  # weights and other tensors that exist without a stream
    for index, frames in enumerate(stream):
        frames_ref = weakref.ref(frames)
        del frames
        if previous_frames is not None:
            assert previous_frames() is None, f"chunk {index - 1}'s frames are still referenced"
        assert all(ref() is None for ref in latents_of_chunk[:-1]), f"an old latents tensor survives at chunk {index}"
        previous_frames = frames_ref
        if first_embeds is None:
            first_embeds = weakref.ref(stream.embeds[0])
        storages = live_storages()
        layer_bytes = stream.caches[0][0].keys.untyped_storage().nbytes()
        copies.append(sum(nbytes == layer_bytes for ptr, nbytes in storages.items() if ptr not in before))
        totals.append(sum(storages.values()))
        seen[index] = stream.active_prompt
    branches, blocks = (2 if guidance_scale > 1 else 1), len(stream.caches[0])
    assert len(stream.caches) == branches
    assert copies == [branches * blocks * 2] * len(copies)  # K and V per block per branch, never a second copy
    assert seen[len(seen) - 1] == 1 and first_embeds() is None  # the replaced prompt's embeddings are gone
    # flat once the stream holds its most recent latents (a re-cache re-runs up to sink + window frames: chunk 3
    # here): nothing grows chunk after chunk after that
    assert max(totals[3:]) == totals[3], totals

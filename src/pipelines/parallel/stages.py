"""One stage of a split transformer: a copy that holds only its blocks, hooked to its `StageLink`.

The copy shares the original's weights where it stays on their device (no second copy of the stage's blocks, and
none at all of the others: they are left out of the copy), renumbers its blocks' attention processors from 0, and
so makes caches of its own blocks only: `make_cache` builds one layer per block it holds, self- and
cross-attention, and the cache's layer i is its block i. The pipeline around it is a shallow copy whose
transformer is the stage, so the caller's pipeline is never changed.

`stage_checksums` lets a worker that loaded the pipeline from disk prove it holds the weights the caller's
pipeline runs: one float64 sum per stage over the stage's blocks and the shared (non-block) weights.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from .link import StageLink


def _shared_weights(transformer: nn.Module) -> dict[int, Any]:
    """A deepcopy memo that makes a copy share every parameter and buffer of `transformer`."""
    tensors = [*transformer.parameters(), *transformer.buffers()]
    return {id(tensor): tensor for tensor in tensors}


def stage_transformer(transformer: nn.Module, blocks: range, link: StageLink, device: torch.device) -> nn.Module:
    """A copy of `transformer` holding only `blocks` (processors renumbered from 0), on `device`, hooked to `link`.

    Weights are shared with `transformer` when it is already on `device`; otherwise the copy owns them there."""
    memo: dict[int, Any] = {id(block): None for index, block in enumerate(transformer.blocks) if index not in blocks}
    if next(transformer.parameters()).device == torch.device(device):
        memo.update(_shared_weights(transformer))
    call_slot = getattr(transformer.rope, "call_slot", None)  # per-thread call state: shared, never copied
    if call_slot is not None:
        memo[id(call_slot)] = call_slot
    stage = copy.deepcopy(transformer, memo)
    kept = [stage.blocks[index] for index in blocks]
    for local, block in enumerate(kept):  # the cache's layer i is the stage's block i
        block.attn1.processor.index = local
        block.attn2.processor.index = local
    stage.blocks = nn.ModuleList(kept)
    stage = stage.to(device)
    link.attach(kept[0], kept[-1])
    return stage


def stage_pipeline(pipe: Any, transformer: nn.Module) -> Any:
    """A shallow copy of `pipe` running `transformer` (the caller's pipeline keeps its own)."""
    staged = copy.copy(pipe)
    vars(staged)["transformer"] = transformer  # not through diffusers' __setattr__: the config is the same
    return staged


@torch.no_grad()
def stage_checksums(transformer: nn.Module, stages: list[range]) -> list[float]:
    """Per stage: the float64 sum of its blocks' and the shared weights (what a worker's load must reproduce)."""
    block_ids = {id(p) for block in transformer.blocks for p in block.parameters()}
    shared = sum(float(p.double().sum()) for p in transformer.parameters() if id(p) not in block_ids)
    per_block = [sum(float(p.double().sum()) for p in block.parameters()) for block in transformer.blocks]
    return [shared + sum(per_block[index] for index in stage) for stage in stages]

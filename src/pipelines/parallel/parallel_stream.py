"""`ParallelChunkStream`: one `ChunkStream` rank of a stream split over devices (SPMD).

Every rank runs the same chunk loop from the same request and generator states, so the noise, the scheduler steps,
the commits and the prompt switches agree without being sent; only the transformer is split (`stages.py`,
`link.py`). What one rank decides alone is sent before each chunk as a control message from rank 0 (the leader)
to the others (followers): go on (with a `switch_prompt` embedding to apply at this boundary, if any), stop
(`close()` or `interrupt()` before the end), or send your caches (`state_dict()`). An interrupt therefore takes
effect at the next chunk boundary.

`state_dict()` on the leader gathers every stage's cache state and renumbers its layers into the whole model's
(`merge_cache_states`), so the saved state is the one-process stream's: a split run can be resumed on one device.
Under `denoising="stream_batch"` the rows of each forward travel through the stages as micro-batches, several in
flight at once (`inflight_batch.py`); control messages are asynchronous for the leader, so it never waits for the
last stage to catch up. Only rank 0 decodes and yields frames; followers run with `output_type="latent"` unless the loop needs decoded
pixels (Krea's re-encoded first frame), and then decode too.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..stream import ChunkStream, StreamPipeline
from .inflight_batch import InFlightStreamBatch
from .link import StageLink

GO_ON, STOP, SEND_STATE, SEND_STATS = 0, 1, 2, 3
_BLOCK_KEY = re.compile(r"^(layers|_cross_modules|_slot_modules\.\w+)\.(\d+)\.(.*)$")


def merge_cache_states(states: list[dict[str, Any]], stages: list[range]) -> dict[str, Any]:
    """One cache state of the whole model from each stage's (`RollingKVCache.state_dict()`), layers renumbered."""
    merged: dict[str, Any] = {}
    layout: dict[str, Any] = {"layers": [], "cross": [], "slots": {}}
    for state, blocks in zip(states, stages):
        for key, value in state.items():
            match = _BLOCK_KEY.match(key)
            if match is None:
                continue
            kind, index, rest = match.groups()
            merged[f"{kind}.{blocks.start + int(index)}.{rest}"] = value
        own = state["_extra_state"]
        layout["layers"] += own["layers"]
        layout["cross"] += own["cross"]
        for name, kinds in own["slots"].items():
            layout["slots"].setdefault(name, []).extend(kinds)
    merged["_extra_state"] = {**states[0]["_extra_state"], **layout}
    return merged


def _on_host(state: dict[str, Any]) -> dict[str, Any]:
    return {key: value.cpu() if isinstance(value, torch.Tensor) else value for key, value in state.items()}


class ParallelChunkStream(InFlightStreamBatch, ChunkStream):
    """A `ChunkStream` whose transformer is one stage of a split model; rank 0 leads, the others follow.

    `on_start` (leader) starts the other ranks at the first chunk and returns the link; `on_close` ends them."""

    def __init__(
        self,
        pipe: StreamPipeline,
        request: Any,
        stages: list[range],
        on_start: Callable[[ParallelChunkStream], StageLink],
        on_close: Callable[[bool], None],
    ) -> None:
        super().__init__(pipe, request)
        self._stages = stages
        self._on_start, self._on_close = on_start, on_close
        self._link: StageLink | None = None
        self._stop_requested = False
        self._failed = False
        self._others_stopped = False  # a STOP was sent: the other ranks have left the loop
        self._init_in_flight()  # `denoising="stream_batch"`: rows in flight through the stages (inflight_batch.py)

    @property
    def link(self) -> StageLink | None:
        """This rank's link (its counters), once started."""
        return self._link

    def generators(self) -> list[torch.Generator]:
        """The generators this stream draws from (the call's, else the device's default): their states start the
        other ranks."""
        return self._generators()

    @property
    def is_leader(self) -> bool:
        return self._link is None or self._link.rank == 0

    # ---------------------------------------------------------------------------------------- start, stop
    def _start(self) -> None:
        if not self._started and self._link is None:
            self._link = self._on_start(self)
        super()._start()

    def __next__(self) -> Any:
        try:
            return super().__next__()
        except StopIteration:
            raise
        except BaseException:
            self._failed = True  # the other ranks may wait on this one forever: they are ended, not told
            self.close()
            raise

    def interrupt(self) -> None:
        """Stop at the next chunk boundary (every rank must finish the chunk it is in)."""
        self._stop_requested = True

    @property
    def interrupted(self) -> bool:
        return self._stop_requested

    def close(self) -> None:
        if self._closed:
            return
        others_wait = not (self._failed or self._others_stopped) and self._next_chunk < self.num_chunks
        if self.is_leader and self._started and self._link is not None and others_wait:
            self._broadcast_control(STOP)
            self._drain_in_flight()
        if self._link is not None:
            self._link.flush()
        super().close()
        self._on_close(self._failed)

    # ---------------------------------------------------------------------------------------- control
    def _broadcast_control(self, command: int) -> None:
        switch = self._pending is not None and command == GO_ON
        control = self._placed_tensor(
            torch.tensor([command, int(switch), self._pending_blend or 0, int(self._pending_cut)], dtype=torch.int64)
        )
        # asynchronous: with rows in flight the other ranks reach this message a forward later, and the leader goes on
        self._link.keep(dist.broadcast(control, src=0, async_op=True), control)
        self._others_stopped = command == STOP
        if switch:
            embeds = self._pending.contiguous()
            self._link.keep(dist.broadcast(embeds, src=0, async_op=True), embeds)

    def _placed_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self._placement[0])  # NCCL sends device tensors only

    def _receive_control(self) -> int:
        while True:
            control = self._placed_tensor(torch.zeros(4, dtype=torch.int64))
            dist.broadcast(control, src=0)
            command, switch, blend, cut = control.tolist()
            if command == SEND_STATE:
                dist.gather_object(self._cache_states(), None, dst=0)
                continue
            if command == SEND_STATS:
                dist.gather_object(dataclasses.asdict(self._link.stats), None, dst=0)
                continue
            if switch:
                embeds = torch.empty_like(self._embeds[0])
                dist.broadcast(embeds, src=0)
                self._pending, self._pending_blend, self._pending_cut = embeds, blend or None, bool(cut)
            return command

    def _generate_chunk(self) -> torch.Tensor | None:
        if self.is_leader:
            command = STOP if self._stop_requested else GO_ON
            self._broadcast_control(command)
        else:
            command = self._receive_control()
        if command == STOP:
            self._drain_in_flight()
            return None
        clean = super()._generate_chunk()
        if clean is None:  # the input video ended, on every rank at once (each reads it): none waits for a STOP
            self._others_stopped = True
        return clean

    # ---------------------------------------------------------------------------------------- discarded outputs
    def _commit_context(self, clean: torch.Tensor, batched: bool, denoised: bool = True) -> None:
        with self._link.discarding():
            super()._commit_context(clean, batched, denoised)

    def _rebuild_context(self) -> None:
        with self._link.discarding():
            super()._rebuild_context()

    def _switch_to(self, embeds: torch.Tensor) -> None:
        with self._link.discarding():
            super()._switch_to(embeds)

    # ---------------------------------------------------------------------------------------- state
    def _cache_states(self) -> list[dict[str, Any]]:
        return [_on_host(cache.state_dict()) for cache in self._caches]

    def state_dict(self) -> dict[str, Any]:
        """The one-process stream's state: every stage's caches gathered and renumbered into the whole model's."""
        self._refuse_state_in_flight()
        state = super().state_dict()
        if self._next_chunk >= self.num_chunks:
            raise RuntimeError("`state_dict()` of a split stream after its last chunk: the other stages have ended.")
        self._broadcast_control(SEND_STATE)
        gathered: list[Any] = [None] * self._link.world_size
        dist.gather_object(self._cache_states(), gathered, dst=0)
        for branch in range(len(self._caches)):
            prefix = f"cache.{branch}."
            state = {key: value for key, value in state.items() if not key.startswith(prefix)}
            merged = merge_cache_states([per_rank[branch] for per_rank in gathered], self._stages)
            state.update({prefix + key: value for key, value in merged.items()})
        return state

    def stage_stats(self) -> list[dict[str, float]]:
        """Every stage's `StageStats` so far (leader, between chunks, before the last): compute, waits, forwards."""
        if self._next_chunk >= self.num_chunks:
            raise RuntimeError("`stage_stats()` of a split stream after its last chunk: the other stages have ended.")
        self._broadcast_control(SEND_STATS)
        gathered: list[Any] = [None] * self._link.world_size
        dist.gather_object(dataclasses.asdict(self._link.stats), gathered, dst=0)
        return gathered

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise ValueError(
            "`devices`: a split stream cannot resume from a saved state; resume on one device (drop `devices`), "
            "which continues the same video."
        )

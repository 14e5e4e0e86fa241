"""`StageLink`: what one stage of a split transformer sends and receives, and the hooks that do it.

    rank 0:  embed -> [blocks 0..a) --send--> .                                . <-broadcast- -> norm, proj
    rank 1:  embed -> . --recv--> [blocks a..b) --send--> .                    . <-broadcast- -> norm, proj
    rank N-1:embed -> . --recv--> [blocks b..n) --broadcast--------------------'              -> norm, proj

Every rank runs diffusers' Wan forward unchanged (`for block in self.blocks: ...`) over the blocks it holds: a
forward pre-hook on its first block replaces the hidden states with those received from the rank before (rank 0
keeps its own), a forward hook on its last block sends them on; the last rank broadcasts the final hidden states,
so every rank applies the output norm and projection to the same tensor and goes on in lockstep with the same
velocity. The embeddings, timestep projection and RoPE every block reads are recomputed on each rank (cheap, and
identical: same inputs), so only one `(batch, tokens, channels)` tensor crosses each hop.

A forward whose output is discarded (a context pass, a re-cache: only its cache writes matter) skips the broadcast
(`discarding()`): sends are asynchronous, so rank 0 starts the next chunk's first step while the later stages are
still writing the context; message order per pair of ranks keeps every stage's work in the same order.

Counters (`stats`): seconds spent in the stage's own blocks (`compute_s`), waiting for the rank before or for the
broadcast (`wait_s`), and forwards. Only on CPU are they exact (CUDA work is asynchronous).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class StageStats:
    """Host seconds of one stage: its blocks' work, the waits for its inputs, and the forwards counted."""

    compute_s: float = 0.0
    wait_s: float = 0.0
    forwards: int = 0


class StageLink:
    """Rank `rank` of `world_size` stages: receives from `rank - 1`, sends to `rank + 1`, the last broadcasts."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.last = world_size - 1
        self.stats = StageStats()
        self._discarding = False
        self._blocks_started = 0.0
        self._sends: list[dist.Work] = []  # asynchronous sends still in flight (their tensors kept alive with them)
        self._in_flight: list[torch.Tensor] = []

    @contextlib.contextmanager
    def discarding(self) -> Iterator[None]:
        """Forwards inside write caches only (their output is thrown away): no broadcast of the final states."""
        self._discarding = True
        try:
            yield
        finally:
            self._discarding = False

    def attach(self, first: nn.Module, last: nn.Module) -> None:
        """Hook the stage's first and last block (the same block when the stage holds one)."""
        first.register_forward_pre_hook(self._before_blocks)
        last.register_forward_hook(self._after_blocks)

    def _before_blocks(self, module: nn.Module, args: tuple) -> tuple:
        hidden_states = args[0]
        if self.rank > 0:
            started = time.perf_counter()
            received = torch.empty_like(hidden_states)
            dist.recv(received, src=self.rank - 1)
            self.stats.wait_s += time.perf_counter() - started
            hidden_states = received
        self._blocks_started = time.perf_counter()
        return (hidden_states, *args[1:])

    def _after_blocks(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        self.stats.compute_s += time.perf_counter() - self._blocks_started
        self.stats.forwards += 1
        if self.rank < self.last:
            self._send(output)
        if self._discarding or self.world_size == 1:
            return output  # nobody reads this forward's output: every rank goes on at once
        started = time.perf_counter()
        final = output.contiguous() if self.rank == self.last else torch.empty_like(output)
        self.flush()
        dist.broadcast(final, src=self.last)
        self.stats.wait_s += time.perf_counter() - started
        return final

    def _send(self, hidden_states: torch.Tensor) -> None:
        tensor = hidden_states.contiguous()
        self._sends.append(dist.isend(tensor, dst=self.rank + 1))
        self._in_flight.append(tensor)

    def flush(self) -> None:
        """Wait for every send still in flight (before a collective, and before the process group ends)."""
        for work in self._sends:
            work.wait()
        self._sends.clear()
        self._in_flight.clear()

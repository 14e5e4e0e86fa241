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

Rows in flight (`denoising="stream_batch"`, `inflight_batch.py`): each row is a forward of its own in discarding
mode, and the last rank sends the row's output (the velocity) back to every rank on a second process group
(`return_output`), so a rank posts that receive when it launches the row and waits for it only when it completes
the row, several rows later. The return channel is a group of its own so that on NCCL (one stream per pair and
communicator) a receive waiting for the way back never holds up a send on the way forward.

Counters (`stats`): seconds spent in the stage's own blocks (`compute_s`), waiting for the rank before, for the
broadcast or for a row's output (`wait_s`), forwards, and for rows in flight the most rows launched and not yet
completed at once (`in_flight_peak`) and the launches made while an earlier row was not yet completed
(`overlapped`: 0 for a serial chain). Only on CPU are the seconds exact (CUDA work is asynchronous).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

MAX_PENDING = 64  # asynchronous sends held at most before the oldest is waited for


@dataclass
class StageStats:
    """Host seconds of one stage: its blocks' work, the waits for its inputs, and the forwards counted."""

    compute_s: float = 0.0
    wait_s: float = 0.0
    forwards: int = 0
    in_flight_peak: int = 0  # rows in flight: the most launched and not yet completed at once
    overlapped: int = 0  # rows in flight: launches made while an earlier row was launched and not yet completed


class PendingOutput:
    """A row's output on its way back from the last rank: `wait()` returns it (the last rank holds its own)."""

    def __init__(self, output: torch.Tensor, work: dist.Work | None, stats: StageStats) -> None:
        self._output, self._work, self._stats = output, work, stats

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            started = time.perf_counter()
            self._work.wait()
            self._stats.wait_s += time.perf_counter() - started
            self._work = None
        return self._output


class StageLink:
    """Rank `rank` of `world_size` stages: receives from `rank - 1`, sends to `rank + 1`, the last broadcasts."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.last = world_size - 1
        self.stats = StageStats()
        self._discarding = False
        self._blocks_started = 0.0
        self._sends: list[tuple[dist.Work, Any]] = []  # asynchronous sends in flight, with what they keep alive
        self._returns: Any = None  # the process group of the way back (rows in flight), made at its first use

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
        self.keep(dist.isend(tensor, dst=self.rank + 1), tensor)

    def keep(self, work: dist.Work, tensors: Any) -> None:
        """Hold an asynchronous operation (and the tensors it reads) until it completes; completed ones are dropped
        here, and past `MAX_PENDING` the oldest is waited for (long received in a running pipeline; gloo's sends do not
        report completion), so rows in flight, which never flush, hold a bounded number of tensors."""
        self._sends = [(old, held) for old, held in self._sends if not old.is_completed()]
        self._sends.append((work, tensors))
        while len(self._sends) > MAX_PENDING:
            self._sends.pop(0)[0].wait()

    def flush(self) -> None:
        """Wait for every send still in flight (before a collective, and before the process group ends)."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()

    def return_output(self, output: torch.Tensor) -> PendingOutput:
        """The row's output, from the last rank to every rank, asynchronously: the last rank sends its `output`, the
        others post a receive into a tensor of its shape (theirs is thrown away) and wait only in `wait()`."""
        if self._returns is None:  # every rank reaches its first row in flight at the same point of the loop
            self._returns = dist.new_group(list(range(self.world_size)))
        if self.rank != self.last:
            received = torch.empty_like(output)
            return PendingOutput(received, dist.irecv(received, src=self.last, group=self._returns), self.stats)
        output = output.contiguous()
        for rank in range(self.last):
            self.keep(dist.isend(output, dst=rank, group=self._returns), output)
        return PendingOutput(output, None, self.stats)

"""Rows in flight through the stages: `denoising="stream_batch"` on a split stream, software-pipelined, exact.

StreamDiffusionV2's stream batch (`rolldiff.pipelines.stream_batch`) runs forward f as ONE call over S rows, row r
holding chunk f - r at step r and reading and writing cache r only. Rows never meet, so here each row is a
micro-batch of its own: item (f, r) is row r of forward f, and every stage runs the items in the one order
(f, 0), (f, 1), ..., (f, S-1), (f+1, 0), ... . Item (f+1, r+1) continues item (f, r) (the same chunk, one step on),
which left stage 0 S items earlier, so with N <= S + 1 stages stage 0 never waits for it:

    stage 0:  (f,0) (f,1) (f,2) (f,3) (f+1,0) (f+1,1) ...           S = 4 rows, N = 3 stages, one slot = one item
    stage 1:        (f,0) (f,1) (f,2) (f,3)   (f+1,0) (f+1,1) ...
    stage 2:              (f,0) (f,1) (f,2)   (f,3)   (f+1,0) ...
                                  `--> (f,0)'s output back to every rank; (f+1,1) needs it, 4 slots after (f,0)

On every rank (SPMD) an item is *launched* (stage 0: embed, its blocks, an asynchronous send; a middle stage:
receive, its blocks, send; the last: receive, its blocks, the head, and the row's output sent back to every rank,
`StageLink.return_output`) apart from being *completed* (wait for that output, then the per-row x0 and re-noise,
`_row_step`, the one-process loop's own math). A rank completes (f, r) only right before launching (f+1, r+1),
and the previous forward's leaving row (its clean chunk) after launching the whole next forward, so S items are in
flight. Cache r of a block is owned by one stage and written by (1, r), (2, r), ... in that order, each write
committed right after the stage's blocks ran it (commits need no output), as in one process.

Random draws do not depend on data: each forward's noises (the entering chunk's, then one re-noise per row that
goes on, row 0 first: the one-process order) are drawn when the forward's first row is launched, and applied when
each row completes. So the video is the one-process `stream_batch` video up to the float reordering of a batched
forward against per-row forwards (tests/test_pipeline_parallel_inflight.py states the tolerance).

A split stream returns chunk c after launching forward c + S (one forward later than one process), so at a chunk
boundary the next forward's rows are in flight: `state_dict()` is refused from the first batched forward on (the
first chunk, denoised alone, still saves), and a stop drains what is in flight on every rank before the ranks part.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from ..stream_batch import BatchRow
from .link import PendingOutput, StageLink


@dataclass
class LaunchedRow:
    """Item (forward, step) once launched: its input row, its re-noise (None at the last step) and its output on the
    way back; once completed, the row going on (None at the last step)."""

    forward: int
    step: int
    row: BatchRow
    noise: torch.Tensor | None
    output: PendingOutput
    going_on: BatchRow | None = None
    completed: bool = False

    @property
    def chunk(self) -> int:
        return self.row.chunk


class InFlightStreamBatch:
    """The stream batch of a `ParallelChunkStream` with rows in flight (a mixin over `ChunkStream`'s stream batch:
    the same entering rows, noises, caches, commits and per-row math, in another order of launches)."""

    _link: StageLink | None

    def _init_in_flight(self) -> None:
        self._flight: deque[LaunchedRow] = deque()  # launched, not yet completed, in launch order
        self._slots: list[BatchRow | LaunchedRow | None] | None = None  # what each row of the next forward continues
        self._cleans: dict[int, torch.Tensor] = {}  # completed chunks not yet returned (model dtype)

    @property
    def rows_in_flight(self) -> int:
        """Rows launched and not yet completed on this rank."""
        return len(self._flight)

    def _stream_batch_chunk(self, index: int) -> torch.Tensor | None:
        """Chunk `index`'s clean latents: forwards launched row by row until the chunk has left its last row."""
        if self._link is None or self._link.world_size == 1:
            return super()._stream_batch_chunk(index)  # one stage: nothing to overlap
        if not self._row_caches:
            self._make_row_caches()
        if self._slots is None:
            self._slots = list(self._batch_rows)  # the fill rows
        while index not in self._cleans:
            if not self._next_forward():
                return None  # drained: the input ended
        return self._cleans.pop(index)

    def _next_forward(self) -> bool:
        """Launch the next forward's rows, each right after completing the row it continues; then complete the
        previous forward's leaving row. With nothing left to enter or go on, complete what is in flight; False when
        nothing is."""
        rows = [self._entering_row(), *self._slots]  # the entering chunk's noise is drawn here, first
        if not any(slot is not None and slot.chunk >= 1 for slot in rows):
            if not self._flight:
                return False
            self._complete_through(self._flight[-1])
            return True
        last = len(rows) - 1
        going_on = [(step, slot) for step, slot in enumerate(rows[:last]) if slot is not None]
        noises = {step: self._row_noise(_latents(slot)) for step, slot in going_on}  # in row order, row 0 first
        self._slots = [None] * last
        forward = self._forwards_done + 1
        for step, slot in enumerate(rows):
            if slot is not None:
                row = self._arrived(slot) if step > 0 else slot
                launched = self._launch(forward, step, row, noises.get(step))
                if step < last:
                    self._slots[step] = launched
        self._forwards_done, self._step_index = forward, self._step_index + 1
        while self._flight and self._flight[0].forward < forward:  # the previous forward's leaving row
            self._complete(self._flight.popleft())
        return True

    def _arrived(self, slot: BatchRow | LaunchedRow) -> BatchRow:
        """The row that `slot` goes on as: a fill row as it is, a launched row once completed."""
        if isinstance(slot, BatchRow):
            return slot
        self._complete_through(slot)
        return slot.going_on

    def _launch(self, forward: int, step: int, row: BatchRow, noise: torch.Tensor | None) -> LaunchedRow:
        """Run this stage's part of item (forward, step) through cache `step`, commit its write (a real chunk's), and
        post the return of its output."""
        stats = self._link.stats
        stats.overlapped += bool(self._flight)
        timestep = self._tables(row.plan)[1][step, :1]
        with self._link.discarding():  # the output comes back by `return_output`, not by a broadcast
            output = self._pipe.transformer_step(
                row.latents.to(self._placement[1]), timestep, self._embeds[0], self._row_caches[step], self._request
            )
        if row.chunk >= 1:  # a fill row's writes stay pending, as in one process
            self._commit_row(self._row_caches[step])
        launched = LaunchedRow(forward, step, row, noise, self._link.return_output(output))
        self._flight.append(launched)
        stats.in_flight_peak = max(stats.in_flight_peak, len(self._flight))
        return launched

    def _complete_through(self, item: LaunchedRow) -> None:
        while not item.completed:
            self._complete(self._flight.popleft())

    def _complete(self, item: LaunchedRow) -> None:
        """Wait for the item's output and do its row's math; a real chunk leaving the last row is kept to return."""
        velocity = item.output.wait().float()
        x0, item.going_on = self._row_step(item.step, item.row, velocity, item.noise)
        item.completed = True
        if item.noise is None and item.chunk >= 1:
            self._cleans[item.chunk] = x0.to(self._placement[1])

    def _drain_in_flight(self) -> None:
        """Complete every row in flight (a stop: every rank drains, so every send has its receive)."""
        while self._flight:
            self._complete(self._flight.popleft())

    def _refuse_state_in_flight(self) -> None:
        if self._slots is not None:
            raise RuntimeError(
                "`state_dict()` of a stream split over `devices` with denoising='stream_batch': from its first batched "
                "forward on, the next forward's rows are in flight at every chunk boundary, so no one-process state "
                "exists there. Drop `devices` to save states (the video is the same)."
            )


def _latents(slot: BatchRow | LaunchedRow) -> torch.Tensor:
    """A row's latents, or a launched row's input (the row it goes on as has the same shape)."""
    return slot.latents if isinstance(slot, BatchRow) else slot.row.latents

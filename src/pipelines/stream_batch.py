"""Stream-batch denoising (`denoising="stream_batch"`): StreamDiffusionV2's stream batch, one cache per step.

    forward f:  rows [ chunk f at step 0 | chunk f-1 at step 1 | ... | chunk f-S+1 at step S-1 ]   (S = the steps)
                cache  0                  1                          S-1   (row r reads and writes cache r only)

chenfengxu714/StreamDiffusionV2@c5a0f20 `streamv2v/inference.py:298-371` with
`models/wan/causal_stream_inference.py:202-296`: chunk 0 (the first block) is denoised alone, all its steps through
the stream's cache (the sequential loop, committed under `context_policy="last_step"`); that cache is then copied
into one cache per step (`:221-225`; row 0 keeps the original). Every later forward is ONE transformer call over a
batch of S rows, row r holding chunk f - r at step r; rows never meet, so cache r holds the earlier chunks' K/V as
written at step r, and each row's write is committed at once (no context pass). Until the batch is full, the rows
past the last entered chunk are fill rows: zeros at first (upstream's `hidden_states`), then their own re-noised
predictions moving down the batch; they write into their caches at chunk 1's position and are never shown, but
their adaptive-sink decisions stay in the queues. Each row's adaptive sink pops once per write after its first real
chunk (its policy becomes one write a chunk; before that the fill writes and chunk 1's share block 0's count). When
no chunk enters any more (the video or the input ended), the rows drain: the row that would enter is left out
(upstream re-feeds the last block there, never shown).

Noise: the entering chunk's noise (a video-to-video chunk's input is read and mixed then), then one re-noise per
row that goes on, row 0 first, fill rows included: upstream's draw order. The S caches are allocated once (at the
first batched forward); nothing is allocated per forward beyond the rows' latents, so memory per chunk is flat.
The rows in flight and the S caches are the stream's state (`state_dict`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers.utils.torch_utils import randn_tensor

from ..caching import AdaptiveSinkLayer, AdaptiveSinkPolicy
from .request.steps import StepPlan


@dataclass
class BatchRow:
    """One row of the batch: the chunk it holds (below 1: a fill row, never shown) and its latents (float32)."""

    chunk: int
    latents: torch.Tensor  # (1, channels, chunk_frames, h, w)
    plan: StepPlan  # the chunk's steps (its first may follow the input's motion); a fill row's: chunk 0's


class StreamBatchDenoising:
    """The stream-batch loop of `ChunkStream` (a mixin: it reads the stream's request, schedules, velocity inputs
    and callback the way its sequential `_denoise_chunk` does)."""

    _row_caches: list  # cache r: step r's (row 0's is the stream's own `_caches[0]`); empty until the first batch
    _batch_rows: list[BatchRow | None]  # after a forward: the rows that go on, entry i at step i + 1 next
    _forwards_done: int  # batched forwards so far (chunk f enters at forward f)

    def _init_stream_batch(self) -> None:
        self._row_caches, self._batch_rows, self._forwards_done = [], [], 0
        self._plan_tables: dict[StepPlan, tuple[torch.Tensor, torch.Tensor]] = {}
        self._input_ended = False  # the input video ran out: nothing enters any more, the rows drain

    def _stream_batched(self, index: int) -> bool:
        """Whether chunk `index` comes out of the stream batch (every chunk after the first, under the mode)."""
        return self._request.denoising == "stream_batch" and index > 0

    def _refuse_switch_in_stream_batch(self) -> None:
        if self._request.denoising == "stream_batch":
            raise ValueError(
                "`switch_prompt`: under `denoising='stream_batch'` the chunks in flight sit at different steps in one "
                "forward, so a switch has no chunk boundary to land on; use denoising='sequential' to switch prompts."
            )

    # ---------------------------------------------------------------------------------------- the loop
    def _stream_batch_chunk(self, index: int) -> torch.Tensor | None:
        """Chunk `index`'s clean latents in the model's dtype: batched forwards until it leaves the last row (S of
        them for chunk 1, then one). None if the stream was interrupted or no chunk is left in flight."""
        if not self._row_caches:
            self._make_row_caches()
        while True:
            if self._interrupted.is_set():
                return None
            rows = self._entering_rows()
            if not any(row is not None and row.chunk >= 1 for row in rows):
                return None  # drained: the input ended
            clean = self._batch_forward(rows)
            if clean is not None:
                return clean

    def _make_row_caches(self) -> None:
        """Copy the first chunk's cache into one cache per step (allocated here, once) and condition them."""
        first, pipe = self._caches[0], self._pipe
        steps = len(self._request.step_plan_for(0).steps)
        device, dtype = self._placement
        copies = [pipe.make_stream_cache(self._request, dtype, device) for _ in range(steps - 1)]
        state = first.state_dict()
        for cache in copies:
            cache.load_state_dict(state)
            pipe.set_conditioning(cache, self._embeds[0])
        self._row_caches = [first, *copies]
        if not self._batch_rows:  # the fill rows: zeros (upstream's `hidden_states` before the batch is full)
            plan, zeros = self._request.step_plan_for(0), torch.zeros(self._request.chunk_shape, device=device)
            self._batch_rows = [BatchRow(-step, zeros.clone(), plan) for step in range(steps - 1)]

    def _entering_rows(self) -> list[BatchRow | None]:
        """This forward's rows, row r at step r: the entering chunk (its noise drawn now, its input read and mixed
        now), then the rows that went on; None where no chunk is (the entering one once nothing enters)."""
        return [self._entering_row(), *self._batch_rows]

    def _entering_row(self) -> BatchRow | None:
        """The chunk entering the next forward at row 0 (its noise drawn now, its input read and mixed now), or None
        once nothing enters (the video or the input ended)."""
        request, index = self._request, self._forwards_done + 1
        entering = None
        if index < request.num_chunks and not self._input_ended:
            plan, given, level = request.step_plan_for(index), None, None
            if self._inputs is not None and self._inputs.is_video:
                given = self._inputs.latents(index, request.geometry.chunk_size(index))
                if given is not None and self._inputs.noise_mix is not None:
                    plan, level = self._inputs.noise_mix.plan_and_level(plan, request.step_mapping)
                self._input_ended = given is None
            if not self._input_ended:
                sigma = self._tables(plan)[0][0] if level is None else level
                entering = BatchRow(index, self._starting_latents(index, given, sigma), plan)
        return entering

    def _batch_forward(self, rows: list[BatchRow | None]) -> torch.Tensor | None:
        """One forward of every row through its own cache; commits each real row's write, re-noises the rows that
        go on; the clean latents of the chunk leaving the last row (None while the batch fills)."""
        pipe, request = self._pipe, self._request
        dtype = self._placement[1]
        live = [(step, row) for step, row in enumerate(rows) if row is not None]
        latents = torch.cat([row.latents for _, row in live])
        timestep = torch.cat([self._tables(row.plan)[1][step, :1] for step, row in live])
        embeds = self._embeds[0].expand(len(live), *self._embeds[0].shape[1:])
        caches = [self._row_caches[step] for step, _ in live]  # one row: its cache alone, as a sequential step's
        cache = caches[0] if len(caches) == 1 else caches
        velocity = pipe.transformer_step(latents.to(dtype), timestep, embeds, cache, request).float()
        last, clean = len(rows) - 1, None
        going_on: list[BatchRow | None] = [None] * last
        for (step, row), row_velocity in zip(live, velocity.split(1)):
            if row.chunk >= 1:  # a fill row's writes stay pending: chunk 1 writes the same slots after them
                self._commit_row(self._row_caches[step])
            noise = None if step == last else self._row_noise(row.latents)
            x0, going_on_row = self._row_step(step, row, row_velocity, noise)
            if step == last:
                clean = x0 if row.chunk >= 1 else None
            else:
                going_on[step] = going_on_row
        self._batch_rows, self._forwards_done = going_on, self._forwards_done + 1
        self._after_batch_step(timestep)
        return None if clean is None else clean.to(dtype)

    def _row_noise(self, latents: torch.Tensor) -> torch.Tensor:
        """The re-noise of a row that goes on, shaped as its `latents` (one draw a row, in row order: upstream's)."""
        return randn_tensor(
            latents.shape, generator=self._request.generator, device=latents.device, dtype=torch.float32
        )

    def _row_step(
        self, step: int, row: BatchRow, velocity: torch.Tensor, noise: torch.Tensor | None
    ) -> tuple[torch.Tensor, BatchRow | None]:
        """A row after its step: its x0 = x_t - sigma v (float32), and the row going on, re-noised to the next sigma
        with `noise` (None at the last step: nothing goes on). The one home of the per-row math (a split stream's
        rows complete through it too)."""
        sigmas = self._tables(row.plan)[0]
        x0 = row.latents - sigmas[step] * velocity
        if noise is None:
            return x0, None
        next_sigma = sigmas[step + 1]
        return x0, BatchRow(row.chunk, (1 - next_sigma) * x0 + next_sigma * noise, row.plan)

    def _commit_row(self, cache) -> None:
        """Commit a row's write; from its first real chunk on, its adaptive sink pops at every write."""
        cache.commit()
        _one_write_a_chunk(cache)

    def _after_batch_step(self, timestep: torch.Tensor) -> None:
        """The callback sees (and may replace) the rows that go on, along the frame axis, row 0 first."""
        going_on = [row for row in self._batch_rows if row is not None]
        if not going_on or self._request.callback_on_step_end is None:
            self._step_index += 1
            return
        latents = self._after_step(torch.cat([row.latents for row in going_on], dim=2), timestep)
        for row, part in zip(going_on, latents.split([row.latents.shape[2] for row in going_on], dim=2)):
            row.latents = part

    def _tables(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """The plan's sigmas (float32) and fed timesteps `(steps, batch)` on the device, the sequential loop's own
        values (`_schedule`), made once per plan: a forward sets no scheduler."""
        tables = self._plan_tables.get(plan)
        if tables is None:
            scheduler, fed = self._schedule(plan, self._placement[0])
            tables = self._plan_tables[plan] = (scheduler.sigmas.clone(), fed)
        return tables

    # ---------------------------------------------------------------------------------------- state
    def _stream_batch_bytes(self) -> int:
        return sum(cache.memory_bytes() for cache in self._row_caches[1:])

    def _stream_batch_state(self) -> dict[str, Any]:
        """The copies of the cache (rows 1..S-1; row 0's is `cache.0`), the rows in flight and the forwards done."""
        if not self._row_caches:
            return {}
        state: dict[str, Any] = {}
        for row, cache in enumerate(self._row_caches[1:], start=1):
            state.update({f"stream_batch.cache.{row}.{key}": value for key, value in cache.state_dict().items()})
        held = [row is not None for row in self._batch_rows]
        chunks = [row.chunk if row is not None else 0 for row in self._batch_rows]
        state["stream_batch.rows"] = torch.tensor([chunks, held], dtype=torch.int64)
        rows = enumerate(self._batch_rows)
        state.update({f"stream_batch.latents.{i}": row.latents for i, row in rows if row is not None})
        state["stream_batch.forwards"] = torch.tensor([self._forwards_done], dtype=torch.int64)
        return state

    def _load_stream_batch_state(self, state: dict[str, Any], device: torch.device) -> None:
        """Restore the copies, their policies and the rows. A restored row is past its first step, which is the only
        one a motion-adapted plan changes, so its plan is the request's for its chunk."""
        self._init_stream_batch()
        if "stream_batch.forwards" not in state:
            return
        self._forwards_done = int(state["stream_batch.forwards"][0])
        self._make_row_caches()
        for row, cache in enumerate(self._row_caches[1:], start=1):
            prefix = f"stream_batch.cache.{row}."
            cache.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
            self._pipe.set_conditioning(cache, self._embeds[0])
        for row, cache in enumerate(self._row_caches):
            if self._forwards_done > row:  # it has committed a real chunk: one write a chunk from then on
                _one_write_a_chunk(cache)
        chunks, held = state["stream_batch.rows"].tolist()
        self._batch_rows = [
            BatchRow(
                chunk,
                state[f"stream_batch.latents.{i}"].to(device=device, dtype=torch.float32),
                self._request.step_plan_for(max(chunk, 0)),
            )
            if kept
            else None
            for i, (chunk, kept) in enumerate(zip(chunks, held))
        ]


def _one_write_a_chunk(cache) -> None:
    """A row's cache is written once a chunk after its first real chunk: its adaptive sinks pop at every write."""
    for layer in cache:
        if isinstance(layer, AdaptiveSinkLayer) and layer.policy.forwards_per_chunk != 1:
            layer.policy = AdaptiveSinkPolicy(layer.policy.threshold, 1)

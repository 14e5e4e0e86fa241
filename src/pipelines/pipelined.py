"""Pipelined denoising (`denoising="pipelined"`): every step's chunk in flight, one forward for all of them.

    forward f:  [ chunk f-S+1 at step S-1 | ... | chunk f-1 at step 1 | chunk f at step 0 ]   (S = the steps)
                  oldest, cleanest                                      newest, pure noise

Rolling Forcing's rolling window (thu-ml/Causal-Forcing `long_video/pipeline/rolling_forcing_inference.py:169-230`)
and the idea of StreamDiffusionV2's stream batch: instead of S forwards of one chunk per chunk, one forward of S
chunks at staggered noise levels, each advancing one step. Per forward: the chunk at its last step leaves clean
(the stream then runs its context pass over it and commits it, as in the sequential loop), the others are
re-noised to their next sigma, and a fresh noisy chunk enters at the next forward. The first S - 1 forwards fill
the window (chunks 0..f at the noisiest levels); at the end of the video no chunk enters and the window empties.

The in-flight chunks are the cache's pending region: the request's layout has a chunk of S x `chunk_frames`
(`build_request`), so each forward writes them into the same ring slots (never over a visible committed token),
they attend to the sink, the latest committed frames and to each other bidirectionally, and the context pass of
the leaving chunk overwrites its first slots before `commit()`. Nothing is allocated per forward beyond the
latents of the window; memory and time per chunk stay flat.

Noise: a chunk's starting noise is drawn when it enters (a video-to-video chunk's input is read then, and noised
to its first sigma); after each forward, one draw per chunk that goes on, oldest first; none for the chunk that
leaves (upstream's `continue`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers.utils.torch_utils import randn_tensor


@dataclass
class InFlightChunk:
    """One chunk in the window: its index, its latents at its current noise level (float32), its next step."""

    index: int
    latents: torch.Tensor  # (batch, channels, chunk_frames, h, w)
    step: int


class PipelinedDenoising:
    """The pipelined loop of `ChunkStream` (a mixin: it reads the stream's request, scheduler, velocity and
    callback the way its sequential `_denoise_chunk` does)."""

    _in_flight: list[InFlightChunk]
    _next_entering: int | None  # the next chunk to enter the window (None: not started)

    def _init_pipelined(self) -> None:
        self._in_flight = []
        self._next_entering = None

    def _pipelined_chunk(self, index: int) -> torch.Tensor | None:
        """Chunk `index`'s clean latents in the model's dtype: forwards until it leaves the window (S of them for
        the first chunk, then one). None if the stream was interrupted or the input video ended first."""
        if self._next_entering is None:
            self._next_entering = index  # after a start image's chunk, the first denoised one
        while True:
            if self._interrupted.is_set():
                return None
            self._enter_next_chunk()
            if not self._in_flight:
                return None
            clean = self._pipelined_forward()
            if clean is not None:
                return clean

    def _enter_next_chunk(self) -> None:
        """A fresh chunk joins the window (its noise drawn now; a video-to-video chunk's input read and noised)."""
        request, index = self._request, self._next_entering
        if index >= request.num_chunks:
            return
        plan = request.step_plan_for(index)  # every chunk's (`first_chunk_steps` is refused with this mode)
        if len(self._in_flight) >= len(plan.steps):
            return
        given = None
        if self._inputs is not None and self._inputs.is_video:
            given = self._inputs.latents(index, request.geometry.chunk_size(index))
            if given is None:  # the input ended: nothing enters any more, the window empties
                self._next_entering = request.num_chunks
                return
        sigma = None
        if given is not None:  # noised to its first sigma, or at the mix's own level (`video_noise_mix="strength"`)
            if self._inputs.noise_mix is not None:
                plan, sigma = self._inputs.noise_mix.plan_and_level(plan, request.step_mapping)
            if sigma is None:
                sigma = self._schedule(plan, self._placement[0])[0].sigmas[0]
        noisy = self._starting_latents(index, given, sigma)
        self._in_flight.append(InFlightChunk(index, noisy, 0))
        self._next_entering = index + 1

    def _pipelined_forward(self) -> torch.Tensor | None:
        """One forward over the window; the leaving chunk's clean latents (None while the window fills)."""
        request = self._request
        plan = request.step_plan_for(self._in_flight[0].index)
        scheduler, fed = self._schedule(plan, self._placement[0])
        sigmas = scheduler.sigmas
        window = torch.cat([chunk.latents for chunk in self._in_flight], dim=2)  # (B, C, frames, h, w)
        timestep = torch.cat(
            [fed[chunk.step].unsqueeze(1).expand(-1, chunk.latents.shape[2]) for chunk in self._in_flight], dim=1
        )  # (B, frames): each chunk's frames at its own step
        velocity = self._velocity(window.to(self._placement[1]), timestep).float()
        clean, going_on, offset = None, [], 0
        for chunk in self._in_flight:
            frames = chunk.latents.shape[2]
            x0 = chunk.latents - sigmas[chunk.step] * velocity[:, :, offset : offset + frames]
            offset += frames
            if chunk.step + 1 == len(plan.steps):
                clean = x0  # the oldest: it leaves the window clean
                continue
            noise = randn_tensor(x0.shape, generator=request.generator, device=x0.device, dtype=torch.float32)
            next_sigma = sigmas[chunk.step + 1]
            chunk.latents, chunk.step = (1 - next_sigma) * x0 + next_sigma * noise, chunk.step + 1
            going_on.append(chunk)
        self._in_flight = going_on
        if going_on:  # the callback sees (and may replace) the window that goes on
            latents = self._after_step(torch.cat([chunk.latents for chunk in going_on], dim=2), timestep)
            for chunk, part in zip(going_on, latents.split([c.latents.shape[2] for c in going_on], dim=2)):
                chunk.latents = part
        return None if clean is None else clean.to(self._placement[1])

    # ---------------------------------------------------------------------------------------- state
    def _pipelined_state(self) -> dict[str, Any]:
        """The window at a chunk boundary: each in-flight chunk's latents, index and step, and the next to enter."""
        if self._next_entering is None:
            return {}
        state = {f"pipelined.latents.{i}": chunk.latents for i, chunk in enumerate(self._in_flight)}
        steps = [[chunk.index, chunk.step] for chunk in self._in_flight]
        state["pipelined.steps"] = torch.tensor(steps, dtype=torch.int64).reshape(-1, 2)
        state["pipelined.next"] = torch.tensor([self._next_entering], dtype=torch.int64)
        return state

    def _load_pipelined_state(self, state: dict[str, Any], device: torch.device) -> None:
        self._init_pipelined()
        if "pipelined.next" not in state:
            return
        self._next_entering = int(state["pipelined.next"][0])
        for i, (index, step) in enumerate(state["pipelined.steps"].tolist()):
            latents = state[f"pipelined.latents.{i}"].to(device=device, dtype=torch.float32)
            self._in_flight.append(InFlightChunk(int(index), latents, int(step)))

"""Sessions denoised together: one transformer forward per step for a group of sessions, each through its own cache.

A session's `ChunkStream` is unchanged: it runs its own chunk loop (noise, scheduler steps, context pass, commit,
decode) in a thread of its own, against a `LockstepPipeline`, a view of the shared pipeline whose
`transformer_step` hands the call to the group's `Lockstep` instead of running it. The lockstep waits until
every member of the group has handed in its next call (or has finished its chunk), then runs them as ONE
forward: latents, timesteps and text stacked along the batch, `kv_cache=[each session's cache]`, so each row is
written to and attends through its own cache at its own position and window fill
(`KreaRealtimeTransformer3DModel.forward` with a list of caches), and hands each member its row back.

Members need not be at the same step: a row's timestep is its own, so a session's clean context pass (t = 0)
may share a forward with another's denoising step. Calls that cannot share a forward (another chunk shape,
layout or attention setting, or a batch of more than one row) run as separate forwards of the same round.
The chunk's decode goes the same way: the view's decoders (`LockstepDecoder`) hand their `decode` to the
lockstep, and the members whose feature caches are at the same state (all past their first chunk, or all at it)
decode in ONE call, their caches stacked along the batch (`rolldiff.pipelines.codecs.stacked_decode`); a member at
its first chunk beside older ones, or with another decoder (the tiny autoencoder), decodes alone in the same round.
Outside a group (`lockstep` None) the view calls the pipeline directly: a session alone runs exactly the
library's code, so its frames equal `pipe.stream(...)`'s bit for bit. In a group each row differs from its
solo run only by float reordering in the batched matrix products and convolutions (docs/serving.md,
tests/test_serving.py, tests/test_serving_batched.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from ..pipelines.codecs.stacked_decode import decode_stacked, stack_key
from ..pipelines.stream import ChunkStream


@dataclass
class StepCall:
    """One member's `transformer_step` call, waiting for its round; `result` is its velocity."""

    latents: torch.Tensor
    timestep: torch.Tensor
    embeds: torch.Tensor
    cache: Any
    request: Any
    result: torch.Tensor | None = None
    error: BaseException | None = None
    done: bool = False

    def key(self) -> tuple | None:
        """What must be equal for two calls to share a forward; None (runs alone) for a call of several rows."""
        if self.latents.shape[0] != 1:
            return None
        request = self.request
        return (
            "forward",
            tuple(self.latents.shape[1:]),
            self.latents.dtype,
            self.latents.device,
            tuple(self.embeds.shape[1:]),
            request.layout,
            request.options,
        )


@dataclass
class DecodeCall:
    """One member's chunk decode, waiting for its round; `result` is its frames `(1, 3, frames, H, W)`."""

    decoder: Any
    latents: torch.Tensor
    result: torch.Tensor | None = None
    error: BaseException | None = None
    done: bool = False

    def key(self) -> tuple | None:
        """Decodes with equal keys run as one call (caches stacked); None: this one decodes alone."""
        key = stack_key(self.decoder, self.latents)
        return None if key is None else ("decode", key)


class Lockstep:
    """The rounds of one group: each round, one forward over the calls of every member still making its chunk.

    Members run one at a time between rounds: a member holds the baton from `enter()` until it hands in a call, and
    takes it back once the round ran, so their host work (scheduler steps, decoding, frame encoding) never contends
    for the GIL (eight threads doing it at once were slower on 2 cores than one doing it in turn). A member that
    finishes its chunk (or fails) `leave()`s, so the others never wait for it. The round runs in the thread of the
    member that completed it (the others are waiting anyway). `forwards` counts the forwards that
    ran, `shared_rows` the rows of those that served more than one member; `decodes` and `shared_decodes` the same
    for chunk decodes.
    """

    def __init__(self, pipe: Any, members: int) -> None:
        self._pipe = pipe
        self._live = members
        self._waiting: list[StepCall] = []
        self._turn = threading.Condition()
        self._baton = threading.Lock()
        self.forwards = 0
        self.shared_rows = 0
        self.decodes = 0
        self.shared_decodes = 0

    def enter(self) -> None:
        """A member starts its chunk: it runs once no other member is between two rounds."""
        self._baton.acquire()

    def submit(self, call: StepCall | DecodeCall) -> torch.Tensor:
        """Hand in `call`; returns its result once its round ran (raises what the round raised)."""
        self._baton.release()
        try:
            self._wait_for_round(call)
        finally:
            self._baton.acquire()
        if call.error is not None:
            raise call.error
        return call.result

    def _wait_for_round(self, call: StepCall | DecodeCall) -> None:
        with self._turn:
            self._waiting.append(call)
            while not call.done:
                if len(self._waiting) >= self._live:  # every member still working is waiting: run the round
                    calls, self._waiting = self._waiting, []
                    self._turn.release()
                    try:
                        self._run(calls)
                    finally:
                        self._turn.acquire()
                    for done in calls:
                        done.done = True
                    self._turn.notify_all()
                else:
                    self._turn.wait()

    def leave(self) -> None:
        """A member's chunk is done (after `enter()`): the round no longer waits for it."""
        self._baton.release()
        with self._turn:
            self._live -= 1
            self._turn.notify_all()  # if the rest all wait, one of them runs the round

    def _run(self, calls: list[StepCall | DecodeCall]) -> None:
        for group in group_by_key(calls, lambda call: call.key()):
            try:
                results = self._decode(group) if isinstance(group[0], DecodeCall) else self._forward(group)
            except Exception as error:  # noqa: BLE001 (each member reports it as its chunk's failure)
                for call in group:
                    call.error = error
                continue
            for call, result in zip(group, results):
                call.result = result

    def _forward(self, calls: list[StepCall]) -> list[torch.Tensor]:
        self.forwards += 1
        first = calls[0]
        if len(calls) == 1:
            return [
                self._pipe.transformer_step(first.latents, first.timestep, first.embeds, first.cache, first.request)
            ]
        velocity = self._pipe.transformer_step(
            torch.cat([call.latents for call in calls]),
            torch.cat([call.timestep for call in calls]),
            torch.cat([call.embeds for call in calls]),
            [call.cache for call in calls],  # one cache per row
            first.request,  # the calls' layout and attention settings are equal (`StepCall.key`)
        )
        self.shared_rows += len(calls)
        return list(velocity.split(1))

    def _decode(self, calls: list[DecodeCall]) -> list[torch.Tensor]:
        self.decodes += 1
        if len(calls) == 1:
            return [calls[0].decoder.decode(calls[0].latents)]
        self.shared_decodes += len(calls)
        return decode_stacked([call.decoder for call in calls], [call.latents for call in calls])


def group_by_key(items: list, key: Callable[[Any], Hashable | None], limit: int | None = None) -> list[list]:
    """`items` in order, grouped by `key` (equal keys together, at most `limit` to a group); a None key stays alone."""
    groups: list[tuple[Hashable | None, list]] = []
    for item in items:
        item_key = key(item)
        group = next(
            (g for k, g in groups if item_key is not None and k == item_key and (limit is None or len(g) < limit)),
            None,
        )
        if group is None:
            groups.append((item_key, [item]))
        else:
            group.append(item)
    return [group for _, group in groups]


class LockstepPipeline:
    """One session's view of the shared pipeline: everything is the pipeline's, except that while the session is in
    a group (`lockstep` set by the scheduler) its transformer steps, context passes, re-caches and chunk decodes go
    through the group's `Lockstep`. Holds no state but that link, so a stream's `state_dict` is unchanged."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self.lockstep: Lockstep | None = None

    def __getattr__(self, name: str) -> Any:  # only reached for what this view does not define
        return getattr(self.pipe, name)

    def transformer_step(self, latents, timestep, embeds, cache, request) -> torch.Tensor:
        lockstep = self.lockstep
        if lockstep is None:
            return self.pipe.transformer_step(latents, timestep, embeds, cache, request)
        return lockstep.submit(StepCall(latents, timestep, embeds, cache, request))

    def context_pass(self, *args: Any, **kwargs: Any) -> None:
        # the family's own context pass, run on this view so each of its forwards is a `transformer_step` above
        return type(self.pipe).context_pass(self, *args, **kwargs)

    def recache(self, *args: Any, **kwargs: Any) -> None:
        return type(self.pipe).recache(self, *args, **kwargs)

    def make_decoder(self) -> LockstepDecoder:
        return LockstepDecoder(self, self.pipe.make_decoder())


class LockstepDecoder:
    """A session's streaming decoder as its view hands it out: while the session is in a group, each chunk's decode
    goes through the group's `Lockstep` (decoded together with the other members' where their caches line up);
    otherwise, and for everything else (state, reset, counters), it is the pipeline's own decoder."""

    def __init__(self, view: LockstepPipeline, decoder: Any) -> None:
        self._view = view
        self.decoder = decoder

    def __getattr__(self, name: str) -> Any:  # only reached for what this wrapper does not define
        return getattr(self.decoder, name)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        lockstep = self._view.lockstep
        if lockstep is None or stack_key(self.decoder, latents) is None or _on_side_stream(latents):
            return self.decoder.decode(latents)
        return lockstep.submit(DecodeCall(self.decoder, latents))


def _on_side_stream(latents: torch.Tensor) -> bool:
    """Whether this decode runs on a CUDA stream of its own (an `OverlappedDecoder` decoding beside the next chunk's
    denoising): the round runs in another member's thread, on that thread's stream, outside the ordering the
    side stream's events promise, so such a decode stays in its own thread."""
    return latents.is_cuda and torch.cuda.current_stream(latents.device) != torch.cuda.default_stream(latents.device)


def batchable(pipe: Any) -> bool:
    """Whether `pipe`'s transformer takes one cache per batch row (`kv_cache=[...]`), so sessions can be batched."""
    return bool(getattr(pipe.transformer, "accepts_row_caches", False))


def batch_key(stream: ChunkStream) -> tuple | None:
    """Sessions with equal keys make their next chunks in lockstep: the same chunk shape and cache geometry, the
    same steps and guidance branches, so their forwards line up call for call. None: the session runs alone."""
    if not isinstance(stream.pipeline, LockstepPipeline):
        return None
    request = stream.request
    strength = None if request.conditioning is None else request.conditioning.strength
    return (
        request.chunk_shape,
        request.layout,
        request.options,
        request.step_plan_for(stream.next_chunk),
        request.uses_guidance,
        request.context_policy,
        request.denoising,
        strength,
    )

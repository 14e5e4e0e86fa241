"""The scheduler of `rolldiff serve`: one worker thread advances every session, one chunk at a time, in turn.

Fair by construction: each pass over the sessions gives every ready session one chunk, in a fixed rotation, so
no session waits for more than one chunk of each other session (a session whose client is slow, paused, or
whose input frames have not come is simply not ready, and costs the others nothing). Between two chunks of a
session the worker carries out its queued controls (a prompt switch, named by the chunk it applies to; a
suspend; a stop), so every control lands on a chunk boundary.

Batched (`max_batch` > 1): in each pass, the ready sessions whose next chunks line up (same chunk shape, cache
geometry, steps and guidance: `batching.batch_key`) are made together, up to `max_batch` at a time: each member's
chunk runs in a thread of its own, their transformer steps meet in one forward per step and their chunk decodes
in one decode where the decoders' caches line up (`rolldiff.serving.batching`). Fairness is unchanged: every ready
session still gets exactly one chunk per pass, whether it shares it or not; a session alone in its group runs as
before, in the worker thread.

Side by side (`parallel_groups` > 1, on a CPU with cores to spare: `rolldiff serve --parallel-groups`): the groups
of at least `PARALLEL_MIN_ROWS` sessions in a pass are made at once, each in a thread of its own (a group of at least
twice that many is split into balanced parts first, where there are fewer such groups than workers), so each core
runs a batched forward (torch releases the GIL in its kernels). A group smaller than that gains more from one
forward than from a second core (measured on 2 cores: 8 sessions as two groups of 4 side by side made 1.3x the
frames of one group of 8; 4 as two groups of 2, none more than one group of 4).
"""

from __future__ import annotations

import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch

from ..pipelines.io.video_writer import frames_to_uint8
from .batching import Lockstep, LockstepPipeline, batch_key, group_by_key
from .board import WorkerRow
from .frames import encode_frame
from .protocol import ProtocolError
from .session import Control, Session
from .store import SessionStore

PARALLEL_MIN_ROWS = 4  # the fewest sessions in a group made beside another (module docstring)


class Scheduler:
    """The worker thread and the sessions it serves."""

    def __init__(
        self,
        store: SessionStore | None,
        state_every: int = 0,
        idle_timeout: float = 300.0,
        max_frames: int | None = None,
        max_batch: int = 1,
        parallel_groups: int = 1,
        *,
        row: WorkerRow,
    ) -> None:
        self.store = store
        # this process's row of the server's counts: sessions (reserved at admission, given back when dropped here),
        # session steps in shared forwards, session chunks in shared decodes, groups made beside another
        self.row = row
        self.max_batch = max_batch
        self.parallel_groups = parallel_groups if max_batch > 1 else 1
        # the members of the groups made at once, and of the one the worker makes meanwhile
        members = max_batch * (self.parallel_groups + 1)
        self._members = ThreadPoolExecutor(members, "rolldiff-member") if max_batch > 1 else None
        self._groups = ThreadPoolExecutor(self.parallel_groups, "rolldiff-group") if self.parallel_groups > 1 else None
        self.state_every = state_every
        self.idle_timeout = idle_timeout
        self.max_frames = max_frames
        self._sessions: list[Session] = []
        self._turn = 0
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="rolldiff-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------ from the connections
    @property
    def sessions(self) -> int:
        with self._wake:
            return len(self._sessions)

    def add(self, session: Session) -> None:
        """Serve a session admitted with `row.reserve_session` (its count is given back when it is dropped)."""
        with self._wake:
            self._sessions.append(session)
            self._wake.notify_all()

    def remove(self, session: Session) -> None:
        """The client is gone: the session ends at once (mid-chunk, the chunk is finished and dropped)."""
        session.closed = True
        self.wake()

    def wake(self) -> None:
        with self._wake:
            self._wake.notify_all()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        self._thread.join(timeout=30)
        for pool in (self._members, self._groups):
            if pool is not None:
                pool.shutdown(wait=False)

    def suspend_all(self, reason: str, timeout: float = 60.0) -> None:
        """Ask every session to suspend at its next chunk boundary; returns when all are done (or `timeout`)."""
        with self._wake:
            sessions = list(self._sessions)
        for session in sessions:
            session.control("suspend", reason)
        self.wake()
        deadline = time.monotonic() + timeout
        while self.sessions and time.monotonic() < deadline:
            time.sleep(0.05)

    # ------------------------------------------------------------------------------------ the worker
    def _run(self) -> None:
        while True:
            with self._wake:
                self._end_idle()  # every pass: a paused session idles while the others keep the worker busy
                self._drop_closed()
                while not self._stopping and not self._work_to_do():
                    self._wake.wait(timeout=1.0)
                    self._end_idle()
                    self._drop_closed()
                if self._stopping:
                    return
                sessions = self._rotation()
            if self._members is None:
                for session in sessions:
                    self._serve(session)
            else:
                self._serve_batched(sessions)

    def _rotation(self) -> list[Session]:
        """The sessions in this pass's order: the rotation starts one later each pass (round robin)."""
        self._turn = (self._turn + 1) % max(1, len(self._sessions))
        return self._sessions[self._turn :] + self._sessions[: self._turn]

    def _work_to_do(self) -> bool:
        return any(s.has_controls() or s.ready() for s in self._sessions)

    def _drop_closed(self) -> None:
        for session in [s for s in self._sessions if s.closed]:
            self._sessions.remove(session)
            self.row.add("sessions", -1)
            session.stream.close()  # caches, decoder and input reader go with the stream

    def _end_idle(self) -> None:
        now = time.monotonic()
        for session in self._sessions:
            if not session.closed and now - session.last_activity > self.idle_timeout:
                self._finish(session, "idle")

    def _serve(self, session: Session) -> None:
        if self._controls_then_ready(session):
            self._make_chunk(session)

    def _controls_then_ready(self, session: Session) -> bool:
        """Carry out the session's queued controls (a chunk boundary); whether it is then ready for a chunk."""
        for control in session.take_controls():
            if session.closed:
                return False
            self._carry_out(session, control)
        return session.ready()

    def _serve_batched(self, sessions: list[Session]) -> None:
        """One pass: every session's controls, then one chunk for each ready session, in groups that share forwards."""
        ready = [session for session in sessions if self._controls_then_ready(session)]
        groups = group_by_key(ready, lambda session: batch_key(session.stream), self.max_batch)
        large = sum(len(group) >= PARALLEL_MIN_ROWS for group in groups)
        parts = max(1, self.parallel_groups // max(1, large))  # split only as far as the workers go
        groups = [part for group in groups for part in split_group(group, parts, PARALLEL_MIN_ROWS)]
        beside = [group for group in groups if len(group) >= PARALLEL_MIN_ROWS]
        if self._groups is None or len(beside) < 2:
            beside = []
        futures = [self._groups.submit(self._make_group, group) for group in beside]
        inline = [group for group in groups if len(group) < PARALLEL_MIN_ROWS] if beside else groups
        for group in inline:  # meanwhile, in the worker thread
            self._make_group(group)
        for future in futures:
            future.result()
        self.row.add("side_by_side_groups", len(beside))

    def _make_group(self, group: list[Session]) -> None:
        if len(group) == 1:
            self._make_chunk(group[0])
        else:
            self._make_chunks_together(group)

    def _make_chunks_together(self, group: list[Session]) -> None:
        """Each member's next chunk in a thread of its own, their transformer steps batched by one `Lockstep`."""
        lockstep = Lockstep(group[0].stream.pipeline.pipe, len(group))

        def member(session: Session) -> None:
            view: LockstepPipeline = session.stream.pipeline
            view.lockstep = lockstep
            lockstep.enter()
            try:
                self._make_chunk(session)
            finally:
                view.lockstep = None
                lockstep.leave()

        for future in [self._members.submit(member, session) for session in group]:
            future.result()
        self.row.add("batched_rows", lockstep.shared_rows)
        self.row.add("batched_decodes", lockstep.shared_decodes)

    def _carry_out(self, session: Session, control: Control) -> None:
        if control.kind == "stop":
            self._finish(session, "stopped")
        elif control.kind == "suspend":
            self._suspend(session, control.payload)
        elif control.kind == "prompt":
            prompt, blend, scene_cut = control.payload
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # unknown words: the video shows it; a prompt with none is refused
                    chunk = session.stream.switch_prompt(prompt, blend_chunks=blend, scene_cut=scene_cut)
            except (ValueError, RuntimeError) as error:
                session.post(ProtocolError("bad_request", str(error), "prompt").as_message())
                return
            session.post({"type": "prompt.accepted", "chunk": chunk, "scene_cut": bool(scene_cut)})

    def _make_chunk(self, session: Session) -> None:
        stream = session.stream
        index, first_frame = stream.next_chunk, stream.frames_emitted
        started = time.perf_counter()
        try:
            frames = next(stream, None)
        except Exception as error:  # noqa: BLE001 (one session's failure must not stop the others)
            session.post(ProtocolError("internal", f"chunk {index} failed: {error}").as_message())
            session.closed = True
            return
        if frames is None:  # the input video ended (or the stream was interrupted)
            self._finish(session, "ended")
            return
        milliseconds = (time.perf_counter() - started) * 1000.0
        pixels = frames_to_uint8(frames[0])  # (frames, H, W, 3)
        output = session.start["format"]
        header = {
            "type": "chunk",
            "index": index,
            "first_frame": first_frame,
            "frames": int(pixels.shape[0]),
            "format": output,
            "ms": round(milliseconds, 2),
        }
        session.frames_made += int(pixels.shape[0])
        due = self.store is not None and self.state_every and (index + 1) % self.state_every == 0
        snapshot = self._snapshot(session) if due else None  # saved by the connection once this chunk is sent
        frames = [encode_frame(frame, output) for frame in pixels]
        session.post((header, frames, snapshot), counts_as_chunk=True)
        last = stream.next_chunk >= stream.num_chunks
        if last or (self.max_frames is not None and session.frames_made >= self.max_frames):
            self._finish(session, "complete" if last else "max_frames")

    def _snapshot(self, session: Session) -> tuple[int, dict] | None:
        """The stream's state now, copied to the host (the live buffers move on while the chunk waits to be sent);
        None for an input-video session, whose input lives in the client (a restore could not continue it)."""
        if session.inputs is not None:
            return None
        state = session.stream.state_dict()
        return session.frames_made, {k: v.to("cpu", copy=True) if torch.is_tensor(v) else v for k, v in state.items()}

    def _suspend(self, session: Session, reason: str | None) -> None:
        if self.store is None or session.inputs is not None:
            if reason == "shutdown":  # nothing to keep: the session ends, and says why
                self._finish(session, "shutdown")
                return
            why = (
                "this server keeps no sessions (no --state-dir)"
                if self.store is None
                else ("a session fed with input video cannot be suspended (its input lives in the client)")
            )
            session.post(ProtocolError("bad_request", why).as_message())
            return
        frames, state = self._snapshot(session)
        self.store.save(session.token, session.start, frames, state)
        session.post({"type": "suspended", "token": session.token, "frames": session.frames_made, "reason": reason})
        session.post(None)  # the connection closes after it
        session.closed = True

    def _finish(self, session: Session, reason: str) -> None:
        session.post({"type": "done", "frames": session.frames_made, "reason": reason})
        session.post(None)
        session.closed = True
        if self.store is not None:  # a finished session has nothing to restore (saved every chunk, or restored)
            self.store.delete(session.token)


def split_group(group: list, parts: int, min_rows: int) -> list[list]:
    """`group` in at most `parts` balanced parts of at least `min_rows` each, in order (itself if too small)."""
    count = max(1, min(parts, len(group) // min_rows))
    size = -(-len(group) // count)
    return [group[start : start + size] for start in range(0, len(group), size)]

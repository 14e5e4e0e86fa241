"""One session of `rolldiff serve`: a `ChunkStream` and what stands between it and one WebSocket client.

The stream is only ever advanced by the scheduler (`rolldiff.serving.scheduler`), one chunk at a time (by its
worker thread, or, batched with other sessions, by a member thread the worker waits for); the connection's
coroutine only queues controls (`prompt`, `pause`, `stop`, `suspend`) and input frames, and sends what the
worker put in the outbox. So a prompt switch always lands on a chunk boundary the worker
chose (and names it), and nothing the client does can corrupt a chunk in flight.

Backpressure: the worker makes a chunk only while fewer than `max_outbox` chunks wait to be sent (a slow client
pauses its own session; the server's memory does not grow), and, with a video input, only once the client has
sent the frames that chunk needs (`InputFrames`, bounded: a client that sends faster waits for the socket).
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..pipelines.stream import ChunkStream


class InputFrames(Iterator[np.ndarray]):
    """The client's input video: `(H, W, 3)` uint8 frames in arrival order, read by the stream's `VideoInput`.

    `next` blocks only as a safety net: the scheduler makes a chunk only when `available() >= needed` or the input
    has ended, so the worker never waits on a client."""

    def __init__(self, max_frames: int) -> None:
        self._frames: deque[np.ndarray] = deque()
        self._ready = threading.Condition()
        self.max_frames = max_frames
        self.ended = False

    def available(self) -> int:
        with self._ready:
            return len(self._frames)

    def room(self) -> bool:
        with self._ready:
            return len(self._frames) < self.max_frames

    def push(self, frame: np.ndarray) -> None:
        with self._ready:
            self._frames.append(frame)
            self._ready.notify_all()

    def end(self) -> None:
        with self._ready:
            self.ended = True
            self._ready.notify_all()

    def __next__(self) -> np.ndarray:
        with self._ready:
            while not self._frames and not self.ended:
                self._ready.wait(timeout=1.0)
            if not self._frames:
                raise StopIteration
            return self._frames.popleft()


@dataclass
class Control:
    """A client request the worker carries out between two chunks; `reply` sends its answer."""

    kind: str  # "prompt", "suspend", "stop"
    payload: Any = None


@dataclass
class Session:
    """A live session. `start` holds the `start` message's checked fields (what a restore rebuilds it from)."""

    stream: ChunkStream
    start: dict[str, Any]
    loop: asyncio.AbstractEventLoop
    outbox: asyncio.Queue
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    inputs: InputFrames | None = None
    max_outbox: int = 2
    paused: bool = False
    closed: bool = False
    chunks_sent: int = 0
    frames_made: int = 0
    last_activity: float = field(default_factory=time.monotonic)
    _queued: int = 0  # chunks in the outbox not yet sent
    _controls: deque = field(default_factory=deque)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def id(self) -> str:
        return self.token[:8]

    # ------------------------------------------------------------------------------------ from the connection
    def control(self, kind: str, payload: Any = None) -> None:
        with self._lock:
            self._controls.append(Control(kind, payload))
        self.touch()

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    def sent_one(self) -> None:
        """The connection sent one chunk of the outbox (the worker may make another)."""
        with self._lock:
            self._queued -= 1
        self.chunks_sent += 1
        self.touch()

    # ------------------------------------------------------------------------------------ from the worker
    def take_controls(self) -> list[Control]:
        with self._lock:
            controls, self._controls = list(self._controls), deque()
        return controls

    def has_controls(self) -> bool:
        with self._lock:
            return bool(self._controls)

    def ready(self) -> bool:
        """Whether the worker may make this session's next chunk now."""
        if self.closed or self.paused or self.stream.next_chunk >= self.stream.num_chunks:
            return False
        with self._lock:
            if self._queued >= self.max_outbox:
                return False  # a slow client: wait until it has taken what was made
        if self.inputs is not None and not self.inputs.ended:
            return self.inputs.available() >= self.stream.next_chunk_frames
        return True

    def post(self, item: Any, counts_as_chunk: bool = False) -> None:
        """Hand `item` (a message dict, or a `(header, frames, snapshot)` chunk) to the connection, thread-safely."""
        if counts_as_chunk:
            with self._lock:
                self._queued += 1
        try:
            self.loop.call_soon_threadsafe(self.outbox.put_nowait, item)
        except RuntimeError:  # the loop is gone: the server is shutting down
            pass

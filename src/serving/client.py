"""A Python client of `rolldiff serve`: a remote stream that iterates chunks as the library's stream does.

    >>> from rolldiff.serving import connect
    >>> with connect("ws://127.0.0.1:8000/v1/stream", prompt="a red circle moving left", seed=0, num_frames=48) as live:
    ...     for frames in live:                  # (frames, H, W, 3) uint8, one chunk at a time
    ...         live.switch_prompt("a blue square moving up")   # from the next chunk boundary
    ...         token = live.suspend()           # saved on the server; `restore(url, token)` continues it

Blocking (websockets' sync client); messages that are not chunks (`prompt.accepted`, `pong`, `error`) are kept
in `events` as they come.
"""

from __future__ import annotations

import base64
import io
import json
import os
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import PIL.Image
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from .protocol import PROTOCOL, ProtocolError


class RemoteStream(Iterator[np.ndarray]):
    """A session on a server: iterate it for each chunk's frames `(frames, H, W, 3)` uint8."""

    def __init__(self, url: str, first: dict[str, Any], token: str | None = None, timeout: float = 120.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else None
        # entered here and left in `close`: this object is the context the connection lives in. No keepalive pings:
        # a caller that stops reading for a while (its frames pile up in the library's queue, so TCP stalls and the
        # pong waits behind them) would otherwise be cut off with 1011; every read has its own `timeout` instead. No
        # compression: the frames are media (`rolldiff.serving.server.uvicorn_config`).
        self._socket = ws_connect(
            url, additional_headers=headers, max_size=None, open_timeout=timeout, ping_interval=None, compression=None
        ).__enter__()
        self._timeout = timeout
        self.events: list[dict[str, Any]] = []
        self._chunks: deque[np.ndarray] = deque()
        self.done: dict[str, Any] | None = None
        try:
            self._send(first)
        except ConnectionClosed:
            pass  # refused on arrival (a missing token): its `error` is read below
        self.ready = self._expect("ready")
        self.chunk_headers: list[dict[str, Any]] = []

    # ------------------------------------------------------------------------------------ reading
    def _send(self, message: dict[str, Any]) -> None:
        self._socket.send(json.dumps(message))

    def _read(self) -> dict[str, Any] | None:
        """One control message, or a whole chunk (queued in `_chunks`); None once the server closed."""
        try:
            text = self._socket.recv(timeout=self._timeout)
        except (ConnectionClosed, TimeoutError):
            return None
        if isinstance(text, bytes):
            raise ProtocolError("internal", "a binary message came outside a chunk")
        message = json.loads(text)
        if message.get("type") == "chunk":
            frames = [self._socket.recv(timeout=self._timeout) for _ in range(message["frames"])]
            self._chunks.append(self._decode(frames, message["format"]))
            self.chunk_headers.append(message)
        elif message.get("type") in ("done", "suspended"):
            self.done = message
        else:
            self.events.append(message)
        return message

    def _decode(self, frames: list[bytes], output: str) -> np.ndarray:
        height, width = self.ready["height"], self.ready["width"]
        if output == "raw":
            return np.stack([np.frombuffer(f, dtype=np.uint8).reshape(height, width, 3) for f in frames])
        return np.stack([np.asarray(PIL.Image.open(io.BytesIO(f)).convert("RGB")) for f in frames])

    def _expect(self, kind: str) -> dict[str, Any]:
        """Read until a `kind` message (chunks meanwhile are kept); an `error` raises it."""
        while True:
            message = self._read()
            if message is None:
                raise ConnectionError(f"the server closed the connection before {kind!r}")
            if message.get("type") == kind:
                return message
            if message.get("type") == "error":
                self.events.remove(message)
                raise ProtocolError(message["code"], message["message"], message.get("field"))

    def __iter__(self) -> RemoteStream:
        return self

    def __next__(self) -> np.ndarray:
        while not self._chunks:
            if self.done is not None or self._read() is None:
                raise StopIteration
        return self._chunks.popleft()

    # ------------------------------------------------------------------------------------ controls
    def switch_prompt(self, prompt: str, blend_chunks: int | None = None, scene_cut: bool = False) -> int:
        """Switch at the next chunk boundary (`scene_cut`: as a hard cut); returns the first chunk made under `prompt`."""
        self._send({"type": "prompt", "prompt": prompt, "blend_chunks": blend_chunks, "scene_cut": scene_cut})
        return self._expect("prompt.accepted")["chunk"]

    def send_frames(self, frames: Iterable[np.ndarray], image_format: str = "PNG") -> None:
        """Input video frames `(H, W, 3)` uint8, each sent as one PNG (or JPEG) message."""
        for frame in frames:
            buffer = io.BytesIO()
            PIL.Image.fromarray(np.asarray(frame, dtype=np.uint8)).save(buffer, format=image_format)
            self._socket.send(buffer.getvalue())

    def end_input(self) -> None:
        self._send({"type": "input.end"})

    def pause(self) -> None:
        self._send({"type": "pause"})

    def resume(self) -> None:
        self._send({"type": "resume"})

    def ping(self) -> None:
        self._send({"type": "ping"})
        self._expect("pong")

    def suspend(self) -> str:
        """Save the session on the server (at the next chunk boundary) and end this connection; the token
        `restore` takes. Chunks made before the cut stay readable by iterating."""
        self._send({"type": "suspend"})
        while self.done is None:
            if self._read() is None:
                raise ConnectionError("the server closed the connection before `suspended`")
        if self.done.get("type") != "suspended":
            raise ProtocolError("bad_request", f"the session ended before it could be suspended: {self.done}")
        return self.done["token"]

    def stop(self) -> dict[str, Any]:
        self._send({"type": "stop"})
        while self.done is None and self._read() is not None:
            pass
        return self.done or {}

    def close(self) -> None:
        self._socket.__exit__(None, None, None)

    def __enter__(self) -> RemoteStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def connect(url: str, prompt: str, *, token: str | None = None, image=None, **start: Any) -> RemoteStream:
    """Start a session: `start`'s fields as keywords (`seed`, `num_frames`, `height`, `width`, `format`,
    `input`, `strength`, `recipe`, `guidance_scale`); `image` a PIL image, an `(H, W, 3)` array or a picture file's
    path (image-to-video), as the library's `image=` takes."""
    message = {"type": "start", "prompt": prompt, **start}
    if image is not None:
        message.update(input="image", image=base64.b64encode(_png(image)).decode())
    return RemoteStream(url, message, token)


def _png(image: PIL.Image.Image | np.ndarray | str | os.PathLike) -> bytes:
    """The start image as PNG bytes (lossless), the file's picture for a path."""
    if isinstance(image, (str, os.PathLike)):  # refused here, as the library's `image=` refuses it
        if not os.path.isfile(image):
            raise ValueError(f"`image` {str(image)!r} is not a file.")
        try:
            with PIL.Image.open(image) as opened:
                picture = opened.convert("RGB")
        except OSError as exc:  # PIL's UnidentifiedImageError included
            raise ValueError(f"`image` {str(image)!r} cannot be read as a picture: {exc}") from None
    else:
        picture = image if isinstance(image, PIL.Image.Image) else PIL.Image.fromarray(np.asarray(image))
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


def restore(url: str, session_token: str, *, token: str | None = None) -> RemoteStream:
    """Continue a suspended session (also on a restarted server, or another one sharing `--state-dir`)."""
    return RemoteStream(url, {"type": "restore", "token": session_token}, token)


__all__ = ["PROTOCOL", "RemoteStream", "connect", "restore"]

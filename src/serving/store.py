"""Suspended sessions on disk: `--state-dir/TOKEN.resume.safetensors`, the stream's `state_dict()` plus the
`start` fields a restore rebuilds the stream from (`rolldiff.pipelines.io.resume`'s safe format: tensors in
safetensors, the rest JSON in its header; nothing is unpickled). Tokens are opaque, made by the server
(`secrets.token_urlsafe`) and checked against `TOKEN_PATTERN` before they name a file, so a restore can never
reach outside the folder. A shared folder lets any server of the same model restore a session."""

from __future__ import annotations

import base64
import math
import threading
from pathlib import Path
from typing import Any

from ..pipelines.io.resume import ResumeError, RunState, load_state, save_state
from .protocol import TOKEN_PATTERN, ProtocolError


class SessionStore:
    def __init__(self, folder: str | Path, model: str) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.model = model
        self._newest: dict[str, float] = {}  # token -> frames of the newest state written (inf: the session ended)
        self._lock = threading.Lock()

    def path(self, token: str) -> Path:
        if not TOKEN_PATTERN.match(token):
            raise ProtocolError("not_found", "no suspended session has this token", "token")
        return self.folder / f"{token}.resume.safetensors"

    def save(self, token: str, start: dict[str, Any], frames: int, state: dict[str, Any]) -> None:
        """Write atomically (a kill during a save keeps the previous state). A state older than one already written
        (`frames` fewer) is dropped: a chunk's snapshot saved after it was sent must not undo a later suspend; so is
        any state of a session that has ended (`delete`), however late its save comes."""
        path = self.path(token)
        with self._lock:
            if frames < self._newest.get(token, -1):
                return
            self._newest[token] = frames
        start = dict(start)
        if start.get("image") is not None:
            start["image"] = base64.b64encode(start["image"]).decode()
        fingerprint = {"model": self.model, "start": start}
        save_state(path, RunState(fingerprint, frames, state))
        if self._newest[token] == math.inf:  # the session ended while this was written: `delete` may have been first
            path.unlink(missing_ok=True)

    def load(self, token: str) -> tuple[dict[str, Any], int, dict[str, Any]]:
        """The `start` fields, the frames made and the stream state of a saved session."""
        path = self.path(token)
        if not path.is_file():
            raise ProtocolError("not_found", "no suspended session has this token", "token")
        try:
            saved = load_state(path)
        except ResumeError as error:
            raise ProtocolError("not_found", f"the saved session cannot be read: {error}", "token") from None
        if saved.fingerprint.get("model") != self.model:
            raise ProtocolError(
                "bad_request", f"the session was made by model {saved.fingerprint.get('model')!r}", "token"
            )
        start = dict(saved.fingerprint["start"])
        if start.get("image") is not None:
            start["image"] = base64.b64decode(start["image"])
        return start, saved.frames_written, saved.stream

    def delete(self, token: str) -> None:
        """The session ended: remove its state and refuse its later saves (the last chunk's snapshot is written by the
        connection, which may come after the scheduler has finished the session). Never waits for a write: a save in
        progress sees the mark once written and removes its own file."""
        path = self.path(token)
        with self._lock:
            self._newest[token] = math.inf
        path.unlink(missing_ok=True)

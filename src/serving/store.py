"""Suspended sessions: `TOKEN.resume.safetensors` under `--state-dir`, the stream's `state_dict()` plus the `start`
fields a restore rebuilds the stream from (`rolldiff.pipelines.io.resume`'s safe format: tensors in safetensors, the
rest JSON in its header; nothing is unpickled). Tokens are opaque, made by the server (`secrets.token_urlsafe`) and
checked against `TOKEN_PATTERN` before they name a file, so a restore can never reach outside the folder.

`--state-dir` is a folder (local, or a network folder every server mounts) or an fsspec URL (`file:///...`,
`s3://bucket/prefix`, ...), so servers on other hosts (Ray Serve replicas) read what any of them wrote: a token
suspended on one restores on all. A state is written whole or not at all in both: a local folder renames a
temporary file; a URL writes a temporary object and moves it (on an object store a put is atomic by itself).
"""

from __future__ import annotations

import base64
import math
import threading
import uuid
from pathlib import Path
from typing import Any

from ..pipelines.io.resume import ResumeError, RunState, load_state, save_state, state_bytes, state_from_bytes
from .protocol import TOKEN_PATTERN, ProtocolError


class LocalFolder:
    """Saved states in a folder of this machine (or one every server mounts)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def write(self, name: str, state: RunState) -> None:
        save_state(self.folder / name, state)  # a temporary file, renamed

    def read(self, name: str) -> RunState | None:
        path = self.folder / name
        return load_state(path) if path.is_file() else None

    def remove(self, name: str) -> None:
        (self.folder / name).unlink(missing_ok=True)


class FsspecFolder:
    """Saved states under an fsspec URL (`file:///srv/sessions`, `s3://bucket/sessions`, ...)."""

    def __init__(self, url: str) -> None:
        import fsspec

        self.filesystem, self.root = fsspec.core.url_to_fs(url)
        self.url = url
        self.filesystem.makedirs(self.root, exist_ok=True)

    def _at(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def write(self, name: str, state: RunState) -> None:
        temporary = self._at(f".{name}.{uuid.uuid4().hex}.tmp")  # one per write: two servers never share it
        self.filesystem.pipe_file(temporary, state_bytes(state))
        self.filesystem.mv(temporary, self._at(name))

    def read(self, name: str) -> RunState | None:
        try:
            data = self.filesystem.cat_file(self._at(name))
        except FileNotFoundError:
            return None
        return state_from_bytes(data, f"{self.url.rstrip('/')}/{name}")

    def remove(self, name: str) -> None:
        try:
            self.filesystem.rm_file(self._at(name))
        except FileNotFoundError:
            pass


def open_state_folder(state_dir: str | Path) -> LocalFolder | FsspecFolder:
    """The folder of `state_dir`: a URL (`scheme://...`) through fsspec, anything else a local path. A URL whose
    filesystem lives in one process's memory (`memory://`) is refused: no other server (nor a restart) could read it.
    """
    location = str(state_dir)
    if "://" not in location:
        return LocalFolder(location)
    scheme = location.split("://", 1)[0]
    try:
        import fsspec

        kind = fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError) as error:
        raise ValueError(f"`state_dir` {location!r}: fsspec cannot open {scheme}:// here ({error})") from None
    protocols = (kind.protocol,) if isinstance(kind.protocol, str) else kind.protocol
    if "memory" in protocols:
        raise ValueError(
            f"`state_dir` {location!r}: memory:// lives in one process's memory, so no other server (nor a restart) "
            "could restore its sessions; give a folder or a shared URL (file:///..., s3://...)"
        )
    return FsspecFolder(location)


class SessionStore:
    def __init__(self, state_dir: str | Path, model: str) -> None:
        self.files = open_state_folder(state_dir)
        self.model = model
        self._newest: dict[str, float] = {}  # token -> frames of the newest state written (inf: the session ended)
        self._lock = threading.Lock()

    def name(self, token: str) -> str:
        if not TOKEN_PATTERN.match(token):
            raise ProtocolError("not_found", "no suspended session has this token", "token")
        return f"{token}.resume.safetensors"

    def save(self, token: str, start: dict[str, Any], frames: int, state: dict[str, Any]) -> None:
        """Write atomically (a kill during a save keeps the previous state). A state older than one already written
        (`frames` fewer) is dropped: a chunk's snapshot saved after it was sent must not undo a later suspend; so is
        any state of a session that has ended (`delete`), however late its save comes."""
        name = self.name(token)
        with self._lock:
            if frames < self._newest.get(token, -1):
                return
            self._newest[token] = frames
        start = dict(start)
        if start.get("image") is not None:
            start["image"] = base64.b64encode(start["image"]).decode()
        fingerprint = {"model": self.model, "start": start}
        self.files.write(name, RunState(fingerprint, frames, state))
        if self._newest[token] == math.inf:  # the session ended while this was written: `delete` may have been first
            self.files.remove(name)

    def load(self, token: str) -> tuple[dict[str, Any], int, dict[str, Any]]:
        """The `start` fields, the frames made and the stream state of a saved session."""
        name = self.name(token)
        try:
            saved = self.files.read(name)
        except ResumeError as error:
            raise ProtocolError("not_found", f"the saved session cannot be read: {error}", "token") from None
        if saved is None:
            raise ProtocolError("not_found", "no suspended session has this token", "token")
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
        name = self.name(token)
        with self._lock:
            self._newest[token] = math.inf
        self.files.remove(name)

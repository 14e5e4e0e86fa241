"""The `rolldiff serve` application: one loaded pipeline, many sessions, the `rolldiff-stream/1` WebSocket at
`/v1/stream`, and `GET /healthz`, `GET /v1/model`, `GET /` (the browser page) beside it. FastAPI + uvicorn
(`pip install "rolldiff[serve]"`).

A connection's coroutine reads the client's messages and sends what its session's outbox holds; the chunks are
made by the one scheduler thread (`rolldiff.serving.scheduler`). A session is built from its `start` message by
the library's own `build_request` (through `pipe.stream`), so its errors are the library's, relabelled with the
message's field, and a seeded session alone on the server sends exactly the frames `pipe.stream` gives.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import re
import warnings
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch
from fastapi import FastAPI, WebSocket
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.websockets import WebSocketDisconnect, WebSocketState

from ..choices import DEFAULT_MODEL_NAME
from ..pipelines.memory import fp8_storage, offload_mode
from ..pipelines.request import VideoCall, build_request, longest_num_frames
from ..pipelines.request.builder import whole_chunk_grid
from ..pipelines.request.text_encoding import PromptWarning
from ..pipelines.stream import ChunkStream
from ..recipes import list_recipes
from .batching import LockstepPipeline, batchable
from .board import ServerBoard, WorkerRow
from .frames import decode_frame, decode_image
from .protocol import (
    CLOSE_GOING_AWAY,
    CLOSE_POLICY,
    CLOSE_TOO_BIG,
    CLOSE_TRY_LATER,
    PROTOCOL,
    ProtocolError,
    decode,
    parse_prompt,
    parse_start,
    parse_token,
)
from .scheduler import Scheduler
from .session import InputFrames, Session
from .store import SessionStore


@dataclass(frozen=True)
class ServeSettings:
    """What `rolldiff serve`'s flags set (docs/serving.md)."""

    model: str = DEFAULT_MODEL_NAME
    recipe: str | None = None
    max_sessions: int = 4
    max_batch: int = 8  # sessions denoised together in one forward per step; 1: they take turns
    parallel_groups: int = 1  # batched groups of 4 or more made at once (rolldiff.serving.scheduler)
    token: str | None = None
    state_dir: str | None = None
    idle_timeout: float = 300.0
    max_frames: int = 100_000  # a session's length when `num_frames` is null (until stopped)
    state_every: int = 0  # save each session every N chunks (survives SIGKILL); 0: only on suspend
    max_message_bytes: int = 8 * 2**20
    max_input_pixels: int = 4096 * 4096
    fps: int = 16
    max_outbox: int = 2  # chunks made ahead of a slow client
    input_frames: int = 256  # input frames held for a video session


PAGE_PROMPT = "a red circle moving left"  # the browser page's first prompt (static/index.html)


def session_request(pipe, settings: ServeSettings, call: dict[str, Any], num_frames: int | None):
    """The request of a session's call: `num_frames` None ("until stopped") is the longest video the call may make
    within `--max-frames` (absolute positions end at the RoPE table); a refusal is the library's ValueError."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PromptWarning)
        if num_frames is None:
            num_frames = longest_num_frames(pipe, VideoCall.bind("stream", (), call), settings.max_frames)
        elif num_frames > settings.max_frames:
            raise ProtocolError("too_large", f"`num_frames` is at most {settings.max_frames} here", "num_frames")
        return build_request(pipe, VideoCall.bind("stream", (), {**call, "num_frames": num_frames}))


def check_default_session(pipe, settings: ServeSettings) -> None:
    """Build the request of a plain text session "until stopped" with the server's defaults (its recipe), checks
    only: a setting no such session can run (`--compile` with a recipe whose cache decides on the host, a recipe for
    another pipeline) raises its ValueError at start, from the rule's own home, not once per session."""
    session_request(pipe, settings, {"prompt": PAGE_PROMPT, "recipe": settings.recipe}, None)


# ---------------------------------------------------------------------------------------- the hub
class Hub:
    """The loaded pipeline, the settings, the scheduler and the store, shared by every connection; `row` is this
    process's row of the server's counts (one of several with `--workers`)."""

    def __init__(self, pipe, settings: ServeSettings, row: WorkerRow) -> None:
        self.pipe = pipe
        self.settings = settings
        self.row = row
        self.store = None if settings.state_dir is None else SessionStore(settings.state_dir, settings.model)
        # a transformer that cannot take one cache per row (another family) serves sessions in turns
        self.max_batch = settings.max_batch if batchable(pipe) else 1
        self.scheduler = Scheduler(
            self.store,
            settings.state_every,
            settings.idle_timeout,
            settings.max_frames,
            self.max_batch,
            settings.parallel_groups,
            row=row,
        )
        self.admission = asyncio.Lock()

    def chunk_pixel_frames(self, latent_frames: int) -> int:
        """Pixel frames a chunk of `latent_frames` latent frames decodes to (after the first chunk)."""
        return self.pipe.vae_scale_factor_temporal * latent_frames

    def describe(self) -> dict[str, Any]:
        config = self.pipe.config
        # a session's chunk under the server's recipe (else the folder's), as `start` without a recipe runs it
        _, latent_chunk = whole_chunk_grid(self.pipe, VideoCall(recipe=self.settings.recipe))
        return {
            "model": self.settings.model,
            "pipeline": type(self.pipe).__name__,
            "recipe": self.settings.recipe or config.get("recipe"),
            "recipes": list_recipes(type(self.pipe).__name__),  # what a session's `start` may name
            "loras": list(config.get("fused_loras") or []),  # `--lora`: each source and its scale
            "offload": offload_mode(self.pipe),  # `--offload` (None: every weight resident)
            "fp8_storage": fp8_storage(self.pipe.transformer),
            "height": int(config.height),
            "width": int(config.width),
            "chunk_frames": self.chunk_pixel_frames(latent_chunk),
            "latent_chunk_frames": latent_chunk,
            "fps": self.settings.fps,
            "protocol": PROTOCOL,
            "max_sessions": self.settings.max_sessions,
            "max_batch": self.max_batch,
            "parallel_groups": self.scheduler.parallel_groups,
            **self.row.board.describe(),  # workers (and replicas, under Ray Serve)
        }

    def build(self, start: dict[str, Any], inputs: InputFrames | None):
        """The session's stream from its `start` fields; the library's refusal becomes a `bad_request` naming the
        field (the argument in backticks)."""
        call: dict[str, Any] = {
            "prompt": start["prompt"],
            "height": start["height"],
            "width": start["width"],
            "recipe": start["recipe"] or self.settings.recipe,
            "generator": torch.Generator().manual_seed(start["seed"]),
        }
        if start["guidance_scale"] is not None:
            call["guidance_scale"] = start["guidance_scale"]
        if start["image"] is not None:
            call["image"] = decode_image(start["image"], self.settings.max_input_pixels)
        if inputs is not None:
            call["video"], call["strength"] = inputs, start["strength"]
        try:
            request = session_request(self.pipe, self.settings, call, start["num_frames"])
        except ValueError as error:
            names = re.findall(r"`(\w+)`", str(error))
            raise ProtocolError("bad_request", str(error), names[0] if names else None) from None
        # what `pipe.stream` makes, on a view whose transformer steps are open to batching when the server batches
        return ChunkStream(LockstepPipeline(self.pipe) if self.max_batch > 1 else self.pipe, request)

    def cache_bytes(self, stream) -> int:
        """What the session's caches will take, measured on the meta device (nothing allocated)."""
        request = stream.request
        cache = self.pipe.transformer.make_cache(
            request.layout, request.batch_size, self.pipe.transformer.dtype, "meta"
        )
        return cache.memory_bytes() * (1 + request.uses_guidance)

    def memory_free(self) -> int:
        device = self.pipe.execution_device
        if device.type == "cuda":
            return torch.cuda.mem_get_info(device)[0]
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------------------------------- the app
def create_app(pipe, settings: ServeSettings, row: WorkerRow | None = None) -> FastAPI:
    """The app of one server process; `row`: its row of the counts a `--workers` server shares (default: a board of
    its own, one row)."""
    app = FastAPI(title="rolldiff serve", version=PROTOCOL)
    row = row or ServerBoard().row(0)
    hub = None

    def get_hub() -> Hub:
        nonlocal hub
        if hub is None:  # made in the server's event loop (its lock belongs there)
            hub = Hub(pipe, settings, row)
            app.state.hub = hub
        return hub

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        board = get_hub().row.board  # every worker's (or replica's) counts, whichever answers
        counts = await asyncio.to_thread(board.health)  # a Ray board's is a call to its actor
        return {"status": "ok", "max_sessions": settings.max_sessions, **counts}

    @app.get("/v1/model")
    async def model() -> dict[str, Any]:
        return get_hub().describe()

    @app.get("/", response_class=HTMLResponse)
    async def page() -> str:
        return resources.files("rolldiff.serving").joinpath("static/index.html").read_text()

    @app.websocket("/v1/stream")
    async def stream(websocket: WebSocket) -> None:
        await websocket.accept()
        if not _authorized(websocket, settings.token):
            error = ProtocolError("unauthorized", "a token is required: Authorization: Bearer TOKEN or ?token=TOKEN")
            await _refuse(websocket, error, CLOSE_POLICY)
            return
        await Connection(get_hub(), websocket).run()

    @app.exception_handler(ProtocolError)
    async def protocol_error(request, error: ProtocolError) -> JSONResponse:
        return JSONResponse(error.as_message(), status_code=400)

    app.state.get_hub = get_hub
    return app


def _authorized(websocket: WebSocket, token: str | None) -> bool:
    """The token from `Authorization: Bearer` or `?token=`, compared in constant time."""
    if token is None:
        return True
    header = websocket.headers.get("authorization", "")
    given = header[7:] if header.lower().startswith("bearer ") else websocket.query_params.get("token", "")
    return hmac.compare_digest(given.encode(), token.encode())


async def _refuse(websocket: WebSocket, error: ProtocolError, code: int) -> None:
    try:
        await websocket.send_json(error.as_message())
        await websocket.close(code=code)
    except (WebSocketDisconnect, RuntimeError):
        pass


class Connection:
    """One client: its first message starts (or restores) a session; then controls in, chunks out."""

    def __init__(self, hub: Hub, websocket: WebSocket) -> None:
        self.hub = hub
        self.websocket = websocket
        self.session: Session | None = None

    async def run(self) -> None:
        try:
            if not await self._open():
                return
            sender = asyncio.create_task(self._send())
            receiver = asyncio.create_task(self._receive())
            done, pending = await asyncio.wait({sender, receiver}, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            for task in done:
                if task.exception() and not isinstance(task.exception(), WebSocketDisconnect):
                    raise task.exception()
        except WebSocketDisconnect:
            pass
        finally:
            if self.session is not None:
                self.hub.scheduler.remove(self.session)  # a gone client frees its session at once
            if self.websocket.client_state == WebSocketState.CONNECTED:
                try:
                    await self.websocket.close(code=CLOSE_GOING_AWAY)
                except RuntimeError:
                    pass

    async def _received(self) -> dict[str, Any]:
        """The next message; one over `max_message_bytes` is answered `too_large` and closes with 1009 (uvicorn reads
        up to twice the limit, so such a message arrives whole and the client reads the answer: a server that stops
        reading mid-message resets the connection under the client's feet)."""
        message = await self.websocket.receive()
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", 1000))
        data = message.get("bytes")
        size = len(data) if data is not None else len((message.get("text") or "").encode())
        limit = self.hub.settings.max_message_bytes
        if size > limit:
            error = ProtocolError("too_large", f"a message is at most {limit} bytes here, got {size}")
            await _refuse(self.websocket, error, CLOSE_TOO_BIG)
            raise WebSocketDisconnect(CLOSE_TOO_BIG)
        return message

    async def _open(self) -> bool:
        """The `start` or `restore` message; a refusal closes with 1008 (1013 when the server is full)."""
        try:
            message = await self._received()
        except WebSocketDisconnect:
            return False
        try:
            if "text" not in message or message["text"] is None:
                raise ProtocolError("bad_request", "send a JSON `start` (or `restore`) message before any binary one")
            request = decode(message["text"])
            if request["type"] not in ("start", "restore"):
                raise ProtocolError(
                    "bad_request", f"the first message is `start` or `restore`, got {request['type']!r}"
                )
            async with self.hub.admission:
                # across all workers (or replicas: a call to the Ray board's actor, off the event loop)
                if not await asyncio.to_thread(self.hub.row.reserve_session, self.hub.settings.max_sessions):
                    raise ProtocolError("busy", f"all {self.hub.settings.max_sessions} sessions are taken; try later")
                try:
                    self._event_loop, self._outbox = asyncio.get_running_loop(), asyncio.Queue()
                    self.session = await asyncio.to_thread(self._make_session, request)
                except BaseException:
                    self.hub.row.add("sessions", -1)  # refused (or the client left): the reservation goes back
                    raise
                self.hub.scheduler.add(self.session)
        except ProtocolError as error:
            await _refuse(self.websocket, error, CLOSE_TRY_LATER if error.code == "busy" else CLOSE_POLICY)
            return False
        await self.websocket.send_json(self._ready())
        return True

    def _make_session(self, request: dict[str, Any]) -> Session:
        restored = request["type"] == "restore"
        if restored:
            if self.hub.store is None:
                raise ProtocolError("not_found", "this server keeps no sessions (no --state-dir)", "token")
            token = parse_token(request)
            start, frames_made, state = self.hub.store.load(token)
        else:
            start, token, frames_made, state = parse_start(request), None, 0, None
        inputs = InputFrames(self.hub.settings.input_frames) if start["input"] == "video" else None
        stream = self.hub.build(start, inputs)
        needed = self.hub.cache_bytes(stream)
        if needed > 0.9 * self.hub.memory_free():
            stream.close()
            raise ProtocolError("busy", f"a new session's cache needs {needed} bytes; the device has less free")
        if state is not None:
            try:
                stream.load_state_dict(state)
            except (KeyError, ValueError, RuntimeError) as error:
                stream.close()
                raise ProtocolError(
                    "not_found", f"the saved session does not fit this model: {error}", "token"
                ) from None
        session = Session(
            stream, start, self._event_loop, self._outbox, inputs=inputs, max_outbox=self.hub.settings.max_outbox
        )
        if token is not None:
            session.token = token
        session.frames_made = frames_made
        return session

    def _ready(self) -> dict[str, Any]:
        stream, session = self.session.stream, self.session
        geometry = stream.request.geometry
        return {
            "type": "ready",
            "session": session.id,
            "protocol": PROTOCOL,
            "chunk_frames": self.hub.chunk_pixel_frames(geometry.chunk_frames),
            "fps": self.hub.settings.fps,
            "height": geometry.height,
            "width": geometry.width,
            "num_frames": geometry.num_frames,
            "next_chunk": stream.next_chunk,
            "first_frame": stream.frames_emitted,
            "token": session.token if self.hub.store is not None else None,
        }

    async def _send(self) -> None:
        session = self.session
        while True:
            item = await session.outbox.get()
            if item is None:  # the session ended: `done` / `suspended` went first
                await self.websocket.close(code=1000)
                return
            if isinstance(item, dict):
                await self.websocket.send_json(item)
                continue
            header, frames, snapshot = item
            await self.websocket.send_json(header)
            for frame in frames:
                await self.websocket.send_bytes(frame)
            if snapshot is not None:  # `--state-every`: the state after the last chunk sent, so a restore after a
                made, state = snapshot  # kill goes on right after what the client has
                await asyncio.to_thread(self.hub.store.save, session.token, session.start, made, state)
            session.sent_one()
            self.hub.scheduler.wake()

    async def _receive(self) -> None:
        session = self.session
        while True:
            message = await self._received()
            session.touch()
            try:
                if message.get("bytes") is not None:
                    await self._input_frame(message["bytes"])
                else:
                    self._control(decode(message["text"]))
            except ProtocolError as error:  # a bad message mid-session: said, and the session goes on
                await self.websocket.send_json(error.as_message())

    async def _input_frame(self, data: bytes) -> None:
        inputs = self.session.inputs
        if inputs is None or inputs.ended:
            raise ProtocolError("bad_request", "binary frames are input video: send them after `input`: 'video'")
        frame = await asyncio.to_thread(decode_frame, data, self.hub.settings.max_input_pixels)
        while not inputs.room():  # the client sends faster than the model reads: wait (constant memory)
            await asyncio.sleep(0.01)
            if self.session.closed:
                return
        inputs.push(frame)
        self.hub.scheduler.wake()

    def _control(self, message: dict[str, Any]) -> None:
        session, kind = self.session, message["type"]
        if kind == "ping":
            session.post({"type": "pong"})
        elif kind == "prompt":
            session.control("prompt", parse_prompt(message))
        elif kind in ("pause", "resume"):
            session.paused = kind == "pause"
        elif kind == "input.end":
            if session.inputs is None:
                raise ProtocolError("bad_request", "`input.end` ends an input video; this session has none")
            session.inputs.end()
        elif kind in ("stop", "suspend"):
            session.control(kind, "client")
        else:  # start / restore again
            raise ProtocolError("bad_request", f"`{kind}` opens a session; this connection has one already", "type")
        self.hub.scheduler.wake()

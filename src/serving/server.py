"""Run the app under uvicorn, with a shutdown that keeps every session: on SIGTERM (or Ctrl-C) each running
session is suspended to `--state-dir` at its next chunk boundary and its client is told so (`suspended`, with
the token, `"reason": "shutdown"`) before the server stops; without a state dir they end with `done`."""

from __future__ import annotations

import asyncio
import signal
import threading

import uvicorn

from .app import ServeSettings, create_app


class SuspendingServer(uvicorn.Server):
    """uvicorn's server, whose exit first suspends the sessions (uvicorn would drop their connections)."""

    def __init__(self, config: uvicorn.Config, hub_of) -> None:
        super().__init__(config)
        self._hub_of = hub_of
        self._draining = False

    def handle_exit(self, sig, frame) -> None:
        if self._draining:  # a second signal: stop now
            super().handle_exit(sig, frame)
            return
        self._draining = True
        hub = self._hub_of()

        def drain() -> None:
            hub.scheduler.suspend_all("shutdown")  # without a state dir: each ends with `done`
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0.5), self._loop).result(timeout=5)  # flush the messages
            self._loop.call_soon_threadsafe(super(SuspendingServer, self).handle_exit, sig, frame)

        threading.Thread(target=drain, name="rolldiff-drain", daemon=True).start()

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)


def uvicorn_config(app, settings: ServeSettings, host: str, port: int) -> uvicorn.Config:
    """uvicorn's settings for the app. Messages up to twice `max_message_bytes` are read whole, so the app answers
    one over the limit (`too_large`, close 1009) where the client reads it. No permessage-deflate: frames are media,
    where deflate costs the event loop far more than it saves (one 480x832 raw frame of decoded video: 111 ms to
    compress, to 97 % of its size; JPEG and PNG are compressed already), and every frame of every session goes
    through that one thread."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        ws_max_size=2 * settings.max_message_bytes,
        ws_per_message_deflate=False,
        lifespan="off",
    )


def serve(pipe, settings: ServeSettings, host: str, port: int) -> None:
    """Serve `pipe` on `host:port` until SIGTERM / Ctrl-C (one process; `--workers`: `rolldiff.serving.workers`)."""
    app = create_app(pipe, settings)
    run_until_signalled(SuspendingServer(uvicorn_config(app, settings, host, port), app.state.get_hub))


def run_until_signalled(server: uvicorn.Server) -> None:
    """Run `server` until SIGTERM / Ctrl-C. uvicorn raises the signal it caught again once it has shut down; by then
    every session is suspended, so the process ends normally (exit 0) instead of dying of it."""
    for caught in (signal.SIGTERM, signal.SIGINT):
        signal.signal(caught, lambda signum, frame: None)
    server.run()

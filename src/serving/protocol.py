"""`rolldiff-stream/1`: the session protocol of `rolldiff serve` (docs/serving.md), checked message by message.

Control messages are JSON text, media are binary messages. A client message is parsed here into a plain dict of
checked values, or refused with a `ProtocolError` that carries the wire error's `code` and `field`; nothing here
knows about pipelines, so the client (`rolldiff.serving.client`) and the server share it.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass
from typing import Any

PROTOCOL = "rolldiff-stream/1"
FORMATS = ("raw", "jpeg", "png")
INPUTS = ("text", "image", "video")
# Error codes and the WebSocket close codes that go with a refusal that ends the connection.
ERROR_CODES = ("bad_request", "busy", "unauthorized", "too_large", "not_found", "internal")
CLOSE_POLICY = 1008  # a bad `start` (or restore), a missing token
CLOSE_TOO_BIG = 1009  # a message over the size limit (`too_large` first; uvicorn's own stop at twice the limit)
CLOSE_TRY_LATER = 1013  # too many sessions
CLOSE_GOING_AWAY = 1001  # the server shuts down (after `suspended`), or the session ended idle
TOKEN_PATTERN = re.compile(r"^[A-Za-z0-9_-]{32}$")  # what `secrets.token_urlsafe(24)` makes, nothing else


@dataclass
class ProtocolError(Exception):
    """A refused message: `{"type": "error", "code", "message", "field"}` on the wire."""

    code: str
    message: str
    field: str | None = None

    def __str__(self) -> str:
        return self.message

    def as_message(self) -> dict[str, Any]:
        return {"type": "error", "code": self.code, "message": self.message, "field": self.field}


def _bad(message: str, field: str | None = None) -> ProtocolError:
    return ProtocolError("bad_request", message, field)


def decode(text: str) -> dict[str, Any]:
    """A JSON control message with a known `type`."""
    try:
        message = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise _bad(f"not JSON: {error.msg}") from None
    if not isinstance(message, dict):
        raise _bad(f"a message is a JSON object, got {type(message).__name__}")
    kind = message.get("type")
    if kind not in CLIENT_TYPES:
        raise _bad(f"`type` must be one of {sorted(CLIENT_TYPES)}, got {kind!r}", "type")
    unknown = sorted(set(message) - CLIENT_TYPES[kind] - {"type"})
    if unknown:
        raise _bad(f"{kind!r} takes {sorted(CLIENT_TYPES[kind])}; unknown field(s) {unknown}", unknown[0])
    return message


# The fields each client message takes (besides `type`).
CLIENT_TYPES: dict[str, set[str]] = {
    "start": {
        "prompt", "seed", "num_frames", "height", "width", "format", "input", "image", "strength", "recipe",
        "guidance_scale",
    },
    "prompt": {"prompt", "blend_chunks", "scene_cut"},
    "input.end": set(),
    "pause": set(),
    "resume": set(),
    "stop": set(),
    "ping": set(),
    "suspend": set(),
    "restore": {"token"},
}  # fmt: skip


def _typed(message: dict, name: str, kinds: tuple[type, ...], what: str, required: bool = False) -> Any:
    value = message.get(name)
    if value is None:
        if required:
            raise _bad(f"`{name}` is required: {what}", name)
        return None
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise _bad(f"`{name}` must be {what}, got {value!r}", name)
    return value


def parse_start(message: dict) -> dict[str, Any]:
    """The checked fields of a `start` message (the pipeline checks their values against the model)."""
    prompt = _typed(message, "prompt", (str,), "a non-empty string", required=True)
    if not prompt.strip():
        raise _bad("`prompt` must be a non-empty string", "prompt")
    kind = message.get("input") or "text"
    if kind not in INPUTS:
        raise _bad(f"`input` must be one of {INPUTS}, got {kind!r}", "input")
    output = message.get("format") or "raw"
    if output not in FORMATS:
        raise _bad(f"`format` must be one of {FORMATS}, got {output!r}", "format")
    image = _typed(message, "image", (str,), "a base64 PNG or JPEG")
    if (image is None) == (kind == "image"):
        raise _bad("`image` (base64) comes with `input`: 'image', and only with it", "image")
    start = {
        "prompt": prompt,
        "seed": _typed(message, "seed", (int,), "an int >= 0") or 0,
        "num_frames": _typed(message, "num_frames", (int,), "a positive int, or null (until stopped)"),
        "height": _typed(message, "height", (int,), "pixels, an int"),
        "width": _typed(message, "width", (int,), "pixels, an int"),
        "format": output,
        "input": kind,
        "image": None if image is None else decode_base64(image, "image"),
        "strength": _typed(message, "strength", (int, float), "a number in (0, 1]"),
        "recipe": _typed(message, "recipe", (str,), "a recipe name"),
        "guidance_scale": _typed(message, "guidance_scale", (int, float), "a number >= 1"),
    }
    if start["seed"] < 0:
        raise _bad(f"`seed` must be an int >= 0, got {start['seed']!r}", "seed")
    if start["strength"] is not None and kind != "video":
        raise _bad("`strength` applies to `input`: 'video' only", "strength")
    return start


def parse_prompt(message: dict) -> tuple[str, int | None, bool]:
    prompt = _typed(message, "prompt", (str,), "a non-empty string", required=True)
    if not prompt.strip():
        raise _bad("`prompt` must be a non-empty string", "prompt")
    blend = _typed(message, "blend_chunks", (int,), "an int >= 1 (1: switch at once)")
    if blend is not None and blend < 1:
        raise _bad(f"`blend_chunks` must be an int >= 1, got {blend!r}", "blend_chunks")
    scene_cut = _typed(message, "scene_cut", (bool,), "true or false (a hard cut: the session's recipe must allow it)")
    return prompt, blend, bool(scene_cut)


def parse_token(message: dict) -> str:
    """A restore token as the server issues them; anything else (a path, dots, slashes) is refused as unknown."""
    token = message.get("token")
    if not isinstance(token, str) or not TOKEN_PATTERN.match(token):
        raise ProtocolError("not_found", "no suspended session has this token", "token")
    return token


def decode_base64(text: str, field: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(f"`{field}` must be base64", field) from None

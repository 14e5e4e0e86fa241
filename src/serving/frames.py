"""Frames on the wire: what a chunk's `(frames, H, W, 3)` uint8 array becomes (one binary message per frame), and
what an input frame (a JPEG or PNG message) becomes."""

from __future__ import annotations

import io

import numpy as np
import PIL.Image

from .protocol import ProtocolError


def encode_frame(frame: np.ndarray, output: str) -> bytes:
    """One `(H, W, 3)` uint8 frame: raw RGB bytes, row-major (`raw`), or a JPEG / PNG file."""
    if output == "raw":
        return np.ascontiguousarray(frame).tobytes()
    buffer = io.BytesIO()
    PIL.Image.fromarray(frame).save(buffer, format="JPEG" if output == "jpeg" else "PNG", quality=90)
    return buffer.getvalue()


def decode_frame(data: bytes, max_pixels: int, field: str = "input") -> np.ndarray:
    """A JPEG or PNG message as `(H, W, 3)` uint8 RGB; refused (`bad_request` / `too_large`) when it is not one."""
    try:
        image = PIL.Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > max_pixels:
            raise ProtocolError("too_large", f"an input frame of {width}x{height} is over {max_pixels} pixels", field)
        if image.format not in ("JPEG", "PNG"):
            raise ProtocolError("bad_request", f"input frames are JPEG or PNG, got {image.format}", field)
        return np.asarray(image.convert("RGB"))
    except (OSError, PIL.Image.DecompressionBombError) as error:
        raise ProtocolError("bad_request", f"an input frame is not a JPEG or PNG image ({error})", field) from None


def decode_image(data: bytes, max_pixels: int) -> PIL.Image.Image:
    """The `start` message's `image` (base64-decoded bytes) as an RGB picture."""
    return PIL.Image.fromarray(decode_frame(data, max_pixels, field="image"))

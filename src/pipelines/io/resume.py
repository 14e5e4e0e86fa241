"""Resumable long runs: a `ChunkStream`'s state at a chunk boundary, in one safetensors file beside the video.

The stream says what it is (`ChunkStream.state_dict()`: its caches' buffers and their layers' host counters
as extra state, the decoder's memory, the latents a re-cache needs, the generators' states, its position);
this module only writes and reads that, with a fingerprint of the run's arguments so a resume with other
arguments is refused, and the number of frames the partial video holds.

Tensors go into the safetensors file; the layers' extra states and the header go into JSON in its metadata:
nothing is pickled and loading runs no code. The file (`video.mp4` -> `video.resume.safetensors`) is written
under a temporary name and renamed, so a kill during a save leaves the previous state whole.
"""

from __future__ import annotations

import json
import math
import os
import struct
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load, save, save_file

from ...checks import check_number
from ..lora import lora_fingerprint
from ..memory import fp8_storage
from ..request.fingerprint import request_fingerprint
from ..stream import ChunkStream
from .video_writer import StreamingVideoWriter, check_output_path, check_quality, count_frames, partial_path_for

STATE_FORMAT = "rolldiff-resume-3"  # 3: the fingerprint is derived from the request's fields
_OLD_FORMATS = ("rolldiff-resume-1", "rolldiff-resume-2")
_METADATA_KEY = "rolldiff_state"


class ResumeError(ValueError):
    """A state file that cannot continue this run: missing, from other arguments, or not matching the partial."""


def state_path_for(path: str | os.PathLike) -> Path:
    """Where the resume state of a video is kept: `video.mp4` -> `video.resume.safetensors`."""
    path = Path(path)
    return path.with_name(f"{path.stem}.resume.safetensors")


@dataclass
class RunState:
    """A saved stream: its fingerprint, the frames in the partial video, and `ChunkStream.state_dict()`."""

    fingerprint: dict
    frames_written: int
    stream: dict[str, Any] = field(default_factory=dict)

    @property
    def next_chunk(self) -> int:
        """The chunk the saved stream generates next."""
        return int(self.stream["position"][1])


def save_state(path: str | os.PathLike, state: RunState) -> None:
    """Write `state` to `path` atomically (temporary file in the same folder, then rename)."""
    path = Path(path)
    tensors, metadata = _parts(state)
    temp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(temp), metadata=metadata)
    os.replace(temp, path)


def state_bytes(state: RunState) -> bytes:
    """`state` as the bytes of the file `save_state` writes (for storage that is not a local folder)."""
    tensors, metadata = _parts(state)
    return save(tensors, metadata=metadata)


def _parts(state: RunState) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The safetensors tensors of `state` and its metadata (the header, JSON)."""
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.stream.items() if torch.is_tensor(v)}
    extras = {k: v for k, v in state.stream.items() if not torch.is_tensor(v)}
    header = {
        "format": STATE_FORMAT,
        "fingerprint": state.fingerprint,
        "frames_written": state.frames_written,
        "extras": extras,
    }
    return tensors, {_METADATA_KEY: json.dumps(header)}


def load_state(path: str | os.PathLike) -> RunState:
    """Read a state written by `save_state`; raises ResumeError if it is not one (or an older format)."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as file:
            header = json.loads((file.metadata() or {}).get(_METADATA_KEY, "null"))
            tensors = {name: file.get_tensor(name) for name in file.keys()}
    except (OSError, ValueError) as error:  # safetensors raises SafetensorError (a ValueError subclass) or OSError
        raise ResumeError(f"{str(path)!r} is not a readable resume state: {error}") from None
    return _run_state(header, tensors, str(path))


def state_from_bytes(data: bytes, where: str) -> RunState:
    """Read the bytes of a state file (`state_bytes`), `where` naming them in errors. safetensors keeps its metadata
    in a JSON header after an 8-byte little-endian length; nothing is unpickled."""
    try:
        (length,) = struct.unpack("<Q", data[:8])
        metadata = json.loads(data[8 : 8 + length]).get("__metadata__") or {}
        header = json.loads(metadata.get(_METADATA_KEY, "null"))
        tensors = load(data)
    except (struct.error, ValueError, AttributeError) as error:  # SafetensorError and JSONDecodeError are ValueErrors
        raise ResumeError(f"{where!r} is not a readable resume state: {error}") from None
    return _run_state(header, tensors, where)


def _run_state(header: Any, tensors: dict[str, torch.Tensor], where: str) -> RunState:
    found = header.get("format") if isinstance(header, dict) else None
    if found in _OLD_FORMATS:
        raise ResumeError(
            f"{where!r} was saved by an older rolldiff (format {found!r}, this one reads {STATE_FORMAT!r}) and "
            "cannot be continued; delete it (and the partial video) to start over."
        )
    if found != STATE_FORMAT:
        raise ResumeError(f"{where!r} is not a rolldiff resume state (format {STATE_FORMAT}).")
    return RunState(header["fingerprint"], header["frames_written"], {**tensors, **header["extras"]})


def check_fingerprint(saved: dict, current: dict, path: str | os.PathLike) -> None:
    """Refuse to resume a run whose arguments differ from the saved one's, naming each difference."""
    differences = _differences(saved, current, "")
    if differences:
        raise ResumeError(
            f"Cannot resume from {str(path)!r}: it was saved by a run with other arguments ({'; '.join(differences)}). "
            "Pass the same arguments, or delete the state file to start over."
        )


def run_fingerprint(stream: ChunkStream, fps: float, quality: float = 5, overlay: Any = None) -> dict:
    """What makes two runs the same video: every fingerprinted field of the request (`request_fingerprint`,
    derived from `VideoRequest`'s fields), the model, the output's rate and encoding (parts encoded at different
    qualities may differ in H.264 profile and cannot be joined by stream copy), and what an `overlay` draws (its
    `fingerprint` attribute, e.g. the subtitles)."""
    pipe = stream.pipeline
    transformer = {k: v for k, v in dict(pipe.transformer.config).items() if not k.startswith("_")}
    fingerprint = {
        "request": request_fingerprint(stream.request),
        "model": str(getattr(pipe, "name_or_path", "") or ""),
        "transformer": transformer,
        "dtype": str(pipe.transformer.dtype),
        "lora": lora_fingerprint(pipe),
        "fp8_storage": True if fp8_storage(pipe.transformer) else None,  # None: absent from states saved before it
        "decoder": "tiny" if getattr(pipe, "tiny_autoencoder", None) is not None else "vae",
        "fps": float(fps),
        "quality": float(quality),
        "overlay": getattr(overlay, "fingerprint", None),  # None: absent from states saved before it
    }
    return json.loads(json.dumps(fingerprint, default=str))


def _differences(saved: Any, current: Any, name: str) -> list[str]:
    """Each leaf where two fingerprints differ, by its dotted name (`request.step_plan.sigmas`)."""
    if isinstance(saved, dict) and isinstance(current, dict):
        keys = sorted(set(saved) | set(current))
        return [line for key in keys for line in _differences(saved.get(key), current.get(key), f"{name}{key}.")]
    if saved != current:
        return [f"{name.rstrip('.')}: saved {saved!r}, now {current!r}"]
    return []


def _continue_from(stream: ChunkStream, state_path: Path, partial: Path, fingerprint: dict) -> int:
    """Load the saved state into `stream` after checking it against this run and the partial; frames kept."""
    saved = load_state(state_path)
    check_fingerprint(saved.fingerprint, fingerprint, state_path)
    if not partial.is_file() or count_frames(partial) < saved.frames_written:
        raise ResumeError(
            f"Cannot resume: {str(state_path)!r} continues after frame {saved.frames_written}, but the partial "
            f"video {str(partial)!r} is missing or shorter. Delete the state file to start over."
        )
    try:
        stream.load_state_dict(saved.stream)
    except (KeyError, ValueError, RuntimeError) as error:
        raise ResumeError(f"Cannot resume from {str(state_path)!r}: {error}") from None
    return saved.frames_written


def write_video(
    stream: ChunkStream,
    path: str | os.PathLike,
    fps: float = 16,
    *,
    resume: bool = False,
    state_every_s: float = 60.0,
    quality: float = 5,
    on_chunk: Callable[[int], None] | None = None,
    overlay: Callable[[np.ndarray, int], np.ndarray] | None = None,
) -> int:
    """`pipe.generate_to_file`: write `stream` into `path`, saving a resume state after the first chunk and then
    at most every `state_every_s` seconds (at chunk boundaries; 0: after every chunk). `on_chunk(frames_written)`
    runs after each chunk is in the file (and its state saved, when due): a host's progress bar, or its stop button,
    since an exception raised there ends the run as an interrupt does (the frames done kept, resumable).

    `overlay(frames, first_frame)`, given, draws on each chunk's uint8 frames before they are written (`first_frame`:
    the video frame number of `frames[0]`), e.g. a story's subtitles (`subtitles.subtitle_overlay`).

    Every argument is checked first, and with `resume=True` the saved state too (same arguments, the partial
    file holds the frames it vouches for), before any model work. A failed or interrupted run leaves `path` as
    it was, the frames done in `video.partial.mp4` and the last state in `video.resume.safetensors`; success
    removes both. Returns the frames in the finished file.

    Encoding is causal (see `StreamingVideoWriter`), so the frames kept from the partial are bit for bit those of an
    uninterrupted run; the continuation starts a new key frame, so with lossy `quality` (< 10) its frames match the
    uninterrupted run's to the encoder's precision, and exactly at `quality=10` (lossless).
    """
    try:
        return _write(stream, path, fps, resume, state_every_s, quality, on_chunk, overlay)
    finally:
        stream.close()  # a refused argument or state, or a failed write, leaves no input reader or hook behind


def _write(
    stream: ChunkStream,
    path,
    fps: float,
    resume: bool,
    state_every_s: float,
    quality: float,
    on_chunk: Callable[[int], None] | None,
    overlay: Callable[[np.ndarray, int], np.ndarray] | None = None,
) -> int:
    path = check_output_path(path)
    quality = check_quality(quality)
    state_every_s = check_number("state_every_s", state_every_s, 0, hint="seconds; 0: every chunk")
    request = stream.request
    if request.output_type != "np":
        raise ValueError("`output_type`: writing a video takes a stream of `output_type='np'`.")
    if request.batch_size != 1:
        raise ValueError(f"`prompt`: `generate_to_file` writes one video; got a batch of {request.batch_size}.")
    state_path, partial = state_path_for(path), partial_path_for(path)
    fingerprint = run_fingerprint(stream, fps, quality, overlay)
    continue_frames = None
    if resume and state_path.exists():
        continue_frames = _continue_from(stream, state_path, partial, fingerprint)
    elif resume and partial.exists():
        warnings.warn(
            f"`resume`: {str(partial)!r} has no saved state beside it ({state_path.name}); starting from the first "
            "chunk (the partial is replaced when this run ends).",
            stacklevel=4,  # the caller of `generate_to_file`
        )
    writer = StreamingVideoWriter(
        path,
        fps=fps,
        quality=quality,
        continue_from=partial if continue_frames is not None else None,
        continue_frames=continue_frames,
    )
    with writer:
        last_save = -math.inf  # the first state right after the first chunk, then at most every `state_every_s`
        for frames in stream:  # (1, frames, height, width, 3) in [0, 1]
            pixels = (frames[0] * 255.0).round().clip(0, 255).astype(np.uint8)
            writer.write(pixels if overlay is None else overlay(pixels, writer.total_frames))
            more_to_come = stream.next_chunk < stream.num_chunks
            if more_to_come and time.monotonic() - last_save >= state_every_s:
                save_state(state_path, RunState(fingerprint, writer.total_frames, stream.state_dict()))
                last_save = time.monotonic()
            if on_chunk is not None:
                on_chunk(writer.total_frames)
    state_path.unlink(missing_ok=True)
    partial.unlink(missing_ok=True)  # joined into `path` when this run continued it
    return writer.total_frames

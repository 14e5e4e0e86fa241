"""What makes two requests the same video: a JSON fingerprint derived from `VideoRequest`'s own fields.

The fingerprint is built from `dataclasses.fields(VideoRequest)` (nested dataclasses, the family's cache options
among them, by their own fields), so a field added later is fingerprinted unless it is named in
`NOT_FINGERPRINTED` with the reason. A resume (`rolldiff.pipelines.io.resume`) refuses a state whose fingerprint
differs, naming each difference; a test checks every field is one or the other.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .request import VideoRequest

# Fields that do not change which frames a request makes, or that cannot be compared across processes.
NOT_FINGERPRINTED: dict[str, str] = {
    "callback_on_step_end": "a function: not comparable across processes (the latents it returns are the caller's)",
    "callback_tensor_inputs": "what the callback sees, not what is made",
    "overlap_decode": "when a chunk is decoded, not what: the frames are equal either way",
    "devices": "where the transformer's stages run, not what they make: the frames equal one process's",
}


def fingerprint_value(value: Any) -> Any:
    """`value` as JSON: its own `fingerprint()` if it has one, dataclasses by their fields, tensors by shape and float64
    sum, generators by being given."""
    if callable(getattr(value, "fingerprint", None)):  # a value that says what identifies it (`Conditioning`)
        return fingerprint_value(value.fingerprint())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: fingerprint_value(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, torch.Tensor):  # summed in float64 without a float64 copy
        return {"shape": list(value.shape), "sum": float(value.sum(dtype=torch.float64))}
    if isinstance(value, torch.Generator) or (
        isinstance(value, list) and value and isinstance(value[0], torch.Generator)
    ):
        return "seeded"  # the generators' states are saved with the stream itself
    if isinstance(value, (list, tuple)):
        return [fingerprint_value(item) for item in value]
    if isinstance(value, dict):
        return {str(key): fingerprint_value(item) for key, item in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def request_fingerprint(request: VideoRequest) -> dict[str, Any]:
    """Every fingerprinted field of `request`, as JSON values."""
    return {
        f.name: fingerprint_value(getattr(request, f.name))
        for f in dataclasses.fields(request)
        if f.name not in NOT_FINGERPRINTED
    }

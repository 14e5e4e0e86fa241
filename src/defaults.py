"""The embedded default model, and how the `rolldiff` command and the demo find and load a pipeline.

The default is a tiny Krea-like pipeline trained on 32x32 toy-world videos (bouncing shapes), shipped inside
the package so `rolldiff generate --prompt ...` runs on a laptop CPU with no download.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

import rolldiff

from .pipelines import KreaRealtimeVideoPipeline

DEFAULT_MODEL_NAME = "tiny-bouncing-shapes"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# "name" or "org/name": what the Hugging Face Hub accepts as a repository id.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class ModelNotFoundError(ValueError):
    """`--model` names neither a pipeline folder nor a loadable Hugging Face Hub repository."""


def default_model_path() -> Path:
    """The folder of the embedded default pipeline (inside the installed package)."""
    return Path(rolldiff.__file__).parent / "assets" / DEFAULT_MODEL_NAME


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str | torch.device) -> str:
    """bfloat16 on GPUs (what the real checkpoints are trained in), float32 elsewhere."""
    return "bfloat16" if torch.device(device).type == "cuda" else "float32"


def resolve_model(model: str | Path | None) -> str | Path:
    """A local pipeline folder (checked) or a Hub id; `None` is the embedded default.

    Raises:
        ModelNotFoundError: the folder is missing or holds no `model_index.json`.
    """
    if model is None:
        folder = default_model_path()
        if not (folder / "model_index.json").is_file():
            raise ModelNotFoundError(f"the embedded default model is missing at {folder}; pass --model PATH_OR_ID.")
        return folder
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "model_index.json").is_file():
            raise ModelNotFoundError(f"--model {str(model)!r} is not a pipeline folder (no model_index.json in it).")
        return path
    if not _HUB_ID.match(str(model)):
        raise ModelNotFoundError(f"--model {str(model)!r}: no such folder, and not a Hugging Face Hub id.")
    return str(model)


def load_pipeline(
    model: str | Path | None = None, device: str | None = None, dtype: str | None = None
) -> KreaRealtimeVideoPipeline:
    """Load a pipeline folder or Hub id (`None`: the embedded default) onto `device` in `dtype`.

    Args:
        model: a folder saved with `save_pretrained`, a Hub repository id, or `None`.
        device: "cpu", "cuda", "cuda:1", ...; default: CUDA when available.
        dtype: one of `DTYPES`' names; default: bfloat16 on CUDA, float32 otherwise.

    Raises:
        ModelNotFoundError: nothing loadable under that name.
    """
    source = resolve_model(model)
    device = device or default_device()
    torch_dtype = DTYPES[dtype or default_dtype(device)]
    try:
        pipe = KreaRealtimeVideoPipeline.from_pretrained(source, dtype=torch_dtype)
    except (OSError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelNotFoundError(f"--model {str(source)!r} could not be loaded: {reason}") from exc
    return pipe.to(device)


def native_size(pipe: KreaRealtimeVideoPipeline) -> tuple[int, int]:
    """The `(height, width)` in pixels a checkpoint was trained at: the pipeline's registered `height`/`width`.

    Pipelines saved before those were registered load with Wan 2.1's 480x832.
    """
    return int(pipe.config.height), int(pipe.config.width)


def frames_for_seconds(
    pipe: KreaRealtimeVideoPipeline, seconds: float, fps: float, chunk_frames: int | None = None
) -> int:
    """The smallest frame count the pipeline can make (whole chunks) that lasts at least `seconds` at `fps`."""
    requested = max(1, math.ceil(round(seconds * fps, 6)))  # round first: 0.1 s * 30 fps is 3 frames, not 4
    below, above = pipe.valid_num_frames(requested, chunk_frames)
    return below if below >= requested else above

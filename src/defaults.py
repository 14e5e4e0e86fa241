"""The embedded default models, and how the `rolldiff` command and the demo find and load a pipeline.

Two tiny pipelines trained on 32x32 toy-world videos (bouncing shapes) ship inside the package, so
`rolldiff generate --prompt ...` runs on a laptop CPU with no download: `tiny-bouncing-shapes` (Krea-like,
the default) and `tiny-bouncing-shapes-sana` (SANA-like). `--model` takes one of their names, a pipeline
folder or a Hub id; the pipeline class is the one named by the folder's `model_index.json`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from diffusers import DiffusionPipeline
from huggingface_hub.errors import (
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
)

import rolldiff

from .checks import ModelNotFoundError
from .choices import DEFAULT_MODEL_NAME, DTYPE_NAMES, EMBEDDED_MODEL_NAMES
from .pipelines import KreaRealtimeVideoPipeline

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}

# "name" or "org/name": what the Hugging Face Hub accepts as a repository id.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def default_model_path() -> Path:
    """The folder of the embedded default pipeline (inside the installed package)."""
    return Path(rolldiff.__file__).parent / "assets" / DEFAULT_MODEL_NAME


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str | torch.device) -> str:
    """bfloat16 on GPUs (what the real checkpoints are trained in), float32 elsewhere."""
    return "bfloat16" if torch.device(device).type == "cuda" else "float32"


def embedded_models() -> dict[str, Path]:
    """Name -> folder of every embedded pipeline present in the package (the default first)."""
    folders = {name: default_model_path().parent / name for name in EMBEDDED_MODEL_NAMES}
    folders[DEFAULT_MODEL_NAME] = default_model_path()
    return {name: folder for name, folder in folders.items() if (folder / "model_index.json").is_file()}


def resolve_model(model: str | Path | None) -> str | Path:
    """An embedded model's folder (by name), a local pipeline folder (checked) or a Hub id; `None` is the default.

    Raises:
        ModelNotFoundError: the folder is missing or holds no `model_index.json`.
    """
    if model is None or str(model) == DEFAULT_MODEL_NAME:
        folder = default_model_path()
        if not (folder / "model_index.json").is_file():
            raise ModelNotFoundError(f"the embedded default model is missing at {folder}; pass --model PATH_OR_ID.")
        return folder
    embedded = embedded_models()
    if str(model) in embedded:
        return embedded[str(model)]
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "model_index.json").is_file():
            raise ModelNotFoundError(f"--model {str(model)!r} is not a pipeline folder (no model_index.json in it).")
        return path
    if not _HUB_ID.match(str(model)):
        names = ", ".join(embedded)
        raise ModelNotFoundError(
            f"--model {str(model)!r}: no such folder, not an embedded model ({names}) and not a Hugging Face Hub id."
        )
    return str(model)


def _exception_chain(exc: BaseException) -> list[BaseException]:
    """`exc` and every exception it was raised from or while handling, outermost first."""
    chain: list[BaseException] = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def _hub_failure(repo_id: str, exc: BaseException) -> str | None:
    """Why the Hub could not give `repo_id`'s model_index.json, in the user's terms, or None if not a Hub failure.

    diffusers reports every one of these as "does not appear to have a file named model_index.json", which
    sends a user offline (or behind a proxy) looking for a file that is there; the real cause is further down
    the exception chain.
    """
    chain = _exception_chain(exc)
    if any(isinstance(e, OfflineModeIsEnabled) for e in chain):
        return (
            "HF_HUB_OFFLINE is set and this Hub repository is not in the local cache; unset HF_HUB_OFFLINE "
            "to download it once, or pass a folder saved with save_pretrained."
        )
    if any(isinstance(e, LocalEntryNotFoundError) for e in chain):
        cause = chain[-1]
        return (
            f"could not reach the Hugging Face Hub ({type(cause).__name__}: {cause}) and this repository is not "
            "in the local cache; connect once to download it (later runs use the cache, or set HF_HUB_OFFLINE=1), "
            "or pass a folder saved with save_pretrained."
        )
    if any(isinstance(e, RepositoryNotFoundError) for e in chain):
        return (
            "no such repository on the Hugging Face Hub, or it is private or gated: log in with `hf auth login` "
            "(or set HF_TOKEN) and accept its terms on its page."
        )
    if any(isinstance(e, RemoteEntryNotFoundError) for e in chain):
        return (
            "the Hub repository has no model_index.json, so it is not a diffusers pipeline. If it holds an "
            f"original checkpoint (e.g. self_forcing_dmd.pt), download it (`hf download {repo_id} FILE`) and make "
            "a pipeline folder from it: `rolldiff convert FILE --base BASE --out FOLDER` (docs/real_checkpoints.md)."
        )
    return None


def pipeline_class(source: str | Path) -> type[DiffusionPipeline]:
    """The rolldiff pipeline class named by `_class_name` in the `model_index.json` of `source` (folder or Hub id).

    Raises:
        ModelNotFoundError: no readable `model_index.json`, or it names a class rolldiff does not provide.
    """
    try:
        if Path(source).is_dir():
            index = json.loads((Path(source) / "model_index.json").read_text())
        else:
            index = DiffusionPipeline.load_config(str(source))
        class_name = index["_class_name"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if Path(source).is_dir():
            raise ModelNotFoundError(f"--model {str(source)!r}: no readable model_index.json ({exc}).") from exc
        reason = _hub_failure(str(source), exc) or f"no readable model_index.json ({exc})."
        hint = f" It is not a local folder or an embedded model ({', '.join(embedded_models())})."
        raise ModelNotFoundError(f"--model {str(source)!r}: {reason}{hint}") from exc
    known = {
        name: cls
        for name in rolldiff.__all__
        if isinstance(cls := getattr(rolldiff, name), type) and issubclass(cls, DiffusionPipeline)
    }
    if class_name not in known:
        raise ModelNotFoundError(
            f"--model {str(source)!r} is a {class_name!r} pipeline; rolldiff runs {', '.join(sorted(known))}."
        )
    return known[class_name]


def load_pipeline(model: str | Path | None = None, device: str | None = None, dtype: str | None = None):
    """Load an embedded model (by name), a folder or a Hub id (`None`: the default) onto `device` in `dtype`.

    The pipeline class is the one `model_index.json` names (`pipeline_class`).

    Args:
        model: an embedded model's name (`embedded_models()`), a folder saved with `save_pretrained`, a Hub
            repository id, or `None`.
        device: "cpu", "cuda", "cuda:1", ...; default: CUDA when available.
        dtype: one of `DTYPES`' names; default: bfloat16 on CUDA, float32 otherwise.

    Raises:
        ModelNotFoundError: nothing loadable under that name.
    """
    source = resolve_model(model)
    device = device or default_device()
    torch_dtype = DTYPES[dtype or default_dtype(device)]
    cls = pipeline_class(source)
    try:
        pipe = cls.from_pretrained(source, dtype=torch_dtype)
    except (OSError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelNotFoundError(f"--model {str(source)!r} could not be loaded: {reason}") from exc
    return pipe.to(device)


def native_size(pipe: KreaRealtimeVideoPipeline) -> tuple[int, int]:
    """The `(height, width)` in pixels a checkpoint was trained at: the pipeline's registered `height`/`width`.

    Pipelines saved before those were registered load with Wan 2.1's 480x832.
    """
    return int(pipe.config.height), int(pipe.config.width)

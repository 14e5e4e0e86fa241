"""The base a converted checkpoint is completed from: a diffusers Wan 2.1 or SANA-Video pipeline folder or Hub id.

The causal checkpoints ship only the transformer; the VAE, the text encoder and its tokenizer are the base model's,
and so are the transformer settings that leave no trace in the weights (`eps`, `rope_max_seq_len`). Only what the
conversion reads is downloaded from the Hub: never the base's own transformer weights (5.7 GB for Wan 1.3B, 57 GB
for 14B), which the checkpoint replaces.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .layouts import FAMILY_NAMES, SANA, WAN

__all__ = ["BaseModel", "resolve_base"]

# Pipeline classes a base folder may be, per family: diffusers' own, or a rolldiff folder of the same family.
BASE_PIPELINES = {
    WAN: ("WanPipeline", "KreaRealtimeVideoPipeline"),
    SANA: ("SanaVideoPipeline", "LongSanaVideoPipeline"),
}
BASE_TRANSFORMERS = {
    WAN: ("WanTransformer3DModel", "KreaRealtimeTransformer3DModel"),
    SANA: ("SanaVideoTransformer3DModel", "LongSanaTransformer3DModel"),
}
HUB_EXAMPLES = {WAN: "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", SANA: "Efficient-Large-Model/SANA-Video_2B_480p_diffusers"}
COMPONENTS = ("tokenizer", "text_encoder", "vae")  # what the converted pipeline takes from the base
DOWNLOADED = ["model_index.json", "transformer/config.json", *(f"{name}/*" for name in COMPONENTS)]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class BaseModel:
    """A checked base folder: its `model_index.json` and its transformer's `config.json`."""

    folder: Path
    index: dict[str, Any]
    transformer_config: dict[str, Any]

    def component(self, name: str) -> tuple[str, str]:
        """(library, class name) of one of `COMPONENTS`, as `model_index.json` names it."""
        return tuple(self.index[name])


def _download(repo_id: str, family: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=DOWNLOADED))
    except Exception as exc:  # offline, unknown repository, gated, ...: huggingface_hub's own message says which
        raise ValueError(
            f"`base` {repo_id!r} is not a local folder, and the Hub did not give it ({type(exc).__name__}: {exc}). "
            f"Pass a downloaded diffusers {FAMILY_NAMES[family]} folder (e.g. {HUB_EXAMPLES[family]})."
        ) from exc


def _folder(base: str | os.PathLike, family: str) -> Path:
    path = Path(base).expanduser()
    if path.is_dir():
        return path
    if path.exists() or not _HUB_ID.match(str(base)):
        raise ValueError(
            f"`base` {str(base)!r} is neither a folder nor a Hugging Face Hub id: give the diffusers "
            f"{FAMILY_NAMES[family]} pipeline the checkpoint was trained from (e.g. {HUB_EXAMPLES[family]})."
        )
    return _download(str(base), family)


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"`base` {str(path.parent)!r} has no readable {what} ({exc}).") from None


def resolve_base(base: str | os.PathLike, family: str) -> BaseModel:
    """The checked base for a checkpoint of `family`: a folder (or a Hub id, whose needed files are downloaded)
    holding a diffusers pipeline of that family with a tokenizer, a text encoder, a VAE and a transformer config.

    Raises:
        ValueError: naming `base`, what it is, and what a checkpoint of this family needs.
    """
    folder = _folder(base, family)
    index = _read_json(folder / "model_index.json", "model_index.json")
    accepted = BASE_PIPELINES[family]
    if index.get("_class_name") not in accepted:
        raise ValueError(
            f"`base` {str(base)!r} is a {index.get('_class_name')!r} pipeline; a {FAMILY_NAMES[family]} checkpoint "
            f"needs one of {accepted} (e.g. {HUB_EXAMPLES[family]})."
        )
    missing = [name for name in COMPONENTS if not (isinstance(index.get(name), list) and (folder / name).is_dir())]
    if missing:
        raise ValueError(f"`base` {str(base)!r} lacks the component(s) {missing} a converted pipeline takes from it.")
    config = _read_json(folder / "transformer" / "config.json", "transformer/config.json")
    if config.get("_class_name") not in BASE_TRANSFORMERS[family]:
        raise ValueError(
            f"`base` {str(base)!r} has a {config.get('_class_name')!r} transformer; a {FAMILY_NAMES[family]} "
            f"checkpoint needs one of {BASE_TRANSFORMERS[family]}."
        )
    return BaseModel(folder, index, {key: value for key, value in config.items() if not key.startswith("_")})

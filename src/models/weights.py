"""Weight checks shared by every model family: a checkpoint's weights must fit the model its config describes.

diffusers' `from_pretrained` loads a config saying 2 layers over weights with 4 (or the reverse, leaving layers
random) with only a warning, so a wrong checkpoint would generate noise. `check_weights_match_config` reads the
safetensors headers (no tensor data), builds the model from its config on the meta device, and refuses missing,
unexpected or mis-shaped weights by name, before any weight is loaded. `StrictWeightsMixin` runs it in a model's
`from_pretrained`; `check_pipeline_weights` runs it over every diffusers model of a saved pipeline folder.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import pickle
import re
import warnings
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from diffusers import ModelMixin
from safetensors import safe_open

__all__ = [
    "StrictWeightsMixin",
    "WeightsMismatchError",
    "check_pipeline_weights",
    "check_weights_match_config",
    "preview_keys",
    "resolve_dtype",
]

logger = logging.getLogger(__name__)

KEYS_IN_ERRORS = 5  # keys an error message names before it says how many there are in all


def preview_keys(keys: Iterable[str], limit: int = KEYS_IN_ERRORS) -> str:
    """The first `limit` keys, quoted, and how many there are in all: what an error about weights names."""
    keys = list(keys)
    shown = ", ".join(repr(key) for key in keys[:limit])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


class WeightsMismatchError(ValueError):
    """A checkpoint's weights do not fit the model its config describes (missing, unexpected or mis-shaped keys)."""


def _checkpoint_shapes(folder: Path, weights_name: str) -> dict[str, tuple[int, ...]] | None:
    """Names and shapes of the tensors in `folder`'s safetensors weights (one file or shards), read from headers
    only; None when the folder holds no safetensors weights under `weights_name` (nothing to check)."""
    single = folder / weights_name
    index = folder / f"{weights_name}.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        files = sorted({folder / name for name in json.loads(index.read_text())["weight_map"].values()})
    else:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as weights:
            for key in weights.keys():
                shapes[key] = tuple(weights.get_slice(key).get_shape())
    return shapes


def _blocks(keys: list[str]) -> str:
    """ " in blocks [2, 3]" for keys of numbered blocks: which layers a wrong `num_layers` adds or drops."""
    indices = sorted({int(match.group(1)) for key in keys if (match := re.match(r"^\w+\.(\d+)\.", key))})
    return f" (in blocks {indices})" if indices else ""


def weight_mismatches(
    expected: Mapping[str, tuple[int, ...]],
    found: Mapping[str, tuple[int, ...]],
    ignored: Iterable[re.Pattern] = (),
    expected_as: str = "config",
) -> tuple[list[str], list[str], list[str]]:
    """What of `found` (key -> shape) does not fit `expected`: the missing keys, the unexpected keys (but those an
    `ignored` pattern matches) and the mis-shaped ones, written `"key (found shape) ({expected_as}: shape)"`."""
    ignored = list(ignored)
    missing = [key for key in expected if key not in found]
    unexpected = [key for key in found if key not in expected and not any(p.search(key) for p in ignored)]
    misshaped = [
        f"{key} {found[key]} ({expected_as}: {expected[key]})"
        for key in expected
        if key in found and found[key] != expected[key]
    ]
    return missing, unexpected, misshaped


def check_weights_match_config(
    model_class, folder: str | os.PathLike, weights_name: str = "diffusion_pytorch_model.safetensors"
) -> None:
    """Refuse a diffusers-format model folder whose weights do not fit its `config.json`, before loading them.

    Args:
        model_class: the `ModelMixin` subclass the folder is loaded as (its config builds the expected weights).
        folder: the model's folder (`.../transformer`), holding `config.json` and safetensors weights.
        weights_name: the weights file (sharded checkpoints: its `.index.json`).

    Raises:
        WeightsMismatchError: naming the missing, unexpected and mis-shaped keys (a few of each, and how many).
    """
    folder = Path(folder)
    shapes = _checkpoint_shapes(folder, weights_name)
    if shapes is None:
        return
    with torch.device("meta"):  # shapes only: no memory, no initialisation time, even for 14B
        model = model_class.from_config(model_class.load_config(folder))
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    ignored = [
        re.compile(pattern) for pattern in getattr(model_class, "_keys_to_ignore_on_load_unexpected", None) or []
    ]
    missing, unexpected, misshaped = weight_mismatches(expected, shapes, ignored)
    if not (missing or unexpected or misshaped):
        return
    problems = []
    if missing:
        problems.append(
            f"missing {len(missing)} weight(s) the config needs{_blocks(missing)}: {preview_keys(missing)}"
        )
    if unexpected:
        problems.append(
            f"{len(unexpected)} weight(s) the config has no place for{_blocks(unexpected)}: {preview_keys(unexpected)}"
        )
    if misshaped:
        problems.append(f"{len(misshaped)} weight(s) of another shape: {', '.join(misshaped[:KEYS_IN_ERRORS])}")
    raise WeightsMismatchError(
        f"The weights in {str(folder)!r} do not match its config.json ({model_class.__name__}, "
        f"num_layers={model.config.get('num_layers', '?')}): {'; '.join(problems)}. The config and the weights "
        "come from different checkpoints; use the config.json saved with these weights."
    )


class StrictWeightsMixin:
    """Put first in a `ModelMixin` subclass's bases: `from_pretrained` of a local folder runs
    `check_weights_match_config` before loading, so mismatched weights are an error, not a warning."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        folder = Path(str(pretrained_model_name_or_path)).expanduser() / (kwargs.get("subfolder") or "")
        if folder.is_dir() and kwargs.get("variant") is None:
            check_weights_match_config(cls, folder)
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)


def check_pipeline_weights(folder: str | os.PathLike) -> None:
    """`check_weights_match_config` for every diffusers model of a saved pipeline folder (its `model_index.json`
    names each component's library and class); tokenizers, schedulers and transformers models are skipped."""
    folder = Path(folder)
    index = folder / "model_index.json"
    if not index.is_file():
        return
    for name, entry in json.loads(index.read_text()).items():
        if name.startswith("_") or not (isinstance(entry, list) and len(entry) == 2 and all(entry)):
            continue
        library, class_name = entry
        try:
            model_class = getattr(importlib.import_module(library), class_name)
        except (ImportError, AttributeError):
            continue  # from_pretrained reports a component it cannot import
        if isinstance(model_class, type) and issubclass(model_class, ModelMixin) and (folder / name).is_dir():
            check_weights_match_config(model_class, folder / name)


def rename_by_tables(
    name: str,
    block_key: re.Pattern,
    block_prefix: str,
    block_tables: tuple[Mapping[str, str], Mapping[str, str]],
    top_tables: tuple[Mapping[str, str], Mapping[str, str]],
    suffixes: Iterable[str],
) -> str | None:
    """The diffusers name of one original checkpoint key, or None: the converters' shared renaming rule.

    `block_key` matches `blocks.{i}.rest`; `block_prefix` formats the diffusers block (`"blocks.{}."`). Each tables
    pair is `(modules, parameters)`: a parameter renamed whole, or a module renamed with its `.weight`-like suffix.
    """
    match = block_key.match(name)
    if match is not None:
        index, rest = match.groups()
        prefix, (modules, parameters) = block_prefix.format(index), block_tables
    else:
        rest, prefix, (modules, parameters) = name, "", top_tables
    if rest in parameters:
        return prefix + parameters[rest]
    module, _, suffix = rest.rpartition(".")
    if suffix in suffixes and module in modules:
        return f"{prefix}{modules[module]}.{suffix}"
    return None


# Path segments FSDP, activation checkpointing and torch.compile insert anywhere in a key.
WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
# Top-level entries a training checkpoint may hold the generator's weights under, in order of preference
# (Self-Forcing / LongLive / LongSANA training: `generator_ema`, `generator`; releases and forks: `model`,
# `state_dict`). Other entries (critic, optimizer, step) are ignored.
GENERATOR_ENTRIES = ("generator_ema", "generator", "model", "state_dict")


def select_generator_weights(checkpoint: Mapping, use_ema: bool) -> Mapping:
    """The generator's weights inside a training checkpoint (`GENERATOR_ENTRIES`); a flat state dict as is.

    `use_ema` takes `generator_ema` when present, falling back to `generator`; False requires `generator`.
    """
    entries = [name for name in GENERATOR_ENTRIES if isinstance(checkpoint.get(name), Mapping)]
    if not entries:
        return checkpoint
    if not use_ema:
        if "generator_ema" in entries and "generator" not in entries:
            raise ValueError(
                "use_ema=False asks for the 'generator' weights, but this checkpoint holds only 'generator_ema'; "
                "pass use_ema=True to convert the EMA weights."
            )
        entries = [name for name in entries if name != "generator_ema"]
    elif entries[0] == "generator":
        logger.info("Checkpoint has no 'generator_ema' weights; converting 'generator' instead.")
    return checkpoint[entries[0]]


def strip_wrappers(key: str, roots: tuple[str, ...], leading_prefixes: tuple[str, ...]) -> str:
    """One key without `WRAPPER_SEGMENTS` and without leading wrapper prefixes (stripped repeatedly, as under
    `module.model.` with DDP) in front of its first original path component (`roots`)."""
    for segment in WRAPPER_SEGMENTS:
        key = key.replace(segment, "")
    while not key.startswith(roots):
        prefix = next((prefix for prefix in leading_prefixes if key.startswith(prefix)), None)
        if prefix is None:
            break
        key = key[len(prefix) :]
    return key


def unwrapped_tensors(
    weights: Mapping, roots: tuple[str, ...], leading_prefixes: tuple[str, ...], required: tuple[str, ...], kind: str
) -> dict[str, torch.Tensor]:
    """`weights` keyed by their original names (`strip_wrappers`), refused when an entry is not a tensor, two keys
    collide, or a `required` key of the `kind` format ("Wan 2.1", "SANA-Video") is missing."""
    non_tensors = [key for key, value in weights.items() if not isinstance(value, torch.Tensor)]
    if non_tensors:
        raise ValueError(f"Not a {kind} state dict: these entries are not tensors: {preview_keys(non_tensors)}.")
    stripped: dict[str, torch.Tensor] = {}
    for key, tensor in weights.items():
        name = strip_wrappers(key, roots, leading_prefixes)
        if name in stripped:
            raise ValueError(f"Two keys map to {name!r} after removing wrapper prefixes (one of them is {key!r}).")
        stripped[name] = tensor
    missing = [key for key in required if key not in stripped]
    if missing:
        raise ValueError(
            f"Not an original-format {kind} transformer state dict: missing {missing}; its keys start with "
            f"{preview_keys(weights)}."
        )
    return stripped


SAFETENSORS_SUFFIXES = (".safetensors",)
TORCH_SUFFIXES = (".pt", ".pth", ".bin")


def read_checkpoint_file(path: str | os.PathLike, torch_suffixes: tuple[str, ...] = TORCH_SUFFIXES) -> Mapping:
    """What a checkpoint file holds: `.safetensors` read with safetensors, a torch pickle only with
    `torch.load(weights_only=True)` (memory-mapped when zip-format), which rebuilds tensors and plain containers and
    never runs code stored in the pickle. Every original-format loader (Wan, SANA-Video, TAEHV) reads through here;
    `torch_suffixes` are the pickle endings it accepts (TAEHV's also `.ckpt`)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SAFETENSORS_SUFFIXES + torch_suffixes:
        raise ValueError(
            f"Unsupported checkpoint suffix {path.suffix!r} for {str(path)!r}; "
            f"expected one of {list(SAFETENSORS_SUFFIXES + torch_suffixes)}."
        )
    if not path.is_file():
        raise ValueError(f"`path` {str(path)!r} is not a file.")
    if suffix in SAFETENSORS_SUFFIXES:
        from safetensors.torch import load_file

        return load_file(str(path), device="cpu")
    try:  # mmap (no copy of a multi-GB file in memory) needs torch's zip format; older pickles load without it
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as error:
        raise ValueError(
            f"Refusing to load {str(path)!r}: it pickles Python objects other than tensors and plain containers (for "
            "example an optimizer, an OmegaConf config or a custom class), and unpickling those can run arbitrary "
            "code, so only weights_only loading is allowed. If you trust the file, re-save just the weights "
            "(torch.save or safetensors) and load that."
        ) from error
    if not isinstance(checkpoint, Mapping):
        raise ValueError(f"{str(path)!r} holds a {type(checkpoint).__name__}, not a state dict.")
    return checkpoint


def resolve_dtype(dtype: torch.dtype | None, torch_dtype: torch.dtype | None) -> torch.dtype | None:
    """`dtype`, or its older name `torch_dtype` with a FutureWarning: diffusers (0.42) and transformers take `dtype`
    and remove `torch_dtype` in 1.0, so our loaders take both, as theirs do."""
    if torch_dtype is None:
        return dtype
    if dtype is not None and dtype != torch_dtype:
        raise ValueError(
            f"Give `dtype` only (`torch_dtype` is its old name); got dtype={dtype}, torch_dtype={torch_dtype}."
        )
    warnings.warn("`torch_dtype` is deprecated: pass `dtype` (as diffusers and transformers do).", FutureWarning, 3)
    return torch_dtype

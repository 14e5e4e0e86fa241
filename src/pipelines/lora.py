"""Style LoRAs on the video pipelines: diffusers' loader, and what rolldiff adds around it.

The video pipelines take diffusers' LoRA mixins (`WanLoraLoaderMixin`, `SanaLoraLoaderMixin`), so
`pipe.load_lora_weights(...)`, `set_adapters`, `fuse_lora`, `unload_lora_weights` and the key conversions of
community LoRA files (original Wan `diffusion_model.blocks.0.self_attn.q.lora_down.weight`, kohya, musubi) work as
on `WanPipeline`. Adapters wrap the transformer's linear layers, so every cached path (the self-attention window,
the text K/V written once per prompt, the context pass) runs through them. What this module adds:

- `fuse_loras`: the `--lora` flags' path: load each, weight it, fuse everything into plain weights and drop the
  adapters, so `--compile`, `--cuda-graphs`, `--fp8` and split streams see an ordinary transformer; the fused
  sources are recorded in the pipeline's config (`fused_loras`), where a resume's fingerprint and a saved folder's
  `model_index.json` find them.
- `lora_fingerprint`: what identifies the adapters still loaded (their scales and weights), so a resume under
  other adapters is refused.
- `loaded_adapters`: the names `save_pretrained` refuses to flatten into a folder a plain model cannot load.

A stream computes its text K/V and its context under the weights it starts with: load, weight or fuse adapters
between streams, not while one runs.
"""

from __future__ import annotations

import itertools
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..checks import check_lora_source

__all__ = ["fuse_loras", "loaded_adapters", "lora_fingerprint"]


def loaded_adapters(transformer: torch.nn.Module) -> list[str]:
    """The names of the LoRA adapters loaded in `transformer` (fused or not), in load order."""
    return list(getattr(transformer, "peft_config", None) or {})


def lora_fingerprint(pipe: Any) -> dict[str, Any]:
    """The LoRAs that shape `pipe`'s frames: those fused by `fuse_loras` (from the config), and for each adapter still
    loaded its total scaling and the float64 sum of its weights (cheap: adapters are small)."""
    adapters: dict[str, dict[str, float]] = {}
    for module in pipe.transformer.modules():
        for name, scale in (getattr(module, "scaling", None) or {}).items():
            entry = adapters.setdefault(name, {"scaling": 0.0, "sum": 0.0, "merged": 0.0})
            entry["scaling"] += float(scale) if name in getattr(module, "active_adapters", ()) else 0.0
            for side in ("lora_A", "lora_B"):
                weights = getattr(module, side, {})
                if name in weights:
                    entry["sum"] += float(weights[name].weight.detach().sum(dtype=torch.float64))
            entry["merged"] += float(name in (getattr(module, "merged_adapters", None) or ()))
    return {"fused": list(pipe.config.get("fused_loras") or []), "adapters": adapters}


def _named(source: str | os.PathLike) -> str:
    """How a fused LoRA is recorded: a local file or folder by its absolute path (so the same file given from another
    folder fingerprints alike), a Hub id as given."""
    path = Path(source).expanduser()
    return str(path.resolve()) if path.exists() else str(source)


def _split(source: str | os.PathLike) -> tuple[str, dict[str, str]]:
    """diffusers' (folder or Hub id, {weight_name}) for a LoRA file, a folder holding one, or a Hub id."""
    path = Path(source).expanduser()
    if path.is_file():
        return str(path.parent), {"weight_name": path.name}
    return str(path) if path.is_dir() else str(source), {}


def fuse_loras(pipe: Any, sources: Sequence[str | os.PathLike], scales: Sequence[float]) -> None:
    """Load every LoRA in `sources` (a `.safetensors` file, a folder with one, or a Hub id), weight each by its scale,
    fuse them, with every adapter already loaded (a folder's kept LongLive adapter) at scale 1, into the transformer's
    weights and unload the adapters, leaving plain weights. Records `fused_loras` in the config.

    Raises:
        ValueError: `scales` does not pair with `sources`, a path names no file or a pickle (`check_lora_source`),
            or a LoRA does not fit the transformer (no key of it
            names one of its layers, or its shapes are another model size's); nothing stays loaded then.
    """
    if len(scales) != len(sources):
        raise ValueError(f"{len(scales)} scale(s) for {len(sources)} LoRA(s): give one scale per LoRA")
    for source in sources:
        check_lora_source(source)
    kept = loaded_adapters(pipe.transformer)
    free = (f"lora_{number}" for number in itertools.count() if f"lora_{number}" not in kept)
    names = [next(free) for _ in sources]
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")  # PEFT, on a second adapter
            for source, name in zip(sources, names):
                _load_one(pipe, source, name)
    except ValueError:
        for name in names:
            if name in loaded_adapters(pipe.transformer):
                pipe.delete_adapters(name)
        raise
    pipe.set_adapters([*kept, *names], [1.0] * len(kept) + [float(scale) for scale in scales])
    pipe.fuse_lora(adapter_names=[*kept, *names])
    pipe.unload_lora_weights()
    fused = [{"source": _named(source), "scale": float(scale)} for source, scale in zip(sources, scales)]
    pipe.register_to_config(fused_loras=[*(pipe.config.get("fused_loras") or []), *fused], lora_adapter=None)


def _load_one(pipe: Any, source: str | os.PathLike, name: str) -> None:
    """Load LoRA `source` as adapter `name`, or raise ValueError naming it."""
    where, weight_name = _split(source)
    try:
        pipe.load_lora_weights(where, adapter_name=name, **weight_name)
        if name not in loaded_adapters(pipe.transformer):  # PEFT's keys, without `transformer.`: diffusers skips them
            pipe.transformer.load_lora_adapter(where, prefix=None, adapter_name=name, **weight_name)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{str(source)!r} does not load into this pipeline's transformer: {reason}") from exc
    if name not in loaded_adapters(pipe.transformer):
        raise ValueError(f"{str(source)!r} names none of this pipeline's transformer layers")

"""LongLive's released LoRA (original Wan names, PEFT keys) -> diffusers' LoRA format for our Wan models.

LongLive fine-tunes Self-Forcing's causal Wan 1.3B with PEFT LoRA on every `nn.Linear` of each
attention block (`self_attn.q/k/v/o`, `cross_attn.q/k/v/o`, `ffn.0`, `ffn.2`; rank 256, alpha 256) and
ships the adapter as a `.pt` dict whose `"generator_lora"` entry is PEFT's state dict of the wrapped
`WanModel`: `base_model.model.blocks.0.self_attn.q.lora_A.weight`, ... `convert_longlive_lora_state_dict`
renames those modules to diffusers' (`blocks.0.attn1.to_q.lora_A.weight`) through the same table as the
base-model converter, folds `alpha / rank` into `lora_B` when they differ, and refuses anything else, so

    model.load_lora_adapter(convert_longlive_lora_state_dict(checkpoint), prefix=None, adapter_name="longlive")

applies it through diffusers/PEFT (scale with `attention_kwargs={"scale": s}`, fuse with `fuse_lora`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from .wan_conversion import _rename_key, _strip_wrappers

__all__ = ["convert_longlive_lora_state_dict", "load_longlive_lora"]

# Top-level entries a LongLive LoRA checkpoint may keep the generator's adapter under.
_LORA_CONTAINERS = ("generator_lora", "lora", "generator")
_PEFT_PREFIX = "base_model.model."
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<side>[AB])(?:\.default)?\.weight$")


def _select_adapter(checkpoint: Mapping) -> Mapping:
    for name in _LORA_CONTAINERS:
        if isinstance(checkpoint.get(name), Mapping):
            return checkpoint[name]
    return checkpoint


def convert_longlive_lora_state_dict(
    checkpoint: Mapping[str, Tensor], alpha: float | None = None
) -> dict[str, Tensor]:
    """Diffusers-named PEFT LoRA weights from a LongLive adapter checkpoint (or its `generator_lora` dict).

    `alpha`: the adapter's `lora_alpha` when it differs from its rank (LongLive: equal, scale 1); the
    scale `alpha / rank` is folded into `lora_B` so diffusers' default (alpha = rank) reproduces it.
    """
    adapter = _select_adapter(checkpoint)
    converted: dict[str, Tensor] = {}
    refused: list[str] = []
    for key, tensor in adapter.items():
        stripped = _strip_wrappers(key[len(_PEFT_PREFIX) :] if key.startswith(_PEFT_PREFIX) else key)
        match = _LORA_KEY.match(stripped)
        target = _rename_key(f"{match['module']}.weight") if match else None
        if target is None:
            refused.append(key)
            continue
        converted[f"{target[: -len('.weight')]}.lora_{match['side']}.weight"] = tensor
    if refused or not converted:
        preview = ", ".join(refused[:5]) if refused else "no LoRA keys at all"
        raise ValueError(
            f"Not a LongLive/Wan LoRA checkpoint: {len(refused)} key(s) have no diffusers LoRA name ({preview}). "
            "Expected PEFT keys such as 'base_model.model.blocks.0.self_attn.q.lora_A.weight'."
        )
    _check_pairs_and_scale(converted, alpha)
    return converted


def _check_pairs_and_scale(converted: dict[str, Tensor], alpha: float | None) -> None:
    modules = {key.rsplit(".lora_", 1)[0] for key in converted}
    for module in sorted(modules):
        down, up = converted.get(f"{module}.lora_A.weight"), converted.get(f"{module}.lora_B.weight")
        if down is None or up is None:
            raise ValueError(f"LoRA module {module!r} has only one of lora_A / lora_B.")
        rank = down.shape[0]
        if up.shape[1] != rank:
            raise ValueError(f"LoRA module {module!r}: lora_A rank {rank} but lora_B takes {up.shape[1]}.")
        if alpha is not None and alpha != rank:
            converted[f"{module}.lora_B.weight"] = up * (alpha / rank)


def load_longlive_lora(path: str | os.PathLike, alpha: float | None = None) -> dict[str, Tensor]:
    """Read a LongLive LoRA file (`.safetensors`, or `.pt` with `weights_only=True`) and convert it."""
    path = Path(path)
    if path.suffix.lower() == ".safetensors":
        from safetensors.torch import load_file

        checkpoint = load_file(str(path), device="cpu")
    else:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(checkpoint, Mapping):
        raise ValueError(f"{str(path)!r} holds a {type(checkpoint).__name__}, not a LoRA state dict.")
    return convert_longlive_lora_state_dict(checkpoint, alpha=alpha)

"""An original checkpoint plus its base -> a rolldiff pipeline that runs its authors' recipe, in memory or on disk.

`plan_conversion` does every check first (the file, its family, its recipe, the LoRA, the base, every weight's name
and shape against the base's transformer config), so a wrong checkpoint is refused before anything is built or
written. `pipeline_from_original` builds the pipeline (the transformer with empty weights, then the checkpoint's
tensors assigned: no second copy of a 14B model in memory). `convert_checkpoint` saves it into a new folder
atomically: written beside the target under a temporary name, then renamed, so a failure leaves nothing half made.
"""

from __future__ import annotations

import importlib
import inspect
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from diffusers import FlowMatchEulerDiscreteScheduler
from torch import Tensor

from ...checks import check_flag
from ...models.lora_conversion import load_longlive_lora
from ...models.sana_conversion import convert_original_sana_video_state_dict
from ...models.wan_conversion import convert_original_wan_state_dict
from ...models.weights import preview_keys, read_checkpoint_file, resolve_dtype, weight_mismatches
from ...recipes import get_recipe
from .base import BaseModel, resolve_base
from .layouts import CHECKPOINT_LAYOUTS, FAMILY_NAMES, FAMILY_PIPELINES, SANA, WAN, checkpoint_family, detect_recipe

__all__ = ["ConversionPlan", "convert_checkpoint", "pipeline_from_original", "plan_conversion"]

CONVERTERS = {WAN: convert_original_wan_state_dict, SANA: convert_original_sana_video_state_dict}
TRANSFORMER_CLASSES = {
    WAN: ("rolldiff.models.krea_realtime", "KreaRealtimeTransformer3DModel"),
    SANA: ("rolldiff.models.long_sana", "LongSanaTransformer3DModel"),
}
LONGLIVE_ADAPTER = "longlive"


@dataclass(frozen=True)
class ConversionPlan:
    """A checked conversion: what is converted, for which recipe, onto which base, with which weights."""

    checkpoint: Path
    family: str
    recipe: str
    decided: str  # how the recipe was decided, for messages ("named", "from the published file name ...")
    base: BaseModel
    weights: dict[str, Tensor]  # the transformer's, diffusers names
    lora: dict[str, Tensor] | None  # diffusers-named LoRA weights (LongLive), or None

    @property
    def pipeline_class_name(self) -> str:
        return FAMILY_PIPELINES[self.family]


def _family(raw: Mapping, path: Path) -> str:
    family = checkpoint_family(raw)
    if family is not None:
        return family
    if isinstance(raw.get("generator_lora"), Mapping):
        raise ValueError(
            f"`checkpoint` {str(path)!r} holds only a LoRA adapter ('generator_lora', LongLive's lora.pt): pass it as "
            "`lora` (--lora) beside the base weights (longlive_base.pt)."
        )
    raise ValueError(
        f"`checkpoint` {str(path)!r} is neither an original Wan 2.1 nor a SANA-Video transformer (no "
        f"'patch_embedding.weight' + 'head.modulation', no 'x_embedder.proj.weight'); its keys start with "
        f"{preview_keys(raw)}."
    )


def _check_lora_choice(recipe: str, lora: Any) -> None:
    if CHECKPOINT_LAYOUTS[recipe].needs_lora and lora is None:
        raise ValueError(
            f"recipe {recipe!r} is the base weights plus LongLive's LoRA: pass `lora` (--lora) its lora.pt "
            "(configs/longlive_inference.yaml's lora_ckpt)."
        )
    if not CHECKPOINT_LAYOUTS[recipe].needs_lora and lora is not None:
        raise ValueError(f"`lora` is LongLive's adapter, for recipe 'longlive' only; recipe {recipe!r} takes none.")


def _transformer_class(family: str) -> type:
    module, name = TRANSFORMER_CLASSES[family]
    return getattr(importlib.import_module(module), name)


def _check_against_base(plan_weights: Mapping[str, Tensor], base: BaseModel, family: str, path: Path) -> None:
    """Refuse weights that do not fit the base's transformer (another size, missing or extra keys), by name."""
    with torch.device("meta"):  # shapes only, even for 14B
        model = _transformer_class(family).from_config(base.transformer_config)
    expected = {key: tuple(tensor.shape) for key, tensor in model.state_dict().items()}
    found = {key: tuple(tensor.shape) for key, tensor in plan_weights.items()}
    missing, unexpected, misshaped = weight_mismatches(expected, found, expected_as="base")
    if not (missing or unexpected or misshaped):
        return
    config = base.transformer_config
    problems = [
        f"{label} {len(keys)}: {preview_keys(keys)}"
        for label, keys in (("missing", missing), ("not in the base", unexpected), ("of another shape", misshaped))
        if keys
    ]
    raise ValueError(
        f"`checkpoint` {str(path)!r} does not fit `base` {str(base.folder)!r} (num_layers={config.get('num_layers')}, "
        f"{config.get('num_attention_heads')} heads x {config.get('attention_head_dim')}): {'; '.join(problems)}. "
        f"Use the {FAMILY_NAMES[family]} base of the checkpoint's size (1.3B for Self-Forcing-style, 14B for Krea)."
    )


def _check_lora_fits(lora: Mapping[str, Tensor], weights: Mapping[str, Tensor]) -> None:
    """Each LoRA pair must adapt a weight of the transformer: `lora_A` its inputs, `lora_B` its outputs."""
    wrong = []
    for key, tensor in lora.items():
        module, side = key.rsplit(".lora_", 1)
        target = weights.get(f"{module}.weight")
        axis = 1 if side.startswith("A") else 0
        if target is None or tensor.shape[axis] != target.shape[axis]:
            wrong.append(key)
    if wrong:
        raise ValueError(f"`lora` does not fit the checkpoint's transformer: {preview_keys(wrong)}.")


def plan_conversion(
    checkpoint: str | os.PathLike,
    base: str | os.PathLike,
    recipe: str | None = None,
    lora: str | os.PathLike | None = None,
    use_ema: bool | None = None,
) -> ConversionPlan:
    """Read and check everything a conversion needs; nothing is built or written. See `pipeline_from_original`."""
    path = Path(checkpoint).expanduser()
    if not path.is_file():
        raise ValueError(f"`checkpoint` {str(checkpoint)!r} is not a file.")
    raw = read_checkpoint_file(path)
    family = _family(raw, path)
    recipe, decided = detect_recipe(path, family, recipe, lora is not None)
    _check_lora_choice(recipe, lora)
    use_ema = CHECKPOINT_LAYOUTS[recipe].use_ema if use_ema is None else check_flag("use_ema", use_ema)
    weights = CONVERTERS[family](raw, use_ema=use_ema)
    resolved = resolve_base(base, family)
    _check_against_base(weights, resolved, family, path)
    lora_weights = None
    if lora is not None:
        if not Path(lora).expanduser().is_file():
            raise ValueError(f"`lora` {str(lora)!r} is not a file.")
        lora_weights = load_longlive_lora(Path(lora).expanduser())
        _check_lora_fits(lora_weights, weights)
    return ConversionPlan(path, family, recipe, decided, resolved, weights, lora_weights)


def _component(base: BaseModel, name: str, dtype: torch.dtype | None):
    library, class_name = base.component(name)
    component_class = getattr(importlib.import_module(library), class_name)
    kwargs = {"dtype": dtype} if dtype is not None and name == "text_encoder" else {}
    return component_class.from_pretrained(base.folder / name, **kwargs)


def _cast(transformer, dtype: torch.dtype) -> None:
    """`transformer` in `dtype` but for the modules diffusers keeps in float32 (`_keep_in_fp32_modules`:
    RoPE, the time embedder, the modulation tables, the norms), as `from_pretrained(dtype=...)` does."""
    transformer.to(dtype)
    kept = set(getattr(transformer, "_keep_in_fp32_modules", None) or [])
    for name, tensor in [*transformer.named_parameters(), *transformer.named_buffers()]:
        if kept.intersection(name.split(".")) and tensor.is_floating_point():
            tensor.data = tensor.data.float()


def _transformer(plan: ConversionPlan, dtype: torch.dtype | None, fuse_lora: bool):
    with init_empty_weights(include_buffers=False):  # parameters on meta; the checkpoint's tensors are assigned
        transformer = _transformer_class(plan.family).from_config(plan.base.transformer_config)
    transformer.load_state_dict(plan.weights, strict=True, assign=True)
    if dtype is not None:
        _cast(transformer, dtype)
    transformer.eval()
    if plan.lora is not None:
        transformer.load_lora_adapter(dict(plan.lora), prefix=None, adapter_name=LONGLIVE_ADAPTER)
        if fuse_lora:
            transformer.fuse_lora(lora_scale=1.0)
            transformer.unload_lora()
    return transformer


def _registered_settings(pipeline_class: type, recipe: str) -> dict[str, Any]:
    """The recipe's settings the pipeline registers in its config (so the folder reads as what it runs)."""
    parameters = inspect.signature(pipeline_class.__init__).parameters
    return {key: value for key, value in get_recipe(recipe).settings.items() if key in parameters}


def pipeline_from_original(
    pipeline_class: type,
    plan: ConversionPlan,
    dtype: torch.dtype | None = None,
    fuse_lora: bool = True,
    height: int | None = None,
    width: int | None = None,
):
    """The pipeline of `plan`: its transformer, the base's tokenizer, text encoder and VAE, a flow-matching scheduler
    at the recipe's shift, and the recipe (and its cache settings) in the config. `dtype` casts the transformer
    and the text encoder (the VAE keeps the base's dtype, as diffusers' Wan examples run it in float32)."""
    if pipeline_class.__name__ != plan.pipeline_class_name:
        raise ValueError(
            f"{str(plan.checkpoint)!r} is a {FAMILY_NAMES[plan.family]} checkpoint: load it with "
            f"{plan.pipeline_class_name}.from_original, not {pipeline_class.__name__}.from_original."
        )
    check_flag("fuse_lora", fuse_lora)
    settings = get_recipe(plan.recipe).settings
    components = {name: _component(plan.base, name, dtype) for name in ("tokenizer", "text_encoder", "vae")}
    config = _registered_settings(pipeline_class, plan.recipe)
    config.update({key: value for key, value in (("height", height), ("width", width)) if value is not None})
    kept = plan.lora is not None and not fuse_lora
    return pipeline_class(
        transformer=_transformer(plan, dtype, fuse_lora),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=settings.get("timestep_shift", 5.0)),
        recipe=plan.recipe,
        lora_adapter=LONGLIVE_ADAPTER if kept else None,
        **components,
        **config,
    )


def convert_checkpoint(
    checkpoint: str | os.PathLike,
    base: str | os.PathLike,
    output: str | os.PathLike,
    overwrite: bool = False,
    **options,
) -> ConversionPlan:
    """Write the pipeline folder of an original checkpoint (`rolldiff convert`); returns the plan it followed.

    `options` are `from_original`'s (`recipe`, `lora`, `use_ema`, `fuse_lora`, `dtype`, `height`, `width`; the old
    name `torch_dtype` too).
    Everything is checked before anything is written; the folder appears whole or not at all. An existing
    non-empty `output` is refused unless `overwrite`, and then replaced only once the new folder is complete.
    """
    output = Path(output).expanduser()
    check_flag("overwrite", overwrite)
    if output.exists() and not (output.is_dir() and (overwrite or not any(output.iterdir()))):
        raise ValueError(f"`output` {str(output)!r} exists; pass overwrite=True (--overwrite) to replace it.")
    if not output.parent.is_dir():
        raise ValueError(f"`output` {str(output)!r}: its folder {str(output.parent)!r} does not exist.")
    options["dtype"] = resolve_dtype(options.pop("dtype", None), options.pop("torch_dtype", None))
    planned = {name: options.pop(name) for name in ("recipe", "lora", "use_ema") if name in options}
    plan = plan_conversion(checkpoint, base, **planned)
    pipeline_class = getattr(importlib.import_module("rolldiff"), plan.pipeline_class_name)
    pipe = pipeline_from_original(pipeline_class, plan, **options)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        pipe.save_pretrained(staging)
        if output.exists():
            shutil.rmtree(output)
        staging.replace(output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return plan

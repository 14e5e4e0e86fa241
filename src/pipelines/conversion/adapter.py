"""A LoRA adapter kept beside a pipeline's transformer instead of fused into it (`lora_adapter` in the config).

LongLive ships its weights as a base plus a LoRA. Fused, the folder is one plain transformer; kept, the folder holds
the base transformer and `transformer/pytorch_lora_weights.safetensors` (diffusers' LoRA file, diffusers' key
names), and `from_pretrained` loads it under the config's `lora_adapter` name, so its scale can be changed per call
(`attention_kwargs={"scale": s}`). Saving writes the base weights and the adapter apart: a PEFT-wrapped state dict
(`base_layer.weight`) is not what a plain model loads.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from diffusers import ModelMixin

__all__ = ["LORA_WEIGHTS_NAME", "load_kept_adapter", "saved_without_adapter"]

LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"


def load_kept_adapter(transformer: ModelMixin, source: str | os.PathLike, adapter_name: str, **hub_kwargs) -> None:
    """Load the adapter a pipeline folder (or Hub id) `source` keeps in `transformer/` under `adapter_name`."""
    transformer.load_lora_adapter(
        str(source),
        prefix=None,
        subfolder="transformer",
        weight_name=LORA_WEIGHTS_NAME,
        adapter_name=adapter_name,
        **hub_kwargs,
    )


@contextmanager
def saved_without_adapter(transformer: ModelMixin, adapter_name: str | None, folder: str | os.PathLike):
    """Inside: `transformer` without its kept adapter (plain weights to save); the adapter is written to
    `folder/transformer/` first and loaded back afterwards. A no-op when no adapter is kept."""
    loaded = adapter_name is not None and adapter_name in (getattr(transformer, "peft_config", None) or {})
    if not loaded:
        yield
        return
    target = Path(folder) / "transformer"
    staging = Path(folder) / ".lora-adapter"
    transformer.save_lora_adapter(staging, adapter_name=adapter_name, weight_name=LORA_WEIGHTS_NAME)
    transformer.unload_lora()
    try:
        yield
    finally:
        transformer.load_lora_adapter(
            str(staging), prefix=None, weight_name=LORA_WEIGHTS_NAME, adapter_name=adapter_name
        )
    target.mkdir(parents=True, exist_ok=True)
    (staging / LORA_WEIGHTS_NAME).replace(target / LORA_WEIGHTS_NAME)
    staging.rmdir()

"""Published original checkpoints -> rolldiff pipeline folders that run their authors' recipe (`rolldiff convert`).

layouts.py  each recipe's published file names and loader choices; the family and recipe of a checkpoint
base.py     the diffusers base (folder or Hub id) the tokenizer, text encoder and VAE come from
build.py    the checks, the pipeline in memory (`from_original`), the folder on disk (`convert_checkpoint`)
adapter.py  a LoRA kept beside the transformer instead of fused (`lora_adapter` in the config)
"""

from .build import ConversionPlan, convert_checkpoint, pipeline_from_original, plan_conversion
from .layouts import CHECKPOINT_LAYOUTS, CheckpointLayout, checkpoint_family, detect_recipe

__all__ = [
    "CHECKPOINT_LAYOUTS",
    "CheckpointLayout",
    "ConversionPlan",
    "checkpoint_family",
    "convert_checkpoint",
    "detect_recipe",
    "pipeline_from_original",
    "plan_conversion",
]

"""Toy world: bouncing coloured shapes with exact ground truth, for training and checking tiny video models."""

from .metrics import METRIC_UNITS, evaluate_video, summarise
from .world import SceneSpec, all_prompts, parse_prompt, render_video, sample_batch

__all__ = [
    "METRIC_UNITS",
    "SceneSpec",
    "all_prompts",
    "evaluate_video",
    "parse_prompt",
    "render_video",
    "sample_batch",
    "summarise",
]

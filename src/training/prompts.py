"""The prompts the tiny-model evaluations share (`evaluate_tiny`, `evaluate_conditioning`)."""

from __future__ import annotations

from ..toyworld.world import all_prompts


def evaluation_prompts() -> list[str]:
    """The 12 evaluation prompts: colour i goes direction i, so 4 colours x 3 shapes cover every direction too."""
    return [p for i, p in enumerate(all_prompts()) if i % 4 == (i // 12) % 4]

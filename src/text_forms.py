"""The text forms of arguments that front ends take as typed text (a command-line flag, a ComfyUI text box): a
prompt switch `FRAME:TEXT`, a step list `1000,750,500,250` and a frame list `48,96`. One parser each, raising ValueError that shows the
form expected and the text received; this module imports nothing, so the command line parses flags without torch."""

from __future__ import annotations


def parse_prompt_switch(text: str) -> tuple[int, str]:
    """`"48:a blue square moving up"` -> `(48, "a blue square moving up")`: the video frame the prompt starts at."""
    frame, separator, prompt = text.partition(":")
    if not separator or not frame.strip().isdigit() or not prompt.strip():
        raise ValueError(f"expected FRAME:TEXT with FRAME a frame number >= 0, got {text!r}")
    return int(frame), prompt.strip()


def parse_step_list(text: str) -> list[int]:
    """`"1000,750,500,250"` -> `[1000, 750, 500, 250]` (the library checks the values)."""
    return _int_list(text, "1000,750,500,250")


def parse_frame_list(text: str) -> list[int]:
    """`"48, 96"` -> `[48, 96]`: video frames (the library checks them, e.g. `scene_cuts` against the switches)."""
    return _int_list(text, "48,96")


def _int_list(text: str, example: str) -> list[int]:
    try:
        return [int(item) for item in text.split(",")]
    except ValueError:
        raise ValueError(f"expected comma-separated integers like {example}, got {text!r}") from None

"""Evaluate a video generator (or the ground-truth renderer) on toy-world prompts, per frame window.

    python -m rolldiff.toyworld.evaluate --ground-truth --json outputs/toyworld_gt.json

A trained model plugs in through `evaluate_generator` with a `generate_fn(prompt, num_frames, seed)`
that returns uint8 `(num_frames, height, width, 3)` frames.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from .metrics import METRIC_UNITS, evaluate_video, summarise
from .world import all_prompts, render_video

GenerateFn = Callable[[str, int, int], np.ndarray]
DEFAULT_WINDOWS = ((0, 100), (900, 1000))


def window_name(window: tuple[int, int]) -> str:
    return f"frames {window[0]}-{window[1]}"


def evaluate_generator(
    generate_fn: GenerateFn,
    prompts: Sequence[str],
    num_frames: int,
    windows: Sequence[tuple[int, int]] = DEFAULT_WINDOWS,
    seeds: Sequence[int] = (0,),
) -> dict[str, dict[str, float]]:
    """Mean metrics per window: `{window_name: {metric: value}}`.

    Each (prompt, seed) is generated once with `num_frames` frames and every window is cut from it.
    """
    for window in windows:
        if not 0 <= window[0] < window[1] <= num_frames:
            raise ValueError(f"windows must satisfy 0 <= start < stop <= num_frames={num_frames}; got {window!r}")
    per_window: dict[str, list[dict[str, float]]] = {window_name(w): [] for w in windows}
    for prompt in prompts:
        for seed in seeds:
            frames = np.asarray(generate_fn(prompt, num_frames, seed))
            if frames.shape[0] != num_frames or frames.dtype != np.uint8:
                raise ValueError(
                    f"generate_fn must return uint8 ({num_frames}, H, W, 3); got {frames.dtype} {frames.shape}"
                )
            for window in windows:
                per_window[window_name(window)].append(evaluate_video(frames, prompt, window))
    return {name: summarise(results) for name, results in per_window.items()}


def ground_truth_fn(height: int = 32, width: int = 32) -> GenerateFn:
    """The renderer as a `generate_fn`: the best score a model can reach on these metrics."""

    def generate(prompt: str, num_frames: int, seed: int) -> np.ndarray:
        return render_video(prompt, num_frames, height, width, seed)

    return generate


def format_table(table: dict[str, dict[str, float]]) -> str:
    """Markdown table, one row per metric and one column per window; '-' where a window lacks a metric."""
    names = list(table)
    lines = ["| metric | unit | " + " | ".join(names) + " |", "|---|---|" + "---:|" * len(names)]
    for metric, unit in METRIC_UNITS.items():
        cells = [table[name].get(metric, math.nan) for name in names]
        text = ["-" if math.isnan(v) else f"{v:.3f}" for v in cells]
        lines.append(f"| {metric} | {unit} | " + " | ".join(text) + " |")
    return "\n".join(lines)


def parse_windows(text: str) -> list[tuple[int, int]]:
    """'0:100,900:1000' -> [(0, 100), (900, 1000)]."""
    try:
        return [(int(a), int(b)) for a, b in (part.split(":") for part in text.split(","))]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"--windows must look like '0:100,900:1000'; got {text!r}") from error


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ground-truth", action="store_true", help="evaluate the synthetic renderer itself")
    parser.add_argument("--num-frames", type=int, default=1000)
    parser.add_argument("--windows", type=parse_windows, default=list(DEFAULT_WINDOWS), help="e.g. 0:100,900:1000")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--height", type=int, default=32)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--json", type=Path, default=None, help="also save the table here")
    args = parser.parse_args(argv)
    if not args.ground_truth:
        parser.error("nothing to evaluate: pass --ground-truth (models plug in through evaluate_generator)")

    began = time.perf_counter()
    prompts = all_prompts()
    table = evaluate_generator(
        ground_truth_fn(args.height, args.width), prompts, args.num_frames, args.windows, args.seeds
    )
    seconds = time.perf_counter() - began
    print(
        f"ground truth, {len(prompts)} prompts x {len(args.seeds)} seeds x {args.num_frames} frames ({seconds:.1f} s)"
    )
    print(format_table(table))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        # Strict JSON has no NaN; an undefined metric is saved as null.
        clean = {name: {k: None if math.isnan(v) else v for k, v in row.items()} for name, row in table.items()}
        args.json.write_text(json.dumps({"generator": "ground_truth", "table": clean}, indent=2) + "\n")
    return table


if __name__ == "__main__":
    main()

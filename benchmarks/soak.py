"""Soak: 10,000 frames from the embedded default pipeline in one stream, printing every 1000 frames the time,
the resident memory and whether any frame holds a NaN.

What it shows: an hour-scale stream runs in the memory of its first minute, at the speed of its first minute,
and never degrades into NaNs. It runs the pipeline exactly as a user does (`KreaRealtimeVideoPipeline.from_pretrained`
on the embedded default, `pipe.stream`, decoded frames as numpy), with the pipeline's own defaults (chunk 3,
sink 3, window 9, relative positions, 4 steps).

Columns per 1000 frames: seconds, CPU seconds (`time.process_time`, steadier than wall time on a shared machine)
and frames/s of those frames (VAE decode included), RSS now and the process
peak (MiB), NaN frames (frames with any non-finite value) and the mean pixel value (a stream that collapsed to
black or to grey shows here).

    python benchmarks/soak.py [--frames 10000] [--every 1000] [--json soak.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch
from _common import markdown_table, peak_rss_mib, rss_mib

from rolldiff import KreaRealtimeVideoPipeline
from rolldiff.defaults import default_model_path

PROMPT = "a red circle moving left"


def soak(frames: int, every: int, threads: int, seed: int = 0) -> dict:
    torch.set_num_threads(threads)
    pipe = KreaRealtimeVideoPipeline.from_pretrained(default_model_path())
    pipe.set_progress_bar_config(disable=True)
    below, above = pipe.valid_num_frames(frames)
    num_frames = below if below == frames else above
    rss_start = rss_mib()
    rows, done, nan_frames, pixel_sum = [], 0, 0, 0.0
    began = last = time.perf_counter()
    last_cpu = time.process_time()
    generator = torch.Generator().manual_seed(seed)
    for chunk in pipe.stream(PROMPT, num_frames=num_frames, generator=generator):  # (1, frames, H, W, 3)
        video = np.asarray(chunk)[0]
        nan_frames += int((~np.isfinite(video)).reshape(video.shape[0], -1).any(axis=1).sum())
        pixel_sum += float(video.mean()) * video.shape[0]
        done += video.shape[0]
        if done // every > len(rows) or done == num_frames:
            now, cpu_now = time.perf_counter(), time.process_time()
            first = rows[-1]["frames_end"] if rows else 0
            rows.append(
                dict(
                    frames_start=first,
                    frames_end=done,
                    seconds=now - last,
                    cpu_seconds=cpu_now - last_cpu,
                    fps=(done - first) / (now - last),
                    rss_mib=rss_mib(),
                    peak_rss_mib=peak_rss_mib(),
                    nan_frames=nan_frames,
                    mean_pixel=pixel_sum / (done - first),
                )
            )
            print(
                f"  frames {first:>6}-{done:<6} {now - last:6.1f} s  RSS {rows[-1]['rss_mib']:.0f} MiB  "
                f"NaN frames {nan_frames}",
                flush=True,
            )
            last, last_cpu, nan_frames, pixel_sum = now, cpu_now, 0, 0.0
    return dict(
        num_frames=num_frames,
        seconds=time.perf_counter() - began,
        rss_after_load_mib=rss_start,
        rows=rows,
        threads=threads,
        prompt=PROMPT,
    )


def table(result: dict) -> str:
    rows = [
        (
            f"{row['frames_start']}-{row['frames_end']}",
            f"{row['seconds']:.1f}",
            f"{row['cpu_seconds']:.1f}" if "cpu_seconds" in row else "-",
            f"{row['fps']:.0f}",
            f"{row['rss_mib']:.0f}",
            f"{row['peak_rss_mib']:.0f}",
            row["nan_frames"],
            f"{row['mean_pixel']:.3f}",
        )
        for row in result["rows"]
    ]
    header = ["frames", "seconds", "CPU seconds", "frames/s", "RSS MiB", "peak RSS MiB", "NaN frames", "mean pixel"]
    return markdown_table(header, rows)


def verdict(result: dict) -> tuple[bool, str]:
    """NaN-free and memory flat (the last block's RSS within 5% of the second's); time per frame is reported.

    The first block carries warm-up (first-call allocations), so the comparison starts at the second.
    """
    rows = result["rows"]
    nans = sum(row["nan_frames"] for row in rows)
    base, end = (rows[1], rows[-1]) if len(rows) > 1 else (rows[0], rows[-1])

    def per_frame(row: dict, key: str) -> float:  # blocks hold whole chunks, so their frame counts differ a little
        return row[key] / (row["frames_end"] - row["frames_start"])

    rss_ratio = end["rss_mib"] / base["rss_mib"]
    time_ratio = per_frame(end, "seconds") / per_frame(base, "seconds")
    cpu_ratio = (
        per_frame(end, "cpu_seconds") / per_frame(base, "cpu_seconds") if "cpu_seconds" in end else float("nan")
    )
    ok = nans == 0 and rss_ratio <= 1.05
    return ok, (
        f"{result['num_frames']} frames in {result['seconds']:.0f} s; NaN frames: {nans}; "
        f"RSS last/second block {rss_ratio:.3f}; time per frame, last/second block: wall {time_ratio:.2f}, "
        f"CPU {cpu_ratio:.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=10_000, help="frames to generate (default 10000)")
    parser.add_argument("--every", type=int, default=1000, help="frames per reported block (default 1000)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--json", help="also write the measurements to this JSON file")
    args = parser.parse_args(argv)
    if args.frames < 1 or args.every < 1:
        parser.error(f"--frames and --every must be >= 1, got {args.frames} and {args.every}.")
    result = soak(args.frames, args.every, args.threads)
    ok, summary = verdict(result)
    print()
    print(table(result))
    print(f"\n{summary} ({'ok' if ok else 'FAILED'})")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

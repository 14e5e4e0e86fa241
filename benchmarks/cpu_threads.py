"""Two streams at once on a CPU: in two threads of one process, against two processes.

Why `rolldiff serve`'s side-by-side groups (`--parallel-groups`) gain less than a second core: they are threads of
one process, and every torch call takes and gives back the GIL around its kernel. This measures that cost on the
embedded model with nothing else in the way: `pipe.stream` alone (one thread), two streams in two threads, and two
streams in two processes, each stream with one torch thread, steady-state frames per second after the first
chunk. Rows are interleaved `--repeats` times (this CPU moves from run to run).

    python benchmarks/cpu_threads.py            # 144 frames a stream, 2 repeats
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import threading

import torch
from _common import markdown_table, steady_stream_fps

from rolldiff.defaults import load_pipeline

PROMPT = "a red square"


def _load():
    torch.set_num_threads(1)
    pipe = load_pipeline(None, device="cpu", dtype="float32")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _in_threads(pipe, streams: int, frames: int) -> list[float]:
    rates: list[float] = []
    threads = [
        threading.Thread(target=lambda s=s: rates.append(steady_stream_fps(pipe, PROMPT, frames, s)))
        for s in range(streams)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return rates


def _child(frames: int, seed: int, ready, go, results) -> None:
    pipe = _load()
    ready.put(seed)
    go.wait()  # both children loaded: they stream at the same time
    results.put(steady_stream_fps(pipe, PROMPT, frames, seed))


def _in_processes(streams: int, frames: int) -> list[float]:
    context = multiprocessing.get_context("spawn")
    ready, results, go = context.Queue(), context.Queue(), context.Event()
    children = [context.Process(target=_child, args=(frames, s, ready, go, results)) for s in range(streams)]
    for child in children:
        child.start()
    for _ in children:
        ready.get(timeout=300)
    go.set()
    rates = [results.get(timeout=600) for _ in children]
    for child in children:
        child.join(timeout=60)
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=144, help="frames a stream (whole chunks of 3)")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved runs of every row")
    args = parser.parse_args(argv)
    if args.frames < 6 or args.frames % 3 or args.repeats < 1:
        parser.error("--frames: a multiple of 3, at least 6; --repeats: at least 1")
    pipe = _load()
    rows: dict[str, list[float]] = {"1 stream": [], "2 streams, 2 threads": [], "2 streams, 2 processes": []}
    for _ in range(args.repeats):
        rows["1 stream"].append(sum(_in_threads(pipe, 1, args.frames)))
        rows["2 streams, 2 threads"].append(sum(_in_threads(pipe, 2, args.frames)))
        rows["2 streams, 2 processes"].append(sum(_in_processes(2, args.frames)))
    alone = statistics.median(rows["1 stream"])
    print(f"cpu_threads: embedded model, {args.frames} frames a stream, 1 torch thread each, {args.repeats} repeats")
    table = [
        (name, " / ".join(f"{rate:.1f}" for rate in rates), f"{statistics.median(rates) / alone:.2f}")
        for name, rates in rows.items()
    ]
    print(markdown_table(("streams", "total fps (each repeat)", "median against 1 stream"), table, align="lrr"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

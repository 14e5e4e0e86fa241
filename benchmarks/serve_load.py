"""`rolldiff serve` under load: 1, 2, 4, 8 concurrent sessions on loopback with the embedded model, beside
`pipe.stream` alone in the same run (the server's own overhead).

Per row: aggregate and per-session frames per second (the slowest and the fastest session), time to first frame,
p50 / p99 time between chunks as a client sees them, and the server's RSS after the row. Two servers in the same
run: `--max-batch 1` (unbatched: sessions take turns on the model) and `--max-batch 8` (batched: the sessions'
transformer steps share one forward per step, their chunk decodes one decode), each with its RSS at the start and
the end, and how many session steps ran in a shared forward and session chunks in a shared decode.

    python benchmarks/serve_load.py                # about ten minutes on 2 CPU cores
    python benchmarks/serve_load.py --dry-run      # 1 and 2 sessions, short videos (CI)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from _common import markdown_table

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from serve_helpers import Server  # noqa: E402  (the tests' subprocess runner: one way to start a server)

from rolldiff.defaults import load_pipeline  # noqa: E402
from rolldiff.serving import connect  # noqa: E402


def server_rss_mib(server: Server) -> float:
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def library_fps(num_frames: int) -> float:
    pipe = load_pipeline(None, device="cpu", dtype="float32")
    pipe.set_progress_bar_config(disable=True)
    stream = pipe.stream("a red circle moving left", num_frames, generator=torch.Generator().manual_seed(0))
    next(stream)  # the first chunk allocates: timed apart, as the server's time to first frame
    start, frames = time.perf_counter(), 0
    for chunk in stream:
        frames += chunk.shape[1]
    return frames / (time.perf_counter() - start)


def one_session(url: str, num_frames: int, seed: int, results: list) -> None:
    start = time.perf_counter()
    arrivals = []
    with connect(url, prompt="a red circle moving left", seed=seed, num_frames=num_frames) as live:
        frames = 0
        for chunk in live:
            arrivals.append(time.perf_counter())
            frames += len(chunk)
    first = arrivals[0] - start
    steady = arrivals[-1] - arrivals[0]
    results.append(
        dict(ttff=first, fps=(frames - len(chunk)) / steady if steady else float("nan"), gaps=list(_gaps(arrivals)))
    )


def _gaps(arrivals: list[float]):
    return (b - a for a, b in zip(arrivals, arrivals[1:]))


def run_row(server: Server, sessions: int, num_frames: int) -> dict:
    results: list[dict] = []
    threads = [
        threading.Thread(target=one_session, args=(server.url, num_frames, s, results)) for s in range(sessions)
    ]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    elapsed = time.perf_counter() - start
    gaps = sorted(gap for result in results for gap in result["gaps"])
    rates = [result["fps"] for result in results]
    return dict(
        aggregate=sessions * num_frames / elapsed,
        slowest=min(rates),
        fastest=max(rates),
        ttff=statistics.median(r["ttff"] for r in results),
        p50=gaps[len(gaps) // 2],
        p99=gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="1 and 2 sessions, 24 frames each")
    parser.add_argument("--frames", type=int, default=192, help="frames per session (whole chunks of 3)")
    args = parser.parse_args(argv)
    counts, num_frames = ((1, 2), 24) if args.dry_run else ((1, 2, 4, 8), args.frames)
    # `rolldiff serve` on a CPU leaves one core to its event loop (cpu_count - 1 torch threads); the library alone
    # is measured with the same threads, so the difference is the server's own overhead
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    alone = library_fps(num_frames)
    threads = {"OMP_NUM_THREADS": str(torch.get_num_threads())}
    measured: dict[tuple[int, str], list[str]] = {}
    memory = []
    for mode, max_batch in (("unbatched", 1), ("batched", max(counts))):
        server = Server(
            "--max-sessions", str(max(counts)), "--max-frames", str(num_frames), "--max-batch", str(max_batch),
            env=threads,
        )  # fmt: skip
        try:
            rss_start = server_rss_mib(server)
            for sessions in counts:
                row = run_row(server, sessions, num_frames)
                measured[sessions, mode] = [
                    f"{sessions} {mode}",
                    f"{row['aggregate']:.1f}",
                    f"{row['slowest']:.1f} / {row['fastest']:.1f}",
                    f"{row['ttff'] * 1000:.0f}",
                    f"{row['p50'] * 1000:.1f} / {row['p99'] * 1000:.1f}",
                    f"{server_rss_mib(server):.0f}",
                ]
            health = server.http("/healthz")
            memory.append(
                f"{mode} server RSS: {rss_start:.0f} MiB at the start, {server_rss_mib(server):.0f} MiB at the end"
            )
            memory.append(
                f"{mode} server: {health['batched_rows']} session steps ran in forwards shared with other sessions, "
                f"{health['batched_decodes']} session chunks in decodes shared with other sessions"
            )
        finally:
            server.stop()
    header = ["sessions", "aggregate fps", "per-session fps (slowest / fastest)", "first frame ms",
              "between chunks p50 / p99 ms", "server RSS MiB"]  # fmt: skip
    print(
        f"pipe.stream alone, same run: {alone:.1f} fps (steady state, {num_frames} frames, {threads['OMP_NUM_THREADS']} torch threads)"
    )
    print("\n".join(memory))
    print(
        markdown_table(header, [measured[sessions, mode] for sessions in counts for mode in ("unbatched", "batched")])
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

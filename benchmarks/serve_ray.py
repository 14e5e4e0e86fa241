"""`rolldiff serve --ray --replicas N` beside `rolldiff serve --workers N` in the same run: how long each takes from
the command to every replica (worker) serving, and `serve_load`'s rows (aggregate and per-session fps, first frame,
time between chunks, RSS of every process the command started: for `--ray`, Ray's GCS, raylet, agents, Serve's
controller and proxy and the board actor too) for 1, 2, 4 and 8 sessions on loopback.

Both serve the embedded model with one torch thread per process (the default of either on this machine's cores), so
the difference is Ray Serve's: its proxy relays every WebSocket message between the client and the replica (one more
hop than `--workers`' shared socket), and its cluster's processes take memory.

    python benchmarks/serve_ray.py                  # about five minutes on 2 CPU cores
    python benchmarks/serve_ray.py --dry-run        # 1 and 2 sessions, 24 frames each
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from _common import markdown_table
from serve_load import run_row, server_rss_mib, table_row

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from serve_helpers import RayServer, Server  # noqa: E402  (the tests' subprocess runners)

FRAMES = 192  # a session's frames (64 chunks of 3 on the embedded model)


def servers(replicas: int) -> list[tuple[str, type[Server], list[str]]]:
    return [
        (f"--workers {replicas}", Server, ["--workers", str(replicas)]),
        (f"--ray --replicas {replicas}", RayServer, ["--ray", "--replicas", str(replicas)]),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="1 and 2 sessions, 24 frames each")
    parser.add_argument("--replicas", type=int, default=os.cpu_count() or 1, help="replicas and workers (cores)")
    args = parser.parse_args(argv)
    counts, frames = ((1, 2), 24) if args.dry_run else ((1, 2, 4, 8), FRAMES)
    size = {"height": 32, "width": 32}
    rows, notes = [], []
    for mode, kind, flags in servers(args.replicas):
        start = time.perf_counter()
        server = kind("--max-sessions", "8", "--max-batch", "8", "--max-frames", str(frames), *flags)
        started = time.perf_counter() - start
        try:
            notes.append(
                f"{mode}: serving {started:.1f} s after the command started, RSS {server_rss_mib(server):.0f} MiB"
            )
            run_row(server, 1, frames, size)  # warm-up, untimed
            for sessions in counts:
                row = run_row(server, sessions, frames, size)
                rows.append(table_row(f"{sessions} {mode}", row, server_rss_mib(server)))
                print(f"  {' | '.join(rows[-1])}", file=sys.stderr, flush=True)
            health = server.http("/healthz")
            spread = health.get("replica_sessions", health.get("worker_sessions"))
            notes.append(f"{mode}: {health['batched_rows']} session steps in shared forwards; sessions now {spread}")
        finally:
            stopping = time.perf_counter()
            code = server.stop()
            notes.append(f"{mode}: SIGTERM to exit {code} in {time.perf_counter() - stopping:.1f} s")
    print(f"serve_ray: embedded model, cpu, {os.cpu_count()} cores, {frames} frames a session, 32x32")
    print("\n".join(notes))
    header = ["sessions", "aggregate fps", "per-session fps (slowest / fastest)", "first frame ms",
              "between chunks p50 / p99 ms", "RSS MiB (all processes)"]  # fmt: skip
    print(markdown_table(header, sorted(rows, key=lambda row: int(row[0].split()[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())

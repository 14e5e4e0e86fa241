"""Pipeline parallelism for one stream, measured: per-stage forward time, time per hop, end-to-end fps.

Runs `pipe.stream(..., devices=["cpu"] * N)` (gloo, one process per stage) for N = 1 (the one-process baseline,
measured in the same run), 2 and 3, on the embedded tiny model and on a wider random-weights config of more blocks
(so the blocks' compute dominates the per-rank embedding work). Printed and saved to docs/pipeline_parallel.json:

- per stage: seconds per forward inside its own blocks (`StageLink.stats`);
- per hop: one send + receive of a chunk's hidden states between two processes (ping-pong / 2);
- end to end: pixel frames per second after the first chunk (warm-up), against the baseline;
- the throughput model for N devices from the measured one-process block time t_b (B blocks) and hop h:
  serial chain (one stream, exact) 1 / (B t_b + (N - 1) h + h_broadcast) forwards/s, and fully in flight (N
  independent forwards at once, e.g. StreamDiffusionV2's stale-input schedule) N / (B t_b + N h) ~ 1 / max stage.

`denoising="stream_batch"` rows (StreamDiffusionV2's stream batch, `recipe="streamdiffusionv2"`): the S rows of each
forward travel through the stages as micro-batches, several in flight (`rolldiff.pipelines.parallel.inflight_batch`).
Measured in steady state (after the fill, before the drain) against the one-process stream batch in the same run
(1 thread, and 2 threads: on 2 cores, 2 stages of 1 thread each against one process of 2 threads is the fair
comparison); per stage its busy time (seconds in its own blocks) per chunk and its share of the wall time; and the
throughput model from measured per-row times: S rows a chunk, each stage doing B t_b / N of blocks plus the per-row
work every rank repeats (embedding, head) e and one hop h, so chunk time = S (B t_b / N + e + h).

On this machine's 2 CPU cores, N processes share 2 cores, so measured speed-ups are bounded by the cores, not the
method; the model's numbers are what N devices of the measured speed would give.

    python benchmarks/pipeline_parallel.py [--chunks 6] [--denoising sequential stream_batch] [--out ...json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]


def _wide_pipeline():
    """Random weights: 8 blocks of width 384 (4 heads of 96), 64 x 64 frames."""
    sys.path.insert(0, str(ROOT / "tests"))
    from diffusers import FlowMatchEulerDiscreteScheduler
    from tiny_components import tiny_text_encoder, tiny_transformer, tiny_vae, word_tokenizer

    from rolldiff import KreaRealtimeVideoPipeline

    torch.manual_seed(0)
    transformer = tiny_transformer(num_layers=8, num_attention_heads=4, attention_head_dim=96, ffn_dim=1536)
    pipe = KreaRealtimeVideoPipeline(
        tokenizer=word_tokenizer(), text_encoder=tiny_text_encoder(), transformer=transformer, vae=tiny_vae(False),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), chunk_frames=1, sink_frames=1, window_frames=4,
        max_sequence_length=8, denoising_steps=[1000, 750, 500, 250],
    )  # fmt: skip
    return pipe, dict(height=64, width=64)


def _embedded_pipeline():
    from rolldiff.defaults import load_pipeline

    return load_pipeline(None, device="cpu", dtype="float32"), {}


def _ping_pong(rank: int, port: int, shape: tuple[int, ...], repeats: int, result) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tensor = torch.randn(shape)
    for _ in range(3):  # warm-up
        (dist.send if rank == 0 else dist.recv)(tensor, 1 - rank)
        (dist.recv if rank == 0 else dist.send)(tensor, 1 - rank)
    started = time.perf_counter()
    for _ in range(repeats):
        (dist.send if rank == 0 else dist.recv)(tensor, 1 - rank)
        (dist.recv if rank == 0 else dist.send)(tensor, 1 - rank)
    if rank == 0:
        result.put((time.perf_counter() - started) / (2 * repeats))
    dist.destroy_process_group()


def hop_seconds(shape: tuple[int, ...], repeats: int = 50) -> float:
    """One send + receive of a tensor of `shape` between two processes over gloo on 127.0.0.1."""
    from rolldiff.pipelines.parallel.launch import _free_port  # noqa: PLC2701 (the benchmark's own port pick)

    context = mp.get_context("spawn")
    result, port = context.Queue(), _free_port()
    processes = [context.Process(target=_ping_pong, args=(r, port, shape, repeats, result)) for r in (0, 1)]
    for process in processes:
        process.start()
    value = result.get(timeout=120)
    for process in processes:
        process.join()
    return value


def run(pipe, size: dict, stages: int, chunks: int) -> dict:
    call = dict(prompt="a red circle moving left", output_type="latent", **size)
    chunk_frames = pipe.config.chunk_frames if "height" not in size else 1
    call["num_frames"] = pipe.latent_to_frames(chunks * chunk_frames)
    devices = ["cpu"] * stages if stages > 1 else None
    stream = pipe.stream(generator=torch.Generator().manual_seed(0), devices=devices, **call)
    next(stream)  # warm-up chunk (and, split, the workers' start)
    started = time.perf_counter()
    for _ in range(chunks - 2):
        next(stream)
    stats = stream.stage_stats() if devices else None
    next(stream)
    elapsed = time.perf_counter() - started
    stream.close()
    frames = pipe.latent_to_frames(chunks * chunk_frames) - pipe.latent_to_frames(chunk_frames)
    row = {"stages": stages, "fps": frames / elapsed, "seconds": elapsed}
    if stats:
        row["stage_forward_ms"] = [1e3 * s["compute_s"] / s["forwards"] for s in stats]
        row["stage_wait_ms"] = [1e3 * s["wait_s"] / s["forwards"] for s in stats]
    return row


def block_forward_ms(pipe, size: dict) -> tuple[float, tuple[int, ...]]:
    """One-process forward time of all blocks (the stage time at N = 1) and the hidden-state shape, on a chunk."""
    from rolldiff.pipelines.parallel.link import StageLink, StageStats
    from rolldiff.pipelines.parallel.stages import stage_pipeline, stage_transformer

    link = StageLink(0, 1)
    blocks = range(len(pipe.transformer.blocks))
    staged = stage_pipeline(pipe, stage_transformer(pipe.transformer, blocks, link, torch.device("cpu")))
    shapes = []
    staged.transformer.blocks[0].register_forward_pre_hook(lambda m, a: shapes.append(tuple(a[0].shape)))
    chunk_frames = pipe.config.chunk_frames if "height" not in size else 1
    call = dict(prompt="a red circle moving left", output_type="latent", **size)
    frames = pipe.latent_to_frames(4 * chunk_frames)
    stream = staged.stream(generator=torch.Generator().manual_seed(0), num_frames=frames, **call)
    next(stream)  # warm-up, not counted
    link.stats = StageStats()
    list(stream)
    return 1e3 * link.stats.compute_s / link.stats.forwards, shapes[0]


def model(block_ms: float, hop_ms: float) -> list[dict]:
    rows = []
    for n in (1, 2, 4):
        hops = (n - 1) * hop_ms + (hop_ms if n > 1 else 0.0)  # the chain's hops, then the broadcast back
        rows.append({
            "devices": n,
            "stage_ms": block_ms / n,
            "serial_chain_forwards_per_s": 1e3 / (block_ms + hops),
            "in_flight_forwards_per_s": 1e3 / (block_ms / n + (hop_ms if n > 1 else 0.0)),
        })  # fmt: skip
    return rows


# ---------------------------------------------------------------------------------------- stream batch, rows in flight
BATCH_CALL = dict(prompt="a red circle moving left", output_type="latent", recipe="streamdiffusionv2")
BATCH_STEPS = 4  # the recipe's 1000/750/500/250: S = 4 rows a forward


def run_stream_batch(pipe, size: dict, stages: int, chunks: int, threads: int = 1) -> dict:
    """Steady-state fps of `denoising="stream_batch"` over `chunks` chunks after the fill (chunks 0 and 1), with the
    drain never timed; split: every stage's busy time per chunk and its share of the wall time."""
    total = 2 + chunks + BATCH_STEPS  # warm-up (chunk 0 alone, chunk 1 = the fill), timed, then the drain (not run)
    devices = ["cpu"] * stages if stages > 1 else None
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    stream = pipe.stream(
        generator=torch.Generator().manual_seed(0), devices=devices, denoising="stream_batch",
        num_frames=pipe.latent_to_frames(total + 1), **BATCH_CALL, **size,
    )  # fmt: skip
    next(stream), next(stream)
    before = stream.stage_stats() if devices else None
    started, latent_frames = time.perf_counter(), 0
    for _ in range(chunks):
        latent_frames += next(stream).shape[2]
    elapsed = time.perf_counter() - started
    after = stream.stage_stats() if devices else None
    stream.close()
    torch.set_num_threads(previous)
    frames = latent_frames * pipe.vae_scale_factor_temporal
    row = {"stages": stages, "threads": threads, "fps": frames / elapsed, "seconds": elapsed, "chunks": chunks}
    if after:
        busy = [a["compute_s"] - b["compute_s"] for a, b in zip(after, before)]
        waits = [a["wait_s"] - b["wait_s"] for a, b in zip(after, before)]
        row["stage_busy_ms_per_chunk"] = [1e3 * t / chunks for t in busy]
        row["stage_busy_share"] = [t / elapsed for t in busy]
        row["stage_wait_ms_per_chunk"] = [1e3 * t / chunks for t in waits]
        row["rows_in_flight_peak"] = after[0]["in_flight_peak"]
    return row


def row_forward_ms(pipe, size: dict) -> tuple[float, float]:
    """One row's forward in one process (batch 1 through one cache, as a split stage runs it): all blocks, and the
    rest every rank repeats (embedding, timestep projection, head), in ms; from the stream batch's first chunk."""
    from rolldiff.pipelines.parallel.link import StageLink, StageStats
    from rolldiff.pipelines.parallel.stages import stage_pipeline, stage_transformer

    link = StageLink(0, 1)
    blocks = range(len(pipe.transformer.blocks))
    staged = stage_pipeline(pipe, stage_transformer(pipe.transformer, blocks, link, torch.device("cpu")))
    whole = []
    staged.transformer.register_forward_pre_hook(lambda m, a: whole.append(-time.perf_counter()))
    staged.transformer.register_forward_hook(lambda m, a, o: whole.append(whole.pop() + time.perf_counter()))
    stream = staged.stream(generator=torch.Generator().manual_seed(0), num_frames=pipe.latent_to_frames(3),
                           denoising="sequential", **BATCH_CALL, **size)  # fmt: skip
    next(stream)  # warm-up, not counted
    link.stats, whole[:] = StageStats(), []
    list(stream)
    blocks_ms = 1e3 * link.stats.compute_s / link.stats.forwards
    return blocks_ms, 1e3 * sum(whole) / len(whole) - blocks_ms


def in_flight_model(blocks_ms: float, rest_ms: float, hop_ms: float, steps: int, frames_per_chunk: int) -> list:
    """Chunk time S (B t_b / N + e + h) at N = 1, 2, 4 (no hop at N = 1), as pixel frames per second."""
    rows = []
    for n in (1, 2, 4):
        stage_ms = blocks_ms / n + rest_ms + (hop_ms if n > 1 else 0.0)
        rows.append({"devices": n, "stage_ms_per_row": stage_ms, "fps": 1e3 * frames_per_chunk / (steps * stage_ms)})
    return rows


def stream_batch_results(pipe, size: dict, stages: list[int], chunks: int, hop_ms: float) -> dict:
    steps = BATCH_STEPS
    blocks_ms, rest_ms = row_forward_ms(pipe, size)
    rows = [run_stream_batch(pipe, size, 1, chunks, threads=2)]
    rows += [run_stream_batch(pipe, size, n, chunks) for n in stages]
    model_rows = in_flight_model(blocks_ms, rest_ms, hop_ms, steps, pipe.vae_scale_factor_temporal)
    print(
        f"\nstream_batch (S = {steps} rows), rows in flight; one row: blocks {blocks_ms:.2f} ms, rest {rest_ms:.2f} ms"
    )
    print(f"{'stages':>6} {'threads':>7} {'fps':>8} {'vs 1':>6}  busy ms/chunk per stage (share of wall)")
    base = next(row for row in rows if row["stages"] == 1 and row["threads"] == 1)["fps"]
    for row in rows:
        busy = " ".join(
            f"{t:7.1f} ({s:.0%})"
            for t, s in zip(row.get("stage_busy_ms_per_chunk", []), row.get("stage_busy_share", []))
        )
        print(f"{row['stages']:>6} {row['threads']:>7} {row['fps']:8.2f} {row['fps'] / base:6.2f}  {busy}")
    print(f"{'N':>6} {'stage ms/row':>13} {'fps':>8}   (model)")
    for row in model_rows:
        print(f"{row['devices']:>6} {row['stage_ms_per_row']:13.2f} {row['fps']:8.1f}")
    return {"steps": steps, "row_blocks_ms": blocks_ms, "row_rest_ms": rest_ms, "measured": rows, "model": model_rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each process (default 1)")
    parser.add_argument("--models", type=int, nargs="+", default=[0, 1], help="0: embedded, 1: random wide")
    parser.add_argument("--batch-chunks", type=int, default=8, help="stream_batch: chunks timed in steady state")
    parser.add_argument("--denoising", nargs="+", default=["sequential", "stream_batch"])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "pipeline_parallel.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # workers take threads // stages (at least 1)
    results = {
        "machine": f"{os.cpu_count()} CPU cores, gloo on 127.0.0.1, {args.threads} torch thread(s)",
        "torch": torch.__version__,
        "models": {},
    }
    configs = (("embedded tiny-bouncing-shapes (4 blocks)", _embedded_pipeline),
               ("random wide (8 blocks, width 384, 64x64)", _wide_pipeline))  # fmt: skip
    for name, make in [configs[i] for i in args.models]:
        pipe, size = make()
        pipe.set_progress_bar_config(disable=True)
        block_ms, shape = block_forward_ms(pipe, size)
        hop_ms = 1e3 * hop_seconds(shape)
        results["models"][name] = entry = {"hidden_states_shape": list(shape), "hop_ms": hop_ms}
        if "stream_batch" in args.denoising:
            entry["stream_batch"] = stream_batch_results(pipe, size, args.stages, args.batch_chunks, hop_ms)
        if "sequential" not in args.denoising:
            continue
        rows = [run(pipe, size, stages, args.chunks) for stages in args.stages]
        entry.update(blocks_forward_ms_one_process=block_ms, measured=rows, model=model(block_ms, hop_ms))
        print(f"\n{name}: all blocks {block_ms:.2f} ms/forward in one process; hop {hop_ms:.3f} ms for {shape}")
        print(f"{'stages':>6} {'fps':>8} {'vs 1':>6}  per-stage forward ms      waits ms")
        for row in rows:
            stage = " ".join(f"{t:6.2f}" for t in row.get("stage_forward_ms", [block_ms]))
            waits = " ".join(f"{t:6.2f}" for t in row.get("stage_wait_ms", []))
            print(f"{row['stages']:>6} {row['fps']:8.2f} {row['fps'] / rows[0]['fps']:6.2f}  {stage:24s}  {waits}")
        print(f"{'N':>6} {'stage ms':>9} {'serial chain fwd/s':>19} {'in flight fwd/s':>16}   (model)")
        for row in results["models"][name]["model"]:
            print(f"{row['devices']:>6} {row['stage_ms']:9.2f} {row['serial_chain_forwards_per_s']:19.1f} "
                  f"{row['in_flight_forwards_per_s']:16.1f}")  # fmt: skip
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nsaved {args.out}")


if __name__ == "__main__":
    main()

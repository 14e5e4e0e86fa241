"""Against the limit: how close one cached denoising step at real shapes comes to this machine's matmul
throughput, eager and compiled, and where the rest of the time goes.

A Wan 2.1 1.3B-shaped model (12 heads x 128, ffn 8960, text 512 x 4096; `--layers` blocks, random weights,
fp32) at 240x416 (30x52 latent, 390 tokens per frame) with the cache in steady state (chunk 3, sink 3,
window 9: the window is full and evicting) runs one denoising step of a 3-frame chunk (1170 queries over
up to 4680 keys). Measured in this run:

  matmul peak      best time of a `(1170, 1536) @ (1536, 8960)` fp32 matmul (Wan's FFN shape), GFLOP/s, from
                   wall time and from process CPU time (before and after the step; the higher is used);
  FLOPs of a step  `torch.utils.flop_counter.FlopCounterMode` (matmuls and attention; elementwise ops
                   count 0), split by module; CPU attention is counted by `_common.flop_counter` (torch's
                   table has no entry for the CPU flash kernel and counted it as 0 until this was added);
  step time        median of `--steps` steps (wall and CPU time: on a machine other jobs share, the CPU-time
                   fraction is the steadier one), eager and `torch.compile` (inductor on CPU), with the number
                   of graphs dynamo built (`CompileCounterWithBackend`); `fullgraph=True` is tried first;
  breakdown        a `torch.profiler` trace of one eager step, ops grouped by kind (linear layers,
                   attention, RoPE and other elementwise work, norms, copies into the cache);
  mask             SDPA at the step's shapes with the cache's boolean mask against no mask.

    python benchmarks/limit.py [--layers 2] [--threads 1] [--no-compile] [--json limit.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from _common import WAN_TEXT_TOKENS, flop_counter, latent_hw, markdown_table, matmul_gflops, wan_config
from research_loops import OursLoop, Setup

# aten op name -> kind, for the profiler breakdown (first match wins)
KINDS = (
    ("attention (SDPA)", ("scaled_dot_product", "flash_attention", "_efficient_attention")),
    ("linear layers (matmul)", ("addmm", "aten::mm", "aten::bmm", "aten::matmul", "aten::linear")),
    ("norms", ("layer_norm", "rms_norm", "aten::rsqrt", "aten::pow", "aten::mean")),
    ("copies into the cache / index", ("index_copy", "index_put", "copy_", "clone", "aten::index", "scatter")),
    ("GELU / activations", ("gelu", "silu", "tanh")),
    ("RoPE and other elementwise", ("aten::mul", "aten::add", "aten::sub", "aten::stack", "aten::cat", "where")),
)


def kind_of(op: str) -> str:
    for kind, needles in KINDS:
        if any(needle in op for needle in needles):
            return kind
    return "other"


def steady_loop(setup: Setup) -> tuple[OursLoop, torch.Tensor]:
    """Ours with the cache filled past the window (so it evicts), and a noisy chunk to step on."""
    loop = OursLoop(setup)
    context_chunks = -(-(setup.sink_frames + setup.window_frames) // setup.chunk_frames) + 1
    generator = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for _ in range(context_chunks):  # context passes only: what a chunk's cache holds afterwards
            loop.context_pass(torch.randn(loop.chunk_shape, generator=generator))
            loop.frames_done += setup.chunk_frames
    return loop, torch.randn(loop.chunk_shape, generator=generator)


def time_steps(step, steps: int) -> list[float]:
    return [pair[0] for pair in wall_and_cpu(step, steps)]


def wall_and_cpu(step, steps: int) -> list[tuple[float, float]]:
    """(wall s, process CPU s) per step; CPU time is what other jobs on a shared machine disturb least."""
    times = []
    for _ in range(steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        step()
        times.append((time.perf_counter() - start, time.process_time() - cpu_start))
    return times


def count_flops(step) -> tuple[float, dict[str, float]]:
    with flop_counter() as counter:
        step()
    by_module = {}
    for module, counts in counter.get_flop_counts().items():
        by_module[module] = float(sum(counts.values()))
    return float(counter.get_total_flops()), by_module


def profile_breakdown(step) -> tuple[list[tuple[str, float]], list[tuple[str, float]], float]:
    """Self CPU time of one step by kind and by op (ms), and the profiled total."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    kinds, ops = defaultdict(float), defaultdict(float)
    for event in prof.key_averages():
        ms = event.self_cpu_time_total / 1e3
        kinds[kind_of(event.key)] += ms
        ops[event.key] += ms
    total = sum(kinds.values())
    by_kind = sorted(kinds.items(), key=lambda item: -item[1])
    by_op = sorted(ops.items(), key=lambda item: -item[1])[:10]
    return by_kind, by_op, total


def mask_cost(loop: OursLoop, repeats: int = 3) -> tuple[float, float]:
    """SDPA ms at the step's shapes: with a boolean key mask (the cache's, all True once full) and without."""
    layout = loop.layout
    heads, head_dim = loop.setup.model_config["num_attention_heads"], loop.setup.model_config["attention_head_dim"]
    queries = layout.chunk_frames * layout.tokens_per_frame
    keys = (layout.sink_frames + layout.window_frames) * layout.tokens_per_frame
    q = torch.randn(1, heads, queries, head_dim)
    k, v = torch.randn(1, heads, keys, head_dim), torch.randn(1, heads, keys, head_dim)
    mask = torch.ones(1, 1, 1, keys, dtype=torch.bool)
    F.scaled_dot_product_attention(q, k, v, mask)
    with_mask = min(time_steps(lambda: F.scaled_dot_product_attention(q, k, v, mask), repeats))
    without = min(time_steps(lambda: F.scaled_dot_product_attention(q, k, v), repeats))
    return with_mask * 1e3, without * 1e3


def compiled_step(loop: OursLoop, latents, timestep):
    """Compile the model with inductor; fullgraph first. Returns (step fn, graphs, mode, compile seconds, error)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    errors = []
    for fullgraph in (True, False):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("inductor")
        compiled = torch.compile(loop.model, backend=counter, fullgraph=fullgraph)

        def step(compiled=compiled):
            with torch.inference_mode():
                compiled(latents, timestep, loop.text, kv_cache=loop.cache, layout=loop.layout)

        began = time.perf_counter()
        try:
            step()
            step()  # a second call: a recompile would show here
        except Exception as exc:  # noqa: BLE001 - reported in the table, then the next mode is tried
            errors.append(f"fullgraph={fullgraph}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
            continue
        mode = "fullgraph=True" if fullgraph else "fullgraph=False (graph breaks)"
        return step, counter.frame_count, mode, time.perf_counter() - began, "; ".join(errors)
    return None, 0, "failed", 0.0, "; ".join(errors)


def measure(layers: int, threads: int, steps: int, compile_model: bool, height: int, width: int) -> dict:
    torch.set_num_threads(threads)
    setup = Setup(
        model_config=wan_config(layers),
        latent_hw=latent_hw(height, width),
        text_tokens=WAN_TEXT_TOKENS,
        sink_frames=3,
        window_frames=9,
    )
    peak, peak_cpu = matmul_gflops()
    loop, latents = steady_loop(setup)
    timestep = loop.timestep(0.5)

    def eager_step():
        with torch.inference_mode():
            loop.velocity(latents, 0.5)

    eager_step()  # warm-up
    flops, by_module = count_flops(eager_step)
    eager_times = wall_and_cpu(eager_step, steps)
    eager = statistics.median(t for t, _ in eager_times)
    eager_cpu = statistics.median(c for _, c in eager_times)
    by_kind, by_op, profiled = profile_breakdown(eager_step)
    masked_ms, unmasked_ms = mask_cost(loop)
    result = dict(
        layers=layers,
        threads=threads,
        tokens_per_frame=loop.tokens_per_frame,
        matmul_gflops=peak,
        matmul_gflops_cpu=peak_cpu,
        gflop_per_step=flops / 1e9,
        flops_by_module={k: v / 1e9 for k, v in by_module.items() if k.count(".") <= 2},
        eager_ms=eager * 1e3,
        eager_cpu_ms=eager_cpu * 1e3,
        breakdown=by_kind,
        top_ops=by_op,
        profiled_ms=profiled,
        sdpa_mask_ms=masked_ms,
        sdpa_no_mask_ms=unmasked_ms,
    )
    if compile_model:
        step, graphs, mode, compile_s, error = compiled_step(loop, latents, timestep)
        result.update(compile_mode=mode, graphs=graphs, compile_s=compile_s, compile_error=error)
        if step is not None:
            compiled_times = wall_and_cpu(step, steps)
            result["compiled_ms"] = statistics.median(t for t, _ in compiled_times) * 1e3
            result["compiled_cpu_ms"] = statistics.median(c for _, c in compiled_times) * 1e3
            result["graphs_after"] = graphs
        torch._dynamo.reset()
    # load may have changed during the run: read the peak again
    result["matmul_gflops_after"], result["matmul_gflops_cpu_after"] = matmul_gflops()
    return result


def tables(result: dict) -> str:
    peak = max(result["matmul_gflops"], result["matmul_gflops_after"])
    peak_cpu = max(result["matmul_gflops_cpu"], result["matmul_gflops_cpu_after"])
    gflop = result["gflop_per_step"]
    rows = [
        [
            "fp32 matmul (1170x1536 @ 1536x8960), best",
            "-",
            "-",
            "-",
            f"{peak:.1f} (CPU time: {peak_cpu:.1f})",
            "1.00",
            "1.00",
        ]
    ]

    def row(name: str, wall_ms: float, cpu_ms: float) -> list[str]:
        rate = gflop / wall_ms * 1e3
        return [name, f"{wall_ms:.0f}", f"{cpu_ms:.0f}", f"{gflop:.1f}", f"{rate:.1f}", f"{rate / peak:.2f}",
                f"{gflop / cpu_ms * 1e3 / peak_cpu:.2f}"]  # fmt: skip

    rows.append(row("cached step, eager", result["eager_ms"], result["eager_cpu_ms"]))
    if "compiled_ms" in result:
        name = f"cached step, torch.compile inductor ({result['compile_mode']}, {result['graphs']} graphs)"
        rows.append(row(name, result["compiled_ms"], result["compiled_cpu_ms"]))
    elif result.get("compile_mode") == "failed":
        rows.append(["cached step, torch.compile inductor: failed", *["-"] * 6])
    header = ["what", "ms", "CPU ms", "GFLOP", "GFLOP/s", "fraction of matmul peak", "fraction, from CPU time"]
    speed = markdown_table(header, rows)
    total = result["profiled_ms"]
    breakdown = markdown_table(
        ["kind of op (profiler, one eager step)", "self CPU ms", "share"],
        [[kind, f"{ms:.1f}", f"{ms / total:.1%}"] for kind, ms in result["breakdown"]],
    )
    top = markdown_table(
        ["op", "self CPU ms", "share"], [[f"`{op}`", f"{ms:.1f}", f"{ms / total:.1%}"] for op, ms in result["top_ops"]]
    )
    queries, keys = 3 * result["tokens_per_frame"], 12 * result["tokens_per_frame"]
    mask = markdown_table(
        [f"SDPA at the step's shapes ({queries} queries, {keys} keys, 12 x 128)", "ms"],
        [
            ["with the cache's boolean mask", f"{result['sdpa_mask_ms']:.1f}"],
            ["no mask", f"{result['sdpa_no_mask_ms']:.1f}"],
        ],
    )
    return "\n\n".join([speed, breakdown, top, mask])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2, help="Wan-1.3B blocks (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, for the matmul peak too (default 1)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode (default 3)")
    parser.add_argument("--height", type=int, default=240)
    parser.add_argument("--width", type=int, default=416)
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="skip the inductor column")
    parser.add_argument("--json", help="also write the measurements to this JSON file")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    result = measure(args.layers, args.threads, args.steps, args.compile, args.height, args.width)
    print(
        f"Wan-1.3B blocks x {args.layers}, fp32, {args.threads} thread(s); {args.height}x{args.width} px -> "
        f"{result['tokens_per_frame']} tokens/frame; chunk 3 (queries {3 * result['tokens_per_frame']}), "
        "sink 3 + window 9 (full, evicting); one denoising step\n"
    )
    print(tables(result))
    if result.get("compile_error"):
        print(f"\ncompile: {result['compile_error']}")
    print(f"\n({time.perf_counter() - began:.0f} s)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    return 0 if result.get("compile_mode") != "failed" else 1


if __name__ == "__main__":
    sys.exit(main())

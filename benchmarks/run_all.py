"""Run every benchmark once and write `docs/benchmarks.md` (tables, machine, versions, commands) and the plots.

Each benchmark runs as its own process (`python benchmarks/<name>.py ...`), one after the other, with the
arguments listed in `PLAN`; its printed tables go into the page as they were printed. The race at real shapes
also writes its per-chunk series, plotted to `docs/bench_real_shapes.png` (time and RSS per chunk, ours against
the research loops). The soak takes ~10 minutes on its own, so by default a finished soak is read from
`--soak-json` (run `python benchmarks/soak.py --json soak.json` first, e.g. in the background); without it a
1,000-frame soak runs here.

The whole run is sized to finish in under 15 minutes on 2 CPU cores. The plots need matplotlib
(`pip install ".[bench]"`).

    python benchmarks/run_all.py [--soak-json soak.json] [--out docs] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import load_average, machine_summary, markdown_table

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# name -> (arguments for the full run, arguments for --quick: a smoke run of the same code)
PLAN = {
    "real_shapes": (
        ["--chunks", "100", "--window", "50", "--points", "3", "--threads", "1"],
        ["--chunks", "8", "--window", "3", "--warmup", "2", "--height", "32", "--width", "48", "--text-tokens", "16"],
    ),
    "limit": (
        ["--layers", "2", "--threads", "1"],
        ["--layers", "1", "--height", "32", "--width", "48", "--steps", "1"],
    ),
    "long_video": (
        ["--chunks", "120", "--baseline-budget-s", "8"],
        ["--chunks", "25", "--baseline-budget-s", "1", "--approaches", "ours", "ours-compiled", "recompute-krea"],
    ),
    "cache_bench": (["--threads", "1"], ["--threads", "1", "--chunks", "2", "--tokens-per-frame", "16"]),
    "sana_state": ([], ["--chunks", "4", "--window", "2", "--warmup", "1", "--height", "16", "--width", "16"]),
    "glm_image_bench": (["--size", "256"], ["--size", "256", "--references", "1"]),
    "gpu_fps": (["--dry-run"], ["--dry-run", "--no-compile"]),
}
JSON_OUTPUT = {"real_shapes", "limit", "soak"}
LONG_RACE_PLOT = "bench_real_shapes_long.png"
GPU_LOGS = ROOT / "docs" / "gpu"  # GPU runs' printed output, one file each, first line `$ command`


def run_benchmark(name: str, arguments: list[str], json_path: Path | None) -> dict:
    command = [sys.executable, str(HERE / f"{name}.py"), *arguments]
    if json_path is not None:
        command += ["--json", str(json_path)]
    shown = " ".join(["python", f"benchmarks/{name}.py", *arguments])
    print(f"[{time.strftime('%H:%M:%S')}] {shown}", flush=True)
    began = time.perf_counter()
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    seconds = time.perf_counter() - began
    print(f"    {seconds:.0f} s, exit {done.returncode}", flush=True)
    data = None
    if json_path is not None and json_path.exists():
        data = json.loads(json_path.read_text())
    return dict(
        command=shown, seconds=seconds, returncode=done.returncode, stdout=done.stdout, stderr=done.stderr, data=data
    )


def printed_tables(stdout: str) -> str:
    """The markdown tables and verdict lines a benchmark printed (progress lines dropped)."""
    keep = []
    for line in stdout.splitlines():
        stripped = line.strip()
        if not stripped or line.startswith("  ") or stripped.startswith(("USDT:", "Loading")):
            if not stripped and keep and keep[-1] != "":
                keep.append("")
            continue
        keep.append(line)
    return "\n".join(keep).strip()


def plot_real_shapes(data: dict, path: Path) -> None:
    """Per-chunk time and RSS against chunk index, every approach, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (time_axis, cpu_axis, rss_axis) = plt.subplots(1, 3, figsize=(15, 4.2))
    for approach, series in data["series"].items():
        label = data["summary"][approach]["label"].replace("`", "")
        chunks = range(len(series["ms"]))
        time_axis.plot(chunks, series["ms"], label=label, linewidth=1)
        cpu_axis.plot(chunks, series["cpu_ms"], label=label, linewidth=1)
        rss_axis.plot(chunks, series["rss"], label=label, linewidth=1)
    time_axis.set(xlabel="chunk", ylabel="ms per chunk", title="wall time per chunk")
    cpu_axis.set(xlabel="chunk", ylabel="CPU ms per chunk", title="CPU time per chunk (all threads)")
    rss_axis.set(xlabel="chunk", ylabel="RSS MiB (per process)", title="resident memory")
    time_axis.set_ylim(bottom=0)
    cpu_axis.set_ylim(bottom=0)
    rss_axis.set_ylim(bottom=0)  # from zero: a few MiB of difference must not look like growth
    rss_axis.legend(fontsize=7, loc="lower right")
    tokens = data["tokens_per_frame"]
    figure.suptitle(
        f"Wan-1.3B block x {data['args']['layers']}, {data['args']['height']}x{data['args']['width']} "
        f"({tokens} tokens/frame), chunk 3, sink 1 + window 5, lockstep run",
        fontsize=9,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def long_race_section(data: dict, plot_name: str) -> list[str]:
    """A finished long `real_shapes.py --json` run (real frame size; too long for the 15-minute budget)."""
    sys.path.insert(0, str(HERE))
    from real_shapes import tables, verdicts

    args = data["args"]
    command = " ".join(part for part in data.get("command", "").split() if part != "--json" and ".json" not in part)
    return [
        f"### The same race at {args['height']}x{args['width']} ({data['tokens_per_frame']} tokens per frame)",
        "",
        f"`{command}` ({data.get('seconds', float('nan')) / 60:.0f} minutes, its own run in the background, before or"
        " after the others, included with `run_all.py --race-json`)",
        "",
        "The real frame size of the issue: everything as above but frames 9.8x larger, so Python overhead is a"
        " smaller share and the window copies of the Self-Forcing loop a larger one. Attention is a larger share"
        " too, which favours Krea's loop: its rebuild pass attends among its 3 context frames only, where the"
        " context pass of ours and of Self-Forcing's attends to the whole window (less work, and other K/V by"
        " design; the GFLOP column is counted on one chunk, the last warm-up chunk).",
        *(
            []
            if data.get("flops_count_cpu_attention")
            else [
                "",
                "This run predates counting CPU attention in FLOPs: its GFLOP column counts the matmuls only.",
            ]
        ),
        "",
        tables(data["summary"], args["window"]),
        "",
        "\n".join(verdicts(data["summary"])),
        "",
        f"![per-chunk time and RSS at {args['height']}x{args['width']}]({plot_name})",
        "",
        "Where a loop's process RSS grows while its cache keeps its size, `benchmarks/allocator_rss.py` tells a"
        " leak (more tensors alive chunk after chunk) from glibc's allocator (the same tensors alive, RSS still"
        " growing), and shows the effect of a fixed `MALLOC_MMAP_THRESHOLD_`.",
        "",
    ]


def soak_section(result: dict) -> str:
    sys.path.insert(0, str(HERE))
    from soak import table, verdict

    ok, summary = verdict(result)
    return f"{table(result)}\n\n{summary} ({'ok' if ok else 'FAILED'})"


def gpu_logs() -> list[tuple[str, str]]:
    """(command, printed output) of each GPU run recorded in `GPU_LOGS` (its first line is `$ command`)."""
    logs = []
    for path in sorted(GPU_LOGS.glob("*.txt"), key=lambda path: ("checks" in path.name, path.name)):
        first, _, rest = path.read_text().partition("\n")
        logs.append((first.removeprefix("$ ").strip(), rest.strip("\n")))
    return logs


def gpu_section(dry_run: dict) -> list[str]:
    """The GPU runs recorded in `docs/gpu/` (a GPU is not part of this run), then this run's CPU dry run."""
    lines = [
        "## GPU: `benchmarks/gpu_fps.py` and `benchmarks/gpu_checks.py`",
        "",
        "`python benchmarks/gpu_fps.py` runs Wan 2.1 1.3B (30 blocks, random weights, bf16) at 480x832 with",
        "chunks of 3 latent frames, sink 3 + window 9, 4 steps and the Wan VAE decoding every chunk. It prints",
        "one table: ours eager, ours under `torch.compile` (inductor), the Self-Forcing loop measured on the",
        "same GPU, and the published Self-Forcing (~17 FPS) and LongLive (20.7 FPS) H100 figures. Columns: FPS,",
        "time to first frame, peak memory, and the fraction of the GPU's bf16 peak. It finishes in about 4",
        "minutes on one H200 and exits non-zero if a row fails. `python benchmarks/gpu_checks.py` checks on the",
        "GPU what CPU tests cannot: the embedded pipelines on CUDA give the CPU's video, and the CUDA-only paths",
        "(K/V offload to pinned memory with side-stream prefetch, accelerate's model CPU offload) change nothing.",
        "",
    ]
    logs = gpu_logs()
    if logs:
        lines += [
            f"Recorded GPU runs, as printed (the files in `{GPU_LOGS.relative_to(ROOT)}/`; this run did not use a",
            "GPU, so these numbers come from those runs, not this one):",
            "",
        ]
        for command, output in logs:
            lines += [f"`{command}`", "", printed_tables(output) or output, ""]
    else:
        lines += ["No GPU run is recorded yet (`docs/gpu/` is empty).", ""]
    lines += [
        "This run's CPU dry run (tiny shapes; it checks that the script runs, these are not performance numbers):",
        "",
        f"`{dry_run['command']}` ({dry_run['seconds']:.0f} s)",
        "",
        printed_tables(dry_run["stdout"]),
        "",
    ]
    return lines


def write_page(
    results: dict,
    machine_before: dict,
    load_after,
    out: Path,
    soak_source: str,
    total_s: float,
    long_race: dict | None = None,
) -> str:
    real, limit = results["real_shapes"], results["limit"]
    real_args = (real["data"] or {}).get("args", {})
    size = f"{real_args.get('height', '?')}x{real_args.get('width', '?')}"
    tokens = (real["data"] or {}).get("tokens_per_frame", "?")
    lines = [
        "# Benchmarks",
        "",
        f"Written by `python benchmarks/run_all.py` in one run of {total_s / 60:.1f} minutes. Every number below",
        "was measured in that run on the machine described here, except the soak when it comes from its own",
        "run (its section says so), the recorded GPU runs and the published GPU figures, which are marked as such.",
        "",
        "## Machine",
        "",
        markdown_table(
            ["", ""],
            [*machine_before.items(), ("load average after the run", ", ".join(f"{v:.2f}" for v in load_after))],
            "ll",
        ),
        "",
        "The machine is shared: other jobs ran during the run (see the load averages). The race below runs its",
        "approaches in lockstep so that load hits them alike, and reports medians over windows of 50 chunks.",
        "",
        "## Real shapes, same model, same run: rolldiff against the research loops",
        "",
        f"`{real['command']}` ({real['seconds']:.0f} s)",
        "",
        "What runs: Wan 2.1 1.3B's block (12 heads x 128, ffn 8960, text embeddings of width 4096) with",
        f"random weights, fp32, {real_args.get('layers', '?')} block(s), at {size} pixels ({tokens} tokens per frame).",
        "Each approach generates the same stream",
        "(same weights, noise and text) chunk by chunk: 3 latent frames per chunk, 4 denoising steps and a",
        "context pass. All see the same context, Krea Realtime's: the first latent frame plus the 2 most",
        "recent frames plus the chunk (sink 1, window 5). The approaches (`benchmarks/research_loops.py`) are",
        "re-implemented from the papers' public code descriptions, not copied:",
        "- **Self-Forcing / LongLive loop**: a dict cache per block, index tensors read with `.item()` in",
        "  every block, keys stored after RoPE (float64 complex), and the window shifted left with a `.clone()`",
        "  when a chunk would overflow.",
        "- **Krea recompute loop**: each chunk rebuilds a fresh cache from the clean latents of the first",
        "  frame and the last 2 frames, in one pass at t = 0, then denoises. There is no context pass.",
        "- **diffusers-style `torch.cat`**: each step concatenates the committed K/V with the new ones.",
        "",
        "Each approach runs in its own process, so each has its own RSS. The processes take turns, one chunk",
        "each, in a rotating order, and only one computes at a time. `x ours` is the median of the per-chunk",
        "ratios (baseline chunk time / our chunk time of the same round). The CPU-time columns repeat both",
        "measures with each worker's process CPU time, which other jobs on a shared machine disturb far less",
        "than wall time. The clean latents of the",
        "Self-Forcing and `cat` loops are checked against ours on every chunk; Krea's only until its rebuilt",
        "context first drops a frame (its K/V then differ by design).",
        "",
        f"Why {size} and {real_args.get('text_tokens', '?')} text tokens rather than 240x416 and 512: at 240x416",
        "one block costs about 0.7 TFLOP per chunk, about 8 s on one core of this CPU. Four approaches over",
        "100 chunks would take about an hour, not 15 minutes. The layer shapes are the real ones. Frame size",
        "scales every approach's matmuls alike. The research loops (like diffusers' forward) project the text",
        "in every forward; ours skips that once every block holds its text K/V (the GFLOP column shows the",
        "difference). At 512 tokens the projection is 25% of a one-block step but 0.2% of the real 30-block",
        "step at 240x416 (0.03% at 480x832). Fewer text tokens keep it nearer its real share, but at 64 tokens",
        "and one block it is still about a tenth of the loops' work: read the race's ratios with that in mind.",
        "The next section measures one step at 240x416 with 512 text tokens.",
        *(["The same race at the real frame size, run on its own, follows the plot."] if long_race else []),
        "",
        printed_tables(real["stdout"]),
        "",
        "![per-chunk time and RSS](bench_real_shapes.png)",
        "",
        *(long_race_section(long_race, LONG_RACE_PLOT) if long_race else []),
        "## Against the limit: one cached step at 240x416",
        "",
        f"`{limit['command']}` ({limit['seconds']:.0f} s)",
        "",
        "This measures one denoising step of a 3-frame chunk (1170 queries) with the cache full and evicting",
        "(sink 3 + window 9, 4680 keys). FLOPs are counted with `FlopCounterMode`, with the CPU attention kernel",
        "counted as its two matmuls (torch counts it as 0 FLOPs: before we added it, a quarter of the step's",
        "work was missing and the fractions read 0.61 eager and 0.68 compiled). The peak is the best time",
        "of an fp32 matmul at Wan's FFN shape, measured in the same process (the higher of the readings before",
        "and after the step). The breakdown is a `torch.profiler` trace of one eager step.",
        "",
        printed_tables(limit["stdout"]),
        "",
    ]
    for name, title, note in (
        (
            "long_video",
            "Long videos, small model: flat time per chunk, and the compiled step",
            "A 2-block model scaled to CPU (64 tokens per frame) over 120 chunks. At this size Python overhead"
            " dominates. The point here is flatness and the compiled step's graph count (`torch.compile` with"
            " the eager backend counts graphs; it does not generate kernels).",
        ),
        (
            "cache_bench",
            "The cache alone: time and bytes allocated per step",
            "Cache updates on random K/V at Wan 1.3B head sizes (156 tokens per frame), with and without"
            " attention. Allocations are counted with a `TorchDispatchMode`.",
        ),
    ):
        result = results[name]
        lines += [f"## {title}", "", f"`{result['command']}` ({result['seconds']:.0f} s)", "", note, ""]
        lines += [printed_tables(result["stdout"]), ""]
    sana, glm = results["sana_state"], results["glm_image_bench"]
    lines += [
        "## Other families",
        "",
        "### SANA-like (LongSANA): state cache against recompute",
        "",
        f"`{sana['command']}` ({sana['seconds']:.0f} s)",
        "",
        "SANA-Video 2B's block (20 heads x 112, mlp_ratio 3.0) with `LongSanaTransformer3DModel`, chunks of",
        "10 latent frames, on tiny frames so that 16 chunks of 3 approaches fit the budget. The approaches",
        "run interleaved in one process.",
        "",
        printed_tables(sana["stdout"]),
        "",
        "### GLM-Image-like: condition cache against diffusers' `GlmImageKVCache`",
        "",
        f"`{glm['command']}` ({glm['seconds']:.0f} s), the GLM-Image helper's benchmark, as it prints:",
        "",
        "```text",
        "\n".join(line for line in glm["stdout"].splitlines() if "should be kept in float32" not in line).strip(),
        "```",
        "",
        "## Soak: 10,000 frames with the embedded default",
        "",
        soak_source,
        "",
        results["soak"],
        "",
        *gpu_section(results["gpu_fps"]),
        "## Commands and times",
        "",
        markdown_table(
            ["command", "seconds", "exit"],
            [
                (f"`{r['command']}`", f"{r['seconds']:.0f}", r["returncode"])
                for r in results.values()
                if isinstance(r, dict) and "command" in r
            ],
        ),
        "",
    ]
    page = "\n".join(lines)
    (out / "benchmarks.md").write_text(page)
    return page


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs"), help="folder for benchmarks.md and the plots")
    parser.add_argument("--soak-json", help="results of a finished `soak.py --json` run to include")
    parser.add_argument(
        "--race-json", help="results of a finished long `real_shapes.py --json` run (e.g. at 240x416) to include"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the scripts run, not performance")
    parser.add_argument(
        "--raw",
        default=str(Path(tempfile.gettempdir()) / "rolldiff_benchmarks_raw.json"),
        help="where the raw results are saved (and read from, with --render-only)",
    )
    parser.add_argument("--render-only", action="store_true", help="rewrite the page and plots from --raw")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    long_race = json.loads(Path(args.race_json).read_text()) if args.race_json else None
    if long_race:
        plot_real_shapes(long_race, out / LONG_RACE_PLOT)
    if args.render_only:
        raw = json.loads(Path(args.raw).read_text())
        if raw["results"]["real_shapes"]["data"]:
            plot_real_shapes(raw["results"]["real_shapes"]["data"], out / "bench_real_shapes.png")
        write_page(
            raw["results"], raw["machine"], raw["load_after"], out, raw["soak_source"], raw["total_s"], long_race
        )
        print(f"wrote {out / 'benchmarks.md'} from {args.raw}")
        return 0
    began = time.perf_counter()
    machine_before = machine_summary()
    results, failed = {}, []
    with tempfile.TemporaryDirectory() as scratch:
        for name, (full, quick) in PLAN.items():
            json_path = Path(scratch) / f"{name}.json" if name in JSON_OUTPUT else None
            results[name] = run_benchmark(name, quick if args.quick else full, json_path)
            if results[name]["returncode"] != 0:
                failed.append(name)
                print(results[name]["stderr"][-3000:], file=sys.stderr)
        if args.soak_json:
            soak = json.loads(Path(args.soak_json).read_text())
            source = (
                "From a full run of `python benchmarks/soak.py --json soak.json` shortly before this run (in the"
                " background, at low priority, so its wall times show the machine's load; CPU seconds do not)."
            )
        else:
            frames = ["--frames", "60", "--every", "30"] if args.quick else ["--frames", "1000", "--every", "250"]
            run = run_benchmark("soak", frames, Path(scratch) / "soak.json")
            if run["returncode"] != 0:
                failed.append("soak")
            soak = run["data"]
            source = f"`{run['command']}` ({run['seconds']:.0f} s): a shortened soak run by `run_all`."
        results["soak"] = soak_section(soak) if soak else "soak failed: no results"
    total, load_after = time.perf_counter() - began, load_average()
    raw = dict(results=results, machine=machine_before, load_after=load_after, soak_source=source, total_s=total)
    Path(args.raw).write_text(json.dumps(raw))
    if results["real_shapes"]["data"]:
        plot_real_shapes(results["real_shapes"]["data"], out / "bench_real_shapes.png")
    write_page(results, machine_before, load_after, out, source, total, long_race)
    print(f"wrote {out / 'benchmarks.md'} in {total:.0f} s" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The benchmark scripts run and print their tables; the research-loop baselines compute what ours computes.

No timing is asserted: these check that the scripts work (argument parsing, the GPU script's CPU dry run)
and that the re-implemented Self-Forcing, `torch.cat` and Krea loops generate the same stream as rolldiff's
cache where they must, so the benchmark compares like with like.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import gpu_fps  # noqa: E402
from _common import flop_counter, window_medians  # noqa: E402
from research_loops import Setup, make_loop  # noqa: E402


# ----------------------------------------------------------------------------------------- gpu_fps arguments
def test_gpu_fps_dry_run_defaults_are_tiny():
    args = gpu_fps.parse_args(["--dry-run"])
    assert (args.height, args.width, args.layers, args.chunks, args.warmup) == (64, 64, 1, 4, 1)
    assert args.compile and args.baseline and args.vae


def test_gpu_fps_explicit_values_override_the_defaults():
    args = gpu_fps.parse_args(["--dry-run", "--chunks", "7", "--height", "96", "--no-compile", "--no-vae"])
    assert (args.chunks, args.height, args.width) == (7, 96, 64)
    assert not args.compile and not args.vae and args.baseline


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("script", ["gpu_fps", "gpu_checks"])
def test_gpu_scripts_without_cuda_refuse_and_name_the_dry_run(script, capsys):
    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(script).parse_args([])
    assert exit_info.value.code == 2
    assert "--dry-run" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--dry-run", "--height", "70"], "--height"),
        (["--dry-run", "--chunks", "0"], "--chunks"),
        (["--dry-run", "--warmup", "-1"], "--warmup"),
    ],
)
def test_gpu_fps_bad_arguments_name_the_argument(argv, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_fps.parse_args(argv)
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def tiny_vae_importable() -> bool:
    try:
        from rolldiff.models import TinyVideoAutoencoder  # noqa: F401
    except ImportError:
        return False
    return True


def test_gpu_fps_dry_run_covers_every_row_and_says_which_ran_and_why_not():
    """Every technique's row runs its CPU fallback (synchronous decode, native attention, eager compile backend)
    or says why not: CUDA graphs and fp8 refuse the CPU, the tiny VAE is there only where TAEHV is merged."""
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_fps.py"), "--dry-run"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    table = [line for line in done.stdout.splitlines() if line.startswith("|")]
    header = (
        "| row | FPS | cold first frame s (compile included) | time to first frame s | chunk p50 ms | chunk p99 ms |"
    )
    assert table[0].startswith(header + " decoder | step |")
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in table[2:]}
    published = {name for name, _ in gpu_fps.PUBLISHED_FPS}
    assert set(rows) == {technique.name for technique in gpu_fps.PLAN} | published
    best = gpu_fps.BEST
    tiny_rows = ("ours + tiny VAE", "ours + tiny VAE + overlapped decode")
    ran = ["ours, eager (baseline)", "Self-Forcing loop (measured here)", "ours + overlapped decode", best]
    ran += ["ours + Wan VAE, a chunk a call"]
    ran += ["Self-Forcing loop + best decode", f"{best} + torch.compile (no CUDA graphs)"]
    ran += list(tiny_rows) if tiny_vae_importable() else []
    for name in ran:
        assert float(rows[name][0]) > 0, (name, rows[name][0])  # a number, not FAILED / skipped
    for name in set(tiny_rows) - set(ran):
        assert rows[name][0].startswith("not available: rolldiff.models has no TinyVideoAutoencoder")
    assert rows[f"{best} + CUDA graphs"][0].startswith("skipped: capture_cuda_graphs (--cuda-graphs)")
    assert rows[f"{best} + CUDA graphs + fp8"][0].startswith("skipped: enable_fp8 (--fp8)")
    assert rows["ours + overlapped decode"][5] == "Wan VAE, overlapped (CPU: synchronous)"
    assert rows["ours + Wan VAE, a chunk a call"][5] == "Wan VAE, a chunk a call"
    assert rows[best][6] == "eager, native"  # the fastest backend on a CPU
    compiled = rows[f"{best} + torch.compile (no CUDA graphs)"]
    assert compiled[10] == "2 (fullgraph)"
    assert float(compiled[1]) > 0 and float(compiled[1]) <= float(
        compiled[11].rstrip(" |")
    )  # cold first frame within warm-up
    assert float(rows["Self-Forcing 1.3B (published, H100)"][0]) == 17.0


def test_gpu_fps_runs_the_rows_no_recorded_run_measured_first(tmp_path):
    """A short device session measures what is missing first: rows with a number in a recorded table go last."""
    (tmp_path / "h200_gpu_fps.txt").write_text(
        "| row | FPS | ms |\n| --- | ---: | ---: |\n| ours, eager (baseline) | 18.2 | 658 |\n"
        "| ours + tiny VAE | 30.4 | 394 |\n| ours + overlapped decode | skipped: budget | - |\n"
    )
    args = gpu_fps.parse_args(["--dry-run", "--recorded", str(tmp_path)])
    names = [technique.name for technique in gpu_fps.planned(args)]
    assert names[-2:] == ["ours, eager (baseline)", "ours + tiny VAE"]
    assert names.index("ours + overlapped decode") < names.index("ours, eager (baseline)")  # skipped: no number
    assert len(names) == len(gpu_fps.PLAN)
    plan_order = gpu_fps.planned(gpu_fps.parse_args(["--dry-run", "--order", "plan", "--recorded", str(tmp_path)]))
    assert [technique.name for technique in plan_order] == [technique.name for technique in gpu_fps.PLAN]


def no_decoders() -> gpu_fps.Decoders:
    return gpu_fps.Decoders(wan=None, wan_chunk=None, tiny=None, tiny_missing="skipped: --no-vae")


def test_gpu_fps_counts_flops_on_a_steady_chunk_so_every_loop_counts_the_same_work():
    """A stream's first chunks attend to less context (the Self-Forcing loop reads a shorter slice, ours a
    shorter prefix), so FLOPs counted there would differ between loops doing the same steady-state work."""
    args = gpu_fps.parse_args(["--dry-run", "--warmup", "4", "--chunks", "1", "--no-vae", "--no-compile"])
    setup, flops = gpu_fps.make_setup(args), {}
    for approach in ("ours", "self-forcing"):
        row = gpu_fps.run_row(gpu_fps.Technique(approach, approach=approach), setup, args, no_decoders(), flops)
        assert not row.error
    assert flops[("ours", "none")] == pytest.approx(flops[("self-forcing", "none")], rel=0.02)
    first_chunk = gpu_fps.parse_args(["--dry-run", "--warmup", "0", "--chunks", "1", "--no-vae", "--no-compile"])
    first_flops = {}
    gpu_fps.run_row(gpu_fps.Technique("ours"), setup, first_chunk, no_decoders(), first_flops)
    assert first_flops[("ours", "none")] < 0.9 * flops[("ours", "none")]  # counted before the window filled


@pytest.mark.parametrize("overlapped", [False, True])
def test_an_overlapped_row_times_steady_chunks_not_the_end_of_video_drain(overlapped):
    """Overlapped, chunk k's frames come back once chunk k + 1 exists and the last with no wait at all: the row
    makes one chunk more than it times, so every timed interval is a steady one."""
    from rolldiff.pipelines.codecs.overlap import OverlappedDecoder

    args = gpu_fps.parse_args(["--dry-run", "--chunks", "3", "--no-compile"])
    setup = gpu_fps.make_setup(args)
    decoder, _ = gpu_fps.build_wan_decoder(True, "cpu", torch.float32)
    decoder = OverlappedDecoder(decoder, "cpu") if overlapped else decoder
    loop, row = make_loop("ours", setup), gpu_fps.Row("x")
    gpu_fps.measure(row, loop, decoder, args, full_from=1)
    assert loop.frames_done == (3 + overlapped) * setup.chunk_frames
    assert row.fps > 0 and row.p50_ms > 0


# ----------------------------------------------------------------------------------------- gpu_checks
def test_gpu_checks_dry_run_compares_every_row_of_both_embedded_models(capsys):
    import gpu_checks

    assert gpu_checks.main(["--dry-run", "--seconds", "0.25"]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny")]
    names = [(model.lstrip("| "), row) for model, row, *_ in rows]
    krea, sana = "tiny-bouncing-shapes", "tiny-bouncing-shapes-sana"
    assert (krea, "cuda kv_offload") in names and (sana, "cuda kv_offload") not in names  # SANA has no K/V window
    assert {(sana, "cuda model_cpu_offload"), (krea, "cuda bfloat16")} <= set(names)
    speed = {"cuda CUDA graphs", "cuda fastest attention", "cuda fp8", "cuda overlapped decode", "cuda fp8 storage"}
    speed |= {"cuda offload text-encoder", "cuda offload blocks"}  # the weights offloaded: equal on the CPU too
    assert {(model, row) for model in (krea, sana) for row in speed} <= set(names)
    results = {(model.lstrip("| "), row): result.strip(" |") for model, row, *_, result in rows}
    assert (krea, "cuda CUDA graphs, streamdiffusionv2 pipelined") in names  # a Krea-like recipe only
    assert (sana, "cuda CUDA graphs, streamdiffusionv2 pipelined") not in names
    graphs = "skipped: capture_cuda_graphs"
    refused_on_cpu = {"cuda CUDA graphs": graphs, "cuda CUDA graphs, streamdiffusionv2 pipelined": graphs}
    refused_on_cpu["cuda fp8"] = "skipped: enable_fp8"
    for (model, row), result in results.items():
        assert result.startswith(refused_on_cpu.get(row, "ok")), (model, row, result)
    assert all(float(row[3]) == 0.0 for row in rows if row[1] == "cuda overlapped decode")  # exact


def test_recorded_gpu_runs_render_into_the_benchmarks_page():
    import run_all

    logs = run_all.gpu_logs()
    assert [command.split()[1] for command, _ in logs][-1] == "benchmarks/gpu_checks.py"  # the FPS runs first
    section = "\n".join(run_all.gpu_section({"command": "python benchmarks/gpu_fps.py --dry-run", "seconds": 1.0,
                                               "stdout": "| row | FPS |\n| --- | ---: |\n| ours, eager | 1.0 |"}))  # fmt: skip
    for command, output in logs:
        assert f"`{command}`" in section
        assert next(line for line in output.splitlines() if line.startswith("| ")) in section
    assert "NVIDIA H200" in section and section.rstrip().endswith("| ours, eager | 1.0 |")


# ----------------------------------------------------------------------------------------- helpers
def test_flop_counter_counts_cpu_attention_like_the_two_matmuls_it_does():
    """torch's own counter gives CPU flash attention 0 FLOPs; ours counts it, masked or not, as its matmuls."""
    query, key, value = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    mask = torch.ones(6, 10, dtype=torch.bool)
    with flop_counter() as counter:
        torch.nn.functional.scaled_dot_product_attention(query, key, value)
        torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    with flop_counter() as matmuls:
        scores = query @ key.transpose(-1, -2)
        _ = scores.softmax(-1) @ value
    assert matmuls.get_total_flops() == 2 * 2 * 2 * 6 * 10 * 8
    assert counter.get_total_flops() == 2 * matmuls.get_total_flops()


def test_window_medians_spread_windows_from_start_to_end():
    values = list(range(100))
    assert window_medians(values, 50, 3) == [(0, 24.5), (25, 49.5), (50, 74.5)]
    with pytest.raises(ValueError, match="window=50"):
        window_medians(values[:10], 50)


# ----------------------------------------------------------------------------------------- baselines are faithful
def tiny_setup() -> Setup:
    return Setup(model_config=dict(gpu_fps.TINY_MODEL, in_channels=4, out_channels=4), latent_hw=(4, 4), text_tokens=4)


def stream(approach: str, chunks: int) -> list[torch.Tensor]:
    loop = make_loop(approach, tiny_setup())
    return [loop.chunk() for _ in range(chunks)]


@pytest.fixture(scope="module")
def ours_stream():
    return stream("ours", 5)  # sink 1 + window 5 with chunks of 3: frames are evicted from chunk 2 on


@pytest.mark.parametrize("approach", ["self-forcing", "cat"])
def test_cached_baselines_generate_our_stream(approach, ours_stream):
    """Same frames, same absolute positions: eviction by shift-with-clone or by concatenation changes nothing."""
    for index, (theirs, ours) in enumerate(zip(stream(approach, 5), ours_stream)):
        torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4, msg=f"chunk {index}")


def test_krea_recompute_agrees_until_its_context_drops_a_frame(ours_stream):
    """Chunks 0 and 1 see the same frames at the same positions; from chunk 2 Krea re-indexes its context."""
    theirs = stream("krea-recompute", 3)
    torch.testing.assert_close(theirs[0], ours_stream[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(theirs[1], ours_stream[1], atol=1e-4, rtol=1e-4)
    assert (theirs[2] - ours_stream[2]).abs().max() > 1e-3


def test_self_forcing_loop_shifts_its_window_with_a_clone_once_full():
    """Its buffer holds sink + window frames; after eviction the sink is kept and the window shifted."""
    loop = make_loop("self-forcing", tiny_setup())
    for _ in range(4):
        loop.chunk()
    layer = loop.call.kv_cache[0]
    tokens_per_frame = loop.tokens_per_frame
    assert layer["k"].shape[1] == 6 * tokens_per_frame  # sink 1 + window 5
    assert layer["local_end_index"].item() == 6 * tokens_per_frame
    assert layer["global_end_index"].item() == 12 * tokens_per_frame


# ----------------------------------------------------------------------------------------- the long race on the page
def test_a_long_race_json_becomes_a_section_with_its_tables_and_plot(tmp_path):
    """`run_all.py --race-json`: a finished `real_shapes.py --json` run is rendered, not re-run."""
    import run_all

    data = tmp_path / "race.json"
    argv = ["--chunks", "5", "--window", "2", "--warmup", "2", "--height", "16", "--width", "16", "--text-tokens", "4",
            "--approaches", "ours", "cat", "--json", str(data)]  # fmt: skip
    done = subprocess.run([sys.executable, str(BENCHMARKS / "real_shapes.py"), *argv], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    race = json.loads(data.read_text())
    section = "\n".join(run_all.long_race_section(race, "long.png"))
    assert section.startswith("### The same race at 16x16 (1 tokens per frame)")  # 2x2 latent, patch 2x2
    assert "python benchmarks/real_shapes.py --chunks 5" in section and str(data) not in section
    assert "| rolldiff `RollingKVCache` (ours) |" in section and "diffusers-style per-step `torch.cat`" in section
    assert "ours, wall time: late/early" in section and "![per-chunk time and RSS at 16x16](long.png)" in section
    run_all.plot_real_shapes(race, tmp_path / "long.png")
    assert (tmp_path / "long.png").stat().st_size > 10_000


def test_allocator_rss_prints_rss_and_a_constant_tensor_count():
    argv = ["--height", "16", "--width", "16", "--chunks", "3", "--every", "1"]
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "allocator_rss.py"), *argv], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    table = [line.split("|")[1:4] for line in done.stdout.splitlines() if line.startswith("| ")]
    rows = table[2:]  # after the header and the alignment row
    assert [int(chunk) for chunk, _, _ in rows] == [0, 1, 2]
    assert len({int(tensors) for _, _, tensors in rows}) == 1  # ours keeps no tensor alive from chunk to chunk


def test_recipes_cost_dry_run_measures_every_recipe(capsys):
    import recipes_cost

    assert recipes_cost.main(["--dry-run", "--chunks", "3"]) == 0
    table = capsys.readouterr().out
    for label, _, _ in recipes_cost.ROWS:
        assert label in table
    # per latent frame (9 here): the recompute policy adds its context rebuild to chunks 1 and 2: (5 + 6 + 6) / 9
    assert "| krea-realtime (keep first frame) | 3 | 1.89 |" in table
    # frame-wise, one step a frame after a 4-step first frame: (5 + 8 * 2) / 9 forwards per frame
    assert "| causal-forcing-1step | 1 | 2.33 |" in table


def test_gpu_fps_skips_a_refusal_by_its_type_not_its_message():
    from rolldiff.pipelines.acceleration import AccelerationUnavailable

    assert gpu_fps.refusal_or_failure(AccelerationUnavailable("no CUDA here")) == "skipped: no CUDA here"
    assert gpu_fps.refusal_or_failure(ValueError("--fp8 broke")).startswith("FAILED: ValueError: --fp8 broke")


def test_serve_load_dry_run_prints_every_row_beside_the_library(tmp_path):
    command = [sys.executable, str(BENCHMARKS / "serve_load.py"), "--dry-run", "--plot", str(tmp_path / "load.png")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the plot of the rows below
    assert "pipe.stream alone, same run:" in done.stdout and "server RSS:" in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    modes = ["unbatched", "batched, one group at a time", "batched"]  # the servers
    cores = os.cpu_count() or 1
    modes += [f"batched, {cores} workers"] if cores > 1 else []  # one worker process per core
    assert len(rows) == 2 * len(modes) and all(float(row.split("|")[2]) > 0 for row in rows)  # each measured
    names = {row.split(" | ")[0].lstrip("| ") for row in rows}
    assert names == {f"{count} {mode}" for count in (1, 2) for mode in modes}, names


def test_serve_load_refuses_a_plot_path_in_a_missing_folder_before_any_work(tmp_path):
    command = [
        sys.executable,
        str(BENCHMARKS / "serve_load.py"),
        "--dry-run",
        "--plot",
        str(tmp_path / "no" / "a.png"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--plot" in done.stderr and "does not exist" in done.stderr, done.stderr[-500:]


def test_serve_load_refuses_an_unknown_server_kind_naming_the_choices():
    command = [sys.executable, str(BENCHMARKS / "serve_load.py"), "--dry-run", "--servers", "batched,ray"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--servers" in done.stderr, done.stderr[-500:]
    assert "'batched,ray': a comma-separated list of unbatched, serial, batched, workers" in done.stderr


def test_serve_load_wan_shape_dry_run_builds_serves_and_says_what_it_ran():
    """The GPU row's path (a saved Wan-shape pipeline, its tiny decoder, --device/--dtype passed through), tiny,
    on the two servers a GPU run starts (`--servers` keeps only those)."""
    command = [sys.executable, str(BENCHMARKS / "serve_load.py"), "--dry-run", "--wan-1-3b-shape", "--device", "cpu"]
    command += ["--servers", "unbatched,batched"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("serve_load: cpu, float32; model: Wan 2.1 1.3B shape (dry run: tiny)")
    assert "64x64; decoder: TAEHV (tiny decoder); 33 frames a session" in lines[0]  # 24 rounded up to 9 + 12 + 12
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in lines if line.startswith("| ")}
    assert set(rows) - {"sessions", "---"} == {"1 unbatched", "1 batched", "2 unbatched", "2 batched"}, rows
    for name in ("1 unbatched", "1 batched", "2 unbatched", "2 batched"):
        assert float(rows[name][0]) > 0 and float(rows[name][2]) > 0, (name, rows[name])  # fps, first frame ms


def test_cpu_threads_measures_one_stream_two_threads_and_two_processes():
    command = [sys.executable, str(BENCHMARKS / "cpu_threads.py"), "--frames", "6", "--repeats", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.split(" | ")[0].lstrip("| "): line for line in done.stdout.splitlines() if " stream" in line}
    assert set(rows) >= {"1 stream", "2 streams, 2 threads", "2 streams, 2 processes"}, done.stdout
    for name in ("1 stream", "2 streams, 2 threads", "2 streams, 2 processes"):
        assert float(rows[name].split("|")[2]) > 0  # a measured total, each repeat


def test_cpu_threads_refuses_frames_that_are_not_whole_chunks():
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "cpu_threads.py"), "--frames", "7"], capture_output=True, text=True
    )
    assert done.returncode == 2 and "--frames" in done.stderr


def test_device_run_refuses_an_unknown_step_before_any_work(tmp_path):
    """The prepared device script names its steps; a typo costs no device time and writes nothing."""
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(BENCHMARKS / "device_run.sh"), "fps", "serv"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "OUT": str(out)},
    )
    assert done.returncode == 2, done.stderr
    assert "unknown step 'serv': give fps, checks or serve" in done.stderr
    assert not out.exists() and done.stdout == ""


# ----------------------------------------------------------------------------------------- weights_memory
def test_weights_memory_counts_each_published_checkpoint_under_each_offload_mode(capsys):
    import weights_memory

    assert weights_memory.main() == 0
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in capsys.readouterr().out.splitlines()]
    rows = [row for row in rows if len(row) == 8 and row[1].endswith(" B)")]
    assert len(rows) == 2 * len(weights_memory.CHECKPOINTS)  # each in bfloat16, then with --fp8-storage
    gb = lambda cell: float(cell.split(" GB")[0])  # noqa: E731
    billions = [float(row[1].split("(")[1].split(" B")[0]) for row in rows[::2]]
    assert 1.3 <= billions[0] <= 1.5 and 14.0 <= billions[1] <= 14.5 and 1.9 <= billions[2] <= 2.2  # 1.3B, 14B, 2B
    for plain, stored in zip(rows[::2], rows[1::2], strict=True):
        resident, text_encoder, model, blocks = (gb(cell) for cell in plain[4:])
        assert resident > text_encoder > blocks and resident > model > blocks
        assert gb(stored[1]) < 0.55 * gb(plain[1]) and gb(stored[5]) < text_encoder  # float8: about half

"""`rolldiff serve` under load: 1, 2, 4, 8 concurrent sessions on loopback, beside `pipe.stream` alone in the same
run (the server's own overhead).

Per row: aggregate and per-session frames per second (the slowest and the fastest session), time to first frame,
p50 / p99 time between chunks as a client sees them, and the server's RSS after the row (all its processes). Up to
four servers in the same run: `--max-batch 1` (unbatched: sessions take turns on the model), `--max-batch 8
--parallel-groups 1` (batched: the sessions' transformer steps share one forward per step, their chunk decodes one
decode, one group after another), `--max-batch 8` (batched, with the server's default parallel groups: on a CPU,
groups of 4 or more side by side, one per core) and, on a CPU of 2 or more cores, `--max-batch 8 --workers CORES`
(batched in one server process per core, each with its share of the sessions), each with its RSS at the start and
the end, how many session steps ran in a shared forward, session chunks in a shared decode and groups beside another. Each server first runs one untimed session (kernels chosen,
buffers allocated), as the library's first chunk is timed apart.

The model is the embedded one by default; `--model`, `--device`, `--dtype` and `--tiny-vae` go to both the server
(`rolldiff serve` flags of the same names) and the library baseline, loaded the same way (`load_pipeline`, then
`load_tiny_autoencoder`). `--height` / `--width` go in each session's `start` message and to `pipe.stream` (the
server has no such flags: a session picks its size). `--wan-1-3b-shape` builds a random-weight pipeline with Wan 2.1
1.3B's transformer (30 blocks, 12 heads x 128, text 512 x 4096), the Wan 2.1 VAE and a random TAEHV decoder,
saves it to a temporary folder and serves it at 480x832 with the tiny decoder (`--dry-run` shrinks it to gpu_fps's
tiny shapes at 64x64, so a CPU runs the same path). The first printed line names device, dtype, model and size.

    python benchmarks/serve_load.py                # about ten minutes on 2 CPU cores
    python benchmarks/serve_load.py --dry-run      # 1 and 2 sessions, short videos (CI)
    python benchmarks/serve_load.py --wan-1-3b-shape --device cuda --frames 96   # the GPU row (issue 25)
    python benchmarks/serve_load.py --wan-1-3b-shape --device cuda --frames 48 --servers batched  # a short GPU run
    python benchmarks/serve_load.py --wan-1-3b-shape --dry-run --device cpu      # the same path, tiny, on a CPU
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from _common import WAN_1_3B, WAN_TEXT_TOKENS, latent_hw, markdown_table, steady_stream_fps, wan_config

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from serve_helpers import Server, process_tree  # noqa: E402  (the tests' subprocess runner: one way to start a server)

from rolldiff.defaults import DTYPES, default_device, default_dtype, load_pipeline, native_size  # noqa: E402
from rolldiff.serving import connect  # noqa: E402

PROMPT = "a red circle moving left"
WAN_SIZE = (480, 832)  # Wan 2.1's native frame size
DRY_WAN_SIZE = (64, 64)  # gpu_fps's dry-run size


SERVER_KINDS = ("unbatched", "serial", "batched", "workers")  # `--servers`: the servers a run may start


def servers(
    batch: str, device: str, kinds: tuple[str, ...] = SERVER_KINDS
) -> list[tuple[str, list[str], dict[str, str]]]:
    """The servers each row runs on, with their flags and torch threads: sessions taking turns ("unbatched");
    batched, one group after another ("serial"); batched, groups of 4 or more side by side (the server's default on
    a CPU: its cores over torch's threads, "batched"); and on a CPU of 2 or more cores, batched in one worker
    process per core (`--workers`, one torch thread each, "workers"). On a GPU the default is one group at a time,
    so "serial" and "batched" are the same server and it runs once, and `--workers` is for CPUs. `kinds` keeps
    only those named."""
    threads = {"OMP_NUM_THREADS": str(torch.get_num_threads())}
    if torch.device(device).type != "cpu":
        rows = [
            ("unbatched", "unbatched", ["--max-batch", "1"], threads),
            ("batched", "batched", ["--max-batch", batch], threads),
        ]
        kinds = tuple(kind.replace("serial", "batched") for kind in kinds)
    else:
        rows = [
            ("unbatched", "unbatched", ["--max-batch", "1"], threads),
            ("serial", "batched, one group at a time", ["--max-batch", batch, "--parallel-groups", "1"], threads),
            ("batched", "batched", ["--max-batch", batch], threads),
        ]
        cores = os.cpu_count() or 1
        if cores > 1:
            rows.append(
                ("workers", f"batched, {cores} workers", ["--max-batch", batch, "--workers", str(cores)],
                 {"OMP_NUM_THREADS": "1"})
            )  # fmt: skip
    return [(label, flags, env) for kind, label, flags, env in rows if kind in kinds]


class LoadServer(Server):
    """The tests' server, given longer to come up: a Wan-1.3B-shape pipeline takes tens of seconds to load."""

    def wait_ready(self, seconds: float = 600.0) -> None:
        super().wait_ready(seconds)


def table_row(label: str, row: dict, rss_mib: float) -> list[str]:
    """One printed row: aggregate fps, slowest / fastest session, first frame, p50 / p99 gap, server RSS."""
    return [
        label,
        f"{row['aggregate']:.1f}",
        f"{row['slowest']:.1f} / {row['fastest']:.1f}",
        f"{row['ttff'] * 1000:.0f}",
        f"{row['p50'] * 1000:.1f} / {row['p99'] * 1000:.1f}",
        f"{rss_mib:.0f}",
    ]


def server_rss_mib(server: Server, field: str = "VmRSS") -> float:
    """The resident memory of the server's processes (its workers included, with `--workers`): their RSS, or with
    `field="Pss"` their proportional set size (pages shared between processes, torch's libraries among them, split
    between them: what the server adds to the machine)."""
    return sum(_memory_kib(pid, field) for pid in process_tree(server.process.pid)) / 1024


def _memory_kib(pid: int, field: str) -> int:
    source = "smaps_rollup" if field == "Pss" else "status"
    try:
        text = Path(f"/proc/{pid}/{source}").read_text()
    except FileNotFoundError:
        return 0
    return next((int(line.split()[1]) for line in text.splitlines() if line.startswith(f"{field}:")), 0)


# ----------------------------------------------------------------------------------------- the model
def build_wan_shape_pipeline(folder: Path, dry_run: bool, device: str, dtype: str, size: tuple[int, int]) -> Path:
    """Save a random-weight pipeline with Wan 2.1 1.3B's transformer and VAE (gpu_fps's tiny ones for a dry run) to
    `folder/pipeline`, and a random TAEHV (taew2_1's shape) to `folder/taehv.safetensors`; returns the latter.

    The weights come from the GPU benchmarks' builders (same seeds, cast as `from_pretrained` casts); the text
    encoder is the embedded model's word-level tokenizer with a random one-layer UMT5 of the transformer's text
    width, so a prompt is encoded to `max_sequence_length` tokens of Wan's 4096 (its cost is once per session)."""
    from gpu_fps import TINY_MODEL, build_tiny_decoder, build_wan_decoder
    from research_loops import Setup, build_model
    from safetensors.torch import save_file

    from rolldiff import KreaRealtimeVideoPipeline
    from rolldiff.training.tiny_components import TinyConfig, build_scheduler, build_text_encoder, build_tokenizer

    torch_dtype = DTYPES[dtype]
    config = dict(TINY_MODEL) if dry_run else wan_config(WAN_1_3B["num_layers"])
    text_tokens = 8 if dry_run else WAN_TEXT_TOKENS
    setup = Setup(config, latent_hw(*size), text_tokens, device=device, dtype=dtype)
    tokenizer = build_tokenizer()
    text_encoder = build_text_encoder(TinyConfig(text_dim=config["text_dim"]), vocab_size=len(tokenizer))
    pipe = KreaRealtimeVideoPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder.to(torch_dtype),
        transformer=build_model(setup),
        vae=build_wan_decoder(dry_run, device, torch_dtype)[0].vae,
        scheduler=build_scheduler(TinyConfig()),
        max_sequence_length=text_tokens,
        height=size[0],
        width=size[1],
    )
    pipe.save_pretrained(folder / "pipeline")
    del pipe
    tiny, missing = build_tiny_decoder(device, torch_dtype)
    if tiny is None:
        raise RuntimeError(f"--wan-1-3b-shape needs the tiny decoder: {missing}")
    state = {name: tensor.detach().cpu().contiguous() for name, tensor in tiny.autoencoder.state_dict().items()}
    save_file(state, str(folder / "taehv.safetensors"))
    return folder / "taehv.safetensors"


def load(args: argparse.Namespace):
    """What `rolldiff serve` loads for these flags (`load_pipeline`, then the tiny decoder)."""
    pipe = load_pipeline(args.model, device=args.device, dtype=args.dtype)
    pipe.set_progress_bar_config(disable=True)
    if args.tiny_vae is not None:
        pipe.load_tiny_autoencoder(args.tiny_vae)
    return pipe


def describe(pipe, args: argparse.Namespace, num_frames: int) -> str:
    """The header line: device, dtype, model shape, frame size, decoder, frames a session."""
    where = args.device
    if torch.device(args.device).type == "cuda":
        where += f" ({torch.cuda.get_device_name(torch.device(args.device))})"
    config = pipe.transformer.config
    shape = ", ".join(
        f"{label} {config[key]}"
        for key, label in (("num_layers", "blocks"), ("num_attention_heads", "heads"),
                           ("attention_head_dim", "head dim"), ("ffn_dim", "ffn"))
        if key in config
    )  # fmt: skip
    if args.wan_1_3b_shape:
        model = f"Wan 2.1 1.3B shape{' (dry run: tiny)' if args.dry_run else ''}, random weights"
    else:
        model = str(args.model or "tiny-bouncing-shapes")
    decoder = "TAEHV (tiny decoder)" if args.tiny_vae is not None else "the pipeline's VAE"
    return (
        f"serve_load: {where}, {args.dtype}; model: {model} ({type(pipe).__name__}: {shape}, text "
        f"{pipe.config.max_sequence_length} tokens); {args.height}x{args.width}; decoder: {decoder}; "
        f"{num_frames} frames a session"
    )


# ----------------------------------------------------------------------------------------- measuring
def library_fps(pipe, args: argparse.Namespace, num_frames: int) -> float:
    return steady_stream_fps(pipe, PROMPT, num_frames, height=args.height, width=args.width)


def one_session(url: str, num_frames: int, seed: int, results: list, size: dict) -> None:
    start = time.perf_counter()
    arrivals = []
    with connect(url, prompt=PROMPT, seed=seed, num_frames=num_frames, **size) as live:
        frames = 0
        for chunk in live:
            arrivals.append(time.perf_counter())
            if chunk.shape[1:3] != (size["height"], size["width"]):
                raise RuntimeError(f"frames of {chunk.shape[1:3]}, asked for {size}")  # the row then fails
            frames += len(chunk)
    first = arrivals[0] - start
    steady = arrivals[-1] - arrivals[0]
    results.append(
        dict(ttff=first, fps=(frames - len(chunk)) / steady if steady else float("nan"), gaps=list(_gaps(arrivals)))
    )


def _gaps(arrivals: list[float]):
    return (b - a for a, b in zip(arrivals, arrivals[1:]))


def run_row(server: Server, sessions: int, num_frames: int, size: dict) -> dict:
    results: list[dict] = []
    threads = [
        threading.Thread(target=one_session, args=(server.url, num_frames, s, results, size)) for s in range(sessions)
    ]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    elapsed = time.perf_counter() - start
    if len(results) != sessions:
        raise RuntimeError(f"{sessions - len(results)} of {sessions} sessions failed; server log: {server.log}")
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


def device_memory(device: str) -> str:
    """Device memory in use by every process (the server's share included), on CUDA; empty elsewhere."""
    if torch.device(device).type != "cuda":
        return ""
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return f", device memory in use (all processes) {(total - free) / 2**20:.0f} MiB"


# ----------------------------------------------------------------------------------------- arguments
def _positive(value: str) -> int:
    number = int(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def _device(value: str) -> str:
    try:
        torch.device(value)
    except RuntimeError as exc:
        raise argparse.ArgumentTypeError(f"cpu, cuda, cuda:1, ...: {exc}") from None
    return value


def _server_kinds(value: str) -> tuple[str, ...]:
    kinds = tuple(kind.strip() for kind in value.split(",") if kind.strip())
    unknown = [kind for kind in kinds if kind not in SERVER_KINDS]
    if not kinds or unknown:
        raise argparse.ArgumentTypeError(f"{value!r}: a comma-separated list of {', '.join(SERVER_KINDS)}")
    return kinds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="1 and 2 sessions, 24 frames each (rounded up)")
    parser.add_argument("--frames", type=_positive, help="frames per session, rounded up to whole chunks (192)")
    parser.add_argument("--model", help="pipeline folder or Hub id (default: the embedded tiny model)")
    parser.add_argument("--device", type=_device, help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    parser.add_argument(
        "--dtype", choices=list(DTYPES), help="weights dtype (default: bfloat16 on cuda, else float32)"
    )
    parser.add_argument("--tiny-vae", type=Path, metavar="PATH", help="decode with a tiny autoencoder (TAEHV)")
    parser.add_argument("--height", type=_positive, help="pixels (default: the model's native size)")
    parser.add_argument("--width", type=_positive, help="pixels (default: the model's native size)")
    parser.add_argument(
        "--wan-1-3b-shape",
        action="store_true",
        help="serve a random-weight Wan 2.1 1.3B-shape pipeline at 480x832 with a tiny decoder (tiny with --dry-run)",
    )
    parser.add_argument("--plot", type=Path, metavar="PNG", help="also draw aggregate fps against sessions to PNG")
    parser.add_argument(
        "--servers",
        type=_server_kinds,
        default=SERVER_KINDS,
        metavar="KIND[,KIND]",
        help=f"which servers to run, of {', '.join(SERVER_KINDS)} (default: all that apply to the device)",
    )
    args = parser.parse_args(argv)
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install 'rolldiff[bench]'")
    if args.plot is not None and not args.plot.parent.is_dir():
        parser.error(f"--plot {str(args.plot)!r}: the folder {str(args.plot.parent)!r} does not exist.")
    if args.wan_1_3b_shape and (args.model is not None or args.tiny_vae is not None):
        parser.error("--wan-1-3b-shape builds its own model and tiny decoder; leave out --model and --tiny-vae.")
    if (args.height is None) != (args.width is None):
        parser.error("give --height and --width together (or neither: the model's native size).")
    if args.tiny_vae is not None and not args.tiny_vae.is_file():
        parser.error(f"--tiny-vae {str(args.tiny_vae)!r} is not a file.")
    args.device = args.device or default_device()
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device here (torch.cuda.is_available() is False).")
    args.dtype = args.dtype or default_dtype(args.device)
    if not servers("8", args.device, args.servers):
        parser.error(f"--servers {','.join(args.servers)}: none of them runs on {args.device} (workers is for CPUs)")
    if args.frames is None:
        args.frames = 24 if args.dry_run else 192
    if args.wan_1_3b_shape:
        if args.height is None:
            args.height, args.width = DRY_WAN_SIZE if args.dry_run else WAN_SIZE
        try:
            latent_hw(args.height, args.width)
        except ValueError as exc:
            parser.error(f"--height / --width: {exc}")
    return args


def plot(path: Path, counts: tuple[int, ...], aggregate: dict[str, list[float]], alone: float, title: str) -> None:
    """Aggregate frames per second against concurrent sessions, one line per server, `pipe.stream` alone dashed."""
    import matplotlib

    matplotlib.use("Agg")  # no display: a file
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.0))
    for mode, values in aggregate.items():
        axes.plot(counts, values, marker="o", label=f"{mode} server")
    axes.axhline(alone, linestyle="--", color="gray", label="pipe.stream alone")
    axes.set(xlabel="concurrent sessions", ylabel="aggregate frames per second", xticks=counts, ylim=(0, None))
    axes.set_title(f"rolldiff serve: {title}", fontsize=9)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# ----------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.wan_1_3b_shape:
        return measure(args)
    with tempfile.TemporaryDirectory(prefix="serve-load-wan-") as folder:
        args.tiny_vae = build_wan_shape_pipeline(
            Path(folder), args.dry_run, args.device, args.dtype, (args.height, args.width)
        )
        args.model = str(Path(folder) / "pipeline")
        gc.collect()
        if torch.device(args.device).type == "cuda":
            torch.cuda.empty_cache()
        return measure(args)


def measure(args: argparse.Namespace) -> int:
    counts = (1, 2) if args.dry_run else (1, 2, 4, 8)
    # `rolldiff serve` on a CPU leaves one core to its event loop (cpu_count - 1 torch threads); the library alone
    # is measured with the same threads, so the difference is the server's own overhead
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    pipe = load(args)
    if args.height is None:
        args.height, args.width = native_size(pipe)
    size = dict(height=args.height, width=args.width)
    num_frames = pipe.num_frames_for(args.frames, 1, **size)  # whole chunks: at least --frames
    header_line = describe(pipe, args, num_frames)
    alone = library_fps(pipe, args, num_frames)
    del pipe
    gc.collect()
    if torch.device(args.device).type == "cuda":
        torch.cuda.empty_cache()
    model_flags = ["--device", args.device, "--dtype", args.dtype]
    model_flags += ["--model", str(args.model)] if args.model is not None else []
    model_flags += ["--tiny-vae", str(args.tiny_vae)] if args.tiny_vae is not None else []
    measured: dict[tuple[int, str], list[str]] = {}
    aggregate: dict[str, list[float]] = {}  # per server, per session count: the plot's lines
    memory = []
    batch = str(max(counts))
    for mode, flags, threads in servers(batch, args.device, args.servers):
        server = LoadServer(
            *model_flags, "--max-sessions", batch, "--max-frames", str(num_frames), *flags, env=threads,
        )  # fmt: skip
        try:
            described = server.http("/v1/model")
            served = described["model"]
            if served != str(args.model or "tiny-bouncing-shapes"):
                raise RuntimeError(f"the server serves {served!r}, not {args.model!r}")
            rss_start = server_rss_mib(server)
            run_row(server, 1, num_frames, size)  # warm-up, untimed: kernels chosen, buffers allocated
            for sessions in counts:
                row = run_row(server, sessions, num_frames, size)
                measured[sessions, mode] = table_row(f"{sessions} {mode}", row, server_rss_mib(server))
                aggregate.setdefault(mode, []).append(row["aggregate"])
                print(f"  {' | '.join(measured[sessions, mode])}", file=sys.stderr, flush=True)  # shown if cut short
            health = server.http("/healthz")
            memory.append(
                f"{mode} server RSS: {rss_start:.0f} MiB at the start, "
                f"{server_rss_mib(server):.0f} MiB at the end (PSS {server_rss_mib(server, 'Pss'):.0f} MiB)"
                f"{device_memory(args.device)}"
            )
            memory.append(
                f"{mode} server: {health['batched_rows']} session steps ran in forwards shared with other sessions, "
                f"{health['batched_decodes']} session chunks in decodes shared with other sessions, "
                f"{health['side_by_side_groups']} groups made beside another (parallel groups: "
                f"{described['parallel_groups']})"
            )
        finally:
            server.stop()
    header = ["sessions", "aggregate fps", "per-session fps (slowest / fastest)", "first frame ms",
              "between chunks p50 / p99 ms", "server RSS MiB"]  # fmt: skip
    print(header_line)
    print(
        f"pipe.stream alone, same run: {alone:.1f} fps (steady state, {num_frames} frames, {torch.get_num_threads()} torch threads)"
    )
    print("\n".join(memory))
    modes = [mode for mode, _, _ in servers(batch, args.device, args.servers)]
    print(markdown_table(header, [measured[sessions, mode] for sessions in counts for mode in modes]))
    if args.plot is not None:
        model = "Wan 2.1 1.3B shape" if args.wan_1_3b_shape else args.model or "tiny-bouncing-shapes"
        plot(args.plot, counts, aggregate, alone, f"{model}, {args.device}, {num_frames} frames a session")
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

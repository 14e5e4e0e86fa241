"""Frames per second of Wan 2.1 1.3B on one GPU, one row per speed technique, stacked the way a real-time app
stacks them, with the Self-Forcing loop measured in the same run and the published numbers.

Wan 2.1 1.3B (30 blocks, 12 heads x 128, ffn 8960, text 512 x 4096; random weights, bf16) at 480x832 (60x104
latent, 1560 tokens per frame), chunks of 3 latent frames, sink 3 + window 9, 4 denoising steps + the context
pass, each chunk decoded as it is made (12 pixel frames per chunk, 9 for the first). No downloads, no prompts:
it runs unattended and prints one table.

Rows (each adds one technique to the row it names; "best decode" is the tiny VAE overlapped when
`rolldiff.models.TinyVideoAutoencoder` is importable, else the Wan VAE overlapped; the decoder and step columns
say what ran):
  ours, eager (baseline)              `KreaRealtimeTransformer3DModel` + `RollingKVCache`, Wan VAE, serial decode.
  Self-Forcing loop (measured here)   `research_loops.SelfForcingLoop`, same weights, Wan VAE, serial decode.
  ours + overlapped decode            chunk k's decode on a side stream during chunk k+1 (`OverlappedDecoder`).
  ours + Wan VAE, a chunk a call      the Wan VAE's decoder called once per chunk, not once per latent frame
                                      (`StreamingWanDecoder(frames_per_call=...)`; the default on a CPU only).
  ours + tiny VAE [+ overlapped]      TAEHV (`TinyVideoAutoencoder`, random weights) instead of the Wan VAE.
  Self-Forcing loop + best decode     the baseline loop with the same decode.
  ours + best decode + fastest attention   `fastest_attention_backend` (FA3 / flash / cuDNN / native).
  ... + CUDA graphs                   `capture_cuda_graphs`: torch.compile(mode="reduce-overhead").
  ... + fp8                           `enable_fp8` (torchao float8, per row) under CUDA graphs.
  ... + torch.compile (no CUDA graphs)     `compile_cached_step`, inductor's default mode (last: optional).
  published                           Self-Forcing ~17 FPS and LongLive 20.7 FPS on an H100, their own figures.

A compiled row keeps the fastest attention only if that backend takes a mask (probed): the compiled step
attends with a mask while the window fills; otherwise it runs "native" and the step column says so.

Columns: FPS = 12 pixel frames / median steady-state interval between two chunks' frames reaching the consumer
(window full; decode included); p50 / p99 = those intervals; cold first frame = from the row's first call to its
first frames, compilation (and CUDA-graph capture) included: what a user waits for on a fresh process; time to
first frame = a new stream's first frames on the warm model (a server compiles once at start-up); peak memory = `torch.cuda.max_memory_allocated`; the
fraction of bf16 peak = FLOPs of a steady chunk (`FlopCounterMode`, counted once per loop and decoder) per
second over the dense bf16 peak (spec sheet) and over a bf16 matmul measured here.

Order (`--order`): "unmeasured" (the default) runs first the rows that no recorded run in docs/gpu/ has a number
for, then the rest, each group in the plan's order, so a short device session measures what is missing first;
"plan" keeps the plan's order.

A row that cannot run here says why ("not available: ...", "skipped: ..."); the dry run runs every row's CPU
fallback (synchronous decode, "native" attention, the eager compile backend) and reports CUDA graphs and fp8 as
skipped with the refusal. Exit status: 0 when every row that could run ran and produced finite frames.

    python benchmarks/gpu_fps.py                  # one H100/H200, about 8 minutes (--budget-s 480)
    python benchmarks/gpu_fps.py --dry-run        # tiny shapes on the CPU (CI)
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from _common import (
    WAN_TEXT_TOKENS,
    cast_like_from_pretrained,
    flop_counter,
    latent_hw,
    markdown_table,
    require_cuda_unless_dry_run,
    wan_config,
)
from research_loops import Setup, make_loop

PUBLISHED_FPS = (("Self-Forcing 1.3B (published, H100)", 17.0), ("LongLive 1.3B (published, H100)", 20.7))
# dense bf16 tensor-core peak, TFLOP/s (spec sheets)
BF16_PEAK_TFLOPS = (("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("A100", 312.0), ("B200", 2250.0))
# seconds a row takes on an H200 (the recorded runs): a row starts only if it should end within the budget
ROW_COST_S = {"eager": 18.0, "compiled": 180.0}
RECORDED = Path(__file__).resolve().parent.parent / "docs" / "gpu"  # the recorded runs' tables
LATENT_CHANNELS = 16  # Wan 2.1's latent channels, also in the dry run: TAEHV's defaults (taew2_1) take 16
TINY_MODEL = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=16,
    in_channels=LATENT_CHANNELS,
    out_channels=LATENT_CHANNELS,
    text_dim=32,
    freq_dim=32,
    ffn_dim=64,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=1024,
)
TINY_VAE = dict(
    base_dim=4,
    z_dim=LATENT_CHANNELS,
    dim_mult=[1, 1, 1, 1],
    num_res_blocks=1,
    temperal_downsample=[False, True, True],
    latents_mean=[0.0] * LATENT_CHANNELS,
    latents_std=[1.0] * LATENT_CHANNELS,
)


@dataclasses.dataclass(frozen=True)
class Technique:
    """What one row runs."""

    name: str
    approach: str = "ours"  # "ours" | "self-forcing"
    vae: str = "wan"  # "wan" | "wan-chunk" (a whole chunk per decoder call) | "tiny" | "best" (tiny, else wan)
    overlap: bool = False
    attention: bool = False  # the fastest backend instead of the default
    compile: str | None = None  # None | "default" | "cuda-graphs"
    fp8: bool = False
    chunk_frames: int | None = None  # a frame-wise row (1); None: the setup's chunk


BEST = "ours + best decode + fastest attention"
PLAN = (
    Technique("ours, eager (baseline)"),
    Technique("Self-Forcing loop (measured here)", approach="self-forcing"),
    Technique("ours + overlapped decode", overlap=True),
    Technique("ours + Wan VAE, a chunk a call", vae="wan-chunk"),
    Technique("ours + tiny VAE", vae="tiny"),
    Technique("ours + tiny VAE + overlapped decode", vae="tiny", overlap=True),
    Technique("Self-Forcing loop + best decode", approach="self-forcing", vae="best", overlap=True),
    Technique(BEST, vae="best", overlap=True, attention=True),
    Technique(f"{BEST} + CUDA graphs", vae="best", overlap=True, attention=True, compile="cuda-graphs"),
    Technique(
        f"{BEST} + CUDA graphs + fp8", vae="best", overlap=True, attention=True, compile="cuda-graphs", fp8=True
    ),
    Technique(f"{BEST} + torch.compile (no CUDA graphs)", vae="best", overlap=True, attention=True, compile="default"),
    # denoising="pipelined" (Rolling Forcing's window: every step's chunk in one forward) and frame-wise chunks
    Technique("ours, pipelined denoising", approach="ours-pipelined"),
    Technique(f"{BEST}, pipelined denoising", approach="ours-pipelined", vae="best", overlap=True, attention=True),
    Technique(
        f"{BEST}, pipelined + CUDA graphs",
        approach="ours-pipelined",
        vae="best",
        overlap=True,
        attention=True,
        compile="cuda-graphs",
    ),  # fmt: skip
    Technique(
        f"{BEST}, frame-wise (1 latent frame a chunk)", vae="best", overlap=True, attention=True, chunk_frames=1
    ),
    Technique(
        f"{BEST}, frame-wise, pipelined",
        approach="ours-pipelined",
        vae="best",
        overlap=True,
        attention=True,
        chunk_frames=1,
    ),  # fmt: skip
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, eager compile backend")
    parser.add_argument("--chunks", type=int, default=None, help="measured chunks per row (default 12; dry run 4)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up chunks per row (default 4; dry run 1)")
    parser.add_argument("--height", type=int, default=None, help="pixel height (default 480; dry run 64)")
    parser.add_argument("--width", type=int, default=None, help="pixel width (default 832; dry run 64)")
    parser.add_argument("--layers", type=int, default=None, help="blocks (default 30; dry run 1)")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="skip the compiled rows")
    parser.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip the Self-Forcing rows")
    parser.add_argument("--no-vae", dest="vae", action="store_false", help="transformer only (no decode rows)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="skip rows that would end after this")
    parser.add_argument(
        "--order",
        choices=("unmeasured", "plan"),
        default="unmeasured",
        help="unmeasured: rows docs/gpu/ has no number for first (default); plan: the plan's order",
    )
    parser.add_argument("--recorded", type=Path, default=RECORDED, help="folder of recorded runs (docs/gpu)")
    args = parser.parse_args(argv)
    dry = args.dry_run
    defaults = dict(chunks=(4, 12), warmup=(1, 4), height=(64, 480), width=(64, 832), layers=(1, 30))
    for name, (tiny, real) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if dry else real)
    for name in ("chunks", "layers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}.")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}.")
    if args.height % 16 or args.width % 16 or args.height < 16 or args.width < 16:
        parser.error(f"--height/--width must be positive multiples of 16, got {args.height}x{args.width}.")
    require_cuda_unless_dry_run(parser, dry)
    return args


@dataclasses.dataclass
class Row:
    name: str
    decoder: str = "-"
    step: str = "-"
    fps: float = math.nan
    ttff_s: float = math.nan
    cold_ttff_s: float = math.nan  # the row's first frames from its first call, compilation included
    p50_ms: float = math.nan
    p99_ms: float = math.nan
    peak_mib: float = math.nan
    tflops: float = math.nan
    graphs: str = "-"
    warmup_s: float = math.nan
    error: str = ""  # "FAILED ...", "not available: ...", "skipped: ..."

    @property
    def failed(self) -> bool:
        return self.error.startswith("FAILED")


# ----------------------------------------------------------------------------------------- decoders
def build_wan_decoder(dry_run: bool, device: str, dtype: torch.dtype):
    """The Wan 2.1 VAE (random weights) and two streaming decoders taking the transformer's latents: one latent frame
    per call of the VAE's decoder (diffusers' loop; the default on a GPU), and a whole chunk per call."""
    from diffusers import AutoencoderKLWan

    from rolldiff.pipelines.codecs.streaming_decode import StreamingWanDecoder

    torch.manual_seed(0)
    with torch.device(device):
        vae = AutoencoderKLWan(**TINY_VAE) if dry_run else AutoencoderKLWan()
    vae = vae.eval().requires_grad_(False)
    cast_like_from_pretrained(vae, dtype)
    per_frame = StreamingWanDecoder(vae, denormalize=True, frames_per_call=1)
    whole_chunk = StreamingWanDecoder(vae, denormalize=True, frames_per_call=2**16)  # more frames than any chunk
    return per_frame, whole_chunk


def build_tiny_decoder(device: str, dtype: torch.dtype):
    """TAEHV (`TinyVideoAutoencoder`, taew2_1's defaults, random weights) and its streaming decoder, or why it could
    not be built on this device (its rows then say so and the others go on)."""
    from rolldiff.models import TinyVideoAutoencoder
    from rolldiff.pipelines.codecs.streaming_tiny_decode import StreamingTinyDecoder

    torch.manual_seed(0)
    try:
        with torch.device(device):
            autoencoder = TinyVideoAutoencoder().eval().requires_grad_(False)
        return StreamingTinyDecoder(autoencoder.to(dtype)), ""
    except Exception as exc:  # noqa: BLE001 - the row says why; the others go on
        return None, f"not available: {type(exc).__name__}: {str(exc)[:160]}"


@dataclasses.dataclass
class Decoders:
    """The decoders built once per run (a VAE is the same weights for every row)."""

    wan: object | None
    wan_chunk: object | None
    tiny: object | None
    tiny_missing: str

    def pick(self, kind: str) -> tuple[object | None, str, str]:
        """(decoder, its label, why it is missing)."""
        if kind == "best":
            kind = "tiny" if self.tiny is not None else "wan"
        if kind == "tiny":
            return self.tiny, "TAEHV", self.tiny_missing
        if kind == "wan-chunk":
            return self.wan_chunk, "Wan VAE, a chunk a call", ""
        return self.wan, "Wan VAE", ""


# ----------------------------------------------------------------------------------------- one row
def frames_of(loop, decoder, chunks: int) -> Iterator[torch.Tensor]:
    """Each chunk's decoded frames as the consumer gets them (latents when there is no decoder)."""
    from rolldiff.pipelines.codecs.overlap import OverlappedDecoder, decode_ahead

    latents = (loop.chunk() for _ in range(chunks))
    if decoder is None:
        yield from latents
    elif isinstance(decoder, OverlappedDecoder):
        yield from decode_ahead(latents, decoder)
    else:
        for chunk in latents:
            yield decoder.decode(chunk)


def delivered(frames: torch.Tensor) -> None:
    """Wait until `frames` can be read (what a consumer's `.cpu()` waits for), not for the side stream."""
    if frames.is_cuda:
        torch.cuda.current_stream(frames.device).synchronize()


def setup_step(loop, technique: Technique, args, device: str) -> str:
    """Apply the row's attention backend, fp8 and compilation to `loop.model`; returns the step's label."""
    from rolldiff.pipelines.acceleration import (
        attention_accepts_mask,
        capture_cuda_graphs,
        compile_cached_step,
        enable_fp8,
        fastest_attention_backend,
        set_attention_backend,
    )

    parts = ["eager" if technique.compile is None else technique.compile]
    if technique.attention:
        backend = fastest_attention_backend(device)
        if technique.compile is not None and not attention_accepts_mask(backend, device):
            parts.append(f"native ({backend} refuses the filling window's mask)")
            backend = "native"
        else:
            parts.append(backend)
        set_attention_backend(loop.model, backend)
    if technique.fp8:
        enable_fp8(loop.model)
        parts.append("fp8")
    if technique.compile == "cuda-graphs":
        capture_cuda_graphs(loop.model)
    elif technique.compile == "default":
        compile_cached_step(loop.model, backend="eager" if args.dry_run else "inductor")
    return ", ".join(parts)


def steady_flops(loop, decoder) -> float:
    """FLOPs of one chunk and its decode (serial), counted where the warm-up left the stream."""
    with flop_counter() as counter:
        frames = loop.chunk()
        if decoder is not None:
            decoder.decode(frames)
    return counter.get_total_flops()


def measure(row: Row, loop, decoder, args, full_from: int) -> None:
    """A fresh stream on the warm model: time to first frame, then the steady-state intervals."""
    loop.restart()
    if decoder is not None:
        decoder.reset()
    from rolldiff.pipelines.codecs.overlap import OverlappedDecoder

    # An overlapped decoder hands a chunk back once the next one exists: one more chunk keeps the last measured
    # interval a steady one (not the end-of-video drain, which has no next chunk to wait for).
    extra = int(isinstance(decoder, OverlappedDecoder))
    intervals, finite = [], None
    previous = time.perf_counter()
    for frames in itertools.islice(frames_of(loop, decoder, args.chunks + extra), args.chunks):
        delivered(frames)
        now = time.perf_counter()
        intervals.append(now - previous)
        previous = now
        ok = torch.isfinite(frames).all()
        finite = ok if finite is None else finite & ok
    if not bool(finite):
        raise FloatingPointError("non-finite values in the generated frames")
    row.ttff_s = intervals[0]
    steady = np.array(intervals[min(full_from, len(intervals) - 1) :])
    row.p50_ms, row.p99_ms = (float(np.percentile(steady, q)) * 1e3 for q in (50, 99))
    row.fps = 4 * loop.setup.chunk_frames / float(np.median(steady))


def row_decoder(row: Row, technique: Technique, args, decoders: Decoders):
    """The row's decoder, reset for a new video (None: no decode; sets `row.error` if the row cannot run)."""
    from rolldiff.pipelines.codecs.overlap import OverlappedDecoder

    if not args.vae:
        row.decoder = "none"
        if technique.vae == "tiny" or technique.overlap:
            row.error = "skipped: --no-vae"
        return None
    decoder, row.decoder, row.error = decoders.pick(technique.vae)
    if decoder is None:
        return None
    decoder.reset()  # the VAE is shared by the rows; each starts a new video
    if technique.overlap:
        decoder = OverlappedDecoder(decoder, row_device(args))
        row.decoder += ", overlapped" if decoder.overlaps else ", overlapped (CPU: synchronous)"
    return decoder


def row_device(args) -> str:
    return "cpu" if args.dry_run else "cuda"


def run_row(technique: Technique, setup: Setup, args, decoders: Decoders, flops: dict) -> Row:
    """Build the row's loop and step, warm up (compiling, if asked), count FLOPs once, then measure."""
    from torch._dynamo.utils import counters

    row, device = Row(technique.name), setup.device
    if technique.chunk_frames is not None:
        setup = dataclasses.replace(setup, chunk_frames=technique.chunk_frames)
    decoder = row_decoder(row, technique, args, decoders)
    if row.error:
        return row
    loop = None
    try:
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        loop = make_loop(technique.approach, setup)
        before = counters["stats"]["unique_graphs"], counters["inductor"]["cudagraph_skips"]
        row.step = setup_step(loop, technique, args, device)
        began = time.perf_counter()
        for frames in frames_of(loop, decoder, args.warmup):
            delivered(frames)
            if math.isnan(row.cold_ttff_s):
                row.cold_ttff_s = time.perf_counter() - began
        row.warmup_s = time.perf_counter() - began
        key = (technique.approach, row.decoder.split(",")[0])
        if key not in flops and technique.compile is None and not technique.fp8:
            flops[key] = steady_flops(loop, decoder)
        full_from = -(-(setup.sink_frames + setup.window_frames - setup.chunk_frames) // setup.chunk_frames)
        measure(row, loop, decoder, args, full_from)
        row.tflops = flops[key] * row.fps / (4 * setup.chunk_frames) / 1e12 if key in flops else math.nan
        if device.startswith("cuda"):
            row.peak_mib = torch.cuda.max_memory_allocated() / 2**20
        row.graphs = graphs_label(technique, counters["stats"]["unique_graphs"] - before[0],
                                  counters["inductor"]["cudagraph_skips"] - before[1])  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - one failed row must not hide the others; the exit status says it
        row.error = refusal_or_failure(exc)
    finally:
        if loop is not None and technique.attention:
            from rolldiff.pipelines.acceleration import set_attention_backend

            set_attention_backend(loop.model, "native")  # diffusers keeps the last backend process-wide
        del loop
        torch.compiler.reset()
    return row


def graphs_label(technique: Technique, graphs: int, cudagraph_skips: int) -> str:
    """Graphs dynamo compiled for the row, and how often inductor declined to record a CUDA graph."""
    if technique.compile is None:
        return "-"
    label = f"{graphs} (fullgraph)"
    return label + f", {cudagraph_skips} cudagraph skips" if technique.compile == "cuda-graphs" else label


def refusal_or_failure(exc: Exception) -> str:
    """A technique's own refusal on this device (CUDA graphs or fp8 on a CPU) is a skip; anything else fails."""
    from rolldiff.pipelines.acceleration import AccelerationUnavailable

    message = str(exc).splitlines()[0][:200] if str(exc) else ""
    if isinstance(exc, AccelerationUnavailable):
        return f"skipped: {message}"
    return f"FAILED: {type(exc).__name__}: {message}"


# ----------------------------------------------------------------------------------------- table
def bf16_peak(device: str) -> tuple[float | None, float]:
    """(spec-sheet dense bf16 TFLOP/s or None, measured bf16 matmul TFLOP/s)."""
    if not device.startswith("cuda"):
        a = torch.randn(256, 256)
        start = time.perf_counter()
        a @ a
        return None, 2 * 256**3 / (time.perf_counter() - start) / 1e12
    name = torch.cuda.get_device_name()
    spec = next((peak for key, peak in BF16_PEAK_TFLOPS if key in name), None)
    size = 8192
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return spec, 10 * 2 * size**3 / (time.perf_counter() - start) / 1e12


HEADER = [
    "row",
    "FPS",
    "cold first frame s (compile included)",
    "time to first frame s",
    "chunk p50 ms",
    "chunk p99 ms",
    "decoder",
    "step",
    "peak memory MiB",
    "TFLOP/s",
    "fraction of bf16 peak (spec / measured matmul)",
    "compiled graphs",
    "warm-up s",
]


def table(rows: list[Row], spec: float | None, measured: float) -> str:
    body = []
    for row in rows:
        if row.error:
            body.append([row.name, row.error, *["-"] * (len(HEADER) - 2)])
            continue
        fraction = f"{row.tflops / spec:.2f}" if spec and not math.isnan(row.tflops) else "-"
        fraction += f" / {row.tflops / measured:.2f}" if not math.isnan(row.tflops) else " / -"
        cold = "-" if math.isnan(row.cold_ttff_s) else f"{row.cold_ttff_s:.1f}"
        numbers = [f"{row.fps:.1f}", cold, f"{row.ttff_s:.2f}", f"{row.p50_ms:.0f}", f"{row.p99_ms:.0f}"]
        body.append(
            [
                row.name,
                *numbers,
                row.decoder,
                row.step,
                f"{row.peak_mib:.0f}" if not math.isnan(row.peak_mib) else "-",
                f"{row.tflops:.1f}" if not math.isnan(row.tflops) else "-",
                fraction,
                row.graphs,
                f"{row.warmup_s:.1f}",
            ]
        )
    for name, fps in PUBLISHED_FPS:
        body.append([name, f"{fps:.1f}", *["-"] * (len(HEADER) - 2)])
    return markdown_table(HEADER, body)


# ----------------------------------------------------------------------------------------- main
def make_setup(args: argparse.Namespace) -> Setup:
    """Wan 1.3B in bf16 on CUDA, or the tiny model in fp32 on the CPU for a dry run."""
    config = dict(TINY_MODEL, num_layers=args.layers) if args.dry_run else wan_config(args.layers)
    return Setup(
        model_config=config,
        latent_hw=latent_hw(args.height, args.width),
        text_tokens=8 if args.dry_run else WAN_TEXT_TOKENS,
        sink_frames=3,
        window_frames=9,
        device="cpu" if args.dry_run else "cuda",
        dtype="float32" if args.dry_run else "bfloat16",
    )


def measured_rows(folder: Path) -> set[str]:
    """Names of the rows some recorded run (a `*gpu_fps*.txt` table in `folder`) has an FPS number for."""
    names = set()
    for path in sorted(folder.glob("*gpu_fps*.txt")) if folder.is_dir() else []:
        for line in path.read_text().splitlines():
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if len(cells) > 1 and re.fullmatch(r"\d+(\.\d+)?", cells[1]):
                names.add(cells[0])
    return names


def planned(args: argparse.Namespace) -> list[Technique]:
    """The rows to run, the ones no recorded run has measured first (`--order unmeasured`)."""
    rows = [
        technique
        for technique in PLAN
        if (args.baseline or technique.approach == "ours") and (args.compile or technique.compile is None)
    ]
    if args.order == "plan":
        return rows
    measured = measured_rows(args.recorded)
    return [row for row in rows if row.name not in measured] + [row for row in rows if row.name in measured]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.perf_counter()
    if args.dry_run:
        torch.set_num_threads(1)
    setup = make_setup(args)
    device, dtype = setup.device, getattr(torch, setup.dtype)
    spec, measured = bf16_peak(device)
    wan, wan_chunk = build_wan_decoder(args.dry_run, device, dtype) if args.vae else (None, None)
    tiny, tiny_missing = build_tiny_decoder(device, dtype) if args.vae else (None, "skipped: --no-vae")
    decoders = Decoders(wan, wan_chunk, tiny, tiny_missing)
    rows, flops = [], {}
    plan = planned(args)
    print(f"  order ({args.order}): {'; '.join(technique.name for technique in plan)}", flush=True)
    for technique in plan:
        cost = ROW_COST_S["eager" if technique.compile is None else "compiled"]
        if not args.dry_run and time.perf_counter() - began + cost > args.budget_s:
            rows.append(Row(technique.name, error=f"skipped: would end past the {args.budget_s:.0f} s budget"))
            continue
        rows.append(run_row(technique, setup, args, decoders, flops))
        print(f"  {technique.name}: {rows[-1].error or 'done'} at {time.perf_counter() - began:.0f} s", flush=True)
    where = "CPU (dry run)" if args.dry_run else torch.cuda.get_device_name()
    tokens = (setup.latent_hw[0] // 2) * (setup.latent_hw[1] // 2)
    print(
        f"\n{where}, {setup.dtype}; Wan 2.1 1.3B shapes x {args.layers} blocks, {args.height}x{args.width} "
        f"({tokens} tokens/frame), chunk 3, sink 3, window 9, 4 steps + context pass, "
        f"{'decode included' if args.vae else 'transformer only'}; {args.chunks} chunks per row after "
        f"{args.warmup} warm-up; torch {torch.__version__}; {time.perf_counter() - began:.0f} s\n"
    )
    print(table(rows, spec, measured))
    return 1 if any(row.failed for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Frames per second of Wan 2.1 1.3B on one GPU: rolldiff eager and compiled, the Self-Forcing loop measured in
the same run, and the published numbers, in one table.

Wan 2.1 1.3B (30 blocks, 12 heads x 128, ffn 8960, text 512 x 4096; random weights, bf16) at 480x832 (60x104
latent, 1560 tokens per frame), chunks of 3 latent frames, sink 3 + window 9, 4 denoising steps + the context
pass, and the Wan 2.1 VAE (random weights, bf16) decoding each chunk as it is made (12 pixel frames per chunk,
9 for the first). No downloads, no prompts: it runs unattended and prints one table.

Rows:
  ours, eager              `KreaRealtimeTransformer3DModel` + `RollingKVCache`, as the pipeline runs it.
  ours, torch.compile      the same model under `torch.compile` (inductor; `fullgraph=True`, falling back to
                           graph breaks if tracing fails; the graph count says which).
  Self-Forcing loop, eager `research_loops.SelfForcingLoop` (dict cache, `.item()` per block, shift-with-clone,
                           float64 RoPE), the same weights, measured here.
  published                Self-Forcing ~17 FPS and LongLive 20.7 FPS on an H100, their own figures.

Columns: FPS = 12 pixel frames / median steady-state chunk time (window full; VAE decode included);
time to first frame = a new stream's first chunk, denoised and decoded (after the compile warm-up: a server
compiles once at start-up); peak memory = `torch.cuda.max_memory_allocated` for that row; fraction of bf16
peak = FLOPs of a steady-state chunk (`FlopCounterMode`: matmuls, attention and convolutions, counted in the
warm-up chunk where the window is full) per second over the GPU's dense bf16 peak (spec sheet where the name
is known) and over a bf16 matmul measured here.

Exit status: 0 when every row ran and produced finite frames, 1 otherwise (a failed row is in the table).

    python benchmarks/gpu_fps.py               # one H100/H200, < 8 minutes
    python benchmarks/gpu_fps.py --dry-run     # tiny shapes on the CPU (CI)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time

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
TINY_MODEL = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=16,
    in_channels=4,
    out_channels=4,
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
    z_dim=4,
    dim_mult=[1, 1, 1, 1],
    num_res_blocks=1,
    temperal_downsample=[False, True, True],
    latents_mean=[0.0] * 4,
    latents_std=[1.0] * 4,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, eager compile backend")
    parser.add_argument("--chunks", type=int, default=None, help="measured chunks per row (default 24; dry run 4)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up chunks per row (default 4; dry run 1)")
    parser.add_argument("--height", type=int, default=None, help="pixel height (default 480; dry run 64)")
    parser.add_argument("--width", type=int, default=None, help="pixel width (default 832; dry run 64)")
    parser.add_argument("--layers", type=int, default=None, help="blocks (default 30; dry run 1)")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="skip the compiled row")
    parser.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip the Self-Forcing row")
    parser.add_argument("--no-vae", dest="vae", action="store_false", help="transformer only (no decode)")
    parser.add_argument(
        "--compile-mode",
        default="default",
        choices=["default", "max-autotune-no-cudagraphs", "reduce-overhead"],
        help="torch.compile mode (default: 'default')",
    )
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip rows that would start after this")
    args = parser.parse_args(argv)
    dry = args.dry_run
    defaults = dict(chunks=(4, 24), warmup=(1, 4), height=(64, 480), width=(64, 832), layers=(1, 30))
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
    fps: float = math.nan
    ttff_s: float = math.nan
    chunk_ms: float = math.nan
    peak_mib: float = math.nan
    tflops: float = math.nan
    graphs: str = "-"
    warmup_s: float = math.nan
    error: str = ""


class CompiledForward:
    """`torch.compile(model)` that starts with `fullgraph=True` and, if tracing breaks, recompiles without it
    (the break is raised while tracing, before the step runs, so no cache was touched)."""

    def __init__(self, model: torch.nn.Module, backend: str, mode: str | None) -> None:
        self.model, self.backend, self.mode = model, backend, mode
        self._compile(fullgraph=True)

    def _compile(self, fullgraph: bool) -> None:
        from torch._dynamo.testing import CompileCounterWithBackend

        torch._dynamo.reset()
        self.fullgraph = fullgraph
        self.counter = CompileCounterWithBackend(self.backend)
        options = {} if self.mode in (None, "default") or self.backend != "inductor" else {"mode": self.mode}
        if options:  # a mode string goes through inductor's own entry point
            self.fn = torch.compile(self.model, fullgraph=fullgraph, **options)
            self.counter = None
        else:
            self.fn = torch.compile(self.model, backend=self.counter, fullgraph=fullgraph)

    def __call__(self, *args, **kwargs):
        try:
            return self.fn(*args, **kwargs)
        except torch._dynamo.exc.Unsupported:
            if not self.fullgraph:
                raise
            self._compile(fullgraph=False)
            return self.fn(*args, **kwargs)

    def describe(self) -> str:
        count = "?" if self.counter is None else str(self.counter.frame_count)
        return f"{count} ({'fullgraph' if self.fullgraph else 'graph breaks'})"


def build_vae(dry_run: bool, device: str, dtype: torch.dtype):
    from diffusers import AutoencoderKLWan

    from rolldiff.pipelines.streaming_decode import StreamingWanDecoder

    torch.manual_seed(0)
    with torch.device(device):
        vae = AutoencoderKLWan(**TINY_VAE) if dry_run else AutoencoderKLWan()
    vae = vae.to(dtype).eval().requires_grad_(False)
    return vae, StreamingWanDecoder(vae)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def stream_chunk(loop, decoder, vae) -> torch.Tensor:
    """One chunk: denoise, context pass, decode; returns the decoded frames `(1, 3, frames, H, W)` or latents."""
    from rolldiff.pipelines.streaming_decode import denormalize_wan_latents

    clean = loop.chunk()
    if decoder is None:
        return clean
    with torch.inference_mode():
        return decoder.decode(denormalize_wan_latents(clean.to(vae.dtype), vae))


def run_row(name: str, approach: str, setup: Setup, args, vae_pair, compiled: bool, flops: dict) -> Row:
    """Warm up a stream (compiling, if asked), then time a fresh stream chunk by chunk."""
    row = Row(name)
    device = setup.device
    vae, decoder = vae_pair
    loop = None
    try:
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        loop = make_loop(approach, setup)
        if compiled:
            backend = "eager" if args.dry_run else "inductor"
            loop.forward = CompiledForward(loop.model, backend, args.compile_mode)
        full_from = -(-(setup.sink_frames + setup.window_frames - setup.chunk_frames) // setup.chunk_frames)
        count_at = min(full_from, args.warmup - 1)  # a steady-state chunk: the first ones attend to less
        began = time.perf_counter()
        for index in range(args.warmup):
            if index == count_at and approach not in flops and not compiled:
                with flop_counter() as counter:
                    stream_chunk(loop, decoder, vae)
                flops[approach] = counter.get_total_flops()
            else:
                stream_chunk(loop, decoder, vae)
        synchronize(device)
        row.warmup_s = time.perf_counter() - began
        # a fresh stream on the warm model: time to first frame, then steady state
        loop.restart()
        if decoder is not None:
            decoder.reset()
        seconds, finite = [], True
        start = time.perf_counter()
        for _ in range(args.chunks):
            chunk_start = time.perf_counter()
            frames = stream_chunk(loop, decoder, vae)
            synchronize(device)
            seconds.append(time.perf_counter() - chunk_start)
            finite = finite and bool(torch.isfinite(frames).all())
            if len(seconds) == 1:
                row.ttff_s = time.perf_counter() - start
        if not finite:
            raise FloatingPointError("non-finite values in the generated frames")
        steady = seconds[min(full_from, len(seconds) - 1) :]
        median = statistics.median(steady)
        row.chunk_ms = median * 1e3
        row.fps = 4 * setup.chunk_frames / median
        chunk_flops = flops.get(approach, flops.get("ours"))
        row.tflops = chunk_flops / median / 1e12 if chunk_flops else math.nan
        if device.startswith("cuda"):
            row.peak_mib = torch.cuda.max_memory_allocated() / 2**20
        if compiled:
            row.graphs = loop.forward.describe()
    except Exception as exc:  # noqa: BLE001 - one failed row must not hide the others; the exit status says it
        row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    finally:
        del loop
        torch._dynamo.reset()
    return row


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


def table(rows: list[Row], spec: float | None, measured: float) -> str:
    header = [
        "row",
        "FPS",
        "time to first frame s",
        "ms/chunk",
        "peak memory MiB",
        "TFLOP/s",
        "fraction of bf16 peak (spec / measured matmul)",
        "compiled graphs",
        "warm-up s",
    ]
    body = []
    for row in rows:
        if row.error:
            body.append([row.name, f"FAILED: {row.error}", *["-"] * (len(header) - 2)])
            continue
        fraction = f"{row.tflops / spec:.2f}" if spec else "-"
        fraction += f" / {row.tflops / measured:.2f}"
        body.append(
            [
                row.name,
                f"{row.fps:.1f}",
                f"{row.ttff_s:.2f}",
                f"{row.chunk_ms:.0f}",
                f"{row.peak_mib:.0f}" if not math.isnan(row.peak_mib) else "-",
                f"{row.tflops:.1f}",
                fraction,
                row.graphs,
                f"{row.warmup_s:.1f}",
            ]
        )
    for name, fps in PUBLISHED_FPS:
        body.append([name, f"{fps:.1f}", *["-"] * (len(header) - 2)])
    return markdown_table(header, body)


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.perf_counter()
    if args.dry_run:
        torch.set_num_threads(1)
    setup = make_setup(args)
    device, dtype = setup.device, setup.dtype
    spec, measured = bf16_peak(device)
    vae_pair = build_vae(args.dry_run, device, getattr(torch, dtype)) if args.vae else (None, None)
    if vae_pair[0] is not None:
        cast_like_from_pretrained(vae_pair[0], getattr(torch, dtype))
    plan = [("ours, eager", "ours", False)]  # cheapest rows first: a compile that runs long skips only itself
    if args.baseline:
        plan.append(("Self-Forcing loop, eager (measured here)", "self-forcing", False))
    if args.compile:
        plan.append((f"ours, torch.compile ({'eager backend' if args.dry_run else args.compile_mode})", "ours", True))
    rows, flops = [], {}
    for name, approach, compiled in plan:
        if time.perf_counter() - began > args.budget_s:
            rows.append(Row(name, error=f"skipped: past the {args.budget_s:.0f} s budget"))
            continue
        rows.append(run_row(name, approach, setup, args, vae_pair, compiled, flops))
        print(f"  {name}: done at {time.perf_counter() - began:.0f} s", flush=True)
    where = "CPU (dry run)" if args.dry_run else torch.cuda.get_device_name()
    tokens = (setup.latent_hw[0] // 2) * (setup.latent_hw[1] // 2)
    print(
        f"\n{where}, {dtype}; Wan 2.1 1.3B shapes x {args.layers} blocks, {args.height}x{args.width} "
        f"({tokens} tokens/frame), chunk 3, sink 3, window 9, 4 steps + context pass, "
        f"{'VAE decode included' if args.vae else 'transformer only'}; {args.chunks} chunks per row after "
        f"{args.warmup} warm-up; torch {torch.__version__}; {time.perf_counter() - began:.0f} s\n"
    )
    print(table(rows, spec, measured))
    failed = [row for row in rows if row.error]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

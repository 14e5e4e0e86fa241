"""Checks that only a GPU can make: the embedded pipelines on CUDA give the CPU's video, and the CUDA-only code
paths (the K/V window offloaded to pinned CPU memory with side-stream prefetch, the weights offloaded three ways)
give the same video as without them.

Each row generates the same video (fixed prompt, a CPU `torch.Generator`, so the noise is identical on every
device) and compares its frames with a reference row; it prints one table and exits non-zero when a row
fails or differs by more than its tolerance:

  cuda float32 vs cpu float32         kernels differ (TF32 off), so a small difference: atol 2e-3 on frames in [0, 1]
  cuda kv_offload vs cuda             the same arithmetic, copies only: atol 1e-5 (Krea-like only: SANA's state
                                      is small and has no offload)
  cuda model_cpu_offload vs cuda      the same arithmetic, hooks only: atol 1e-5
  cuda offload text-encoder / blocks  `enable_offload`: the text encoder leaf by leaf, the transformer block by block
    vs cuda                           (diffusers' group offloading, prefetched on a side stream): atol 1e-5
  cuda bfloat16 vs cuda float32       reported (bf16 rounding drifts over a long video), finite required
  cuda CUDA graphs vs cuda float32    `capture_cuda_graphs` (inductor + graph replay): atol 2e-3 (fused kernels)
  cuda fastest attention vs bfloat16  `fastest_attention_backend`'s kernel in bf16: reported, finite required
  cuda fp8 vs cuda bfloat16           `enable_fp8` (float8 linears): reported, finite required
  cuda fp8 storage vs cuda bfloat16   `enable_fp8_storage` (float8 weights cast up per layer): reported, finite
  cuda overlapped decode vs serial    `OverlappedDecoder` on a side stream while the main stream is busy, random
                                      latents through the model's own decoder: exact (atol 0)
  cuda CUDA graphs vs cuda float32,   StreamDiffusionV2's adaptive sink, pipelined: the in-flight forwards replayed as
    both streamdiffusionv2 pipelined  CUDA graphs, the deciding ones eager: atol 2e-3 (Krea-like only)

On the CPU (dry run) the overlapped decode runs its synchronous path, attention "native", and CUDA graphs and
fp8 report their refusal as "skipped".

    python benchmarks/gpu_checks.py              # one GPU, under a minute
    python benchmarks/gpu_checks.py --dry-run    # every row on the CPU (CI: the script itself works)
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import sys
import time

import numpy as np
import torch
from _common import markdown_table, require_cuda_unless_dry_run

from rolldiff.choices import OFFLOAD_MODES
from rolldiff.defaults import embedded_models, load_pipeline, pipeline_class
from rolldiff.pipelines.acceleration import AccelerationUnavailable
from rolldiff.pipelines.codecs.overlap import OverlappedDecoder, decode_ahead
from rolldiff.recipes import list_recipes

PROMPT = "a red circle moving right"
STREAM_RECIPE = "streamdiffusionv2"  # its adaptive sink: compiled only pipelined, the deciding forwards eager
SEED = 0


@dataclasses.dataclass
class Check:
    model: str
    name: str
    reference: str
    atol: float | None  # None: reported, not checked
    seconds: float = 0.0
    max_diff: float = float("nan")
    error: str = ""
    skipped: str = ""  # a technique's own refusal on this device (CUDA graphs or fp8 on a CPU)

    @property
    def passed(self) -> bool:
        return bool(self.skipped) or (not self.error and (self.atol is None or self.max_diff <= self.atol))


def generate(
    model: str, device: str, dtype: str, seconds: float, offload: str | None = None, call: dict | None = None
) -> np.ndarray:
    """The video of `PROMPT` as `(frames, H, W, 3)` float32 in [0, 1]. `offload`: an `enable_offload` mode, "kv"
    (the K/V window), "fp8-storage", or a speed switch ("cuda-graphs", "attention", "fp8") applied to the transformer
    after loading; `call`: more call arguments."""
    placed_later = offload in (*OFFLOAD_MODES, "fp8-storage")  # loaded on the CPU, then stored / placed
    pipe = load_pipeline(model, device="cpu" if placed_later else device, dtype=dtype)
    if offload == "fp8-storage":
        pipe.enable_fp8_storage()
        pipe.to(device)
    elif offload in OFFLOAD_MODES:
        pipe.enable_offload(offload, device)
    apply_speed_switch(pipe, offload)
    num_frames = pipe.num_frames_for(seconds, 16)
    generator = torch.Generator("cpu").manual_seed(SEED)
    options = {"kv_offload": True} if offload == "kv" else {}
    options.update(call or {})
    frames = pipe(PROMPT, num_frames=num_frames, generator=generator, **options).frames
    return np.asarray(frames[0], dtype=np.float32)


def apply_speed_switch(pipe, switch: str | None) -> None:
    """The pipeline's own switch (what `rolldiff generate` applies); a refusal raises AccelerationUnavailable."""
    if switch == "cuda-graphs":
        pipe.enable_cuda_graphs()
    elif switch == "attention":
        pipe.set_attention_backend("fastest")
    elif switch == "fp8" and not pipe.enable_fp8():
        raise AccelerationUnavailable("enable_fp8 (--fp8) found no 16-aligned linear layer in this model's blocks")


def overlap_difference(model: str, device: str, chunks: int = 4) -> float:
    """Max |overlapped - serial| over `chunks` random latent chunks decoded by the model's own decoder; the
    main stream runs a matmul chain before each chunk exists, so the side stream races real work."""
    pipe = load_pipeline(model, device=device, dtype="float32")
    generator = torch.Generator("cpu").manual_seed(SEED)
    channels = pipe.transformer.config.out_channels
    latents = [torch.randn(1, channels, 1 if i == 0 else 3, 8, 8, generator=generator) for i in range(chunks)]
    decoder = pipe.make_decoder()
    serial = [decoder.decode(chunk.to(device)) for chunk in latents]
    side = 2048 if device.startswith("cuda") else 32  # on a CPU only the order matters, not the race
    busy = torch.randn(side, side, device=device)

    def produced():
        for chunk in latents:
            for _ in range(8):
                busy.copy_(torch.tanh(busy @ busy))  # main-stream work queued before the chunk exists
            yield chunk.to(device) + 0.0 * busy[0, 0]

    overlapped = list(decode_ahead(produced(), OverlappedDecoder(pipe.make_decoder(), device)))
    return max(float((a - b).abs().max()) for a, b in zip(overlapped, serial, strict=True))


def accepts_kv_offload(model: str) -> bool:
    cls = pipeline_class(embedded_models()[model])
    return "kv_offload" in inspect.signature(cls.__init__).parameters


def offers_recipe(model: str, recipe: str) -> bool:
    return recipe in list_recipes(pipeline_class(embedded_models()[model]).__name__)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="run every row on the CPU")
    parser.add_argument("--seconds", type=float, default=None, help="video length per row (default 6; dry run 1)")
    args = parser.parse_args(argv)
    if args.seconds is None:
        args.seconds = 1.0 if args.dry_run else 6.0
    if args.seconds <= 0:
        parser.error(f"--seconds must be > 0, got {args.seconds}.")
    require_cuda_unless_dry_run(parser, args.dry_run)
    return args


def run_check(check: Check, rows: dict, videos: dict[str, np.ndarray], seconds: float) -> None:
    """Generate the row's video and its reference's (each once per model) and compare them, in place."""
    model, name, reference = check.model, check.name, check.reference
    try:
        if name == "cuda overlapped decode":
            start = time.perf_counter()
            check.max_diff = overlap_difference(model, rows[name][0])
            check.seconds = time.perf_counter() - start
            return
        for row in (reference, name):
            if row not in videos:
                start = time.perf_counter()
                videos[row] = generate(model, *rows[row][:2], seconds, *rows[row][2:])
                check.seconds = time.perf_counter() - start
        video, expected = videos[name], videos[reference]
        if not np.isfinite(video).all():
            raise FloatingPointError("non-finite frames")
        check.max_diff = float(np.abs(video - expected).max())
    except Exception as exc:  # noqa: BLE001 - one failed row must not hide the others; the exit status says it
        message = str(exc).splitlines()[0][:160] if str(exc) else ""
        if isinstance(exc, AccelerationUnavailable):  # the switch's own refusal on this machine: a skip
            check.skipped = message
        else:
            check.error = f"{type(exc).__name__}: {message}"
    finally:
        torch.compiler.reset()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpu = "cpu" if args.dry_run else "cuda"
    # row name -> (device, dtype, offload or speed switch[, call arguments]); the reference rows come first
    pipelined_sink = {"recipe": STREAM_RECIPE, "denoising": "pipelined"}
    rows = {
        "cpu float32": ("cpu", "float32", None),
        "cuda float32": (gpu, "float32", None),
        "cuda kv_offload": (gpu, "float32", "kv"),
        "cuda model_cpu_offload": (gpu, "float32", "model"),
        "cuda offload text-encoder": (gpu, "float32", "text-encoder"),
        "cuda offload blocks": (gpu, "float32", "blocks"),
        "cuda fp8 storage": (gpu, "bfloat16", "fp8-storage"),
        "cuda bfloat16": (gpu, "bfloat16", None),
        "cuda CUDA graphs": (gpu, "float32", "cuda-graphs"),
        "cuda fastest attention": (gpu, "bfloat16", "attention"),
        "cuda fp8": (gpu, "bfloat16", "fp8"),
        "cuda overlapped decode": (gpu, "float32", None),
        f"cuda float32, {STREAM_RECIPE} pipelined": (gpu, "float32", None, pipelined_sink),
        f"cuda CUDA graphs, {STREAM_RECIPE} pipelined": (gpu, "float32", "cuda-graphs", pipelined_sink),
    }
    plan = [
        ("cuda float32", "cpu float32", 2e-3),
        ("cuda kv_offload", "cuda float32", 1e-5),
        ("cuda model_cpu_offload", "cuda float32", 1e-5),
        ("cuda offload text-encoder", "cuda float32", 1e-5),
        ("cuda offload blocks", "cuda float32", 1e-5),
        ("cuda bfloat16", "cuda float32", None),
        ("cuda CUDA graphs", "cuda float32", 2e-3),
        ("cuda fastest attention", "cuda bfloat16", None),
        ("cuda fp8", "cuda bfloat16", None),
        ("cuda fp8 storage", "cuda bfloat16", None),
        ("cuda overlapped decode", "cuda serial decode", 0.0),
        (f"cuda CUDA graphs, {STREAM_RECIPE} pipelined", f"cuda float32, {STREAM_RECIPE} pipelined", 2e-3),
    ]
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    checks = []
    for model in embedded_models():
        videos: dict[str, np.ndarray] = {}
        for name, reference, atol in plan:
            if rows[name][2] == "kv" and not accepts_kv_offload(model):
                continue
            if len(rows[name]) > 3 and not offers_recipe(model, rows[name][3]["recipe"]):
                continue
            check = Check(model, name, reference, atol)
            run_check(check, rows, videos, args.seconds)
            checks.append(check)
            print(f"  {model} / {name}: {'ok' if check.passed else 'FAILED'}", flush=True)
    where = "CPU (dry run)" if args.dry_run else torch.cuda.get_device_name()
    print(f"\n{where}; torch {torch.__version__}; {args.seconds:g} s of video per row at 16 fps, seed {SEED}\n")
    header = ["model", "row", "compared with", "max abs difference", "tolerance", "s", "result"]
    body = [
        [
            c.model,
            c.name,
            c.reference,
            f"{c.max_diff:.2e}",
            "reported" if c.atol is None else f"{c.atol:g}",
            f"{c.seconds:.1f}",
            f"skipped: {c.skipped}" if c.skipped else "ok" if c.passed else f"FAILED {c.error}".strip(),
        ]
        for c in checks
    ]
    print(markdown_table(header, body))
    return 0 if all(c.passed for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())

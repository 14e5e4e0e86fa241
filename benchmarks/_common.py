"""Helpers the benchmark scripts share: model shapes, memory readings, machine facts, window medians, tables.

Kept here so every script measures the same way (RSS from `/proc`, peak RSS from `getrusage`, medians over
windows of chunks) and prints the same markdown.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import time
from collections.abc import Sequence

import torch

MiB = 2**20

# Wan 2.1 1.3B's layer shapes (the block is the real one; `num_layers` is set per benchmark).
WAN_1_3B = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=12,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=8960,
    num_layers=30,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=1024,
)
# SANA-Video 2B 480p (LongSANA), its blocks' count left to the caller (20 in the checkpoint)
SANA_2B = dict(
    in_channels=16,
    out_channels=16,
    num_attention_heads=20,
    attention_head_dim=112,
    num_cross_attention_heads=20,
    cross_attention_head_dim=112,
    cross_attention_dim=2240,
    caption_channels=2304,
    mlp_ratio=3.0,
    patch_size=(1, 2, 2),
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=1024,
)
WAN_TEXT_TOKENS = 512  # UMT5-XXL, padded


def wan_config(num_layers: int) -> dict:
    return {**WAN_1_3B, "num_layers": num_layers}


def latent_hw(height: int, width: int) -> tuple[int, int]:
    """Wan VAE: 8x spatial; the patch is 2x2 so the latent sides must be even."""
    if height % 16 or width % 16:
        raise ValueError(f"height and width must be multiples of 16 (VAE 8 x patch 2), got {height}x{width}.")
    return height // 8, width // 8


def cast_like_from_pretrained(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast to `dtype` but keep `_keep_in_fp32_modules` in fp32, as `from_pretrained(torch_dtype=...)` does."""
    keep = set(model._keep_in_fp32_modules or ())
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point():
            tensor.data = tensor.data.to(torch.float32 if keep & set(name.split(".")) else dtype)


# ----------------------------------------------------------------------------------------- streams
def steady_stream_fps(pipe, prompt: str, num_frames: int, seed: int = 0, **call) -> float:
    """Frames per second of `pipe.stream(...)` after its first chunk (which allocates: a server's time to first
    frame, not steady state); numpy frames on the host, as a client gets them."""
    stream = pipe.stream(prompt, num_frames, generator=torch.Generator().manual_seed(seed), **call)
    next(stream)
    start, frames = time.perf_counter(), 0
    for chunk in stream:
        frames += chunk.shape[1]
    return frames / (time.perf_counter() - start)


# ----------------------------------------------------------------------------------------- memory
def rss_mib() -> float:
    """Resident set size now (`/proc/self/statm`), MiB."""
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / MiB


def peak_rss_mib() -> float:
    """The process's RSS high-water mark (`ru_maxrss`, KiB on Linux), MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ----------------------------------------------------------------------------------------- machine
def require_cuda_unless_dry_run(parser: argparse.ArgumentParser, dry_run: bool) -> None:
    """The GPU scripts' refusal on a machine without CUDA, naming the CPU dry run."""
    if not dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device (torch.cuda.is_available() is False); use --dry-run to check on the CPU.")


def load_average() -> tuple[float, float, float]:
    return os.getloadavg()


def machine_summary() -> dict[str, str]:
    """What a reader needs to judge the numbers: CPU, cores, load, versions."""
    import diffusers

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as info:
            names = [line.split(":", 1)[1].strip() for line in info if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    load = ", ".join(f"{value:.2f}" for value in load_average())
    return {
        "cpu": f"{cpu}, {os.cpu_count()} logical cores",
        "load average (1, 5, 15 min)": load,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "time (UTC)": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }


def flop_counter():
    """`FlopCounterMode` that also counts CPU attention: torch counts the GPU SDPA kernels but gives
    `_scaled_dot_product_flash_attention_for_cpu` zero FLOPs, which left a quarter of a Wan step out of
    the count. The same formula as the GPU kernels (two matmuls; a mask or causality does not reduce it)."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

    def cpu_flash_attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    return FlopCounterMode(
        display=False,
        custom_mapping={torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: cpu_flash_attention_flops},
    )


def matmul_gflops(
    m: int = 1170, k: int = 1536, n: int = 8960, dtype: torch.dtype = torch.float32, seconds: float = 2.0
) -> tuple[float, float]:
    """The machine's fp32 matmul throughput at a Wan FFN shape (`(m, k) @ (k, n)`), GFLOP/s, best of runs:
    `(from wall time, from process CPU time)` (at least 3 runs).

    Best rather than median: it is the ceiling a step could reach on this machine, in this run. The CPU-time
    figure is the one to compare CPU times with on a machine that other jobs share.
    """
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    out = torch.empty(m, n, dtype=dtype)
    torch.mm(a, b, out=out)
    best, best_cpu, runs, began = float("inf"), float("inf"), 0, time.perf_counter()
    while time.perf_counter() - began < seconds or runs < 3:
        start, cpu_start = time.perf_counter(), time.process_time()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - start)
        best_cpu = min(best_cpu, time.process_time() - cpu_start)
        runs += 1
    flop = 2 * m * k * n
    return flop / best / 1e9, flop / best_cpu / 1e9


# ----------------------------------------------------------------------------------------- statistics
def window_medians(values: Sequence[float], window: int, points: int = 3) -> list[tuple[int, float]]:
    """Medians over `points` windows of `window` consecutive values, spread from the start to the end.

    Returns `[(first index, median), ...]`; fewer points when the series is short. Windows may overlap
    (a 100-chunk run gives windows at 0, 25, 50 for `window=50`).
    """
    if len(values) < window:
        raise ValueError(f"need at least window={window} values, got {len(values)}.")
    last = len(values) - window
    starts = sorted({round(i * last / (points - 1)) for i in range(points)}) if points > 1 else [0]
    return [(start, statistics.median(values[start : start + window])) for start in starts]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]], align: str | None = None) -> str:
    """A markdown table; `align` is one letter per column, "l" or "r" (default: first left, rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" if a == "l" else "---:" for a in align) + " |"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)

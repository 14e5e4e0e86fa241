"""The SANA-like family: LongSANA's constant-size state cache against recomputing the context every chunk.

SANA-Video 2B's block (20 heads x 112 = 2240 wide, cross-attention 20 x 112, mlp_ratio 3.0, caption 2304;
`--layers` blocks, random weights, fp32) generates `--chunks` chunks of 10 latent frames (LongSANA's chunk),
4 denoising steps + the clean t = 0 pass, with `LongSanaTransformer3DModel`. Approaches, run interleaved chunk
by chunk in one process (the order alternating), so load falls on all alike:

  state, all chunks        `make_cache` with LongSANA's default window (every earlier chunk): the running
                           `sum(v k^T)` and `sum(k)` per block, constant in the video's length.
  state, last 2 chunks     the same with a window of 2 earlier chunks (the state keeps per-chunk terms to
                           subtract).
  recompute, last 2 chunks no state survives a chunk: each chunk builds a fresh cache by re-running the last
                           2 chunks' clean latents at t = 0 (block-causally, chunk by chunk), then denoises.
                           The same context as the row above, paid again every chunk.

Columns: ms per chunk (medians over windows of `--window` chunks at the start and the end), late/early, time
over the state cache with the same context (median of per-chunk ratios), and the cache's bytes.

    python benchmarks/sana_state.py [--chunks 16] [--window 6] [--layers 1] [--height 32 --width 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from _common import SANA_2B, markdown_table, window_medians

from rolldiff.models.long_sana import LongSanaTransformer3DModel, sana_layout

STEPS, SHIFT, CHUNK_FRAMES, CONTEXT_CHUNKS = (1000, 750, 500, 250), 8.0, 10, 2
LABELS = {
    "state-all": "state cache, every earlier chunk (ours, LongSANA's default)",
    "state-window": f"state cache, last {CONTEXT_CHUNKS} chunks (ours)",
    "recompute-window": f"recompute the last {CONTEXT_CHUNKS} chunks every chunk",
}


class SanaLoop:
    """LongSANA's chunk loop on a shared model; the context is a state cache or rebuilt every chunk."""

    def __init__(self, approach: str, model, latent_hw, text, seed: int = 0) -> None:
        self.approach, self.model, self.text = approach, model, text
        self.text_mask = torch.ones(text.shape[:2], dtype=torch.bool)
        tokens = model.tokens_per_frame(*latent_hw)
        window = None if approach == "state-all" else CONTEXT_CHUNKS
        self.layout = sana_layout(tokens, chunk_frames=CHUNK_FRAMES, context_chunks=window)
        self.shape = (1, model.config.in_channels, CHUNK_FRAMES, *latent_hw)
        self.noise = torch.Generator().manual_seed(seed)
        self.sigmas = [SHIFT * (s / 1000) / (1 + (SHIFT - 1) * s / 1000) for s in STEPS]
        self.recent: list[torch.Tensor] = []  # clean chunks, for the recompute
        self.cache = None if approach == "recompute-window" else self._fresh_cache()

    def _fresh_cache(self):
        cache = self.model.make_cache(self.layout, 1, torch.float32, "cpu")
        self.model.prepare_conditioning(cache, self.text)
        return cache

    def _forward(self, latents, sigma, cache):
        timestep = torch.full((1,), sigma * 1000.0)
        return self.model(
            latents, self.text, timestep, encoder_attention_mask=self.text_mask, kv_cache=cache, layout=self.layout
        ).sample

    @torch.inference_mode()
    def chunk(self) -> int:
        """One chunk; returns the cache bytes held during it."""
        cache = self.cache
        if cache is None:  # rebuild: the last chunks' clean latents, one t = 0 pass each, committed in order
            cache = self._fresh_cache()
            for clean in self.recent:
                self._forward(clean, 0.0, cache)
                cache.commit()
        noisy = torch.randn(self.shape, generator=self.noise)
        for i, sigma in enumerate(self.sigmas):
            clean = noisy - sigma * self._forward(noisy, sigma, cache)
            if i + 1 < len(self.sigmas):
                noisy = (1 - self.sigmas[i + 1]) * clean + self.sigmas[i + 1] * torch.randn(
                    self.shape, generator=self.noise
                )
        held = cache.memory_bytes()
        if self.cache is not None:
            self._forward(clean, 0.0, cache)
            cache.commit()
        else:
            self.recent = [*self.recent, clean][-CONTEXT_CHUNKS:]
        return held


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=16, help="chunks per approach (default 16)")
    parser.add_argument("--window", type=int, default=6, help="chunks per median (default 6)")
    parser.add_argument("--warmup", type=int, default=2, help="chunks left out (default 2)")
    parser.add_argument("--layers", type=int, default=1, help="SANA-2B blocks (default 1; the real model has 20)")
    parser.add_argument("--height", type=int, default=32, help="pixel height (default 32)")
    parser.add_argument("--width", type=int, default=32, help="pixel width (default 32)")
    parser.add_argument("--text-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.chunks < args.warmup + args.window:
        parser.error(f"--chunks must be >= --warmup + --window = {args.warmup + args.window}, got {args.chunks}.")
    if args.height % 16 or args.width % 16:
        parser.error(f"--height/--width must be multiples of 16, got {args.height}x{args.width}.")
    torch.set_num_threads(args.threads)
    began = time.perf_counter()
    torch.manual_seed(0)
    model = LongSanaTransformer3DModel(**SANA_2B, num_layers=args.layers).eval().requires_grad_(False)
    text = torch.randn(1, args.text_tokens, SANA_2B["caption_channels"], generator=torch.Generator().manual_seed(1))
    latent_hw = (args.height // 8, args.width // 8)
    loops = {name: SanaLoop(name, model, latent_hw, text) for name in LABELS}
    ms = {name: [] for name in LABELS}
    cpu_ms = {name: [] for name in LABELS}
    held = {name: 0 for name in LABELS}
    names = list(LABELS)
    for index in range(args.chunks):
        for name in names if index % 2 == 0 else names[::-1]:
            start, cpu_start = time.perf_counter(), time.process_time()
            held[name] = loops[name].chunk()
            ms[name].append((time.perf_counter() - start) * 1e3)
            cpu_ms[name].append((time.process_time() - cpu_start) * 1e3)
    tokens = model.tokens_per_frame(*latent_hw)
    print(
        f"SANA-Video 2B blocks x {args.layers} (20 heads x 112, mlp 3.0), fp32, {args.threads} thread(s); "
        f"{args.height}x{args.width} px -> {tokens} tokens/frame; chunks of {CHUNK_FRAMES} latent frames "
        f"({CHUNK_FRAMES * tokens} tokens); 4 steps + clean pass; {args.chunks} chunks; text {args.text_tokens} tokens\n"
    )
    rows = []
    for name in names:
        windows = window_medians(ms[name][args.warmup :], args.window, 2)
        reference = "state-window" if name == "recompute-window" else name
        paired = statistics.median(b / a for a, b in zip(ms[reference][args.warmup :], ms[name][args.warmup :]))
        paired_cpu = statistics.median(
            b / a for a, b in zip(cpu_ms[reference][args.warmup :], cpu_ms[name][args.warmup :])
        )
        cpu_windows = window_medians(cpu_ms[name][args.warmup :], args.window, 2)
        rows.append(
            [
                LABELS[name],
                f"{windows[0][1]:.0f}",
                f"{windows[-1][1]:.0f}",
                f"{windows[-1][1] / windows[0][1]:.3f}",
                f"{paired:.2f}",
                f"{cpu_windows[-1][1] / cpu_windows[0][1]:.3f}",
                f"{paired_cpu:.2f}",
                f"{held[name] / 2**20:.2f}",
            ]
        )
    first, last = windows[0][0] + args.warmup, windows[-1][0] + args.warmup
    header = [
        "approach",
        f"ms/chunk, chunks {first}-{first + args.window - 1}",
        f"ms/chunk, chunks {last}-{last + args.window - 1}",
        "late/early",
        "x state cache, same context",
        "CPU time: late/early",
        "CPU time: x state cache",
        "cache MiB",
    ]
    print(markdown_table(header, rows))
    print(f"\n({time.perf_counter() - began:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

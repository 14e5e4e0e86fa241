"""Long videos: per-chunk time and memory of the rolling cache over hundreds of chunks, against the
two ways the field handles a stream that outgrows its window, measured in the same run.

A Wan-shaped `KreaRealtimeTransformer3DModel` (random weights, scaled to CPU) generates `--chunks` chunks
of 3 latent frames with a 3-frame sink and a 9-frame window (the window counts the chunk), 4 denoising
steps (1000, 750, 500, 250, shift 5) + 1 context pass per chunk, fp32, random text embeddings, no VAE
and no text encoder. Approaches (each in its own spawned process, one after the other, so the peak RSS
of one is not the peak of another):

  rolling cache (ours)    `make_cache` + cached forward + `commit`, as `KreaRealtimeVideoPipeline` does.
  ours, compiled          the same with `torch.compile(model, backend=CompileCounter())` (dynamo with the
                          eager backend: it shows graph breaks and recompiles, not kernel speed);
                          `fullgraph=True` is tried first. The graph count is every graph dynamo built over
                          the whole run: a recompile as the video grows would show as a count that grows.
  no eviction             `GrowingLayer` below: every committed chunk is kept (one `torch.cat` per pass)
                          and attended to, at absolute positions (Self-Forcing / CausVid without a window).
  recompute, Krea context Krea Realtime's server loop: no cache survives a chunk. Each chunk builds a fresh
                          cache from clean frames at t = 0 (first latent frame + last 2 latent frames,
                          positions 0..2), then denoises; no context pass (the next chunk rebuilds).
  recompute, our context  the same loop over the frames the rolling cache sees (sink + window), so the
                          attention span equals ours; filled chunk by chunk, which equals one block-causal
                          pass. Positions start at 0 in the fresh cache. Once frames are evicted its output
                          differs slightly from ours: each context frame's K/V are rebuilt seeing only the
                          context, where ours kept what the frame saw when it was generated.
The baselines stop after `--baseline-budget-s` seconds of chunks (at least 10 + 10 measured chunks), and
the growing cache stops before the 1024-frame RoPE table; the table says how far each got.

Columns: ms per chunk = wall time of a whole chunk (every pass, cache build, commit), median of the first
and of the last window of chunks after `--warmup` warm-up chunks (windows of 50 chunks when 100 or more are
measured, else 10); peak RSS = the process's high-water mark
(`getrusage` ru_maxrss) after warm-up and at the end; cache MiB = `cache.memory_bytes()` (self- and
cross-attention buffers; for recompute, the cache rebuilt every chunk).
Before the table, the clean latents of the first chunks are compared across approaches where they must
agree (until the window starts evicting, every approach sees the same frames at the same positions).

`--gpu`: Wan 2.1 1.3B shapes (30 layers, 12 heads x 128, ffn 8960, text 512 x 4096) at 480x832
(60x104 latent, 1560 tokens per frame), bf16 on CUDA, our rolling cache only; prints frames per second
(4 pixel frames per latent frame) next to Self-Forcing's published ~17 FPS on an H100.

    python benchmarks/long_video.py [--chunks 200] [--threads 1] [--position-mode absolute|relative] [--gpu]
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import resource
import statistics
import sys
import time

import torch
from _common import WAN_1_3B, WAN_TEXT_TOKENS, MiB

from rolldiff import ChunkLayout, KreaRealtimeTransformer3DModel
from rolldiff.caching import CacheLayer, CrossAttentionLayer, RollingKVCache
from rolldiff.pipelines.flow_matching import add_noise, predict_clean, sigma_for_step

DENOISING_STEPS = (1000, 750, 500, 250)
SHIFT = 5.0
SAMPLE = 10  # chunks in each median (first 10 / last 10 after warm-up)
CHECKED_CHUNKS = 4  # chunks before eviction starts (sink 3 + window 9 = 12 frames = 4 chunks)
SELF_FORCING_FPS_H100 = 17.0

# CPU: Wan's block, patch and latent channels, smaller everywhere else (~20 ms per forward, ~90 ms per chunk
# of 5 passes on one core shared with other jobs), so 200 chunks of ours take well under a minute.
CPU_MODEL = {  # Wan 1.3B's config with narrower heads, FFN and text, and 2 layers
    **WAN_1_3B,
    "num_attention_heads": 4,
    "attention_head_dim": 32,
    "text_dim": 128,
    "ffn_dim": 512,
    "num_layers": 2,
}
CPU_LATENT = (16, 16)  # (height, width) -> 8x8 = 64 tokens per frame after the 2x2 patch
CPU_TEXT_TOKENS = 16

WAN_LATENT = (60, 104)  # 480x832 pixels / 8 -> 30x52 = 1560 tokens per frame


# ----------------------------------------------------------------------------------------- the no-eviction baseline
class GrowingLayer(CacheLayer):
    """Keeps every committed token: attention sees the whole stream, at absolute positions.

    `update` concatenates the committed tokens with the pending chunk (a new allocation each pass, the size
    of everything so far); `commit` adopts the last pass's concatenation, so the buffer grows by one chunk
    per chunk. Speaks the part of `SlidingWindowLayer`'s interface the model's processor reads.
    """

    is_sliding = False
    window_full = False  # nothing is evicted, so the mask is always read

    def __init__(self) -> None:
        super().__init__()
        self._committed_count = 0  # tokens; read by the model's RoPE budget check
        self._latest: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            self.keys = key.new_empty((key.shape[0], 0, *key.shape[2:]))  # (B, 0, H, D)
            self.values = torch.empty_like(self.keys)
        self._latest = torch.cat([self.keys, key], dim=1), torch.cat([self.values, value], dim=1)  # (B, S, H, D)
        self.pending_tokens = key.shape[1]
        return self._latest

    @property
    def attention_mask(self) -> torch.Tensor:
        """`(committed + pending,)` all True: nothing is ever evicted."""
        return torch.ones(self._committed_count + self.pending_tokens, dtype=torch.bool, device=self.keys.device)

    @property
    def committed_count(self) -> int:
        """Tokens committed (the stream position the model's RoPE budget check reads)."""
        return self._committed_count

    def visible_prefix(self, num_pending: int) -> int:
        """Every token is visible, in stream order: attention reads them all with no mask."""
        return self._committed_count + num_pending

    def pending_positions(self, num_tokens: int, reindexed: bool = False, device=None) -> torch.Tensor:
        if reindexed:
            raise ValueError("GrowingLayer keeps absolute positions; use position_mode='absolute'.")
        return torch.arange(self._committed_count, self._committed_count + num_tokens, device=device)

    def commit(self) -> None:
        self._require_pending()
        self.keys, self.values = self._latest
        self._latest = None
        self._committed_count += self.pending_tokens
        self.pending_tokens = 0

    def get(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return (self.keys, self.values) if self._committed_count else None

    def reset(self) -> None:
        self.keys = self.values = self._latest = None
        self._committed_count = self.pending_tokens = 0

    def get_seq_length(self) -> int:
        return self._committed_count

    def early_initialization(self, batch_size, num_heads, head_dim, dtype, device) -> None:
        """Nothing to allocate ahead: the buffer grows from the first update."""


# ----------------------------------------------------------------------------------------- one run
@dataclasses.dataclass
class Setup:
    """What every approach shares; sent to the spawned worker."""

    model_config: dict
    latent_hw: tuple[int, int]
    text_tokens: int
    chunks: int
    warmup: int
    threads: int
    device: str = "cpu"
    dtype: str = "float32"
    position_mode: str = "absolute"
    baseline_budget_s: float = float("inf")
    seed: int = 0


@dataclasses.dataclass
class Result:
    approach: str
    chunk_ms: list[float] = dataclasses.field(default_factory=list)  # every chunk, warm-up included
    peak_rss_mib: tuple[float, float] = (0.0, 0.0)  # after warm-up, at the end
    cache_mib: tuple[float, float] = (0.0, 0.0)
    device_peak_mib: float = 0.0
    stopped: str = ""
    graphs: int | None = None  # graphs dynamo built (compiled approach)
    compile_mode: str = ""
    # clean latents of the first chunks, for the agreement check
    first_chunks: list[torch.Tensor] = dataclasses.field(default_factory=list)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def cast_like_from_pretrained(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast to `dtype` but keep `_keep_in_fp32_modules` (RoPE, time embedder, norms, modulation) in fp32,
    as `from_pretrained(torch_dtype=...)` does; `model.to(dtype)` would cast those too."""
    keep = set(model._keep_in_fp32_modules or ())
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point():
            tensor.data = tensor.data.to(torch.float32 if keep & set(name.split(".")) else dtype)


def build(setup: Setup):
    torch.manual_seed(setup.seed)
    dtype = getattr(torch, setup.dtype)
    with torch.device(setup.device):
        model = KreaRealtimeTransformer3DModel(**setup.model_config).eval().requires_grad_(False)
    cast_like_from_pretrained(model, dtype)
    tokens_per_frame = model.tokens_per_frame(*setup.latent_hw)
    layout = ChunkLayout(
        tokens_per_frame=tokens_per_frame,
        chunk_frames=3,
        sink_frames=3,
        window_frames=9,
        position_mode=setup.position_mode,
    )
    generator = torch.Generator(setup.device).manual_seed(setup.seed)
    text = torch.randn(
        1, setup.text_tokens, setup.model_config["text_dim"], generator=generator, device=setup.device
    ).to(dtype)
    return model, layout, text, dtype


class ChunkLoop:
    """The chunk loop of `KreaRealtimeVideoPipeline._generate_latents`, with the cache handling swappable."""

    def __init__(self, approach: str, setup: Setup):
        self.approach = approach
        self.model, self.layout, self.text, self.dtype = build(setup)
        self.device = setup.device
        self.sigmas = [sigma_for_step(step, SHIFT) for step in DENOISING_STEPS]
        self.noise = torch.Generator(setup.device).manual_seed(setup.seed + 1)
        channels = setup.model_config["in_channels"]
        self.chunk_shape = (1, channels, self.layout.chunk_frames, *setup.latent_hw)
        self.history = torch.zeros(*self.chunk_shape[:2], 0, *setup.latent_hw, dtype=self.dtype, device=self.device)
        self.frames_done = 0
        self.forward = self.model
        if approach in ("ours", "ours-compiled"):
            self.cache = self.model.make_cache(self.layout, 1, self.dtype, self.device)
            with torch.inference_mode():  # the text K/V, before the first step, as the pipeline does
                self.model.prepare_conditioning(self.cache, self.text)
            if approach == "ours-compiled":
                self.forward, self.counter, self.compile_mode = self._compile()
        elif approach == "growing":
            self.layout = dataclasses.replace(self.layout, position_mode="absolute")  # it has no window to re-index
            blocks = len(self.model.blocks)
            self.cache = RollingKVCache(
                [GrowingLayer() for _ in range(blocks)], [CrossAttentionLayer() for _ in range(blocks)]
            )
            with torch.inference_mode():
                self.model.prepare_conditioning(self.cache, self.text)
        elif approach in ("recompute-krea", "recompute-window"):
            self.cache = None  # built afresh every chunk
        else:
            raise ValueError(f"unknown approach {approach!r}")

    def _compile(self, fullgraph: bool = True):
        """`torch.compile` with a graph-counting eager backend (`CompileCounter`)."""
        from torch._dynamo.testing import CompileCounter

        torch._dynamo.reset()
        counter = CompileCounter()
        mode = "fullgraph=True" if fullgraph else "fullgraph=False"
        return torch.compile(self.model, backend=counter, fullgraph=fullgraph), counter, mode

    def _forward(self, latents: torch.Tensor, sigma: float, cache: RollingKVCache) -> torch.Tensor:
        timestep = torch.full((1,), sigma * 1000.0, device=self.device)
        try:
            return self.forward(latents, timestep, self.text, kv_cache=cache, layout=self.layout).sample
        except torch._dynamo.exc.Unsupported:
            # a graph break under fullgraph=True is raised while tracing, before the step runs (the cache is
            # untouched): fall back to fullgraph=False, where the breaks show in the graph count
            if self.approach != "ours-compiled" or self.compile_mode != "fullgraph=True":
                raise
            self.forward, self.counter, self.compile_mode = self._compile(fullgraph=False)
            return self.forward(latents, timestep, self.text, kv_cache=cache, layout=self.layout).sample

    def _context_frames(self) -> torch.Tensor:
        """Clean frames a recompute rebuilds its cache from, `(1, C, frames, h, w)`, oldest first."""
        done, chunk = self.frames_done, self.layout.chunk_frames
        if self.approach == "recompute-krea":  # first latent frame + the last 2
            frames = sorted({0, *range(max(0, done - 2), done)}) if done else []
        else:  # exactly what the rolling cache holds: sink + the recent window minus the chunk
            frames = [f for f in self.layout.visible_frames(done) if f < done]
        if len(frames) % chunk:
            raise ValueError(f"context of {len(frames)} frames is not whole chunks of {chunk}")
        return self.history[:, :, [self._history_index(f) for f in frames]]

    def _history_index(self, frame: int) -> int:
        """Index in `history` (sink frames, then the most recent ones) of latent frame `frame`."""
        kept_from = self.frames_done - (self.history.shape[2] - self.layout.sink_frames)
        return frame if frame < self.layout.sink_frames else self.layout.sink_frames + frame - kept_from

    def _remember(self, clean: torch.Tensor) -> None:
        """Keep the sink frames and the recent window of clean latents (bounded, like Krea's frame buffer)."""
        sink, recent = self.layout.sink_frames, self.layout.window_frames - self.layout.chunk_frames
        joined = torch.cat([self.history, clean], dim=2)
        if joined.shape[2] > sink + recent:
            joined = torch.cat([joined[:, :, :sink], joined[:, :, -recent:]], dim=2)
        self.history = joined

    @torch.inference_mode()
    def chunk(self) -> torch.Tensor:
        """Generate one chunk; returns its clean latents `(1, C, chunk_frames, h, w)`."""
        cache = self.cache
        if cache is None:  # Krea's server loop: rebuild the cache from clean frames at t = 0
            cache = self.model.make_cache(self.layout, 1, self.dtype, self.device)
            self.model.prepare_conditioning(cache, self.text)
            context = self._context_frames()
            for start in range(0, context.shape[2], self.layout.chunk_frames):
                self._forward(context[:, :, start : start + self.layout.chunk_frames], 0.0, cache)
                cache.commit()
        noisy = torch.randn(self.chunk_shape, generator=self.noise, device=self.device).to(self.dtype)
        for i, sigma in enumerate(self.sigmas):
            velocity = self._forward(noisy, sigma, cache)
            clean = predict_clean(noisy.float(), velocity.float(), sigma).to(self.dtype)
            if i + 1 < len(self.sigmas):
                noise = torch.randn(self.chunk_shape, generator=self.noise, device=self.device)
                noisy = add_noise(clean.float(), noise, self.sigmas[i + 1]).to(self.dtype)
        if self.cache is not None:  # the context pass: write the clean chunk's K/V, then advance
            self._forward(clean, 0.0, cache)
            cache.commit()
        else:
            self._remember(clean)
        self.frames_done += self.layout.chunk_frames
        self.last_cache_bytes = cache.memory_bytes()
        return clean


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_approach(approach: str, setup: Setup) -> Result:
    """Run the chunk loop for `approach` in this process; meant to be called in a fresh spawned process."""
    torch.set_num_threads(setup.threads)
    loop = ChunkLoop(approach, setup)
    result = Result(approach)
    chunks = setup.chunks
    if approach == "growing":  # absolute positions: stop before the RoPE table ends
        limit = setup.model_config["rope_max_seq_len"] // loop.layout.chunk_frames
        if chunks > limit:
            chunks, result.stopped = limit, f"RoPE table ({limit} chunks)"
    measure_from = time.perf_counter()
    for index in range(chunks):
        synchronize(setup.device)
        start = time.perf_counter()
        clean = loop.chunk()
        synchronize(setup.device)
        result.chunk_ms.append((time.perf_counter() - start) * 1000.0)
        if index < CHECKED_CHUNKS:
            result.first_chunks.append(clean.float().cpu())
        if index + 1 == setup.warmup:
            result.peak_rss_mib = (peak_rss_mib(), 0.0)
            result.cache_mib = (loop.last_cache_bytes / MiB, 0.0)
            measure_from = time.perf_counter()
        measured = index + 1 - setup.warmup
        over_budget = time.perf_counter() - measure_from > setup.baseline_budget_s
        if not approach.startswith("ours") and measured >= 2 * SAMPLE and over_budget and index + 1 < chunks:
            result.stopped = f"time budget ({setup.baseline_budget_s:.0f} s)"
            break
    result.peak_rss_mib = (result.peak_rss_mib[0], peak_rss_mib())
    result.cache_mib = (result.cache_mib[0], loop.last_cache_bytes / MiB)
    if setup.device.startswith("cuda"):
        result.device_peak_mib = torch.cuda.max_memory_allocated() / MiB
    if approach == "ours-compiled":
        result.graphs, result.compile_mode = loop.counter.frame_count, loop.compile_mode
    return result


def run_in_fresh_process(approach: str, setup: Setup) -> Result:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(run_approach, (approach, setup))


# ----------------------------------------------------------------------------------------- report
def sample_size(measured: int) -> int:
    """Chunks per median: 50-chunk windows once 100 are measured (10-chunk medians are too noisy on a shared
    machine), else 10."""
    return 50 if measured >= 100 else SAMPLE


def first_last(result: Result, warmup: int) -> tuple[float, float]:
    measured = result.chunk_ms[warmup:]
    sample = sample_size(len(measured))
    return statistics.median(measured[:sample]), statistics.median(measured[-sample:])


NAMES = {
    "ours": "rolling cache (ours)",
    "ours-compiled": "rolling cache (ours), torch.compile (eager backend)",
    "growing": "no eviction (growing cache)",
    "recompute-krea": "recompute every chunk, Krea context (1 + 2 frames)",
    "recompute-window": "recompute every chunk, our context (sink + window)",
}


def check_agreement(results: dict[str, Result]) -> tuple[float, list[str]]:
    """Clean latents that must equal ours: every approach's until eviction starts (same frames at the same
    positions), Krea's context only for 2 chunks (then it drops frames). Afterwards they differ by design:
    a recompute rebuilds each context frame's K/V seeing only the context, ours kept what it saw then."""
    worst, problems = 0.0, []
    reference = results["ours"].first_chunks
    for approach, result in results.items():
        agree_until = {"recompute-krea": 2, "ours": 0}.get(approach, CHECKED_CHUNKS)
        for index in range(min(agree_until, len(result.first_chunks))):
            error = (result.first_chunks[index] - reference[index]).abs().max().item()
            worst = max(worst, error)
            if error > 1e-3:
                problems.append(f"{approach} chunk {index}: max |diff| vs ours {error:.2e}")
    return worst, problems


def print_table(results: dict[str, Result], setup: Setup) -> None:
    print(
        "| approach | chunks | first-window ms/chunk | last-window ms/chunk | last/first "
        "| peak RSS MiB start -> end | cache MiB start -> end | compiled graphs |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for approach, result in results.items():
        first, last = first_last(result, setup.warmup)
        chunks = f"{len(result.chunk_ms)}" + (f" (stopped: {result.stopped})" if result.stopped else "")
        rss, cache = result.peak_rss_mib, result.cache_mib
        print(
            f"| {NAMES[approach]} | {chunks} | {first:.1f} | {last:.1f} | {last / first:.2f} "
            f"| {rss[0]:.0f} -> {rss[1]:.0f} | {cache[0]:.2f} -> {cache[1]:.2f} "
            f"| {f'{result.graphs} ({result.compile_mode})' if result.graphs is not None else '-'} |"
        )


def check_length(setup: Setup) -> None:
    """Enough chunks for two medians; absolute positions must stay inside the RoPE table."""
    if setup.chunks < setup.warmup + 2 * SAMPLE:
        raise SystemExit(
            f"--chunks must be >= --warmup + {2 * SAMPLE} = {setup.warmup + 2 * SAMPLE}, got {setup.chunks}."
        )
    frames, table = 3 * setup.chunks, setup.model_config["rope_max_seq_len"]
    if setup.position_mode == "absolute" and frames > table:
        raise SystemExit(
            f"--chunks {setup.chunks} is {frames} latent frames, past the {table}-frame RoPE table in "
            "--position-mode absolute; use --position-mode relative (the growing baseline stops at the table)."
        )


def cpu_main(args: argparse.Namespace) -> int:
    setup = Setup(
        model_config=CPU_MODEL,
        latent_hw=CPU_LATENT,
        text_tokens=CPU_TEXT_TOKENS,
        chunks=args.chunks,
        warmup=args.warmup,
        threads=args.threads,
        position_mode=args.position_mode,
        baseline_budget_s=args.baseline_budget_s,
    )
    check_length(setup)
    config = setup.model_config
    print(
        f"CPU, fp32, torch.set_num_threads({setup.threads}); model: {config['num_layers']} layers, "
        f"{config['num_attention_heads']} heads x {config['attention_head_dim']}, ffn {config['ffn_dim']}; "
        f"latent {setup.latent_hw[0]}x{setup.latent_hw[1]} -> {setup.latent_hw[0] * setup.latent_hw[1] // 4} "
        f"tokens/frame; chunk 3, sink 3, window 9 latent frames; {len(DENOISING_STEPS)} steps + 1 context pass; "
        f"{setup.chunks} chunks, {setup.warmup} warm-up; position_mode={setup.position_mode!r} (ours); "
        f"baselines stop after {setup.baseline_budget_s:.0f} s of measured chunks."
    )
    results = {}
    for approach in args.approaches:
        began = time.perf_counter()
        results[approach] = run_in_fresh_process(approach, setup)
        print(
            f"  {approach}: {len(results[approach].chunk_ms)} chunks in {time.perf_counter() - began:.1f} s",
            flush=True,
        )
    worst, problems = check_agreement(results) if "ours" in results else (0.0, [])
    for problem in problems:
        print(f"MISMATCH {problem}")
    if "ours" in results and not problems:
        print(f"  clean latents agree with ours where they must (max |diff| {worst:.1e})")
    print()
    print_table(results, setup)
    print()
    for approach in ("ours", "ours-compiled"):
        if approach in results:
            first, last = first_last(results[approach], setup.warmup)
            verdict = "flat" if last / first <= 1.05 else "NOT flat"
            print(f"{NAMES[approach]}: last/first = {last / first:.3f} ({verdict}; bound 1.05)")
    return 1 if problems else 0


# ----------------------------------------------------------------------------------------- GPU
def gpu_main(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA device, and torch.cuda.is_available() is False here.")
    setup = Setup(
        model_config=WAN_1_3B,
        latent_hw=WAN_LATENT,
        text_tokens=WAN_TEXT_TOKENS,
        chunks=args.chunks,
        warmup=args.warmup,
        threads=args.threads,
        device="cuda",
        dtype="bfloat16",
        position_mode=args.position_mode,
    )
    check_length(setup)
    print(
        f"{torch.cuda.get_device_name()}, bf16; Wan 2.1 1.3B shapes (30 layers, 12 heads x 128, ffn 8960), "
        f"480x832 -> 60x104 latent, 1560 tokens/frame; chunk 3, sink 3, window 9; {len(DENOISING_STEPS)} steps "
        f"+ 1 context pass; {setup.chunks} chunks, {setup.warmup} warm-up; position_mode={setup.position_mode!r}; "
        "random weights."
    )
    result = run_approach("ours", setup)
    first, last = first_last(result, setup.warmup)
    median_ms = statistics.median(result.chunk_ms[setup.warmup :])
    pixel_frames = 3 * 4  # 4 pixel frames per latent frame
    fps = pixel_frames / (median_ms / 1000.0)
    print()
    print(
        "| approach | chunks | first-chunk ms | last-chunk ms | last/first | FPS (median chunk) | cache MiB | peak GPU MiB |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(
        f"| {NAMES['ours']} | {len(result.chunk_ms)} | {first:.1f} | {last:.1f} | {last / first:.2f} | {fps:.1f} "
        f"| {result.cache_mib[1]:.0f} | {result.device_peak_mib:.0f} |"
    )
    print(
        f"\nSelf-Forcing 1.3B, published: ~{SELF_FORCING_FPS_H100:.0f} FPS on an H100 (not measured here); "
        f"ours: {fps:.1f} FPS = {fps / SELF_FORCING_FPS_H100:.2f}x on {torch.cuda.get_device_name()} "
        "(no torch.compile, no CFG, transformer only: no VAE decode)."
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=200, help="chunks of 3 latent frames (default 200)")
    parser.add_argument("--warmup", type=int, default=5, help="chunks not measured (default 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in each worker (default 1)")
    parser.add_argument(
        "--baseline-budget-s", type=float, default=90.0, help="seconds of measured chunks per baseline (default 90)"
    )
    parser.add_argument(
        "--approaches", nargs="+", default=list(NAMES), choices=list(NAMES), help="which approaches to run"
    )
    parser.add_argument(
        "--position-mode",
        default="absolute",
        choices=["absolute", "relative"],
        help="ours: keys after RoPE at absolute positions (the pipeline's default; <= 341 chunks) or re-indexed",
    )
    parser.add_argument("--gpu", action="store_true", help="Wan 1.3B shapes, bf16 on CUDA, rolling cache FPS only")
    args = parser.parse_args(argv)
    return gpu_main(args) if args.gpu else cpu_main(args)


if __name__ == "__main__":
    sys.exit(main())

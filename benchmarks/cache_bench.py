"""Rolling self-attention cache: rolldiff's `SlidingWindowLayer` against the eviction schemes in use today.

Every approach runs the causal-video chunk loop (sink + sliding window counting the pending chunk, as
Self-Forcing's `local_attn_size`) on the same random K/V, in one process, in this run:
  ours        `SlidingWindowLayer`: ring buffer written in place with `index_copy_`, read through a mask.
  ours, compiled  the same update under `torch.compile(fullgraph=True)` with a graph-counting eager backend
              (`CompileCounter`; dynamo only, so it shows breaks and recompiles, not kernel speed); the
              count is every graph built over the whole run, warm-up included. Its allocations are
              counted on the same ops run eagerly (dynamo does not trace under a dispatch mode).
  shift-clone Self-Forcing / LongLive / Krea: when full, shift the window left with
              `cache[:, sink:sink+kept] = cache[:, sink+evicted:...].clone()`, then write at the end.
  cat         per-step `torch.cat([window, chunk])` for attention; on commit, cat sink + recent tokens.
  roll        transformers' static sliding layer: `torch.roll` the window part of the buffer, copy it
              back, then write at the end.
Baselines evict once per chunk (at its first pass), as Self-Forcing does; later passes overwrite.

Per chunk: `--steps` denoising passes + 1 context pass (all call `update`), then `commit()`.
Columns (steady state: measured after warm-up chunks that fill sink + window and start evicting):
  update ms/step           median over the measured chunks of (chunk wall time / passes per chunk);
                           the chunk time includes its commit and eviction, so a once-per-chunk
                           shift/roll/cat is amortised over the passes instead of hidden by a median.
  update + attention       the same with SDPA after each update: ours over the whole buffer with
                           `attention_mask`, the baselines over their contiguous window.
  allocated MiB/step       bytes of new tensor storage created by ATen ops during one chunk's updates
                           and commit, divided by the passes. Counted with a `TorchDispatchMode`: an op
                           output whose storage none of the op's inputs owns is a new allocation (views
                           and in-place / `out=` writes count 0). Scratch memory inside a single kernel
                           is invisible to it; the cache ops here have none of size. Attention is not counted.
  cache MiB                bytes of the distinct tensor storages the cache object holds mid-chunk
                           (for `cat`, the committed window plus the step's concatenation).
All approaches' attention outputs are checked against ours before the table is printed. Approaches run
interleaved chunk by chunk, so background load on a shared machine falls on all of them alike.

Defaults are Wan 2.1 1.3B per-head sizes (12 heads x 128, fp32) with 156 tokens per frame (Wan's 1560
at 480x832, divided by 10: SDPA over 15 frames x 1560 tokens takes ~10 s per step on 2 CPU cores).
`--tokens-per-frame 1560 --no-attention` measures the cache alone at the real frame size.

    python benchmarks/cache_bench.py [--tokens-per-frame 156] [--no-attention] ...
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from rolldiff.caching import SlidingWindowLayer

MiB = 2**20


# ----------------------------------------------------------------------------------------- the four caches
class Ours:
    name = "ours: SlidingWindowLayer (ring + mask)"

    def __init__(self, sink_tokens: int, window_tokens: int, chunk_tokens: int):
        self.layer = SlidingWindowLayer(sink_tokens, window_tokens, chunk_tokens)

    def update(self, key, value):
        keys, values = self.layer.update(key, value)
        return keys, values, self.layer.attention_mask[None]  # (1, capacity) broadcasts over (B, H, L, S)

    def commit(self):
        self.layer.commit()

    def held(self):
        return [*self.layer.buffers(), *vars(self.layer).values(), *self.layer._tensors()]


class OursCompiled(Ours):
    name = "ours, torch.compile (eager backend)"

    def __init__(self, sink_tokens: int, window_tokens: int, chunk_tokens: int):
        from torch._dynamo.testing import CompileCounter

        super().__init__(sink_tokens, window_tokens, chunk_tokens)
        self.counter = CompileCounter()
        self._update = torch.compile(self._eager_update, backend=self.counter, fullgraph=True)

    def _eager_update(self, key, value):
        keys, values = self.layer.update(key, value)
        return keys, values, self.layer.attention_mask[None]

    def update(self, key, value):
        return self._update(key, value)

    def uncompiled(self) -> None:
        """Run the update eagerly from now on (for the allocation counter, a dispatch mode dynamo skips)."""
        self._update = self._eager_update

    def graphs(self) -> int:
        return self.counter.frame_count


class ShiftClone:
    name = "shift-clone (Self-Forcing/LongLive/Krea)"

    def __init__(self, sink_tokens: int, window_tokens: int, chunk_tokens: int):
        self.sink, self.capacity = sink_tokens, sink_tokens + window_tokens
        self.keys = self.values = None
        self.end = 0  # committed tokens held in the buffer
        self.pending = 0

    def update(self, key, value):
        num_new = key.shape[1]
        if self.keys is None:
            batch, _, heads, head_dim = key.shape
            self.keys = torch.zeros(batch, self.capacity, heads, head_dim, dtype=key.dtype)
            self.values = torch.zeros_like(self.keys)
        if self.pending == 0 and self.end + num_new > self.capacity:  # first pass of a chunk: evict
            evicted = self.end + num_new - self.capacity
            self.evict(evicted)
            self.end -= evicted
        self.keys[:, self.end : self.end + num_new] = key
        self.values[:, self.end : self.end + num_new] = value
        self.pending = num_new
        return self.keys[:, : self.end + num_new], self.values[:, : self.end + num_new], None

    def evict(self, evicted: int) -> None:
        kept, start = self.end - self.sink - evicted, self.sink + evicted
        for cache in (self.keys, self.values):
            cache[:, self.sink : self.sink + kept] = cache[:, start : start + kept].clone()

    def commit(self):
        self.end += self.pending
        self.pending = 0

    def held(self):
        return vars(self).values()


class Roll(ShiftClone):
    name = "roll + copy (transformers static sliding)"

    def evict(self, evicted: int) -> None:
        for cache in (self.keys, self.values):
            window = cache[:, self.sink :]
            window.copy_(torch.roll(window, -evicted, dims=1))


class Cat:
    name = "cat per step (then slice)"

    def __init__(self, sink_tokens: int, window_tokens: int, chunk_tokens: int):
        self.sink, self.recent = sink_tokens, window_tokens - chunk_tokens
        self.keys = self.values = None  # committed sink + recent tokens
        self.pending = None

    def update(self, key, value):
        if self.keys is None:
            self.keys, self.values = key[:, :0], value[:, :0]
        self.pending = (torch.cat([self.keys, key], dim=1), torch.cat([self.values, value], dim=1))
        return (*self.pending, None)

    def commit(self):
        keys, values = self.pending
        if keys.shape[1] > self.sink + self.recent:
            recent = slice(keys.shape[1] - self.recent, None)
            keys = torch.cat([keys[:, : self.sink], keys[:, recent]], dim=1)
            values = torch.cat([values[:, : self.sink], values[:, recent]], dim=1)
        self.keys, self.values, self.pending = keys, values, None

    def held(self):
        return [self.keys, self.values, *(self.pending or ())]


class OursQuantized(Ours):
    name = "ours, int8 K/V (quantization='int8')"
    quantization, offload = "int8", False
    tolerance = 0.1  # attention error vs the exact caches (the tests state the bound: <= 0.03 at unit variance)

    def __init__(self, sink_tokens: int, window_tokens: int, chunk_tokens: int):
        options = dict(quantization=self.quantization, offload=self.offload)
        self.layer = SlidingWindowLayer(sink_tokens, window_tokens, chunk_tokens, **options)

    def held(self):
        """The layer's own storage; the dequantization / offload scratch is one per cache (see the note)."""
        return self.layer._tensors()


class OursFp8(OursQuantized):
    name = "ours, fp8 K/V (quantization='fp8')"
    quantization, tolerance = "fp8", 0.5


class OursOffloaded(OursQuantized):
    name = "ours, offloaded (offload=True)"
    quantization, offload, tolerance = None, True, 1e-4


APPROACHES = [Ours, OursCompiled, ShiftClone, Cat, Roll, OursQuantized, OursFp8, OursOffloaded]


# ----------------------------------------------------------------------------------------- measurement
class AllocationCounter(TorchDispatchMode):
    """Sums the storage bytes of op outputs that none of the op's inputs owns (new allocations)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = tree_flatten((args, kwargs))[0]
        owned = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in owned:
                owned.add(tensor.untyped_storage().data_ptr())
                self.bytes += tensor.untyped_storage().nbytes()
        return out


def held_bytes(cache) -> int:
    storages = {}
    for item in cache.held():
        if isinstance(item, torch.Tensor):
            storages[item.untyped_storage().data_ptr()] = item.untyped_storage().nbytes()
    return sum(storages.values())


def attend(query, keys, values, mask):
    """SDPA on `(batch, tokens, heads, head_dim)` tensors."""
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask
    )
    return out.transpose(1, 2)  # (B, T, H, D)


def chunk_inputs(args, chunk_index: int) -> list[tuple[torch.Tensor, ...]]:
    """(query, key, value) for each pass of a chunk, `(1, chunk_tokens, heads, head_dim)`; same for every approach."""
    generator = torch.Generator().manual_seed(args.seed * 100_003 + chunk_index)
    shape = (1, args.chunk_frames * args.tokens_per_frame, args.heads, args.head_dim)
    return [
        tuple(torch.randn(shape, generator=generator, dtype=args.dtype) for _ in range(3))
        for _ in range(args.steps + 1)
    ]


def run_chunk(cache, inputs, with_attention: bool):
    out = None
    for query, key, value in inputs:
        keys, values, mask = cache.update(key, value)
        if with_attention:
            out = attend(query, keys, values, mask)
    cache.commit()
    return out


def measure(args, sizes, warmup_chunks: int) -> dict[str, dict]:
    """Time every approach chunk by chunk, interleaved, so load on a shared machine hits them alike."""
    results = {approach.name: {} for approach in APPROACHES}
    passes = args.steps + 1
    for with_attention in [False, True] if args.attention else [False]:
        caches = [approach(*sizes) for approach in APPROACHES]
        for index in range(warmup_chunks):
            inputs = chunk_inputs(args, index)
            for cache in caches:
                run_chunk(cache, inputs, with_attention and index == warmup_chunks - 1)
        seconds = {cache.name: [] for cache in caches}
        for index in range(warmup_chunks, warmup_chunks + args.chunks):
            inputs = chunk_inputs(args, index)
            for cache in caches:
                start = time.perf_counter()
                out = run_chunk(cache, inputs, with_attention)
                seconds[cache.name].append((time.perf_counter() - start) / passes)
                if with_attention:
                    results[cache.name]["output"] = out
        for name, times in seconds.items():
            results[name]["attention" if with_attention else "update"] = statistics.median(times) * 1e3
        for cache in caches:
            if hasattr(cache, "graphs"):
                results[cache.name]["graphs"] = max(results[cache.name].get("graphs", 0), cache.graphs())
    # allocations and resident memory, on fresh streams, in steady state
    for approach in APPROACHES:
        cache = approach(*sizes)
        for index in range(warmup_chunks):
            run_chunk(cache, chunk_inputs(args, index), False)
        inputs = chunk_inputs(args, warmup_chunks)
        if hasattr(cache, "uncompiled"):
            cache.uncompiled()
        with AllocationCounter() as counter:
            for _, key, value in inputs:
                cache.update(key, value)
            results[approach.name]["memory"] = held_bytes(cache) / MiB  # mid-chunk: pending written
            cache.commit()
        results[approach.name]["allocated"] = counter.bytes / passes / MiB
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens-per-frame", type=int, default=156)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--sink-frames", type=int, default=3)
    parser.add_argument("--window-frames", type=int, default=12, help="counts the pending chunk")
    parser.add_argument("--chunk-frames", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per chunk (plus one context pass)")
    parser.add_argument("--chunks", type=int, default=8, help="measured chunks after warm-up")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--no-attention", dest="attention", action="store_false", help="time the cache alone")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.dtype = getattr(torch, args.dtype)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    tokens = args.tokens_per_frame
    sizes = (args.sink_frames * tokens, args.window_frames * tokens, args.chunk_frames * tokens)
    # fill sink + window, then evict for two more chunks before measuring
    warmup_chunks = -(-(args.sink_frames + args.window_frames) // args.chunk_frames) + 2
    results = measure(args, sizes, warmup_chunks)

    if args.attention:  # the four caches must agree on what attention sees
        reference = results[Ours.name]["output"]
        tolerance = {approach.name: getattr(approach, "tolerance", 1e-4) for approach in APPROACHES}
        for name, result in results.items():
            error = (result["output"] - reference).abs().max().item()
            assert error < tolerance[name], f"{name} attention differs from ours by {error}"

    print(
        f"Shapes: batch 1, {args.heads} heads x {args.head_dim}, {str(args.dtype).removeprefix('torch.')}, "
        f"{tokens} tokens/frame; sink {args.sink_frames} + window {args.window_frames} frames "
        f"({sizes[0]} + {sizes[1]} tokens), chunk {args.chunk_frames} frames ({sizes[2]} tokens); "
        f"{args.steps} denoising steps + 1 context pass per chunk; {warmup_chunks} warm-up chunks, "
        f"median over {args.chunks} chunks; torch {torch.__version__}, {torch.get_num_threads()} CPU threads."
    )
    print()
    print("| cache | update ms/step | update + attention ms/step | allocated MiB/step | cache MiB | compiled graphs |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, result in results.items():
        attention = f"{result['attention']:.2f}" if args.attention else "-"
        graphs = result.get("graphs", "-")
        print(
            f"| {name} | {result['update']:.2f} | {attention} | {result['allocated']:.2f} | {result['memory']:.1f} "
            f"| {graphs} |"
        )
    scratch = {cls.name: cls(*sizes) for cls in (OursQuantized, OursOffloaded)}
    for name, cache in scratch.items():
        run_chunk(cache, chunk_inputs(args, 0), False)
        print(
            f"\n{name}: + {cache.layer.workspace.memory_bytes() / MiB:.1f} MiB of scratch held once per cache (shared by "
            "all its blocks; an offloaded cache keeps two blocks' K/V on the device, the rest in CPU memory)."
        )


if __name__ == "__main__":
    main()

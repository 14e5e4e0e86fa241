"""One live copy: memory across a 100-chunk stream of the embedded default pipeline, with and without CFG.

At every chunk boundary it counts, in this run: the bytes of every live tensor storage in the process
(`gc`, distinct storages, weights included), how many of them have the size of one cache layer's K (or
V) buffer beyond those that existed before the stream (the cache copies: K and V per block per
guidance branch), the resident memory and the process peak. Flat columns mean nothing of an old chunk
(latents, frames, embeddings, a second cache) survives into the next.

    python benchmarks/live_memory.py [--chunks 100] [--every 10]

Measured (CPU, 1 thread, 2-core machine shared with other jobs): flat over 100 chunks: live tensors 9.83 MiB and
8 cache K/V buffers without CFG, 10.72 MiB and 16 buffers with CFG, peak RSS 435-436 MiB.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
from _common import markdown_table, peak_rss_mib, rss_mib

from rolldiff import KreaRealtimeVideoPipeline
from rolldiff.defaults import default_model_path

MiB = 2**20
PROMPT = "a red circle moving left"


def live_storages() -> dict[int, int]:
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and not obj.is_meta:  # real tensors, not fakes
            storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    return storages


def run(pipe, chunks: int, every: int, guidance_scale: float) -> list[dict]:
    chunk_frames = pipe.config.chunk_frames
    num_frames = pipe.valid_num_frames(chunks * chunk_frames * pipe.vae_scale_factor_temporal)[1]
    rows, before = [], live_storages()
    began = time.perf_counter()
    stream = pipe.stream(
        PROMPT, num_frames=num_frames, guidance_scale=guidance_scale, negative_prompt="moving up",
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    for index, _frames in enumerate(stream, start=1):
        if index == 1 or index % every == 0:
            storages = live_storages()
            layer_bytes = stream.caches[0][0].keys.untyped_storage().nbytes()
            copies = sum(n == layer_bytes for p, n in storages.items() if p not in before)
            rows.append(
                {
                    "CFG": "yes" if guidance_scale > 1 else "no",
                    "chunk": index,
                    "live tensor MiB": f"{sum(storages.values()) / MiB:.2f}",
                    "cache K/V buffers": copies,
                    "cache MiB": f"{sum(c.memory_bytes() for c in stream.caches) / MiB:.2f}",
                    "RSS MiB": f"{rss_mib():.0f}",
                    "peak RSS MiB": f"{peak_rss_mib():.0f}",
                    "s": f"{time.perf_counter() - began:.1f}",
                }
            )
            print(rows[-1], flush=True)
        if index >= chunks:
            break
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=100)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pipe = KreaRealtimeVideoPipeline.from_pretrained(default_model_path())
    pipe.set_progress_bar_config(disable=True)
    rows = run(pipe, args.chunks, args.every, 1.0) + run(pipe, args.chunks, args.every, 3.0)
    print(markdown_table(list(rows[0]), [list(row.values()) for row in rows]))


if __name__ == "__main__":
    main()

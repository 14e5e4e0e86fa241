"""Moving an offloaded layer's K/V between its home (CPU memory, pinned when CUDA is present) and the GPU.

An offloaded layer keeps only committed tokens at home. When its block runs, `fetch` copies the
home rows into a device work buffer shared with every other offloaded layer of the cache (two work
buffers, alternating by block, so block i+1 can be `prefetch`ed on a side stream while block i
computes); the pending chunk is written into the work buffer and staged to host memory without
blocking, and `commit` writes the staged chunk home. Home therefore only ever changes at a commit,
which is what makes prefetching safe and keeps a chunk a transaction.
"""

from __future__ import annotations

import torch

from .quantization import as_bits


def copy_rows(work: dict[str, torch.Tensor], home: dict[str, torch.Tensor], batch: int, non_blocking: bool) -> None:
    """Copy the first `batch` rows of every home tensor into its work view."""
    for name, target in work.items():
        target.copy_(home[name][:batch], non_blocking=non_blocking)


def prefetch(work: dict[str, torch.Tensor], home: dict[str, torch.Tensor], batch: int, stream) -> torch.cuda.Event:
    """Start `copy_rows` on `stream` after the work queued so far (which may still read the work buffer)."""
    device = next(iter(work.values())).device
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        copy_rows(work, home, batch, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return event


def write_home(home: dict[str, torch.Tensor], staged: dict[str, torch.Tensor], slots: torch.Tensor) -> None:
    """Write the staged chunk (`(batch, tokens, heads, ·)` per tensor) into the home slots `slots`."""
    for name, chunk in staged.items():
        as_bits(home[name][: chunk.shape[0]]).index_copy_(1, slots, as_bits(chunk))

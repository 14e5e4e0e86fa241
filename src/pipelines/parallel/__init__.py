"""Pipeline parallelism for ONE stream: the transformer's blocks split into contiguous stages, one process each.

`pipe.stream(..., devices=["cpu", "cpu"])` (or `["cuda:0", "cuda:1", ...]`) runs stage 0 in the calling process
and spawns a worker per other stage (`launch.py`); every rank runs the same chunk loop (`parallel_stream.py`), and
only the hidden states cross between stages (`link.py`), each stage holding its blocks' weights and cache layers
only (`stages.py`). Under `denoising="stream_batch"` each forward's rows travel through the stages several at once
(`inflight_batch.py`), so more devices give more speed. Which blocks go where and which calls are refused:
`plan.py`. docs/pipeline_parallel.md.

This package's `__init__` imports only the plan: the request builder reads it, and the launcher imports the
builder, so the launcher is imported where a split stream starts.
"""

from .plan import check_devices, split_blocks

__all__ = ["check_devices", "split_blocks"]

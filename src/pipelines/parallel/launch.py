"""Starting and ending the other ranks of a split stream from one Python process.

`pipe.stream(..., devices=[d0, ..., dN-1])` runs stage 0 here and spawns N - 1 worker processes (torch
multiprocessing's "spawn": a fresh interpreter each, so no CUDA state or thread is inherited). Each worker loads the
same pipeline (`pipe.name_or_path`, or a temporary `save_pretrained` folder for a pipeline made in memory), proves
its stage's weights are the caller's (`stage_checksums`), builds its stage, reports ready on a queue, and joins the
process group (gloo on CPU, NCCL on CUDA) on 127.0.0.1 at a free port. It then runs the same chunk loop as a
follower until the leader stops it or the video ends.

A script needs no `if __name__ == "__main__":` guard around its stream: a spawned process runs the caller's script
again (as `__mp_main__`) before its target, so the script's name is hidden from "spawn" while the workers start
(`_script_not_rerun`); workers need nothing of it, unless the spec refers to something defined there (a pipeline
class written in the script), and then the usual rule holds and the start error says so.

Nothing is left behind: a worker that fails to start reports its error (raised here, naming its rank); when the
stream closes, fails or is interrupted (KeyboardInterrupt included) the workers are joined, and terminated then
killed if they do not end in time; a stream dropped without `close()` ends them when it is collected.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import pickle
import queue
import shutil
import socket
import sys
import tempfile
import traceback
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..request.builder import build_request
from ..request.call import VideoCall
from .link import StageLink
from .parallel_stream import ParallelChunkStream
from .plan import backend_for, split_blocks
from .stages import stage_checksums, stage_pipeline, stage_transformer

MAIN_GUARD_HINT = (
    "; the stream's arguments refer to the script that runs it (`__main__`), so each worker runs that script again: "
    'start the stream under `if __name__ == "__main__":`'
)
START_TIMEOUT_S = 600.0  # loading a large pipeline in every worker takes a while
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


class StageStartError(RuntimeError):
    """A worker process of a split stream could not start its stage."""


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to rebuild the leader's stream: where the pipeline is, the call, the split."""

    pipeline_class: type
    source: str
    dtype: torch.dtype
    call: VideoCall
    generator_states: list[torch.Tensor]
    devices: tuple[str, ...]
    port: int
    checksums: list[float]
    threads: int


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _follower_call(call: VideoCall, request: Any) -> VideoCall:
    """The leader's call for a follower: no devices (it is a stage), no decode unless the loop needs pixels."""
    output_type = call.output_type if request.reencodes else "latent"
    return call.replace(devices=None, generator=None, output_type=output_type, overlap_decode=False)


def _generators(states: list[torch.Tensor], device: torch.device) -> torch.Generator | list[torch.Generator]:
    generators = []
    for state in states:
        generator = torch.Generator(device)
        generator.set_state(state)
        generators.append(generator)
    return generators[0] if len(generators) == 1 else generators


def _join_group(rank: int, devices: tuple[str, ...], port: int) -> None:
    dist.init_process_group(
        backend_for(devices),
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=len(devices),
        timeout=COLLECTIVE_TIMEOUT,
    )


def _end_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------- worker side
def _follower_stream(rank: int, spec: WorkerSpec) -> ParallelChunkStream:
    device = torch.device(spec.devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    pipe = spec.pipeline_class.from_pretrained(spec.source, dtype=spec.dtype)
    pipe.set_progress_bar_config(disable=True)
    stages = split_blocks(len(pipe.transformer.blocks), len(spec.devices))
    if abs(stage_checksums(pipe.transformer, stages)[rank] - spec.checksums[rank]) > 1e-6 * (
        1.0 + abs(spec.checksums[rank])
    ):
        raise StageStartError(
            f"The weights stage {rank} loaded from {spec.source!r} differ from the pipeline's in memory (changed "
            "after loading?); `save_pretrained` it and load it from that folder before passing `devices`."
        )
    link = StageLink(rank, len(spec.devices))
    staged = stage_pipeline(pipe, stage_transformer(pipe.transformer, stages[rank], link, device))
    del pipe  # the blocks of the other stages go with it
    staged.to(device)
    call = spec.call.replace(generator=_generators(spec.generator_states, device) if spec.generator_states else None)
    request = build_request(staged, call)
    return ParallelChunkStream(staged, request, stages, lambda stream: link, lambda failed: None)


def worker_main(rank: int, spec: WorkerSpec, reports: Any) -> None:
    """A worker process: build stage `rank`, report, join the group, follow the leader's loop to its end."""
    torch.set_num_threads(spec.threads)
    try:
        stream = _follower_stream(rank, spec)
    except BaseException:
        reports.put((rank, traceback.format_exc()))
        return
    reports.put((rank, None))
    _join_group(rank, spec.devices, spec.port)
    try:
        for _ in stream:
            pass
    finally:
        stream.close()
        _end_group()


# ---------------------------------------------------------------------------------------- leader side
@contextlib.contextmanager
def _script_not_rerun(spec: WorkerSpec):
    """While the workers start: `__main__` without its script's name (`__file__`, `__spec__`), so "spawn" does not run
    the script in each of them, unless `spec` pickles something of `__main__`. Yields whether it was hidden."""
    main = sys.modules["__main__"]
    names = {name: getattr(main, name) for name in ("__file__", "__spec__") if getattr(main, name, None) is not None}
    if not names or b"__main__" in pickle.dumps(spec):
        yield not names
        return
    main.__spec__ = None
    vars(main).pop("__file__", None)
    try:
        yield True
    finally:
        for name, value in names.items():
            setattr(main, name, value)


class Workers:
    """The worker processes of one split stream, ended with it (or when it is collected)."""

    def __init__(self, processes: list[Any], folder: str | None) -> None:
        self.processes, self.folder = processes, folder
        self.hint = ""  # said when a worker dies before it reports

    def wait_ready(self, reports: Any) -> None:
        ready = 0
        while ready < len(self.processes):
            try:
                rank, error = reports.get(timeout=1.0)
            except queue.Empty:
                dead = [p.exitcode for p in self.processes if not p.is_alive() and p.exitcode not in (0, None)]
                if dead:
                    raise StageStartError(
                        f"A stage's worker process died while starting (exit codes {dead}){self.hint}."
                    ) from None
                continue
            if error is not None:
                raise StageStartError(f"Stage {rank} could not start:\n{error}")
            ready += 1

    def end(self, failed: bool, timeout_s: float = 60.0) -> None:
        for process in self.processes:
            process.join(timeout=1.0 if failed else timeout_s)
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout=5.0)
            if process.is_alive():
                process.kill()
                process.join()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


def _source(pipe: Any) -> tuple[str, str | None]:
    """Where workers load the pipeline from, and a temporary folder to remove afterwards (or None)."""
    source = pipe.name_or_path
    if source and (os.path.isdir(source) or not os.path.isabs(str(source))):
        return str(source), None
    folder = tempfile.mkdtemp(prefix="rolldiff-stages-")
    pipe.save_pretrained(folder)
    return folder, folder


class Leader:
    """Starts the other ranks at a stream's first chunk and ends them when it closes."""

    def __init__(self, pipe: Any, call: VideoCall, stages: list[range]) -> None:
        self.pipe, self.call, self.stages = pipe, call, stages
        self.workers: Workers | None = None
        self.link = StageLink(0, len(stages))

    def start(self, stream: ParallelChunkStream) -> StageLink:
        request = stream.request
        devices = request.devices
        states = [generator.get_state() for generator in stream.generators()]
        source, folder = _source(self.pipe)
        spec = WorkerSpec(
            pipeline_class=type(self.pipe),
            source=source,
            dtype=self.pipe.transformer.dtype,
            call=_follower_call(self.call, request),
            generator_states=states,
            devices=devices,
            port=_free_port(),
            checksums=stage_checksums(self.pipe.transformer, self.stages),
            threads=max(1, torch.get_num_threads() // len(devices)) if devices[0] == "cpu" else 1,
        )
        context = mp.get_context("spawn")
        reports = context.Queue()
        processes = [
            context.Process(target=worker_main, args=(rank, spec, reports), daemon=True)
            for rank in range(1, len(devices))
        ]
        self.workers = Workers(processes, folder)
        weakref.finalize(stream, self.workers.end, True)
        try:
            with _script_not_rerun(spec) as hidden:
                for process in processes:
                    process.start()
            self.workers.hint = "" if hidden else MAIN_GUARD_HINT
            self.workers.wait_ready(reports)
            _join_group(0, devices, spec.port)
        except BaseException:
            self.end(True)
            raise
        return self.link

    def end(self, failed: bool) -> None:
        if self.workers is not None:
            self.workers.end(failed)
        with contextlib.suppress(Exception):
            _end_group()


def parallel_stream(pipe: Any, call: VideoCall, request: Any) -> ParallelChunkStream:
    """Stage 0 of a stream split over `request.devices`, here; the other stages start at its first chunk."""
    stages = split_blocks(len(pipe.transformer.blocks), len(request.devices))
    leader = Leader(pipe, call, stages)
    device = torch.device(request.devices[0])
    staged = stage_pipeline(pipe, stage_transformer(pipe.transformer, stages[0], leader.link, device))
    return ParallelChunkStream(staged, request, stages, leader.start, leader.end)

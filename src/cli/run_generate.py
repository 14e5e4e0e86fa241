"""`rolldiff generate`: a video written to an mp4 as it is made, chunk by chunk, so memory stays that of one chunk
however long the video. Every flag is checked before the model loads (the library's own checks, their messages
shown with the flags' names); Ctrl-C or SIGTERM keeps the frames made, and `--resume` continues from them."""

from __future__ import annotations

import argparse
import math
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ..defaults import default_device, native_size
from ..pipelines.io.resume import ResumeError, load_state, state_path_for, write_video
from ..pipelines.io.subtitles import subtitle_overlay
from ..pipelines.io.video_writer import check_output_path, count_frames, partial_path_for
from ..pipelines.request.builder import check_image_mode
from ..pipelines.request.prompt_schedule import PromptSchedule
from ..pipelines.request.text_encoding import PromptWarning
from ..story import Story, parse_story
from .arguments import FLAGS
from .errors import EXIT_FAILED, EXIT_INTERRUPTED, UsageError, relabel
from .loading import load_from_flags

DEFAULT_SECONDS = 5.0  # --seconds without a story


def _start_image(path: Path | None):
    """`--image` read as an RGB picture, or a usage error naming the file."""
    if path is None:
        return None
    from ..pipelines.io.video_input import read_image

    try:
        return read_image(path)
    except ValueError as exc:
        raise UsageError(f"--image: cannot read {str(path)!r} as an image ({exc})") from None


# ---------------------------------------------------------------------------------------- the run
def _check_before_loading(args: argparse.Namespace) -> None:
    """The rules that need no model, run by the library's own checks before it loads (so a typo costs no load); those
    the flags alone decide were answered before torch loaded (`generate._check_flags_alone`)."""
    try:
        check_output_path(args.out)
        if args.story is None:
            PromptSchedule.build(args.prompt, _switches(args), num_frames=math.inf)
        check_image_mode(args.image_mode, args.image)
    except ValueError as exc:
        raise _relabelled(exc, args) from None
    if args.video is not None and not args.video.is_file():
        raise UsageError(f"--video: no such file {str(args.video)!r}")


def _relabelled(exc: Exception, args: argparse.Namespace) -> UsageError:
    """The library's message with the flags' names; a schedule entry is named by the flag that gave it."""
    if args.story is not None:
        return relabel(exc, {**FLAGS, "prompt_schedule": "--story", "scene_cuts": "--story", "story": "--story"})
    return relabel(exc, {**FLAGS, "prompt_schedule": _schedule_flag(args, getattr(exc, "frame", None))})


def _story(args: argparse.Namespace) -> Story | None:
    """`--story` parsed (a usage error naming it), before the model loads."""
    if args.story is None:
        return None
    try:
        return parse_story(args.story)
    except ValueError as exc:
        raise _relabelled(exc, args) from None


def _asked_seconds(args: argparse.Namespace, story: Story | None) -> float | None:
    """The length asked for: `--seconds`, else the story's (None: a scene without one, counted in chunks), else 5."""
    if args.seconds is not None:
        return args.seconds
    return DEFAULT_SECONDS if story is None else story.seconds


def _frames_and_call(pipe, args: argparse.Namespace, story: Story | None, call: dict) -> tuple[int, dict]:
    """The frame count and the stream's arguments: the length asked for and the prompt flags, or the story's scenes
    and cuts (its length when `--seconds` is not given)."""
    seconds = _asked_seconds(args, story)
    if story is None:
        return pipe.num_frames_for(seconds, args.fps, **call), call
    if args.seconds is not None:
        call["num_frames"] = pipe.num_frames_for(seconds, args.fps, **call)
    call = story.arguments(pipe, args.fps, **call)
    return call.pop("num_frames"), call


def _schedule_flag(args: argparse.Namespace, frame: int | None) -> str:
    """`--prompt-at` or `--cut-at`, whichever gave the schedule `frame` a refusal is about (both build one schedule):
    the only one given, else the one holding `frame` (`ScheduleFrameError.frame`), or both when both hold it."""
    switches, cuts = {at for at, _ in args.prompt_at}, {at for at, _ in args.cut_at}
    if not cuts or not switches:
        return "--cut-at" if cuts else "--prompt-at"
    if frame in cuts and frame not in switches:
        return "--cut-at"
    return "--prompt-at and --cut-at" if frame in cuts else "--prompt-at"


def _switches(args: argparse.Namespace) -> list[tuple[int, str]] | None:
    """`--prompt-at` and `--cut-at` together, by frame: the prompt schedule (None: no switch)."""
    return sorted(args.prompt_at + args.cut_at) or None


def _call_arguments(args: argparse.Namespace, image) -> dict:
    """The `pipe.stream` arguments the flags set (None: the recipe's or the model's)."""
    return dict(
        prompt=args.prompt,
        prompt_schedule=_switches(args),
        scene_cuts=[frame for frame, _ in args.cut_at] or None,
        denoising_steps=args.steps,
        first_chunk_steps=args.first_chunk_steps,
        denoising=args.denoising,
        chunk_frames=args.chunk_frames,
        sink_frames=args.sink_frames,
        window_frames=args.window_frames,
        position_mode=args.position_mode,
        sink_mode=args.sink_mode,
        context_policy=args.context_policy,
        elastic_window=args.elastic_window,
        context_window_frames=args.context_window_frames,
        kv_quantization=args.kv_quantization,
        kv_offload=args.kv_offload,
        image=image,
        image_mode=args.image_mode,
        video=None if args.video is None else str(args.video),
        strength=args.strength,
        video_noise_mix=args.video_noise_mix,
        recipe=args.recipe,
        overlap_decode=args.overlap_decode,
        devices=_stage_devices(args.pipeline_parallel, args.device or default_device()),
    )


def _stage_devices(stages: int | None, device: str) -> list[str] | None:
    """`--pipeline-parallel N`: the device of each stage (N CPUs, or --device's GPU and the next N - 1)."""
    if stages is None:
        return None
    if not device.startswith("cuda"):
        return [device] * stages
    first = int(device.partition(":")[2] or 0)
    return [f"cuda:{first + stage}" for stage in range(stages)]


def run_generate(args: argparse.Namespace) -> int:
    _check_before_loading(args)
    story = _story(args)
    image = _start_image(args.image)  # read (and refused) before the model loads
    device = args.device or default_device()
    pipe = load_from_flags(args, device)
    native_height, native_width = native_size(pipe)
    height, width = args.height or native_height, args.width or native_width
    call = _call_arguments(args, image)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PromptWarning)
            # The length as the stream resolves it (the flags, else --recipe's or the folder's), then every
            # argument checked and the bad one named; nothing runs until the stream is iterated.
            num_frames, call = _frames_and_call(pipe, args, story, call)
            generator = torch.Generator("cpu").manual_seed(args.seed)
            stream = pipe.stream(num_frames=num_frames, height=height, width=width, generator=generator, **call)
    except (ValueError, TypeError, OSError) as exc:
        raise _relabelled(exc, args) from exc
    _report_warnings(caught)
    asked = _asked_seconds(args, story)
    rounded = " (rounded up to whole chunks)" if asked is not None and num_frames != round(asked * args.fps) else ""
    duration = num_frames / args.fps
    print(f"Generating {num_frames} frames{rounded}: {duration:.2f} s at {args.fps} fps, {height}x{width}, {device}")

    pipe.set_progress_bar_config(disable=False, unit="chunk")  # the stream makes its bar at the first chunk
    start = time.perf_counter()
    try:
        with _sigterm_as_interrupt():
            # a temporary file beside --out until the end; resume states beside it
            frames = write_video(
                stream,
                args.out,
                args.fps,
                resume=args.resume,
                state_every_s=args.state_every,
                quality=args.quality,
                overlay=None if story is None else subtitle_overlay(story.subtitle_spans(args.fps)),
            )
    except KeyboardInterrupt:
        print(f"rolldiff: interrupted; {_kept(args.out)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ResumeError as exc:
        raise UsageError(f"--resume: {_relabelled(exc, args)}") from exc
    except (FloatingPointError, MemoryError) as exc:  # NaN latents, or a cache that does not fit: stopped there
        print(f"rolldiff: error: {exc} {_kept(args.out)}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        stream.close()  # its input video and offload hooks, however the run ended
    elapsed = time.perf_counter() - start
    print(f"Wrote {frames} frames to {args.out.resolve()}")
    print(f"{frames / elapsed:.1f} frames per second ({elapsed:.1f} s for the whole video)")
    return 0


def _kept(out: Path) -> str:
    """What a failed run left: the partial file (if any frame was made), the untouched target, how to resume."""
    partial, state = partial_path_for(out), state_path_for(out)
    if not partial.exists():
        return f"no frame was finished; {out} was not touched."
    message = f"the {count_frames(partial)} frames made are kept in {partial}; {out} was not touched."
    if state.exists():
        message += f" Run the same command with --resume to continue from frame {load_state(state).frames_written}."
    return message


def _report_warnings(caught: list[warnings.WarningMessage]) -> None:
    """One `rolldiff: warning:` line per prompt warning (unknown words, truncation); others as Python shows them."""
    for warning in caught:
        if issubclass(warning.category, PromptWarning):
            print(f"rolldiff: warning: {warning.message}", file=sys.stderr)
        else:
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """`kill PID` stops a run like Ctrl-C does: the frames done are kept, not lost with an unfinished file."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():  # signal handlers live on the main thread
        yield
        return
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)

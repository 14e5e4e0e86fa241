"""The `rolldiff` command: `rolldiff generate` writes a long video to an mp4, `rolldiff demo` serves the Gradio demo,
`rolldiff serve` serves live sessions, `rolldiff convert` turns a published checkpoint into a pipeline folder.

Frames are streamed into the file chunk by chunk as they are generated, so memory stays that of one chunk
however long the video. Bad arguments end with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from . import __version__ as rolldiff_version
from .caching.layout import ALL_FRAMES
from .cli_convert import add_convert_command
from .cli_errors import UsageError
from .cli_ray import add_ray_arguments, check_ray_arguments, serve_with_ray
from .defaults import DTYPES, ModelNotFoundError, default_device, default_dtype, load_pipeline, native_size
from .pipelines.acceleration import compile_cached_step
from .pipelines.io.resume import ResumeError, load_state, state_path_for, write_video
from .pipelines.io.video_writer import check_output_path, check_quality, count_frames, partial_path_for
from .pipelines.request.builder import check_image_mode
from .pipelines.request.prompt_schedule import PromptSchedule
from .pipelines.request.text_encoding import PromptWarning
from .recipes import list_recipes

EXIT_USAGE = 2
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130  # what a shell reports for a program stopped by Ctrl-C (128 + SIGINT)
# One run is at most a day of video: a typo such as --seconds 1e9 is refused instead of running for decades.
MAX_SECONDS = 24 * 3600.0
MAX_FPS = 240
# torch.Generator.manual_seed takes any 64-bit value.
MAX_SEED = 2**64 - 1
# Device types a pipeline can run on; `meta` holds no data and `cpu`/`cuda` cover the usual cases.
_DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")


# The library's argument names and the flags that set them: a library error is relabelled with the flag (the
# rule itself is checked once, by the library).
FLAGS = {
    "prompt": "--prompt",
    "prompt_schedule": "--prompt-at",
    "denoising_steps": "--steps",
    "first_chunk_steps": "--first-chunk-steps",
    "denoising": "--denoising",
    "height": "--height",
    "width": "--width",
    "num_frames": "--seconds",
    "seconds": "--seconds",
    "fps": "--fps",
    "chunk_frames": "--chunk-frames",
    "sink_frames": "--sink-frames",
    "window_frames": "--window-frames",
    "position_mode": "--position-mode",
    "sink_mode": "--sink-mode",
    "context_policy": "--context-policy",
    "elastic_window": "--elastic-window",
    "context_window_frames": "--context-window-frames",
    "kv_quantization": "--kv-quantization",
    "kv_offload": "--kv-offload",
    "image": "--image",
    "image_mode": "--image-mode",
    "video": "--video",
    "strength": "--strength",
    "video_noise_mix": "--video-noise-mix",
    "recipe": "--recipe",
    "overlap_decode": "--overlap-decode",
    "devices": "--pipeline-parallel",
    "path": "--out",
    "quality": "--quality",
    "state_every_s": "--state-every",
}


def relabel(error: Exception) -> UsageError:
    """The library's message with each argument it names shown as the flag that sets it (`--steps
    (`denoising_steps`)`), as one usage error."""
    message = str(error)
    for name, flag in FLAGS.items():
        message = message.replace(f"`{name}`", f"{flag} (`{name}`)")
    return UsageError(message)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print the usage block and exit itself
        raise UsageError(message)


# ---------------------------------------------------------------------------------------- argument types
def _prompt_at(text: str) -> tuple[int, str]:
    frame, sep, prompt = text.partition(":")
    if not sep or not frame.strip().isdigit() or not prompt.strip():
        raise argparse.ArgumentTypeError(f"expected FRAME:TEXT with FRAME a frame number >= 0, got {text!r}")
    return int(frame), prompt.strip()


def _steps(text: str) -> list[int]:
    try:
        return [int(step) for step in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 1000,750,500,250, got {text!r}"
        ) from None


def _positive(kind, maximum: float = math.inf):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"expected a finite {kind.__name__} > 0, got {text!r}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"expected at most {maximum:g}, got {text!r}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def _window_frames(text: str) -> int | str:
    """A number of latent frames, or the one spelling of an unbounded window (`ALL_FRAMES`)."""
    if text == ALL_FRAMES:
        return ALL_FRAMES
    try:
        return _positive(int)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected an int > 0 or {ALL_FRAMES!r}, got {text!r}") from None


_window_frames.__name__ = "window"  # argparse names the type in its messages


def _quality(text: str) -> float:
    try:
        return check_quality(float(text))  # the writer's own range
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number from 1 to 10, got {text!r}") from None


def _non_negative_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0, got {text!r}")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**64 - 1], got {text!r}")
    return value


def _compile_backend(text: str) -> str:
    if text not in torch._dynamo.list_backends(exclude_tags=()):  # noqa: SLF001 (dynamo's backend registry)
        usual = sorted({*torch._dynamo.list_backends(), "eager"})  # noqa: SLF001
        raise argparse.ArgumentTypeError(f"expected a torch.compile backend such as {', '.join(usual)}; got {text!r}")
    return text


def _device(text: str) -> str:
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"expected a torch device like cpu, cuda or cuda:1, got {text!r}") from None
    if device.type not in _DEVICE_TYPES:
        raise argparse.ArgumentTypeError(f"expected one of the device types {', '.join(_DEVICE_TYPES)}, got {text!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r} asked for, but CUDA is not available on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(
            f"{text!r} asked for, but this machine has {torch.cuda.device_count()} GPU(s)"
        )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError(f"{text!r} asked for, but MPS is not available on this machine")
    if device.type == "xpu" and not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        raise argparse.ArgumentTypeError(f"{text!r} asked for, but XPU is not available on this machine")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rolldiff", description="Generate long videos chunk by chunk with a rolling KV cache.")
    parser.add_argument("--version", action="version", version=f"rolldiff {rolldiff_version}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    generate = commands.add_parser(
        "generate",
        help="write a video to an mp4 file",
        description="Write a video to an mp4, streaming frames into the file as they are generated.",
    )
    generate.add_argument("--prompt", help="the text (optional when a --prompt-at starts at frame 0)")
    generate.add_argument(
        "--prompt-at",
        action="append",
        type=_prompt_at,
        default=[],
        metavar="FRAME:TEXT",
        help="switch to TEXT at video frame FRAME (repeatable), e.g. --prompt-at '48:a blue square moving up'",
    )
    generate.add_argument(
        "--seconds",
        type=_positive(float, MAX_SECONDS),
        default=5.0,
        help="length (default 5, at most a day); rounded up",
    )
    generate.add_argument("--out", type=Path, default=Path("video.mp4"), help="the .mp4 to write (default video.mp4)")
    _add_model_arguments(generate)
    generate.add_argument("--seed", type=_seed, default=0, help="random seed (default 0)")
    generate.add_argument(
        "--fps", type=_positive(int, MAX_FPS), default=16, help="frames per second of the file (default 16)"
    )
    generate.add_argument("--height", type=_positive(int), help="pixels (default: the model's native size)")
    generate.add_argument("--width", type=_positive(int), help="pixels (default: the model's native size)")
    generate.add_argument("--steps", type=_steps, help="denoising steps, e.g. 1000,750,500,250 (default: the model's)")
    generate.add_argument(
        "--first-chunk-steps",
        type=_steps,
        help="the first chunk's own steps, e.g. 1000,750,500,250 (Causal Forcing++)",
    )
    generate.add_argument(
        "--denoising",
        help="'sequential' (default), 'pipelined': every step's chunk in flight, one forward for all (Rolling Forcing), "
        "or 'stream_batch': StreamDiffusionV2's batch of one row per step, each with its own cache",
    )
    generate.add_argument("--chunk-frames", type=_positive(int), help="latent frames per chunk (default: the model's)")
    generate.add_argument("--sink-frames", type=int, help="latent frames kept forever at the start of the cache")
    generate.add_argument(
        "--window-frames",
        type=_window_frames,
        help="latent frames of the rolling window, or 'all' (every earlier frame stays visible)",
    )
    generate.add_argument("--position-mode", help="RoPE positions: absolute or relative (default: the model's)")
    generate.add_argument(
        "--sink-mode", help="fixed, or rolling (Rolling Sink's sliding sink; needs relative positions)"
    )
    generate.add_argument(
        "--context-policy",
        help="how a chunk becomes context: rolling (a clean pass, the default), recompute (Krea: rebuilt each chunk) "
        "or last_step (StreamDiffusionV2: the last step's K/V, no clean pass)",
    )
    generate.add_argument(
        "--elastic-window",
        action="store_true",
        default=None,
        help="the window counts the frames being denoised: fewer in flight see more committed frames (Rolling Forcing)",
    )
    generate.add_argument(
        "--context-window-frames",
        type=int,
        help="latent frames the context pass attends to, counting its chunk (Rolling Forcing's clean pass: 21)",
    )
    generate.add_argument(
        "--kv-quantization", choices=["int8", "fp8"], help="store the K/V window quantized (about half of bf16)"
    )
    generate.add_argument(
        "--kv-offload", action="store_true", default=None, help="keep the K/V window in CPU memory between blocks"
    )
    generate.add_argument(
        "--fp8",
        action="store_true",
        help="float8 weights and activations for the linear layers (torchao; CUDA, sm 8.9+)",
    )
    generate.add_argument(
        "--attention-backend",
        metavar="NAME",
        help="diffusers attention backend (flash, _flash_3, _native_cudnn, native, ...) or 'fastest' for the device",
    )
    generate.add_argument(
        "--cuda-graphs", action="store_true", help="replay the compiled cached step as CUDA graphs (implies --compile)"
    )
    generate.add_argument(
        "--overlap-decode", action="store_true", help="decode chunk k on a side stream while chunk k+1 denoises (CUDA)"
    )
    generate.add_argument(
        "--tiny-vae",
        type=Path,
        metavar="PATH",
        help="decode with a tiny autoencoder (TAEHV: taew2_1.pth / .safetensors) instead of the full VAE",
    )
    generate.add_argument(
        "--recipe",
        choices=list_recipes(),
        help="the checkpoint authors' inference settings (rolldiff.recipes); explicit flags override them",
    )
    generate.add_argument("--image", type=Path, help="start frame (image-to-video): a PNG/JPEG the video starts on")
    generate.add_argument(
        "--image-mode",
        choices=["chunk", "frame"],
        help="with --image: 'chunk' repeats it over the first chunk (Krea; the default), 'frame' commits its one "
        "latent frame first (Self-Forcing/CausVid; the self-forcing recipe's)",
    )
    generate.add_argument(
        "--video", type=Path, help="input video (video-to-video), read chunk by chunk; the output ends with it"
    )
    generate.add_argument(
        "--strength",
        type=float,
        help="with --video: how much of each input chunk is regenerated, in (0, 1] (default 0.8)",
    )
    generate.add_argument(
        "--video-noise-mix",
        help="with --video: sigma (noised to the step --strength cuts at; the default), strength (noise*s + "
        "input*(1-s), every step runs) or motion (StreamDiffusionV2's: s and the first step follow the input's "
        "motion; its recipe's)",
    )
    generate.add_argument(
        "--quality",
        type=_quality,
        default=5.0,
        help="mp4 encoding, 1 (smallest file) to 10 (lossless); default 5",
    )
    generate.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted run of the same command from its last saved chunk (the video equals an "
        "uninterrupted one)",
    )
    generate.add_argument(
        "--state-every",
        type=_non_negative_seconds,
        default=60.0,
        metavar="SECONDS",
        help="save the resume state after a chunk at most this often (0: every chunk; default 60)",
    )
    generate.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        type=_compile_backend,
        metavar="BACKEND",
        help="torch.compile the transformer (fullgraph; default backend inductor): two graphs, no recompiles",
    )
    generate.add_argument(
        "--pipeline-parallel",
        type=_positive(int),
        metavar="N",
        help="split the transformer's blocks into N stages, one process each (CPU: gloo; CUDA: NCCL on --device's "
        "GPU and the next N - 1); the same video as one process",
    )
    generate.set_defaults(run=run_generate)

    demo = commands.add_parser("demo", help="serve the Gradio demo", description="Serve the Gradio demo.")
    _add_model_arguments(demo)
    demo.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    demo.add_argument("--port", type=int, default=7860, help="port, 1 to 65535 (default 7860)")
    demo.add_argument("--max-concurrency", type=_positive(int), default=2, help="generations at once (default 2)")
    demo.set_defaults(run=run_demo)
    _add_serve_command(commands)
    add_convert_command(commands, _positive(int))
    return parser


def _add_serve_command(commands) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve real-time sessions over WebSocket (rolldiff-stream/1)",
        description="Serve live generation sessions at ws://HOST:PORT/v1/stream (docs/serving.md).",
    )
    _add_model_arguments(serve)
    serve.add_argument("--recipe", choices=list_recipes(), help="the recipe sessions use unless they name one")
    serve.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        type=_compile_backend,
        metavar="BACKEND",
        help="torch.compile the transformer (fullgraph; default backend inductor)",
    )
    serve.add_argument("--tiny-vae", type=Path, metavar="PATH", help="decode with a tiny autoencoder (TAEHV)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8000, help="port, 1 to 65535 (default 8000)")
    serve.add_argument("--max-sessions", type=_positive(int), default=4, help="sessions at once (default 4)")
    serve.add_argument(
        "--max-batch",
        type=_positive(int),
        default=8,
        metavar="N",
        help="sessions denoised together in one forward per step (default 8; 1: sessions take turns)",
    )
    serve.add_argument(
        "--parallel-groups",
        type=_positive(int),
        metavar="N",
        help="batched groups of 4 or more sessions made at once (default: on a CPU, its cores over torch's threads; "
        "1 on a GPU)",
    )
    serve.add_argument(
        "--token", default=os.environ.get("ROLLDIFF_TOKEN"), help="clients must send it (default: $ROLLDIFF_TOKEN)"
    )
    serve.add_argument(
        "--insecure-no-token",
        action="store_true",
        help="allow binding an address other than loopback without a token (anyone who reaches it may use the GPU)",
    )
    serve.add_argument(
        "--state-dir",
        metavar="DIR_OR_URL",
        help="folder or fsspec URL (file:///..., s3://...) for suspended sessions (suspend/restore, restarts)",
    )
    serve.add_argument(
        "--idle-timeout", type=_positive(float), default=300.0, help="end a session idle this many seconds (300)"
    )
    serve.add_argument(
        "--max-frames", type=_positive(int), default=100_000, help="frames a session may make (default 100000)"
    )
    serve.add_argument(
        "--state-every",
        type=int,
        default=0,
        metavar="CHUNKS",
        help="save each session every N chunks (needs --state-dir)",
    )
    serve.add_argument("--fps", type=_positive(int), default=16, help="frames per second clients play at (16)")
    serve.add_argument(
        "--workers",
        type=_positive(int),
        metavar="N",
        help="server processes on a CPU's cores, each with its own copy of the model and its share of the sessions, "
        "behind the one port (default 1)",
    )
    add_ray_arguments(serve, _positive(int))
    serve.set_defaults(run=run_serve, fp8=False, attention_backend=None, cuda_graphs=False, kv_offload=None)


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="pipeline folder or Hugging Face Hub id (default: the embedded tiny model)")
    parser.add_argument("--device", type=_device, help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    parser.add_argument(
        "--dtype", choices=list(DTYPES), help="weights dtype (default: bfloat16 on cuda, else float32)"
    )


def _accelerate(pipe, args: argparse.Namespace) -> None:
    """--fp8, --attention-backend, --cuda-graphs / --compile, in that order (fp8 before compiling), through the
    pipeline's own switches; a refusal (no CUDA, no torchao, an unknown backend) is a usage error naming the flag."""
    flag = "--fp8"
    try:
        if args.fp8:
            pipe.enable_fp8()
        flag = "--attention-backend"
        if args.attention_backend:
            pipe.set_attention_backend(args.attention_backend)  # "fastest": the transformer's device's fastest
        flag = "--cuda-graphs"
        if args.cuda_graphs:
            if args.kv_offload:
                raise ValueError("CUDA graphs need the cache's buffers on the GPU; drop --kv-offload")
            pipe.enable_cuda_graphs()
        elif args.compile:  # one graph per window state (filling, full); compiled at the first chunks
            compile_cached_step(pipe.transformer, backend=args.compile)
    except (ValueError, RuntimeError, ImportError) as exc:
        raise UsageError(f"{flag}: {exc}") from None


def _start_image(path: Path | None):
    """`--image` read as an RGB picture, or a usage error naming the file."""
    if path is None:
        return None
    from .pipelines.io.video_input import read_image

    try:
        return read_image(path)
    except ValueError as exc:
        raise UsageError(f"--image: cannot read {str(path)!r} as an image ({exc})") from None


# ---------------------------------------------------------------------------------------- commands
def _check_before_loading(args: argparse.Namespace) -> None:
    """The rules that need no model, run by the library's own checks before it loads (so a typo costs no load)."""
    try:
        check_output_path(args.out)
        PromptSchedule.build(args.prompt, sorted(args.prompt_at) or None, num_frames=math.inf)
        check_image_mode(args.image_mode, args.image)
    except ValueError as exc:
        raise relabel(exc) from None
    if args.video is not None and not args.video.is_file():
        raise UsageError(f"--video: no such file {str(args.video)!r}")
    if args.pipeline_parallel is not None:
        # each stage loads the model again and runs it as loaded, and a split run cannot load a saved state
        given = [flag for flag, on in (("--compile", args.compile), ("--cuda-graphs", args.cuda_graphs),
                                       ("--fp8", args.fp8), ("--attention-backend", args.attention_backend),
                                       ("--resume", args.resume)) if on]  # fmt: skip
        if given:
            raise UsageError(f"--pipeline-parallel runs the model as loaded, without {', '.join(given)}; drop them.")


def _call_arguments(args: argparse.Namespace, image) -> dict:
    """The `pipe.stream` arguments the flags set (None: the recipe's or the model's)."""
    return dict(
        prompt=args.prompt,
        prompt_schedule=sorted(args.prompt_at) or None,
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


def _load(args: argparse.Namespace, device: str):
    pipe = load_pipeline(args.model, device=device, dtype=args.dtype or default_dtype(device))
    pipe.set_progress_bar_config(disable=True)  # ours counts chunks of the whole video instead
    if args.tiny_vae is not None:
        try:
            pipe.load_tiny_autoencoder(args.tiny_vae)
        except (OSError, ValueError) as exc:
            raise UsageError(f"--tiny-vae: {exc}") from None
    _accelerate(pipe, args)
    return pipe


def run_generate(args: argparse.Namespace) -> int:
    _check_before_loading(args)
    image = _start_image(args.image)  # read (and refused) before the model loads
    device = args.device or default_device()
    pipe = _load(args, device)
    native_height, native_width = native_size(pipe)
    height, width = args.height or native_height, args.width or native_width
    call = _call_arguments(args, image)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PromptWarning)
            # The length as the stream resolves it (the flags, else --recipe's or the folder's), then every
            # argument checked and the bad one named; nothing runs until the stream is iterated.
            num_frames = pipe.num_frames_for(args.seconds, args.fps, **call)
            generator = torch.Generator("cpu").manual_seed(args.seed)
            stream = pipe.stream(num_frames=num_frames, height=height, width=width, generator=generator, **call)
    except (ValueError, TypeError, OSError) as exc:
        raise relabel(exc) from exc
    _report_warnings(caught)
    rounded = " (rounded up to whole chunks)" if num_frames != round(args.seconds * args.fps) else ""
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
            )
    except KeyboardInterrupt:
        print(f"rolldiff: interrupted; {_kept(args.out)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ResumeError as exc:
        raise UsageError(f"--resume: {relabel(exc)}") from exc
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


def _check_serve_arguments(args: argparse.Namespace) -> None:
    from .demo import check_address

    loopback = args.host in ("127.0.0.1", "localhost", "::1") or args.host.startswith("127.")
    if not loopback and not args.token and not args.insecure_no_token:
        raise UsageError(
            f"--host {args.host} lets other machines in; give --token (or ROLLDIFF_TOKEN), or --insecure-no-token to "
            "serve without one"
        )
    if (args.parallel_groups or 1) > 1 and (args.max_batch == 1 or args.compile):
        raise UsageError(
            "--parallel-groups makes batched groups side by side: it needs --max-batch above 1 and no --compile "
            "(a compiled step is one session's graph)"
        )
    if args.state_every < 0 or (args.state_every and args.state_dir is None):
        raise UsageError("--state-every: a number of chunks >= 0, with --state-dir to save into")
    if args.state_dir is not None:
        from .serving.store import open_state_folder

        try:
            open_state_folder(args.state_dir)
        except ValueError as exc:
            raise UsageError(str(exc).replace("`state_dir`", "--state-dir")) from None
    try:
        # a joined cluster's Serve listens on the cluster's nodes, not necessarily here (its port is checked once joined)
        check_address(args.host, args.port, bind=not (args.ray and args.ray_address))
    except ValueError as exc:
        raise UsageError(str(exc).replace("`host`", "--host").replace("`port`", "--port")) from None


def _serving_threads(device: str, workers: int) -> tuple[int, int]:
    """Torch threads and default parallel groups for each server process. On a CPU each process gets its share of
    the cores, less one for the event loop and the frame encoding: torch on every core starves them (measured on 2
    cores: 26 fps with 2 threads, 46 with 1; docs/serving.md), and its groups of 4 or more run side by side on the
    rest (2 on 2 cores with one process). On a GPU, torch's threads as they are and one group at a time: a second
    group's forwards would only queue on the GPU's one stream."""
    if torch.device(device).type != "cpu":
        return torch.get_num_threads(), 1
    cores = max(1, (os.cpu_count() or 1) // workers)
    if "OMP_NUM_THREADS" in os.environ:
        threads = torch.get_num_threads()
    else:
        threads = max(1, cores - 1)
    return threads, max(1, cores // threads)


def load_served_pipeline(args: argparse.Namespace, device: str, settings):
    """The pipeline `rolldiff serve` serves, loaded as `rolldiff generate` loads it, and checked: a default no
    session could run (e.g. --compile with a recipe that decides on the host) is refused now, not once per session.
    Module-level, so each `--workers` process can load its own copy."""
    from .serving.app import check_default_session

    with _quiet_libraries():
        pipe = _load(args, device)
    try:
        check_default_session(pipe, settings)
    except ValueError as exc:
        recipe = f"--recipe {args.recipe}" if args.recipe else "the model's recipe"
        raise UsageError(f"a plain session with {recipe} would be refused: {exc}") from None
    return pipe


def run_serve(args: argparse.Namespace) -> int:
    missing = [name for name in ("fastapi", "uvicorn", "websockets") if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(f"serving needs {', '.join(missing)}, which is not installed: pip install 'rolldiff[serve]'")
    _check_serve_arguments(args)
    from .serving.app import ServeSettings

    device = args.device or default_device()
    replicas = check_ray_arguments(args, device)  # 0 without --ray
    args.workers = args.workers or 1
    if args.workers > 1 and torch.device(device).type != "cpu":
        raise UsageError(
            f"--workers {args.workers} runs server processes on a CPU's cores; on a GPU run one server per device "
            "(--device cuda:N), behind a proxy (docs/serving.md)"
        )
    cores = os.cpu_count() or 1
    if args.workers > cores:  # each worker is a whole process with its own model: more than cores only costs memory
        raise UsageError(f"--workers {args.workers}: at most one per core, and this machine has {cores}")
    threads, default_groups = _serving_threads(device, replicas or args.workers)
    settings = ServeSettings(
        model=str(args.model or "tiny-bouncing-shapes"),
        recipe=args.recipe,
        max_sessions=args.max_sessions,
        max_batch=1 if args.compile else args.max_batch,  # a compiled step is one cache's graph
        parallel_groups=args.parallel_groups or default_groups,
        token=args.token or None,
        state_dir=None if args.state_dir is None else str(args.state_dir),
        idle_timeout=args.idle_timeout,
        max_frames=args.max_frames,
        state_every=args.state_every,
        fps=args.fps,
    )
    address = f"ws://{args.host}:{args.port}/v1/stream"
    if args.ray:
        from functools import partial

        load = partial(load_served_pipeline, args, device, settings)
        return serve_with_ray(args, load, settings, device, (threads, replicas), address)
    if args.workers > 1:
        return _serve_with_workers(args, device, settings, threads, address)
    from .serving.server import serve

    torch.set_num_threads(threads)
    pipe = load_served_pipeline(args, device, settings)
    print(f"rolldiff serve: {address} ({type(pipe).__name__}, {device})", flush=True)
    serve(pipe, settings, args.host, args.port)
    return 0


def _serve_with_workers(args: argparse.Namespace, device: str, settings, threads: int, address: str) -> int:
    from functools import partial

    from .serving.workers import WorkerError, WorkerSpec, serve_workers

    spec = WorkerSpec(partial(load_served_pipeline, args, device, settings), settings, args.host, args.port, threads)

    def announce(pipeline: str) -> None:
        print(f"rolldiff serve: {address} ({pipeline}, {device}, {args.workers} workers)", flush=True)

    try:
        serve_workers(spec, args.workers, announce)
    except WorkerError as exc:
        raise UsageError(str(exc)) from None
    return 0


def run_demo(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("gradio") is None:
        raise UsageError("the demo needs Gradio, which is not installed: pip install 'rolldiff[demo]'")
    from .demo import build_demo, check_address  # build_demo imports gradio: only for this command

    try:  # a busy port or a foreign address fails before the model loads
        check_address(args.host, args.port)
    except ValueError as exc:
        raise UsageError(str(exc).replace("`host`", "--host").replace("`port`", "--port")) from None
    device = args.device or default_device()
    demo = build_demo(
        args.model, max_concurrency=args.max_concurrency, device=device, dtype=args.dtype or default_dtype(device)
    )
    demo.launch(server_name=args.host, server_port=args.port)
    return 0


@contextmanager
def _quiet_libraries() -> Iterator[None]:
    """Keep stderr for our progress bar and errors: no per-component loading bars or library chatter."""
    import diffusers.utils.logging as diffusers_logging
    import transformers.utils.logging as transformers_logging

    saved = [
        (lib, lib.get_verbosity(), lib.is_progress_bar_enabled()) for lib in (diffusers_logging, transformers_logging)
    ]
    for lib, _, _ in saved:
        lib.set_verbosity_error()
        lib.disable_progress_bar()
    try:
        yield
    finally:  # `main` may run inside a bigger program (or a test session): leave it as it was
        for lib, verbosity, bars in saved:
            lib.set_verbosity(verbosity)
            if bars:
                lib.enable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `rolldiff` command; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv:  # `rolldiff` alone: say what it does and how to start, not "the following arguments are required"
        parser.print_help()
        return EXIT_USAGE
    try:
        args = parser.parse_args(argv)
        with _quiet_libraries():
            return args.run(args)
    except (UsageError, ModelNotFoundError) as exc:
        print(f"rolldiff: error: {' '.join(str(exc).split())}", file=sys.stderr)  # one line, whatever the message
        return EXIT_USAGE

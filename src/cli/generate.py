"""`rolldiff generate`'s flags, in the groups `--help` shows; the run is `run_generate.py`, imported when the command
runs (so `--help` and a mistyped flag answer without loading torch)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..story import check_story_call
from .arguments import (
    FLAGS,
    MAX_FPS,
    MAX_SECONDS,
    add_compile_and_decoder_arguments,
    add_lora_arguments,
    add_memory_arguments,
    add_model_arguments,
    add_recipe_argument,
    check_lora_flags,
    check_memory_flags,
    non_negative_seconds,
    positive,
    prompt_at,
    quality,
    seed,
    step_list,
    window_frames,
)
from .errors import UsageError, relabel

STORY_FLAGS = {**FLAGS, "story": "--story"}  # a refusal of `--story` beside the flags it stands in for

EXAMPLES = """examples:
  rolldiff generate --prompt "a red circle moving left" --seconds 20 --out video.mp4
  rolldiff generate --prompt "a red circle moving left" --prompt-at "160:a blue square moving up" --seconds 30
  rolldiff generate --recipe infinity-rope --prompt "a red circle moving left" --cut-at "160:a blue square" --seconds 30
  rolldiff generate --recipe infinity-rope --story "a red circle[5s#] | a blue square[5s] ; Red | Blue"
  rolldiff generate --image start.png --prompt "a red circle moving left" --out i2v.mp4
  rolldiff generate --model FOLDER --lora style.safetensors --lora-scale 0.8 --prompt "..." --out styled.mp4
  rolldiff generate --model FOLDER --prompt "..." --seconds 3600 --out hour.mp4 --resume   # again after Ctrl-C
every flag: docs/cli.md
"""


def add_generate_command(commands) -> None:
    """The `generate` subcommand, its flags in groups as `--help` shows them."""
    generate = commands.add_parser(
        "generate",
        help="write a video to an mp4 file",
        description="Write a video to an mp4, streaming frames into the file as they are generated.",
        epilog=EXAMPLES,
    )
    generate.add_argument("--prompt", help="the text (optional when a --prompt-at starts at frame 0)")
    generate.add_argument(
        "--prompt-at",
        action="append",
        type=prompt_at,
        default=[],
        metavar="FRAME:TEXT",
        help="switch to TEXT at video frame FRAME (repeatable), e.g. --prompt-at '48:a blue square moving up'",
    )
    generate.add_argument(
        "--cut-at",
        action="append",
        type=prompt_at,
        default=[],
        metavar="FRAME:TEXT",
        help="switch to TEXT at video frame FRAME with a hard scene cut (repeatable; Infinity-RoPE's RoPE cut: needs "
        "--position-mode relative, e.g. --recipe infinity-rope)",
    )
    generate.add_argument(
        "--story",
        metavar="TEXT",
        help="a whole multi-scene video in Infinity-RoPE's syntax, instead of --prompt/--prompt-at/--cut-at: "
        "'SCENE[5s#] | SCENE[10s] ; SUBTITLE | SUBTITLE' (# in a scene's brackets: a hard cut after it; subtitles "
        "drawn in)",
    )
    generate.add_argument(
        "--seconds",
        type=positive(float, MAX_SECONDS),
        help="length (default 5, or the story's; at most a day); rounded up",
    )
    generate.add_argument("--out", type=Path, default=Path("video.mp4"), help="the .mp4 to write (default video.mp4)")
    add_model_arguments(generate)
    add_lora_arguments(generate)
    generate.add_argument("--seed", type=seed, default=0, help="random seed (default 0)")
    generate.add_argument(
        "--fps", type=positive(int, MAX_FPS), default=16, help="frames per second of the file (default 16)"
    )
    generate.add_argument("--height", type=positive(int), help="pixels (default: the model's native size)")
    generate.add_argument("--width", type=positive(int), help="pixels (default: the model's native size)")
    add_recipe_argument(generate, "the checkpoint authors' inference settings (explicit flags override them)")
    _add_denoising_arguments(
        generate.add_argument_group("denoising and context (default: the recipe's, else the model's)")
    )
    _add_input_arguments(generate.add_argument_group("start image and input video"))
    _add_memory_arguments(generate.add_argument_group("GPU memory (docs/memory.md)"))
    _add_speed_arguments(generate.add_argument_group("speed"))
    _add_file_arguments(generate.add_argument_group("the file"))
    generate.set_defaults(run=_run, check_flags=_check_flags_alone)


def _add_denoising_arguments(group) -> None:
    """Steps, chunking, the cache's sink and window, how a chunk becomes context."""
    group.add_argument("--steps", type=step_list, help="denoising steps, e.g. 1000,750,500,250 (default: the model's)")
    group.add_argument(
        "--first-chunk-steps",
        type=step_list,
        help="the first chunk's own steps, e.g. 1000,750,500,250 (Causal Forcing++)",
    )
    group.add_argument(
        "--denoising",
        help="'sequential' (default), 'pipelined': every step's chunk in flight, one forward for all (Rolling Forcing), "
        "or 'stream_batch': StreamDiffusionV2's batch of one row per step, each with its own cache",
    )
    group.add_argument("--chunk-frames", type=positive(int), help="latent frames per chunk (default: the model's)")
    group.add_argument("--sink-frames", type=int, help="latent frames kept forever at the start of the cache")
    group.add_argument(
        "--window-frames",
        type=window_frames,
        help="latent frames of the rolling window, or 'all' (every earlier frame stays visible)",
    )
    group.add_argument("--position-mode", help="RoPE positions: absolute or relative (default: the model's)")
    group.add_argument(
        "--sink-mode",
        help="fixed, rolling (Rolling Sink's sliding sink) or ema (Reward Forcing's averaged sink); both need relative positions",
    )
    group.add_argument(
        "--context-policy",
        help="how a chunk becomes context: rolling (a clean pass, the default), recompute (Krea: rebuilt each chunk) "
        "or last_step (StreamDiffusionV2: the last step's K/V, no clean pass)",
    )
    group.add_argument(
        "--elastic-window",
        action="store_true",
        default=None,
        help="the window counts the frames being denoised: fewer in flight see more committed frames (Rolling Forcing)",
    )
    group.add_argument(
        "--context-window-frames",
        type=int,
        help="latent frames the context pass attends to, counting its chunk (Rolling Forcing's clean pass: 21)",
    )


def _add_memory_arguments(group) -> None:
    """Where the weights and the K/V window live, and in what dtype."""
    add_memory_arguments(group)
    group.add_argument(
        "--kv-quantization", choices=["int8", "fp8"], help="store the K/V window quantized (about half of bf16)"
    )
    group.add_argument(
        "--kv-offload", action="store_true", default=None, help="keep the K/V window in CPU memory between blocks"
    )


def _add_input_arguments(group) -> None:
    """Image-to-video and video-to-video."""
    group.add_argument("--image", type=Path, help="start frame (image-to-video): a PNG/JPEG the video starts on")
    group.add_argument(
        "--image-mode",
        choices=["chunk", "frame"],
        help="with --image: 'chunk' repeats it over the first chunk (Krea; the default), 'frame' commits its one "
        "latent frame first (Self-Forcing/CausVid; the self-forcing recipe's)",
    )
    group.add_argument(
        "--video", type=Path, help="input video (video-to-video), read chunk by chunk; the output ends with it"
    )
    group.add_argument(
        "--strength",
        type=float,
        help="with --video: how much of each input chunk is regenerated, in (0, 1] (default 0.8)",
    )
    group.add_argument(
        "--video-noise-mix",
        help="with --video: sigma (noised to the step --strength cuts at; the default), strength (noise*s + "
        "input*(1-s), every step runs) or motion (StreamDiffusionV2's: s and the first step follow the input's "
        "motion; its recipe's)",
    )


def _add_speed_arguments(group) -> None:
    """The GPU speed switches, the tiny decoder and pipeline parallelism."""
    add_compile_and_decoder_arguments(group)
    group.add_argument(
        "--cuda-graphs", action="store_true", help="replay the compiled cached step as CUDA graphs (implies --compile)"
    )
    group.add_argument(
        "--fp8",
        action="store_true",
        help="float8 weights and activations for the linear layers (torchao; CUDA, sm 8.9+)",
    )
    group.add_argument(
        "--attention-backend",
        metavar="NAME",
        help="diffusers attention backend (flash, _flash_3, _native_cudnn, native, ...) or 'fastest' for the device",
    )
    group.add_argument(
        "--overlap-decode", action="store_true", help="decode chunk k on a side stream while chunk k+1 denoises (CUDA)"
    )
    group.add_argument(
        "--pipeline-parallel",
        type=positive(int),
        metavar="N",
        help="split the transformer's blocks into N stages, one process each (CPU: gloo; CUDA: NCCL on --device's "
        "GPU and the next N - 1); the same video as one process",
    )


def _add_file_arguments(group) -> None:
    """Encoding quality, and resuming an interrupted run."""
    group.add_argument(
        "--quality",
        type=quality,
        default=5.0,
        help="mp4 encoding, 1 (smallest file) to 10 (lossless); default 5",
    )
    group.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted run of the same command from its last saved chunk (the video equals an "
        "uninterrupted one)",
    )
    group.add_argument(
        "--state-every",
        type=non_negative_seconds,
        default=60.0,
        metavar="SECONDS",
        help="save the resume state after a chunk at most this often (0: every chunk; default 60)",
    )


def _run(args: argparse.Namespace) -> int:
    from .run_generate import run_generate  # torch and the pipelines load when the command runs, not for --help

    return run_generate(args)


def _check_flags_alone(args: argparse.Namespace) -> None:
    """The rules the flags decide on their own (no library, no model, no file read). Raises `UsageError`."""
    check_lora_flags(args)
    check_memory_flags(args)
    if args.story is not None:
        try:
            check_story_call({"prompt": args.prompt, "prompt_schedule": args.prompt_at or None,
                              "scene_cuts": args.cut_at or None})  # fmt: skip
        except ValueError as exc:
            raise relabel(exc, STORY_FLAGS) from None
    if args.pipeline_parallel is not None:
        # each stage loads the model again and runs it as loaded, and a split run cannot load a saved state
        given = [flag for flag, on in (("--compile", args.compile), ("--cuda-graphs", args.cuda_graphs),
                                       ("--fp8", args.fp8), ("--attention-backend", args.attention_backend),
                                       ("--resume", args.resume), ("--lora", args.lora),
                                       ("--offload", args.offload), ("--fp8-storage", args.fp8_storage)) if on]  # fmt: skip
        if given:
            raise UsageError(f"--pipeline-parallel runs the model as loaded, without {', '.join(given)}; drop them.")

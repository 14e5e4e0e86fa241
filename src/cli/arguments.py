"""The command line's value types (each refuses a bad value with a message argparse shows beside the flag) and the
flags every model-loading subcommand shares. Nothing heavy is imported here: the parser is built for every command,
`--help` and `--version` included; a value type that needs torch imports it when it is called."""

from __future__ import annotations

import argparse
import difflib
import math
import textwrap
from pathlib import Path

from ..checks import check_lora_source
from ..choices import ALL_FRAMES, DTYPE_NAMES, OFFLOAD_MODES
from ..recipes import list_recipes
from ..text_forms import parse_prompt_switch, parse_step_list
from .errors import UsageError

# One run is at most a day of video: a typo such as --seconds 1e9 is refused instead of running for decades.
MAX_SECONDS = 24 * 3600.0
MAX_FPS = 240
# torch.Generator.manual_seed takes any 64-bit value.
MAX_SEED = 2**64 - 1
# Device types a pipeline can run on; `meta` holds no data and `cpu`/`cuda` cover the usual cases.
_DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")


class HelpFormatter(argparse.HelpFormatter):
    """argparse's, without breaking a line inside a hyphenated name (`causal-forcing-1step`, `--window-frames`), and
    with a command's examples (its epilog) shown as written."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:  # an epilog of example commands, laid out by hand: kept as written
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


class Parser(argparse.ArgumentParser):
    """argparse whose errors are ours: one `rolldiff: error:` line and exit code 2 (`main`), not its usage block. Flags
    are not abbreviated: `rolldiff serve --fp8` (a flag of `generate` only) would be taken for `--fp8-storage`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **{"formatter_class": HelpFormatter, "allow_abbrev": False, **kwargs})

    def error(self, message: str):  # argparse would print the usage block and exit itself
        raise UsageError(message)

    def parse_known_args(self, args=None, namespace=None):
        """argparse's, and a command's parser names the flag a mistyped one was meant to be (`--sec` -> `--seconds`)."""
        namespace, extras = super().parse_known_args(args, namespace)
        if self._subparsers is None:  # a command's own parser: it knows its flags
            flags = [flag for flag in self._option_string_actions if flag.startswith("--")]
            for extra in (extra.partition("=")[0] for extra in extras if extra.startswith("--")):
                close = [flag for flag in flags if flag.startswith(extra)] or difflib.get_close_matches(
                    extra, flags, n=1
                )
                if close:
                    raise UsageError(f"unrecognized argument {extra}: did you mean {' or '.join(sorted(close))}?")
        return namespace, extras


def prompt_at(text: str) -> tuple[int, str]:
    try:
        return parse_prompt_switch(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def step_list(text: str) -> list[int]:
    try:
        return parse_step_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive(kind, maximum: float = math.inf):
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


def window_frames(text: str) -> int | str:
    """A number of latent frames, or the one spelling of an unbounded window (`ALL_FRAMES`)."""
    if text == ALL_FRAMES:
        return ALL_FRAMES
    try:
        return positive(int)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected an int > 0 or {ALL_FRAMES!r}, got {text!r}") from None


window_frames.__name__ = "window"  # argparse names the type in its messages


def quality(text: str) -> float:
    from ..pipelines.io.video_writer import check_quality

    try:
        return check_quality(float(text))  # the writer's own range
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number from 1 to 10, got {text!r}") from None


def non_negative_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0, got {text!r}")
    return value


def seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**64 - 1], got {text!r}")
    return value


def compile_backend(text: str) -> str:
    import torch

    if text not in torch._dynamo.list_backends(exclude_tags=()):  # noqa: SLF001 (dynamo's backend registry)
        usual = sorted({*torch._dynamo.list_backends(), "eager"})  # noqa: SLF001
        raise argparse.ArgumentTypeError(f"expected a torch.compile backend such as {', '.join(usual)}; got {text!r}")
    return text


def device_name(text: str) -> str:
    import torch

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


def add_address_arguments(parser: argparse.ArgumentParser, port: int) -> None:
    """`--host` and `--port` of a command that serves (`check_address_flags` checks them)."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=port, help=f"port, 1 to 65535 (default {port})")


def check_address_flags(args: argparse.Namespace, bind: bool = True) -> None:
    """`rolldiff.demo.check_address` on `--host` / `--port`, its refusal in the flags' words (before the model loads:
    a busy port or a foreign address costs no load)."""
    from ..demo import check_address

    try:
        check_address(args.host, args.port, bind=bind)
    except ValueError as exc:
        raise UsageError(str(exc).replace("`host`", "--host").replace("`port`", "--port")) from None


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="pipeline folder or Hugging Face Hub id (default: the embedded tiny model)")
    parser.add_argument("--device", type=device_name, help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, help="weights dtype (default: bfloat16 on cuda, else float32)")


def add_compile_and_decoder_arguments(parser) -> None:
    """`--compile` and `--tiny-vae`, offered by every command that loads with `loading.load_from_flags` (which reads
    them)."""
    parser.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        type=compile_backend,
        metavar="BACKEND",
        help="torch.compile the transformer (fullgraph; default backend inductor): two graphs, no recompiles",
    )
    parser.add_argument(
        "--tiny-vae",
        type=Path,
        metavar="PATH",
        help="decode with a tiny autoencoder (TAEHV: taew2_1.pth / .safetensors) instead of the full VAE",
    )


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def add_lora_arguments(parser) -> None:
    """`--lora` and `--lora-scale`, read by `loading.load_from_flags` (fused into the weights after loading)."""
    parser.add_argument(
        "--lora",
        action="append",
        metavar="PATH_OR_ID",
        help="fuse a LoRA into the transformer: a .safetensors file, a folder holding one, or a Hub id; repeat for "
        "several (diffusers' and the original Wan / kohya key names are read)",
    )
    parser.add_argument(
        "--lora-scale",
        action="append",
        type=finite_float,
        metavar="SCALE",
        help="each --lora's weight, in order (default 1.0 each)",
    )


def check_lora_flags(args: argparse.Namespace) -> None:
    """The LoRA flags' rules that need no model: a scale per LoRA, and a LoRA given as a path exists and is a
    safetensors file or a folder (a pickle is never read). Raises `UsageError`."""
    sources, scales = args.lora or [], args.lora_scale or []
    if scales and len(scales) != len(sources):
        raise UsageError(f"--lora-scale: {len(scales)} given for {len(sources)} --lora; give one per --lora, or none")
    for source in sources:
        try:
            check_lora_source(source)
        except ValueError as exc:
            raise UsageError(f"--lora: {exc}") from None


def add_memory_arguments(parser) -> None:
    """`--offload` and `--fp8-storage`: how the weights fit a smaller GPU, read by `loading.load_weights`."""
    parser.add_argument(
        "--offload",
        choices=OFFLOAD_MODES,
        help="keep weights in CPU memory until used: text-encoder (it visits the GPU per prompt; chunks at full "
        "speed), model (each component in turn; the transformer moves every chunk) or blocks (the transformer too, a "
        "block at a time: the least GPU memory, the slowest)",
    )
    parser.add_argument(
        "--fp8-storage",
        action="store_true",
        help="store the transformer's weights in float8, computed in --dtype (diffusers' layerwise casting): half "
        "the memory of bfloat16 weights, any GPU, a slightly different video",
    )


def check_memory_flags(args: argparse.Namespace) -> None:
    """The `--offload` / `--fp8-storage` combinations refused before loading: what cannot be compiled, captured or
    stored twice (the library refuses them too, after the load). Raises `UsageError`."""
    compiler = (
        "--cuda-graphs"
        if getattr(args, "cuda_graphs", False)
        else "--compile"
        if getattr(args, "compile", None)
        else None
    )
    resident = "; --offload text-encoder keeps the transformer resident, and compiles"
    if compiler and args.offload in ("model", "blocks"):
        raise UsageError(
            f"--offload {args.offload} and {compiler}: hooks move the weights at each call, which torch.compile cannot "
            f"trace and a CUDA graph cannot replay; drop one{resident}"
        )
    if compiler and args.fp8_storage:
        raise UsageError(
            f"--fp8-storage and {compiler}: hooks cast the weights at each call, which torch.compile cannot trace; drop "
            "one (--fp8 is float8 that compiles, on sm 8.9+)"
        )
    if args.fp8_storage and getattr(args, "fp8", False):
        raise UsageError("--fp8-storage and --fp8: two ways to float8 weights (torchao's --fp8 quantizes the bfloat16 "
                         "ones); drop one")  # fmt: skip


def add_recipe_argument(parser, help: str) -> None:
    """`--recipe NAME`, one of `rolldiff.recipes`, the names listed once in its help (as choices they would fill the
    usage line)."""
    names = list_recipes()
    parser.add_argument("--recipe", choices=names, metavar="NAME", help=f"{help}: {', '.join(names)}")


# The library's argument names and the flags that set them: a library error is relabelled with the flag (the
# rule itself is checked once, by the library).
FLAGS = {
    "prompt": "--prompt",
    "prompt_schedule": "--prompt-at",
    "scene_cuts": "--cut-at",
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

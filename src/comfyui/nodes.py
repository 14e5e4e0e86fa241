"""rolldiff's ComfyUI nodes, in ComfyUI's classic node API (`INPUT_TYPES`, `RETURN_TYPES`, `FUNCTION`), which every
ComfyUI release loads:

- `RolldiffLoadPipeline`: an embedded model, a pipeline folder (`rolldiff convert`, `save_pretrained`) or a Hub id,
  loaded once with its device, dtype, offload, float8 storage and LoRA; the video nodes take its output.
- `RolldiffVideo`: a video as an IMAGE batch `(frames, height, width, 3)` in [0, 1] and its frame rate, for Create
  Video + Save Video or any node that takes images. From text, a start image or an input video's frames (IMAGE
  batches), with prompt switches at chosen frames.
- `RolldiffVideoToFile`: the same video written into an mp4 in ComfyUI's output folder chunk by chunk, in constant
  memory: an hour of video never sits in RAM as images. Cancel keeps the frames made, and `resume` continues them.

Inputs carry the library's argument names, so the library's checks (every input checked before the first chunk)
name the input at fault; `seconds` sets `num_frames` (rounded up to whole chunks) as the command line's flag does.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..choices import DEFAULT_MODEL_NAME, DEFAULT_STRENGTH, DTYPE_NAMES, EMBEDDED_MODEL_NAMES, OFFLOAD_MODES
from ..recipes import list_recipes
from ..text_forms import parse_frame_list, parse_prompt_switch, parse_step_list
from . import host

PIPELINE = "ROLLDIFF_PIPELINE"  # the link type from the loader to the video nodes
CATEGORY = "rolldiff"
AUTO, NO_OFFLOAD = "auto", "none"
# Library argument -> the node input that sets it, where the two differ.
INPUT_NAMES = {"num_frames": "seconds", "path": "filename_prefix"}
# ... and with a `story`, which sets the schedule and its cuts.
STORY_INPUT_NAMES = {**INPUT_NAMES, "prompt_schedule": "story", "scene_cuts": "story"}


def relabel(error: Exception, names: dict[str, str] = INPUT_NAMES) -> ValueError:
    """The library's message with an argument that a differently named input sets shown as that input."""
    message = str(error).replace("--model", "`model`")  # the loader's messages speak of the command line's flag
    for argument, name in names.items():
        message = message.replace(f"`{argument}`", f"`{name}` (`{argument}`)")
    return ValueError(message)


# ---------------------------------------------------------------------------------------- loading
class RolldiffLoadPipeline:
    """Loads a rolldiff video pipeline once; every video node connected to it shares its weights."""

    DESCRIPTION = "Load a rolldiff video pipeline: an embedded model, a pipeline folder or a Hub id."
    RETURN_TYPES = (PIPELINE,)
    RETURN_NAMES = ("pipeline",)
    FUNCTION = "load"
    CATEGORY = CATEGORY

    @classmethod
    def INPUT_TYPES(cls) -> dict:  # noqa: N802 (ComfyUI's name)
        embedded = ", ".join(EMBEDDED_MODEL_NAMES)
        return {
            "required": {
                "model": (
                    "STRING",
                    {
                        "default": DEFAULT_MODEL_NAME,
                        "tooltip": f"an embedded model ({embedded}), a pipeline folder (rolldiff convert) or a Hub id",
                    },
                ),
                "device": ("STRING", {"default": AUTO, "tooltip": "auto: ComfyUI's device; or cuda, cuda:1, cpu"}),
                "dtype": ([AUTO, *DTYPE_NAMES], {"default": AUTO, "tooltip": "auto: bfloat16 on GPUs, else float32"}),
                "offload": (
                    [NO_OFFLOAD, *OFFLOAD_MODES],
                    {"default": NO_OFFLOAD, "tooltip": "weights kept in CPU memory until used (docs/memory.md)"},
                ),
                "fp8_storage": ("BOOLEAN", {"default": False, "tooltip": "transformer weights stored in float8"}),
            },
            "optional": {
                "lora": (
                    "STRING",
                    {
                        "default": "",
                        "tooltip": "a LoRA fused into the weights: a file in models/loras, a path or a Hub id",
                    },
                ),
                "lora_scale": ("FLOAT", {"default": 1.0, "min": -4.0, "max": 4.0, "step": 0.05}),
            },
        }

    def load(
        self,
        model: str,
        device: str,
        dtype: str,
        offload: str,
        fp8_storage: bool,
        lora: str = "",
        lora_scale: float = 1.0,
    ) -> tuple[Any]:
        from ..checks import ModelNotFoundError
        from ..defaults import default_dtype, load_pipeline
        from ..pipelines import ChunkedVideoPipeline
        from ..pipelines.lora import fuse_loras
        from ..pipelines.memory import loading_device, place_weights

        device = _device(device)
        placement = dict(fp8_storage=fp8_storage, offload=None if offload == NO_OFFLOAD else offload)
        try:
            pipe = load_pipeline(
                model.strip(),
                device=loading_device(device, **placement),
                dtype=default_dtype(device) if dtype == AUTO else dtype,
            )
        except ModelNotFoundError as exc:
            raise relabel(exc) from exc
        if not isinstance(pipe, ChunkedVideoPipeline):
            raise ValueError(
                f"`model`: {model!r} is a {type(pipe).__name__}; the rolldiff video nodes take a video pipeline "
                "(KreaRealtimeVideoPipeline or LongSanaVideoPipeline)."
            )
        if lora.strip():
            try:
                fuse_loras(pipe, [host.lora_path(lora.strip())], [lora_scale])
            except ValueError as exc:
                raise ValueError(f"`lora`: {exc}") from exc
        place_weights(pipe, device, **placement)
        pipe.set_progress_bar_config(disable=True)  # the node's own bar counts frames
        return (pipe,)


def _device(device: str) -> str:
    """`auto` as ComfyUI's device, anything else checked as a torch device before the weights load."""
    device = device.strip()
    if device == AUTO:
        return host.default_device()
    try:
        return str(torch.device(device))
    except RuntimeError:
        raise ValueError(f"`device`: {device!r} is not a device; use auto, cuda, cuda:N, cpu or mps.") from None


# ---------------------------------------------------------------------------------------- generating
def video_inputs() -> dict:
    """The inputs both video nodes take: the pipeline, what to make and how long, and the optional inputs."""
    return {
        "required": {
            "pipeline": (PIPELINE,),
            "prompt": ("STRING", {"multiline": True, "default": "a red circle moving left"}),
            "seconds": (
                "FLOAT",
                {"default": 3.0, "min": 0.1, "max": 86400.0, "step": 0.1, "tooltip": "rounded up to whole chunks"},
            ),
            "fps": ("INT", {"default": 16, "min": 1, "max": 120}),
            "seed": ("INT", {"default": 0, "min": 0, "max": 2**64 - 1}),
            "recipe": (
                [AUTO, *list_recipes()],
                {"default": AUTO, "tooltip": "the checkpoint authors' settings; auto: the folder's own"},
            ),
            "width": ("INT", {"default": 0, "min": 0, "max": 4096, "step": 16, "tooltip": "0: the model's own"}),
            "height": ("INT", {"default": 0, "min": 0, "max": 4096, "step": 16, "tooltip": "0: the model's own"}),
        },
        "optional": {
            "prompt_schedule": (
                "STRING",
                {"multiline": True, "default": "", "tooltip": "prompt switches, one per line: FRAME:TEXT"},
            ),
            "scene_cuts": (
                "STRING",
                {
                    "default": "",
                    "tooltip": "frames of prompt_schedule lines that are hard cuts, e.g. 48,96 (needs the "
                    "relative position mode, e.g. recipe infinity-rope)",
                },
            ),  # fmt: skip
            "story": (
                "STRING",
                {
                    "multiline": True,
                    "default": "",
                    "tooltip": "a whole multi-scene video in Infinity-RoPE's syntax, SCENE[5s#] | SCENE[10s] ; "
                    "SUBTITLE | SUBTITLE (# in the brackets: a hard cut after that scene): replaces prompt, "
                    "prompt_schedule and scene_cuts; the video lasts the story (seconds, when a scene has no "
                    "length); subtitles are drawn in",
                },
            ),  # fmt: skip
            "denoising_steps": ("STRING", {"default": "", "tooltip": "e.g. 1000,750,500,250; empty: the recipe's"}),
            "image": ("IMAGE", {"tooltip": "a start frame (image-to-video)"}),
            "video": ("IMAGE", {"tooltip": "an input video's frames (video-to-video)"}),
            "strength": (
                "FLOAT",
                {"default": DEFAULT_STRENGTH, "min": 0.01, "max": 1.0, "step": 0.01, "tooltip": "with video"},
            ),
        },
    }


def open_stream(
    pipeline,
    prompt: str,
    seconds: float,
    fps: int,
    seed: int,
    recipe: str,
    width: int,
    height: int,
    **optional: Any,
) -> tuple[Any, Callable[[np.ndarray, int], np.ndarray] | None]:
    """The pipeline's `ChunkStream` for the nodes' inputs, every input checked (nothing has run yet), and what draws
    a story's subtitles on its frames (None: nothing to draw)."""
    from ..defaults import native_size
    from ..pipelines.io.subtitles import subtitle_overlay

    story = optional.pop("story", "")
    call = _call_arguments(prompt, recipe, **optional)
    native_height, native_width = native_size(pipeline)
    parsed = None
    try:
        parsed = _story(story, call)
        if parsed is None or parsed.seconds is None:  # no story, or a scene without a length: `seconds` long
            call["num_frames"] = pipeline.num_frames_for(seconds, fps, **call)
        if parsed is not None:
            call = parsed.arguments(pipeline, fps, **call)
        generator = torch.Generator("cpu").manual_seed(seed)
        stream = pipeline.stream(
            height=height or native_height, width=width or native_width, generator=generator, **call
        )
    except (ValueError, TypeError) as exc:
        raise relabel(exc, INPUT_NAMES if parsed is None else STORY_INPUT_NAMES) from exc
    return stream, None if parsed is None else subtitle_overlay(parsed.subtitle_spans(fps))


def _story(text: str, call: dict):
    """The `story` input parsed, or None when empty; it stands in for `prompt` (then unused), and the schedule inputs
    must be empty (`check_story_call`, the library's rule)."""
    from ..story import check_story_call, parse_story

    if not text.strip():
        return None
    call["prompt"] = None
    check_story_call(call)
    return parse_story(text)


def _call_arguments(
    prompt: str,
    recipe: str,
    prompt_schedule: str = "",
    scene_cuts: str = "",
    denoising_steps: str = "",
    image: torch.Tensor | None = None,
    video: torch.Tensor | None = None,
    strength: float = DEFAULT_STRENGTH,
) -> dict:
    """The `pipe.stream` arguments the text and IMAGE inputs stand for."""
    return dict(
        prompt=prompt if prompt.strip() else None,  # empty: the schedule's frame-0 line is the prompt
        prompt_schedule=_prompt_schedule(prompt_schedule),
        scene_cuts=_int_list("scene_cuts", scene_cuts, parse_frame_list),
        denoising_steps=_int_list("denoising_steps", denoising_steps, parse_step_list),
        recipe=None if recipe == AUTO else recipe,
        image=_start_image(image),
        video=None if video is None else video.detach().cpu().float().numpy(),  # (frames, height, width, 3)
        strength=None if video is None else strength,
    )


def _prompt_schedule(text: str) -> list[tuple[int, str]] | None:
    """`FRAME:TEXT` per line (blank lines skipped), sorted by frame; a bad line is named by its number."""
    switches = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            switches.append(parse_prompt_switch(line))
        except ValueError as exc:
            raise ValueError(f"`prompt_schedule` line {number}: {exc}") from None
    return sorted(switches) or None


def _int_list(name: str, text: str, parse) -> list[int] | None:
    """A comma-separated input (`parse`: its text form), None when empty; a bad one named by `name`."""
    if not text.strip():
        return None
    try:
        return parse(text)
    except ValueError as exc:
        raise ValueError(f"`{name}`: {exc}") from None


def _start_image(image: torch.Tensor | None):
    """ComfyUI's IMAGE `(1, height, width, 3)` as the `(height, width, 3)` picture the pipeline takes."""
    if image is None:
        return None
    if image.ndim != 4 or image.shape[0] != 1:
        raise ValueError(f"`image`: connect one picture (an IMAGE batch of 1), got shape {tuple(image.shape)}.")
    return image[0].detach().cpu().float().numpy()


class RolldiffVideo:
    """Generates a video chunk by chunk and returns its frames as ComfyUI images."""

    DESCRIPTION = "A rolldiff video as images (frames, height, width, 3) and its frame rate; long ones: Video to File."
    RETURN_TYPES = ("IMAGE", "FLOAT")
    RETURN_NAMES = ("frames", "fps")
    FUNCTION = "generate"
    CATEGORY = CATEGORY

    @classmethod
    def INPUT_TYPES(cls) -> dict:  # noqa: N802 (ComfyUI's name)
        return video_inputs()

    def generate(self, pipeline, **inputs: Any) -> tuple[torch.Tensor, float]:
        stream, overlay = open_stream(pipeline, **inputs)
        total = stream.request.geometry.num_frames
        progress = host.Progress(total)
        video, made = None, 0  # the IMAGE batch, filled in place: no second copy of the video at the end
        try:
            for frames in stream:  # (1, chunk frames, height, width, 3) float32 in [0, 1]
                if video is None:
                    video = torch.empty((total, *frames.shape[2:]), dtype=torch.float32)
                video[made : made + frames.shape[1]] = torch.from_numpy(_drawn(frames[0], made, overlay))
                made += frames.shape[1]
                progress.frames_done(made)
                host.check_interrupted()
        finally:
            stream.close()
        return video[:made], float(inputs["fps"])  # an input video may end before `seconds`


def _drawn(frames: np.ndarray, first_frame: int, overlay) -> np.ndarray:
    """`frames` (float in [0, 1]) with the subtitles drawn on those they cover; the others untouched."""
    if overlay is None:
        return frames
    pixels = (frames * 255.0).round().clip(0, 255).astype(np.uint8)
    drawn = overlay(pixels, first_frame)
    changed = (drawn != pixels).any(axis=(1, 2, 3))
    frames = frames.copy()
    frames[changed] = drawn[changed].astype(np.float32) / 255.0
    return frames


class RolldiffVideoToFile:
    """Writes a video straight into an mp4 in ComfyUI's output folder, in constant memory, resumable."""

    DESCRIPTION = "A rolldiff video written to an mp4 as it is made: constant memory for any length; resumable."
    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("path",)
    FUNCTION = "write"
    OUTPUT_NODE = True
    CATEGORY = CATEGORY

    @classmethod
    def INPUT_TYPES(cls) -> dict:  # noqa: N802 (ComfyUI's name)
        inputs = video_inputs()
        inputs["required"]["filename_prefix"] = ("STRING", {"default": "rolldiff/video"})
        inputs["required"]["quality"] = (
            "INT",
            {"default": 5, "min": 1, "max": 10, "tooltip": "the encoder's: 1 smallest file, 10 lossless"},
        )
        inputs["required"]["resume"] = (
            "BOOLEAN",
            {"default": True, "tooltip": "continue the last video of this prefix that was cancelled or failed"},
        )
        return inputs

    def write(self, pipeline, filename_prefix: str, quality: int, resume: bool, **inputs: Any) -> dict:
        from ..pipelines.io.resume import write_video

        folder = host.output_folder()
        path = output_path(folder, filename_prefix, resume)
        stream, overlay = open_stream(pipeline, **inputs)
        total = stream.request.geometry.num_frames
        progress = host.Progress(total)

        def after_chunk(frames_written: int) -> None:
            progress.frames_done(frames_written)
            if frames_written < total:  # Cancel stops before the next chunk; the frames made stay resumable
                host.check_interrupted()

        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            write_video(
                stream, path, inputs["fps"], resume=resume, quality=quality, on_chunk=after_chunk, overlay=overlay
            )
        except ValueError as exc:  # a saved state that does not fit these inputs, named by the library
            raise relabel(exc) from exc
        saved = {"filename": path.name, "subfolder": path.parent.relative_to(folder).as_posix(), "type": "output"}
        return {"ui": {"images": [saved], "animated": (True,)}, "result": (str(path),)}


def output_path(folder: Path, prefix: str, resume: bool) -> Path:
    """`folder/prefix_00001.mp4`, numbered like ComfyUI's own saves: the next free number, or with `resume` the last
    one a cancelled or failed run left a resume state for. The prefix must stay inside `folder`."""
    from ..pipelines.io.resume import state_path_for

    folder = folder.resolve()
    target = (folder / prefix.strip()).resolve()
    if not prefix.strip() or folder not in target.parents:
        raise ValueError(f"`filename_prefix` must name a file inside ComfyUI's output folder, got {prefix!r}.")
    numbered = re.compile(rf"{re.escape(target.name)}_(\d{{5}})\.")
    taken = sorted(
        int(match.group(1))
        for entry in (target.parent.iterdir() if target.parent.is_dir() else ())
        if (match := numbered.match(entry.name))
    )

    def path_for(number: int) -> Path:
        return target.parent / f"{target.name}_{number:05d}.mp4"

    if resume:
        unfinished = [number for number in taken if state_path_for(path_for(number)).exists()]
        if unfinished:
            return path_for(unfinished[-1])
    return path_for(taken[-1] + 1 if taken else 1)

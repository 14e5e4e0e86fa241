"""Resumable long runs: the state of a generation at a chunk boundary, in one safetensors file beside the video.

What a stream needs to continue exactly where it stopped, so the resumed video equals an uninterrupted one:
- every stream cache layer's buffers and host-side counters (`capture_module`); the cross-attention K/V are
  not saved, they are recomputed from the prompt on resume;
- the streaming VAE decoder's feature cache (`capture_object`);
- the random generators' states (`capture_generators`);
- where the loop is: next chunk, active prompt, frames written, callback step, plus the latents a later
  re-cache needs; and a fingerprint of the run's arguments, so a resume with other arguments is refused.

Tensors go into the safetensors file, everything else into JSON in its header metadata: nothing is pickled and
loading runs no code. The file (`video.mp4` -> `video.resume.safetensors`) is written under a temporary name and
renamed, so a kill during a save leaves the previous state whole.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

STATE_FORMAT = "rolldiff-resume-1"
_METADATA_KEY = "rolldiff_state"
# Host-side values saved as JSON: counters, flags, shapes, and (decoder) the "Rep" markers of its feature cache.
_JSON_TYPES = (bool, int, float, str, type(None))


class ResumeError(ValueError):
    """A state file that cannot continue this run: missing, from other arguments, or not matching the partial."""


def state_path_for(path: str | os.PathLike) -> Path:
    """Where the resume state of a video is kept: `video.mp4` -> `video.resume.safetensors`."""
    path = Path(path)
    return path.with_name(f"{path.stem}.resume.safetensors")


def _is_json_value(value: Any) -> bool:
    if isinstance(value, _JSON_TYPES):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_json_value(item) for item in value)
    return False


# ---------------------------------------------------------------------------------------- capture / restore
def capture_object(obj: Any, prefix: str, skip: Iterable[str] = ()) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors and JSON-able attributes of `obj` (lists of tensors, as the decoder's feature cache, included).

    Returns `(tensors named "{prefix}.{attribute}[.{index}]", {attribute: value or a list description})`.
    Attributes of other types (modules, weak references, events, workspaces) are not state and are skipped.
    """
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    for name, value in vars(obj).items():
        if name in skip or name in ("_parameters", "_modules", "training") or name.startswith("_forward"):
            continue
        if name == "_buffers":
            for buffer_name, buffer in value.items():
                if buffer is not None:
                    tensors[f"{prefix}.{buffer_name}"] = buffer
            values["_buffer_names"] = sorted(b for b, t in value.items() if t is not None)
            continue
        if isinstance(value, torch.Tensor):
            tensors[f"{prefix}.{name}"] = value
            values[name] = {"tensor": True}
        elif isinstance(value, list) and value and any(isinstance(item, torch.Tensor) for item in value):
            kinds = []
            for index, item in enumerate(value):
                if isinstance(item, torch.Tensor):
                    tensors[f"{prefix}.{name}.{index}"] = item
                    kinds.append({"tensor": True})
                elif _is_json_value(item):
                    kinds.append({"value": item})
                else:
                    raise TypeError(f"Cannot save {prefix}.{name}[{index}] of type {type(item).__name__}.")
            values[name] = {"list": kinds}
        elif _is_json_value(value):
            values[name] = {
                "value": list(value) if isinstance(value, tuple) else value,
                "tuple": isinstance(value, tuple),
            }
    return tensors, values


def restore_object(obj: Any, prefix: str, tensors: Mapping[str, torch.Tensor], values: Mapping[str, Any]) -> None:
    """Put back what `capture_object` saved. A tensor attribute of the same shape and dtype is copied into in place
    (compiled graphs and other holders keep pointing at it); otherwise the loaded tensor is moved to the device
    the attribute lives on (or the first tensor's device) and assigned."""
    device = _device_of(obj)
    for name in values.get("_buffer_names", []):
        _assign(obj, name, tensors[f"{prefix}.{name}"], device, buffer=True)
    for name, saved in values.items():
        if name == "_buffer_names":
            continue
        if "tensor" in saved:
            _assign(obj, name, tensors[f"{prefix}.{name}"], device)
        elif "list" in saved:
            current = getattr(obj, name, None)
            items = []
            for index, kind in enumerate(saved["list"]):
                if "tensor" in kind:
                    loaded = tensors[f"{prefix}.{name}.{index}"]
                    old = current[index] if isinstance(current, list) and index < len(current) else None
                    items.append(loaded.to(old.device if isinstance(old, torch.Tensor) else device))
                else:
                    items.append(kind["value"])
            setattr(obj, name, items)
        else:
            setattr(obj, name, tuple(saved["value"]) if saved.get("tuple") else saved["value"])


def _device_of(obj: Any) -> torch.device:
    if isinstance(obj, nn.Module):
        for tensor in [*obj.buffers(), *obj.parameters()]:
            return tensor.device
    for value in vars(obj).values():
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


def _assign(obj: Any, name: str, loaded: torch.Tensor, device: torch.device, buffer: bool = False) -> None:
    current = getattr(obj, name, None)
    if isinstance(current, torch.Tensor) and current.shape == loaded.shape and current.dtype == loaded.dtype:
        current.copy_(loaded)
        return
    target = current.device if isinstance(current, torch.Tensor) else device
    if buffer and isinstance(obj, nn.Module):
        obj.register_buffer(name, loaded.to(target), persistent=name in obj.state_dict())
    else:
        setattr(obj, name, loaded.to(target))


def capture_module(module: nn.Module, prefix: str, skip_types: tuple[type, ...] = ()) -> tuple[dict, dict]:
    """`capture_object` of every submodule of `module` (a cache: its layers), keyed by submodule name."""
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    for name, sub in module.named_modules():
        if skip_types and isinstance(sub, skip_types):
            continue
        sub_tensors, sub_values = capture_object(sub, f"{prefix}.{name or '_root'}")
        tensors.update(sub_tensors)
        values[name or "_root"] = sub_values
    return tensors, values


def restore_module(module: nn.Module, prefix: str, tensors: Mapping[str, torch.Tensor], values: Mapping) -> None:
    """Put back what `capture_module` saved into a module built the same way (the same layout and sizes)."""
    modules = dict(module.named_modules())
    missing = [name for name in values if (modules.get("" if name == "_root" else name) is None)]
    if missing:
        raise ResumeError(
            f"The saved cache has parts this cache does not: {missing[:5]}; it was made by another model."
        )
    for name, sub_values in values.items():
        restore_object(modules["" if name == "_root" else name], f"{prefix}.{name}", tensors, sub_values)


def capture_generators(generators: torch.Generator | list[torch.Generator] | None) -> dict[str, torch.Tensor]:
    """Each generator's state (a CPU uint8 tensor, also for CUDA generators)."""
    if generators is None:
        return {}
    generators = generators if isinstance(generators, list) else [generators]
    return {f"generator.{i}": g.get_state() for i, g in enumerate(generators)}


def restore_generators(generators, tensors: Mapping[str, torch.Tensor]) -> None:
    if generators is None:
        return
    generators = generators if isinstance(generators, list) else [generators]
    saved = sorted(name for name in tensors if name.startswith("generator."))
    if len(saved) != len(generators):
        raise ResumeError(f"The state holds {len(saved)} generator state(s); this run passes {len(generators)}.")
    for i, generator in enumerate(generators):
        generator.set_state(tensors[f"generator.{i}"])


# ---------------------------------------------------------------------------------------- the file
@dataclass
class RunState:
    """The loop's position and everything saved with it; `tensors` and `parts` come back as they were captured."""

    fingerprint: dict
    next_chunk: int
    frames_written: int
    values: dict = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def save_state(path: str | os.PathLike, state: RunState) -> None:
    """Write `state` to `path` atomically (temporary file in the same folder, then rename)."""
    path = Path(path)
    header = {
        "format": STATE_FORMAT,
        "fingerprint": state.fingerprint,
        "next_chunk": state.next_chunk,
        "frames_written": state.frames_written,
        "values": state.values,
    }
    # safetensors stores contiguous CPU tensors; shared storage (views of one buffer) is written once per name.
    tensors = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in state.tensors.items()}
    temp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(temp), metadata={_METADATA_KEY: json.dumps(header)})
    os.replace(temp, path)


def load_state(path: str | os.PathLike) -> RunState:
    """Read a state written by `save_state`; raises ResumeError if it is not one."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as file:
            header = json.loads((file.metadata() or {}).get(_METADATA_KEY, "null"))
            tensors = {name: file.get_tensor(name) for name in file.keys()}
    except (OSError, ValueError) as error:  # safetensors raises SafetensorError (a ValueError subclass) or OSError
        raise ResumeError(f"{str(path)!r} is not a readable resume state: {error}") from None
    if not isinstance(header, dict) or header.get("format") != STATE_FORMAT:
        raise ResumeError(f"{str(path)!r} is not a rolldiff resume state (format {STATE_FORMAT}).")
    return RunState(
        fingerprint=header["fingerprint"],
        next_chunk=header["next_chunk"],
        frames_written=header["frames_written"],
        values=header["values"],
        tensors=tensors,
    )


def check_fingerprint(saved: dict, current: dict, path: str | os.PathLike) -> None:
    """Refuse to resume a run whose arguments differ from the saved one's, naming each difference."""
    differences = [
        f"{name}: saved {saved.get(name)!r}, now {current.get(name)!r}"
        for name in sorted(set(saved) | set(current))
        if saved.get(name) != current.get(name)
    ]
    if differences:
        raise ResumeError(
            f"Cannot resume from {str(path)!r}: it was saved by a run with other arguments ({'; '.join(differences)}). "
            "Pass the same arguments, or delete the state file to start over."
        )


# ---------------------------------------------------------------------------------------- a resumable video file
def _cache_modules_to_skip() -> tuple[type, ...]:
    """Scratch that is not state: the shared workspace (refilled every step)."""
    try:
        from ..caching.workspace import CacheWorkspace
    except ImportError:  # older cache package without a shared workspace
        return ()
    return (CacheWorkspace,)


def _capture_cache(cache: nn.Module, prefix: str) -> tuple[dict, dict]:
    """A cache's stream layers (self-attention, slots); the cross-attention K/V are refilled from the prompt."""
    tensors, values = capture_module(cache, prefix, skip_types=_cache_modules_to_skip())
    cross = [name for name in values if name.startswith("_cross_modules")]
    for name in cross:
        del values[name]
    tensors = {k: v for k, v in tensors.items() if not k.startswith(f"{prefix}._cross_modules")}
    return tensors, values


def _default_generator(device: torch.device) -> torch.Generator:
    """The generator `randn_tensor` draws from when the call passes none."""
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index or 0]
    return torch.default_generator


def run_fingerprint(pipe, run, fps, generator, latents, quality: float = 5) -> dict:
    """What makes two runs the same video: the checked arguments, the model and the output's rate and encoding
    (parts encoded at different qualities may differ in H.264 profile and cannot be joined by stream copy)."""
    transformer = {k: v for k, v in dict(pipe.transformer.config).items() if not k.startswith("_")}
    return json.loads(
        json.dumps(
            {
                "model": str(getattr(pipe, "name_or_path", "") or ""),
                "transformer": transformer,
                "dtype": str(pipe.transformer.dtype),
                "schedule": [[frame, list(prompts)] for frame, prompts in run.schedule.entries],
                "negative_prompt": run.negative_prompt,
                "num_latent_frames": run.num_latent_frames,
                "chunk_shape": list(run.chunk_shape),
                "denoising_steps": run.denoising_steps,
                "guidance_scale": run.guidance_scale,
                "max_sequence_length": run.max_sequence_length,
                "options": run.options,
                "fps": float(fps),
                "quality": float(quality),
                "seeded": generator is not None,
                "latents": None if latents is None else float(latents.double().sum()),
                "prompt_embeds": run.prompt_embeds is not None,
            },
            default=str,
        )
    )


def write_video(
    pipe,
    path: str | os.PathLike,
    prompt=None,
    fps: float = 16,
    *,
    resume: bool = False,
    state_every_s: float = 60.0,
    quality: float = 5,
    **kwargs: Any,
) -> int:
    """`pipe.generate_to_file`: stream a video into `path`, saving a resume state after the first chunk and then
    at most every `state_every_s` seconds (at chunk boundaries; 0: after every chunk).

    Every argument is checked first, and with `resume=True` the saved state too (same arguments, the partial
    file holds the frames it vouches for), before any model work. A failed or interrupted run leaves `path` as
    it was, the frames done in `video.partial.mp4` and the last state in `video.resume.safetensors`; success
    removes both. Returns the frames in the finished file.

    Encoding is causal (see `StreamingVideoWriter`), so the frames kept from the partial are bit for bit those of an
    uninterrupted run; the continuation starts a new key frame, so with lossy `quality` (< 10) its frames match the
    uninterrupted run's to the encoder's precision, and exactly at `quality=10` (lossless).
    """
    from .chunked_video import StreamState
    from .video_writer import StreamingVideoWriter, check_output_path, check_quality, count_frames, partial_path_for

    path = check_output_path(path)
    quality = check_quality(quality)
    if isinstance(state_every_s, bool) or not isinstance(state_every_s, (int, float)) or not state_every_s >= 0:
        raise ValueError(f"`state_every_s` must be a number of seconds >= 0 (0: every chunk), got {state_every_s!r}.")
    if kwargs.get("output_type", "np") != "np":
        raise ValueError("`output_type`: `generate_to_file` writes frames itself; do not pass it.")
    kwargs["output_type"] = "np"
    holder = StreamState()
    chunks = pipe.stream(prompt, state=holder, **kwargs)  # checks every argument before any work
    run = holder.run
    if run.batch_size != 1:
        raise ValueError(f"`prompt`: `generate_to_file` writes one video; got a batch of {run.batch_size}.")
    generator = kwargs.get("generator")
    state_path, partial = state_path_for(path), partial_path_for(path)
    fingerprint = run_fingerprint(pipe, run, fps, generator, kwargs.get("latents"), quality)
    continue_frames = None
    if resume and state_path.exists():
        saved = load_state(state_path)
        check_fingerprint(saved.fingerprint, fingerprint, state_path)
        if not partial.is_file() or count_frames(partial) < saved.frames_written:
            raise ResumeError(
                f"Cannot resume: {str(state_path)!r} continues after frame {saved.frames_written}, but the partial "
                f"video {str(partial)!r} is missing or shorter. Delete the state file to start over."
            )
        continue_frames = saved.frames_written
        holder.on_start = lambda state, run: _restore(pipe, state, run, saved, generator)
    elif resume and partial.exists():
        warnings.warn(
            f"`resume`: {str(partial)!r} has no saved state beside it ({state_path.name}); starting from the first "
            "chunk (the partial is replaced when this run ends).",
            stacklevel=3,
        )

    writer = StreamingVideoWriter(
        path,
        fps=fps,
        quality=quality,
        continue_from=partial if continue_frames is not None else None,
        continue_frames=continue_frames,
    )
    with writer:
        last_save = -math.inf  # the first state right after the first chunk, then at most every `state_every_s`
        for frames in chunks:  # (1, frames, height, width, 3) in [0, 1]
            writer.write((frames[0] * 255.0).round().clip(0, 255).astype(np.uint8))
            more_to_come = holder.next_chunk < run.num_chunks
            if more_to_come and time.monotonic() - last_save >= state_every_s:
                save_state(state_path, _capture(pipe, holder, generator, fingerprint, writer.total_frames))
                last_save = time.monotonic()
    state_path.unlink(missing_ok=True)
    partial.unlink(missing_ok=True)  # joined into `path` when this run continued it
    return writer.total_frames


def _generators(pipe, generator) -> list[torch.Generator]:
    if generator is None:
        return [_default_generator(pipe._execution_device)]
    return generator if isinstance(generator, list) else [generator]


def _capture(pipe, state, generator, fingerprint: dict, frames_written: int) -> RunState:
    """Everything `state` needs to go on from its next chunk, with the video's frame count."""
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {"active_prompt": state.active_prompt, "caches": []}
    for index, cache in enumerate(state.caches):
        cache_tensors, cache_values = _capture_cache(cache, f"cache{index}")
        tensors.update(cache_tensors)
        values["caches"].append(cache_values)
    if state.decoder is not None:
        decoder_tensors, values["decoder"] = capture_object(state.decoder, "decoder", skip=("vae",))
        tensors.update(decoder_tensors)
    if state.recent is not None:
        tensors["recent"] = state.recent
    tensors.update(capture_generators(_generators(pipe, generator)))
    return RunState(fingerprint, state.next_chunk, frames_written, values, tensors)


def _restore(pipe, state, run, saved: RunState, generator) -> None:
    """`StreamState.on_start` of a resumed stream: put back the caches, decoder, position and generators."""
    if len(saved.values["caches"]) != len(state.caches):
        raise ResumeError(f"The state has {len(saved.values['caches'])} cache(s), this run {len(state.caches)}.")
    for index, cache in enumerate(state.caches):
        restore_module(cache, f"cache{index}", saved.tensors, saved.values["caches"][index])
    if state.decoder is not None and "decoder" in saved.values:
        restore_object(state.decoder, "decoder", saved.tensors, saved.values["decoder"])
    if "recent" in saved.tensors:
        state.recent = saved.tensors["recent"].to(device=pipe._execution_device, dtype=pipe.transformer.dtype)
    active = saved.values["active_prompt"]
    if active != state.active_prompt:  # the prompt of the saved chunk: its cross-attention K/V, no re-cache
        state.active_prompt = active
        state.embeds[0] = pipe._branch_embeds(run, active)
        pipe._set_conditioning(state.caches[0], state.embeds[0])
    restore_generators(_generators(pipe, generator), saved.tensors)
    state.next_chunk = saved.next_chunk
